"""Portability by construction (issue #24 item 21): what differs between systems sits behind small functions in
core/files/fsutil.py, and each fallback is exercised here on Linux by taking the POSIX form away: Windows
locks (``msvcrt``, simulated), no lock module at all, no directory fsync, no hard links, no ``pread``/
``pwrite``, no ``copy_file_range``, no ``fchmod``, no ``termios``."""

from __future__ import annotations

import builtins
import errno
import os
import types
from pathlib import Path
from typing import Any

import pytest

from chatcli.core.files import fsutil
from chatcli.core.files.store import ConversationDir, ConversationStore, LockedError


class FakeMsvcrt(types.ModuleType):
    """``msvcrt.locking`` as Windows behaves: a byte range locked per open handle, refused (EACCES) to any
    other handle, this process's included."""

    LK_UNLCK, LK_LOCK, LK_NBLCK, LK_RLCK, LK_NBRLCK = 0, 1, 2, 3, 4

    def __init__(self) -> None:
        super().__init__("msvcrt")
        self.held: dict[tuple[int, int, int], int] = {}  # (dev, inode, offset) -> fd
        self.calls: list[tuple[int, int, int]] = []

    def locking(self, fd: int, mode: int, nbytes: int) -> None:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, os.lseek(fd, 0, os.SEEK_CUR))
        self.calls.append((fd, mode, nbytes))
        if mode == self.LK_UNLCK:
            if self.held.get(key) != fd:
                raise OSError(errno.EACCES, "not locked")
            del self.held[key]
            return
        if key in self.held and self.held[key] != fd:
            raise OSError(errno.EACCES, "Permission denied")
        self.held[key] = fd


@pytest.fixture
def windows_locks(monkeypatch: pytest.MonkeyPatch) -> FakeMsvcrt:
    fake = FakeMsvcrt()
    monkeypatch.setattr(fsutil, "fcntl", None)
    monkeypatch.setattr(fsutil, "msvcrt", fake)
    return fake


def _conv(tmp_path: Path) -> ConversationDir:
    return ConversationStore(tmp_path / "conversations").create({"title": "t"})


def test_posix_locks_refuse_a_second_holder_and_name_the_first(tmp_path: Path) -> None:
    conv = _conv(tmp_path)
    conv.lock()
    with pytest.raises(LockedError, match=f"process {os.getpid()}"):
        ConversationDir(conv.path).lock()
    conv.unlock()
    ConversationDir(conv.path).lock()


def test_windows_locks_refuse_a_second_handle_and_release(tmp_path: Path, windows_locks: FakeMsvcrt) -> None:
    conv = _conv(tmp_path)
    conv.lock()
    assert windows_locks.held, "msvcrt.locking was not used"
    # The PID stays readable: the locked byte lies past it.
    with pytest.raises(LockedError, match=f"process {os.getpid()}"):
        ConversationDir(conv.path).lock()
    conv.unlock()
    assert not windows_locks.held
    other = ConversationDir(conv.path)
    other.lock()
    other.unlock()


def test_without_any_lock_module_opening_still_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsutil, "fcntl", None)
    monkeypatch.setattr(fsutil, "msvcrt", None)
    conv = _conv(tmp_path)
    conv.lock()
    conv.unlock()


def test_positioned_io_without_pread_and_pwrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "pread")
    monkeypatch.delattr(os, "pwrite")
    conv = _conv(tmp_path)
    conv.lock()
    assert (conv.path / "lock").read_text() == str(os.getpid())
    with pytest.raises(LockedError, match=f"process {os.getpid()}"):
        ConversationDir(conv.path).lock()
    conv.unlock()


def test_atomic_writes_without_directory_fsync_or_fchmod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[Any] = []
    real_open = os.open

    def spy(path: Any, flags: int, *a: Any) -> int:
        opened.append(path)
        return real_open(path, flags, *a)

    monkeypatch.delattr(os, "O_DIRECTORY")
    monkeypatch.delattr(os, "fchmod")
    monkeypatch.setattr(os, "open", spy)
    target = tmp_path / "f.json"
    fsutil.atomic_write_text(target, "hello")
    assert target.read_text() == "hello"
    assert Path(tmp_path) not in [Path(p) for p in opened]  # the directory was never opened to be fsynced
    assert not list(tmp_path.glob(".*.tmp"))


def test_copy_range_without_copy_file_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(bytes(range(256)) * 1000)
    dst.write_bytes(b"head")
    monkeypatch.delattr(os, "copy_file_range", raising=False)
    fin, fout = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY)
    try:
        fsutil.copy_range(fin, fout, 1000, 200_000)
    finally:
        os.close(fin)
        os.close(fout)
    assert dst.read_bytes() == b"head" + src.read_bytes()[1000:201_000]


def test_hard_links_missing_is_an_os_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "link")
    (tmp_path / "a").write_text("x")
    with pytest.raises(OSError):
        fsutil.hard_link(tmp_path / "a", tmp_path / "b")


def test_a_fork_copies_when_links_are_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """chatcli fork where the system has no hard links: the child's state is a byte copy of the records."""
    import json

    from chatcli.core.forking import fork_conversation
    from chatcli.core.kv import records as sf

    store = ConversationStore(tmp_path / "conversations")
    parent = store.create({"title": "p"})
    parent.append_event({"type": "prefix", "persona": "x", "messages": [], "tokens": [1, 2], "span": [0, 2]})
    for mid, (role, toks) in enumerate([("user", [3, 4]), ("assistant", [5, 6, 7])]):
        p0 = 2 + 2 * mid
        parent.append_event({"type": "message", "mid": mid, "role": role, "text": role, "tokens": toks,
                             "span": [p0, p0 + len(toks)], "turn": 0})
    header = sf.encode_record(sf.HEADER, 0, 0, sf.header_payload({"model": "m"}))
    cells = sf.encode_record(sf.CELLS, 0, 7, sf.cells_payload([1, 2, 3, 4, 5, 6, 7], b"\1" * 700))
    parent.state_path.write_bytes(header + cells)
    monkeypatch.delattr(os, "link")
    cid, copied = fork_conversation(store, parent.id, 1)
    child = ConversationDir(store.root / cid)
    assert copied == 7
    assert not list(child.path.glob("state.base-*.kv"))  # no link: a copy
    assert sf.scan(child.state_path).live()[2] == 7
    assert json.loads(child.meta_path.read_text())["forked_from"] == parent.id


def test_the_repl_runs_without_termios(monkeypatch: pytest.MonkeyPatch) -> None:
    from chatcli.repl.terminal import TerminalIO

    real_import = builtins.__import__

    def no_termios(name: str, *a: Any, **kw: Any) -> Any:
        if name == "termios":
            raise ImportError("no termios here")
        return real_import(name, *a, **kw)

    io = TerminalIO.__new__(TerminalIO)
    io._tty_fd = 0
    monkeypatch.setattr(builtins, "__import__", no_termios)
    with io.busy():
        pass
