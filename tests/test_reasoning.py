"""Reasoning apart from the answer, without a model: streaming split, transcript fields, export, display, and
the server's key for a reply sent back without its reasoning."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from chatcli.core.events import ReplyEnd, ReplyStart, ReplyText, TurnStats
from chatcli.core.export import to_markdown, to_messages
from chatcli.core.template import ChatTemplate, Message, ReasoningStream, strip_reasoning
from chatcli.core.transcript import ActiveMessage, message_parts, replay_events
from chatcli.repl.render import Renderer
from chatcli.server.history import message_key
from tests.test_templates_all import TEMPLATE_DIR


def _template(name: str) -> ChatTemplate:
    if TEMPLATE_DIR is None:
        pytest.skip("llama.cpp's models/templates not found")
    return ChatTemplate((TEMPLATE_DIR / f"{name}.jinja").read_text())


def _stream(t: ChatTemplate, text: str) -> tuple[str, str, int]:
    """Feed ``text`` one character at a time (the worst split a tag can get): (reasoning, answer, pieces)."""
    rs = ReasoningStream(t)
    runs: list[tuple[str, bool]] = []
    for ch in text:
        runs += rs.feed(ch)
    runs += rs.finish()
    return ("".join(r for r, is_r in runs if is_r), "".join(r for r, is_r in runs if not is_r), rs.n_reasoning)


def test_stream_splits_reasoning_and_never_shows_its_tags() -> None:
    t = _template("Qwen-Qwen3-0.6B")
    assert not t.opens_reasoning()
    reasoning, answer, n = _stream(t, "<think>\nlet me see\n</think>\n\nIt is 4.")
    assert reasoning.strip() == "let me see" and answer == "It is 4."
    assert n == len("\nlet me see\n</think>")  # pieces fed while reasoning, the closing tag's included
    assert _stream(t, "Plain answer <think> not a block")[1] == "Plain answer <think> not a block"


def test_stream_of_a_template_that_opens_reasoning_in_its_prompt() -> None:
    t = _template("Qwen3.5-4B")
    assert t.opens_reasoning()  # the generation prompt ends with <think>: the reply starts reasoning
    reasoning, answer, _ = _stream(t, "hmm\n</think>\n\nYes.")
    assert (reasoning.strip(), answer) == ("hmm", "Yes.")
    assert _stream(t, "cut off while thinking")[:2] == ("cut off while thinking", "")
    assert t.split_reasoning("hmm\n</think>\n\nYes.") == ("hmm", "Yes.")


def test_gpt_oss_channels() -> None:
    t = _template("openai-gpt-oss-120b")
    text = "<|channel|>analysis<|message|>think<|start|>assistant<|channel|>final<|message|>Done."
    assert t.split_reasoning(text) == ("think", "Done.")
    assert _stream(t, text)[:2] == ("think", "Done.")
    assert t.split_reasoning("<|channel|>final<|message|>Only.") == ("", "Only.")
    # The template refuses channel markup in a content field: the reply is handed to it split.
    hist = [Message("user", "q"), Message("assistant", text)]
    assert "Done." in t.user_turn(hist, "next") or t.user_turn(hist, "next").startswith("<|start|>user")


def test_strip_reasoning_matches_what_clients_send_back() -> None:
    for stored in ("<think>\nx\n</think>\n\nAnswer", "x\n</think>\n\nAnswer", "<seed:think>x</seed:think>Answer",
                   "<|channel|>final<|message|>Answer", "Answer"):
        assert strip_reasoning(stored).strip() == "Answer", stored
        assert message_key("k", "assistant", stored) == message_key("k", "assistant", "Answer")
    assert message_key("k", "user", "<think>a</think>b") != message_key("k", "user", "b")  # only replies


def _ev(mid: int, role: str, text: str, p0: int, **extra: Any) -> dict[str, Any]:
    toks = list(range(p0, p0 + 4))
    return {"type": "message", "mid": mid, "role": role, "text": text, "tokens": toks, "span": [p0, p0 + 4],
            "turn": 0, "v": 1, **extra}


def test_transcript_fields_and_older_lines() -> None:
    old = _ev(1, "assistant", "<think>r</think>a", 4)
    assert message_parts(old) == ("", None, 0)  # a line written before the fields existed: all answer
    new = _ev(1, "assistant", "<think>r</think>a", 4, reasoning={"text": "r", "tokens": [0, 3]},
              answer={"text": "a", "tokens": [3, 4]})
    r = replay_events([{"type": "prefix", "tokens": [0, 1, 2, 3], "messages": []}, _ev(0, "user", "q", 4),
                       {**new, "span": [8, 12], "mid": 1}])
    m = r.active[-1]
    assert (m.text, m.reasoning, m.shown, m.reasoning_tokens) == ("<think>r</think>a", "r", "a", 3)
    assert to_messages(r)[-1] == {"role": "assistant", "content": "a"}
    assert to_messages(r, reasoning=True)[-1] == {"role": "assistant", "content": "a", "reasoning_content": "r"}
    assert "*reasoning:* r" in to_markdown({}, r, reasoning=True) and "reasoning" not in to_markdown({}, r)


def _reply_events(reasoning: str, answer: str) -> list[Any]:
    msg = ActiveMessage(mid=1, role="assistant", text=f"<think>{reasoning}</think>{answer}", tokens=[1] * 9, p0=0,
                        turn=0, reasoning=reasoning, answer=answer, reasoning_tokens=5)
    return [ReplyStart(0, 0), *(ReplyText(w + " ", True) for w in reasoning.split()),
            *(ReplyText(w + " ") for w in answer.split()), ReplyEnd(msg, TurnStats())]


@pytest.mark.parametrize("show", [False, True])
def test_rich_display_folds_reasoning_unless_asked(show: bool) -> None:
    out = io.StringIO()
    r = Renderer(Console(file=out, width=100, height=30, color_system=None), err=io.StringIO(), show_reasoning=show)
    r.stream(_reply_events("weighing the options carefully", "Blue."))
    text = out.getvalue()
    # Counted as it streams (one piece per token); the line is printed for good when the answer begins.
    assert "thinking · 4 tok" in text and "Blue." in text
    assert text.index("thinking") < text.index("Blue.")
    assert ("weighing the options carefully" in text) is show


def test_plain_display_keeps_reasoning_off_stdout() -> None:
    out, err = io.StringIO(), io.StringIO()
    r = Renderer(Console(file=out, width=100), plain=True, err=err)
    r.stream(_reply_events("secret steps", "Blue."))
    assert out.getvalue().strip() == "Blue." and "thinking · 2 tok" in err.getvalue()
    r.reasoning("secret steps", 5, full=True)  # /think
    assert "secret steps" in err.getvalue()


def test_template_file_is_read_in_one_line(tmp_path: Path) -> None:
    from chatcli.core.template import TemplateError, read_template_file

    with pytest.raises(TemplateError, match="cannot read the chat template"):
        read_template_file(str(tmp_path / "missing.jinja"))
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(TemplateError, match="is empty"):
        read_template_file(str(tmp_path / "empty.jinja"))


def test_thinking_is_part_of_the_cache_key() -> None:
    src = (TEMPLATE_DIR / "Qwen3.5-4B.jinja").read_text() if TEMPLATE_DIR else "{{ x }}"
    keys = {ChatTemplate(src, enable_thinking=v).cache_key for v in (None, True, False)}
    assert len(keys) == 3 and ChatTemplate(src).cache_key == src  # unset: the key earlier caches have


def test_think_command_shows_the_last_reasoning_in_full() -> None:
    from tests.test_repl import FakeConversation, drive

    conv = FakeConversation(replies=["Blue."])
    _, out, _ = drive("/think\r\x04", conv)
    assert "error: the last reply has no reasoning" in out
    conv = FakeConversation(replies=["Blue."])
    _, _, _ = drive("colour?\r\x04", conv)
    conv._r.active[-1].reasoning, conv._r.active[-1].reasoning_tokens = "first red, then blue", 6
    _, out, _ = drive("/think\r\x04", conv)
    assert "thinking · 6 tok" in out and "first red, then blue" in out
