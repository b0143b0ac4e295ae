"""Forks share their parent's state bytes (a hard link and a BASE record) instead of copying them.

Real model throughout: a fork resumed in a new process continues bit-identically to its parent, whatever
happens to the parent afterwards (it grows, it is compacted, it is removed); a base that is missing, damaged
or replaced is detected and the fork rebuilds from its transcript; an older chatcli refuses a fork's state
file; the state budget counts shared bytes once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from chatcli.core.kv import records as sf
from tests.drive import build_session, drain, says
from tests.drive import run_process as drive

M = ["Hi! What is your name?", "What is the capital of France?", "And of Italy?", "And of Spain?"]
runner = CliRunner()


def _store() -> Any:
    from chatcli.config.settings import get_paths
    from chatcli.core.files.store import ConversationStore

    return ConversationStore(get_paths().conversations_dir)


def _fork(parent: str, at: int) -> tuple[str, int]:
    from chatcli.core.forking import fork_conversation

    return fork_conversation(_store(), parent, at)


def _bases(cid: str) -> list[Path]:
    return sf.base_files(_store().resolve(cid).state_path)


def test_fork_shares_the_inode_and_continues_bit_identically_after_the_parent_grows_compacts_and_goes(
        tmp_path: Path) -> None:
    parent = drive("--new", *says(M[:2]), logits=tmp_path / "parent.npy")
    pdir = _store().resolve(parent["id"])
    size_before = pdir.state_path.stat().st_size
    child_id, copied = _fork(parent["id"], 1)
    assert copied > 0
    cdir = _store().resolve(child_id)
    # Shared, not copied: the child's own file is a header, a BASE record and a TRUNCATE.
    [base] = _bases(child_id)
    assert os.path.samefile(base, pdir.state_path) and pdir.state_path.stat().st_nlink == 2
    assert cdir.state_path.stat().st_size < 2048 < size_before
    res = sf.scan(cdir.state_path)
    assert res.problem == "" and res.header is not None and res.live()[2] == copied
    assert res.bases == [base.name] and res.base_bytes == size_before
    assert [r.kind for r in res.records if r.file is None] == [sf.HEADER, sf.BASE, sf.TRUNCATE]

    # The parent grows (appends to the shared inode beyond the base's length), then is compacted (a rewrite:
    # a new inode), then removed.
    grown = drive("--resume", parent["id"], *says(M[2:3]), logits=tmp_path / "grown.npy")
    assert grown["report"]["reevaluated"] == 0
    session = build_session()
    conv, _, _ = drain(session.open_conversation(parent["id"]))
    assert conv is not None
    conv.log._rewrite_state()  # type: ignore[attr-defined]  # what compaction and context shifts do
    conv.close()
    session.close()
    assert not os.path.samefile(base, pdir.state_path)
    assert base.stat().st_nlink == 1  # the child's link is the last one: the parent's bytes live on for it
    _store().remove(pdir)

    child = drive("--resume", child_id, *says(M[1:3]), logits=tmp_path / "child.npy")
    assert child["report"]["reevaluated"] == 0 and child["report"]["reason"] == ""
    assert child["report"]["restored_tokens"] == copied and child["evaluated_after_open"] == 0
    assert child["replies"] == parent["replies"][1:] + grown["replies"]
    want = np.concatenate([np.load(tmp_path / "parent.npy")[1:], np.load(tmp_path / "grown.npy")])
    assert np.array_equal(np.load(tmp_path / "child.npy"), want)
    # The child's own turns were appended to its own small file, after the BASE record.
    assert _bases(child_id) == [base]
    again = drive("--resume", child_id, *says(M[3:]))
    assert again["report"]["reevaluated"] == 0 and again["report"]["reason"] == ""


def test_a_fork_of_a_fork_links_both_bases_and_a_rewrite_makes_the_fork_whole(tmp_path: Path) -> None:
    parent = drive("--new", *says(M[:3]), logits=tmp_path / "parent.npy")
    # A fork of the whole conversation holds only a header and a BASE record; a fork of that fork checks the
    # first fork's own last record (its BASE record), not its base's.
    whole, n_whole = _fork(parent["id"], 3)
    assert [r.kind for r in sf.scan(_store().resolve(whole).state_path).records if r.file is None] == [sf.HEADER, sf.BASE]
    twice, n_twice = _fork(whole, 3)
    res = sf.scan(_store().resolve(twice).state_path)
    assert res.problem == "" and res.depth == 2 and res.live()[2] == n_twice == n_whole
    opened = drive("--resume", twice)
    assert opened["report"]["reevaluated"] == 0 and opened["report"]["reason"] == ""
    mid, _ = _fork(parent["id"], 2)
    drive("--resume", mid, *says(["Tell me a joke."]))
    leaf, copied = _fork(mid, 1)
    res = sf.scan(_store().resolve(leaf).state_path)
    assert res.problem == "" and res.depth == 2 and len(_bases(leaf)) == 2 and res.live()[2] == copied
    child = drive("--resume", leaf, *says(M[1:3]), logits=tmp_path / "leaf.npy")
    assert child["report"]["reevaluated"] == 0 and child["replies"] == parent["replies"][1:]
    assert np.array_equal(np.load(tmp_path / "leaf.npy"), np.load(tmp_path / "parent.npy")[1:])
    # A rewrite of the fork writes a self-contained file and drops its base links.
    session = build_session()
    conv, report, _ = drain(session.open_conversation(leaf))
    assert conv is not None and report is not None and report.reevaluated == 0
    conv.log._rewrite_state()  # type: ignore[attr-defined]
    conv.close()
    session.close()
    assert _bases(leaf) == []
    assert sf.scan(_store().resolve(leaf).state_path).bases == []
    again = drive("--resume", leaf, *says(M[3:]))
    assert again["report"]["reevaluated"] == 0 and again["report"]["reason"] == ""


@pytest.mark.parametrize("how", ["removed", "corrupted", "replaced"])
def test_a_missing_damaged_or_foreign_base_rebuilds_from_the_transcript(how: str, tmp_path: Path) -> None:
    parent = drive("--new", *says(M[:2]), logits=tmp_path / "parent.npy")
    other = drive("--new", *says(["Name a colour."]))
    child_id, copied = _fork(parent["id"], 1)
    [base] = _bases(child_id)
    if how == "removed":
        base.unlink()
        needle = "missing"
    elif how == "corrupted":
        # A copy with one byte of a cell flipped (a new inode: the parent keeps its good bytes).
        data = bytearray(base.read_bytes())
        cells = next(r for r in sf.scan(base).records if r.kind == sf.CELLS)
        data[cells.offset + sf.HEADER_SIZE + 4 * (cells.p1 - cells.p0) + 100] ^= 0x55
        base.unlink()
        base.write_bytes(bytes(data))
        needle = "checksum mismatch"
    else:
        base.unlink()
        os.link(_store().resolve(other["id"]).state_path, base)
        needle = ""  # "does not match", "shorter than recorded" or "unusable": which check sees it first
    child = drive("--resume", child_id, *says(M[1:2]), logits=tmp_path / "child.npy")
    report = child["report"]
    assert needle in report["reason"] and "shared base" in report["reason"], report
    assert report["restored_tokens"] + report["reevaluated"] == copied
    # Rebuilt from the transcript: the same reply and logits as the parent (batched as first evaluated).
    assert child["replies"] == parent["replies"][1:]
    assert np.array_equal(np.load(tmp_path / "child.npy"), np.load(tmp_path / "parent.npy")[1:])
    # The rebuild rewrote the child's state whole: it no longer needs a base.
    assert _bases(child_id) == [] and sf.scan(_store().resolve(child_id).state_path).problem == ""
    assert drive("--resume", child_id)["report"]["reevaluated"] == 0


def test_an_older_chatcli_refuses_a_fork_and_still_reads_plain_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader of state format 1 (before BASE records) would skip the BASE record and restore the wrong
    cells: a fork's file says format 2, which such a reader refuses in one line; other files stay format 1."""
    from chatcli.cli.app import app
    from chatcli.core.files import migrations

    parent = drive("--new", *says(M[:1]))
    child_id, _ = _fork(parent["id"], 1)
    child_state = _store().resolve(child_id).state_path
    assert b'"format": 2' in child_state.read_bytes()[:400]
    assert b'"format": 1' in _store().resolve(parent["id"]).state_path.read_bytes()[:400]
    monkeypatch.setattr(sf, "FORMAT_VERSION", sf.PLAIN_FORMAT)  # what chatcli before format 2 checks
    with pytest.raises(migrations.FormatError, match="state file format 2 was written by a newer chatcli"):
        _store().resolve(child_id).read_meta()
    res = sf.scan(child_state)
    assert res.newer_format and res.header is None
    assert sf.scan(_store().resolve(parent["id"]).state_path).problem == ""
    before = child_state.read_bytes()
    result = runner.invoke(app, ["resume", child_id], input="")
    assert result.exit_code == 1 and "state file format 2" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert child_state.read_bytes() == before
    assert migrations.STATE_VERSION == sf.BASE_FORMAT


def test_the_budget_counts_shared_bytes_once_and_frees_them_with_their_last_link() -> None:
    from chatcli.config.settings import get_paths
    from chatcli.core.kv.budget import enforce, scan_usage, total_bytes

    paths = get_paths()
    parent = drive("--new", *says(M[:2]))
    pdir = _store().resolve(parent["id"])
    p_size = pdir.state_path.stat().st_size
    child_id, _ = _fork(parent["id"], 2)
    c_size = _store().resolve(child_id).state_path.stat().st_size
    usage = scan_usage(paths.conversations_dir, paths.prefix_cache_dir)
    prefixes = usage.prefixes
    assert usage.conversations == p_size + c_size  # not 2 * p_size
    assert usage.total == total_bytes(paths.conversations_dir, paths.prefix_cache_dir) == p_size + c_size + prefixes
    # The parent is the least recently used: dropping it frees nothing of the bytes the fork shares, so the
    # budget goes on to the fork, whose eviction frees them.
    os.utime(pdir.state_path, (1, 1))
    meta = pdir.read_meta()
    meta["updated"] = 1.0
    pdir.write_meta(meta)
    freed = enforce(paths.conversations_dir, None, p_size)
    assert [i.conv_id for i in freed.evicted] == [parent["id"], child_id]
    assert freed.freed == p_size + c_size == freed.before - freed.after
    assert scan_usage(paths.conversations_dir, None).total == freed.after == 0
    assert _bases(child_id) == []
    # A fork that is the only one evicted frees only its own small file.
    parent2 = drive("--new", *says(M[:1]))
    p2 = _store().resolve(parent2["id"]).state_path.stat().st_size
    child2, _ = _fork(parent2["id"], 1)
    c2 = _store().resolve(child2).state_path.stat().st_size
    freed = enforce(paths.conversations_dir, None, p2, keep_ids=[parent2["id"]])
    assert [i.conv_id for i in freed.evicted] == [child2] and freed.freed == c2 and freed.after == p2


def test_where_a_link_cannot_be_made_the_fork_copies(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another filesystem (EXDEV), no permission (EPERM), too many links: the live records are copied byte for
    byte into a self-contained file (format 1), which continues exactly like the parent."""
    import errno

    parent = drive("--new", *says(M[:2]), logits=tmp_path / "parent.npy")

    def no_link(*_args: object, **_kw: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    with monkeypatch.context() as mp:
        mp.setattr(os, "link", no_link)
        child_id, copied = _fork(parent["id"], 1)
    state = _store().resolve(child_id).state_path
    assert _bases(child_id) == [] and state.stat().st_nlink == 1
    res = sf.scan(state)
    assert res.problem == "" and res.bases == [] and res.live()[2] == copied
    assert b'"format": 1' in state.read_bytes()[:400]
    assert _store().resolve(parent["id"]).state_path.stat().st_nlink == 1
    child = drive("--resume", child_id, *says(M[1:2]), logits=tmp_path / "child.npy")
    assert child["report"]["reevaluated"] == 0 and child["replies"] == parent["replies"][1:]
    assert np.array_equal(np.load(tmp_path / "child.npy"), np.load(tmp_path / "parent.npy")[1:])


def test_a_copied_fork_writes_revived_cells_as_live_records(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A parent whose /redo revived a SPARE record (an /undo into a compacted snapshot saved the part it cut):
    a fork that copies the live records writes that one as the CELLS record the state sees (its own bytes
    say SPARE, and a REVIVE's offset means nothing in another file), and continues exactly like the parent."""
    import errno

    from tests.drive import say

    session = build_session()
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    for m in M[:3]:
        say(conv, m)
    conv.log.compact()  # type: ignore[attr-defined]
    conv.undo(1)
    assert conv.redo().n_eval == 0
    parent_state = conv.dir.state_path
    kinds = [r.kind for r in sf.scan(parent_state).records]
    assert kinds[-1] == sf.REVIVE and sf.SPARE in kinds, kinds
    conv.close()
    session.close()

    def no_link(*_args: object, **_kw: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    with monkeypatch.context() as mp:
        mp.setattr(os, "link", no_link)
        child_id, copied = _fork(conv.id, 3)
    res = sf.scan(_store().resolve(child_id).state_path)
    assert res.problem == "" and copied == res.live()[2] == sf.scan(parent_state).live()[2]
    assert [r.kind for r in res.records if r.kind in (sf.SPARE, sf.REVIVE)] == []
    child = drive("--resume", child_id, *says(M[3:]), logits=tmp_path / "child.npy")
    parent = drive("--resume", conv.id, *says(M[3:]), logits=tmp_path / "parent.npy")
    assert child["report"]["reevaluated"] == 0 and parent["report"]["reevaluated"] == 0
    assert child["replies"] == parent["replies"]
    assert np.array_equal(np.load(tmp_path / "child.npy"), np.load(tmp_path / "parent.npy"))


# -- the one fork function, on the fake backend (tests/fakes.py): CLI forks at exchanges, the server anywhere --


@pytest.mark.fast
def test_a_fork_after_any_message_holds_exactly_those_messages(tmp_path: Path) -> None:
    from chatcli.core.files.store import ConversationStore
    from chatcli.core.forking import fork_after
    from tests.fakes import FakeBackend, new_conversation, open_again, say

    eng = FakeBackend()
    store_dir = tmp_path / "conversations"
    conv = new_conversation(eng, store_dir)
    say(conv, "one", reply="uno")
    say(conv, "two", reply="dos")
    upto = {k: list(conv.r.prefix_tokens) + [t for m in conv.r.active[:k] for t in m.tokens] for k in range(5)}
    parent = conv.dir
    conv.close()
    store = ConversationStore(store_dir)
    for k in (0, 1, 3):  # the persona alone, a user message without its reply, mid-conversation
        child_id, held = fork_after(store, parent, k, {"source": "api"})
        assert held == len(upto[k])
        eng.clear()
        n0 = eng.n_evaluated_total
        child, report = open_again(eng, store_dir, child_id)
        assert eng.tokens == eng.kv == upto[k] and report.reevaluated == 0 and eng.n_evaluated_total == n0
        assert child.meta["forked_from"] == parent.id and child.meta["source"] == "api"
        child.close()


@pytest.mark.fast
def test_a_fork_that_fails_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from chatcli.core import forking
    from chatcli.core.events import ConversationError
    from chatcli.core.files.store import ConversationStore
    from tests.fakes import FakeBackend, new_conversation, say

    conv = new_conversation(FakeBackend(), tmp_path / "conversations")
    say(conv, "one", reply="uno")
    conv.close()
    store = ConversationStore(tmp_path / "conversations")
    ids = store.ids()
    with pytest.raises(ConversationError):
        forking.fork_after(store, conv.dir, 3, {})  # it has two messages
    monkeypatch.setattr(forking, "fork_state", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        forking.fork_conversation(store, conv.id, 1)
    assert store.ids() == ids
