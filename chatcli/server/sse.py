"""A streamed chat completion as server-sent events, written straight to the ASGI server.

Per token the event loop does little: the chunk's JSON around the text is encoded once per request
(``ChunkEncoder``), so a token costs one ``json.dumps`` of its text; after the first token, text is
gathered for ``bridge.WINDOW`` (50 ms) and everything waiting goes in one ``http.response.body`` message;
no sse-starlette (its per-event ``ServerSentEvent`` encoding and its task group cost the event loop CPU
per token, which competes with the decode threads for the cores). The bytes are those sse-starlette sent
(``data: …`` lines, ``\r\n`` separators, the same headers and 15 s pings).

A client that goes away sets the run's ``cancel``: the worker stops at its next token and records the
reply so far (``bridge``), then the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from chatcli.errors import ChatcliError
from chatcli.server.bridge import END, WINDOW, Run
from chatcli.server.errors import from_error
from chatcli.server.service import Delta, Finished

log = logging.getLogger("chatcli.server")

SEP = "\r\n"  # sse-starlette's line separator
DONE = b"data: [DONE]\r\n\r\n"
PING_SECONDS = 15.0  # a comment line this often keeps proxies from closing a quiet stream (a long prompt)
_MARK = "\ue000chatcli-split\ue000"  # a private-use sentinel where a delta's text goes


class ChunkEncoder:
    """The ``chat.completion.chunk`` events of one response, as bytes; only a delta's text is encoded
    per token (the rest of the chunk is the same bytes every time)."""

    def __init__(self, rid: str, created: int, model: str) -> None:
        self.head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        self._content = self._split("content")
        self._reasoning = self._split("reasoning_content")

    def _split(self, field: str) -> tuple[bytes, bytes] | None:
        whole = self.chunk({field: _MARK})
        parts = whole.split(json.dumps(_MARK, ensure_ascii=False).encode())
        return (parts[0], parts[1]) if len(parts) == 2 else None  # the sentinel in a model name: encode whole

    def chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        return event({**self.head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                "logprobs": None}], **extra})

    def delta(self, text: str, reasoning: bool = False) -> bytes:
        around = self._reasoning if reasoning else self._content
        if around is None:
            return self.chunk({"reasoning_content" if reasoning else "content": text})
        return around[0] + json.dumps(text, ensure_ascii=False).encode() + around[1]


def event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, ensure_ascii=False).encode() + b"\r\n\r\n"


def ping() -> bytes:
    return f": ping - {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())}{SEP}{SEP}".encode()


class CompletionStream(Response):
    """The response of a streamed completion: the run's events as SSE until ``[DONE]``, an error event,
    or the run's end."""

    def __init__(self, run: Run, enc: ChunkEncoder, headers: dict[str, str], *, rid: str, include_usage: bool,
                 on_finished: Callable[[Finished, float], None], usage: Callable[[Finished], dict[str, Any]],
                 extension: Callable[[Finished], dict[str, Any]], timings: Callable[[Finished], dict[str, Any]],
                 t0: float) -> None:
        super().__init__(status_code=200)
        self.run, self.enc, self.rid = run, enc, rid
        self.sse_headers = {"cache-control": "no-store", **{k.lower(): v for k, v in headers.items()},
                        "connection": "keep-alive", "x-accel-buffering": "no"}
        self.include_usage = include_usage
        self.on_finished, self.usage, self.extension, self.timings = on_finished, usage, extension, timings
        self.t0 = t0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(_watch_disconnect(receive, self.run))
        finished = False
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                *((k.encode("latin-1"), v.encode("latin-1")) for k, v in self.sse_headers.items())]})
            finished = await self._body(send)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            if not finished:
                self.run.cancel.set()
                log.info("%s client went away mid-stream: reply so far recorded", self.rid)

    async def _body(self, send: Send) -> bool:
        """Send until the end; True when the reply finished (``[DONE]`` sent)."""
        enc, ttft = self.enc, 0.0
        out = [enc.chunk({"role": "assistant", "content": ""})]
        window = 0.0  # none before the first token: it goes out the moment it is sampled
        while True:
            if out:
                await _send_body(send, b"".join(out))
                out.clear()
            evs = await self.run.take(PING_SECONDS, window=window)
            if not evs:
                out.append(ping())
                continue
            for ev in evs:
                if type(ev) is Delta:
                    if not ttft:
                        ttft = time.perf_counter() - self.t0
                        window = WINDOW
                    out.append(enc.delta(ev.text, ev.reasoning))
                elif isinstance(ev, Finished):
                    self.on_finished(ev, ttft or time.perf_counter() - self.t0)
                    # Usage only in its own chunk, and only when asked (stream_options.include_usage), as OpenAI;
                    # ``timings`` on the last chunk, as llama-server.
                    if self.include_usage:
                        out.append(enc.chunk({}, ev.finish_reason, chatcli=self.extension(ev)))
                        out.append(event({**enc.head, "choices": [], "usage": self.usage(ev),
                                          "timings": self.timings(ev)}))
                    else:
                        out.append(enc.chunk({}, ev.finish_reason, chatcli=self.extension(ev),
                                             timings=self.timings(ev)))
                    out.append(DONE)
                    await _send_body(send, b"".join(out), more=False)
                    return True
                elif isinstance(ev, ChatcliError):
                    err = from_error(ev)
                    log.info("%s %d %s (mid-stream)", self.rid, err.status, err.message)
                    out.append(event(err.body()))
                    await _send_body(send, b"".join(out), more=False)
                    return False
                elif ev is END:
                    await _send_body(send, b"".join(out), more=False)
                    return False


async def _send_body(send: Send, body: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": more})


async def _watch_disconnect(receive: Receive, run: Run) -> None:
    """Wait for the client to go away (after its body, the only message left is the disconnect)."""
    while True:
        message: Message = await receive()
        if message.get("type") == "http.disconnect":
            run.cancel.set()
            return
