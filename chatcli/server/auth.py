"""API keys and the request middleware: who a request is (its key's namespace), and one log line for it.

Plain ASGI rather than Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``): that one relays
every body chunk of a streamed response through an anyio memory stream and extra tasks, measured at
0.05-0.14 ms of the event loop's CPU per streamed token, and event-loop work competes with the decode
threads for the cores (issue #22).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatcli.server.errors import APIError, error_response

log = logging.getLogger("chatcli.server")

CHAT_PATH = "/v1/chat/completions"


def key_id(key: str) -> str:
    """The namespace of the client with this key, as stored in its conversations' metadata (not the key)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class ApiKeys:
    """The keys a server accepts; each key is a client that only ever meets its own conversations."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = [(k.encode(), key_id(k)) for k in keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def client_of(self, authorization: str) -> str | None:
        """The namespace of the key in an ``Authorization`` header, None for a missing or wrong one. Every
        key is compared (compare_digest on bytes), so the time taken says neither which key nor how much
        of one matched."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode()
        found = None
        for kb, kid in self._keys:
            if hmac.compare_digest(given, kb) and found is None:
                found = kid
        return found


class AuthAndLog:
    """Checks the API key (``scope["state"]["client"]`` = its namespace, "" without keys) and logs one
    line per request other than a chat completion, which logs its own (with its tokens and timings)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        method, path = scope["method"], scope["path"]
        state = scope.setdefault("state", {})
        state["client"] = ""
        if self.keys:
            client = self.keys.client_of(Headers(scope=scope).get("authorization", ""))
            state["client"] = client or ""
            if client is None:
                if method == "GET" and path == "/health":
                    # Liveness stays open for probes and supervisors (llama-server's /health needs no
                    # key either); what the server holds is only for those with the key.
                    await JSONResponse({"status": "ok"})(scope, receive, send)
                    return
                log.info("- %s %s 401 missing or wrong API key", method, path)
                refusal = error_response(APIError("authentication", "missing or wrong API key: send "
                                                  "'Authorization: Bearer KEY'"), {"WWW-Authenticate": "Bearer"})
                await refusal(scope, receive, send)
                return
        if path == CHAT_PATH and method == "POST":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def noting_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        await self.app(scope, receive, noting_status)
        log.info("- %s %s %d %.0fms", method, path, status[0], 1000 * (time.perf_counter() - t0))

