"""OpenAI-style error objects: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from chatcli.errors import ChatcliError, DoesNotFitError, Kind

# service error kind -> (HTTP status, OpenAI error type)
KINDS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "invalid_json": (400, "invalid_request_error"),
    "authentication": (401, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "conflict": (409, "invalid_request_error"),
    "body_too_large": (413, "invalid_request_error"),
    "unsupported_media_type": (415, "invalid_request_error"),
    "server_error": (500, "server_error"),
    "unavailable": (503, "server_error"),
}

CODES: dict[str, str | None] = {
    "context_length_exceeded": "context_length_exceeded",
    "invalid_json": "invalid_json",
    "authentication": "invalid_api_key",
    "conflict": "conversation_busy",
    "body_too_large": "request_too_large",
}


class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(self, kind: str, message: str, param: str | None = None, *, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind if kind in KINDS else "server_error"
        self.message = message
        self.param = param
        self.status = status or KINDS[self.kind][0]

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": KINDS[self.kind][1], "param": self.param,
                          "code": CODES.get(self.kind, self.kind if self.kind != "server_error" else None)}}


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


# chatcli error kind -> the OpenAI error kind above; the status is the kind's (chatcli.errors.HTTP_STATUSES)
_API_KINDS: dict[Kind, str] = {"usage": "invalid_request", "refused": "invalid_request", "conflict": "conflict",
                               "not_found": "not_found", "engine": "server_error", "io": "server_error"}


def from_error(exc: ChatcliError) -> APIError:
    """The server's one mapping of chatcli errors to answers (the CLI's is ``cli.errors.user_errors``)."""
    param = getattr(exc, "param", None)
    if isinstance(exc, DoesNotFitError):
        return APIError("context_length_exceeded", str(exc), param or "messages", status=exc.http_status)
    if exc.kind == "not_found":
        param = param or "conversation"  # the only thing a request names that can be missing
    return APIError(_API_KINDS[exc.kind], str(exc), param, status=exc.http_status)
