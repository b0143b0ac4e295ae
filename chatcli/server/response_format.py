"""A request's ``response_format``, read into what the reply must be: any text, or JSON (an object, or a value
matching a JSON schema).

Only the request's shape is checked here; the grammar that constrains the reply is built by the backend
(``Backend.json_grammar``: llama.cpp's JSON grammar, or the JSON-schema converter llama-server applies),
which also says whether a schema can be used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chatcli.errors import ChatcliError


class ResponseFormatError(ChatcliError, ValueError):
    """A ``response_format`` of a type or shape chatcli does not take (one line for the client)."""

    kind = "usage"


@dataclass(frozen=True)
class JsonReply:
    """The reply must be JSON: an object (``json_object``: ``schema`` None) or a value matching ``schema``."""

    schema: dict[str, Any] | None = None


def json_reply_for(response_format: dict[str, Any] | None) -> JsonReply | None:
    """What ``response_format`` asks of the reply (None = unconstrained text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonReply()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ResponseFormatError("response_format.json_schema: an object with a 'schema' object is required")
        return JsonReply(dict(spec.get("schema", {})))
    raise ResponseFormatError(f"response_format.type: {kind!r} is not supported (use text, json_object or json_schema)")
