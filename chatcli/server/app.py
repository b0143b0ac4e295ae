"""The HTTP layer: FastAPI routes over ``ChatService``.

``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``, ``GET /health``. Every error is an
OpenAI error object with a 4xx/5xx status — never a traceback. With an API key every request needs
``Authorization: Bearer KEY`` (compared in constant time), except that ``GET /health`` without it still
answers ``{"status": "ok"}`` for probes. Each request logs one line: its id, the
conversation, prompt tokens, cached (not evaluated) tokens, generated tokens and time to first token.

The service runs in a worker thread per request (it blocks on the model); events come back through an
asyncio queue. A streaming client that disconnects makes the worker close the service's iterator, which
records the reply so far like a Ctrl-C'd one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatcli.errors import ChatcliError
from chatcli.server.errors import APIError, from_error
from chatcli.server.schemas import ChatCompletionBody, parse_chat_request
from chatcli.server.service import (
    ChatRequest,
    ChatService,
    Delta,
    Finished,
    Started,
)

log = logging.getLogger("chatcli.server")

CONVERSATION_HEADER = "X-Chatcli-Conversation"
DEFAULT_MAX_BODY = 8 * 1024 * 1024
DEFAULT_MAX_MESSAGES = 2048
_END = object()


@dataclass
class ServerLimits:
    max_body: int = DEFAULT_MAX_BODY
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_queue: int = 16  # chat requests waiting beyond the contexts; more are refused (503) before their body
    retry_after: int = 2  # seconds a refused client is told to wait


def key_id(key: str) -> str:
    """The namespace of the client with this key, as stored in its conversations' metadata (not the key)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def create_app(service: ChatService, *, api_keys: Sequence[str] = (), limits: ServerLimits | None = None) -> FastAPI:
    """The app; with ``api_keys`` every request needs one of them, and each key is a client that only ever
    meets its own conversations (without keys, all clients are one)."""
    limits = limits or ServerLimits()
    app = FastAPI(title="chatcli", docs_url=None, redoc_url=None, openapi_url=None)
    runs: set[_Run] = set()  # requests whose worker is still running
    stopping = threading.Event()

    def stop_requests() -> None:
        """Shutting down: every running request stops at its next batch or token (its reply so far is
        recorded), so the server does not wait for whole replies to be generated for nobody."""
        stopping.set()
        for run in list(runs):
            run.cancel.set()

    app.state.stop_requests = stop_requests
    keys = [(k.encode(), key_id(k)) for k in api_keys]
    admitted = [0]  # chat requests between arrival and response (the event loop's thread only: no lock)
    capacity = service.parallel + limits.max_queue
    app.state.admitted = lambda: admitted[0]

    def client_of(token: str) -> str | None:
        """The namespace of the key sent, None for a wrong one. Every key is compared (compare_digest on
        bytes), so the time taken says neither which key nor how much of one matched."""
        given = token.encode()
        found = None
        for kb, kid in keys:
            if hmac.compare_digest(given, kb) and found is None:
                found = kid
        return found

    @app.middleware("http")
    async def auth_and_log(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        t0 = time.perf_counter()
        request.state.client = ""
        if keys:
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            client = client_of(token.strip()) if scheme.lower() == "bearer" else None
            request.state.client = client or ""
            if client is None:
                if request.method == "GET" and request.url.path == "/health":
                    # Liveness stays open for probes and supervisors (llama-server's /health needs no
                    # key either); what the server holds is only for those with the key.
                    return JSONResponse({"status": "ok"})
                log.info("- %s %s 401 missing or wrong API key", request.method, request.url.path)
                return error_response(APIError("authentication", "missing or wrong API key: send "
                                               "'Authorization: Bearer KEY'"), {"WWW-Authenticate": "Bearer"})
        response = await call_next(request)
        if request.url.path != "/v1/chat/completions" or request.method != "POST":  # that route logs its own
            log.info("- %s %s %d %.0fms", request.method, request.url.path, response.status_code,
                     1000 * (time.perf_counter() - t0))
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return error_response(APIError(kind, str(exc.detail), status=exc.status_code))

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return error_response(APIError("server_error", f"internal error ({type(exc).__name__})"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": service.model_id, "model_name": service.model_name,
                "conversations_indexed": len(service.index)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": service.model_id, "object": "model", "created": 0, "owned_by": "chatcli",
             "name": service.model_name}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        rid = "chatcmpl-" + secrets.token_hex(12)
        if admitted[0] >= capacity:
            # Refused before its body is read: a waiting request holds a thread and its parsed body.
            log.info("%s 503 queue full (%d admitted)", rid, admitted[0])
            return error_response(APIError("unavailable", "the server is busy: retry later"),
                                  {"Retry-After": str(limits.retry_after)})
        admitted[0] += 1
        try:
            return await _chat(request, rid)
        finally:
            admitted[0] -= 1

    async def _chat(request: Request, rid: str) -> Response:
        t0 = time.perf_counter()
        try:
            doc = await _read_json(request, limits.max_body)
            req, body = parse_chat_request(doc, max_messages=limits.max_messages,
                                           header_conversation=request.headers.get(CONVERSATION_HEADER))
        except APIError as bad:
            log.info("%s %d %s", rid, bad.status, bad.message)
            return error_response(bad)
        req.client = request.state.client
        run = _Run(service, req, runs)
        watcher = asyncio.create_task(_watch_disconnect(request, run.cancel))
        try:
            return await _respond(run, body, rid, t0)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _respond(run: _Run, body: ChatCompletionBody, rid: str, t0: float) -> Response:
        first = await run.next()
        if run.cancel.is_set() or first is _END:
            # Stopped before its reply started (between batches of its prompt): what was appended is kept.
            return _stopped(rid, "before its reply started")
        if isinstance(first, ChatcliError):
            err = from_error(first)
            log.info("%s %d %s", rid, err.status, err.message)
            return error_response(err)
        assert isinstance(first, Started)
        headers = {CONVERSATION_HEADER: first.conversation, "X-Request-Id": rid}
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventSourceResponse(_sse(run, rid, created, service.model_id, include_usage, t0),
                                       headers=headers, ping=15)
        text: list[str] = []
        ttft = 0.0
        while True:
            ev = await run.next()
            if isinstance(ev, Delta):
                if not ttft:
                    ttft = time.perf_counter() - t0
                text.append(ev.text)
            elif isinstance(ev, Finished):
                _log_done(rid, ev, ttft or time.perf_counter() - t0)
                return JSONResponse({
                    "id": rid, "object": "chat.completion", "created": created, "model": service.model_id,
                    "choices": [{"index": 0, "message": _message(ev),
                                 "finish_reason": ev.finish_reason, "logprobs": None}],
                    "usage": _usage(ev), "chatcli": _extension(ev),
                }, headers=headers)
            elif isinstance(ev, ChatcliError):
                err = from_error(ev)
                log.info("%s %d %s", rid, err.status, err.message)
                return error_response(err, headers)
            elif ev is _END:
                if run.cancel.is_set():
                    return _stopped(rid, "mid-reply: reply so far recorded")
                err = APIError("server_error", "the reply ended without a result")
                return error_response(err, headers)

    def _stopped(rid: str, when: str) -> Response:
        if stopping.is_set():
            log.info("%s stopped by the shutdown %s", rid, when)
            return error_response(APIError("unavailable", "the server is shutting down: retry later"))
        log.info("%s client went away %s", rid, when)
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    return app


async def _read_json(request: Request, max_body: int) -> Any:
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


class _Run:
    """One service call in a worker thread; its events arrive on an asyncio queue."""

    def __init__(self, service: ChatService, req: ChatRequest, running: set[_Run]) -> None:
        self.running = running
        running.add(self)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.cancel = threading.Event()
        self.thread = threading.Thread(target=self._work, args=(service.complete(req, cancelled=self.cancel.is_set),),
                                       daemon=True)
        self.thread.start()

    def _put(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            # The server is shutting down (its event loop closed): nobody listens any more, and closing
            # the service iterator below still records the reply.
            self.cancel.set()

    def _work(self, it: Iterator[object]) -> None:
        try:
            for ev in it:
                self._put(ev)
                if self.cancel.is_set():
                    break  # the client left: closing the iterator records the reply so far
        except ChatcliError as exc:
            self._put(exc)
        except Exception as exc:  # never a traceback to the client; the log has it
            log.exception("request failed")
            self._put(ChatcliError(f"internal error ({type(exc).__name__})", kind="engine"))
        finally:
            try:
                close = getattr(it, "close", None)
                if close is not None:
                    close()  # records a reply cut short: may fail (disk full), the end must still be sent
            except Exception:
                log.exception("recording the end of a request failed")
            finally:
                self.running.discard(self)
                self._put(_END)

    async def next(self) -> object:
        return await self.queue.get()


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    """Wait for the client to go away (after its body, the only message left is the disconnect) and tell
    the service, which stops even between batches of a long prompt. Cancelled before a streaming
    response starts: sse-starlette then listens for the disconnect itself."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            cancel.set()
            return


def _usage(ev: Finished) -> dict[str, Any]:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": ev.cached_tokens}}


def _extension(ev: Finished) -> dict[str, Any]:
    """chatcli's own fields (OpenAI clients ignore unknown fields)."""
    return {"conversation": ev.conversation, "forked_from": ev.forked_from, "evaluated_tokens": ev.evaluated,
            "state_from": ev.state,
            "context_shift": {"messages_dropped": ev.shifted} if ev.shifted else None, "notices": ev.notices}


def _log_done(rid: str, ev: Finished, ttft: float) -> None:
    log.info("%s 200 conv=%s prompt=%d cached=%d generated=%d ttft=%.0fms state=%s%s", rid, ev.conversation,
             ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens, 1000 * ttft, ev.state,
             f" forked_from={ev.forked_from}" if ev.forked_from else "")


def _message(ev: Finished) -> dict[str, Any]:
    """The reply as an OpenAI message; its reasoning apart, in ``reasoning_content`` (DeepSeek's field,
    which llama-server returns too), only when there is some."""
    out: dict[str, Any] = {"role": "assistant", "content": ev.text}
    if ev.reasoning:
        out["reasoning_content"] = ev.reasoning
    return out


async def _sse(run: _Run, rid: str, created: int, model: str, include_usage: bool, t0: float) -> AsyncIterator[dict[str, str]]:
    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, str]:
        doc = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
        return {"data": json.dumps(doc, ensure_ascii=False)}

    ttft = 0.0
    finished = False
    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            ev = await run.next()
            if isinstance(ev, Delta):
                if not ttft:
                    ttft = time.perf_counter() - t0
                yield chunk({"reasoning_content": ev.text} if ev.reasoning else {"content": ev.text})
            elif isinstance(ev, Finished):
                finished = True
                _log_done(rid, ev, ttft or time.perf_counter() - t0)
                # Usage only in its own chunk, and only when asked (stream_options.include_usage), as OpenAI.
                yield chunk({}, ev.finish_reason, chatcli=_extension(ev))
                if include_usage:
                    yield {"data": json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                               "model": model, "choices": [], "usage": _usage(ev)})}
                yield {"data": "[DONE]"}
                return
            elif isinstance(ev, ChatcliError):
                err = from_error(ev)
                log.info("%s %d %s (mid-stream)", rid, err.status, err.message)
                yield {"data": json.dumps(err.body())}
                return
            elif ev is _END:
                return
    finally:
        if not finished:
            run.cancel.set()
            log.info("%s client went away mid-stream: reply so far recorded", rid)
