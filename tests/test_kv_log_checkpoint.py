"""The conversation on a backend that saves whole sequences (a remote llama-server's slot save/restore).

The real engine is seen through a checkpoint-only interface: no cell ranges, no logits, no shift. The
conversation must persist by ``checkpoint``/``restore_checkpoint`` and rebuild by evaluation otherwise,
with no change to ``Conversation`` itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from chatcli.core.backend import Capabilities
from chatcli.core.conversation import Conversation
from chatcli.core.events import ResumeReport
from chatcli.core.kv.log import CheckpointLog
from chatcli.core.loading import create_conversation, open_conversation
from chatcli.session import Session, sampling_from
from tests.drive import build_session, drain


class CheckpointEngine:
    """The real Engine behind a checkpoint-only interface; checkpoints are files in ``where`` (as a server
    keeps its slot saves in its own directory)."""

    def __init__(self, engine: Any, where: Path, *, checkpoint: bool = True) -> None:
        self._e = engine
        self.where = where
        self.caps = Capabilities(cells=False, checkpoint=checkpoint, logits=False, local_sampling=True, shift=False)
        self.saved: list[str] = []
        self.restored: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._e, name)

    def checkpoint(self, name: str) -> int:
        data = self._e.save_cells(0, self._e.n_past)
        (self.where / f"{name}.bin").write_bytes(data)
        (self.where / f"{name}.json").write_text(json.dumps(list(self._e.tokens)))
        self.saved.append(name)
        return len(data)

    def restore_checkpoint(self, name: str, tokens: Sequence[int]) -> bool:
        path = self.where / f"{name}.json"
        if not path.exists() or json.loads(path.read_text()) != list(tokens):
            return False
        self._e.clear()
        self._e.load_cells(0, len(tokens), (self.where / f"{name}.bin").read_bytes(), list(tokens))
        self.restored.append(name)
        return True


def _create(session: Session, backend: Any) -> Conversation:
    conv, _, _ = drain(create_conversation(
        session.store, backend, session.template, persona_name="alice", persona_messages=[],
        persona_hash="none", identity=session.identity(), model_path=str(session.model.path),
        sampling=sampling_from(session.settings), seed=7, max_tokens=24, reserve=32))
    assert conv is not None
    return conv


def _open(session: Session, backend: Any, cid: str) -> tuple[Conversation, ResumeReport]:
    conv, report, _ = drain(open_conversation(
        session.store, cid, backend, session.template, identity=session.identity(),
        sampling=sampling_from(session.settings), max_tokens=24, reserve=32))
    assert conv is not None and report is not None
    return conv, report


def _say(conv: Conversation, text: str) -> list[int]:
    _, _, ends = drain(conv.send(text))
    return ends[-1].message.tokens


def test_checkpoint_backend_resumes_rolls_back_and_continues_like_an_uninterrupted_one(tmp_path: Path) -> None:
    session = build_session(temperature=0.0)
    eng = session.engine
    backend = CheckpointEngine(eng, tmp_path)
    # Reference: three exchanges without interruption.
    ref = _create(session, backend)
    assert isinstance(ref.log, CheckpointLog)
    ref_replies = [_say(ref, m) for m in ("Name a fruit.", "And a colour?", "Now a number.")]
    ref.close()

    conv = _create(session, backend)
    _say(conv, "Name a fruit.")
    _say(conv, "And a colour?")
    assert backend.saved and conv.meta["checkpoint"]["tokens"] == eng.n_past  # one save per turn, recorded
    cid, want = conv.id, list(eng.tokens)
    conv.close()
    eng.clear()  # another conversation used the engine meanwhile

    before = eng.n_evaluated_total
    conv, report = _open(session, backend, cid)
    assert backend.restored and report.restored_tokens == len(want) and report.reevaluated == 0
    assert eng.n_evaluated_total == before  # nothing evaluated to resume
    assert list(eng.tokens) == want == conv.r.tokens()
    assert _say(conv, "Now a number.") == ref_replies[2]  # continues as if never interrupted

    # Rollback is truncation of the sequence; the checkpoint follows the conversation.
    conv.undo()
    assert list(eng.tokens) == conv.r.tokens() == want
    assert conv.meta["checkpoint"]["tokens"] == len(want)
    conv.close()
    conv, report = _open(session, backend, cid)
    assert report.restored_tokens == len(want) and report.reevaluated == 0
    _, _, ends = drain(conv.regen())
    assert list(eng.tokens) == conv.r.tokens()
    assert ends[-1].message.turn == 1 and len(conv.r.alternatives(1)) == 2
    conv.close()
    session.close()


def test_stale_or_missing_checkpoint_rebuilds_from_the_transcript(tmp_path: Path) -> None:
    session = build_session(temperature=0.0)
    eng = session.engine
    backend = CheckpointEngine(eng, tmp_path)
    conv = _create(session, backend)
    _say(conv, "Name a fruit.")
    cid, want = conv.id, list(eng.tokens)
    conv.close()
    for f in tmp_path.glob("*.json"):
        f.write_text(json.dumps([1, 2, 3]))  # the server's save now holds something else
    conv, report = _open(session, backend, cid)
    assert report.restored_tokens == 0 and report.reevaluated == len(want)
    assert list(eng.tokens) == want == conv.r.tokens()
    conv.close()

    # A backend with neither cells nor checkpoints still works: every open rebuilds by evaluation.
    plain = CheckpointEngine(eng, tmp_path, checkpoint=False)
    conv, report = _open(session, plain, cid)
    assert report.restored_tokens == 0 and report.reevaluated == len(want) and plain.saved == []
    _say(conv, "And a colour?")
    assert list(eng.tokens) == conv.r.tokens()
    conv.close()
    session.close()
