"""The request body of ``POST /v1/chat/completions``, validated into the service's ``ChatRequest``.

Fields OpenAI clients send that chatcli does not use (``user``, ``frequency_penalty``, ``logit_bias`` …)
are accepted and ignored, as llama.cpp's server does; fields whose meaning chatcli cannot honour
(``n`` > 1, tools, logprobs) are refused rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chatcli.core.template import Message
from chatcli.server.errors import APIError
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


class ChatCompletionBody(_Model):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
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
    req = ChatRequest(
        messages=[Message(m.role, m.text()) for m in body.messages],
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, repeat_penalty=body.repeat_penalty,
        max_tokens=body.max_completion_tokens or body.max_tokens, seed=body.seed, stop=tuple(stop),
        conversation=conversation,
    )
    return req, body
