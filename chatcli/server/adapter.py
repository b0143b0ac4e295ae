"""The server's only contact with the conversation core's API.

Everything the server does to a conversation goes through these functions, so a change in the core
(``Conversation``'s split into transcript / state log / policy) is absorbed here. Appending a client-written
message without generating is the core's (``Conversation.append_user`` / ``append_reply``), and so is
forking at any message boundary (``core.forking.fork_after``, which ``chatcli fork`` uses at whole exchanges).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatcli.backends.llamacpp import Engine, Sampling
from chatcli.core.conversation import (
    Conversation,
    ConversationError,
    Event,
    Progress,
    ResumeReport,
    replay_events,
)
from chatcli.core.files.store import ConversationDir, ConversationStore
from chatcli.core.forking import fork_after, fork_state
from chatcli.core.kv.log import CellLog
from chatcli.core.loading import create_conversation, open_conversation
from chatcli.core.opening import Opening
from chatcli.core.steps import drain
from chatcli.core.template import Message
from chatcli.errors import ChatcliError
from chatcli.session import Session


class OpenCancelled(Exception):
    """Opening stopped between two batches because the request's client went away."""


class StaleForkError(ChatcliError):
    """The parent no longer has the boundary a fork was asked for (changed since it was indexed)."""

    kind = "conflict"


@dataclass
class Opened:
    conv: Conversation
    notices: list[str]
    report: ResumeReport | None = None


def _drain(opening: Opening[Conversation], session: Session, cancelled: Callable[[], bool] | None = None) -> Opened:
    """Run an opening to its end, its notices collected; its conversation gets the state budget hook
    (applied after every state write, see Session). ``cancelled`` is asked between evaluated batches of a
    rebuild: True closes the opening (releasing the conversation's lock; the state file is rewritten only
    once a rebuild completes, so it is left as it was) and raises ``OpenCancelled``."""
    done = drain(opening, stop=cancelled)
    if done.stopped:
        raise OpenCancelled("the client went away")
    notices = [n.text for n in done.notices]
    conv = opening.conversation
    text = session.attach_budget(conv)
    if text:
        notices.append(text)
    return Opened(conv, notices, opening.report)


def create(session: Session, engine: Engine, *, persona: Sequence[Message], persona_name: str, persona_hash: str, seed: int,
           sampling: Sampling, max_tokens: int, meta: dict[str, Any]) -> Opened:
    """A new conversation from a persona (its prefix from the shared prefix cache when present)."""
    from chatcli.core.files.fsutil import ensure_private_dir

    opened = _drain(create_conversation(
        session.store, engine, session.template,
        persona_name=persona_name, persona_messages=list(persona), persona_hash=persona_hash,
        identity=session.identity(), model_path=str(session.local_model.path), sampling=sampling, seed=seed,
        prefix_cache_dir=ensure_private_dir(session.paths.prefix_cache_dir), max_tokens=max_tokens,
        reserve=session.settings.reserve,
    ), session)
    opened.conv.update_meta(meta)
    return opened


def open_(session: Session, engine: Engine, cid: str, *, sampling: Sampling, max_tokens: int,
          cancelled: Callable[[], bool] | None = None) -> Opened:
    """Restore a stored conversation (takes its lock; raises LockedError if another process has it).
    ``cancelled`` is asked between batches of a rebuild: True stops it (``OpenCancelled``)."""
    return _drain(open_conversation(
        session.store, cid, engine, session.template, identity=session.identity(),
        sampling=sampling, max_tokens=max_tokens, reserve=session.settings.reserve, lock=True,
    ), session, cancelled)


def adopt(session: Session, eng: Engine, cid: str, *, sampling: Sampling, max_tokens: int) -> Conversation | None:
    """Open a conversation whose tokens the engine already holds at its start (a fork of the resident
    conversation): cut the engine back to it instead of restoring from disk, as /regen does in the REPL.
    None when the engine or the state file do not match (then ``open_`` restores it normally)."""
    conv_dir = session.store.resolve(cid)
    conv_dir.lock()
    try:
        meta = conv_dir.read_meta()
        r = replay_events(conv_dir.read_transcript().events)
        want = r.tokens()
        conv = Conversation(eng, session.template, conv_dir, meta, r, sampling, identity=session.identity(),
                            max_tokens=max_tokens, reserve=session.settings.reserve)
        conv.after_save = lambda: session.budget_notice([conv])
        log = conv.log
        if not isinstance(log, CellLog) or not r.has_prefix or r.problems or not log.adopt_resident(want):
            conv_dir.unlock()
            return None
        return conv
    except BaseException:
        conv_dir.unlock()
        raise


def configure(conv: Conversation, *, sampling: Sampling, max_tokens: int, stop: Sequence[str]) -> None:
    """Per-request sampling, reply length and extra stop strings (cut like the template's own)."""
    conv.set_options(sampling=sampling, max_tokens=max_tokens, extra_stop=stop)


def send(conv: Conversation, text: str, *, seed: int) -> Iterator[Event]:
    return conv.send(text, seed=seed)


def reply_pending(conv: Conversation, *, seed: int) -> Iterator[Event]:
    """Generate the reply to the last message, a user message with no reply yet (0 tokens evaluated when
    the state file kept the logits after it)."""
    return conv.regen(seed=seed)


def user_tokens(conv: Conversation, text: str, history: Sequence[Message] | None = None) -> int:
    """How many tokens a user message adds after ``history`` (default: the conversation's)."""
    hist = conv.history() if history is None else list(history)
    return len(conv.engine.tokenize(conv.template.user_turn(hist, text), add_special=False))


def append(conv: Conversation, message: Message) -> Iterator[Progress]:
    """Add a message of the client's history without generating (one ``Progress`` per evaluated batch;
    closing the iterator early takes the message back out)."""
    if message.role == "user":
        return conv.append_user(message.content)
    return conv.append_reply(message.content)


def fork_at(store: ConversationStore, parent: ConversationDir, k: int, meta_update: dict[str, Any]) -> tuple[str, int]:
    """A new conversation holding the parent's persona and first ``k`` active messages (``core.forking``'s
    one fork, as ``chatcli fork`` makes them, shifted-out messages carried along): nothing evaluated, the
    parent only read. ``StaleForkError`` when the parent no longer has ``k`` messages."""
    try:
        return fork_after(store, parent, k, meta_update)
    except ConversationError as exc:
        if exc.kind == "conflict":
            raise StaleForkError(str(exc)) from exc
        raise


def copy_state(src: Path, dst: Path, cut: int) -> int:
    """The parent's KV cells covering positions [0, cut) for the child's new state file: shared with the
    parent through a hard link and a BASE record (a few hundred bytes written, nothing copied or fsynced
    but the child's small file), or, where a link cannot be made, its live records copied byte for byte
    (plus a TRUNCATE when the cut falls inside a record; the logits when they sit at or before it). This
    is what makes a client's regenerate cheap. Returns the positions the child holds."""
    return fork_state(src, dst, cut)


KV_STAMP = 4  # the first entries of ``stamp``: transcript and state file (what the resident KV depends on)


def reload_meta(conv: Conversation) -> None:
    """Take the metadata another process wrote (a title) into a resident conversation."""
    conv.meta = conv.dir.read_meta()


def stamp(conv_dir: ConversationDir) -> tuple[int, ...]:
    """What changes when anyone writes the conversation: its transcript and state file (a resident copy's
    KV is valid while those are unchanged), then its metadata (to be re-read when it changed)."""
    out = []
    for p in (conv_dir.transcript_path, conv_dir.state_path, conv_dir.meta_path):
        try:
            st = Path(p).stat()
            out += [st.st_size, st.st_mtime_ns]
        except OSError:
            out += [-1, -1]
    return tuple(out)
