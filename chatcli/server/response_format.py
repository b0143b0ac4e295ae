"""A request's ``response_format`` as the GBNF grammar llama.cpp's grammar sampler constrains the reply with.

``json_object`` is llama.cpp's own JSON grammar; ``json_schema`` goes through llama-cpp-python's port of
llama.cpp's JSON-schema-to-grammar converter (the same rules llama-server applies). ``text`` is no grammar.
"""

from __future__ import annotations

import json
from typing import Any

from chatcli.errors import ChatcliError


class ResponseFormatError(ChatcliError, ValueError):
    """A ``response_format`` that cannot become a grammar (one line for the client)."""

    kind = "usage"


def grammar_for(response_format: dict[str, Any] | None) -> str:
    """The GBNF for ``response_format`` ("" = unconstrained)."""
    if response_format is None:
        return ""
    kind = response_format.get("type")
    if kind == "text":
        return ""
    # Imported here: llama_cpp loads the native library, which the HTTP layer's parsing does not need
    # until a client asks for a format.
    from llama_cpp import llama_grammar

    if kind == "json_object":
        return str(llama_grammar.JSON_GBNF)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ResponseFormatError("response_format.json_schema: an object with a 'schema' object is required")
        schema = spec.get("schema", {})
        try:
            return str(llama_grammar.json_schema_to_gbnf(json.dumps(schema)))
        except Exception as exc:
            # The converter raises whatever it meets (AssertionError for an unresolvable $ref, KeyError,
            # NotImplementedError for an unknown type): all mean "this schema", one line for the client.
            raise ResponseFormatError(f"response_format.json_schema.schema: cannot be used ({exc})") from None
    raise ResponseFormatError(f"response_format.type: {kind!r} is not supported (use text, json_object or json_schema)")
