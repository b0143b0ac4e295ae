"""The model's chat template, rendered incrementally with sentinels.

A chat template renders a whole list of messages. chatcli never re-renders what the context already
holds: the context keeps what was evaluated (a reply exactly as generated, its reasoning included) and a
new user message evaluates only the text the template puts between the end of the last message's content
and the new assistant header. That text is found with sentinels placed at the end of the last content and
as the new message, not as the common prefix of two renderings: many templates render the turns before
the last user message differently (they drop reasoning, add an empty think block, move the system prompt
into the last user turn), and a common prefix would then start inside the previous reply and show it to
the model a second time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from chatcli.errors import ChatcliError, Kind

# ChatML: the fallback for models whose GGUF has no template (said once to the user).
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Sentinels: text no message contains and no template rewrites (no whitespace to trim, no markup).
_SENTINEL = "\x00chatcli-sentinel\x00"
_S_END = "\x00chatcli-end\x00"  # at the end of the last content the context holds
_S_NEXT = "\x00chatcli-next\x00"  # the content of the next user message
_S_SYS = "\x00chatcli-system\x00"  # a system prompt, to see whether a template repeats it

# Pairs that open and close a reasoning block in a reply's text, as the templates llama.cpp ships write
# them; gpt-oss's channel markers are rendered into the text (llama.cpp marks them user-defined), its
# ``<|end|>`` is not.
REASONING_TAGS = (("<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"),
                  ("<think>", "</think>"), ("<seed:think>", "</seed:think>"), ("<|think|>", "<|/think|>"),
                  ("[THINK]", "[/THINK]"), ("<thinking>", "</thinking>"))


_HARMONY_OPEN = REASONING_TAGS[0][0]
_HARMONY_FINAL = "<|channel|>final<|message|>"


class _HasPiece(Protocol):
    piece: bytes


_E = TypeVar("_E", bound=_HasPiece)


class TemplateError(ChatcliError, ValueError):
    """The chat template cannot render these messages."""

    kind: Kind = "refused"


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


class _Generation(Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers marks the assistant's tokens for training
    masks with it): rendering is its body, as transformers and llama.cpp do."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain attribute)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            separators: Any = None, sort_keys: bool = False) -> str:
    """``tojson`` with the keyword arguments templates pass (Python's ``json.dumps`` ones); jinja2's own
    filter HTML-escapes, which a prompt must not."""
    import json
    seps = tuple(separators) if separators else None
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=seps, sort_keys=sort_keys)


class ChatTemplate:
    """Jinja2 chat template in a sandbox (templates come from model files: data, not code).

    Args:
        source: the template text; None or "" means ChatML (``is_fallback``).
        bos_token, eos_token: the model's BOS/EOS text, for templates that write them.
        enable_thinking: passed to templates that read it (None: not passed, the template's default).
    """

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "",
                 enable_thinking: bool | None = None) -> None:
        self.is_fallback = not source
        self.source = source or CHATML
        env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _Generation])

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self._tmpl = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"the model's chat template does not parse: {exc}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.enable_thinking = enable_thinking
        self.origin: str | None = None  # where a template other than the model's came from (a file path)
        self._tags: tuple[str, str] | None = None
        self._opens: bool | None = None
        self._stops: list[str] | None = None
        self.folds_system = False
        self.drops_greeting = False
        self.folds_system = self._refuses_system()
        self.drops_greeting = self._refuses_greeting()
        self._header: str | None = None
        self._first: str | None = None
        self._tags = self._find_reasoning_tags()

    @property
    def cache_key(self) -> str:
        """Everything of the template that shapes a rendering: its source and the variables chatcli sets.
        The persona prefix cache key is built from it (``kv.prefix.cache_path``); without ``enable_thinking``
        it is the source alone, the key every earlier cache file has."""
        if self.enable_thinking is None:
            return self.source
        return f"{self.source}\x00enable_thinking={self.enable_thinking}"

    # -- rendering ---------------------------------------------------------------------------------

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        msgs = _fold_system(messages) if self.folds_system else list(messages)
        if self.drops_greeting:
            msgs = _without_greeting(msgs)
        dicts = [self._as_dict(m) for m in msgs]
        extra: dict[str, Any] = {}
        if self.enable_thinking is not None:
            extra["enable_thinking"] = self.enable_thinking
        try:
            return self._tmpl.render(
                messages=dicts,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                # Tool-calling templates that concatenate their function list (firefunction) need it to be
                # text; chatcli has no tools, so it is empty. ``tools`` stays undefined: every template
                # takes that as "no tools", whereas an empty list makes some write an empty tools section.
                functions="",
                datetime=datetime.now().strftime("%d %b %Y"),  # firefunction-v2 writes "Today is …"
                **extra,
            )
        except TemplateError:
            raise
        except Exception as exc:  # a template is foreign code-like data: any failure is its failure
            raise TemplateError(f"the chat template failed: {exc}") from None

    def _as_dict(self, m: Message) -> dict[str, str]:
        """A message as templates read it: a reply's reasoning apart from its answer, in both fields
        templates use (``reasoning_content``, gpt-oss ``thinking``), since some refuse reasoning markup in
        the content (gpt-oss) and the rest place it themselves."""
        if m.role != "assistant" or self._tags is None:
            return m.as_dict()
        harmony_final = self._tags[0] == _HARMONY_OPEN and m.content.lstrip().startswith(_HARMONY_FINAL)
        if self._tags[1] not in m.content and not harmony_final:
            return m.as_dict()  # no reasoning, or one cut off before it ended: the content as it is
        reasoning, answer = self.split_reasoning(m.content)
        if not reasoning:
            return {"role": m.role, "content": answer}
        return {"role": m.role, "content": answer, "reasoning_content": reasoning, "thinking": reasoning}

    def _visible(self, messages: Sequence[Message]) -> list[Message]:
        """The messages the model sees: a refused greeting left out (so the sentinels go where they show)."""
        return _without_greeting(messages) if self.drops_greeting else list(messages)

    def _refuses_greeting(self) -> bool:
        """A template that insists on user/assistant alternation (Mistral, Gemma 2) refuses a persona's
        greeting, an assistant message before any user message: the model then does not see it (the user
        still does), rather than no conversation starting at all."""
        try:
            self.render([Message("system", "s"), Message("assistant", "g"), Message("user", "u")],
                        add_generation_prompt=True)
            return False
        except TemplateError:
            pass
        self.drops_greeting = True
        try:
            self.render([Message("system", "s"), Message("assistant", "g"), Message("user", "u")],
                        add_generation_prompt=True)
            return True
        except TemplateError:
            return False
        finally:
            self.drops_greeting = False

    def _refuses_system(self) -> bool:
        """A template that raises on a system message but renders the same chat without one (Gemma 2):
        then the persona is folded into the first user message (``folds_system``)."""
        try:
            self.render([Message("system", "s"), Message("user", "u")], add_generation_prompt=True)
            return False
        except TemplateError:
            pass
        try:
            self.render([Message("user", "u")], add_generation_prompt=True)
        except TemplateError:
            return False
        return True

    # -- the pieces the context is made of ---------------------------------------------------------

    def prefix(self, persona: Sequence[Message]) -> str:
        """Text of the persona part (system prompt, examples, greeting): what precedes the first user turn.

        Rendered followed by a user message, as it always will be (some templates refuse to render
        without one, Qwen3.5: "No user query found"), and cut at the end of the last persona message's
        closing.
        """
        persona = self._visible(persona)
        if not persona:
            return ""
        text = self.render([*_with_end(persona), Message("user", _S_NEXT)], add_generation_prompt=True)
        if _S_END not in text:
            # The template does not show the last persona message where it stands (e.g. it moves the
            # system prompt into the last user turn): the prefix ends before the first user turn's text.
            return text.split(_S_NEXT, 1)[0] if _S_NEXT in text else ""
        head, rest = text.split(_S_END, 1)
        between = rest.split(_S_NEXT, 1)[0]
        return head + self._mid_closing(persona, between)

    def user_turn(self, history: Sequence[Message], user_text: str) -> str:
        """Text to evaluate for a new user message: what follows the context's last closing, the message,
        and the assistant header.

        ``history`` is everything the context already holds (persona included), each message closed as
        ``closing`` says. The text is what the template writes after the last content, minus that closing.
        """
        history = self._visible(history)
        if not history:
            return self.render([Message("user", user_text)], add_generation_prompt=True)
        hist = self._without_repeated_system(history)
        after = self.render([*_with_end(hist), Message("user", user_text)], add_generation_prompt=True)
        if _S_END not in after:
            raise TemplateError("the chat template drops the conversation's last message")
        after = after.split(_S_END, 1)[1]
        probe = self.render([*_with_end(hist), Message("user", _S_NEXT)], add_generation_prompt=True)
        between = probe.split(_S_END, 1)[1].split(_S_NEXT, 1)[0]
        closing = self._mid_closing(hist, between)
        return after[len(closing):] if after.startswith(closing) else after

    def closing(self, history: Sequence[Message]) -> str:
        """What the template writes after the content of the last message when the conversation goes on
        (e.g. ``<|im_end|>\\n``): evaluated right after a reply, so each message owns its rendering."""
        history = self._visible(history)
        if not history:
            return ""
        hist = self._without_repeated_system(history)
        probe = self.render([*_with_end(hist), Message("user", _S_NEXT)], add_generation_prompt=True)
        if _S_END not in probe:
            return ""
        between = probe.split(_S_END, 1)[1].split(_S_NEXT, 1)[0]
        return self._mid_closing(hist, between)

    def final_closing(self, history: Sequence[Message]) -> str:
        """What the template writes after the last message's content when it ends the rendering (gpt-oss
        ends a final answer with ``<|return|>``, the token the model generates, where a turn that others
        follow ends with ``<|end|>``); "" when it cannot render the history alone."""
        history = self._visible(history)
        if not history:
            return ""
        try:
            text = self.render(_with_end(history), add_generation_prompt=False)
        except TemplateError:
            return ""
        return text.split(_S_END, 1)[1] if _S_END in text else ""

    def _mid_closing(self, history: Sequence[Message], between: str) -> str:
        """Split ``between`` (all the template writes from the end of the last content to the next user
        message's text) into the last message's closing and the user header."""
        final = self.final_closing(history)
        if final and between.startswith(final):
            return final
        header = self.user_header()
        if header and between.endswith(header):
            return between[:len(between) - len(header)]
        # The template ends a last message differently (gpt-oss <|return|> for <|end|>) or writes more after
        # it (command-r always opens the next turn). The user header is a tail of ``between`` that also
        # stands before a first user message; the closing ends where a markup tag begins, as far as it
        # agrees with the final closing.
        first = self._before_first_user()
        cuts = [k for k in range(1, len(between) + 1)
                if (k == len(between) or between[k] in "<[") and first.endswith(between[k:])]
        agreed = len(_common_prefix(final, between))
        within = [k for k in cuts if k <= agreed]
        if within:
            return between[:max(within)]
        return between[:min(cuts)] if cuts and cuts[0] < len(between) else ""

    def _before_first_user(self) -> str:
        if self._first is None:
            try:
                text = self.render([Message("user", _S_NEXT)], add_generation_prompt=True)
            except TemplateError:
                text = ""
            self._first = text.split(_S_NEXT, 1)[0]
        return self._first

    def user_header(self) -> str:
        """What the template writes before a user message's text that follows a reply (``<|im_start|>user\\n``),
        learnt from a reply whose closing is known."""
        if self._header is None:
            self._header = ""
            hist = [Message("user", "a"), Message("assistant", "b")]
            try:
                probe = self.render([*_with_end(hist), Message("user", _S_NEXT)], add_generation_prompt=True)
                final = self.final_closing(hist)
            except TemplateError:
                return ""
            if _S_END in probe and _S_NEXT in probe:
                between = probe.split(_S_END, 1)[1].split(_S_NEXT, 1)[0]
                self._header = between[len(final):] if final and between.startswith(final) else ""
        return self._header

    def _without_repeated_system(self, history: Sequence[Message]) -> list[Message]:
        """The history to render a later user turn with: without the system prompt when the template would
        write it again into that turn (Mistral Nemo puts it into the last user message). The context
        already holds it once, from the first turn."""
        hist = list(history)
        if not any(m.role == "system" for m in hist) or not any(m.role == "user" for m in hist):
            return hist
        probe_hist = [Message(m.role, _S_SYS) if m.role == "system" else m for m in hist]
        try:
            probe = self.render([*_with_end(probe_hist), Message("user", _S_NEXT)], add_generation_prompt=True)
        except TemplateError:
            return hist
        if _S_END in probe and _S_SYS in probe.split(_S_END, 1)[1]:
            return [m for m in hist if m.role != "system"]
        return hist

    # -- reasoning -----------------------------------------------------------------------------------

    def reasoning_tags(self) -> tuple[str, str] | None:
        """The open/close pair this template's replies mark reasoning with, if any."""
        return self._tags

    def _find_reasoning_tags(self) -> tuple[str, str] | None:
        for tags in REASONING_TAGS:
            if tags[1] in self.source or (tags[0] == _HARMONY_OPEN and "<|channel|>analysis" in self.source):
                return tags
        return None

    def opens_reasoning(self) -> bool:
        """The generation prompt itself opens the reasoning block (Qwen3.5 with thinking on ends it with
        ``<think>\\n``): a reply then starts inside its reasoning, without the open tag."""
        if self._opens is None:
            self._opens = False
            if self._tags is not None:
                try:
                    text = self.render([Message("user", "u")], add_generation_prompt=True)
                except TemplateError:
                    return False
                self._opens = text.rstrip().endswith(self._tags[0])
        return self._opens

    def split_reasoning(self, text: str) -> tuple[str, str]:
        """A reply's text as (reasoning, answer): the reasoning block's inside, and the rest; ("", text) when
        the reply has no reasoning. A reply cut off while it reasons is all reasoning."""
        tags = self._tags
        if tags is None:
            return "", text
        start = self.opens_reasoning()
        open_tag, close_tag = tags
        body = text
        if not start:
            stripped = text.lstrip()
            if open_tag == _HARMONY_OPEN and stripped.startswith(_HARMONY_FINAL):
                return "", stripped[len(_HARMONY_FINAL):]
            if not stripped.startswith(open_tag):
                return "", text
            body = stripped[len(open_tag):]
        if close_tag not in body:
            return body.strip(), ""
        reasoning, answer = body.split(close_tag, 1)
        return reasoning.strip(), answer.lstrip()

    # -- stop strings ------------------------------------------------------------------------------

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
        if self._stops is None:
            # Asked per request by a server (three renderings: ~1 ms); the template does not change.
            self._stops = self._find_stop_strings()
        return list(self._stops)

    def _find_stop_strings(self) -> list[str]:
        try:
            probe = self.render(
                [Message("user", "a"), Message("assistant", _SENTINEL), Message("user", "b")],
                add_generation_prompt=False,
            )
        except TemplateError:
            return []
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


class ReasoningStream:
    """A reply's streamed text split into reasoning and answer as it comes, for showing them apart.

    ``feed`` takes each decoded piece and returns the (text, is_reasoning) runs that can be shown now: the
    reasoning block's tags are never shown, and a piece that may be the beginning of a tag is held back
    until it is clear. ``n_reasoning`` counts the pieces fed while reasoning (one per token as sampled).
    """

    def __init__(self, template: ChatTemplate) -> None:
        tags = template.reasoning_tags()
        self._open, self._close = tags or ("", "")
        self._active = tags is not None
        self._state = "reasoning" if template.opens_reasoning() else "start"
        self._buf = ""
        self.n_reasoning = 0

    @property
    def reasoning(self) -> bool:
        """The text being produced is (still) reasoning."""
        return self._active and self._state == "reasoning"

    def feed(self, piece: str) -> list[tuple[str, bool]]:
        if not self._active:
            return [(piece, False)] if piece else []
        if self._state == "reasoning":
            self.n_reasoning += 1
        self._buf += piece
        return self._drain()

    def finish(self) -> list[tuple[str, bool]]:
        """What is still held back when the reply ends."""
        rest, self._buf = self._buf, ""
        if not rest or (self._state != "reasoning" and not rest.strip()):
            return []
        return [(rest, self._state == "reasoning")]

    def _drain(self) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        while True:
            buf = self._buf
            if self._state == "start":
                s = buf.lstrip()
                finals = (_HARMONY_FINAL,) if self._open == _HARMONY_OPEN else ()
                if not s or any(t.startswith(s) and t != s for t in (self._open, *finals)):
                    return out  # only blanks so far, or the beginning of a tag
                if s.startswith(self._open):
                    self._state, self._buf = "reasoning", s[len(self._open):]
                    continue
                marker = next((t for t in finals if s.startswith(t)), "")
                self._state, self._buf = "answer", ""
                # No reasoning: the text as it came (its leading blanks too), as the stored reply has it.
                out.append((s[len(marker):] if marker else buf, False))
                return out
            if self._state == "reasoning":
                if self._close in buf:
                    head, self._buf = buf.split(self._close, 1)
                    if head:
                        out.append((head, True))
                    self._state = "answer_start"
                    continue
                keep = _held_tag_start(buf, self._close)
                if len(buf) > keep:
                    out.append((buf[:len(buf) - keep], True))
                    self._buf = buf[len(buf) - keep:]
                return out
            if self._state == "answer_start":
                s = buf.lstrip()
                if s:
                    self._state, self._buf = "answer", ""
                    out.append((s, False))
                return out
            self._buf = ""
            if buf:
                out.append((buf, False))
            return out


def _held_tag_start(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a beginning of ``tag`` (to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def strip_reasoning(text: str) -> str:
    """A reply's answer without a leading reasoning block in any of the forms llama.cpp's templates write
    (for matching a client's copy of a reply, which usually comes back without its reasoning)."""
    s = text.lstrip()
    if s.startswith(_HARMONY_FINAL):
        return s[len(_HARMONY_FINAL):]
    for open_tag, close_tag in REASONING_TAGS:
        if close_tag in s and (s.startswith(open_tag) or open_tag not in s.split(close_tag, 1)[0]):
            return s.split(close_tag, 1)[1].lstrip()
    return text


def read_template_file(path: str) -> str:
    """The text of a chat template file (``--chat-template``); a one-line ``TemplateError`` if unreadable."""
    from pathlib import Path

    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise TemplateError(f"cannot read the chat template {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TemplateError(f"the chat template {p} is not UTF-8 text") from None
    if not text.strip():
        raise TemplateError(f"the chat template {p} is empty")
    return text


def _with_end(history: Sequence[Message]) -> list[Message]:
    """``history`` with the end sentinel after the last message's content."""
    last = history[-1]
    return [*history[:-1], Message(last.role, last.content + _S_END)]


def _without_greeting(messages: Sequence[Message]) -> list[Message]:
    """Assistant messages before the first user message left out (a greeting the template refuses)."""
    out: list[Message] = []
    seen_user = False
    for m in messages:
        seen_user = seen_user or m.role == "user"
        if m.role == "assistant" and not seen_user:
            continue
        out.append(m)
    return out


def _fold_system(messages: Sequence[Message]) -> list[Message]:
    """System messages folded into the first user message (for templates that refuse a system role)."""
    system = "\n\n".join(m.content for m in messages if m.role == "system")
    rest = [m for m in messages if m.role != "system"]
    if not system:
        return rest
    for i, m in enumerate(rest):
        if m.role == "user":
            rest[i] = Message("user", system + "\n\n" + m.content)
            return rest
    # No user message yet (the persona alone): a user message holding the system prompt stands for it.
    return [Message("user", system), *rest]


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
    return any(s in text or stop_prefix_at_end(text, s, len(s) - 1) for s in stops)


def stop_prefix_at_end(text: str, stop: str, limit: int) -> int:
    """The longest beginning of ``stop``, at most ``limit`` characters, that ``text`` ends with (0: none).

    Asked for every token of a reply: only the beginnings whose last character is ``text``'s are compared
    (``rfind``), not every length (a ChatML stop string has ~25; per token the whole loop cost ~10 us)."""
    if not text:
        return 0
    last = text[-1]
    n = stop.rfind(last, 0, min(limit, len(text))) + 1  # stop[n - 1] == last
    while n > 0:
        if text.endswith(stop[:n]):
            return n
        n = stop.rfind(last, 0, n - 1) + 1
    return 0


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
