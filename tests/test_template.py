"""SmolLM2's chat template, rendered incrementally."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from chatcli.core.template import CHATML, ChatTemplate, Message, TemplateError, hold_back_stops
from chatcli.models.gguf import read_gguf


@pytest.fixture(scope="module")
def smol(model_path: Path) -> ChatTemplate:
    return ChatTemplate(read_gguf(model_path).chat_template)


def test_smollm2_renders_chatml(smol: ChatTemplate) -> None:
    text = smol.render([Message("system", "S"), Message("user", "U")], add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_prefix_is_the_persona_part(smol: ChatTemplate) -> None:
    persona = [Message("system", "S"), Message("user", "ex"), Message("assistant", "ans")]
    assert smol.prefix(persona) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nex<|im_end|>\n"
                                    "<|im_start|>assistant\nans<|im_end|>\n")


def test_incremental_turns_concatenate_to_the_full_rendering(smol: ChatTemplate) -> None:
    history = [Message("system", "S")]
    text = smol.prefix(history)
    for user, reply in [("a", "b"), ("c", "d"), ("e", "f")]:
        text += smol.user_turn(history, user)
        history += [Message("user", user), Message("assistant", reply)]
        text += reply + smol.closing(history)
    assert text == smol.render(history, add_generation_prompt=False)


def test_default_system_prompt_is_injected_without_persona(smol: ChatTemplate) -> None:
    assert "You are a helpful AI assistant named SmolLM" in smol.user_turn([], "hi")


def test_closing_and_stop_strings(smol: ChatTemplate) -> None:
    assert smol.closing([Message("user", "a"), Message("assistant", "b")]) == "<|im_end|>\n"
    assert smol.reply_stop_strings() == ["<|im_end|>\n<|im_start|>user", "<|im_end|>"]


def test_missing_template_falls_back_to_chatml() -> None:
    t = ChatTemplate(None)
    assert t.is_fallback and t.source == CHATML


def test_template_errors_are_one_line() -> None:
    with pytest.raises(TemplateError):
        ChatTemplate("{% for %}")
    t = ChatTemplate("{{ raise_exception('no system role') }}")
    with pytest.raises(TemplateError, match="no system role"):
        t.render([Message("user", "x")], add_generation_prompt=True)


# -- a vocabulary without the template's end-of-turn token (issue #11 item 4) ---------------------------


def test_chatml_fallback_stops_at_its_end_marker_alone() -> None:
    """A base model under the ChatML fallback may write ``<|im_end|>`` and then any role: the marker alone
    must end the reply, not only the full ``<|im_end|>\\n<|im_start|>user``."""
    assert ChatTemplate(None).reply_stop_strings() == ["<|im_end|>\n<|im_start|>user", "<|im_end|>"]
    # A closing that is a bare newline (or a word) is no markup and never a stop string.
    plain = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    assert plain.reply_stop_strings() == ["user:"]


@dataclass
class _Ev:
    piece: bytes
    n: int = 0


def test_pieces_that_may_start_a_stop_string_are_held_back() -> None:
    pieces = [b"Re", b"d.", b"</", b"b>", b" ok", b"</", b"turn", b">"]
    closed = []

    def events() -> Iterator[_Ev]:
        try:
            yield from (_Ev(p, i) for i, p in enumerate(pieces))
        finally:
            closed.append(True)

    out = list(hold_back_stops(events(), ["</turn>"]))
    # "</" is held until "b>" shows it is no stop string; "</turn>" reaches the consumer in one piece.
    assert [e.piece for e in out] == [b"Re", b"d.", b"</b>", b" ok", b"</turn>"]
    assert [e.n for e in out] == [0, 1, 3, 4, 7]  # a merged event is the last one, carrying all the bytes
    assert closed == [True]
    # Events that end while held are released; closing the filter early closes its source.
    assert [e.piece for e in hold_back_stops(iter([_Ev(b"a<"), _Ev(b"/t")]), ["</turn>"])] == [b"a</t"]
    closed.clear()
    gen = hold_back_stops(events(), ["</turn>"])
    next(gen)
    gen.close()
    assert closed == [True]


def test_stop_prefix_at_end_is_the_longest_beginning_the_text_ends_with() -> None:
    """The per-token check compares only the beginnings ending in the text's last character; it must find
    what comparing every length finds (random texts over the characters stop strings are made of)."""
    import random

    from chatcli.core.template import stop_prefix_at_end

    def every_length(text: str, stop: str, limit: int) -> int:
        return next((n for n in range(min(limit, len(text)), 0, -1) if text.endswith(stop[:n])), 0)

    rng = random.Random(7)
    for _ in range(20000):
        stop = "".join(rng.choice("<|>a\n") for _ in range(rng.randint(1, 8)))
        text = "".join(rng.choice("<|>a\n") for _ in range(rng.randint(0, 10)))
        limit = rng.randint(0, len(stop))
        assert stop_prefix_at_end(text, stop, limit) == every_length(text, stop, limit), (text, stop, limit)
    assert stop_prefix_at_end("Red.<|im", "<|im_end|>", 9) == 4
    assert stop_prefix_at_end("<|im_end|>", "<|im_end|>", 9) == 0  # the whole string is not a beginning


def test_end_marker_outside_the_vocabulary_never_reaches_the_reply(model_path: Path) -> None:
    """SmolLM2 under a ChatML-like template whose markers (``<turn>``, ``</turn>``) are not tokens of its
    vocabulary writes them as ordinary pieces (``</``, ``turn``, ``>``) and goes on with another turn; the
    reply shown and the one stored end before the marker. (Before: "Red.</turn>\\n<turn>assistant\\n…")"""
    from chatcli.core.events import ReplyEnd, ReplyText
    from tests.drive import build_session, drain

    session = build_session(max_tokens=40)
    try:
        assert len(session.engine.tokenize("</turn>")) > 1
        session.template = ChatTemplate(CHATML.replace("<|im_start|>", "<turn>").replace("<|im_end|>", "</turn>"))
        conv, _, _ = drain(session.new_conversation("alice"))
        assert conv is not None
        shown, end = "", None
        for ev in conv.send("Name a colour."):
            if isinstance(ev, ReplyText):
                shown += ev.text
            elif isinstance(ev, ReplyEnd):
                end = ev
        assert end is not None and end.message.stop == "stop"
        stored = end.message.text
        assert shown == stored and stored.strip()
        for text in (shown, stored, conv.messages[-1].text):
            assert "<turn" not in text and "</" not in text, text
        # The context holds the marker once, as the template writes it: the closing adds only what follows it.
        held = session.engine.detokenize(conv.messages[-1].tokens)
        assert held.endswith("</turn>\n") and held.count("</turn>") == 1, held
        conv.close()
    finally:
        session.close()
