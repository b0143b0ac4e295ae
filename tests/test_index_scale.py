"""The index at many conversations (issue #23's goals): what `ls` and a walk cost, counted rather than timed.

Policy tests (no model): conversations are written through the store, copied as bench/scale.py copies them,
and each test compares a cost (SQLite virtual-machine steps, stat calls) at a small and a larger store, or
checks a kept value (the counts, the pruned removals) against the query it replaces.
"""

from __future__ import annotations

import io
import os
import sqlite3
import time
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest

from chatcli.cli import listing
from chatcli.config.settings import get_paths
from chatcli.core.files import index as index_mod
from chatcli.core.files.index import Index, Row
from chatcli.core.files.store import ConversationStore
from tests.test_index import _conv, _copies, _say, _settle, _store, _vm_steps


def _ls_work(store: ConversationStore) -> None:
    """What `chatcli ls` asks of the index (``listing._rows_from_index``), without printing."""
    index = store.index
    assert index is not None
    index.reconcile()
    rows = index.rows(limit=listing.DEFAULT_LIMIT)
    index.check_rows(rows, lambda cid: listing._replay_counts(store, cid))
    index.count()
    index.problems()
    index.state_total()


def test_ls_reads_the_same_from_sqlite_at_60_and_at_360_conversations(
        chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ls` flat to 100,000 when the index is current: no statement reads a row per conversation. (The
    count and the unusable rows were read by scanning every row, 0.18 s of `ls` at 100,000, and the 50
    most recent through an index on ``updated`` alone, sorting every tie: 2,426 → 11,126 steps here.)
    The slice of folders each call checks is as big at both sizes (both are past it, as 100,000 is)."""
    monkeypatch.setattr(index_mod, "SLICE_FOLDERS", 20)
    base = _conv(_store(), "t", "hello", "world")  # copies: every row ties on ``updated``
    _copies(base, 59, "a")
    _settle(_store())
    _ls_work(_store())  # the first `ls` after copies replays the shown rows' counts: measured is the next
    store = _store()
    small = _vm_steps(store, lambda: _ls_work(store))
    _copies(base, 300, "b")
    _settle(_store())
    _ls_work(_store())
    store = _store()
    big = _vm_steps(store, lambda: _ls_work(store))
    assert store.index is not None and store.index.count()[0] == 360
    assert big <= small + 50, (small, big)


def test_the_kept_counts_match_a_count_of_the_rows(chatcli_home: Path) -> None:
    """The triggers keep (conversations, warm ones) through every kind of change, and an index made
    without them (an earlier build of schema 2) gets them, counted, when it is opened."""
    store = _store()
    convs = [_conv(store, f"t{i}", "hello", "world") for i in range(4)]
    index = store.index
    assert index is not None

    def counted() -> tuple[int, int]:
        row = index.db().execute("SELECT COUNT(*), COALESCE(SUM((CASE WHEN server != '' THEN checkpoint_bytes "
                                 "ELSE state_bytes END) > 0), 0) FROM convs WHERE ok=1").fetchone()
        return int(row[0]), int(row[1])

    assert index.count() == counted() == (4, 0)
    convs[0].state_path.write_bytes(b"x" * 100)  # warm: a state file, as a turn writes it
    index.note_state(convs[0])
    assert index.count() == counted() == (4, 1)
    store.remove(convs[1])
    assert index.count() == counted() == (3, 1)
    convs[2].meta_path.write_text("{not json", "utf-8")  # unusable
    index.refresh(convs[2].id)
    assert index.count() == counted() == (2, 1)
    with index.write() as w:
        for name in ("convs_n_ins", "convs_n_del", "convs_n_upd"):
            w.execute(f"DROP TRIGGER {name}")
        w.execute("DELETE FROM info WHERE key IN ('n_ok', 'n_warm')")
    index.close()
    reopened = _store().index
    assert reopened is not None and reopened.count() == (2, 1)
    assert reopened.db().execute("SELECT COUNT(*) FROM sqlite_master WHERE type='trigger'").fetchone()[0] == 3


def test_a_moved_conversations_folder_walks_names_without_a_stat_per_folder(
        chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder copied in moves the conversations folder's mtime: that can only mean names changed, so
    the walk is one scandir and the new folder's own stats, the same at 20 as at 220 conversations
    (a stat per folder before: ~0.3 s at 100,000), besides the slice's, as many at both sizes. The
    periodic walk (WALK_EVERY_S) is of names too: no stat per folder in any call but a full one."""
    monkeypatch.setattr(index_mod, "SLICE_FOLDERS", 10)
    base = _conv(_store(), "t", "hello", "world")
    real_stat = os.stat

    def stats_of_a_copy(n_copies: int, tag: str) -> tuple[int, index_mod.Walk | None]:
        _copies(base, n_copies, tag)
        index = _settle(_store())
        _copies(base, 1, tag + "new")
        old = time.time() - 200
        os.utime(index.root, (old, old))
        calls = [0]

        def counting(path: object, *args: object, **kwargs: object) -> os.stat_result:
            if str(path).startswith(str(index.root)):
                calls[0] += 1
            return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "stat", counting)
        try:
            assert index.reconcile() == 1
        finally:
            monkeypatch.setattr(os, "stat", real_stat)
        return calls[0], index.last_walk

    small, walk = stats_of_a_copy(19, "a")
    assert walk is not None and walk.kind == "names" and walk.reread == 1
    big, walk = stats_of_a_copy(200, "b")
    assert walk is not None and walk.kind == "names" and walk.reread == 1 and walk.folders == 222
    assert big == small, (small, big)
    index = _store().index
    assert index is not None
    before = index.walks()
    with index.write() as w:  # the last walk is WALK_EVERY_S old: its names are listed again
        w.execute("UPDATE info SET value = value - ? WHERE key='walked_at'", (int((index_mod.WALK_EVERY_S + 1) * 1e9),))
    index.reconcile()
    assert index.last_walk is not None and index.last_walk.kind == "names"
    assert index.walks()["names"] == before["names"] + 1 and index.walks().get("full") == before.get("full")


def test_a_folder_removed_by_hand_is_forgotten_by_a_names_walk(chatcli_home: Path) -> None:
    import shutil

    store = _store()
    convs = [_conv(store, f"t{i}", "hello", "world") for i in range(3)]
    index = _settle(store)
    shutil.rmtree(convs[1].path)
    old = time.time() - 200
    os.utime(store.root, (old, old))
    assert index.reconcile() == 1
    assert index.last_walk is not None and index.last_walk.kind == "names" and index.last_walk.gone == 1
    assert sorted(index.ids()) == sorted([convs[0].id, convs[2].id]) and index.count() == (2, 0)


def test_the_removed_table_is_pruned_and_a_server_behind_it_checks_everything(
        chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from chatcli.server.index import PrefixIndex

    monkeypatch.setattr(index_mod, "KEEP_REMOVED", 2)
    store = _store()
    convs = [_conv(store, f"t{i}", "hello", "world") for i in range(6)]

    def prefix() -> PrefixIndex:
        return PrefixIndex(_store(), get_paths().data_dir / "server" / "index.json", model_identity={"m": 1},
                           n_ctx=4096, template_source="t")

    server = prefix()
    server.refresh()
    server.save()
    assert len(server) == 6
    for conv in convs[:4]:  # while the server is down
        store.remove(conv)
    index = store.index
    assert index is not None
    assert index.db().execute("SELECT COUNT(*) FROM removed").fetchone()[0] == 2
    assert index.removed_floor() > 0
    restarted = prefix()
    restarted.refresh()
    assert len(restarted) == 2 and sorted(restarted._rows.ids()) == sorted(c.id for c in convs[4:])


def test_a_reply_reindex_does_not_wait_for_another_process_holding_the_index(
        chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service re-indexes a reply under its lock: another process's long write (here an open
    ``BEGIN IMMEDIATE``) made it wait up to the 5 s busy timeout, holding up every request. It now gives
    up after ``UPDATE_WAIT_S`` and the conversation is re-read from its transcript at the next refresh."""
    from chatcli.core.transcript import replay_events
    from chatcli.server import index as server_index
    from chatcli.server.index import PrefixIndex, Shape

    store = _store()
    conv = _conv(store, "t", "hello", "world")
    idx = PrefixIndex(store, get_paths().data_dir / "server" / "index.json", model_identity={"m": 1},
                      n_ctx=4096, template_source="t")
    idx.refresh()
    _say(conv, 2, "one more", "reply")
    # The service hands an open Conversation; its shape is what the transcript replays to.
    monkeypatch.setattr(Shape, "of", classmethod(lambda cls, c: Shape.of_replay(replay_events(
        store.dir(c.id).read_transcript().events))))
    opened = SimpleNamespace(id=conv.id, meta=conv.read_meta())
    other = sqlite3.connect(get_paths().data_dir / "index.sqlite", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process writing
    try:
        t = time.perf_counter()
        idx.update(opened)  # type: ignore[arg-type]
        waited = time.perf_counter() - t
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert waited < 1.0, waited
    assert idx._pending == {conv.id}
    stamp = idx._rows.stamp(conv.id)
    assert stamp is not None and stamp[0] != conv.transcript_path.stat().st_size  # not re-indexed yet
    checked: list[str] = []
    real = PrefixIndex._check_many

    def counting(self: PrefixIndex, items: list[tuple[str, str]]) -> None:
        checked.extend(cid for cid, _ in items)
        real(self, items)

    monkeypatch.setattr(PrefixIndex, "_check_many", counting)
    idx.refresh()
    stamp = idx._rows.stamp(conv.id)
    assert conv.id in checked and idx._pending == set()
    assert stamp is not None and stamp[0] == conv.transcript_path.stat().st_size
    assert server_index.UPDATE_WAIT_S < 1.0


def test_ls_into_a_pipe_prints_the_same_lines_from_the_index_rows(chatcli_home: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`ls` into a pipe formats the index's rows directly (``_tsv``): the same lines as the general path
    (``_print_rows``), with the server and "from" columns, odd titles and a warm row."""
    rows = [Row("a1", "plain", "alice", "m", "", "", "f16", 10, 1_700_000_000.5, 1, 1, 0),
            Row("b2", "tab\there", "bob", "m", "api", "http://host:8080", "q8_0", 99, 1_650_000_000.0, 3, 2, 5_000_000),
            Row("c3", "üñí ✓", "", "m", "", "", "f16", 0, 0.0, 0, 0, 123)]
    monkeypatch.setattr(listing.sys.stdout, "isatty", lambda: False, raising=False)
    buf = io.StringIO()
    with redirect_stdout(buf):
        listing._print_rows([r.as_listing() for r in rows])
    assert listing._tsv(rows) == buf.getvalue()
    plain = rows[:1]
    buf = io.StringIO()
    with redirect_stdout(buf):
        listing._print_rows([r.as_listing() for r in plain])
    assert listing._tsv(plain) == buf.getvalue()


@pytest.mark.parametrize("which", ["all", "plain", "local", "shifted"])
def test_ls_on_a_terminal_prints_the_same_lines_from_the_index_rows(which: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal too the index's rows are formatted directly (``_screen_lines``): the same lines as the
    general path (``_print_rows``: its screen columns), with and without the server, "from" and
    "in_context" columns, a quantized warm row, a server named "local", a control character, a title too
    wide to fit and one of another year."""
    import time as time_module

    from chatcli.cli import listing as listing_module

    now = time_module.time()
    rows = [Row("a1", "plain", "alice", "m", "", "", "f16", 10, now - 60, 1, 1, 0),
            Row("b2", "tab\there, and a title far too long to fit in its column " * 2, "bob", "m", "api",
                "http://host:8080", "q8_0", 99, 1_650_000_000.0, 3, 2, 5_000_000),
            Row("c3", "üñí ✓ 中文", "", "m", "", "", "f16", 0, 0.0, 0, 0, 123)]
    picked = {"all": rows, "plain": rows[:1],
              "local": [rows[0], rows[2]._replace(server="http://local")],
              "shifted": [rows[0], rows[2]._replace(in_context=0, turns=4)]}[which]

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    for width in (60, 200):
        buf = Tty()
        size = os.terminal_size((width, 40))
        monkeypatch.setattr(listing_module.shutil, "get_terminal_size", lambda *a, size=size: size)
        with redirect_stdout(buf):
            listing_module._print_rows([r.as_listing() for r in picked])
        bold = not os.environ.get("NO_COLOR")
        assert listing_module._screen_lines(picked, width, bold_header=bold) == buf.getvalue().splitlines()


def test_all_rows_sorted_as_the_limited_query_sorts_them(chatcli_home: Path) -> None:
    """``rows()`` without a limit sorts in Python (the index walk was the slow part of `ls --all`): the
    order is the SQL one, ties on ``updated`` by id."""
    store = _store()
    for i in range(6):
        c = _conv(store, f"t{i}", "hello", "world")
        c.write_meta({**c.read_meta(), "updated": float(i % 3)})
    index: Index | None = store.index
    assert index is not None
    assert [r.id for r in index.rows()] == [r.id for r in index.rows(limit=100)]



def test_a_big_first_server_build_says_what_it_is_doing(chatcli_home: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The first `serve` after 90,000 folders were copied in reads every transcript before /health
    answers (a minute at 100,000): the log says so at the start and when it is done; a restart says nothing."""
    import logging

    from chatcli.server import index as server_index
    from chatcli.server.index import PrefixIndex

    monkeypatch.setattr(server_index, "BUILD_NOTICE", 5)
    base = _conv(_store(), "t", "hello", "world")
    _copies(base, 6, "c")

    def prefix() -> PrefixIndex:
        return PrefixIndex(_store(), get_paths().data_dir / "server" / "index.json", model_identity={"m": 1},
                           n_ctx=4096, template_source="t")

    monkeypatch.setattr(server_index, "BUILD_CHUNK", 3)
    seen: list[tuple[int, int] | None] = []
    check_many = PrefixIndex._check_many

    def watched(self: PrefixIndex, items: list[tuple[str, str]]) -> None:
        seen.append(server_index.BUILDING.get())  # what the loading server's 503 says meanwhile
        check_many(self, items)

    monkeypatch.setattr(PrefixIndex, "_check_many", watched)
    with caplog.at_level(logging.INFO, logger="chatcli.server"):
        first = prefix()
        first.refresh()
        first.save()
    assert seen == [(0, 7), (3, 7), (6, 7)] and server_index.BUILDING.get() is None
    said = [r.getMessage() for r in caplog.records]
    assert "indexing 7 conversations for the server …" in said
    assert any(m.startswith("indexed 7 conversations for the server in ") for m in said)
    caplog.clear()
    seen.clear()
    with caplog.at_level(logging.INFO, logger="chatcli.server"):
        prefix().refresh()
    assert not [r for r in caplog.records if "index" in r.getMessage()]
    assert seen == []  # nothing changed since: nothing read, nothing to say


def test_the_loading_servers_503_says_how_far_a_first_index_build_got() -> None:
    """While the first index build of a big store runs (a minute at 100,000 conversations), a client
    polling /health sees its progress in llama-server's 503 "Loading model"; without one, those words
    alone (as tests/test_server_loading.py checks of a real start)."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from chatcli.server import index as server_index
    from chatcli.server.app import create_app

    with TestClient(create_app(None)) as client:
        got = client.get("/health")
        assert got.status_code == 503 and got.json()["error"]["message"] == "Loading model"
        server_index.BUILDING.set((4096, 100_000))
        try:
            got = client.get("/health")
        finally:
            server_index.BUILDING.set(None)
        assert got.status_code == 503 and got.headers["Retry-After"] == "1"
        assert got.json()["error"]["message"] == "Loading model (indexing conversations: 4096/100000)"



def test_an_index_that_cannot_get_the_counts_still_lists(chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The triggers are added at open; where that cannot write (a read-only data directory, a lock held
    past the busy timeout) the index is still read, its counts counted."""
    store = _store()
    for i in range(3):
        _conv(store, f"t{i}", "hello", "world")
    index = store.index
    assert index is not None
    with index.write() as w:
        for name in ("convs_n_ins", "convs_n_del", "convs_n_upd"):
            w.execute(f"DROP TRIGGER {name}")
        w.execute("DELETE FROM info WHERE key IN ('n_ok', 'n_warm')")
    index.close()

    def cannot_write(db: sqlite3.Connection) -> None:
        db.execute("BEGIN IMMEDIATE")  # left open, as a failure part-way through the script would
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(Index, "_ensure_counts", staticmethod(cannot_write))
    ro = _store().index
    assert ro is not None and ro.count() == (3, 0) and len(ro.rows(limit=50)) == 3
    assert not ro.db().in_transaction


KILLED_BUILD = r"""
import os, signal
from chatcli.config.settings import get_paths
from chatcli.core.files.store import ConversationStore

def progress(done: int, total: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # after the first transaction, before the others

index = ConversationStore(get_paths().conversations_dir).index
index.reconcile(progress=progress)
"""


def _dump(index: Index) -> dict[str, object]:
    """Everything a build writes, but the change numbers (they count the writes, which differ)."""
    db = index.db()
    cols = [r[1] for r in db.execute("PRAGMA table_info(convs)") if r[1] not in ("seq", "open_pid")]
    return {"convs": sorted(db.execute(f"SELECT {', '.join(cols)} FROM convs").fetchall()),
            "hits": sorted(db.execute("SELECT text, reasoning, conv, mid, role, ts FROM hits").fetchall()),
            "files": sorted(db.execute("SELECT * FROM files").fetchall()),
            "inodes": sorted(db.execute("SELECT * FROM inodes").fetchall()),
            "info": sorted(db.execute("SELECT key, value FROM info WHERE key IN "
                                      "('state_total', 'n_ok', 'n_warm')").fetchall())}


def test_a_bulk_build_killed_part_way_is_completed_by_the_next_process(chatcli_home: Path) -> None:
    """A first build of many folders runs in batches with rare checkpoints (``BULK_FOLDERS``): killed
    after its first batch, it leaves the batch it committed and no walk stamp, so the next process walks every
    folder and reads the rest. The result equals a build in one go, the state files' shared inodes and
    an unreadable folder included."""
    import signal
    import subprocess
    import sys

    store = _store()
    base = _conv(store, "t", "hello", "world")
    base.state_path.write_bytes(b"\0" * 4096)  # a state file: 99 copies keep their own, 300 share it
    ids = _copies(base, 1199, "a")
    assert 1200 >= index_mod.BULK_FOLDERS
    for cid in ids[:300]:
        (store.root / cid / "state.kv").unlink()
        os.link(base.state_path, store.root / cid / "state.kv")
    for cid in ids[300:1100]:
        (store.root / cid / "state.kv").unlink()
    (store.root / ids[700] / "meta.json").write_text("{not json", "utf-8")
    assert store.index is not None
    store.index.close()
    index_path = get_paths().data_dir / "index.sqlite"

    def delete_index() -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{index_path}{suffix}").unlink(missing_ok=True)

    delete_index()
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", KILLED_BUILD], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    db = sqlite3.connect(index_path)
    assert db.execute("SELECT COUNT(*) FROM convs").fetchone()[0] == index_mod.REFRESH_CHUNK < 1200
    db.close()
    index = _store().index
    assert index is not None
    index.reconcile()
    assert index.last_walk is not None and index.last_walk.reread == 1200 - index_mod.REFRESH_CHUNK
    completed = _dump(index)
    index.close()
    delete_index()
    fresh = _store().index
    assert fresh is not None
    fresh.reconcile()
    assert fresh.last_walk is not None and fresh.last_walk.reread == 1200
    assert _dump(fresh) == completed
    assert fresh.count() == (1199, 400) and fresh.state_total() == 4096 * 100  # 99 copies and the shared one
    assert len(fresh.problems()) == 1 and ids[700] in fresh.problems()[0]
