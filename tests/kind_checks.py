"""Every state promise on one architecture's fixture, at the Conversation level, in one process (issue #20).

    python -m tests.kind_checks MODEL.gguf   (CHATCLI_HOME set by the caller)

tests/test_memory_kinds.py runs this once per architecture in a subprocess, so that a llama.cpp abort is
that architecture's result, not the test session's; one model load (one Session) serves all of its checks.
It prints one JSON object: ``{"memory": caps.memory, "checks": {name: "ok" | why it failed}}``.

Every check compares with a fresh evaluation of the same history in the same context: the logits the next
reply is sampled from must be bit-identical (``np.array_equal``), and the greedy tokens the same. The one
exception is DeepSeek-V4 (``deepseek4``): llama.cpp 0.3.36's DSV4 cache does not round-trip bit-exactly once
the sequence passes ~64 tokens (save the whole state of 69 tokens, load it, evaluate 10 more: max |Δ logit|
2.9e-6; 30 tokens: exact), a limitation of its cache and not of chatcli, so there the logits must agree
within ``DSV4_ATOL`` and the tokens exactly.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

M = ["hello there", "tell me of the sea", "and the hills", "what of the sky"]
OTHER = "say something else"
# Long enough that a 256-token context must drop exchanges after a few of them.
LONG = "a rather long message about the weather and the sea, told at length so it fills the context fast"
N_CTX = 256
DSV4_ATOL = 1e-4
CHECKS = ("resume", "regen", "undo", "undo_resume", "redo", "redo_compacted", "redo_resume", "redo_torn", "redo_regen",
          "edit", "alt", "alt_torn", "fork", "evict", "shift", "kept")


class CheckFailed(AssertionError):
    pass


def expect(ok: bool, why: str) -> None:
    if not ok:
        raise CheckFailed(why)


class Kind:
    """One architecture's session and the uninterrupted control conversation every check compares with."""

    def __init__(self, model: Path) -> None:
        from tests.drive import build_session

        self.exact = "deepseek4" not in model.stem
        self.session = build_session(model=str(model), n_ctx=N_CTX, reserve=32, max_tokens=8, threads=1)
        self.engine = self.session.engine
        # control: M[0..3] in one conversation, never interrupted
        self.control = self.talk(M)

    def new(self) -> Any:
        from tests.drive import drain

        conv, _, _ = drain(self.session.new_conversation("alice"))
        assert conv is not None
        return conv

    def state_path(self, cid: str) -> Path:
        return Path(self.session.store.resolve(cid).state_path)

    def open(self, cid: str) -> tuple[Any, Any]:
        from tests.drive import drain

        conv, report, _ = drain(self.session.open_conversation(cid))
        assert conv is not None and report is not None
        return conv, report

    def reopen(self, cid: str, what: str) -> tuple[Any, Any]:
        """Open ``cid`` again, expecting its state restored with nothing evaluated; ``what`` names the check."""
        before = self.engine.n_evaluated_total
        conv, report = self.open(cid)
        expect(report.reevaluated == 0 and self.engine.n_evaluated_total == before,
               f"{what} evaluated {self.engine.n_evaluated_total - before} "
               f"(restored {report.restored_tokens}, reason {report.reason!r})")
        return conv, report

    def talk(self, msgs: list[str], conv: Any = None) -> dict[str, Any]:
        """Send ``msgs`` (in a new conversation unless given); the replies, logits and tokens, conversation closed."""
        from tests.drive import say

        conv = conv or self.new()
        out: dict[str, Any] = {"id": conv.id, "replies": [], "logits": []}
        for m in msgs:
            toks, lg = say(conv, m)
            out["replies"].append(toks)
            out["logits"].append(lg)
        out["tokens"] = list(self.engine.tokens)
        conv.close()
        return out

    def same(self, a: np.ndarray, b: np.ndarray, what: str) -> None:
        if self.exact:
            expect(np.array_equal(a, b), f"{what}: logits differ (max |Δ| {float(np.max(np.abs(a - b))):.3g})")
        else:
            expect(np.allclose(a, b, rtol=0, atol=DSV4_ATOL),
                   f"{what}: logits differ beyond {DSV4_ATOL} (max |Δ| {float(np.max(np.abs(a - b))):.3g})")

    def continues_like_control(self, conv: Any, i: int, what: str) -> None:
        """Sending M[i] on ``conv`` gives the control's reply i and its logits."""
        from tests.drive import say

        toks, lg = say(conv, M[i])
        self.same(lg, self.control["logits"][i], what)
        expect(toks == self.control["replies"][i], f"{what}: reply tokens {toks} != {self.control['replies'][i]}")
        expect(list(self.engine.tokens) == self.control["tokens"][:len(self.engine.tokens)],
               f"{what}: the context's tokens differ from the control's")

    # -- the checks: each raises CheckFailed (or anything) with why ----------------------------------------

    def check_resume(self) -> None:
        first = self.talk(M[:2])
        conv, report = self.reopen(first["id"], "resume")
        expect(report.restored_tokens == len(first["tokens"]), f"restored {report.restored_tokens} of {len(first['tokens'])}")
        self.continues_like_control(conv, 2, "resume")
        conv.close()

    def check_regen(self) -> None:
        """Regenerate after a resume: 0 history tokens, the same greedy reply, and the next turn as the control's."""
        from tests.drive import drain

        first = self.talk(M[:2])
        conv, _ = self.open(first["id"])
        before = self.engine.n_evaluated_total
        _, _, ends = drain(conv.regen())
        end = ends[-1]
        expect(end.stats.reevaluated == 0, f"regen re-evaluated {end.stats.reevaluated}")
        evaluated = self.engine.n_evaluated_total - before
        # The new reply's tokens are decoded one by one (the last sampled one is not evaluated until the next turn).
        expect(evaluated <= len(end.message.tokens), f"regen evaluated {evaluated} for a {len(end.message.tokens)}-token reply")
        expect(end.message.tokens == self.control["replies"][1], "regen gave another greedy reply")
        self.continues_like_control(conv, 2, "after regen")
        conv.close()

    def _fresh_other(self) -> dict[str, Any]:
        if not hasattr(self, "_other"):
            self._other = self.talk([*M[:2], OTHER])
        return self._other

    def check_undo(self) -> None:
        """Undo after a resume, then a new message: the same as a conversation that never had the undone one."""
        from tests.drive import say

        full = self.talk(M[:3])
        conv, _ = self.open(full["id"])
        before = self.engine.n_evaluated_total
        stats = conv.undo(1)
        expect(self.engine.n_evaluated_total == before and not stats.reevaluated,
               f"undo evaluated {self.engine.n_evaluated_total - before}")
        toks, lg = say(conv, OTHER)
        fresh = self._fresh_other()
        self.same(lg, fresh["logits"][2], "undo")
        expect(toks == fresh["replies"][2] and list(self.engine.tokens) == fresh["tokens"], "undo: tokens differ")
        conv.close()

    def check_undo_resume(self) -> None:
        """Undo, close, resume: the state file ends with a TRUNCATE back to a point, which resume loads."""
        from tests.drive import say

        full = self.talk(M[:3])
        conv, _ = self.open(full["id"])
        conv.undo(1)
        conv.close()
        conv, _ = self.reopen(full["id"], "resume after undo")
        toks, lg = say(conv, OTHER)
        fresh = self._fresh_other()
        self.same(lg, fresh["logits"][2], "resume after undo")
        expect(toks == fresh["replies"][2], "resume after undo: tokens differ")
        conv.close()

    def check_redo(self) -> None:
        full = self.talk(M[:3])
        conv, _ = self.open(full["id"])
        conv.undo(1)
        self._redo_reads_back(conv, full["tokens"], "redo")

    def _redo_reads_back(self, conv: Any, tokens: list[int], what: str) -> None:
        """``conv.redo()`` evaluates nothing (the undone cells are read back), ends on ``tokens`` and
        continues as the control; closes ``conv``."""
        before = self.engine.n_evaluated_total
        stats = conv.redo()
        expect(stats.n_eval == 0 and self.engine.n_evaluated_total == before,
               f"{what} evaluated {self.engine.n_evaluated_total - before} (cells not read back)")
        expect(list(self.engine.tokens) == tokens, f"{what}: tokens differ")
        self.continues_like_control(conv, 3, f"after {what}")
        conv.close()

    def check_redo_compacted(self) -> None:
        """Undo every exchange, compact the state file (as a long undo triggers), redo: the compaction kept
        the undone cells (SPARE records), nothing is evaluated, and the conversation continues as the control."""
        from chatcli.core.kv import records as sf

        full = self.talk(M[:3])
        conv, _ = self.open(full["id"])
        conv.undo(3)
        conv.log.compact()
        kinds = [r.kind for r in sf.scan(conv.dir.state_path).records]
        expect(sf.SPARE in kinds, f"the compaction kept no SPARE record ({kinds})")
        self._redo_reads_back(conv, full["tokens"], "redo after a compaction")

    def check_redo_resume(self) -> None:
        """Undo two exchanges, redo them (the records read back are revived in place, not copied), resume:
        nothing evaluated, and the conversation continues as the control."""
        full = self.talk(M[:3])
        conv, _ = self.open(full["id"])
        conv.undo(2)
        conv.redo()
        conv.close()
        self._resumes_exactly(full, "resume after redo")

    def check_redo_torn(self) -> None:
        """A /redo killed after its first transcript event (the user message without its reply): opening the
        conversation brings back the rest, reads their cells back (nothing evaluated), and the conversation
        continues as the control."""
        full = self.talk(M[:3])
        conv, _ = self.open(full["id"])
        conv.undo(1)
        # What _redo writes first; the kill comes before the reply's event and before any state record.
        conv.transcript.append({"type": "activate", "mid": conv.r.redo[-1][0], "p0": self.engine.n_past, "redo": True})
        conv.close()
        self._resumes_exactly(full, "resume after a torn redo")

    def _resumes_exactly(self, full: dict[str, Any], what: str) -> None:
        conv, _ = self.reopen(full["id"], what)
        expect(list(self.engine.tokens) == full["tokens"], f"{what}: tokens differ")
        self.continues_like_control(conv, 3, what)
        conv.close()

    def check_redo_regen(self) -> None:
        """/regen right after /redo, in the same process and after a resume: the logits saved with the redone
        user message are live again, so nothing is evaluated before the reply, which is sampled from logits
        bit-identical to the first reply's (the same greedy reply), and the conversation continues as the
        control."""
        for resume in (False, True):
            what = "regen after redo" + (" and a resume" if resume else "")
            full = self.talk(M[:3])
            conv, _ = self.open(full["id"])
            conv.undo(1)
            conv.redo()
            if resume:
                conv.close()
                conv, _ = self.open(full["id"])
            self._regen_samples_the_first_logits(conv, what)
            self.continues_like_control(conv, 3, what)
            conv.close()

    def _regen_samples_the_first_logits(self, conv: Any, what: str) -> None:
        from tests.drive import drain

        before = self.engine.n_evaluated_total
        _, _, ends = drain(conv.regen())
        end = ends[-1]
        expect(end.stats.reevaluated == 0, f"{what} re-evaluated {end.stats.reevaluated} "
               f"(evaluated {self.engine.n_evaluated_total - before} for a {len(end.message.tokens)}-token reply)")
        expect(conv.turn_logits is not None, f"{what}: no logits saved for the last user message")
        self.same(conv.turn_logits[1], self.control["logits"][2], what)
        expect(end.message.tokens == self.control["replies"][2], f"{what} gave another greedy reply")

    def check_alt_torn(self) -> None:
        """An /alt killed after its transcript events, before its state records (the state file still ends
        with the reply it switched from): the resume reads the reply switched to back, evaluates nothing,
        says nothing of damage, and the conversation continues as the control."""
        from chatcli.core.backend import Sampling
        from tests.drive import drain

        first = self.talk(M[:2])
        conv, _ = self.open(first["id"])
        conv.set_options(sampling=Sampling(temperature=2.0, top_k=0, top_p=1.0, repeat_penalty=1.0))
        for seed in range(5):  # another reply than the greedy one (random weights: the first try gives one)
            drain(conv.regen(seed=seed))
            if conv.messages[-1].tokens != first["replies"][1]:
                break
        expect(conv.messages[-1].tokens != first["replies"][1], "no other reply to switch from")
        original = next(a for a in conv.alternatives() if conv.r.all[a.mid]["tokens"] == first["replies"][1])
        to = conv.messages[-1].p0
        # What _switch_alt writes before put_back and the state records (the kill comes after them).
        conv.transcript.append({"type": "truncate", "to": to, "reason": "alt"})
        conv.transcript.append({"type": "activate", "mid": original.mid, "p0": to})
        conv.close()
        conv, report = self.reopen(first["id"], "resume after a torn /alt")
        expect(report.reason == "", f"resume after a torn /alt reported {report.reason!r}")
        expect(list(self.engine.tokens) == first["tokens"], "resume after a torn /alt: tokens differ")
        self.continues_like_control(conv, 2, "resume after a torn /alt")
        conv.close()

    def check_edit(self) -> None:
        from tests.drive import drain

        first = self.talk(M[:3])
        conv, _ = self.open(first["id"])
        _, _, ends = drain(conv.edit(3, OTHER))
        assert conv.turn_logits is not None
        lg = conv.turn_logits[1].copy()
        fresh = self._fresh_other()
        self.same(lg, fresh["logits"][2], "edit")
        expect(ends[-1].message.tokens == fresh["replies"][2] and list(self.engine.tokens) == fresh["tokens"],
               "edit: tokens differ")
        conv.close()

    def check_alt(self) -> None:
        """A second alternative (regen), then back to the first: its cells read back, nothing evaluated."""
        from tests.drive import drain

        first = self.talk(M[:2])
        conv, _ = self.open(first["id"])
        drain(conv.regen())
        before = self.engine.n_evaluated_total
        stats = conv.switch_alt(0)
        expect(stats.n_eval == 0 and self.engine.n_evaluated_total == before,
               f"switch_alt evaluated {self.engine.n_evaluated_total - before} (cells not read back)")
        expect(list(self.engine.tokens) == first["tokens"], "switch_alt: tokens differ")
        self.continues_like_control(conv, 2, "after switch_alt")
        conv.close()

    def check_fork(self) -> None:
        import os

        from chatcli.config.settings import get_paths
        from chatcli.core.files.store import ConversationStore
        from chatcli.core.forking import fork_conversation
        from chatcli.core.kv import records as sf

        parent = self.talk(M[:3])
        store = ConversationStore(get_paths().conversations_dir)
        child_id, _ = fork_conversation(store, parent["id"], 2)
        child_state = store.resolve(child_id).state_path
        bases = sf.base_files(child_state)
        expect(any(os.path.samefile(b, store.resolve(parent["id"]).state_path) for b in bases),
               "the fork does not share the parent's records")
        conv, _ = self.reopen(child_id, "the fork's resume")
        self.continues_like_control(conv, 2, "fork")
        conv.close()

    def check_evict(self) -> None:
        """The state file deleted (what budget eviction does): resume rebuilds from the transcript, identically."""
        first = self.talk(M[:2])
        self.state_path(first["id"]).unlink()
        conv, report = self.open(first["id"])
        expect(report.restored_tokens == 0 and report.reevaluated == len(first["tokens"]),
               f"rebuild: restored {report.restored_tokens}, re-evaluated {report.reevaluated} of {len(first['tokens'])}")
        self.continues_like_control(conv, 2, "after rebuild")
        conv.close()
        # and the rebuilt state file resumes like any other
        conv, report = self.open(first["id"])
        expect(report.reevaluated == 0, f"second resume re-evaluated {report.reevaluated} ({report.reason})")
        self.continues_like_control(conv, 3, "resume after rebuild")
        conv.close()

    def check_shift(self) -> None:
        """Messages until the 256-token context must drop exchanges: it goes on; a memory that cannot shift says
        once that it rebuilds."""
        from chatcli.core.events import Notice
        from tests.drive import drain

        conv = self.new()
        notices: list[str] = []
        sent = 0
        for i in range(10):
            events = list(conv.send(f"{i} {LONG}"))
            notices += [e.text for e in events if isinstance(e, Notice)]
            sent += len(conv.messages[-2].tokens) + len(conv.messages[-1].tokens)
        expect(sent > N_CTX and conv.r.out_of_context, f"only {sent} tokens sent: the context never had to drop")
        expect(list(self.engine.tokens) == conv.r.tokens(), "the context does not hold the conversation's tokens")
        rebuilt = [n for n in notices if "cannot be shifted" in n]
        if self.engine.caps.shift:
            expect(not rebuilt, f"a shiftable memory rebuilt: {rebuilt}")
        else:
            expect(len(rebuilt) == 1, f"{len(rebuilt)} rebuild notices (want one): {notices}")
        cid = conv.id
        conv.close()
        # and it resumes where it was, without evaluating
        conv, report = self.open(cid)
        expect(report.reevaluated == 0, f"resume after the shift re-evaluated {report.reevaluated} ({report.reason})")
        drain(conv.send("one more"))
        conv.close()


    def check_kept(self) -> None:
        """A new conversation started where another one ends, its cells kept (``keep``: the server's new
        conversation in a context it reuses) takes up what both start with, the persona and its first message
        but the last two tokens, and computes what the control did; its state resumes exactly."""
        from tests.drive import drain, say

        self.talk(M[:1])  # the context now holds the persona prefix, M[0] and its reply
        before = self.engine.n_evaluated_total
        conv, _, _ = drain(self.session.new_conversation("alice", keep=True))
        assert conv is not None
        expect(self.engine.n_evaluated_total == before, "the persona prefix was evaluated again")
        caps = self.engine.caps
        n_msg = len(conv._user_tokens([], M[0]))
        self.continues_like_control(conv, 0, "kept")
        evaluated = self.engine.n_evaluated_total - before
        reply = len(self.control["replies"][0])
        if caps.memory == "attention" and caps.truncate and caps.ranges:
            expect(evaluated <= 2 + reply, f"evaluated {evaluated}: more than the message's last two tokens and the reply")
        else:  # nothing is kept: the message is evaluated whole
            expect(evaluated >= n_msg, f"evaluated {evaluated} of a {n_msg}-token message")
        self.continues_like_control(conv, 1, "after kept")
        conv.close()
        conv, _ = self.reopen(conv.id, "kept resume")
        self.continues_like_control(conv, 2, "kept resume")
        conv.close()
        # Its state file deleted: rebuilt from the transcript (the part taken up as a call of its own).
        self.state_path(conv.id).unlink()
        conv, report = self.open(conv.id)
        expect(report.restored_tokens == 0, f"kept rebuild restored {report.restored_tokens}")
        self.continues_like_control(conv, 3, "kept rebuild")
        conv.close()
        # A first message that only starts as the context's last one did: the same as a fresh conversation's.
        longer = M[0] + " " + OTHER
        start = self.engine.n_evaluated_total
        fresh = self.talk([longer])
        fresh_evaluated = self.engine.n_evaluated_total - start  # its message and reply (the prefix is cached)
        self.talk(M[:1])
        conv, _, _ = drain(self.session.new_conversation("alice", keep=True))
        assert conv is not None
        before = self.engine.n_evaluated_total
        toks, lg = say(conv, longer)
        n_longer = len(conv.r.active[0].tokens)
        self.same(lg, fresh["logits"][0], "kept, a longer message")
        expect(toks == fresh["replies"][0], "kept, a longer message: another reply")
        if caps.memory == "attention" and caps.truncate and caps.ranges:
            taken = conv.r.active[0].taken
            expect(taken > 0, "nothing of the longer message was taken up")
            expect(self.engine.n_evaluated_total - before == fresh_evaluated - taken,
                   f"evaluated {self.engine.n_evaluated_total - before} with {taken} of {n_longer} taken up "
                   f"(a fresh one: {fresh_evaluated})")
        conv.close()


def run(model: Path, only: list[str]) -> dict[str, Any]:
    kind = Kind(model)
    out: dict[str, Any] = {"memory": kind.engine.caps.memory, "shift": kind.engine.caps.shift, "checks": {}}
    for name in only or CHECKS:
        check: Callable[[], None] = getattr(kind, f"check_{name}")
        try:
            check()
            out["checks"][name] = "ok"
        except Exception as e:  # every failure is this check's result, with where it came from
            where = traceback.extract_tb(e.__traceback__)[-1]
            out["checks"][name] = f"{type(e).__name__}: {e} ({Path(where.filename).name}:{where.lineno})"
    kind.session.close()
    return out


if __name__ == "__main__":
    print(json.dumps(run(Path(sys.argv[1]), sys.argv[2:])))
