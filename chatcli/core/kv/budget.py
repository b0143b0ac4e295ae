"""The state budget: a bound on the bytes of all KV state files, kept by evicting the least recently used.

What counts: every conversation's ``state.kv`` and every persona prefix file in the cache. What is never
touched: transcripts and metadata (the truth: an evicted conversation rebuilds its KV from the transcript's
token ids on its next resume), a conversation that is open (its lock is held: by another process, or by this
one on another file description, which ``flock`` refuses just the same), and the prefix files the caller says
are in use.

Last use is the conversation's metadata ``updated`` time (written after every turn and rollback; what
``chatcli ls`` sorts by and what ``resume`` without an id picks), or the state file's mtime when that is
later (a resume that rebuilt the state). Access times are not used: most systems mount with ``relatime`` or
``noatime``, and a backup or a ``grep`` would count as use. Prefix files are touched when a new conversation
loads them, so their mtime is their last use.

Shared bytes count once. A fork's state refers to its parent's file through a hard link (``state.base-*.kv``
in the fork's folder, see records.py): one inode, several names. Every total here adds each inode
(``st_dev``, ``st_ino``) once, and evicting a conversation frees only the inodes no other remaining item
still links: dropping a parent whose bytes a fork shares frees nothing of them (the fork keeps them).

This module only deals with files: no UI, no engine, no numpy.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chatcli.core.files.index import Index, IndexUnavailable
from chatcli.core.files.migrations import FormatError
from chatcli.core.files.store import ConversationDir, LockedError, StoreError
from chatcli.core.kv import records
from chatcli.units import format_size

DEFAULT_BUDGET = "20GB"


_Inode = tuple[int, int]  # (st_dev, st_ino)


@dataclass(frozen=True)
class StateItem:
    """One evictable file: a persona prefix file, or a conversation's state file with its base links."""

    path: Path
    size: int  # bytes of its distinct inodes (some may be shared with other items)
    last_used: float
    conv_id: str | None  # None for a persona prefix file
    inodes: tuple[tuple[_Inode, int], ...] = ()  # each distinct inode it links, with its size

    @property
    def kind(self) -> str:
        return "prefix" if self.conv_id is None else "conversation"


def _distinct(items: Iterable[StateItem]) -> int:
    """Bytes of the items' inodes, each inode once."""
    seen: dict[_Inode, int] = {}
    for item in items:
        seen.update(item.inodes)
    return sum(seen.values())


@dataclass
class Usage:
    items: list[StateItem] = field(default_factory=list)

    @property
    def total(self) -> int:
        return _distinct(self.items)

    @property
    def conversations(self) -> int:
        return _distinct(i for i in self.items if i.conv_id is not None)

    @property
    def prefixes(self) -> int:
        return _distinct(i for i in self.items if i.conv_id is None)


@dataclass
class Freed:
    """What applying a budget did; ``summary()`` is the one line a front end shows."""

    budget: int | None
    before: int
    after: int
    evicted: list[StateItem] = field(default_factory=list)
    spared_open: list[str] = field(default_factory=list)  # over budget, but open: left alone
    freed: int = 0  # bytes actually released (a shared inode only when its last link went)

    @property
    def over_budget(self) -> bool:
        return self.budget is not None and self.after > self.budget

    def summary(self) -> str:
        if self.budget is None:
            return f"no state budget (unlimited): {format_size(self.after)} of KV state kept"
        convs = [i.conv_id for i in self.evicted if i.conv_id is not None]
        n_prefix = sum(1 for i in self.evicted if i.conv_id is None)
        limit = f"state budget {format_size(self.budget)}"
        if not self.evicted:
            head = f"{limit}: nothing to free ({format_size(self.after)} in use)"
        else:
            what = []
            if convs:
                shown = ", ".join(convs[:6]) + (f" and {len(convs) - 6} more" if len(convs) > 6 else "")
                what.append(f"the KV state of {len(convs)} conversation{'s' if len(convs) != 1 else ''} ({shown})")
            if n_prefix:
                what.append(f"{n_prefix} persona prefix{'es' if n_prefix != 1 else ''}")
            head = (f"{limit}: freed {format_size(self.freed)} by dropping {' and '.join(what)}; "
                    f"{format_size(self.after)} in use")
            if convs:
                head += "; they resume by re-evaluating their transcript"
        if self.over_budget:
            head += f"; still over: open conversation{'s' if len(self.spared_open) != 1 else ''} " \
                    f"{', '.join(self.spared_open) or '(none)'} kept"
        return head


# -- usage ---------------------------------------------------------------------------------------


def _conv_files(path: Path) -> list[Path]:
    """A conversation's state files: ``state.kv`` and the base files it links (a fork's shared bytes)."""
    return [path / "state.kv", *sorted(path.glob("state.base-*.kv"))]


def _inodes(files: Iterable[Path]) -> tuple[tuple[_Inode, int], ...]:
    out: dict[_Inode, int] = {}
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        out[(st.st_dev, st.st_ino)] = st.st_size
    return tuple(out.items())


def _conv_item(path: Path) -> StateItem | None:
    state = path / "state.kv"
    try:
        st = state.stat()
    except FileNotFoundError:
        return None
    last = st.st_mtime
    try:
        meta = json.loads((path / "meta.json").read_text("utf-8"))
        if isinstance(meta, dict) and isinstance(meta.get("updated"), (int, float)):
            last = max(last, float(meta["updated"]))
    except (OSError, ValueError, UnicodeDecodeError):
        pass  # unreadable metadata: the state file's mtime is the best guess
    inodes = _inodes(_conv_files(path))
    return StateItem(state, sum(n for _, n in inodes), last, path.name, inodes)


def scan_usage(conversations_dir: Path, prefix_dir: Path | None) -> Usage:
    """Every state file and prefix file with its size and last use (a stat each; metadata read per file)."""
    usage = Usage()
    if conversations_dir.is_dir():
        for entry in os.scandir(conversations_dir):
            if entry.is_dir(follow_symlinks=False):
                item = _conv_item(Path(entry.path))
                if item is not None:
                    usage.items.append(item)
    if prefix_dir is not None and prefix_dir.is_dir():
        for entry in os.scandir(prefix_dir):
            if entry.name.endswith(".kv") and entry.is_file(follow_symlinks=False):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                usage.items.append(StateItem(Path(entry.path), st.st_size, st.st_mtime, None,
                                             (((st.st_dev, st.st_ino), st.st_size),)))
    return usage


def total_bytes(conversations_dir: Path, prefix_dir: Path | None) -> int:
    """Only the sizes (no metadata reads), each inode once: the check that runs after every save."""
    seen: dict[_Inode, int] = {}
    for root, conv in ((conversations_dir, True), (prefix_dir, False)):
        if root is None or not root.is_dir():
            continue
        for entry in os.scandir(root):
            try:
                if conv and entry.is_dir(follow_symlinks=False):
                    # A listing per conversation (not a stat of state.kv alone): its base links count too.
                    for sub in os.scandir(entry.path):
                        if sub.name == "state.kv" or (sub.name.startswith("state.base-") and sub.name.endswith(".kv")):
                            st = sub.stat(follow_symlinks=False)
                            seen[(st.st_dev, st.st_ino)] = st.st_size
                elif not conv and entry.name.endswith(".kv"):
                    st = entry.stat()
                    seen[(st.st_dev, st.st_ino)] = st.st_size
            except FileNotFoundError:
                continue
    return sum(seen.values())


def prefix_bytes(prefix_dir: Path | None) -> int:
    """Bytes of the persona prefix files (a few per model): the part of the total the index does not keep."""
    seen: dict[_Inode, int] = {}
    if prefix_dir is None or not prefix_dir.is_dir():
        return 0
    for entry in os.scandir(prefix_dir):
        if entry.name.endswith(".kv"):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def resync_index(index: Index | None, conversations_dir: Path) -> None:
    """Set the index's state files (and so its running total) from a full scan: after an eviction, the
    rare time the budget rescans anyway, whatever wrote state files behind the index's back is counted."""
    if index is None:
        return
    try:
        usage = scan_usage(conversations_dir, None)
        index.set_all_files((i.conv_id, [(d, n, sz) for (d, n), sz in i.inodes])
                            for i in usage.items if i.conv_id is not None)
    except (sqlite3.Error, IndexUnavailable):
        pass  # the running total stays as it was: the next rescan sets it


# -- eviction ------------------------------------------------------------------------------------


def enforce(
    conversations_dir: Path,
    prefix_dir: Path | None,
    budget: int | None,
    *,
    keep_ids: Iterable[str] = (),
    keep_prefixes: Iterable[Path] = (),
) -> Freed:
    """Drop least-recently-used state files until the total is within ``budget`` (None: no limit).

    ``keep_ids`` are conversations the caller has open (spared even if their lock were not held);
    ``keep_prefixes`` are prefix files in use. Other open conversations are recognised by their lock.
    """
    usage = scan_usage(conversations_dir, prefix_dir)
    before = usage.total
    freed = Freed(budget=budget, before=before, after=before)
    if budget is None or before <= budget:
        return freed
    keep = set(keep_ids)
    keep_paths = {Path(p).resolve() for p in keep_prefixes}
    # How many remaining items link each inode: its bytes are freed when the last of them goes.
    links: dict[_Inode, int] = {}
    for item in usage.items:
        for ino, _ in item.inodes:
            links[ino] = links.get(ino, 0) + 1
    total = before

    def release(item: StateItem) -> int:
        gone = 0
        for ino, size in item.inodes:
            links[ino] -= 1
            if links[ino] == 0:
                gone += size
        return gone

    for item in sorted(usage.items, key=lambda i: (i.last_used, i.size)):
        if total <= budget:
            break
        if item.size == 0:
            continue
        if item.conv_id is None:
            if item.path.resolve() in keep_paths or _newer(item.path):
                continue
            if _unlink(item.path):
                gone = release(item)
                total -= gone
                freed.freed += gone
                freed.evicted.append(item)
            continue
        if item.conv_id in keep:
            freed.spared_open.append(item.conv_id)
            continue
        outcome = _evict_conversation(item)
        if outcome == "evicted":
            gone = release(item)
            total -= gone
            freed.freed += gone
            freed.evicted.append(item)
        elif outcome == "open":
            freed.spared_open.append(item.conv_id)
    freed.after = total
    return freed


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return False


def _newer(path: Path) -> bool:
    """``path`` is a state file of a newer chatcli: never touched here (it is not ours to drop or rewrite)."""
    try:
        records.check_format(path)
    except FormatError:
        return True
    return False


def _evict_conversation(item: StateItem) -> str:
    """Delete one conversation's state file under its lock: "evicted", "open" (locked, or vanished), or
    "newer" (its metadata or state file was written by a newer chatcli: left alone, checked first)."""
    conv = ConversationDir(item.path.parent)
    try:
        conv.lock()
    except (LockedError, OSError):
        return "open"
    try:
        try:
            meta: dict[str, Any] | None = conv.read_meta()  # also checks the state file's format
        except FormatError:
            return "newer"
        except (StoreError, OSError):
            meta = None  # unreadable metadata: the state file is still only a cache
            if _newer(conv.state_path):
                return "newer"
        if not _unlink(conv.state_path):
            return "open"
        for base in _conv_files(conv.path)[1:]:  # its base links: useless without the file naming them
            _unlink(base)
        if meta is not None:
            meta["evicted"] = {"at": round(time.time(), 3), "bytes": item.size}
            try:
                conv.write_meta(meta)
            except OSError:
                pass  # the marker only improves the resume message; the state file is gone either way
        return "evicted"
    finally:
        conv.unlock()


def was_evicted(meta: dict[str, object]) -> bool:
    """The conversation's state was dropped by a budget (and not rebuilt since)."""
    return isinstance(meta.get("evicted"), dict)


__all__ = [
    "DEFAULT_BUDGET", "Freed", "StateItem", "Usage", "enforce", "prefix_bytes", "resync_index", "scan_usage",
    "total_bytes", "was_evicted",
]
