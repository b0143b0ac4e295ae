"""Sampling one reply: seeds, streaming text out of tokens, stop strings, and closing the turn.

``stream_reply`` turns the backend's token stream into ``ReplyStart``/``ReplyText`` events, decoding
UTF-8 across token boundaries and stopping where the model starts writing the next turn itself. What was
produced is kept in a ``Draft`` that survives the consumer going away, so the conversation can record a
reply that nobody finished reading exactly like a cancelled one.
"""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from chatcli.core.backend import Backend, GenerationResult, Sampling
from chatcli.core.events import Event, ReplyStart, ReplyText
from chatcli.core.template import ChatTemplate, Message, ReasoningStream, hold_back_stops


def reply_seed(conv_seed: int, turn: int, alt: int) -> int:
    """The sampler seed of one reply: same conversation, turn and alternative ⇒ same reply, any process."""
    h = hashlib.sha256(f"{conv_seed}:{turn}:{alt}".encode()).digest()
    return int.from_bytes(h[:4], "little")


@dataclass
class Draft:
    """A reply as far as it got: its text (template markup cut off) and how generation ended."""

    text: str = ""
    result: GenerationResult = field(default_factory=GenerationResult)
    cut: bool = False  # a stop string was cut off the text: the context holds more than ``text``


def stream_reply(backend: Backend, sampling: Sampling, draft: Draft, *, seed: int, max_tokens: int,
                 stop_strings: Sequence[str], turn: int, alt: int,
                 reasoning: ReasoningStream | None = None, defer_last: bool = False) -> Generator[Event, None, None]:
    """Sample a reply into ``draft``, yielding its text as it comes; each token joins the backend's sequence
    (but for the last with ``defer_last``: ``draft.result.undecoded``). With ``reasoning`` the text comes as
    reasoning and answer runs (``ReplyText.reasoning``), tags left out."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    # Pieces that may begin a stop string are held back until it is clear: markup is never shown.
    gen = hold_back_stops(backend.generate(sampling, seed=seed, max_tokens=max_tokens, result=draft.result,
                                           stop_strings=stop_strings, defer_last=defer_last), stop_strings)
    try:
        yield ReplyStart(turn, alt)
        for ev in gen:
            piece = decoder.decode(ev.piece)
            if piece:
                draft.text += piece
                if cut_stop(draft.text, stop_strings) is not None:
                    break
                if reasoning is None:
                    yield ReplyText(piece)
                    continue
                for run, is_reasoning in reasoning.feed(piece):
                    yield ReplyText(run, is_reasoning)
        if reasoning is not None:
            for run, is_reasoning in reasoning.finish():
                yield ReplyText(run, is_reasoning)
    finally:
        close = getattr(gen, "close", None)
        if close is not None:
            close()  # also when our consumer went away (GeneratorExit): the backend keeps what it sampled
        draft.text += decoder.decode(b"", final=True)
        cut = cut_stop(draft.text, stop_strings)
        if cut is not None:
            draft.text = cut
            draft.cut = True


def closing_tokens(backend: Backend, template: ChatTemplate, history: list[Message], text: str,
                   reply_tokens: list[int], stop: str) -> list[int]:
    """The tokens that close a reply as the template writes it (e.g. the "\\n" after ``<|im_end|>``).

    What the model already wrote of the closing (its end-of-turn token, or a marker it spelled out in
    ordinary pieces because its vocabulary lacks it as one token) is not written again. The template's
    closing of a final message counts too: gpt-oss ends a reply with ``<|return|>`` where a turn that
    others follow ends with ``<|end|>``, and the context keeps what the model generated. A model that ends
    with a token the template does not write (e.g. EOS after ChatML) gets the template's whole closing,
    so the next turn reads as the template expects.
    """
    msgs = [*history, Message("assistant", text)]
    closing = template.closing(msgs)
    if stop in ("eog", "stop") and reply_tokens:
        # An end-of-generation token is the last one; a spelled-out marker takes a few pieces.
        last = reply_tokens[-1:] if stop == "eog" else reply_tokens[-32:]
        # A spelled-out marker is read in ordinary pieces only: a reply rolled back to the text before a stop
        # string ends with the text, then the whole closing, whose marker token must not count as written
        # by the model (the rebuild plan would decode it alone, and the rebuilt KV would differ).
        tail = b"".join(backend.piece(t, special=stop == "eog") for t in last).decode("utf-8", "replace")
        for form in (closing, template.final_closing(msgs)):
            k = _written(tail, form)
            if k:
                closing = form[k:]
                break
    return backend.tokenize(closing, add_special=False) if closing else []


def _written(tail: str, closing: str) -> int:
    """How much of ``closing`` the reply's ``tail`` already ends with (its first characters)."""
    for k in range(len(closing), 0, -1):
        if tail.endswith(closing[:k]):
            return k
    return 0


def reasoning_parts(backend: Backend, template: ChatTemplate, text: str,
                    tokens: Sequence[int]) -> dict[str, Any] | None:
    """A reply's reasoning and answer as separate spans over its token ids (offsets into ``tokens``), for
    the transcript; None for a reply without reasoning. The reasoning span ends with the token that
    completes the closing tag (the tokens are the truth: the text is not tokenized again)."""
    reasoning, answer = template.split_reasoning(text)
    tags = template.reasoning_tags()
    if not reasoning or tags is None:
        return None
    k, seen = len(tokens), b""
    close = tags[1].encode()
    # A remote backend renders a list in one request (``pieces``); one request per token would not do.
    batch = getattr(backend, "pieces", None)
    pieces = batch(list(tokens)) if callable(batch) else [backend.piece(t, special=True) for t in tokens]
    for i, piece in enumerate(pieces):
        seen += piece
        if close in seen:
            k = i + 1
            break
    return {"reasoning": {"text": reasoning, "tokens": [0, k]}, "answer": {"text": answer, "tokens": [k, len(tokens)]}}


def returned_tokens(backend: Backend, reply_tokens: Sequence[int], text: str) -> tuple[int, list[int]]:
    """How to make the context hold exactly ``text`` after a stop string was cut from the reply: keep the
    first ``k`` sampled tokens (those whose pieces ``text`` begins with) and add the tokens of the rest of
    ``text`` that a kept token did not cover (the part of the token that also held the stop string)."""
    want = text.encode("utf-8")
    done = b""
    k = 0
    for tok in reply_tokens:
        piece = backend.piece(tok, special=False)
        if not want.startswith(done + piece):
            break
        done += piece
        k += 1
    rest = want[len(done):].decode("utf-8", "replace")
    return k, backend.tokenize(rest, add_special=False, parse_special=False) if rest else []


def cut_stop(text: str, stops: Sequence[str]) -> str | None:
    for s in stops:
        i = text.find(s)
        if i >= 0:
            return text[:i].rstrip()
    return None


def make_title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 60 else line[:57].rstrip() + "…"
