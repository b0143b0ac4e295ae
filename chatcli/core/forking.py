"""``chatcli fork``: a new conversation sharing a prefix of another one's history.

The child's transcript gets the parent's messages up to the fork point and its state file gets a copy of
the parent's live KV records covering those positions: nothing is evaluated, not even the model is loaded.
"""

from __future__ import annotations

from pathlib import Path

from chatcli.core import statefile as sf
from chatcli.core.events import ConversationError
from chatcli.core.store import ConversationStore
from chatcli.core.transcript import replay_events


def fork_conversation(store: ConversationStore, ref: str, at: int | None) -> tuple[str, int]:
    parent = store.resolve(ref)
    meta = parent.read_meta()
    r = replay_events(parent.read_transcript().events)
    users = [m for m in r.active if m.role == "user"]
    turns = len(users)
    at = turns if at is None else at
    if not 0 <= at <= turns:
        raise ConversationError(f"--at must be between 0 and {turns} (the conversation has {turns} exchanges)")
    cut = users[at].p0 if at < turns else (r.active[-1].p1 if r.active else len(r.prefix_tokens))
    keep = [m for m in r.active if m.p1 <= cut]

    child_meta = {k: v for k, v in meta.items() if k not in ("id", "created", "updated")}
    child_meta.update(title=f"{meta.get('title') or parent.id} (fork at {at})", forked_from=parent.id,
                      turns=at, tokens=cut)
    child = store.create(child_meta)
    child.lock()
    try:
        prefix = next(e for e in parent.read_transcript().events if e.get("type") == "prefix")
        child.append_event({k: v for k, v in prefix.items() if k not in ("v", "ts")})
        for new_mid, m in enumerate(keep):
            child.append_event({
                "type": "message", "mid": new_mid, "role": m.role, "text": m.text, "tokens": m.tokens,
                "span": [m.p0, m.p1], "turn": m.turn, "alt": 0, **({"stop": m.stop} if m.stop else {}),
            })
        copied = _copy_state(parent.state_path, child.state_path, cut)
    finally:
        child.unlock()
    return child.id, copied


def _copy_state(src: Path, dst: Path, cut: int) -> int:
    res = sf.scan(src)
    if res.header is None:
        return 0  # the child rebuilds its KV from the transcript on first resume
    chunks, logits, _ = res.live()
    records = [sf.encode_record(sf.HEADER, 0, 0, sf.header_payload(res.header["identity"]))]
    n = 0
    for ch in chunks:
        if ch.record.p0 >= cut or ch.record.p0 != n:
            break
        payload = sf.read_payload(src, ch.record)
        records.append(sf.encode_record(ch.record.kind, ch.record.p0, ch.record.p1, payload))
        n = min(ch.end, cut)
        if n < ch.record.p1:
            records.append(sf.encode_record(sf.TRUNCATE, n, n, b""))
        if n >= cut:
            break
    if logits is not None and logits.p0 <= n:
        # Logits depend only on the tokens before p0, which the child shares: /regen right after a fork
        # samples from them instead of re-evaluating a token.
        records.append(sf.encode_record(sf.LOGITS, logits.p0, logits.p0, sf.read_payload(src, logits)))
    sf.StateWriter(dst).rewrite(records)
    return n
