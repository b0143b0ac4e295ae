"""Creating a conversation from a persona, or opening one from its files: the core's one lifecycle.

Both take the conversation's lock and return an ``Opening`` (its events, then ``.conversation`` and
``.report``). If either fails, or its consumer stops it before the conversation is there, the lock is
released: a long-lived process (the server) can try again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Generator, TypeVar

from chatcli.core.backend import Backend, Sampling
from chatcli.core.conversation import Conversation
from chatcli.core.events import ConversationError, Event, Notice, ResumeReport
from chatcli.core.files.store import ConversationDir, ConversationStore
from chatcli.core.kv import prefix
from chatcli.core.kv.log import CellLog
from chatcli.core.opening import Opening, Steps
from chatcli.core.template import ChatTemplate, Message
from chatcli.core.transcript import Transcript, replay_events
from chatcli.units import counted


def create_conversation(
    store: ConversationStore, backend: Backend, template: ChatTemplate, *, persona_name: str,
    persona_messages: list[Message], persona_hash: str, identity: dict[str, Any], model_path: str,
    sampling: Sampling, seed: int, prefix_cache_dir: Path | None = None, max_tokens: int = 1024, reserve: int = 256,
    extra_meta: dict[str, Any] | None = None, keep: bool = False,
) -> Opening[Conversation]:
    """Start a conversation from a persona: its events are the prefix's progress (or cache hit). ``extra_meta``:
    more fields for its metadata (the template it was started with). ``keep``: see ``Conversation.start``."""
    meta = {
        "title": "", "persona": persona_name, "persona_hash": persona_hash, "model": {"path": model_path, **identity},
        "params": backend.identity(), "seed": seed, "turns": 0, "tokens": 0, **(extra_meta or {}),
    }
    conv = store.create(meta)
    conv.lock()

    def body() -> Steps[Conversation]:
        prefix_tokens = prefix.persona_prefix_tokens(backend, template, persona_messages)
        conv.append_event({
            "type": "prefix", "persona": persona_name, "persona_hash": persona_hash, "tokens": prefix_tokens,
            "messages": [m.as_dict() for m in persona_messages], "span": [0, len(prefix_tokens)],
        })
        replay = replay_events(conv.read_transcript().events)
        c = Conversation(backend, template, conv, conv.read_meta(), replay, sampling, identity=identity,
                         max_tokens=max_tokens, reserve=reserve)
        cache_file = None
        if prefix_cache_dir is not None:
            cache_file = prefix.cache_path(prefix_cache_dir, c.state_identity(), persona_hash, template.cache_key)
        yield from c.start(cache_file, keep=keep)
        return c, None

    return Opening(_unlock_if_failed(conv, body()))


def open_conversation(
    store: ConversationStore, ref: str | None, backend: Backend, template: ChatTemplate, *,
    identity: dict[str, Any], sampling: Sampling, max_tokens: int = 1024, reserve: int = 256, lock: bool = True,
    persona_messages: list[Message] | None = None,
) -> Opening[Conversation]:
    """Resume a conversation: restore its KV from what was saved, evaluating only what is missing."""
    conv = store.resolve(ref)
    if lock:
        conv.lock()

    def body() -> Steps[Conversation]:
        meta = conv.read_meta()
        tr = conv.read_transcript()
        conv.repair_transcript_tail()
        for p in tr.problems:
            yield Notice(p, "warn")
        replay = replay_events(tr.events)
        for p in replay.problems:
            yield Notice(p, "warn")
        if not replay.has_prefix:
            if replay.all or persona_messages is None:
                raise ConversationError(f"conversation {conv.id}: its transcript lost the persona prefix record")
            # Killed before the first transcript line was written: start the prefix now from the persona.
            toks = prefix.persona_prefix_tokens(backend, template, persona_messages)
            Transcript(conv, replay).append({
                "type": "prefix", "persona": meta.get("persona", ""), "persona_hash": meta.get("persona_hash", ""),
                "messages": [m.as_dict() for m in persona_messages], "tokens": toks, "span": [0, len(toks)]})
            yield Notice("the conversation had no transcript yet: started it from its persona", "warn")
        if replay.torn_redo:
            # Killed between a /redo's events (one per message): the redo is finished, not left half done.
            n = len(replay.torn_redo)
            tr_ = Transcript(conv, replay)
            for mid in list(replay.torn_redo):
                tr_.append({"type": "activate", "mid": mid, "p0": len(replay.tokens()), "redo": False})
            yield Notice(f"the last /redo was interrupted: brought back the {counted(n, 'message')} it had left", "warn")
        c = Conversation(backend, template, conv, meta, replay, sampling, identity=identity,
                         max_tokens=max_tokens, reserve=reserve)
        report = ResumeReport()
        yield from c.restore(report)
        return c, report

    return Opening(_unlock_if_failed(conv, body()))


def adopt_conversation(
    store: ConversationStore, cid: str, backend: Backend, template: ChatTemplate, *, identity: dict[str, Any],
    sampling: Sampling, max_tokens: int = 1024, reserve: int = 256,
) -> Conversation | None:
    """Open a conversation whose tokens ``backend`` already holds at its start (the server's fork of the
    conversation resident there): the backend is cut back to it instead of restoring from disk, as /regen
    does in the REPL. Takes its lock. None, the lock released and the backend unchanged, when the backend
    or the state file do not match (``open_conversation`` then restores it)."""
    conv_dir = store.resolve(cid)
    conv_dir.lock()
    try:
        meta = conv_dir.read_meta()
        r = replay_events(conv_dir.read_transcript().events)
        conv = Conversation(backend, template, conv_dir, meta, r, sampling, identity=identity,
                            max_tokens=max_tokens, reserve=reserve)
        # Only a cell log can take the resident cells (a checkpoint log restores its checkpoint).
        # A torn /redo is finished by open_conversation (it writes the transcript; adopting would not).
        if (not isinstance(conv.log, CellLog) or not r.has_prefix or r.problems or r.torn_redo
                or not conv.log.adopt_resident(r.tokens())):
            conv_dir.unlock()
            return None
        return conv
    except BaseException:
        conv_dir.unlock()
        raise


_R = TypeVar("_R")


def _unlock_if_failed(conv: ConversationDir, body: Generator[Event, None, _R]) -> Generator[Event, None, _R]:
    """Run an opening ``body``; if it fails, or its consumer goes away first, release the lock (a no-op when
    this process did not take it). Once it has returned the conversation, the lock is the conversation's."""
    try:
        return (yield from body)
    except BaseException:
        conv.unlock()
        raise
