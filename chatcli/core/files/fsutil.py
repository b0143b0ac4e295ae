"""Durable file writes: what chatcli writes either fully happened or did not happen at all."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX needs the directory fsynced too)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and parents) and make it private (0700): conversations are nobody else's business."""
    # Parents we create are private too (mkdir(parents=True) would make them 0755).
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)
        os.chmod(d, 0o700)
    # mkdir's mode is filtered by the umask and ignored for an existing dir, so set it explicitly; only
    # for dirs we own, since chmod on someone else's (e.g. a shared CHATCLI_HOME parent) would fail.
    st = path.stat()
    getuid = getattr(os, "getuid", None)
    if getuid is not None and st.st_uid == getuid() and stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def atomic_write_with(path: Path, write: Callable[[int], None], mode: int = 0o600) -> None:
    """Create ``path`` atomically: ``write(fd)`` fills a temp file in the same directory, then fsync + rename +
    directory fsync. On any failure the temp file is removed and ``path`` is untouched."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        write(fd)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` via temp file + fsync + rename + directory fsync."""
    atomic_write_with(path, lambda fd: write_all(fd, data), mode)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def append_line_durably(path: Path, line: str) -> None:
    """Append one line and fsync it: a transcript record is on disk before the state that depends on it."""
    append_durably(path, (line.rstrip("\n") + "\n").encode("utf-8"))


def append_durably(path: Path, data: bytes) -> None:
    """Append ``data`` and fsync it, all or nothing as far as the process can tell.

    If a write fails part-way (ENOSPC, EIO), the bytes already written are cut off again, so the next append
    (once there is room) does not land after half a record and spoil it too.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        start = os.fstat(fd).st_size  # one writer per file (the conversation's lock): the end stays here
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # the reader detects a torn record anyway; the original error is what matters
            raise
    finally:
        os.close(fd)
