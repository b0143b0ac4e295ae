"""How a conversation's KV state outlives the process: chosen by what the backend can do.

The conversation (``conversation.py``) decides *what* happens to the context — a turn, a rollback, a
shift — and tells its state log through a few hooks; the log decides what to save and how to restore.

- ``CellLog`` (backends with ``caps.cells``, the local llama.cpp engine): the append-only state file
  (``records.py``). Each turn appends only the cells it added, plus the logits after the user message
  (so /regen samples again without evaluating anything); a rollback appends a TRUNCATE record; switching
  back to a reply or redoing it reads its cells back; compaction and context shifts write one snapshot
  (a compaction keeps, as SPARE records, the cells ``/redo`` and ``/alt`` can still bring back).
- ``CheckpointLog`` (backends with ``caps.checkpoint``, e.g. a remote llama-server that saves whole slots
  to its own files): after each operation the backend saves its sequence under the conversation's
  checkpoint name, and the conversation's metadata records how many tokens it holds (and their hash). On
  open the checkpoint is restored if it still matches the transcript; otherwise, or for backends with
  neither capability, the context is rebuilt by evaluating the transcript's tokens (a server reuses
  whatever common prefix its cache still has). A backend whose memory cannot be cut back (``not
  caps.truncate``: a server running a recurrent or hybrid model) also saves a second checkpoint at the
  regenerate point, and a rollback to that point restores it instead of evaluating the history again.

What a ``CellLog`` saves follows the memory (``Capabilities``): an attention cache is cut back anywhere, so
records only need to hold cells. A memory that cannot be cut back (recurrent or hybrid: Mamba, Qwen3.5,
Granite-4-H, LFM2...; or one that copies only whole sequences, DeepSeek-V4) is rolled back to *points*: every
record is saved when the sequence ends at the record's end, so its bytes hold the state there too, and the
records end at every message boundary (the persona prefix, each user message — the regenerate point, with
its logits —, each reply). Rollback = rewind to the point (``Backend.rewind``); a rollback to a position with
no point left rewinds to the nearest earlier one and evaluates the difference, then saves a point there.
Hybrid memories save cells by range (each record also carries the recurrent state); whole-sequence
memories save the whole state at each point (SNAPSHOT records) and keep the newest ``WHOLE_POINTS``.

Either way the transcript is the truth: the state log only saves time.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, Protocol, Sequence

import numpy as np

from chatcli.core.backend import Backend, BackendError
from chatcli.core.events import Event, Progress, ResumeReport, TurnStats
from chatcli.core.kv import prefix, rebuild
from chatcli.core.kv import records as sf
from chatcli.core.steps import evaluate, progress, to_the_end

if TYPE_CHECKING:
    from chatcli.core.backend import Logits

# How a rebuild batches the tokens (rebuild.segments), or a function that works it out when needed.
Plan = list[tuple[int, int]] | Callable[[], list[tuple[int, int]]]


class StateLog(Protocol):
    """The hooks a conversation calls; each keeps the saved state equal to the backend's sequence."""

    save_error: str  # the last save failure ("" once a save succeeds): the transcript is intact either way
    failures: list[str]  # failures not yet reported; the conversation turns them into Notices and clears it
    meta_changed: bool  # the log changed the conversation's metadata: write it
    on_saved: Callable[[], None] | None  # called after every successful write to this machine's disk
    # Keep a turn's writes back until ``commit`` (a server answers the reply's end first): its cells are read
    # out of the backend only then, so nothing may change the backend before (the conversation commits
    # first in every operation; the log's own operations do too).
    hold: bool
    # How the conversation's tokens were first batched (rebuild.segments), for evaluating part of it again
    # bit-identically when a rollback finds no saved point (set by the conversation).
    replan: Callable[[], list[tuple[int, int]]] | None
    # What ``put_back`` may be asked for next (set by the conversation): (p0, seq) pairs, each a token sequence
    # from position 0 whose part from p0 on /redo or /alt can bring back. A compaction keeps the saved cells
    # of those parts (SPARE records) instead of dropping them with the other dead records.
    reusable: Callable[[], list[tuple[int, list[int]]]] | None

    @property
    def turn_logits(self) -> tuple[int, Logits] | None: ...

    def start(self, prefix_tokens: list[int], cache_file: Path | None) -> Iterator[Event]:
        """Put the persona prefix in the (empty) backend and start the saved state from it."""
        ...

    def restore(self, want: list[int], report: ResumeReport, plan: Plan | None = None,
                points: Sequence[int] = (), brought_back: int = -1) -> Iterator[Event]:
        """Make the (empty) backend hold ``want``, loading what was saved and evaluating the rest (batched as
        ``plan`` says, see rebuild.py). ``points``: the positions a rollback can return to (message ends),
        saved along the way when a memory that cannot be cut back is rebuilt. ``brought_back``: where /redo
        or /alt brought the end of ``want`` back (-1: they did not): a state file that ends there was killed
        before their records, and the cells they would have read back are read back."""
        ...

    def user_evaluated(self, p0: int, tokens: list[int], stats: TurnStats, *, defer: bool = False,
                       closing: int = 0) -> None:
        """A user message is in the backend. ``defer``: its reply follows at once, so its cells are written with
        the reply's (``reply_done``), or by ``flush`` if the reply runs long (off the time to first token and
        the stream); any other operation writes them first. ``closing``: the previous reply's last ``closing``
        tokens were evaluated with it (the conversation decodes a reply's closing with the next prompt): their
        cells are saved with it."""
        ...

    def cells_evaluated(self, p0: int, p1: int) -> None:
        """The backend's cells [p0, p1) are one message (a reply whose closing was decoded late): saved now,
        whole, in place of the part of it saved before."""
        ...

    def flush(self) -> None:
        """Write what ``user_evaluated(defer=True)`` kept back (nothing when nothing is, or while ``hold``)."""
        ...

    def commit(self) -> None:
        """Write everything kept back (``hold``): the turn's records, then compaction as ``settle`` does."""
        ...
    # The three hooks below evaluate when the memory needs it (a rebuild from a saved point can be long): a
    # ``Progress`` per step, and the tokens evaluated as the generator's value. Closed early, they finish
    # first (``steps.to_the_end``): the context is never left halfway. ``steps.finish`` runs them unseen.
    def before_reply(self) -> Generator[Progress, None, int]:
        """Get the backend ready to sample at its current position; returns tokens re-evaluated."""
        ...

    def reply_done(self, p0: int, tokens: list[int], stats: TurnStats) -> None: ...
    def rollback(self, to: int, *, persist: bool = True) -> Generator[Progress, None, int]:
        """Make the backend end at ``to`` (a message boundary): truncation where the memory allows it, else
        a saved point's state. ``persist``: record it in the saved state (False when the state never got
        past ``to``). Returns the tokens evaluated again (0 unless a point had to be rebuilt)."""
        ...

    def put_back(self, tokens: list[int]) -> Generator[Progress, None, int]:
        """Append ``tokens`` to the context, reusing saved cells where possible; returns tokens reused."""
        ...

    def shifted(self) -> None: ...
    def settle(self) -> None:
        """An operation ended: compact or checkpoint as needed."""
        ...

    def size_bytes(self) -> int: ...


def make_state_log(backend: Backend, *, state_path: Path, identity: dict[str, Any], meta: dict[str, Any],
                   checkpoint_name: str) -> StateLog:
    if backend.caps.cells:
        return CellLog(backend, state_path, identity)
    return CheckpointLog(backend, meta, checkpoint_name)


# A whole-sequence memory saves its whole state at every point: a compaction keeps this many (2 per turn:
# regenerate, undo or edit reach back 4 exchanges without evaluating anything).
WHOLE_POINTS = 8
# A hybrid memory's records each carry a copy of the recurrent state (MBs on real models): once more than
# twice this many points are live, the records before the newest HYBRID_POINTS are merged into one record
# of their cells without a usable recurrent state (NOT_A_POINT), so the file stops growing by two recurrent
# states per turn. Rolling back further than that evaluates from the start.
HYBRID_POINTS = 16
# Below this many dead bytes a memory that cannot be cut back is not compacted (its records are copied, and
# tiny files are not worth a rewrite).
COMPACT_FLOOR = 1 << 20
HEADER_BYTES = 512  # about what the header record takes (its JSON identity)
PUT_BACK = "evaluating the messages brought back"  # redo, /alt: what the state file no longer had


def _save_failed(exc: BaseException) -> str:
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"could not save the KV state ({why}); the transcript is intact"


# -- cells: the append-only state file ------------------------------------------------------------------


class CellLog:
    def __init__(self, backend: Backend, path: Path, identity: dict[str, Any]) -> None:
        self.eng = backend
        self.path = path
        self.identity = identity
        self.state = sf.ScanResult(header=None)
        self.writer = sf.StateWriter(path)
        self._turn_logits: tuple[int, Logits] | None = None
        self.save_error = ""
        self.failures: list[str] = []
        self.meta_changed = False
        self.on_saved: Callable[[], None] | None = None
        self.replan: Callable[[], list[tuple[int, int]]] | None = None
        self.reusable: Callable[[], list[tuple[int, list[int]]]] | None = None
        self._needs_snapshot = False
        # A user message's records not written yet (see user_evaluated's ``defer``), with the record itself
        # where it had to be read out at once.
        self._pending: tuple[int, list[int], TurnStats, list[sf.Raw] | None, int] | None = None
        # A reply's record kept back by ``hold``: (p0, p1, stats, the record where it had to be read out at once).
        self._pending_reply: tuple[int, int, TurnStats, list[sf.Raw] | None] | None = None
        self.hold = False

    @property
    def turn_logits(self) -> tuple[int, Logits] | None:
        return self._turn_logits

    def start(self, prefix_tokens: list[int], cache_file: Path | None) -> Iterator[Event]:
        records, _hit = yield from prefix.load_or_build(self.eng, prefix_tokens, cache_file, self.identity)
        # The conversation gets its own copy of the prefix cells: it keeps working if the cache is cleared.
        self.writer.rewrite(records)
        self.state = sf.scan(self.path)

    @property
    def _cuts(self) -> bool:
        """The memory is cut back by truncation (else: rewound to points)."""
        return self.eng.caps.truncate

    @property
    def _whole(self) -> bool:
        """Each save is the whole sequence (SNAPSHOT records at points), not a range."""
        return not self.eng.caps.ranges

    def restore(self, want: list[int], report: ResumeReport, plan: Plan | None = None,
                points: Sequence[int] = (), brought_back: int = -1) -> Iterator[Event]:
        eng = self.eng
        t0 = time.perf_counter()
        loaded_bytes = 0
        logits_rec: sf.Record | None = None
        chunks: list[sf.LiveChunk] = []
        n_loaded = 0  # chunks loaded into the backend
        cut_part: list[bytes] = []  # a SPARE record of the cells past the transcript's end (see below)
        cut_span = (0, 0)
        # One pass over the file: it is mapped, each record's crc is checked once (in a second thread, one
        # record ahead of the loading), and the cells go to llama.cpp straight from the mapping. The
        # mapping is closed before anything below writes to the file.
        with sf.map_state(self.path, background=True) as ms:
            idx = ms.records  # from the record headers; ms.wait_ok(rec) before using a record's bytes
            usable = idx.header is not None and idx.header.get("identity") == self.identity
            if idx.header is None:
                missing = idx.problem in ("missing", "empty")
                report.reason = "no saved state" if missing else f"state file unusable ({idx.problem})"
            elif not usable:
                report.reason = prefix.identity_mismatch(idx.header.get("identity"), self.identity)
            else:
                chunks, logits_rec, _ = idx.live()
                if not self._cuts:
                    # Only whole records hold the state at their end; the log never cuts one (a rollback to
                    # a position without a point saves one there), so a cut chunk is damage: what follows
                    # is evaluated. A whole-sequence memory loads its last record alone.
                    whole = [c for c in chunks if c.end == c.record.p1]
                    chunks = chunks[:len(whole)] if whole == chunks[:len(whole)] else []
                    if self._whole:
                        # The newest point that starts at 0 (a fork's or a rollback's TRUNCATE may have cut
                        # the newest record: an older snapshot is then the state wanted).
                        n_live = idx.live()[2]
                        pts = [r for r in idx.points() if r.p0 == 0 and r.p1 <= n_live]
                        chunks = [sf.LiveChunk(pts[-1], pts[-1].p1)] if pts else []
                for ch in chunks:
                    rec = ch.record
                    # A rollback killed after its transcript event and before its TRUNCATE record leaves
                    # the state longer than the transcript: a memory that is cut back loads what the
                    # transcript still holds and cuts there, even inside a record (a snapshot of several
                    # messages), instead of evaluating that record's part again.
                    end = min(ch.end, len(want)) if self._cuts else ch.end
                    if end <= rec.p0:
                        break  # nothing more is wanted (the TRUNCATE is appended below)
                    if not ms.wait_ok(rec):
                        break  # a damaged record: the rest is re-evaluated (the reason is set below)
                    toks, kv = ms.cells(rec)
                    try:
                        if want[rec.p0:end] != toks[: end - rec.p0]:
                            report.reason = "saved state does not match the transcript"
                            break
                        try:
                            eng.load_cells(rec.p0, rec.p1, kv, toks)
                        except Exception as exc:  # llama.cpp rejected it: rebuild from tokens instead
                            report.reason = f"saved cells rejected ({exc})"
                            break
                    finally:
                        kv.release()
                    if end < ch.end and eng.caps.memory == "attention":
                        # What the interrupted rollback would have saved (``_cut_part``): /redo or /alt
                        # reads those cells back.
                        cut_span = (end, ch.end)
                        cut_part = self._spare_record(end, ch.end, toks[end - rec.p0:ch.end - rec.p0])
                    if end < rec.p1:
                        eng.truncate(end)
                    loaded_bytes += rec.size
                    n_loaded += 1
                    if end < ch.end:
                        break
            if n_loaded and not self._cuts and not chunks[n_loaded - 1].record.is_point:
                # Old cells without the state at their end (the record after them failed): unusable alone.
                eng.clear()
                n_loaded, loaded_bytes = 0, 0
                report.reason = report.reason or "saved state incomplete"
            res = ms.result  # waits for the remaining crc checks: the scan's final answer
            if usable and res.dropped_bytes and not report.reason:
                report.reason = f"dropped {res.dropped_bytes} bytes of a damaged state record ({res.problem})"
            report.restored_tokens = eng.n_past
            report.restored_bytes = loaded_bytes
            report.seconds = time.perf_counter() - t0
            n_ok = eng.n_past
            if logits_rec is not None and logits_rec.p0 <= n_ok and ms.wait_ok(logits_rec):
                arr = np.frombuffer(ms.payload(logits_rec), dtype="<f4")
                if arr.shape == (eng.n_vocab,):
                    self._turn_logits = (logits_rec.p0, arr.copy())
                del arr
        read_back: list[tuple[sf.Record, bytes]] = []
        mismatch = report.reason == "saved state does not match the transcript"
        # A whole-sequence memory loads one point, the newest: after an /alt it is the reply switched from,
        # which does not match, and nothing is loaded (its read-back replaces the backend's state anyway).
        reached = brought_back == n_ok or (self._whole and mismatch and n_ok < brought_back)
        if usable and 0 <= brought_back < len(want) and reached and (n_ok == res.live()[2] or mismatch):
            # The transcript goes on where the state file's use ends, with what a /redo or /alt brought
            # back: one killed after its transcript events and before its records were written whole (or
            # between a /redo's events: the opening finished it); an /alt also before its TRUNCATE (the
            # state still holds the reply it switched from). The records it would have made live again are
            # read back, as it would have (a torn tail of its records is cut by the append below).
            self.state = res
            read_back = self._read_back_whole(want, brought_back) if self._whole else self._read_back(want[n_ok:])
            loaded = read_back[-1:] if self._whole else read_back  # a whole-sequence memory loads its last
            report.restored_bytes += sum(rec.size for rec, _ in loaded)
            read_back += self._logits_back(read_back)
            n_ok = report.restored_tokens = eng.n_past
            if mismatch and n_ok == len(want):
                report.reason = ""  # not damage: the /alt's records, written now
        # Catch up: evaluate only the tail the state file did not have.
        tail = want[n_ok:]
        rebuilt: list[sf.Raw] = []
        if tail:
            t1 = time.perf_counter()
            # Batched as the tokens were when first evaluated, so the rebuilt KV is bit-identical (rebuild.py).
            # The plan renders the chat template once per reply: worked out only when something is rebuilt.
            segs = plan() if callable(plan) else plan
            stops = sorted({p for p in points if n_ok < p <= len(want)} | {len(want)})
            if self._whole:
                stops = stops[-WHOLE_POINTS:]
            at: Callable[[int], None] | None = None
            if not self._cuts:
                # A memory that cannot be cut back keeps the points it passes: regenerate, undo and edit
                # after the rebuild rewind to them instead of rebuilding again.
                last = [n_ok]

                def at(pos: int) -> None:
                    rebuilt.extend(self._point_record(last[0], pos))
                    last[0] = pos
            yield from progress(rebuild.evaluate(eng, want, n_ok, segs or [(0, len(want))], stops=stops, at=at),
                                "rebuilding context from the transcript", since=t1)
            report.reevaluated = len(tail)
        # Bring the state file in line with the context (one rewrite; the common case writes nothing).
        n_live = res.live()[2]
        if usable:
            self.state = res  # for _spares: any rewrite below keeps, as a compaction does, what /redo and /alt read back
        if read_back and not tail:
            sf.drop_bases(self.path, keep=res.bases)
            cut = [sf.encode_record(sf.TRUNCATE, brought_back, brought_back, b"")] if brought_back < n_live else []
            self._append([*cut, *self._revived(read_back)], None)
        elif not self._cuts and (tail or not usable or res.dropped_bytes or n_ok < n_live):
            kept = [c.record for c in chunks[:n_loaded]] if usable else []
            # What was read back, as the state sees it (a SPARE record's cells are live CELLS there).
            kept += [sf.Record(sf.live_kind(r.p0), r.p0, r.p1, r.offset, r.length, file=r.file, flags=r.flags)
                     for r, _ in read_back if r.kind != sf.LOGITS]  # the logits: _turn_logits, written last
            self._rewrite_points(kept=kept, added=rebuilt, spares=self._spares(kept) if usable else [])
        elif usable and not res.dropped_bytes and not tail and n_ok < n_live:
            # The interrupted rollback's records, appended now: the rest of the file (what /redo and /alt
            # read back among it) stays as it is.
            sf.drop_bases(self.path, keep=res.bases)
            if self._has_spare(res.records, cut_span, cut_part):
                cut_part = []  # the interrupted rollback's SPARE record made it to the file (its TRUNCATE did not)
            self._append([*cut_part, sf.encode_record(sf.TRUNCATE, n_ok, n_ok, b"")], None)
        elif usable and tail and self._cuts and not res.dropped_bytes and n_ok == n_live:
            # The file is whole and only lags behind the transcript (typically a reply's closing, which a server
            # decodes with the next prompt, or a process killed mid-turn): the cells evaluated are appended.
            sf.drop_bases(self.path, keep=res.bases)
            self._append(self._whole_message(max((p for p in points if p <= n_ok), default=n_ok), len(want)), None)
        elif not usable or res.dropped_bytes or n_ok < n_live or tail:
            spares: list[sf.Record] = []
            if usable:
                spares = self._spares([c.record for c in res.live()[0]])
                if self._has_spare(spares, cut_span, cut_part):
                    cut_part = []  # the interrupted rollback's own SPARE record made it to the file
            self._rewrite_state(spares, extra=cut_part)
        else:
            self.state = res
            # Links nothing refers to any more: a crash came between a rewrite and its unlinking of them.
            sf.drop_bases(self.path, keep=res.bases)
        if self._turn_logits and self._turn_logits[0] == eng.n_past:
            eng.set_logits(self._turn_logits[1])

    def _has_spare(self, records: Sequence[sf.Record], span: tuple[int, int], part: list[bytes]) -> bool:
        """Whether ``records`` hold a SPARE record of the cells ``part`` (one encoded record over ``span``)."""
        if not part:
            return False
        toks = np.frombuffer(part[-1], dtype="<i4", count=span[1] - span[0], offset=sf.HEADER_SIZE).tolist()
        for rec in records:
            if rec.kind == sf.SPARE and (rec.p0, rec.p1) == span:
                try:
                    if sf.read_tokens(self.path, rec) == toks:
                        return True
                except (OSError, sf.StateFileError):
                    continue
        return False

    def adopt_resident(self, want: list[int]) -> bool:
        """The engine already holds ``want`` at its start (the server forked its resident conversation):
        cut the engine back to ``want`` and take the file's index instead of loading its cells, as /regen
        does in the REPL. Only record headers are read (the cells are not used here: whoever loads them
        later checks their crcs) plus the logits record, checked. False, changing nothing, when the file
        does not end exactly at ``want`` or was written for another model."""
        eng = self.eng
        if eng.tokens[:len(want)] != want:
            return False
        with sf.map_state(self.path, check=False) as ms:
            state = ms.records
        _chunks, logits_rec, n_live = state.live()
        if (state.header is None or state.problem or state.dropped_bytes or n_live != len(want)
                or state.header.get("identity") != self.identity):
            return False
        self.state = state
        if len(want) < eng.n_past:
            try:
                self._rewind(len(want))
            except Exception:
                self.state = sf.ScanResult(header=None)
                return False
        if logits_rec is not None and logits_rec.p0 == len(want):
            try:
                arr = np.frombuffer(sf.read_payload(self.path, logits_rec), dtype="<f4")
            except (OSError, sf.StateFileError):
                return True  # no saved logits: the first reply evaluates its last token again
            if arr.shape == (eng.n_vocab,):
                self._turn_logits = (len(want), arr.copy())
                eng.set_logits(self._turn_logits[1])
        return True

    def user_evaluated(self, p0: int, tokens: list[int], stats: TurnStats, *, defer: bool = False,
                       closing: int = 0) -> None:
        self._flush()
        eng = self.eng
        logits = eng.logits()
        self._turn_logits = (eng.n_past, logits)
        if self._needs_snapshot:
            # After a context shift the moved K cells were rotated by this decode: only now is a snapshot
            # valid. Reloading it also lays the cells out exactly as a resumed process will have them, so
            # this process and a resumed one continue bit-identically.
            data = self._rewrite_state()
            if data is not None:
                toks = list(eng.tokens)
                eng.clear()
                eng.load_cells(0, len(toks), data, toks)
                eng.set_logits(logits)
            self._needs_snapshot = False
            return
        if defer:
            # Saved with the reply (one append), or mid-reply by ``flush`` when the reply runs long
            # (conversation.LATE_SAVE_SECONDS): reading the cells out of llama.cpp, their checksum and the
            # write stay out of the time to first token and of the stream. A process killed before then
            # evaluates the message again on resume. Nothing may touch cells [p0, p0+len) until then: every
            # other operation of this log flushes first.
            # A memory that cannot be cut back is read out now (a copy, no disk): its state moves on with
            # the first token, and only the state at the message's end is a regenerate point.
            self._pending = (p0, list(tokens), stats, None if self._cuts else self._point_record(p0, eng.n_past),
                             closing)
            return
        stats.state_bytes += self._append(self._user_records(p0, tokens, closing=closing), stats)

    def cells_evaluated(self, p0: int, p1: int) -> None:
        self._flush()
        self._append(self._whole_message(p0, p1), None)

    def _whole_message(self, p0: int, p1: int) -> list[sf.Raw]:
        """Records that save the backend's cells [p0, p1) as one record, cutting the saved part of it: records
        are found again (/alt, /redo) by their start and tokens, so a message's cells never end in a record
        of their own that another alternative's identical closing could be mistaken for."""
        n = self.state.live()[2]
        p0 = min(p0, n)
        cut = [sf.encode_record(sf.TRUNCATE, p0, p0, b"")] if n > p0 else []
        return [*cut, *self._point_record(p0, p1)]

    def _point_record(self, p0: int, p1: int) -> list[sf.Raw]:
        """The record of cells [p0, p1) saved now (the sequence ends at p1): CELLS (after its HISTORY), or on
        a whole-sequence memory a SNAPSHOT of everything up to p1 (which is then a point of its own)."""
        eng = self.eng
        if self._whole:
            return [sf.encode_record_parts(sf.SNAPSHOT, 0, p1, sf.cells_parts(eng.tokens[:p1], eng.save_cells(0, p1)))]
        return [*self._history(p0, eng.tokens[:p0]),
                sf.encode_record_parts(sf.CELLS, p0, p1, sf.cells_parts(eng.tokens[p0:p1], eng.save_cells(p0, p1)))]

    @staticmethod
    def _history(p0: int, before: Sequence[int], digest: bytes | None = None) -> list[bytes]:
        """The HISTORY record to write before a record of cells from ``p0`` computed after ``before`` (or
        whose history is ``digest``): none from position 0 (nothing comes before) or when not known."""
        if p0 <= 0:
            return []
        if digest is not None:
            return [sf.encode_record(sf.HISTORY, p0, p0, digest)]
        return [sf.history_record(p0, before)] if len(before) == p0 else []

    def _user_records(self, p0: int, tokens: list[int], saved: list[sf.Raw] | None = None,
                      closing: int = 0) -> list[sf.Raw]:
        p1 = p0 + len(tokens)
        # The closing evaluated with the message is saved in its record (one call, one record; never a record
        # of the closing alone: see ``_whole_message``).
        recs = [*(saved if saved is not None else self._point_record(p0 - closing, p1))]
        if self._turn_logits is not None and self._turn_logits[0] == p1:
            recs.append(sf.encode_record(sf.LOGITS, p1, p1, self._turn_logits[1].astype("<f4").tobytes()))
        return recs

    def flush(self) -> None:
        if not self.hold:
            self._flush()

    def commit(self) -> None:
        self._flush()

    def _flush(self) -> None:
        """Write a deferred user message's records and a held reply's (before anything else touches the
        state file); after a reply, compact as ``reply_done`` does."""
        pending, reply = self._pending, self._pending_reply
        self._pending = self._pending_reply = None
        recs = self._user_records(pending[0], pending[1], pending[3], pending[4]) if pending is not None else []
        if reply is not None:
            p0, p1, stats, saved = reply
            recs.extend(saved if saved is not None else self._point_record(p0, p1))
        elif pending is not None:
            stats = pending[2]
        if recs:
            # The user message's cells alone are written mid-reply (a long reply): not fsynced there, between
            # two tokens. A killed process still finds them; only an OS crash before the reply's own append
            # (whose fsync covers them) can lose them, and then the transcript, which holds the message, has
            # them evaluated again. Nor is a held commit (a server after a reply's end): the conversation's
            # next request waits for it, and its fsync was 3 ms of the 9 it took; an OS crash before the
            # kernel writes the records back (within ~30 s) costs their evaluation again, as it would for the
            # user message's.
            stats.state_bytes += self._append(recs, stats, sync=reply is not None and not self.hold)
        if reply is not None:
            self.settle()

    def before_reply(self) -> Generator[Progress, None, int]:
        return to_the_end(self._before_reply())

    def _before_reply(self) -> Generator[Progress, None, int]:
        eng = self.eng
        if self._turn_logits and self._turn_logits[0] == eng.n_past and not eng.has_logits:
            eng.set_logits(self._turn_logits[1])
        if eng.has_logits or self._cuts or not eng.n_past:
            return eng.ensure_logits()
        # No logits, and the last token cannot be cut off to evaluate it again: rewind to the point before.
        n, toks = eng.n_past, list(eng.tokens)
        at = self._rewind(n - 1, exact=False)
        return (yield from self._eval(toks[at:], n))

    def reply_done(self, p0: int, tokens: list[int], stats: TurnStats) -> None:
        n = p0 + len(tokens)  # the backend may still lack the reply's closing (held: the commit decodes it)
        if self.hold:
            # Cells are read out at ``commit`` (the backend must not change before it; see ``hold``); a
            # memory that cannot be cut back is read out now, as a deferred user message is.
            self._pending_reply = (p0, n, stats, None if self._cuts else self._point_record(p0, n))
            return
        rec = self._point_record(p0, n)
        pending, self._pending = self._pending, None
        first = self._user_records(pending[0], pending[1], pending[3], pending[4]) if pending else []
        stats.state_bytes += self._append([*first, *rec], stats)
        self.settle()

    def rollback(self, to: int, *, persist: bool = True) -> Generator[Progress, None, int]:
        return to_the_end(self._rollback(to, persist))

    def _rollback(self, to: int, persist: bool) -> Generator[Progress, None, int]:
        self._flush()
        eng = self.eng
        again = 0
        if self._cuts or to in (0, eng.n_past):
            spare = self._cut_part(to) if persist and self._cuts and self.eng.caps.memory == "attention" else []
            eng.truncate(to)
            if persist:
                self._append([*spare, sf.encode_record(sf.TRUNCATE, to, to, b"")], None)
        else:
            want = eng.tokens[:to]
            at = self._rewind(to, exact=False)
            # With the batching the tokens first had, so the result is bit-identical to the original.
            yield from progress(rebuild.evaluate(eng, want, at, self.replan() if self.replan else [(0, to)]),
                                "rebuilding context from a saved point")
            again = to - at
            if again:
                self.failures.append(f"no saved state was left at position {to}: evaluated {again} tokens from "
                                     "the nearest earlier point")
            if at < to and persist:
                # No point at ``to`` was left (compacted away, damaged, never saved): the one just
                # evaluated is saved, so the next rollback here is a rewind.
                self._append([sf.encode_record(sf.TRUNCATE, at, at, b""), *self._point_record(at, to)], None)
            elif persist:
                self._append([sf.encode_record(sf.TRUNCATE, to, to, b"")], None)
        if self._turn_logits and self._turn_logits[0] == to:
            eng.set_logits(self._turn_logits[1])
        elif self._turn_logits and self._turn_logits[0] > to:
            self._turn_logits = None
        return again

    def _cut_part(self, to: int) -> list[bytes]:
        """Before cutting an attention memory back to ``to``: the cells of the live record that the cut
        falls inside, from ``to`` to its end, as a SPARE record. Only a snapshot (compaction, context shift,
        a rebuilt resume) holds several messages; without this, /redo or /alt to what was cut out of it
        would evaluate it again. A record that starts at ``to`` is already there as it is. (Not on a sliding
        window: its cells of [to, end) saved now would lack those the window dropped since.)"""
        for ch in self.state.live()[0]:
            rec = ch.record
            if rec.p0 < to < ch.end <= self.eng.n_past:
                return self._spare_record(to, ch.end, self.eng.tokens[to:ch.end])
        return []

    def _spare_record(self, p0: int, p1: int, tokens: list[int]) -> list[bytes]:
        """A SPARE record of the context's cells [p0, p1), which hold ``tokens``: what /redo or /alt reads back
        after a cut (``_cut_part``, and the cut a resume finishes for an interrupted rollback)."""
        return [*self._history(p0, self.eng.tokens[:p0]),
                sf.encode_record(sf.SPARE, p0, p1, sf.cells_payload(tokens, self.eng.save_cells(p0, p1)))]

    def _eval(self, tokens: list[int], end: int) -> Generator[Progress, None, int]:
        """Evaluate ``tokens`` so that the backend ends at ``end``; returns how many."""
        eng = self.eng
        yield from evaluate(eng, tokens, "rebuilding context from a saved point")
        assert eng.n_past == end
        return len(tokens)

    def _rewind(self, to: int, *, exact: bool = True) -> int:
        """Rewind a memory that cannot be cut back to the saved point at ``to`` — or, unless ``exact``, to the
        nearest point before it (the start when there is none); returns where the backend now ends."""
        eng = self.eng
        if self._cuts:
            eng.truncate(to)
            return to
        want = eng.tokens[:to]
        for rec in reversed(self.state.points()):
            if rec.p1 > to or (exact and rec.p1 != to) or rec.p1 > eng.n_past:
                continue
            try:
                toks, kv = sf.split_cells(sf.read_payload(self.path, rec), rec.p1 - rec.p0)
                if toks != want[rec.p0:rec.p1]:
                    continue
                eng.rewind(rec.p1, rec.p0, kv)
            except Exception:
                continue  # unreadable or rejected: an earlier point may still do
            return rec.p1
        if exact:
            raise BackendError(f"no saved point at {to} to rewind to")
        eng.clear()
        return 0

    def put_back(self, tokens: list[int]) -> Generator[Progress, None, int]:
        return to_the_end(self._put_back(tokens))

    def _put_back(self, tokens: list[int]) -> Generator[Progress, None, int]:
        """Put ``tokens`` back after the current context, reusing cells the state file still holds.

        A rolled-back reply's CELLS record stays in the file (dead; a compaction keeps it as a SPARE record
        while /redo or /alt can still ask for it, see ``reusable``): switching back to it or redoing it reads
        those cells instead of evaluating. Returns how many tokens came from the file;
        the rest is evaluated. Either way records that make those cells live again are appended: for cells
        read back, a REVIVE record of the one they came from (a few bytes, not a copy: ``_revive``); for
        cells evaluated, a record of them.

        Several records may start at the same position (each alternative reply of a turn has one): the
        newest whose tokens are the ones wanted is used, not merely the newest there.
        """
        self._flush()
        eng = self.eng
        p0 = eng.n_past
        if self._whole:
            return (yield from self._put_back_whole(tokens))
        read = self._read_back(tokens)
        loaded = sum(rec.p1 - rec.p0 for rec, _ in read)
        # What makes the cells read back live, and the logits saved with the last user message among them.
        back: list[sf.Raw] = [*self._revived([*read, *self._logits_back(read)])]
        if loaded < len(tokens):
            yield from evaluate(eng, tokens[loaded:], PUT_BACK)
            back.extend(self._point_record(p0 + loaded, eng.n_past))
        self._append(back, None)
        return loaded

    def _read_back(self, tokens: list[int]) -> list[tuple[sf.Record, bytes]]:
        """Load into the backend, after what it holds, the cells of as many of ``tokens`` as records of the
        state file hold (dead or spare ones: rolled back, undone, kept by a compaction); the records used,
        in order, with their payloads."""
        eng = self.eng
        p0 = eng.n_past
        loaded = 0
        out: list[tuple[sf.Record, bytes]] = []
        while loaded < len(tokens):
            pos = p0 + loaded
            found = False
            history = sf.history_digest(eng.tokens[:pos])  # the backend holds exactly the tokens before pos
            for rec in reversed(self.state.records):
                if not (rec.kind in (sf.CELLS, sf.SPARE) and rec.p0 == pos and pos < rec.p1 <= p0 + len(tokens)):
                    continue
                if rec.history is not None and rec.history != history:
                    continue  # cells computed after other tokens (a record without a history: written before it)
                try:
                    payload = sf.read_payload(self.path, rec)
                    toks, kv = sf.split_cells(payload, rec.p1 - rec.p0)
                    if toks != tokens[loaded:loaded + len(toks)]:
                        continue  # another alternative at this position
                    eng.load_cells(rec.p0, rec.p1, kv, toks)
                except Exception:
                    continue  # unreadable or rejected: an older record may still do, else it is evaluated
                out.append((rec, payload))
                loaded += len(toks)
                found = True
                break
            if not found:
                break
        return out

    def _revived(self, read: Sequence[tuple[sf.Record, bytes]]) -> list[bytes]:
        """The records that make the records ``read`` back live again, in order (``_revive`` each)."""
        return [raw for rec, payload in read for raw in self._revive(rec, payload)]

    def _revive(self, rec: sf.Record, payload: bytes) -> list[bytes]:
        """The record that makes ``rec`` (whose cells, ``payload``, were just loaded) live again: a REVIVE
        record naming it, or a copy where a REVIVE cannot name it — a record of a fork's base (the REVIVE's
        offset counts in this file only; a rewrite of the fork makes the base's records its own) or one the
        stored crc of which cannot be read (then the copy is the record, under its live kind).

        The cells are not saved again from the backend: what was loaded is what the record holds (on a
        memory that cannot be cut back that includes the state at its end, so the revived record is a point
        as the record was), and a resume loads the same bytes from the same offset. A LOGITS record
        (``_logits_back``) is revived the same way, by a REVIVE_LOGITS record."""
        logits = rec.kind == sf.LOGITS
        if rec.file is None and (logits or rec.kind in sf.REVIVED_KINDS):
            try:
                crc = sf.stored_crc(self.path, rec)
            except (OSError, sf.StateFileError):
                pass
            else:
                return [sf.encode_record(sf.REVIVE_LOGITS if logits else sf.REVIVE, rec.p0, rec.p1,
                                         sf.revive_payload(rec.offset, crc))]
        if logits:
            return [sf.encode_record(sf.LOGITS, rec.p0, rec.p1, payload)]
        # A copy keeps the history the cells were computed on (the backend's: they were just checked against it).
        return [*self._history(rec.p0, self.eng.tokens[:rec.p0], rec.history),
                sf.encode_record(sf.live_kind(rec.p0), rec.p0, rec.p1, payload, rec.flags)]

    def _logits_back(self, read: Sequence[tuple[sf.Record, bytes]]) -> list[tuple[sf.Record, bytes]]:
        """The LOGITS record saved with the last user message among the records ``read`` back (the one
        right after its record in the file: the same append, so the same history), made the turn's logits:
        /regen right after /redo or /alt samples from them instead of evaluating the message's last token
        again. Returned as ``read`` is, for ``_revive``; none found or unreadable: []."""
        recs = self.state.records
        where = {id(r): i for i, r in enumerate(recs)}
        best: sf.Record | None = None
        for rec, _ in read:
            i = where.get(id(rec), len(recs)) + 1
            nxt = recs[i] if i < len(recs) else None
            if (nxt is not None and nxt.kind == sf.LOGITS and nxt.p0 == rec.p1 and nxt.file == rec.file
                    and nxt.p0 <= self.eng.n_past and (best is None or nxt.p0 > best.p0)):
                best = nxt
        if best is None:
            return []
        try:
            payload = sf.read_payload(self.path, best)
        except (OSError, sf.StateFileError):
            return []
        arr = np.frombuffer(payload, dtype="<f4")
        if arr.shape != (self.eng.n_vocab,):
            return []
        self._turn_logits = (best.p0, arr.copy())
        return [(best, payload)]

    def _whole_points(self, want: list[int], lo: int) -> list[tuple[sf.Record, bytes]]:
        """Saved points of a whole-sequence memory holding ``want[:p1]`` for ``lo < p1 <= len(want)``: the
        newest for each p1, in order of p1, with their payloads. A record that cannot be read is passed
        over (an older one of the same p1 may do); the backend is not touched here."""
        found: dict[int, tuple[sf.Record, bytes]] = {}
        for rec in reversed(self.state.records):
            if (rec.kind not in (sf.SNAPSHOT, sf.SPARE) or rec.p0 != 0 or not lo < rec.p1 <= len(want)
                    or rec.p1 in found):
                continue
            try:
                if sf.read_tokens(self.path, rec) != want[:rec.p1]:
                    continue
                found[rec.p1] = (rec, sf.read_payload(self.path, rec))
            except (OSError, sf.StateFileError):
                continue
        return [found[p] for p in sorted(found)]

    def _read_back_whole(self, want: list[int], lo: int) -> list[tuple[sf.Record, bytes]]:
        """On a whole-sequence memory, load a saved point holding exactly ``want`` instead of what the backend
        holds; the records to make live again, as /redo's own records would be: the points after ``lo`` on
        the way to ``want`` (regenerate and undo rewind to them), the one loaded last. None found: [] and
        nothing changes; a point llama.cpp rejects leaves the backend empty (the caller evaluates then)."""
        eng = self.eng
        points = self._whole_points(want, lo)
        if not points or points[-1][0].p1 != len(want):
            return []
        rec, payload = points[-1]
        eng.clear()
        try:
            eng.load_cells(0, rec.p1, sf.split_cells(payload, rec.p1)[1], list(want))
        except Exception:
            eng.clear()
            return []
        return points

    def _put_back_whole(self, tokens: list[int]) -> Generator[Progress, None, int]:
        """``put_back`` on a whole-sequence memory: a saved point holding exactly the sequence wanted is
        loaded (it and the points on the way to it revived, live); else the tokens are evaluated."""
        eng = self.eng
        p0 = eng.n_past
        want = [*eng.tokens, *tokens]
        read = self._read_back_whole(want, p0)
        if read:
            self._append(self._revived([*read, *self._logits_back(read)]), None)
            return len(tokens)
        if eng.n_past != p0:
            # Back to where we were (only reached when llama.cpp rejects a saved state).
            yield from evaluate(eng, want[:p0], "rebuilding context")
        yield from evaluate(eng, tokens, PUT_BACK)
        self._append(self._point_record(0, eng.n_past), None)
        return 0

    def shifted(self) -> None:
        self._flush()
        self._turn_logits = None
        self._needs_snapshot = True

    def settle(self) -> None:
        self._flush()
        st = self.state
        if not self._cuts:
            # Points are not made again from the backend (it holds only the end state): compaction copies
            # the records it keeps. Dead records are rolled-back alternatives and, on a whole-sequence
            # memory, points older than the newest WHOLE_POINTS.
            keep = self._kept_points()
            spares = self._spares(keep)
            if not self._whole and sum(r.is_point for r in keep) > 2 * HYBRID_POINTS:
                self._merge_old_points(keep, spares)
                return
            live = sum(r.size for r in keep) + sum(r.size for r in spares) + HEADER_BYTES
            if st.valid_bytes + st.base_bytes - live > max(live, COMPACT_FLOOR):
                self._rewrite_points(kept=keep, added=[], spares=spares)
            return
        shared = bool(st.bases) and self._bases_shared()
        if shared:
            # A fork whose base another conversation still links: the base's dead bytes cost nothing extra
            # (the parent keeps them anyway) and a rewrite would copy what is shared, so only the fork's own
            # records are weighed.
            total, live = st.valid_bytes, st.live_bytes(own=True)
        else:
            # Plain file, or a base nobody else links any more (the parent is gone or rewrote its file):
            # the base's bytes are this conversation's alone and compact like its own.
            total, live = st.valid_bytes + st.base_bytes, st.live_bytes()
        # What /redo and /alt can still read back is kept too, and weighs as live: the file is rewritten once
        # the records nothing can use any more outweigh those kept.
        spares = self._spares([c.record for c in st.live()[0]])
        live += sum(r.size for r in spares if not (shared and r.file is not None))
        if total - live > live:
            self._rewrite_state(spares)

    def compact(self) -> None:
        """Rewrite the state file now, as ``settle`` does once the dead records outweigh the rest: the live
        state (the points kept, on a memory that cannot be cut back) and the SPARE records."""
        self._flush()
        if self._cuts:
            self._rewrite_state(self._spares([c.record for c in self.state.live()[0]]))
            return
        keep = self._kept_points()
        spares = self._spares(keep)
        if not self._whole and sum(r.is_point for r in keep) > 2 * HYBRID_POINTS:
            self._merge_old_points(keep, spares)
        else:
            self._rewrite_points(kept=keep, added=[], spares=spares)

    def _spares(self, kept: Sequence[sf.Record]) -> list[sf.Record]:
        """The dead records a compaction keeps: those whose cells ``put_back`` can still use (``reusable``),
        one per distinct content, the newest. On a whole-sequence memory that is a snapshot of exactly a
        sequence wanted; otherwise cells whose tokens are those of a wanted part at the same positions.

        Bounded by what is reusable: the redo stack (cells that were in the context together with the live
        ones, so at most one context's worth) and the alternatives the conversation names (a few)."""
        wanted = self.reusable() if self.reusable is not None else []
        if not wanted:
            return []
        ranges = not self._whole
        kinds = (sf.CELLS, sf.SPARE) if ranges else (sf.SNAPSHOT, sf.SPARE)
        skip = {(r.file, r.offset) for r in kept}
        out: list[sf.Record] = []
        seen: set[tuple[int, int, tuple[int, ...]]] = set()
        for rec in reversed(self.state.records):
            if rec.kind not in kinds or (rec.file, rec.offset) in skip or rec.p1 <= rec.p0:
                continue
            if ranges:
                fits = any(p0 <= rec.p0 and rec.p1 <= len(seq) for p0, seq in wanted)
            else:
                fits = rec.p0 == 0 and any(rec.p1 == len(seq) for _p0, seq in wanted)
            if not fits:
                continue
            try:
                toks = sf.read_tokens(self.path, rec)
            except (OSError, sf.StateFileError):
                continue
            key = (rec.p0, rec.p1, tuple(toks))
            if key in seen:
                continue  # an older copy of the same cells (an undo and a redo each append one)
            if ranges:
                ok = any(p0 <= rec.p0 and seq[rec.p0:rec.p1] == toks
                         and (rec.history is None or rec.history == sf.history_digest(seq[:rec.p0])) for p0, seq in wanted)
            else:
                ok = any(seq == toks for _p0, seq in wanted)
            if ok:
                seen.add(key)
                out.append(rec)
        out.reverse()  # file order
        return out

    def _spare_copies(self, spares: Sequence[sf.Record]) -> list[bytes]:
        """``spares`` re-encoded as SPARE records (crc-checked copies); an unreadable one is left out: it was
        only going to save an evaluation."""
        out = []
        for rec in spares:
            try:
                payload = sf.read_payload(self.path, rec)
                out += [*self._history(rec.p0, (), rec.history), sf.encode_record(sf.SPARE, rec.p0, rec.p1, payload, rec.flags)]
            except (OSError, sf.StateFileError):
                continue
        return out

    def _bases_shared(self) -> bool:
        try:
            return any((self.path.parent / name).stat().st_nlink > 1 for name in self.state.bases)
        except OSError:
            return False

    def size_bytes(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def _failed(self, exc: OSError) -> None:
        # The transcript is already safe; the state file only caches. Tell the user, keep going; the next
        # write starts the file over from a snapshot.
        self.save_error = _save_failed(exc)
        self.failures.append(self.save_error)
        self.state = sf.ScanResult(header=None)

    def _header(self) -> bytes:
        return sf.encode_record(sf.HEADER, 0, 0, sf.header_payload(self.identity))

    def _append(self, records: Sequence[sf.Raw], stats: TurnStats | None, *, sync: bool = True) -> int:
        t0 = time.perf_counter()
        try:
            if self.state.header is None:
                self._rewrite_state()
                return 0
            if self.state.dropped_bytes:
                self.writer.cut(self.state.valid_bytes)
                self.state.dropped_bytes = 0
            n = self.writer.append(records, sync=sync)
        except OSError as exc:
            self._failed(exc)
            return 0
        self.save_error = ""
        self.state.add(records)
        if stats is not None:
            stats.save_ms += 1000 * (time.perf_counter() - t0)
        if self.on_saved is not None:
            self.on_saved()  # the state budget
        return n

    def _kept_points(self) -> list[sf.Record]:
        """The records a compaction of a memory that cannot be cut back keeps, in file order."""
        if self._whole:
            return self.state.points()[-WHOLE_POINTS:]
        chunks, _, _ = self.state.live()
        return [c.record for c in chunks if c.end == c.record.p1]

    def _merge_old_points(self, keep: list[sf.Record], spares: Sequence[sf.Record] = ()) -> None:
        """Keep the newest HYBRID_POINTS points of a hybrid memory; the cells before them become one record
        (its recurrent part is today's, not the state at its end: flagged NOT_A_POINT)."""
        eng = self.eng
        seen, i = 0, len(keep)
        while i > 0 and seen < HYBRID_POINTS:
            i -= 1
            seen += keep[i].is_point
        cut = keep[i].p0
        if cut <= 0:
            return
        lead = sf.encode_record(sf.CELLS, 0, cut, sf.cells_payload(eng.tokens[:cut], eng.save_cells(0, cut, point=False)),
                                flags=sf.NOT_A_POINT)
        self._rewrite_points(kept=keep[i:], added=[], lead=[lead], spares=spares)

    def _rewrite_points(self, *, kept: list[sf.Record], added: Sequence[sf.Raw], lead: Sequence[bytes] = (),
                        spares: Sequence[sf.Record] = ()) -> None:
        """Rewrite the state file as ``kept`` records of the current file (copied, crc-checked), then
        ``added`` ones, then ``spares`` (as SPARE records), then the logits: the points survive. On any read
        failure the backend's end state is written as one snapshot instead (the points before it are then
        gone: rollbacks there evaluate)."""
        self._pending = self._pending_reply = None
        try:
            # Kept records are live: the cells before each are the backend's.
            copies = [raw for r in kept for raw in (*self._history(r.p0, self.eng.tokens[:r.p0]),
                                                    sf.encode_record(r.kind, r.p0, r.p1, sf.read_payload(self.path, r), r.flags))]
        except (OSError, sf.StateFileError):
            self._rewrite_state()
            return
        recs = [self._header(), *lead, *copies, *added, *self._spare_copies(spares), *self._logits_record()]
        try:
            self.writer.rewrite(recs)
        except OSError as exc:
            self._failed(exc)
            return
        self.save_error = ""
        st = sf.ScanResult(header={"identity": self.identity})
        st.records, st.valid_bytes = sf.records_at(recs, 0)
        if st.live()[2] != self.eng.n_past:  # the kept records do not add up to the backend: start over
            self._rewrite_state()
            return
        self.state = st
        if self.on_saved is not None:
            self.on_saved()

    def _logits_record(self) -> list[bytes]:
        """The LOGITS record of the turn's logits when they lie within what the backend holds (a rewrite
        keeps them: /regen after a compaction still evaluates nothing)."""
        if self._turn_logits is None or self._turn_logits[0] > self.eng.n_past:
            return []
        pos, arr = self._turn_logits
        return [sf.encode_record(sf.LOGITS, pos, pos, arr.astype("<f4").tobytes())]

    def _rewrite_state(self, spares: Sequence[sf.Record] = (), extra: Sequence[bytes] = ()) -> sf.Buffer | None:
        """Write the whole live state as one snapshot (compaction, shifts, recovery), then copies of the
        ``spares`` records of the current file (compaction) and the ``extra`` records (encoded SPARE
        records: a restore's cells past the transcript's end); returns the snapshot's cells."""
        self._pending = self._pending_reply = None  # the snapshot holds those cells (and the logits, below)
        eng = self.eng
        n = eng.n_past
        recs = [self._header()]
        kv = eng.save_cells(0, n)
        recs.append(sf.encode_record(sf.SNAPSHOT, 0, n, sf.cells_payload(eng.tokens, kv)))
        recs.extend(self._spare_copies(spares))
        recs.extend(extra)
        recs.extend(self._logits_record())
        try:
            self.writer.rewrite(recs)
        except OSError as exc:
            self._failed(exc)
            return kv
        self.save_error = ""
        st = sf.ScanResult(header={"identity": self.identity})
        st.records, st.valid_bytes = sf.records_at(recs, 0)
        self.state = st
        if self.on_saved is not None:
            self.on_saved()  # the state budget
        return kv


# -- checkpoints: whole sequences saved by the backend ---------------------------------------------------


def tokens_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


class CheckpointLog:
    """The backend saves its whole sequence under one name per conversation; metadata says what it holds.

    ``meta["checkpoint"] = {"name", "tokens", "sha256", "bytes", "identity"}``: the name the backend saved
    under, how many tokens that save holds and a digest of them. Restoring asks the backend for exactly
    those tokens (it refuses if its save holds anything else); the rest of the transcript is evaluated.

    A backend that cannot cut its sequence back (``not caps.truncate``) would evaluate the whole history
    again for a regenerate or an alternative: its cache holds the reply, which it cannot drop. So after each
    user message it also saves ``meta["checkpoint"]["regen"]`` (same fields, name ``NAME-regen``) holding
    the sequence *but the message's last token*: restored, the reply's request evaluates that one token and
    samples (a save holding the whole message would not do: a llama-server must evaluate at least one
    prompt token, and with a slot that holds exactly the prompt it cannot go back one, so it starts over).
    """

    def __init__(self, backend: Backend, meta: dict[str, Any], name: str) -> None:
        self.eng = backend
        self.meta = meta
        info = meta.get("checkpoint")
        self.name = str(info["name"]) if isinstance(info, dict) and info.get("name") else name
        self.save_error = ""
        self.failures: list[str] = []
        self.meta_changed = False
        self.on_saved: Callable[[], None] | None = None  # its saves live on the server: nothing to budget here
        self.hold = False  # nothing is kept back: a checkpoint is the backend's own save
        self.replan: Callable[[], list[tuple[int, int]]] | None = None
        self.reusable: Callable[[], list[tuple[int, list[int]]]] | None = None  # a checkpoint keeps no cells
        self._saved: list[int] | None = None  # the tokens of the last checkpoint this process made
        # The regenerate point's checkpoint ({"name", "tokens", "sha256", "bytes"}), when one was saved.
        regen = info.get("regen") if isinstance(info, dict) else None
        self._regen: dict[str, Any] | None = regen if isinstance(regen, dict) else None

    @property
    def turn_logits(self) -> tuple[int, Logits] | None:
        return None

    @property
    def _regen_points(self) -> bool:
        """Save regenerate points: the backend saves checkpoints, cannot cut its sequence back, and reuses
        a restored one. (A llama-server whose model has a sliding-window cache cannot cut back either, but
        reuses nothing of a restored slot: points there would only cost a file per turn.)"""
        caps = self.eng.caps
        return caps.checkpoint and not caps.truncate and caps.restore_reuse

    def _eval(self, tokens: list[int], label: str) -> Iterator[Event]:
        yield from evaluate(self.eng, tokens, label)

    def start(self, prefix_tokens: list[int], cache_file: Path | None) -> Iterator[Event]:
        # The persona prefix is a checkpoint of its own (named after the prefix cache key: model, context,
        # persona, template), restored for each new conversation instead of evaluated.
        eng = self.eng
        name = f"chatcli-prefix-{cache_file.stem[:40]}" if cache_file is not None else ""
        restored = False
        if name and eng.caps.checkpoint and prefix_tokens:
            try:
                restored = eng.restore_checkpoint(name, prefix_tokens)
            except BackendError:
                restored = False
        if not restored:
            eng.clear()
            yield from self._eval(prefix_tokens, "evaluating persona prefix")
            if name and eng.caps.checkpoint and prefix_tokens:
                try:
                    eng.checkpoint(name)
                except BackendError:
                    pass  # only a cache: the conversation's own checkpoint follows
        self.settle()

    def restore(self, want: list[int], report: ResumeReport, plan: Plan | None = None,
                points: Sequence[int] = (), brought_back: int = -1) -> Iterator[Event]:
        eng = self.eng
        t0 = time.perf_counter()
        info = self.meta.get("checkpoint")
        if not (eng.caps.checkpoint and isinstance(info, dict)):
            report.reason = "no saved state"
        else:
            n = int(info.get("tokens", 0))
            if info.get("identity", eng.identity()) != eng.identity():
                # Another model or context size behind the same name (a llama-server restarted with other
                # flags): its saved sequence must not be loaded, the context is rebuilt from the tokens.
                report.reason = "saved state is for another model or context size"
                self._regen = None
            elif n > len(want) or tokens_digest(want[:n]) != info.get("sha256"):
                report.reason = "saved state does not match the transcript"
            else:
                try:
                    ok = eng.restore_checkpoint(self.name, want[:n])
                except BackendError as exc:
                    ok = False
                    report.reason = f"saved state unusable ({exc})"
                if ok:
                    report.restored_tokens = eng.n_past
                    report.restored_bytes = int(info.get("bytes", 0))
                    self._saved = want[:n]
                elif not report.reason:
                    report.reason = "saved state is missing or does not match"
        if eng.n_past and eng.tokens != want[:eng.n_past]:
            eng.clear()  # a backend that restored something else: start from nothing rather than trust it
            report.restored_tokens = report.restored_bytes = 0
        report.seconds = time.perf_counter() - t0
        tail = want[eng.n_past:]
        if tail:
            yield from self._eval(tail, "rebuilding context from the transcript")
            report.reevaluated = len(tail)
        self.settle()

    def user_evaluated(self, p0: int, tokens: list[int], stats: TurnStats, *, defer: bool = False,
                       closing: int = 0) -> None:
        eng = self.eng
        n = eng.n_past - 1  # the regenerate point's save: all but the message's last token (see the class)
        if not self._regen_points or n <= 0:
            return
        t0 = time.perf_counter()
        name = f"{self.name}-regen"
        try:
            n_bytes = eng.checkpoint(name, n)
        except BackendError as exc:
            self._regen = None  # an older point's file may be half overwritten: never restore it
            self.save_error = _save_failed(exc)
            self.failures.append(self.save_error)
        else:
            self._regen = {"name": name, "tokens": n, "sha256": tokens_digest(eng.tokens[:n]), "bytes": n_bytes}
        finally:
            # Reading the message (all of it but one token) happened here: part of the time to first token.
            stats.prompt_seconds += time.perf_counter() - t0
        self._write_meta()

    def cells_evaluated(self, p0: int, p1: int) -> None:
        pass  # a checkpoint is saved at the points above; nothing is kept back here (``hold`` is never set)

    def flush(self) -> None:
        pass

    def commit(self) -> None:
        pass

    def before_reply(self) -> Generator[Progress, None, int]:
        yield from ()  # nothing to get ready: the server evaluates what the reply's request needs
        return 0

    def reply_done(self, p0: int, tokens: list[int], stats: TurnStats) -> None:
        self.settle()

    def rollback(self, to: int, *, persist: bool = True) -> Generator[Progress, None, int]:
        return to_the_end(self._rollback(to, persist))

    def _rollback(self, to: int, persist: bool) -> Generator[Progress, None, int]:
        # The backend's own prefix reuse makes a shorter sequence free (the next settle saves it), unless it
        # cannot cut back: then the regenerate point's save, when this is that point, is restored; else the
        # backend is cut back now, so that what it costs is this rollback's and is said with it (undo, /alt,
        # edit). To ``to - 1``: a server's slot holding exactly the next prompt would have to go back one.
        eng = self.eng
        eng.truncate(to)
        if (yield from self._to_regen_point(to)) or not persist or eng.caps.truncate or not eng.caps.checkpoint or to < 2:
            return 0
        try:
            return eng.flush(to - 1)
        except BackendError:
            return 0  # the next request or save meets it again and says so

    def _to_regen_point(self, to: int) -> Generator[Progress, None, bool]:
        """The backend (already cut back to ``to``) is at the last user message's end and its regenerate
        point's save holds those tokens but the last: restore that, and append the last one (evaluated by
        the reply's request); True when done. Anything else, or a failed restore, changes nothing."""
        eng, regen = self.eng, self._regen
        if not self._regen_points or regen is None or int(regen.get("tokens", -1)) != to - 1 or eng.n_past != to:
            return False
        want = list(eng.tokens)
        n = to - 1
        if tokens_digest(want[:n]) != regen.get("sha256"):
            return False
        try:
            ok = eng.restore_checkpoint(str(regen["name"]), want[:n])
        except BackendError:
            ok = False  # the next request says what went wrong, if anything still does
        if ok:
            yield from evaluate(eng, want[n:], "rebuilding context from a saved point")
        return ok

    def put_back(self, tokens: list[int]) -> Generator[Progress, None, int]:
        return to_the_end(self._put_back(tokens))

    def _put_back(self, tokens: list[int]) -> Generator[Progress, None, int]:
        yield from evaluate(self.eng, tokens, PUT_BACK)
        return 0

    def shifted(self) -> None:
        pass

    def settle(self) -> None:
        eng = self.eng
        if not eng.caps.checkpoint or self._saved == eng.tokens:
            return
        try:
            n_bytes = eng.checkpoint(self.name)
        except BackendError as exc:
            self.save_error = _save_failed(exc)
            self.failures.append(self.save_error)
            return
        self.save_error = ""
        self._saved = list(eng.tokens)
        self.meta["checkpoint"] = {"name": self.name, "tokens": eng.n_past, "sha256": tokens_digest(eng.tokens),
                                   "bytes": n_bytes, "identity": eng.identity()}
        self._write_meta()

    def _write_meta(self) -> None:
        info = self.meta.get("checkpoint")
        if isinstance(info, dict):
            if self._regen is not None:
                info["regen"] = dict(self._regen)
            else:
                info.pop("regen", None)
            self.meta_changed = True

    def size_bytes(self) -> int:
        info = self.meta.get("checkpoint")
        if not isinstance(info, dict):
            return 0
        regen = info.get("regen")
        return int(info.get("bytes", 0)) + (int(regen.get("bytes", 0)) if isinstance(regen, dict) else 0)
