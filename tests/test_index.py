"""The SQLite index (issue #23): a cache of the folders that `ls`, search, the budget and the server read.

Conversations are written by hand through the store (these are policy tests: no model), so each test says
exactly what the transcript holds. Every fault test compares what the index answers after the fault with
what the folders say, and checks the one line that was said.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chatcli.config.settings import get_paths
from chatcli.core.files import index as index_module
from chatcli.core.files.index import WALK_EVERY_S, Index, SearchFilters, fts_query
from chatcli.core.files.store import ConversationDir, ConversationStore
from chatcli.core.kv.budget import total_bytes
from chatcli.core.search import run_search
from chatcli.core.template import Message
from chatcli.server import history

ROOT = Path(__file__).resolve().parent.parent


def _store() -> ConversationStore:
    return ConversationStore(get_paths().conversations_dir)


def _conv(store: ConversationStore, title: str, user: str, reply: str, *, persona: str = "alice",
          source: str | None = None, reasoning: str | None = None) -> ConversationDir:
    meta = {"title": title, "persona": persona, "model": {"name": "SmolLM2 test"}, "seed": 1}
    if source:
        meta["source"] = source
    conv = store.create(meta)
    conv.append_event({"type": "prefix", "persona": persona, "messages": [{"role": "system", "content": f"S {persona}"}],
                       "tokens": [1, 2, 3], "span": [0, 3]})
    conv.append_event({"type": "message", "mid": 0, "role": "user", "text": user, "tokens": [4, 5],
                       "span": [3, 5], "turn": 0})
    ev = {"type": "message", "mid": 1, "role": "assistant", "text": reply, "tokens": [6, 7], "span": [5, 7],
          "turn": 0}
    if reasoning is not None:  # as core.transcript.message_parts reads it: text is reasoning + answer
        ev["text"] = reasoning + reply
        ev["reasoning"] = {"text": reasoning, "tokens": [0, 1]}
        ev["answer"] = {"text": reply, "tokens": [1, 2]}
    conv.append_event(ev)
    return conv


def _say(conv: ConversationDir, mid: int, user: str, reply: str) -> None:
    p = 3 + 2 * mid
    conv.append_event({"type": "message", "mid": mid, "role": "user", "text": user, "tokens": [4, 5],
                       "span": [p, p + 2], "turn": mid})
    conv.append_event({"type": "message", "mid": mid + 1, "role": "assistant", "text": reply, "tokens": [6, 7],
                       "span": [p + 2, p + 4], "turn": mid})


def _ls(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chatcli", "ls", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL)


def _ls_json(*args: str) -> list[dict[str, object]]:
    proc = _ls("--json", *args)
    assert proc.returncode == 0, proc.stderr
    rows: list[dict[str, object]] = json.loads(proc.stdout)
    return rows


def _ids(hits: list[object]) -> list[str]:
    return sorted({h.id for h in hits})  # type: ignore[attr-defined]


def _index_path() -> Path:
    return get_paths().data_dir / "index.sqlite"


def test_ls_is_most_recent_first_with_limit_and_all(chatcli_home: Path) -> None:
    store = _store()
    made = [_conv(store, f"t{i}", f"question {i}", f"answer {i}").id for i in range(5)]
    time.sleep(0.01)
    conv = store.resolve(made[1])
    conv.write_meta({**conv.read_meta(), "updated": time.time() + 5})  # the most recent now
    rows = _ls_json()
    assert [r["id"] for r in rows] == [made[1], made[4], made[3], made[2], made[0]]
    assert [r["turns"] for r in rows] == [1] * 5
    assert [r["id"] for r in _ls_json("--limit", "2")] == [made[1], made[4]]
    assert len(_ls_json("--all")) == 5
    piped = _ls("--limit", "2")
    assert len(piped.stdout.splitlines()) == 2 and "3 older not shown" in piped.stderr


def test_a_message_is_searchable_as_soon_as_its_line_is_written(chatcli_home: Path) -> None:
    store = _store()
    conv = _conv(store, "gardens", "tell me about roses", "roses need sun")
    hits, notices = run_search("roses", store)
    assert notices == []
    assert _ids(hits) == [conv.id] and {h.role for h in hits} == {"user", "assistant"}
    _say(conv, 2, "and tulips?", "tulips like cold winters")
    hits, _ = run_search("tulip", _store())  # a new process's view: the prefix "tulip" matches "tulips"
    assert {(h.id, h.exchange, h.role) for h in hits} == {(conv.id, 2, "user"), (conv.id, 2, "assistant")}
    assert all("\x02tulips\x03" in h.snippet for h in hits)
    # Forking at the last exchange is resuming; an earlier one says how to fork there.
    first = next(h for h in run_search("roses sun", store)[0])
    assert first.exchange == 1 and first.how_to_continue() == f"chatcli resume {conv.id}  ·  chatcli fork {conv.id} --at 1"


def test_search_filters_and_reasoning(chatcli_home: Path) -> None:
    store = _store()
    a = _conv(store, "a", "what is a monad", "a monoid in the category", reasoning="the user wants burritos")
    b = _conv(store, "b", "monad please", "sure", persona="bob", source="api")
    assert _ids(run_search("monad", store)[0]) == sorted([a.id, b.id])
    assert _ids(run_search("monad", store, persona="bob")[0]) == [b.id]
    assert _ids(run_search("monad", store, api=True)[0]) == [b.id]
    assert _ids(run_search("monad", store, api=False)[0]) == [a.id]
    assert _ids(run_search("monad", store, model="smollm2")[0]) == sorted([a.id, b.id])
    assert run_search("monad", store, model="llama")[0] == []
    assert run_search("monad", store, since="2999-01-01")[0] == []
    # Reasoning is not message text: found only when asked, and the hit says so.
    assert run_search("burritos", store)[0] == []
    hits, _ = run_search("burritos", store, reasoning=True)
    assert _ids(hits) == [a.id] and hits[0].in_reasoning
    index = _store().index
    assert index is not None
    assert {h.conv for h in index.search("category", SearchFilters())} == {a.id}


@pytest.mark.parametrize("text", ['AND OR NOT', 'a"b', "col:umn*", "(", "NEAR(x y)", "^start", "-"])
def test_no_input_is_fts_syntax(chatcli_home: Path, text: str) -> None:
    store = _store()
    _conv(store, "x", "plain words here", "more words")
    hits, _ = run_search(text, store)  # no FTS5 syntax error: every word is quoted
    words = {w.lower() for w in fts_query(text).replace('"', " ").replace("*", " ").split()}
    assert bool(hits) == bool(words & {"plain", "words", "here", "more"})


def test_ls_grep(chatcli_home: Path) -> None:
    store = _store()
    a = _conv(store, "a", "the quick brown fox", "jumps")
    _conv(store, "b", "lazy dog", "sleeps")
    assert [r["id"] for r in _ls_json("--grep", "brown fox")] == [a.id]


def _snapshot() -> list[dict[str, object]]:
    return sorted(_ls_json("--all"), key=lambda r: str(r["id"]))


@pytest.mark.parametrize("fault", ["deleted", "truncated", "corrupted", "newer", "garbage"])
def test_a_damaged_index_is_rebuilt_and_nothing_is_lost(chatcli_home: Path, fault: str) -> None:
    store = _store()
    convs = [_conv(store, f"t{i}", f"needle{i} question", f"answer {i}") for i in range(4)]
    store.index.close()  # type: ignore[union-attr]
    before = _snapshot()
    path = _index_path()
    db = sqlite3.connect(path)  # checkpointed, so the damage below is in the main file
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    size = path.stat().st_size
    if fault == "deleted":
        path.unlink()
    elif fault == "truncated":
        with path.open("r+b") as fh:
            fh.truncate(size // 3)
    elif fault == "corrupted":
        with path.open("r+b") as fh:  # every page after the first overwritten: the schema survives, data does not
            fh.seek(4096)
            fh.write(os.urandom(size - 4096))
    elif fault == "newer":
        db = sqlite3.connect(path)
        db.execute("UPDATE info SET value=99 WHERE key='schema'")
        db.commit()
        db.close()
    else:
        path.write_bytes(b"not a database at all" * 100)
    proc = _ls("--all", "--json")
    assert proc.returncode == 0, proc.stderr
    assert sorted(json.loads(proc.stdout), key=lambda r: str(r["id"])) == before
    said = [line for line in proc.stderr.splitlines() if line.startswith("note: index")]
    assert len(said) == 1 and ("built from 4 conversation" if fault == "deleted" else "rebuilt") in said[0], proc.stderr
    hits, _ = run_search("needle2", _store())
    assert _ids(hits) == [convs[2].id]


def test_a_locked_index_falls_back_to_the_folders(chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()
    conv = _conv(store, "t", "hello", "world")
    store.index.close()  # type: ignore[union-attr]
    before = _snapshot()
    holder = sqlite3.connect(_index_path(), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process in a long write
    try:
        monkeypatch.setattr("chatcli.core.files.index.BUSY_TIMEOUT_S", 0.2)
        conv.write_meta({**conv.read_meta(), "title": "renamed while locked"})  # the truth is written anyway
        proc = _ls("--all", "--json")
        assert proc.returncode == 0, proc.stderr
        rows = json.loads(proc.stdout)
        assert [r["title"] for r in rows] == ["renamed while locked"]
        assert "listing from the folders" in proc.stderr
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    after = _snapshot()  # unlocked: the index re-reads the folder whose meta changed behind it
    assert [r["title"] for r in after] == ["renamed while locked"]
    assert [{k: v for k, v in r.items() if k != "title"} for r in after] == \
           [{k: v for k, v in r.items() if k != "title"} for r in before]


KILLED = """
import os, signal, sys
from chatcli.config.settings import get_paths
from chatcli.core.files.index import Index
from chatcli.core.files.store import ConversationStore
conv = ConversationStore(get_paths().conversations_dir).resolve(sys.argv[1])
conv.lock()
def die(self, *args):  # the transcript line is durable; the index write never happens
    os.kill(os.getpid(), signal.SIGKILL)
Index.note_append = die
conv.append_event({"type": "message", "mid": 2, "role": "user", "text": "zebra crossing", "tokens": [4, 5],
                   "span": [7, 9], "turn": 1})
"""


def test_sigkill_between_the_transcript_and_the_index_is_repaired(chatcli_home: Path) -> None:
    store = _store()
    conv = _conv(store, "t", "hello", "world")
    proc = subprocess.run([sys.executable, "-c", KILLED, conv.id], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert b"zebra crossing" in conv.transcript_path.read_bytes()
    hits, _ = run_search("zebra", _store())  # a new process: its reconcile finds the dead holder's row
    assert [(h.id, h.exchange) for h in hits] == [(conv.id, 2)]
    assert [r["turns"] for r in _ls_json()] == [2]


def test_copied_and_removed_folders(chatcli_home: Path) -> None:
    import shutil

    store = _store()
    conv = _conv(store, "orig", "kangaroo facts", "they hop")
    copy = conv.path.parent / "copied1"
    shutil.copytree(conv.path, copy)
    hits, _ = run_search("kangaroo", _store())
    assert _ids(hits) == sorted([conv.id, "copied1"])
    shutil.rmtree(conv.path)
    hits, _ = run_search("kangaroo", _store())
    assert _ids(hits) == ["copied1"]
    assert [r["id"] for r in _ls_json()] == ["copied1"]


def _settle(store: ConversationStore) -> Index:
    """The conversations folder as if its last change were minutes old (not racy), walked once."""
    index = store.index
    assert index is not None
    old = time.time() - 300
    os.utime(store.root, (old, old))
    index.reconcile()
    return index


def _age_last_walk(index: Index) -> None:
    with index.write() as w:
        w.execute("UPDATE info SET value = value - ? WHERE key='walked_at'", (int((WALK_EVERY_S + 1) * 1e9),))


def _count_walks(store: ConversationStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The list that each listing of the conversations folder (a walk: ``scandir`` or ``listdir``) adds to.
    Both are every module's: only the folder's own listings are counted."""
    walks: list[str] = []
    for name in ("scandir", "listdir"):
        real = getattr(os, name)

        def counting(path: object, _real: Callable[[object], object] = real, _name: str = name) -> object:
            if str(path) == str(store.root):
                walks.append(_name)
            return _real(path)

        monkeypatch.setattr(os, name, counting)
    return walks


def test_an_unchanged_store_is_not_walked(chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ls and search at 10,000 conversations: no stat per folder when the stamps say nothing changed."""
    store = _store()
    convs = [_conv(store, f"t{i}", f"question {i}", "answer") for i in range(3)]
    index = _settle(store)
    walks = _count_walks(store, monkeypatch)
    assert index.reconcile() == 0 and walks == []
    _say(convs[0], 2, "a new turn by chatcli", "told the index itself")  # no walk needed to find it
    assert index.reconcile() == 0 and walks == []
    assert _ids(run_search("told", store)[0]) == [convs[0].id] and walks == []
    shutil.copytree(convs[1].path, store.root / "copied1")  # a new entry: the folder's mtime moves
    os.utime(store.root, (time.time() - 200, time.time() - 200))
    assert index.reconcile() == 1 and len(walks) == 1
    assert _ids(run_search("question 1", store)[0]) == sorted([convs[1].id, "copied1"])
    assert index.reconcile() == 0 and len(walks) == 1  # walked: recorded
    _age_last_walk(index)
    assert index.reconcile() == 0 and len(walks) == 2  # the periodic walk
    assert index.reconcile(full=True) == 0 and len(walks) == 3


@pytest.mark.parametrize(("sub_second", "inside", "outside"), [
    (123_456_789, 30_000_000, 80_000_000),  # ext4, tmpfs, xfs: stamps to the ns, the kernel's tick behind them
    (300_000_000, 150_000_000, 250_000_000),  # a file system whose stamps end in zeros: 100 ms steps
    (0, 1_500_000_000, 2_500_000_000),  # whole seconds (FAT: 2 s)
], ids=["fine", "100ms", "coarse"])
def test_a_change_in_the_tick_a_walk_saw_is_found_and_a_settled_folder_is_not_walked(
        chatcli_home: Path, monkeypatch: pytest.MonkeyPatch, sub_second: int, inside: int, outside: int) -> None:
    """The conversations folder's mtime is trusted only once the file system's clock has moved past it: a
    folder copied in by hand in the same tick as a walk leaves the mtime the walk saw (simulated by
    setting it back), and must still be found; once the window has passed, an unchanged folder is not
    walked again (`ls` after `ls`: 0.2 s of names at 100,000). Each wrong rule fails one half: trusting a
    fine stamp at once misses the copy; the old 2 s for every file system walks again."""
    store = _store()
    conv = _conv(store, "t", "hello", "world")
    index = _settle(store)
    stamp = (time.time_ns() // 1_000_000_000 + 10) * 1_000_000_000 + sub_second  # a change's, as stamped
    clock = [0]
    monkeypatch.setattr(time, "time_ns", lambda: clock[0])

    def copy_in(name: str) -> None:
        shutil.copytree(conv.path, store.root / name)
        os.utime(store.root, ns=(stamp, stamp))  # the folder's mtime as the tick the walk saw left it

    def walk(at: int) -> str:
        clock[0] = stamp + at
        index.reconcile()
        return "" if index.last_walk is None else index.last_walk.kind

    copy_in("copied1")
    assert walk(inside) == "names" and index.ids() == {conv.id, "copied1"}
    copy_in("copied2")  # in the same tick: nothing the mtime shows
    assert walk(inside + 1_000_000) == "names" and index.ids() == {conv.id, "copied1", "copied2"}
    assert walk(outside) == "names"  # the last walk was inside the window: once more, now outside it
    assert walk(outside + 1_000_000) == ""  # settled: trusted
    assert walk(outside + 2_000_000_000) == ""



def _fine(store: ConversationStore) -> Index:
    index = store.index
    assert index is not None
    for _ in range(20):  # a loaded disk can keep one probe from getting a fast enough sample
        if index.fine_stamps():
            break
        index._fine = None
    else:
        pytest.skip("stamps not shown fine here (coarse, or a disk too busy to show it): own changes are walked "
                    "as before (tested below)")
    return index


def test_chatcli_s_own_new_and_removed_folders_need_no_walk(chatcli_home: Path) -> None:
    """A process that makes or removes a conversation folder records it and the stamp it leaves, so the
    next `ls` (another process) does not walk the names: 0.2 s at 100,000 conversations. Without the rule
    each of these reconciles walks."""
    maker = _store()
    first = _conv(maker, "first", "x", "y")
    _fine(maker)
    reader = _settle(_store())
    walks = reader.walks()
    conv = _conv(maker, "new", "made by chatcli", "ok")
    assert reader.reconcile() == 0 and reader.last_walk is None
    assert conv.id in reader.ids() and _ids(run_search("made", _store())[0]) == [conv.id]
    forked = _conv(maker, "second", "again", "ok")
    maker.remove(conv)
    assert reader.reconcile() == 0 and reader.last_walk is None
    assert reader.ids() == {first.id, forked.id} and [r["id"] for r in _ls_json()] == [forked.id, first.id]
    assert reader.walks() == walks  # the `ls` process did not walk either


def test_an_outside_change_around_an_own_change_is_still_found(chatcli_home: Path) -> None:
    """The own-change rule records the folder's stamp only when nothing else can have changed its names: a
    copy by hand before it (the stamp had already moved), during it (one subfolder too many), or right
    after it (in the same tick: the stamp moves anyway, as ``fine_stamps`` showed) is found by the next
    walk. Dropping any one of the checks fails one part."""
    maker = _store()
    src = _conv(maker, "src", "copied by hand", "ok")
    index = _fine(maker)
    reader = _settle(_store())
    shutil.copytree(src.path, maker.root / "before1")  # by hand, then chatcli makes one
    made = _conv(maker, "made", "x", "y")
    assert reader.reconcile() == 1 and reader.last_walk is not None and reader.last_walk.kind == "names"
    assert reader.ids() == {src.id, "before1", made.id}
    reader = _settle(_store())

    def make_and_copy() -> None:
        os.mkdir(maker.root / "made2")
        shutil.copytree(src.path, maker.root / "during1")  # by hand, in the same microseconds

    index.own_change("made2", make_and_copy, links=1)
    assert reader.reconcile() >= 1 and reader.last_walk is not None
    assert {"made2", "during1"} <= reader.ids()
    reader = _settle(_store())
    made3 = _conv(maker, "made3", "x", "y")
    shutil.copytree(src.path, maker.root / "after1")  # right after: same tick, the stamp still moves
    assert reader.reconcile() == 1 and reader.last_walk is not None and "after1" in reader.ids()
    assert made3.id in reader.ids()


def test_an_own_change_with_coarse_stamps_or_no_index_is_walked(chatcli_home: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a copy right after the change could leave the stamp as it was (coarse stamps), or the index
    cannot be written (locked), the change is made all the same and the next `ls` walks to find it."""
    maker = _store()
    _conv(maker, "first", "x", "y")
    index = maker.index
    assert index is not None
    reader = _settle(_store())
    monkeypatch.setattr(index, "fine_stamps", lambda: False)
    made = _conv(maker, "coarse", "x", "y")
    assert made.id in reader.ids()  # the row was read: search and `ls` show it at once ...
    assert reader.reconcile() == 0 and reader.last_walk is not None  # ... but the names are walked
    reader = _settle(_store())

    def locked(timeout: float | None = None) -> object:
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(index, "write", locked)
    made2 = _conv(maker, "locked", "x", "y")
    assert reader.reconcile() == 1 and made2.id in reader.ids()


def test_fine_stamps_are_shown_once_per_kernel_and_file_system(chatcli_home: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What the probe showed is kept in the index for this kernel and file system (a later process on a
    loaded disk may not get a fast enough sample to show it again); for any other, it is measured anew."""
    from chatcli.core.files import index as index_module

    store = _store()
    _conv(store, "a", "x", "y")
    index = _fine(store)
    probes: list[bool] = []
    monkeypatch.setattr(index_module, "_probe_fine_stamps", lambda *a: probes.append(False) or False)
    assert _fine(_store()) is not None and probes == []  # kept: not measured again
    with index.write() as w:
        w.execute("UPDATE info SET value = 'another-kernel/1/2' WHERE key='fine_stamps'")
    fresh = _store().index
    assert fresh is not None and fresh.fine_stamps() is False and probes == [False]


@pytest.mark.parametrize("grain", [4_000_000, 1_000_000, 1_000_000_000])
@pytest.mark.parametrize("ticks", ["within", "across"])
def test_coarse_stamps_are_not_taken_for_fine_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   grain: int, ticks: str) -> None:
    """``fine_stamps`` on a file system whose stamps are the kernel's coarse clock (a 4 ms or 1 ms tick)
    or whole seconds, simulated: every change within one tick (the mtime cut to the grain: stamps stay
    equal), or every change in a tick of its own (a loaded machine at worst: each stamp a grain past the
    last). Without the rule that a stamp may move by no more than the time between the changes, the
    second would pass."""
    from chatcli.core.files import index as index_module

    real = os.stat
    seen: dict[int, int] = {}

    def coarse(path: object, *args: object, **kw: object) -> object:
        st = real(path, *args, **kw)  # type: ignore[arg-type]
        if ticks == "within":
            mtime = st.st_mtime_ns // grain * grain
        else:
            mtime = seen.setdefault(st.st_mtime_ns, (st.st_mtime_ns // grain + len(seen)) * grain)
        fields = list(st)
        return os.stat_result((*fields[:8], int(mtime // 1_000_000_000), fields[9]),
                              {"st_mtime_ns": mtime, "st_dev": st.st_dev, "st_nlink": st.st_nlink})

    monkeypatch.setattr(os, "stat", coarse)
    assert index_module._probe_fine_stamps(tmp_path, tmp_path) is False
    assert list(tmp_path.iterdir()) == []  # the probe's folder is gone

def test_a_hand_edit_is_reindexed_at_the_next_walk(chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a folder a hand edit moves no stamp the index looks at without walking: it is found when
    the slice of ``reconcile`` comes to its folder, and a search never shows a hit the edited transcript no
    longer holds (each hit's transcript is checked), nor ``ls`` a stale row."""
    store = _store()
    conv = _conv(store, "t", "original words", "reply")
    index = _settle(store)
    text = conv.transcript_path.read_text("utf-8").replace("original words", "edited phrase")
    tmp = conv.path / "t.tmp"
    tmp.write_text(text, "utf-8")
    os.replace(tmp, conv.transcript_path)  # as editors save: a new file renamed over the old
    assert run_search("original", _store())[0] == []  # the hit's transcript changed: re-read, no hit
    assert _ids(run_search("edited", _store())[0]) == [conv.id]  # ... and so the new words are in
    conv2 = _conv(store, "u", "second words", "reply")
    index = _settle(store)
    meta = json.loads(conv2.meta_path.read_text("utf-8"))
    conv2.meta_path.write_text(json.dumps({**meta, "title": "retitled by hand"}), "utf-8")  # in place
    assert {r["id"]: r["title"] for r in _ls_json()}[conv2.id] == "retitled by hand"  # a shown row is checked
    text = conv2.transcript_path.read_text("utf-8").replace("second words", "third phrase")
    tmp = conv2.path / "t.tmp"
    tmp.write_text(text, "utf-8")
    os.replace(tmp, conv2.transcript_path)
    monkeypatch.setattr(index_module, "SLICE_FOLDERS", 0)
    assert run_search("third", _store())[0] == []  # no slice, no walk: not seen (documented)
    _age_last_walk(index)
    assert run_search("third", _store())[0] == []  # a walk of names does not look inside folders
    monkeypatch.setattr(index_module, "SLICE_FOLDERS", 2)
    assert _ids(run_search("third", _store())[0]) == [conv2.id]  # the slice: two folders, both of them


def _replace_keeping_stamps(path: Path, old: str, new: str) -> None:
    """``path`` replaced by a copy with ``old`` → ``new`` (same length), renamed over it with its size and
    mtime kept (as ``cp -p`` / ``rsync -a`` restore a file): only its folder's mtime moves."""
    assert len(old) == len(new)
    st = path.stat()
    tmp = path.with_name(".edit.tmp")
    tmp.write_bytes(path.read_bytes().replace(old.encode(), new.encode()))
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, path)
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_a_hand_edit_inside_a_shown_folder_is_seen_at_the_next_ls(
        chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows `ls` shows are checked against their folder's mtime: a transcript restored over the one
    indexed with the same size and mtime (nothing but the folder's mtime shows it; not the transcript's
    stamps, which `search` checks its hits by) is re-read by the next `ls`, and searched as it is now.
    No slice here: only the check of the shown rows can see it."""
    from chatcli.cli import listing

    monkeypatch.setattr(index_module, "SLICE_FOLDERS", 0)
    store = _store()
    convs = [_conv(store, f"t{i}", f"question number {i}", "answer") for i in range(3)]
    _settle(store)
    _replace_keeping_stamps(convs[1].transcript_path, "question number 1", "restored backup 1")
    assert _ids(run_search("question", _store())[0]) == sorted(c.id for c in convs)  # not seen yet
    shown = listing._rows_from_index(_store(), listing.DEFAULT_LIMIT, None, 0)
    assert shown is not None and convs[1].id in {r.id for r in shown[0]}
    assert _ids(run_search("restored", _store())[0]) == [convs[1].id]
    assert _ids(run_search("question", _store())[0]) == sorted([convs[0].id, convs[2].id])


def test_a_hand_edit_in_an_unshown_folder_is_seen_within_the_slices_bound(
        chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Folders `ls` does not show are checked ``SLICE_FOLDERS`` per call in rotation: a hand edit in one
    (a meta.json saved by an editor, renamed over) is in its row within ceil(n / SLICE_FOLDERS) calls,
    each of which stats that many folders, not every one (the periodic full walk did, 0.6-0.9 s at
    100,000). A folder replaced by a file is forgotten the same way."""
    monkeypatch.setattr(index_module, "SLICE_FOLDERS", 2)
    store = _store()
    convs = [_conv(store, f"t{i}", "hello", "world") for i in range(7)]
    index = _settle(store)
    index.reconcile()  # a slice checked: the cursor is at its last folder
    shown = {r.id for r in index.rows(limit=1)}
    cursor = index.db().execute("SELECT value FROM info WHERE key='slice_at'").fetchone()[0]
    # The worst case: the folder the last call's slice has just checked.
    target = store.dir(cursor) if cursor not in shown else next(c for c in convs if c.id not in shown)
    meta = json.loads(target.meta_path.read_text("utf-8"))
    tmp = target.path / ".meta.tmp"
    tmp.write_text(json.dumps({**meta, "title": "retitled in an editor"}), "utf-8")
    os.replace(tmp, target.meta_path)
    folder_stats = [0]
    real_stat = os.stat

    def counting(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if os.path.dirname(str(path)) == str(store.root):
            folder_stats[0] += 1
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", counting)
    bound = -(-len(convs) // 2)
    calls = 0
    while calls < bound:
        calls += 1
        folder_stats[0] = 0
        index.reconcile()
        # The slice's two, and the changed folder's when it is re-read: not every folder.
        assert index.last_walk is None and folder_stats[0] == 2 + index.last_slice[1] <= 3
        if index.rows(ids=[target.id])[0].title == "retitled in an editor":
            break
    assert index.rows(ids=[target.id])[0].title == "retitled in an editor", f"not seen in {bound} calls"
    monkeypatch.setattr(os, "stat", real_stat)
    gone = next(c for c in convs if c.id not in shown and c.id != target.id)
    shutil.rmtree(gone.path)
    gone.path.write_text("not a folder", "utf-8")
    os.utime(store.root, (time.time() - 300, time.time() - 300))  # the names walk alone would keep the id
    for _ in range(bound):
        index.reconcile()
    assert gone.id not in index.ids()


def test_the_budget_total_runs_without_rescans_and_counts_shared_inodes_once(chatcli_home: Path) -> None:
    store = _store()
    a = _conv(store, "a", "x", "y")
    b = _conv(store, "b", "x", "y")
    a.state_path.write_bytes(b"a" * 1000)
    a.state_changed()
    b.state_path.write_bytes(b"b" * 300)
    os.link(a.state_path, b.path / "state.base-abc.kv")  # a fork's shared base: one inode, two names
    b.state_changed()
    paths = get_paths()
    assert store.index.state_total() == total_bytes(paths.conversations_dir, None) == 1300  # type: ignore[union-attr]
    with a.state_path.open("ab") as fh:
        fh.write(b"a" * 500)
    a.state_changed()
    assert store.index.state_total() == total_bytes(paths.conversations_dir, None) == 1800  # type: ignore[union-attr]
    store.remove(a)  # the base link in b keeps the inode's bytes
    assert store.index.state_total() == total_bytes(paths.conversations_dir, None) == 1800  # type: ignore[union-attr]
    (b.path / "state.base-abc.kv").unlink()
    b.state_changed()
    assert store.index.state_total() == total_bytes(paths.conversations_dir, None) == 300  # type: ignore[union-attr]


WRITER = """
import sys
from chatcli.config.settings import get_paths
from chatcli.core.files.store import ConversationStore
store = ConversationStore(get_paths().conversations_dir)
conv = store.resolve(sys.argv[1])
conv.lock()
for i in range(2, 2 + 2 * int(sys.argv[2]), 2):
    p = 3 + 2 * i
    conv.append_event({"type": "message", "mid": i, "role": "user", "text": f"word{sys.argv[3]} {i}",
                       "tokens": [4, 5], "span": [p, p + 2], "turn": i})
    conv.append_event({"type": "message", "mid": i + 1, "role": "assistant", "text": "ok", "tokens": [6, 7],
                       "span": [p + 2, p + 4], "turn": i})
    conv.write_meta({**conv.read_meta(), "title": f"at {i}"})
conv.unlock()
"""


def test_several_processes_at_once(chatcli_home: Path) -> None:
    store = _store()
    convs = [_conv(store, f"c{i}", "start", "ok") for i in range(3)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, c.id, "30", chr(ord("a") + i)], env=env,
                              stderr=subprocess.PIPE, text=True) for i, c in enumerate(convs)]
    for _ in range(5):  # readers reconcile while the writers write
        run_search("worda", _store())
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    index = Index(get_paths().conversations_dir)
    for i, c in enumerate(convs):
        hits = index.search(f"word{chr(ord('a') + i)}", limit=1000)
        assert len(hits) == 30 and {h.conv for h in hits} == {c.id}
    rows = {r["id"]: r for r in _ls_json()}
    assert all(rows[c.id]["turns"] == 31 and rows[c.id]["title"] == "at 60" for c in convs)


CLOSER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
db.execute("SELECT COUNT(*) FROM extra").fetchone()
db.close()  # the last connection, as far as it can tell: it checkpoints and deletes the WAL
"""


def test_a_second_index_in_one_process_keeps_the_first_ones_locks(chatcli_home: Path) -> None:
    """The cause of the three-writer test's lost hits: opening a second Index made a descriptor of the
    database file and closed it, which drops every POSIX lock the process holds on the file. A process whose
    connection then closed saw no other holder, checkpointed and deleted the WAL, and the first connection's
    later commits went to the deleted file."""
    first = Index(get_paths().conversations_dir)
    first.put_extra("t", [("aaa", "one")])
    Index(get_paths().conversations_dir).db()  # as every `ConversationStore(...)` of a process does
    subprocess.run([sys.executable, "-c", CLOSER, str(first.path)], check=True, timeout=60)
    assert Path(f"{first.path}-wal").exists()  # another holder was seen: the WAL stays
    first.put_extra("t", [("bbb", "two")])
    fresh = sqlite3.connect(first.path)
    try:
        assert sorted(r[0] for r in fresh.execute("SELECT conv FROM extra WHERE name='t'")) == ["aaa", "bbb"]
    finally:
        fresh.close()


def test_threads_of_one_process_share_the_index(chatcli_home: Path) -> None:
    """The server's requests run in threads over one store (one SQLite connection): no write is lost."""
    import threading

    store = _store()
    convs = [_conv(store, f"c{i}", "start", "ok") for i in range(4)]
    for c in convs:
        c.lock()

    def write(conv: ConversationDir, tag: str) -> None:
        for i in range(2, 42, 2):
            _say(conv, i, f"thread{tag} {i}", "ok")

    threads = [threading.Thread(target=write, args=(c, chr(ord("a") + i))) for i, c in enumerate(convs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.index is not None and store.index.notices == []
    for i, c in enumerate(convs):
        assert len(store.index.search(f"thread{chr(ord('a') + i)}", limit=100)) == 20
        c.unlock()


def test_ls_flags_take_the_fast_path_and_others_go_to_typer() -> None:
    from chatcli.cli.entry import _fast_ls

    assert _fast_ls(["ls"]) == (False, 50)
    assert _fast_ls(["ls", "--json", "--all"]) == (True, None)
    assert _fast_ls(["ls", "--limit", "7"]) == (False, 7)
    for argv in (["ls", "--limit"], ["ls", "--limit", "0"], ["ls", "--all", "--limit", "3"], ["ls", "--grep", "x"],
                 ["ls", "--help"], ["ls", "--json", "--json"], ["show"]):
        assert _fast_ls(argv) is None, argv


def test_repl_search_shows_hits_and_how_to_continue(chatcli_home: Path) -> None:
    import io

    from rich.console import Console

    from chatcli.repl.loop import Repl
    from chatcli.repl.render import Renderer
    from chatcli.repl.terminal import LineIO
    from tests.test_repl import FakeConversation, FakeSession

    store = _store()
    conv = _conv(store, "gardens", "how deep do carrots root", "about thirty centimetres")
    _say(conv, 2, "and parsnips?", "deeper still")
    session = FakeSession()
    session.store = store  # type: ignore[attr-defined]
    out, err = io.StringIO(), io.StringIO()
    renderer = Renderer(Console(file=out, highlight=False, color_system=None), plain=True, err=err)
    repl = Repl(session, FakeConversation(), renderer,  # type: ignore[arg-type]
                lambda r: LineIO(io.StringIO("/search carrots\n/search nothingmatcheshere\n/search\n")))
    repl.run()
    text = err.getvalue()
    assert f"{conv.id}  gardens · alice · exchange 1 · user" in text and "«carrots»" in text
    assert f"chatcli fork {conv.id} --at 1" in text
    assert "nothing matches 'nothingmatcheshere'" in text and "usage: /search TEXT" in text


def test_a_hand_edited_meta_with_odd_types_lists_and_never_breaks_a_write(chatcli_home: Path) -> None:
    store = _store()
    conv = _conv(store, "t", "hello", "world")
    meta = conv.read_meta()
    conv.write_meta({**meta, "title": 42, "tokens": "many", "updated": "yesterday",
                     "checkpoint": {"bytes": "x"}, "summary": {"exchanges": "one", "transcript": [1, 2]}})
    rows = _ls_json()
    assert [r["id"] for r in rows] == [conv.id] and rows[0]["title"] == "42" and rows[0]["turns"] == 1


def test_a_restarted_server_looks_only_at_what_changed_since_its_save(chatcli_home: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` ready at 10,000 conversations: its saved prefix rows carry the change number they are caught
    up with, so its first refresh checks what changed since (not a stat and a meta.json read of each)."""
    from chatcli.server.index import PrefixIndex

    store = _store()
    convs = [_conv(store, f"t{i}", "hello", "world") for i in range(4)]

    def prefix() -> PrefixIndex:
        return PrefixIndex(_store(), get_paths().data_dir / "server" / "index.json", model_identity={"m": 1},
                           n_ctx=4096, template_source="t")

    first = prefix()
    first.refresh()
    first.save()
    checked: list[str] = []
    real = PrefixIndex._check_many

    def counting(self: PrefixIndex, items: list[tuple[str, str]]) -> None:
        checked.extend(cid for cid, _ in items)
        real(self, items)

    monkeypatch.setattr(PrefixIndex, "_check_many", counting)
    second = prefix()
    second.refresh()
    assert checked == [] and len(second) == 4
    _say(convs[1], 2, "while it was down", "ok")  # another process, after the save
    store.remove(convs[2])
    third = prefix()
    third.refresh()
    assert sorted(checked) == sorted([convs[1].id, convs[2].id]) and len(third) == 3


def _copies(conv: ConversationDir, n: int, tag: str) -> list[str]:
    """``n`` copies of a conversation's folder under new ids (as bench/scale.py grows a store)."""
    ids = [f"{tag}{i:05d}" for i in range(n)]
    for cid in ids:
        shutil.copytree(conv.path, conv.path.parent / cid, ignore=shutil.ignore_patterns("*.lock", "lock"))
    return ids


def _vm_steps(store: ConversationStore, fn: Callable[[], object]) -> int:
    """SQLite virtual-machine steps ``fn`` runs on the store's index: what it reads, not how long it takes."""
    assert store.index is not None
    db, n = store.index.db(), [0]

    def tick() -> int:
        n[0] += 1
        return 0

    db.set_progress_handler(tick, 1)
    try:
        fn()
    finally:
        db.set_progress_handler(None, 1)
    return n[0]


def test_a_server_start_reads_no_row_per_stored_conversation(chatcli_home: Path) -> None:
    """`serve` ready in the same time at 10 as at 10,000 conversations: opening the prefix index and its
    first refresh (nothing changed since the last server) read the same from SQLite with 200 more stored
    conversations. (They loaded every conversation's rows: 0.6 s at 10k, linear.) The folder walk is the
    SQLite index's own business, tested above."""
    from chatcli.server.index import PrefixIndex

    base = _conv(_store(), "t", "hello", "world")

    def start(store: ConversationStore) -> PrefixIndex:
        idx = PrefixIndex(store, get_paths().data_dir / "server" / "index.json", model_identity={"name": "SmolLM2 test"},
                          n_ctx=0, template_source="t")
        idx._reconciled_at = time.monotonic()  # the walk left out (see above)
        idx.refresh()
        return idx

    def restart() -> int:
        store = _store()
        return _vm_steps(store, lambda: start(store))

    first = start(_store())
    first.refresh(full=True)
    first.save()
    small = restart()
    _copies(base, 200, "c")
    grown = start(_store())
    grown.refresh(full=True)
    grown.save()
    assert len(grown) == 201
    big = restart()
    assert big <= small + 100, (small, big)


def test_a_lookup_returns_the_candidates_to_try_not_every_conversation_sharing_the_key(chatcli_home: Path) -> None:
    """One API request flat to 100,000 conversations: when thousands share a boundary (copies, a client's
    forks, one persona's root), a lookup returns at most ``LOOKUP_LIMIT`` per owner (each then costs the
    request a stat), the ones the server tries first: that had a state file, then ending at the boundary."""
    from chatcli.server.index import LOOKUP_LIMIT, PrefixIndex

    store = _store()
    base = _conv(store, "t", "hello", "world")
    ids = _copies(base, LOOKUP_LIMIT + 10, "c")
    longer, warm = store.resolve(ids[0]), store.resolve(ids[-1])
    _say(longer, 2, "and then", "more")  # goes on past the boundary: tried last
    warm.state_path.write_bytes(b"x" * 16)
    idx = PrefixIndex(store, get_paths().data_dir / "server" / "index.json", model_identity={"name": "SmolLM2 test"},
                      n_ctx=0, template_source="t")
    idx.refresh(full=True)
    assert len(idx) == LOOKUP_LIMIT + 11
    root = idx.root([Message("system", "S alice")])
    keys = history.chain(root, [Message("user", "hello"), Message("assistant", "world")])
    i, found = idx.lookup(root, keys, owners=frozenset({"repl"}))
    assert i == 2 and len(found) == LOOKUP_LIMIT
    assert found[0].conv == warm.id and all(e.end for e in found) and longer.id not in {e.conv for e in found}
    i, found = idx.lookup(root, keys, only=longer.id, owners=frozenset({"repl"}))
    assert i == 2 and [e.conv for e in found] == [longer.id] and found[0].rest == 2
    assert idx.lookup(root, keys, owners=frozenset({"api:"})) == (-1, [])  # another owner's: none
    _, at_root = idx.lookup(root, [], owners=frozenset({"repl"}))
    assert len(at_root) == LOOKUP_LIMIT and at_root[0].conv == warm.id


def test_the_servers_persona_lookups_match_a_walk_of_every_conversation(chatcli_home: Path) -> None:
    """personas() and persona_for_root() run per request: kept as conversations come and go (their cost the
    number of personas), they answer what asking every conversation answered."""
    from chatcli.server.index import PrefixIndex

    store = _store()
    made = [_conv(store, f"t{i}", "hello", "world", persona=f"p{i % 2}", source="api" if i % 3 == 0 else None)
            for i in range(6)]
    idx = PrefixIndex(_store(), get_paths().data_dir / "server" / "index.json",
                      model_identity={"name": "SmolLM2 test"}, n_ctx=0, template_source="t")

    def agree() -> None:
        convs = [(row, idx.persona_for_root(row["root"], frozenset({row["owner"]}))) for row in
                 idx._rows.dump().values()]
        for owners in (None, frozenset({"repl"}), frozenset({"api:"}), frozenset({"nobody"})):
            walked = list(dict.fromkeys(p.messages for c, p in convs if p is not None and c["entries"]
                                        and (owners is None or c["owner"] in owners)))
            assert sorted(map(repr, idx.personas(owners))) == sorted(map(repr, walked))
            for root in {c["root"] for c, _ in convs} | {"none"}:
                want = [p.messages for c, p in convs if c["root"] == root and p is not None
                        and (owners is None or c["owner"] in owners)]
                got = idx.persona_for_root(root, owners)
                assert (got.messages if got is not None else None) == (want[0] if want else None)

    idx.refresh()
    assert len(idx) == 6 and len(idx.personas()) == 2 and len(idx.personas(frozenset({"api:"}))) == 2
    agree()
    for c in made[:4]:
        store.remove(c)
        idx.refresh()
        agree()
    idx.save()
    again = PrefixIndex(_store(), get_paths().data_dir / "server" / "index.json",
                        model_identity={"name": "SmolLM2 test"}, n_ctx=0, template_source="t")
    idx = again
    agree()
    assert len(idx) == 2


def test_a_servers_row_holds_its_persona_once_and_format_4_rows_are_rebuilt(chatcli_home: Path) -> None:
    """A prefix row stored the persona's messages twice (its document and, again, its key); now once, the
    key made from the document when the row is dropped. An index of format 4 (its ``prefix_convs`` table,
    left to a server of that version that may still run) is rebuilt under format 5's names and answers."""
    from chatcli.server.index import PrefixIndex

    store = _store()
    for i in range(3):
        _conv(store, f"t{i}", "hello", "world", persona=f"p{i % 2}")
    assert store.index is not None
    # What format 4 left: its table (with a row), and no table of format 5's.
    db = store.index.prefix_rows("server-prefix-4-x")._db()
    db.execute("DROP TABLE prefix_conv_rows")
    db.execute("CREATE TABLE prefix_convs(name TEXT NOT NULL, conv TEXT NOT NULL, size INTEGER NOT NULL, "
               "mtime INTEGER NOT NULL, root TEXT NOT NULL, persona TEXT, persona_key TEXT, updated REAL NOT NULL, "
               "n_active INTEGER NOT NULL, owner TEXT NOT NULL, UNIQUE(name, conv))")
    db.execute("INSERT INTO prefix_convs VALUES('server-prefix-4-x', 'c', 1, 1, 'r', NULL, NULL, 0, 0, 'repl')")
    idx = PrefixIndex(_store(), get_paths().data_dir / "server" / "index.json",
                      model_identity={"name": "SmolLM2 test"}, n_ctx=0, template_source="t")
    idx.refresh(full=True)
    assert len(idx) == 3 and len(idx.personas()) == 2
    root = next(iter(idx._rows.dump().values()))["root"]
    assert idx.persona_for_root(root) is not None
    db = idx._rows._db()
    assert db.execute("SELECT COUNT(*) FROM prefix_convs").fetchone() == (1,)
    rows = db.execute("SELECT * FROM prefix_conv_rows WHERE name=?", (idx._name,)).fetchall()
    assert len(rows) == 3
    for row in rows:
        messages = json.dumps(json.loads(row[5])["messages"], ensure_ascii=False)
        assert sum(messages in str(col) for col in row) == 1, row
