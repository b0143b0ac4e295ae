"""Long conversations on the real model: the persona prefix cache and a context shift that never misses."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chatcli.core.events import MessageTooLongError, Notice
from tests.drive import build_session, drain, run_process, say

N_CTX = 512


def long_message(i: int) -> str:
    return (f"Message {i}. Please remember the number {i * 7} and tell me a short fact about the sea, "
            "the mountains, the rivers and the stars, in one sentence.")


def test_three_contexts_worth_of_chat_never_re_evaluates() -> None:
    session = build_session(n_ctx=N_CTX, reserve=64, max_tokens=40)
    eng = session.engine
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    prefix = list(conv.r.prefix_tokens)
    total, shifts, i = 0, 0, 0
    while total < 3 * N_CTX:
        before = eng.n_evaluated_total
        events = list(conv.send(long_message(i)))
        end = events[-1]
        shifts += sum(1 for e in events if isinstance(e, Notice) and "left the context" in e.text)
        new = end.stats.n_prompt + len(end.message.tokens)
        assert eng.n_evaluated_total - before == new == end.stats.n_eval  # only this turn's tokens
        assert eng.tokens[: len(prefix)] == prefix  # the persona is still at positions 0..k
        assert eng.seq_pos_max() == eng.n_past - 1 <= N_CTX - 1
        total += new
        i += 1
    assert shifts >= 2
    # After the shifts the context is the prefix plus the most recent whole exchanges.
    assert conv.messages[0].role == "user"
    assert eng.tokens == conv.r.tokens()
    # The shifted cache still makes sense: it predicts like a fresh evaluation of the same tokens
    # (RoPE-rotated f16 keys round differently, so close rather than equal).
    shifted = eng.logits()
    conv.close()
    session.close()
    fresh = build_session(n_ctx=N_CTX)
    fresh.engine.eval(list(conv.r.tokens()))
    assert np.corrcoef(shifted, fresh.engine.logits())[0, 1] > 0.99
    fresh.close()


def _drive(*args: str, logits: Path | None = None) -> dict[str, Any]:
    return run_process("--n-ctx", str(N_CTX), "--max-tokens", "40", *args, logits=logits)


def test_resume_after_shift_continues_exactly(tmp_path: Path) -> None:
    msgs = [a for i in range(9) for a in ("--say", long_message(i))]
    whole = _drive("--new", *msgs, logits=tmp_path / "whole.npy")
    part = _drive("--new", *msgs[:-2])
    assert part["replies"] == whole["replies"][:-1]
    rest = _drive("--resume", part["id"], *msgs[-2:], logits=tmp_path / "rest.npy")
    assert rest["report"]["reevaluated"] == 0 and rest["evaluated_after_open"] == 0
    assert rest["replies"][0] == whole["replies"][-1]
    assert np.array_equal(np.load(tmp_path / "rest.npy")[0], np.load(tmp_path / "whole.npy")[-1])
    transcript = (Path(os.environ["CHATCLI_HOME"]) / "data" / "conversations" / part["id"] / "transcript.jsonl").read_text()
    assert '"type":"shift"' in transcript  # the test really crossed a shift


def test_message_too_long_is_refused_and_nothing_changes() -> None:
    session = build_session(n_ctx=N_CTX, reserve=64)
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    say(conv, "Hello")
    transcript = conv.dir.transcript_path.read_text()
    tokens = list(session.engine.tokens)
    with pytest.raises(MessageTooLongError, match="too long"):
        drain(conv.send("word " * 2000))
    assert conv.dir.transcript_path.read_text() == transcript
    assert session.engine.tokens == tokens
    say(conv, "Still there?")  # and the conversation goes on
    conv.close()
    session.close()


def test_model_that_cannot_shift_rebuilds_the_kept_context() -> None:
    session = build_session(n_ctx=N_CTX, reserve=64, max_tokens=40)
    session.engine.can_shift = False  # what llama_memory_can_shift reports for e.g. recurrent models
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    notices: list[str] = []
    for i in range(8):
        events = list(conv.send(long_message(i)))
        notices += [e.text for e in events if isinstance(e, Notice)]
    assert sum("cannot be shifted" in n for n in notices) == 1  # told once
    assert session.engine.tokens == conv.r.tokens()
    assert session.engine.tokens[: len(conv.r.prefix_tokens)] == conv.r.prefix_tokens
    conv.close()
    session.close()


def test_persona_prefix_is_evaluated_once_and_reused(tmp_path: Path) -> None:
    session = build_session()
    eng = session.engine
    first, _, _ = drain(session.new_conversation("alice"))
    assert first is not None
    n_prefix = len(first.r.prefix_tokens)
    assert eng.n_evaluated_total == n_prefix > 0
    first.close()
    opening = session.new_conversation("alice")
    events = list(opening)
    second = opening.conversation
    assert eng.n_evaluated_total == n_prefix  # loaded from the cache: nothing evaluated
    assert any(isinstance(e, Notice) and "from cache" in e.text for e in events)
    cached_tokens = list(eng.tokens)
    # The cached and the evaluated prefix behave identically.
    _, a = say(second, "Hello!")
    second.close()
    cache = Path(os.environ["CHATCLI_HOME"]) / "cache" / "prefix"
    for f in cache.iterdir():
        f.unlink()
    third, _, _ = drain(session.new_conversation("alice"))
    assert eng.tokens == cached_tokens and eng.n_evaluated_total > n_prefix
    _, b = say(third, "Hello!")
    assert np.array_equal(a, b)
    third.close()
    # A conversation keeps working with the cache cleared (it has its own copy of the cells).
    for f in cache.iterdir():
        f.unlink()
    again, report, _ = drain(session.open_conversation(second.id))
    assert again is not None and report is not None and report.reevaluated == 0
    again.close()
    session.close()


def test_editing_the_persona_invalidates_its_cache() -> None:
    home = Path(os.environ["CHATCLI_HOME"])
    pdir = home / "config" / "personas"
    pdir.mkdir(parents=True)
    (pdir / "bob.toml").write_text('name = "bob"\ndescription = "d"\nsystem = "You are Bob."\n')
    session = build_session(persona="bob")
    c1, _, _ = drain(session.new_conversation("bob"))
    n1 = session.engine.n_evaluated_total
    c1.close()  # type: ignore[union-attr]
    (pdir / "bob.toml").write_text('name = "bob"\ndescription = "d"\nsystem = "You are Bob, a sailor."\n')
    c2, _, _ = drain(session.new_conversation("bob"))
    assert session.engine.n_evaluated_total > n1  # new text: evaluated again
    c2.close()  # type: ignore[union-attr]
    (pdir / "bob.toml").write_text('name = "bob"\ndescription = "changed"\nsystem = "You are Bob, a sailor."\n')
    n2 = session.engine.n_evaluated_total
    c3, _, _ = drain(session.new_conversation("bob"))
    assert session.engine.n_evaluated_total == n2  # description is not part of the prefix: still cached
    c3.close()  # type: ignore[union-attr]
    session.close()
