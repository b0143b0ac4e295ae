"""Durable file writes (what chatcli writes either fully happened or did not happen at all), and the few
operating-system services whose form differs between systems, each behind one small function with its
fallback: file locks (``flock`` on POSIX, ``msvcrt.locking`` on Windows), directory fsync (skipped where
the system has none), hard links (an OSError where there are none, so callers copy instead), positioned
reads and writes, and copying a byte range in the kernel. Nothing else in chatcli imports ``fcntl`` or
``msvcrt`` or calls these ``os`` functions directly. The fallbacks are tested on Linux by simulating the
absence of the POSIX form (tests/test_portability.py).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

fcntl: ModuleType | None
msvcrt: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
try:
    import msvcrt
except ImportError:  # everywhere but Windows
    msvcrt = None

# Read where they are used (not bound at import), so a test can take them away.
_BUSY = {errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK, getattr(errno, "EDEADLK", errno.EAGAIN),
         getattr(errno, "EDEADLOCK", errno.EAGAIN)}
# msvcrt locks byte ranges: the byte locked lies past what a lock file holds (a PID), which stays readable.
_MSVCRT_LOCK_AT = 1 << 20


def try_lock(fd: int) -> bool:
    """Take an exclusive lock on the open file ``fd`` without waiting; False when it is held, by another
    process or through another file description of this one (``flock`` and Windows locks both refuse
    that). The lock goes with the process. Where the system has neither, True: nothing can be locked."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _BUSY:
                return False
            raise
        return True
    if msvcrt is not None:
        os.lseek(fd, _MSVCRT_LOCK_AT, os.SEEK_SET)
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError as exc:
            if exc.errno in _BUSY:
                return False
            raise
        return True
    return True


def unlock(fd: int) -> None:
    """Release ``try_lock``'s lock (closing ``fd`` releases it too)."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    elif msvcrt is not None:
        os.lseek(fd, _MSVCRT_LOCK_AT, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


def read_at(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes at ``offset`` (``os.pread``, or seek and read where it does not exist)."""
    pread = getattr(os, "pread", None)
    if pread is not None:
        return bytes(pread(fd, n, offset))
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, n)


def write_at(fd: int, data: bytes, offset: int) -> None:
    """``data`` at ``offset`` (``os.pwrite``, or seek and write where it does not exist)."""
    pwrite = getattr(os, "pwrite", None)
    view = memoryview(data)
    while view:
        if pwrite is not None:
            n = pwrite(fd, view, offset)
        else:
            os.lseek(fd, offset, os.SEEK_SET)
            n = os.write(fd, view)
        view, offset = view[n:], offset + n


def hard_link(src: Path, dst: Path) -> None:
    """A second name for ``src``; OSError where the system or the filesystem has no hard links (FAT,
    another filesystem, no permission), for the caller to copy instead."""
    link = getattr(os, "link", None)
    if link is None:
        raise OSError(errno.ENOTSUP, "hard links are not available here", str(dst))
    link(src, dst)


def copy_range(fin: int, fout: int, offset: int, size: int) -> None:
    """Append ``size`` bytes of ``fin`` from ``offset`` to ``fout``: in the kernel where it can
    (``os.copy_file_range``, Linux; a reflink on filesystems that share extents), else through memory."""
    copy = getattr(os, "copy_file_range", None)
    done = 0
    while done < size and copy is not None:
        try:
            k = copy(fin, fout, size - done, offset + done)
        except OSError:
            k = 0
        if k <= 0:  # not supported here (or a short copy): finish through user space
            break
        done += k
    if done < size:
        os.lseek(fout, 0, os.SEEK_END)
        while done < size:
            chunk = read_at(fin, min(size - done, 1 << 24), offset + done)
            if not chunk:
                raise OSError(errno.EIO, "file shorter than expected while copying")
            write_all(fout, chunk)
            done += len(chunk)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX needs the directory fsynced too). Skipped
    where the system has no directory fsync (Windows: no ``O_DIRECTORY``; NTFS journals renames)."""
    o_directory = getattr(os, "O_DIRECTORY", None)
    if o_directory is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY | o_directory)
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
        fchmod = getattr(os, "fchmod", None)  # not on Windows before Python 3.13 (mkstemp makes it 0600)
        if fchmod is not None:
            fchmod(fd, mode)
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


def write_all(fd: int, data: bytes | memoryview | Sequence[bytes | memoryview]) -> None:
    """Write ``data`` (or the buffers of a sequence, in order, not joined first: a state record is
    megabytes) whole. One ``os.write`` per buffer, not ``writev``: a few syscalls against milliseconds of
    copying, and the tests' full disks are ``os.write``s that fail."""
    for buf in (data,) if isinstance(data, (bytes, memoryview)) else data:
        view = memoryview(buf).cast("B")
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


def append_durably(path: Path, data: bytes | Sequence[bytes | memoryview], *, sync: bool = True) -> None:
    """Append ``data`` (or the buffers of a sequence, in order, not joined: a state record is
    megabytes) and fsync it, all or nothing as far as the process can tell. ``sync=False`` skips
    the fsync: the bytes survive the process being killed (they are in the OS's cache), not an OS crash,
    until the next synced append of the same file, whose fsync covers them too.

    If a write fails part-way (ENOSPC, EIO), the bytes already written are cut off again, so the next append
    (once there is room) does not land after half a record and spoil it too.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        start = os.fstat(fd).st_size  # one writer per file (the conversation's lock): the end stays here
        try:
            write_all(fd, data)
            if sync:
                os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # the reader detects a torn record anyway; the original error is what matters
            raise
    finally:
        os.close(fd)


def remove_stale_temp_files(folder: Path, *, older_than: float = 600.0) -> int:
    """Remove temp files of ``atomic_write_with`` (``.<name>.*.tmp``) that a process killed mid-write left
    in ``folder``, a folder no lock protects (the prefix cache): only those older than ``older_than``
    seconds, since a live writer's temp file is younger than any write takes. Returns how many went."""
    gone = 0
    limit = time.time() - older_than
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        if not (entry.name.startswith(".") and entry.name.endswith(".tmp")):
            continue
        try:
            if entry.is_file(follow_symlinks=False) and entry.stat().st_mtime < limit:
                os.unlink(entry.path)
                gone += 1
        except OSError:
            continue
    return gone

