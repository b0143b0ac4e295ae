"""``chatcli fork`` and the server's forks: a new conversation sharing a prefix of another one's history.

The child's transcript gets the parent's messages up to the fork point. Its state file *refers* to the
parent's bytes instead of copying them (see kv/records.py, BASE records): the parent's ``state.kv`` is
hard-linked into the child's folder as its base, and the child's own file holds a header, the BASE record
and a TRUNCATE to the fork point: a few hundred bytes however long the parent is, nothing evaluated, not
even the model loaded. Where a link cannot be made (another filesystem, no permission, a chain of forks
too deep) the live records are copied byte for byte instead, as before.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from chatcli.core.events import ConversationError
from chatcli.core.export import exchange_counts
from chatcli.core.files.fsutil import atomic_write_bytes, atomic_write_with, copy_range, hard_link, write_all
from chatcli.core.files.store import ConversationDir, ConversationStore
from chatcli.core.kv import records as sf
from chatcli.core.transcript import ActiveMessage, Replay, replay_events


def fork_conversation(store: ConversationStore, ref: str, at: int | None) -> tuple[str, int]:
    """``chatcli fork``: a child holding the parent's first ``at`` exchanges (default all), counted as
    ``chatcli ls`` counts turns. Returns (child id, positions of KV state it got)."""
    parent = store.resolve(ref)
    meta = parent.read_meta()
    r = replay_events(parent.read_transcript().events)
    users = [m for m in r.active if m.role == "user"]
    # Exchanges are counted as `chatcli ls` counts turns (and `show` lists them): those a context shift
    # took out of the context come first. Their cells are gone: a fork starts at the context's first one.
    turns, in_context = exchange_counts(r)
    gone = turns - in_context
    at = turns if at is None else at
    if not 0 <= at <= turns:
        raise ConversationError(f"--at must be between 0 and {turns} (the conversation has {turns} exchanges)")
    if at < gone:
        raise ConversationError(f"exchanges 1..{gone} left the context in a shift (their KV state is gone): "
                                f"fork at {gone}..{turns}, or export the conversation")
    kept = at - gone  # exchanges of the context the fork keeps
    cut = users[kept].p0 if kept < len(users) else (r.active[-1].p1 if r.active else len(r.prefix_tokens))
    n_messages = sum(1 for m in r.active if m.p1 <= cut)
    return fork_after(store, parent, n_messages,
                      {"title": f"{meta.get('title') or parent.id} (fork at {at})"})


def fork_after(store: ConversationStore, parent: ConversationDir, k: int,
               meta_update: dict[str, Any]) -> tuple[str, int]:
    """The one fork of CLI and server: a new conversation holding the parent's persona and first ``k``
    active messages, with the KV records covering them shared (or copied, see ``fork_state``; the logits
    after them when the parent kept those): nothing evaluated. ``meta_update`` goes into the child's
    metadata. The parent is only read: its later turns stay where they are for whoever is on them. A fork
    that fails leaves nothing behind. Returns (child id, positions of KV state the child holds).
    """
    meta = parent.read_meta()
    events = parent.read_transcript().events
    r = replay_events(events)
    if not 0 <= k <= len(r.active):  # changed since the caller looked (a REPL /undo between two requests)
        raise ConversationError(f"cannot fork {parent.id} after {k} messages: it has {len(r.active)}",
                                kind="conflict")
    keep = r.active[:k]
    cut = keep[-1].p1 if keep else len(r.prefix_tokens)
    # A checkpoint (a llama-server slot file) belongs to the parent: the child saves its own under a new name.
    # "evicted" describes the parent's state file, not the child's (whose state is shared or copied).
    child_meta = {key: v for key, v in meta.items()
                  if key not in ("id", "created", "updated", "checkpoint", "evicted")}
    child_meta.update(forked_from=parent.id, turns=sum(1 for m in keep if m.role == "user"), tokens=cut,
                      **meta_update)
    child = store.create(child_meta)
    child.lock()
    try:
        write_child_transcript(child, events, r, keep)
        copied = fork_state(parent.state_path, child.state_path, cut)
    except BaseException:
        child.unlock()
        store.remove(child)
        raise
    child.unlock()
    return child.id, copied


def write_child_transcript(child: ConversationDir, events: list[dict[str, Any]], r: Replay,
                           keep: list[ActiveMessage]) -> None:
    """A fork's transcript: the parent's persona prefix, the messages context shifts took out of the
    parent's context (carried as such: appended after the prefix, then one shift event takes them out
    again), then the active messages ``keep`` at their positions. So the child's history is the parent's
    whole history up to the fork point (``ls`` counts, ``export`` and the server's chain keys agree), and
    its context holds the same tokens at the same positions as the parent's."""
    prefix = next(e for e in events if e.get("type") == "prefix")
    child.append_event({k: v for k, v in prefix.items() if k not in ("v", "ts")})
    start = pos = len(r.prefix_tokens)
    mid = 0
    for ev in (r.all[m] for m in r.out_of_context if m in r.all):
        tokens = [int(t) for t in ev["tokens"]]
        child.append_event(_message(mid, str(ev["role"]), str(ev.get("text", "")), tokens, pos,
                                    int(ev.get("turn", 0)), str(ev.get("stop", ""))))
        mid, pos = mid + 1, pos + len(tokens)
    if pos > start:
        child.append_event({"type": "shift", "keep": start, "drop": pos - start})
    for m in keep:
        child.append_event(_message(mid, m.role, m.text, m.tokens, m.p0, m.turn, m.stop))
        mid += 1


def _message(mid: int, role: str, text: str, tokens: list[int], p0: int, turn: int, stop: str) -> dict[str, Any]:
    return {"type": "message", "mid": mid, "role": role, "text": text, "tokens": tokens,
            "span": [p0, p0 + len(tokens)], "turn": turn, "alt": 0, **({"stop": stop} if stop else {})}


def fork_state(src: Path, dst: Path, cut: int, *, share: bool = True) -> int:
    """Give the new state file ``dst`` the cells [0, cut) of ``src``: shared through a hard link when
    possible (``share``), else copied. Returns how many positions the child holds (0: it rebuilds its KV
    from the transcript on first resume). ``dst``'s folder must be the child's own (its lock held)."""
    if share:
        n = _link_state(src, dst, cut)
        if n is not None:
            return n
    return _copy_state(src, dst, cut)


def _link_state(src: Path, dst: Path, cut: int) -> int | None:
    """The fork as a BASE record over a hard link of ``src``; None when it cannot be made (nothing left)."""
    folder = dst.parent
    name = sf.base_name(dst)
    linked: list[Path] = []
    try:
        # Link first, then index the link: the inode indexed is the one kept, whatever the parent does
        # meanwhile (a rewrite replaces its file; the link still holds the old inode, unchanged).
        hard_link(src, folder / name)
        linked.append(folder / name)
        for base in sf.base_files(src):  # the parent is a fork itself: its bases come along
            hard_link(base, folder / base.name)
            linked.append(folder / base.name)
    except OSError:  # EXDEV, EPERM, EMLINK, no links on this system, a file that vanished: copy instead
        _unlink_all(linked)
        return None
    try:
        with sf.map_state(folder / name, check=False) as ms:
            res = ms.records
            own = [r for r in res.records if r.file is None]
            if res.header is None or not own or own[0].kind != sf.HEADER or res.depth >= sf.MAX_BASE_DEPTH:
                _unlink_all(linked)
                return None
            header_crc, last = ms.stored_crc(own[0]), own[-1]
            last_crc = ms.stored_crc(last)
        _, _, n_all = res.live()
        n = min(cut, n_all)
        identity = res.header["identity"]
        records = [sf.encode_record(sf.HEADER, 0, 0, sf.header_payload(identity, based=True)),
                   sf.encode_record(sf.BASE, 0, 0, sf.base_payload(name, res.valid_bytes, header_crc,
                                                                      last.offset, last_crc))]
        if n < n_all:
            # The parent's cells after the fork point stay in the base, dead for the child; the logits
            # after the cut go with them, those at or before it stay live (live() keeps them).
            records.append(sf.encode_record(sf.TRUNCATE, n, n, b""))
        # Base links the parent had but its current file does not use (left-overs) are not needed here.
        used = {name, *res.bases}
        _unlink_all([p for p in linked if p.name not in used])
        atomic_write_bytes(dst, b"".join(records))  # also makes the links durable (the folder is fsynced)
        return n
    except BaseException:
        _unlink_all(linked)
        raise


def _unlink_all(paths: list[Path]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()


def _copy_state(src: Path, dst: Path, cut: int) -> int:
    """The parent's live KV records covering positions [0, cut), copied byte for byte into a new state file
    (plus a TRUNCATE when the cut falls inside a record, and the logits when they sit at or before it).

    The records were indexed by ``scan`` and are copied in the kernel (``os.copy_file_range``; a reflink on
    filesystems that share extents), each from the file that holds it (a parent's base). Returns the
    positions copied.
    """
    res = sf.scan(src)
    if res.header is None or not res.records or res.records[0].kind != sf.HEADER:
        return 0  # the child rebuilds its KV from the transcript on first resume
    chunks, logits, _ = res.live()
    header = sf.encode_record(sf.HEADER, 0, 0, sf.header_payload(res.header["identity"]))
    parts: list[sf.Record | bytes] = [header]
    n = 0
    for ch in chunks:
        if ch.record.p0 >= cut or ch.record.p0 != n:
            break
        parts.append(ch.record)
        n = min(ch.end, cut)
        if n < ch.record.p1:
            parts.append(sf.encode_record(sf.TRUNCATE, n, n, b""))
        if n >= cut:
            break
    if len(parts) > 1 and isinstance(parts[-1], bytes):
        # The cut fell inside a record. On a memory that cannot be cut back only a record ending exactly
        # there holds the state wanted: a whole-sequence point (SNAPSHOT from 0) serves alone.
        whole = [r for r in res.points() if r.p0 == 0 and r.p1 == n]
        if whole:
            parts = [header, whole[-1]]
    if logits is not None and logits.p0 <= n:
        # Logits depend only on the tokens before p0, which the child shares: /regen right after a fork
        # samples from them instead of re-evaluating a token.
        parts.append(logits)
    files: dict[Path, int] = {}

    def write(fd: int) -> None:
        for part in parts:
            if isinstance(part, bytes):
                write_all(fd, part)
                continue
            path = part.file or src
            if part.via >= 0:
                # A revived record (a REVIVE record's view): its bytes may say SPARE, and a REVIVE's offset
                # means nothing in the new file, so it is written as the record the state sees.
                write_all(fd, sf.encode_record(part.kind, part.p0, part.p1, sf.read_payload(src, part), part.flags))
                continue
            if path not in files:
                files[path] = os.open(path, os.O_RDONLY)
            copy_range(files[path], fd, part.offset, part.size)

    try:
        atomic_write_with(dst, write)
    finally:
        for f in files.values():
            os.close(f)
    return n
