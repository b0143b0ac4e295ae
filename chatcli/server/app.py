"""The HTTP app: FastAPI assembled from the endpoints (``routes``), the key check (``auth``) and the
error handlers.

``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``, ``GET /health``. Every error is an
OpenAI error object with a 4xx/5xx status — never a traceback. With an API key every request needs
``Authorization: Bearer KEY`` (compared in constant time), except that ``GET /health`` without it still
answers ``{"status": "ok"}`` for probes. Each request logs one line: its id, the conversation, prompt
tokens, cached (not evaluated) tokens, generated tokens and time to first token.

The service runs in a worker thread per request (it blocks on the model); its events come back to the
event loop through ``bridge``. A streaming client that disconnects makes the worker close the service's
iterator, which records the reply so far like a Ctrl-C'd one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatcli.server.auth import ApiKeys, AuthAndLog
from chatcli.server.errors import APIError, error_response
from chatcli.server.routes import Routes, ServerLimits
from chatcli.server.service import ChatService

__all__ = ["ServerLimits", "create_app"]

log = logging.getLogger("chatcli.server")


def create_app(service: ChatService, *, api_keys: Sequence[str] = (), limits: ServerLimits | None = None) -> FastAPI:
    """The app; with ``api_keys`` every request needs one of them, and each key is a client that only ever
    meets its own conversations (without keys, all clients are one)."""
    app = FastAPI(title="chatcli", docs_url=None, redoc_url=None, openapi_url=None)
    routes = Routes(service, limits or ServerLimits())
    app.state.stop_requests = routes.stop_requests
    app.state.admitted = lambda: routes.admitted
    app.add_middleware(AuthAndLog, keys=ApiKeys(api_keys))
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    return app


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    return error_response(APIError(kind, str(exc.detail), status=exc.status_code))


async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error")
    return error_response(APIError("server_error", f"internal error ({type(exc).__name__})"))
