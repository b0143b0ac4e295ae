"""Rollback on the real model: regen, edit, undo/redo, alternatives and forks never re-ingest history."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chatcli.core.conversation import Conversation
from chatcli.core.events import ConversationError, MessageTooLongError, ReplyEnd
from chatcli.core.forking import fork_conversation
from chatcli.core.kv import records as sf
from tests.drive import build_session, drain, say, says
from tests.drive import run_process as drive
from tests.golden import new_conv

M = ["Hi! What is your name?", "What is the capital of France?", "And of Italy?"]


def test_regen_after_resume_evaluates_no_history_and_repeats_greedy_reply() -> None:
    first = drive("--new", *says(M[:2]))
    res = drive("--resume", first["id"], "--regen")
    assert res["evaluated_after_open"] == 0
    assert res["regen_stats"]["reevaluated"] == 0  # sampled from the saved logits, nothing re-read
    assert res["regen_stats"]["dropped"] == len(first["replies"][1])  # exactly the old reply's tokens
    assert res["replies"][0] == first["replies"][1]  # same state ⇒ same greedy tokens


def test_regen_counts_only_new_tokens_and_keeps_alternatives() -> None:
    session = build_session(temperature=0.9, seed=5)
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    say(conv, M[0])
    original = conv.messages[-1]
    before = session.engine.n_evaluated_total
    kept = original.p0
    _, _, ends = drain(conv.regen())
    end = ends[-1]
    # Evaluated: only the new reply's tokens (decoded one by one) — never the history before it.
    assert session.engine.n_evaluated_total - before == len(end.message.tokens)
    assert end.stats.kept == kept and end.stats.reevaluated == 0
    assert end.message.tokens != original.tokens  # a fresh seed per alternative
    alts = conv.r.alternatives(original.turn)
    assert [a["text"] for a in sorted(alts, key=lambda a: a["alt"])] == [original.text, end.message.text]
    # Switching back costs no evaluation: the old reply's cells are still in the state file.
    before = session.engine.n_evaluated_total
    stats = conv.switch_alt(0)
    assert session.engine.n_evaluated_total == before and stats.n_eval == 0
    assert conv.messages[-1].text == original.text and session.engine.tokens[kept:] == original.tokens
    conv.close()
    session.close()


def test_edit_continues_like_a_conversation_that_had_the_edit_from_the_start() -> None:
    session = build_session()
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    say(conv, M[0])
    say(conv, M[1])
    before = session.engine.n_evaluated_total
    _, _, ends = drain(conv.edit(2, "What is the capital of Spain?"))
    edited_eval = session.engine.n_evaluated_total - before
    assert edited_eval == ends[-1].stats.n_eval  # only the edited message and its reply
    edited_tokens = list(session.engine.tokens)
    edited_logits = conv.turn_logits[1].copy()  # type: ignore[index]
    conv.close()
    fresh, _, _ = drain(session.new_conversation("alice"))
    assert fresh is not None
    say(fresh, M[0])
    say(fresh, "What is the capital of Spain?")
    assert session.engine.tokens == edited_tokens
    assert np.array_equal(fresh.turn_logits[1], edited_logits)  # type: ignore[index]
    fresh.close()
    session.close()


def test_undo_redo_round_trip() -> None:
    session = build_session()
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    for m in M:
        say(conv, m)
    full_tokens = list(session.engine.tokens)
    full_texts = [m.text for m in conv.messages]
    one_turn = conv.messages[1].p1
    before = session.engine.n_evaluated_total
    stats = conv.undo(2)
    assert session.engine.n_evaluated_total == before  # undo evaluates nothing
    assert session.engine.tokens == full_tokens[:one_turn] and stats.dropped == len(full_tokens) - one_turn
    assert [m.text for m in conv.messages] == full_texts[:2]
    stats = conv.redo()
    assert session.engine.tokens == full_tokens
    assert [m.text for m in conv.messages] == full_texts
    assert session.engine.n_evaluated_total == before and stats.reevaluated == 0  # cells read back from disk
    conv.close()
    # Undo and redo survive a resume: the transcript replays to the same state.
    conv2, report, _ = drain(session.open_conversation(conv.id))
    assert conv2 is not None and report is not None and report.reevaluated == 0
    assert [m.text for m in conv2.messages] == full_texts
    conv2.undo(1)
    conv2.close()
    conv3, _, _ = drain(session.open_conversation(conv.id))
    assert conv3 is not None
    assert [m.text for m in conv3.messages] == full_texts[:4]
    assert conv3.r.redo  # still redoable after a restart
    conv3.redo()
    assert [m.text for m in conv3.messages] == full_texts
    conv3.close()
    session.close()


def test_alternatives_survive_resume(tmp_path: Path) -> None:
    first = drive("--new", "--temperature", "0.9", "--seed", "3", *says(M[:1]))
    session = build_session(temperature=0.9, seed=3)
    conv, _, _ = drain(session.open_conversation(first["id"]))
    assert conv is not None
    drain(conv.regen())
    drain(conv.regen())
    texts = [a["text"] for a in sorted(conv.r.alternatives(0), key=lambda a: a["alt"])]
    assert len(texts) == 3 and len(set(texts)) >= 2
    conv.close()
    session.close()
    session = build_session(temperature=0.9, seed=3)
    conv, report, _ = drain(session.open_conversation(first["id"]))
    assert conv is not None and report is not None and report.reevaluated == 0
    assert [a["text"] for a in sorted(conv.r.alternatives(0), key=lambda a: a["alt"])] == texts
    assert conv.messages[-1].text == texts[2]
    conv.switch_alt(0)
    assert conv.messages[-1].text == texts[0]
    conv.close()
    session.close()


def test_alt_switch_after_resume_undo_redo_regen_reads_the_cells_back() -> None:
    """Each alternative reply of a turn has its own CELLS record at the same position: switching back reads
    the older one (it used to take only the newest record there, the other alternative's, and evaluate)."""
    from chatcli.config.settings import get_paths
    from chatcli.core.files.store import ConversationStore
    from chatcli.core.forking import fork_conversation

    session = build_session(temperature=0.9, seed=5, max_tokens=8)
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    say(conv, M[0])
    say(conv, M[1])
    conv.close()
    ref_id, _ = fork_conversation(ConversationStore(get_paths().conversations_dir), conv.id, 2)  # the reference
    eng = session.engine
    conv, report, _ = drain(session.open_conversation(conv.id))
    assert conv is not None and report is not None and report.reevaluated == 0
    before = eng.n_evaluated_total
    conv.undo(1)
    assert conv.redo().n_eval == 0 and eng.n_evaluated_total == before
    original = conv.messages[-1]
    want = list(eng.tokens)
    _, _, ends = drain(conv.regen(seed=11))
    new = ends[-1].message.tokens
    # The case that failed: the new alternative's record is no longer than the original's.
    assert new != original.tokens and len(new) <= len(original.tokens)
    before = eng.n_evaluated_total
    stats = conv.switch_alt(0)
    assert stats.n_eval == 0 and eng.n_evaluated_total == before
    assert eng.tokens == want and conv.messages[-1].text == original.text
    stats = conv.switch_alt(1)  # and forth: the newer alternative's cells too
    assert stats.n_eval == 0 and eng.n_evaluated_total == before
    conv.switch_alt(0)
    toks, logits = say(conv, M[2])
    tokens_after = list(eng.tokens)
    conv.close()
    ref, _, _ = drain(session.open_conversation(ref_id))
    assert ref is not None
    ref_toks, ref_logits = say(ref, M[2])
    assert eng.tokens == tokens_after and ref_toks == toks
    assert np.array_equal(ref_logits, logits)  # the KV read back is bit-identical to the uninterrupted one
    ref.close()
    session.close()


def test_fork_continues_like_the_parent(tmp_path: Path) -> None:
    from chatcli.config.settings import get_paths
    from chatcli.core.files.store import ConversationStore
    from chatcli.core.forking import fork_conversation

    parent = drive("--new", *says(M), logits=tmp_path / "parent.npy")
    child_id, copied = fork_conversation(ConversationStore(get_paths().conversations_dir), parent["id"], 2)
    assert copied > 0
    child = drive("--resume", child_id, *says(M[2:]), logits=tmp_path / "child.npy")
    assert child["report"]["reevaluated"] == 0 and child["evaluated_after_open"] == 0
    assert child["replies"][0] == parent["replies"][2]
    assert np.array_equal(np.load(tmp_path / "child.npy")[0], np.load(tmp_path / "parent.npy")[2])


def test_many_rollbacks_keep_the_state_file_bounded_and_exact(tmp_path: Path) -> None:
    session = build_session(temperature=0.9, seed=11)
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    say(conv, M[0])
    say(conv, M[1])
    for _ in range(12):
        drain(conv.regen())
    conv.undo(1)
    conv.redo()
    path = conv.dir.state_path
    res = sf.scan(path)
    # Compaction: the dead records never outweigh the live ones plus those /alt can still read back (the
    # other replies of the last turn, kept as SPARE records by a compaction). /redo no longer appends a
    # copy of what it reads back, which used to push the file over that bound into a compaction here.
    live = res.live_bytes() + sum(r.size for r in conv.log._spares([c.record for c in res.live()[0]]))
    assert path.stat().st_size <= 2 * live
    assert sf.REVIVE in _kinds(path)
    assert res.problem == ""
    # A copy of the folder as it is now, resumed in another process, continues bit-identically.
    copy_dir = path.parent.parent / "copyxx"
    shutil.copytree(path.parent, copy_dir)
    (copy_dir / "lock").unlink(missing_ok=True)
    _, here = say(conv, M[2])
    conv.close()
    session.close()
    there = drive("--resume", "copyxx", "--temperature", "0.9", "--seed", "11", *says(M[2:]), logits=tmp_path / "c.npy")
    assert there["report"]["reevaluated"] == 0
    assert np.array_equal(np.load(tmp_path / "c.npy")[0], here)


def test_a_reply_whose_reader_goes_away_is_kept_consistent() -> None:
    """Closing the event stream mid-reply (a renderer error, a closed pipe) records the partial reply like
    a Ctrl-C'd one: the context and the transcript never disagree, now or after a resume."""
    from chatcli.core.events import ReplyText

    session = build_session()
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    say(conv, M[0])
    events = conv.send("Tell me a long story about a dragon.")
    for ev in events:
        if isinstance(ev, ReplyText):
            break
    events.close()
    assert session.engine.tokens == conv.r.tokens()
    assert conv.messages[-1].role == "assistant" and conv.messages[-1].stop == "cancelled"
    drain(conv.regen())
    assert session.engine.tokens == conv.r.tokens()
    conv.close()
    again, report, _ = drain(session.open_conversation(conv.id))
    assert again is not None and report is not None
    assert report.reevaluated == 0 and report.reason == "" and again.r.problems == []
    again.close()
    session.close()


def test_regen_with_an_explicit_seed_is_reproducible() -> None:
    session = build_session(temperature=1.0, seed=21)
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    say(conv, M[0])
    replies = []
    for seed in (5, 5, 6):
        _, _, ends = drain(conv.regen(seed=seed))
        replies.append(ends[-1].message.tokens)
    assert replies[0] == replies[1] != replies[2]
    conv.close()
    session.close()


# -- every rollback operation validates first (one engine for these tests, n_ctx 512) ------------------------

N_CTX = 512
BASE_SESSION = {"threads": 2, "n_ctx": N_CTX, "max_tokens": 16}  # golden.base_session, this module's settings


def snapshot(conv: Conversation) -> tuple[Any, ...]:
    """Everything a refused operation must leave alone."""
    return (
        [(m.mid, m.role, m.text, tuple(m.tokens), m.p0) for m in conv.messages],
        conv.context.n_past, list(conv.engine.tokens), [list(x) for x in conv.r.redo],
        conv.dir.transcript_path.read_bytes(), conv.dir.state_path.read_bytes(), conv.dir.meta_path.read_bytes(),
    )


def test_refused_rollbacks_change_nothing(sess: Any) -> None:
    conv = new_conv(sess, "Hi, who are you?", "Name a colour.")
    try:
        before = snapshot(conv)
        refusals = {
            "edit too long for the context": lambda: list(conv.edit(1, "word " * 600)),
            "edit of the last message too long": lambda: list(conv.edit(None, "word " * 600)),
            "edit of a message that does not exist": lambda: list(conv.edit(3, "hello")),
            "edit of message 0": lambda: list(conv.edit(0, "hello")),
            "edit to empty text": lambda: list(conv.edit(1, "   ")),
            "undo of nothing": lambda: conv.undo(0),
            "undo of more than there is": lambda: conv.undo(3),
            "redo with nothing undone": lambda: conv.redo(),
            "alt that does not exist": lambda: conv.switch_alt(1),
            "alt -1": lambda: conv.switch_alt(-1),
        }
        for what, op in refusals.items():
            with pytest.raises(ConversationError):
                op()
            assert snapshot(conv) == before, what
        # A refused fork creates nothing and leaves the parent alone.
        ids = sess.store.ids()
        with pytest.raises(ConversationError):
            fork_conversation(sess.store, conv.id, 5)
        assert sess.store.ids() == ids and snapshot(conv) == before
        # Refused, yet usable: a real edit still works afterwards, and an undo can be redone.
        assert any(isinstance(ev, ReplyEnd) for ev in conv.edit(2, "Name a fruit."))
        conv.undo()
        undone = snapshot(conv)
        with pytest.raises(MessageTooLongError):
            list(conv.edit(1, "word " * 600))
        assert snapshot(conv) == undone  # the redo stack survived the refusal
        conv.redo()
        assert [m.role for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    finally:
        conv.close()
    empty = new_conv(sess)
    try:
        before = snapshot(empty)
        with pytest.raises(ConversationError):
            list(empty.regen())
        with pytest.raises(ConversationError):
            list(empty.edit(None, "hello"))
        assert snapshot(empty) == before
    finally:
        empty.close()


M4 = [*M, "And of Spain?"]


def _kinds(path: Path) -> list[int]:
    return [r.kind for r in sf.scan(path).records]


def _fork(conv: Conversation, exchanges: int) -> str:
    return _fork_id(conv.id, exchanges)


def _continue(session: Any, cid: str, text: str) -> tuple[list[int], np.ndarray]:
    ref, report, _ = drain(session.open_conversation(cid))
    assert ref is not None and report is not None and report.reevaluated == 0
    out = say(ref, text)
    ref.close()
    return out


def test_redo_after_undoing_most_of_the_conversation_reads_the_undone_cells_back() -> None:
    """/undo 3 of 4 exchanges leaves more dead bytes than live ones. That used to compact the state file,
    dropping the undone cells, so /redo evaluated all of them again (found in the REPL: 961 tokens, ~20 s)."""
    session = build_session()
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    for m in M4:
        say(conv, m)
    eng = session.engine
    want = list(eng.tokens)
    ref_id = _fork(conv, len(M4))  # never undone
    before = eng.n_evaluated_total
    assert conv.undo(3).reevaluated == 0
    stats = conv.redo()
    assert stats.n_eval == 0 and stats.reevaluated == 0 and eng.n_evaluated_total == before
    assert eng.tokens == want
    toks, logits = say(conv, "And of Germany?")
    conv.close()
    ref_toks, ref_logits = _continue(session, ref_id, "And of Germany?")
    assert toks == ref_toks and np.array_equal(logits, ref_logits)  # as if never undone
    session.close()


def _regen_until_compacted(conv: Conversation, on_each: Any = None) -> None:
    """Regenerate the last reply until a compaction rewrites the state file (it shrinks): the older
    alternatives are dead records nothing can switch to any more."""
    path = conv.dir.state_path
    for _ in range(30):
        size = path.stat().st_size
        drain(conv.regen())
        if on_each is not None:
            on_each()
        if path.stat().st_size < size:
            return
    raise AssertionError("no compaction after 30 regenerations")


def test_compaction_keeps_the_alternatives_alt_can_switch_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regenerating a reply again and again makes dead records (the older alternatives) until a compaction
    rewrites the state file. It used to drop every alternative's cells, so /alt evaluated the reply again;
    the newest SPARE_ALTS other replies are now kept (SPARE records) and read back, bit-identically."""
    from chatcli.core import conversation

    monkeypatch.setattr(conversation, "SPARE_ALTS", 2)  # fewer regenerations until a compaction
    session = build_session(temperature=0.9, seed=5, max_tokens=48)
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    say(conv, M[0])
    eng = session.engine
    refs: dict[int, str] = {}  # an alternative's mid -> a fork made while it was the active reply
    _regen_until_compacted(conv, lambda: refs.update({conv.messages[-1].mid: _fork(conv, 1)}))
    p0 = conv.messages[-1].p0
    others = [a for a in conv.alternatives() if not a.active][-2:]
    before = eng.n_evaluated_total
    for alt in reversed(others):
        stats = conv.switch_alt(alt.index)
        assert stats.n_eval == 0 and eng.n_evaluated_total == before, alt
        assert eng.tokens[p0:] == [int(t) for t in conv.r.all[alt.mid]["tokens"]]
    assert sf.SPARE in _kinds(conv.dir.state_path)
    toks, logits = say(conv, M[1])
    conv.close()
    ref_toks, ref_logits = _continue(session, refs[others[0].mid], M[1])
    assert toks == ref_toks and np.array_equal(logits, ref_logits)
    session.close()


def test_redo_and_alt_after_a_compaction_read_the_cells_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a compaction the live state is one snapshot: an undo cutting into it saves the part it cuts
    (a SPARE record), and the compaction an undo triggers keeps the undone exchanges and the other replies
    of the turn a redo brings back: /redo, then /alt, evaluate nothing."""
    from chatcli.core import conversation

    monkeypatch.setattr(conversation, "SPARE_ALTS", 1)
    session = build_session(temperature=0.9, seed=3, max_tokens=48)
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    for m in M:
        say(conv, m)
    eng = session.engine
    _regen_until_compacted(conv)
    assert _kinds(conv.dir.state_path)[1] == sf.SNAPSHOT
    want = list(eng.tokens)
    other = [a.mid for a in conv.alternatives() if not a.active][-1]
    ref_id = _fork(conv, len(M))
    before = eng.n_evaluated_total
    assert conv.undo(2).reevaluated == 0
    stats = conv.redo()
    assert stats.n_eval == 0 and eng.n_evaluated_total == before and eng.tokens == want
    active = conv.messages[-1].mid
    assert conv.switch_alt(next(a.index for a in conv.alternatives() if a.mid == other)).n_eval == 0
    assert conv.switch_alt(next(a.index for a in conv.alternatives() if a.mid == active)).n_eval == 0
    assert eng.tokens == want and eng.n_evaluated_total == before
    toks, logits = say(conv, "And of Germany?")
    conv.close()
    ref_toks, ref_logits = _continue(session, ref_id, "And of Germany?")
    assert toks == ref_toks and np.array_equal(logits, ref_logits)
    session.close()


@pytest.mark.parametrize("copies", [False, True], ids=["revive", "copies-as-before"])
def test_redo_and_alt_append_no_copy_of_what_they_read_back(copies: bool, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    """/redo and /alt read cells back from the state file; they used to append a full copy of them (after
    /undo 8 of 9 exchanges and /redo the file grew from 17.4 to 29.9 MB). Now each record read back is made
    live again by a REVIVE record naming it: a few dozen bytes. A resume in a new process loads the cells
    from the records named, evaluates nothing, and the next reply is bit-identical to a conversation never
    rolled back. ``copies``: a file written the old way (what chatcli wrote before) resumes the same."""
    from chatcli.core.kv.log import CellLog

    if copies:
        monkeypatch.setattr(CellLog, "_revive", lambda self, rec, payload: [sf.encode_record(
            sf.LOGITS if rec.kind == sf.LOGITS else sf.live_kind(rec.p0), rec.p0, rec.p1, payload, rec.flags)])
    session = build_session(temperature=0.9, seed=3)
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    for m in M:
        say(conv, m)
    eng = session.engine
    want = list(eng.tokens)
    ref_id = _fork(conv, len(M))  # never rolled back
    path = conv.dir.state_path
    before = eng.n_evaluated_total
    conv.undo(2)
    size = path.stat().st_size
    assert conv.redo().n_eval == 0 and eng.tokens == want and eng.n_evaluated_total == before
    grown = path.stat().st_size - size
    drain(conv.regen())
    size, before = path.stat().st_size, eng.n_evaluated_total
    assert conv.switch_alt(0).n_eval == 0 and eng.tokens == want and eng.n_evaluated_total == before
    grown_alt = path.stat().st_size - size
    undone = len(want) - conv.messages[2].p0
    if copies:
        assert grown > 1000 * undone and sf.REVIVE not in _kinds(path)
    else:
        # 4 REVIVE records and the REVIVE_LOGITS of the last user message's logits; a TRUNCATE and 1 REVIVE
        assert grown < 250 and grown_alt < 200, (grown, grown_alt)
    conv.close()
    here = drive("--resume", conv.id, *says(["And of Germany?"]), logits=tmp_path / "here.npy")
    assert here["report"]["reevaluated"] == 0 and here["evaluated_after_open"] == 0, here["report"]
    there = drive("--resume", ref_id, *says(["And of Germany?"]), logits=tmp_path / "there.npy")
    assert here["replies"] == there["replies"]
    assert np.array_equal(np.load(tmp_path / "here.npy"), np.load(tmp_path / "there.npy"))
    session.close()


def test_a_redo_cut_short_is_known_only_where_the_transcript_ends() -> None:
    """/redo writes one activate event per message; the replay knows which ones a /redo killed between them
    still had to bring back (the opening appends those) — but only when nothing follows: an older version
    that went on from the partial redo wrote a history that stands as it is (old transcripts still load)."""
    from chatcli.core.transcript import replay_events

    def msg(mid: int, role: str, p0: int) -> dict[str, Any]:
        return {"type": "message", "mid": mid, "role": role, "text": role, "tokens": [mid, mid], "span": [p0, p0 + 2],
                "turn": mid // 2}

    head = [{"type": "prefix", "tokens": [1, 2], "span": [0, 2]}, msg(0, "user", 2), msg(1, "assistant", 4),
            msg(2, "user", 6), msg(3, "assistant", 8), {"type": "truncate", "to": 2, "reason": "undo"}]
    torn = [*head, {"type": "activate", "mid": 0, "p0": 2, "redo": True}]
    r = replay_events(torn)
    assert r.torn_redo == [1, 2, 3] and r.brought_back == 2 and not r.redo and not r.problems
    r = replay_events([*torn, {"type": "activate", "mid": 1, "p0": 4, "redo": False}])
    assert r.torn_redo == [2, 3] and r.brought_back == 2
    whole = [*torn, *({"type": "activate", "mid": m, "p0": 2 * m + 2, "redo": False} for m in (1, 2, 3))]
    r = replay_events(whole)
    assert r.torn_redo == [] and [m.mid for m in r.active] == [0, 1, 2, 3] and r.brought_back == 2
    # What an older chatcli wrote after resuming a torn redo: its next message follows the partial state.
    r = replay_events([*torn, msg(4, "user", 4), msg(5, "assistant", 6)])
    assert r.torn_redo == [] and [m.mid for m in r.active] == [0, 4, 5] and r.brought_back == -1 and not r.problems


def test_an_alt_killed_before_its_state_records_resumes_reading_the_reply_back(tmp_path: Path) -> None:
    """/alt writes its transcript events (truncate, activate) before its state records: killed in between,
    the state file still holds the reply it switched from. The resume cuts that, reads the reply switched
    to back from its record (nothing evaluated, not reported as damage) and continues bit-identically to a
    conversation that never had the other reply."""
    first = drive("--new", "--temperature", "0.9", "--seed", "3", *says(M[:2]))
    ref_id = _fork_id(first["id"], 2)
    session = build_session(temperature=0.9, seed=3)
    conv, _, _ = drain(session.open_conversation(first["id"]))
    assert conv is not None
    drain(conv.regen())
    original = next(a for a in conv.alternatives() if not a.active)
    assert conv.r.all[original.mid]["tokens"] != conv.messages[-1].tokens  # another reply to switch from
    to = conv.messages[-1].p0
    # What _switch_alt writes before put_back and the state records (the kill comes after them).
    conv.transcript.append({"type": "truncate", "to": to, "reason": "alt"})
    conv.transcript.append({"type": "activate", "mid": original.mid, "p0": to})
    conv.close()
    session.close()
    here = drive("--resume", first["id"], *says(M[2:]), logits=tmp_path / "here.npy")
    assert here["report"]["reevaluated"] == 0 and here["evaluated_after_open"] == 0, here["report"]
    assert here["report"]["reason"] == "" and here["tokens"][:len(first["tokens"])] == first["tokens"]
    there = drive("--resume", ref_id, *says(M[2:]), logits=tmp_path / "there.npy")
    assert here["replies"] == there["replies"]
    assert np.array_equal(np.load(tmp_path / "here.npy"), np.load(tmp_path / "there.npy"))


def _fork_id(cid: str, exchanges: int) -> str:
    from chatcli.config.settings import get_paths
    from chatcli.core.files.store import ConversationStore

    return fork_conversation(ConversationStore(get_paths().conversations_dir), cid, exchanges)[0]
