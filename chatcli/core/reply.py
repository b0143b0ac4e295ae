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

from chatcli.core.backend import Backend, GenerationResult, Sampling
from chatcli.core.events import Event, ReplyStart, ReplyText
from chatcli.core.template import ChatTemplate, Message, hold_back_stops


def reply_seed(conv_seed: int, turn: int, alt: int) -> int:
    """The sampler seed of one reply: same conversation, turn and alternative ⇒ same reply, any process."""
    h = hashlib.sha256(f"{conv_seed}:{turn}:{alt}".encode()).digest()
    return int.from_bytes(h[:4], "little")


@dataclass
class Draft:
    """A reply as far as it got: its text (template markup cut off) and how generation ended."""

    text: str = ""
    result: GenerationResult = field(default_factory=GenerationResult)


def stream_reply(backend: Backend, sampling: Sampling, draft: Draft, *, seed: int, max_tokens: int,
                 stop_strings: Sequence[str], turn: int, alt: int) -> Generator[Event, None, None]:
    """Sample a reply into ``draft``, yielding its text as it comes; each token joins the backend's sequence."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    # Pieces that may begin a stop string are held back until it is clear: markup is never shown.
    gen = hold_back_stops(backend.generate(sampling, seed=seed, max_tokens=max_tokens, result=draft.result,
                                           stop_strings=stop_strings), stop_strings)
    try:
        yield ReplyStart(turn, alt)
        for ev in gen:
            piece = decoder.decode(ev.piece)
            if piece:
                draft.text += piece
                if cut_stop(draft.text, stop_strings) is not None:
                    break
                yield ReplyText(piece)
    finally:
        close = getattr(gen, "close", None)
        if close is not None:
            close()  # also when our consumer went away (GeneratorExit): the backend keeps what it sampled
        draft.text += decoder.decode(b"", final=True)
        cut = cut_stop(draft.text, stop_strings)
        if cut is not None:
            draft.text = cut


def closing_tokens(backend: Backend, template: ChatTemplate, history: list[Message], text: str,
                   reply_tokens: list[int], stop: str) -> list[int]:
    """The tokens that close a reply as the template writes it (e.g. the "\\n" after ``<|im_end|>``)."""
    closing = template.closing([*history, Message("assistant", text)])
    if stop == "eog" and reply_tokens:
        eog_text = backend.piece(reply_tokens[-1], special=True).decode("utf-8", "replace")
        # A model may end with a token the template does not write (e.g. EOS after ChatML): then the
        # template's whole closing still follows, so the next turn reads as the template expects.
        if eog_text and closing.startswith(eog_text):
            closing = closing[len(eog_text):]
    elif stop == "stop" and reply_tokens:
        # Stopped at a closing marker the model spelled out in ordinary pieces (its vocabulary lacks it as
        # one token): the context already holds the marker; only what follows it is still missing.
        marker = closing.rstrip()
        tail = b"".join(backend.piece(t, special=True) for t in reply_tokens[-32:]).decode("utf-8", "replace")
        if marker and tail.endswith(marker):
            closing = closing[len(marker):]
    return backend.tokenize(closing, add_special=False) if closing else []


def cut_stop(text: str, stops: Sequence[str]) -> str | None:
    for s in stops:
        i = text.find(s)
        if i >= 0:
            return text[:i].rstrip()
    return None


def make_title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 60 else line[:57].rstrip() + "…"
