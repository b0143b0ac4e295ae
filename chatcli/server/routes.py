"""The endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions`` (JSON or SSE).

Each is a small function over a ``Routes`` (the service, the limits and what the server tracks of its
running requests); ``app.create_app`` only assembles them. A chat request is admitted (or refused with 503
before its body is read), parsed, run in a worker thread (``bridge.Run``), and answered as one JSON
completion or as a stream (``sse.CompletionStream``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatcli.errors import ChatcliError
from chatcli.server.bridge import END, Run
from chatcli.server.errors import APIError, error_response, from_error
from chatcli.server.schemas import ChatCompletionBody, parse_chat_request
from chatcli.server.service import ChatService, Delta, Finished, Started
from chatcli.server.sse import ChunkEncoder, CompletionStream

log = logging.getLogger("chatcli.server")

CONVERSATION_HEADER = "X-Chatcli-Conversation"
DEFAULT_MAX_BODY = 8 * 1024 * 1024
DEFAULT_MAX_MESSAGES = 2048
# A non-streamed reply waits this long for its end before looking again (text alone never wakes it).
WHOLE_WAIT = 3600.0


@dataclass
class ServerLimits:
    max_body: int = DEFAULT_MAX_BODY
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_queue: int = 16  # chat requests waiting beyond the contexts; more are refused (503) before their body
    retry_after: int = 2  # seconds a refused client is told to wait


@dataclass
class Routes:
    """What the endpoints share: the service, the limits, and the requests in flight. The service is None
    while the model loads (``app.UntilLoaded`` answers every request meanwhile)."""

    _service: ChatService | None
    limits: ServerLimits
    runs: set[Run] = field(default_factory=set)  # requests whose worker is still running
    stopping: threading.Event = field(default_factory=threading.Event)
    admitted: int = 0  # chat requests between arrival and response (the event loop's thread only: no lock)

    @property
    def ready(self) -> bool:
        return self._service is not None

    @property
    def service(self) -> ChatService:
        if self._service is None:  # not reached: the gate answers 503 until loaded
            raise RuntimeError("the model is still loading")
        return self._service

    def loaded(self, service: ChatService) -> None:
        """The model is loaded: from now on requests are served (set from the loading thread: one
        attribute store, which the event loop's next request reads)."""
        self._service = service

    @property
    def capacity(self) -> int:
        return self.service.parallel + self.limits.max_queue

    def stop_requests(self) -> None:
        """Shutting down: every running request stops at its next batch or token (its reply so far is
        recorded), so the server does not wait for whole replies to be generated for nobody."""
        self.stopping.set()
        for run in list(self.runs):
            run.cancel.set()

    # -- endpoints --------------------------------------------------------------------------------------------

    async def health(self, _request: Request) -> Response:
        s = self.service
        return JSONResponse({"status": "ok", "model": s.model_id, "model_name": s.model_name,
                             "conversations_indexed": len(s.index)})

    async def models(self, _request: Request) -> Response:
        s = self.service
        return JSONResponse({"object": "list", "data": [
            {"id": s.model_id, "object": "model", "created": 0, "owned_by": "chatcli", "name": s.model_name}]})

    async def chat_completions(self, request: Request) -> Response:
        rid = "chatcmpl-" + secrets.token_hex(12)
        if self.admitted >= self.capacity:
            # Refused before its body is read: a waiting request holds a thread and its parsed body.
            log.info("%s 503 queue full (%d admitted)", rid, self.admitted)
            return error_response(APIError("unavailable", "the server is busy: retry later"),
                                  {"Retry-After": str(self.limits.retry_after)})
        self.admitted += 1
        try:
            return await self._chat(request, rid)
        finally:
            self.admitted -= 1

    # -- one chat request -------------------------------------------------------------------------------------

    async def _chat(self, request: Request, rid: str) -> Response:
        t0 = time.perf_counter()
        try:
            doc = await read_json(request, self.limits.max_body)
            req, body = parse_chat_request(doc, max_messages=self.limits.max_messages,
                                           header_conversation=request.headers.get(CONVERSATION_HEADER))
        except APIError as bad:
            log.info("%s %d %s", rid, bad.status, bad.message)
            return error_response(bad)
        req.client = request.state.client
        run = Run(self.service, req, self.runs)
        # Until the reply starts; a stream then watches for the disconnect itself (``sse``).
        watcher = asyncio.create_task(_watch_disconnect(request, run.cancel))
        try:
            return await self._respond(run, body, rid, t0)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _respond(self, run: Run, body: ChatCompletionBody, rid: str, t0: float) -> Response:
        first = await run.next()
        if run.cancel.is_set() or first is END:
            # Stopped before its reply started (between batches of its prompt): what was appended is kept.
            return self._stopped(rid, "before its reply started")
        if isinstance(first, ChatcliError):
            err = from_error(first)
            log.info("%s %d %s", rid, err.status, err.message)
            return error_response(err)
        assert isinstance(first, Started)
        headers = {CONVERSATION_HEADER: first.conversation, "X-Request-Id": rid}
        created = int(time.time())
        model = self.service.model_id
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = CompletionStream(run, ChunkEncoder(rid, created, model), headers, rid=rid,
                                      include_usage=include_usage, on_finished=lambda ev, ttft: log_done(rid, ev, ttft),
                                      usage=usage, extension=extension, timings=timings, t0=t0)
            return stream
        return await self._whole(run, rid, created, headers, t0)

    async def _whole(self, run: Run, rid: str, created: int, headers: dict[str, str], t0: float) -> Response:
        """The non-streamed answer: the whole reply in one ``chat.completion``."""
        ttft = 0.0
        while True:
            # After the first token only the end matters (the text comes whole with ``Finished``): the tokens
            # between must not wake the event loop, each wake-up takes a core from the decode threads.
            for ev in await run.take(window=WHOLE_WAIT if ttft else 0.0):
                if type(ev) is Delta:
                    ttft = ttft or time.perf_counter() - t0
                elif isinstance(ev, ChatcliError):
                    err = from_error(ev)
                    log.info("%s %d %s", rid, err.status, err.message)
                    return error_response(err, headers)
                elif ev is END:
                    if run.cancel.is_set():
                        return self._stopped(rid, "mid-reply: reply so far recorded")
                    return error_response(APIError("server_error", "the reply ended without a result"), headers)
                elif isinstance(ev, Finished):
                    log_done(rid, ev, ttft or time.perf_counter() - t0)
                    return JSONResponse({
                        "id": rid, "object": "chat.completion", "created": created, "model": self.service.model_id,
                        "choices": [{"index": 0, "message": message(ev), "finish_reason": ev.finish_reason,
                                     "logprobs": None}],
                        "usage": usage(ev), "timings": timings(ev), "chatcli": extension(ev),
                    }, headers=headers)

    def _stopped(self, rid: str, when: str) -> Response:
        if self.stopping.is_set():
            log.info("%s stopped by the shutdown %s", rid, when)
            return error_response(APIError("unavailable", "the server is shutting down: retry later"))
        log.info("%s client went away %s", rid, when)
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it


async def read_json(request: Request, max_body: int) -> Any:
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype not in ("application/json", ""):
        raise APIError("unsupported_media_type", f"content-type must be application/json, not {ctype}")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise APIError("body_too_large", f"request body too large ({declared} bytes; at most {max_body})")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            raise APIError("body_too_large", f"request body too large (more than {max_body} bytes)")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise APIError("invalid_json", "the request body is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError("invalid_json", f"the request body is not valid JSON ({exc})") from None
    try:
        # JSON may escape a lone UTF-16 surrogate ("\ud800"), which no UTF-8 file or tokenizer can take:
        # refused here, before a conversation is made for it. Encoding the whole body back is the one
        # check that sees every string, keys included.
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError("invalid_json", "the request body holds a lone UTF-16 surrogate (an invalid \\u escape)") from None
    except RecursionError:
        raise APIError("invalid_json", "the request body is nested too deeply") from None
    return doc


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    """Wait for the client to go away (after its body, the only message left is the disconnect) and tell
    the service, which stops even between batches of a long prompt."""
    while True:
        msg = await request.receive()
        if msg.get("type") == "http.disconnect":
            cancel.set()
            return


def usage(ev: Finished) -> dict[str, Any]:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": ev.cached_tokens}}


def timings(ev: Finished) -> dict[str, Any]:
    """llama-server's ``timings`` (tools/server ``server_slot_stats::to_json``): the request's new messages
    as evaluated (``prompt_*``; ``cache_n`` the context's tokens it did not evaluate) and the reply's tokens
    as sampled and decoded (``predicted_*``: from the first token to the last, as llama-server's
    ``t_token_generation`` runs from its first token's sampling; a reply of one token has no such span)."""
    p_ms = 1000 * ev.prompt_seconds
    g_ms = 1000 * (ev.decode_seconds if ev.decode_seconds > 0 else ev.gen_seconds)
    p_n, g_n = ev.prompt_n, ev.completion_tokens
    return {"cache_n": ev.cached_tokens,
            "prompt_n": p_n, "prompt_ms": p_ms, "prompt_per_token_ms": p_ms / p_n if p_n else 0.0,
            "prompt_per_second": 1000 * p_n / p_ms if p_ms > 0 else 0.0,
            "predicted_n": g_n, "predicted_ms": g_ms, "predicted_per_token_ms": g_ms / g_n if g_n else 0.0,
            "predicted_per_second": 1000 * g_n / g_ms if g_ms > 0 else 0.0}


def extension(ev: Finished) -> dict[str, Any]:
    """chatcli's own fields (OpenAI clients ignore unknown fields)."""
    return {"conversation": ev.conversation, "forked_from": ev.forked_from, "evaluated_tokens": ev.evaluated,
            "state_from": ev.state,
            "context_shift": {"messages_dropped": ev.shifted} if ev.shifted else None, "notices": ev.notices}


def log_done(rid: str, ev: Finished, ttft: float) -> None:
    log.info("%s 200 conv=%s prompt=%d cached=%d generated=%d ttft=%.0fms state=%s%s", rid, ev.conversation,
             ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens, 1000 * ttft, ev.state,
             f" forked_from={ev.forked_from}" if ev.forked_from else "")


def message(ev: Finished) -> dict[str, Any]:
    """The reply as an OpenAI message; its reasoning apart, in ``reasoning_content`` (DeepSeek's field,
    which llama-server returns too), only when there is some."""
    out: dict[str, Any] = {"role": "assistant", "content": ev.text}
    if ev.reasoning:
        out["reasoning_content"] = ev.reasoning
    return out
