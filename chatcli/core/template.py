"""The model's chat template, rendered incrementally.

A chat template renders a whole list of messages. chatcli never re-renders what the context already
holds: for each new user message it renders the conversation with and without it and evaluates only the
difference (the "glue" plus the message plus the assistant header), as llama.cpp's
``common_chat_format_single`` does. Earlier tokens therefore never change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, TypeVar

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML: the fallback for models whose GGUF has no template (said once to the user).
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_SENTINEL = "\x00chatcli-sentinel\x00"


class _HasPiece(Protocol):
    piece: bytes


_E = TypeVar("_E", bound=_HasPiece)


class TemplateError(ValueError):
    """The chat template cannot render these messages."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


class ChatTemplate:
    """Jinja2 chat template in a sandbox (templates come from model files: data, not code)."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self.is_fallback = not source
        self.source = source or CHATML
        env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._tmpl = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"the model's chat template does not parse: {exc}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        try:
            return self._tmpl.render(
                messages=[m.as_dict() for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError:
            raise
        except Exception as exc:  # a template is foreign code-like data: any failure is its failure
            raise TemplateError(f"the chat template failed: {exc}") from None

    def prefix(self, persona: Sequence[Message]) -> str:
        """Text of the persona part (system prompt, examples, greeting): what precedes the first user turn."""
        if not persona:
            return ""
        text = self.render(persona, add_generation_prompt=False)
        with_user = self.render([*persona, Message("user", _SENTINEL)], add_generation_prompt=True)
        if with_user.startswith(text):
            return text
        # Template re-renders the persona differently once a user message follows: cut right before it.
        head = with_user.split(_SENTINEL, 1)[0]
        return _common_prefix(text, head)

    def user_turn(self, history: Sequence[Message], user_text: str) -> str:
        """Text to evaluate for a new user message: the message and the assistant header.

        ``history`` is everything the context already holds, each message closed (see ``closing``).
        Only the difference between the renderings with and without the message is returned.
        """
        before = self.render(history, add_generation_prompt=False) if history else ""
        after = self.render([*history, Message("user", user_text)], add_generation_prompt=True)
        if after.startswith(before):
            return after[len(before):]
        # The template rewrites earlier turns once a new one follows (some strip reasoning): the context
        # keeps what it has, and only the part after the common prefix is new.
        return after[len(_common_prefix(before, after)):]

    def closing(self, history: Sequence[Message]) -> str:
        """What the template writes after the content of the last message (e.g. ``<|im_end|>\\n``)."""
        if not history:
            return ""
        last = history[-1]
        text = self.render([*history[:-1], Message(last.role, _SENTINEL)], add_generation_prompt=False)
        if _SENTINEL not in text:
            return ""
        return text.split(_SENTINEL, 1)[1]

    def reply_stop_strings(self) -> list[str]:
        """Strings that mean the model ended its reply or started writing the next turn itself.

        The next-turn opener (``<|im_end|>\\n<|im_start|>user``) and the reply's closing marker alone
        (``<|im_end|>``). When the marker is one special token of the vocabulary, the model ends with that
        token (end of generation) and its text never appears, since sampled tokens are rendered without
        special tokens: the string can then only match a marker the model spelled out in ordinary pieces.
        That is what a model whose vocabulary lacks the marker does (a base model under the ChatML
        fallback writes ``<``, ``|``, ``im``, ``_end`` …), and it must end the reply there too: a reply
        never contains template markup.
        """
        probe = self.render(
            [Message("user", "a"), Message("assistant", _SENTINEL), Message("user", "b")],
            add_generation_prompt=False,
        )
        try:
            after = probe.split(_SENTINEL, 1)[1]
        except IndexError:
            return []
        out: list[str] = []
        opener = after.split("b", 1)[0].strip()
        if _is_markup(opener):
            out.append(opener)
        marker = self.closing([Message("user", "a"), Message("assistant", "x")]).strip()
        if _is_markup(marker) and marker not in out:
            out.append(marker)
        return out


def _is_markup(text: str) -> bool:
    """Template markup rather than a word a reply may contain (``User`` or ``END`` could be prose)."""
    return len(text) >= 3 and not text.isalnum()


def hold_back_stops(events: Iterator[_E], stops: Sequence[str]) -> Generator[_E, None, None]:
    """Pass token events on, holding back those that may be the start of a stop string.

    A stop string spelled out in ordinary pieces (``<``, ``|``, ``im_end``, ``|>``) is only recognised
    once complete; the pieces before must not be shown meanwhile. Held events are released merged into one
    (the last event with all their bytes) as soon as the text cannot be a stop string any more, or when the
    events end, so the consumer sees either the whole stop string in one piece (and cuts it) or text that
    is no stop string. Closing this generator closes ``events``.
    """
    held: list[_E] = []
    text = ""
    try:
        for ev in events:
            held.append(ev)
            text = (text + ev.piece.decode("utf-8", "ignore"))[-_MAX_STOP:]
            if not stops or not _ends_with_stop_prefix(text, stops):
                # No stop string can begin in what was held: any later one starts after it.
                yield _merge(held)
                held, text = [], ""
        if held:
            yield _merge(held)
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


_MAX_STOP = 256  # characters of recent text kept to recognise a stop string's beginning


def _ends_with_stop_prefix(text: str, stops: Sequence[str]) -> bool:
    """``text`` ends with a beginning of a stop string (or holds a whole one): more text may complete it."""
    for s in stops:
        if s in text:
            return True
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                return True
    return False


def _merge(held: list[_E]) -> _E:
    if len(held) == 1:
        return held[0]
    return dataclasses.replace(held[-1], piece=b"".join(e.piece for e in held))  # type: ignore[type-var]


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]
