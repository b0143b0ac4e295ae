"""The request body of ``POST /v1/chat/completions``, validated into the service's ``ChatRequest``.

Every field is honoured or refused: sampling fields go to llama.cpp's samplers (penalties, ``logit_bias``,
``min_p``; ``response_format`` through its grammar sampler), fields that only describe the caller
(``user``, ``metadata``, ``store``, ``service_tier``) are accepted as they change nothing, and anything
else (``n`` > 1, tools, functions, logprobs, an unknown field) is a 400 naming the field, never silently
dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chatcli.core.template import Message
from chatcli.server.errors import APIError
from chatcli.server.response_format import ResponseFormatError, json_reply_for
from chatcli.server.service import ChatRequest


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Model):
    include_usage: bool = False


class JSONSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


_INT32 = 2**31 - 1  # llama.cpp's int32 parameters: a larger value would wrap in ctypes


class ChatCompletionBody(_Model):
    # Unknown fields are refused (a client relying on one would get a different answer than it asked for).
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=_INT32)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    repeat_penalty: float | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    tools: list[Any] | None = Field(default=None, max_length=0)
    logprobs: bool | None = None
    conversation: str | None = Field(default=None, min_length=1, max_length=32)
    # About the caller only: accepted, they change nothing about the reply.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Tools are refused unless absent or empty (chatcli has no tool calling).
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=0)


def _logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` (bias in -100..100) as (id, bias) pairs."""
    out: list[tuple[int, float]] = []
    for key, bias in (raw or {}).items():
        if not key.isdigit() or int(key) > _INT32:
            raise APIError("invalid_request", f"logit_bias: {key!r} is not a token id", "logit_bias")
        if not -100 <= bias <= 100:
            raise APIError("invalid_request", f"logit_bias.{key}: the bias must be between -100 and 100", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def parse_chat_request(doc: Any, *, max_messages: int, header_conversation: str | None) -> tuple[ChatRequest, ChatCompletionBody]:
    if not isinstance(doc, dict):
        raise APIError("invalid_request", "the request body must be a JSON object")
    try:
        body = ChatCompletionBody.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        path = tuple(err.get("loc", ()))
        if len(path) >= 3 and path[0] == "messages" and path[2] == "content":
            # A union's error names the branch pydantic tried ("content.str"): say what is accepted instead.
            loc = f"messages.{path[1]}.content"
            raise APIError("invalid_request", f"{loc}: must be a string or a list of text parts "
                           "({\"type\": \"text\", \"text\": ...}); images, audio and files are not supported",
                           loc) from None
        loc = ".".join(str(p) for p in path)
        if err.get("type") == "extra_forbidden":
            raise APIError("invalid_request", f"{loc}: not supported by chatcli", loc) from None
        raise APIError("invalid_request", f"{loc or 'body'}: {err.get('msg', 'invalid value')}", loc or None) from None
    if len(body.messages) > max_messages:
        raise APIError("invalid_request", f"too many messages ({len(body.messages)}; at most {max_messages})", "messages")
    if body.logprobs:
        raise APIError("invalid_request", "logprobs are not supported", "logprobs")
    for i, m in enumerate(body.messages):
        if m.role not in ("system", "developer", "user", "assistant"):
            raise APIError("invalid_request", f"messages.{i}.role: unsupported role {m.role!r} "
                           "(use system, user or assistant)", f"messages.{i}.role")
        if m.content is None:
            raise APIError("invalid_request", f"messages.{i}.content: a string is required", f"messages.{i}.content")
        if m.role == "user" and not m.text().strip():
            raise APIError("invalid_request", f"messages.{i}.content: empty message", f"messages.{i}.content")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise APIError("invalid_request", "stop: up to 4 non-empty strings", "stop")
    conversation = body.conversation or header_conversation or None
    try:
        json_reply = json_reply_for(body.response_format.model_dump(by_alias=True) if body.response_format else None)
    except ResponseFormatError as exc:
        raise APIError("invalid_request", str(exc), "response_format") from None
    req = ChatRequest(
        messages=[Message(m.role, m.text()) for m in body.messages],
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, repeat_penalty=body.repeat_penalty,
        max_tokens=body.max_completion_tokens or body.max_tokens, seed=body.seed, stop=tuple(stop),
        conversation=conversation, min_p=body.min_p, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logit_bias=_logit_bias(body.logit_bias), json_reply=json_reply,
    )
    return req, body
