"""The HTTP app: Starlette assembled from the endpoints (``routes``), the key check (``auth``), the
loading gate and the error handlers.

``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``, ``GET /health``. Every error is an
OpenAI error object with a 4xx/5xx status — never a traceback. With an API key every request needs
``Authorization: Bearer KEY`` (compared in constant time), except that ``GET /health`` without it still
answers ``{"status": "ok"}`` for probes. Each request logs one line: its id, the conversation, prompt
tokens, cached (not evaluated) tokens, generated tokens and time to first token.

The service runs in a worker thread per request (it blocks on the model); its events come back to the
event loop through ``bridge``. A streaming client that disconnects makes the worker close the service's
iterator, which records the reply so far like a Ctrl-C'd one.

Starlette, not FastAPI: the endpoints take the request and answer a response themselves (the body is
validated by ``schemas``), so FastAPI added nothing but its import, ~0.2-0.35 s of `chatcli serve`'s start
(its OpenAPI models, pydantic classes built at import, telemetry).

Until the model is loaded (``chatcli serve`` listens first and loads on a thread) every request is answered
503 ``Loading model`` with a ``Retry-After``, as llama-server answers while it loads: /health says ready
only when a request could be served.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from chatcli.server.auth import ApiKeys, AuthAndLog
from chatcli.server.errors import APIError, error_response
from chatcli.server.index import BUILDING
from chatcli.server.routes import Routes, ServerLimits
from chatcli.server.service import ChatService

__all__ = ["ServerLimits", "create_app"]

log = logging.getLogger("chatcli.server")


LOADING_RETRY_AFTER = 1  # seconds a client is told to wait while the model loads


def create_app(service: ChatService | None, *, api_keys: Sequence[str] = (),
               limits: ServerLimits | None = None) -> Starlette:
    """The app; with ``api_keys`` every request needs one of them, and each key is a client that only ever
    meets its own conversations (without keys, all clients are one). ``service`` None: the model is still
    loading; every request is answered 503 until ``app.state.loaded(service)``."""
    routes = Routes(service, limits or ServerLimits())
    app = Starlette(
        routes=[Route("/health", routes.health, methods=["GET"]),
                Route("/v1/models", routes.models, methods=["GET"]),
                Route("/v1/chat/completions", routes.chat_completions, methods=["POST"])],
        # The gate first: while loading, not even the key check runs (llama-server answers so too).
        middleware=[Middleware(UntilLoaded, routes=routes), Middleware(AuthAndLog, keys=ApiKeys(api_keys))],
        exception_handlers={StarletteHTTPException: _http_error, Exception: _internal_error},  # type: ignore[dict-item]
    )
    app.state.stop_requests = routes.stop_requests
    app.state.admitted = lambda: routes.admitted
    app.state.loaded = routes.loaded
    return app


class UntilLoaded:
    """Plain ASGI: every request is answered 503 ``Loading model`` until the routes have their service."""

    def __init__(self, app: ASGIApp, routes: Routes) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.routes.ready:
            # llama-server's words, and how far a first index build has got when one runs (a minute at
            # 100,000 conversations copied in): a client polling /health sees it move.
            at = BUILDING.get()
            message = "Loading model" + (f" (indexing conversations: {at[0]}/{at[1]})" if at else "")
            refusal = error_response(APIError("unavailable", message), {"Retry-After": str(LOADING_RETRY_AFTER)})
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    return error_response(APIError(kind, str(exc.detail), status=exc.status_code))


async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error")
    return error_response(APIError("server_error", f"internal error ({type(exc).__name__})"))
