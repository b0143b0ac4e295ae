"""The one llama.cpp context of a chatcli process.

Everything that touches the model's KV memory lives here: evaluating tokens, sampling, truncating,
shifting, and saving/restoring ranges of cells. No other module imports ``llama_cpp``.

The engine's token list is the truth about what the context holds: ``tokens[i]`` is the token whose KV
cells sit at position ``i`` of sequence 0. Generated tokens are appended as the sampled ids, never
re-tokenized. Sequence 1 is a scratch sequence used to cut a position range out of sequence 0 for saving
(``llama_memory_seq_cp`` in a unified KV cache only tags cells, it copies nothing) and to stage cells
being restored. Siblings (``Engine.sibling``, the server's resident conversations) on a plain attention
memory also share a batch context (``_SharedBatch``) where the tokens they generate at the same time are
decoded together; the cells computed there are copied back, so each engine's own context stays the truth.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import ctypes
import json
import os
import sys
import threading
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

# No OMP_WAIT_POLICY here: libgomp's default (spin, then sleep) is what llama.cpp's own tools run with, and
# PASSIVE measured 2.7x slower decoding on an idle machine. Busy machines are handled by the thread count
# (cpuload.FreeCores: one thread, hence no barrier to spin at, when others hold a core), and the spin after a
# reply's last decode by COMPUTE.rest (omp.py). The user's OMP_WAIT_POLICY / GOMP_SPINCOUNT, read by libgomp
# when it loads, still apply.
import llama_cpp  # the only import of llama_cpp in chatcli
import numpy as np
import numpy.ctypeslib  # loaded on first use: the first reply's first logits would import it between decodes

from chatcli.backends import seqstate
from chatcli.backends.batching import BatchScheduler
from chatcli.backends.compute import COMPUTE
from chatcli.backends.cpuload import FreeCores, usable_cpus
from chatcli.backends.kvformat import KV_PARAMS, KV_TYPE_NAMES, engine_identity, kv_params_for
from chatcli.core.backend import (
    BackendError,
    Capabilities,
    ContextFullError,
    GenerationResult,
    GrammarError,
    Sampling,
    TokenEvent,
)
from chatcli.core.token_loop import check_load, checked_logits, ensure_logits, eval_batches, token_loop

SEQ = 0  # the conversation
SCRATCH = 1  # staging area for saving/restoring cell ranges
# How long a sibling that ended a reply is expected back with a message (its closing, the client's next turn):
# a message evaluated meanwhile waits up to the scheduler's gather window for it, so that messages sent
# together share one decode. Measured on the bench's clients: the next message came 20-100 ms after a reply.
_LINGER = 0.3


def _addr_fn(name: str, argtypes: list[Any]) -> Any:
    """llama.cpp's ``name`` returning a pointer as a plain int: llama_cpp's binding returns a ctypes pointer,
    whose cast to an address cost ~20 us a token once a decode has cooled the caches (~9 us this way). A
    function object of its own (``CDLL[name]``), so the binding llama_cpp uses keeps its types."""
    fn = llama_cpp.llama_cpp._lib[name]
    fn.restype = ctypes.c_void_p
    fn.argtypes = argtypes
    return fn


_LOGITS_ITH = _addr_fn("llama_get_logits_ith", [ctypes.c_void_p, ctypes.c_int32])


def _fork_probe(operation: Callable[[], object], timeout: float = 10.0) -> bool:
    """Whether ``operation`` returns (True) or aborts the process (False), tried in a forked child.

    llama.cpp answers some unsupported memory operations with GGML_ASSERT (abort), not an error. The
    child runs only that call (no decode, so no thread pool is needed) and exits at once; a child that
    neither returns nor dies within ``timeout`` counts as a failure. No fork (Windows): False, the safe
    answer (the caller then uses only whole-sequence operations).
    """
    if not hasattr(os, "fork"):
        return False
    pid = os.fork()
    if pid == 0:  # the child: try, then leave without running any Python cleanup
        import faulthandler

        faulthandler.disable()  # an abort here is an answer, not a crash to report
        os.environ["GGML_NO_BACKTRACE"] = "1"  # no gdb attach on abort
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the assertion message is not for the user
            operation()
        except BaseException:
            os._exit(1)
        os._exit(0)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return False
        time.sleep(0.002)


@dataclass
class _Step:
    """Tokens to decode in the shared batch: one generated token, or a chunk of a prompt; whose (its sequence
    there), from where, and whether the last one's logits are needed (not after an end-of-turn token, nor
    for a prompt's chunk before its last)."""

    seq: int
    tokens: list[int]
    pos: int
    logits: bool
    read_back: bool = False  # a message's chunk: its cells are read out in the decode's lock hold (``_run``)


@dataclass
class _Done:
    """What ``_SharedBatch._run`` gives each step: its logits row (a copy; None when not asked for) and, for a
    ``read_back`` step, its sequence's state read right after the decode (``sync`` cuts the step's cells out
    of it once the lock is let go)."""

    logits: np.ndarray | None
    cells: np.ndarray | None = None


def _cut(data: np.ndarray, p0: int, p1: int) -> np.ndarray:
    """``seqstate.cut``, its refusal an engine error (the batched cells cannot be taken back)."""
    try:
        return seqstate.cut(data, p0, p1)
    except seqstate.SeqStateError as exc:
        raise BackendError(f"could not read the batched cells back: {exc}") from None


def _seq_data(ctx: Any, seq: int, what: str = "read out the cells", *, room: int = 0) -> np.ndarray:
    """Sequence ``seq``'s state as a byte array, for another context's ``llama_state_seq_set_data``; with
    ``room`` spare bytes after it (``seqstate.widen`` fills them).

    No bytes object and no zero-filled ctypes buffer: a sequence is tens of MB (1,500 tokens of the bundled
    135M model: 23 MB) and each of those copies cost as much as llama.cpp's own (measured: get_data 7.5 ms,
    string_at 6.3, ctypes' zero fill 5.0, from_buffer_copy 7.0), under the model's lock, while the other
    conversations wait for their next token.
    """
    size = llama_cpp.llama_state_seq_get_size(ctx, seq)
    buf = np.empty(size + room, dtype=np.uint8)
    n = llama_cpp.llama_state_seq_get_data(ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq)
    if n == 0:
        raise BackendError(f"llama.cpp could not {what}")
    return buf[:n + room]


class _Family:
    """How many contexts are open on one model (``Engine.sibling`` adds one, ``close`` takes it away)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.open = 1

    def join(self) -> None:
        with self._lock:
            self.open += 1

    def leave(self) -> None:
        with self._lock:
            self.open -= 1


class _SharedBatch:
    """The context in which the siblings of one model decode together while several of them generate.

    A KV cache with a stream per sibling (``kv_unified`` off), each sized for the sibling's whole context:
    a sequence's cells lie together, not interleaved with the others', and a batched decode attends each
    sequence over its own cells only (seqstate.py has the measurements). A sibling's cells come here only
    for the generation in progress: on its first batched token its sequence is copied in whole
    (``enter_batch``); when it is alone again or its reply ends, the cells decoded here are copied back into
    its own context and dropped from this one (``leave_batch``). So the batch context holds only
    conversations generating now and each sibling's own context always ends up with exactly the cells that
    were computed. The copies and the decodes run under the model's decode lock: one decode at a time on the
    model, whatever context.
    """

    def __init__(self, owner: Engine) -> None:
        self.owner = owner
        self.members: list[Engine] = [owner]
        self.capacity = 0  # sequences of the batch context once made (0: not yet)
        self.alone = 0  # siblings evaluating a message in their own context now (changed under the GIL)
        self.stale: set[int] = set()  # sequences left behind by ``Engine._detach``, dropped under the lock
        self._ctx: Any = None
        self._mem: Any = None
        self._batch: Any = None
        self._applied_threads = owner.n_threads
        # The scheduler holds the model's decode lock around ``_run`` (taken before the batch is: steps that
        # come while a sibling evaluates its prompt join the same decode).
        self.scheduler: BatchScheduler[_Step, _Done] = BatchScheduler(
            self._run, lock=owner._decode_lock, size=lambda s: len(s.tokens), linger=_LINGER)

    def add(self, member: Engine) -> int:
        self.members.append(member)
        return len(self.members) - 1

    def fits(self, member: Engine) -> bool:
        """Whether ``member`` has a sequence in the batch context (made for the siblings of its first use)."""
        return self.capacity == 0 or member._member < self.capacity

    def _make(self) -> None:
        o = self.owner
        cap = len(self.members)
        cp = type(o._cparams).from_buffer_copy(o._cparams)  # a ctypes struct: copied bytewise
        cp.n_seq_max = cap  # one sequence each, in a stream of its own ...
        cp.n_ctx = cap * o.n_ctx  # ... of its whole context (llama.cpp gives each stream n_ctx / n_seq_max)
        cp.kv_unified = False
        # A prompt's chunk (up to n_batch tokens) and every other sibling's next token fit in one decode;
        # llama.cpp reserves an output row per sequence. The micro-batch is smaller: its compute buffer grows
        # with it times the cache, and a chat message is a few dozen tokens; longer ones are split by
        # llama.cpp (measured with one unified cache: 659 MiB at 8 siblings of 4,096 tokens for 521, 11 MiB
        # for 9).
        cp.n_batch = o.n_batch + cap
        cp.n_ubatch = min(o.n_batch, 128) + cap
        cp.n_outputs_max = 0  # = n_batch
        with _loading():
            ctx = llama_cpp.llama_init_from_model(o._model, cp)
        if not ctx:
            raise BackendError(f"llama.cpp could not create the batch context: {_last_error() or 'unknown error'}")
        self._ctx = ctx
        self._mem = llama_cpp.llama_get_memory(ctx)
        self._batch = llama_cpp.llama_batch_init(cp.n_batch, 0, 1)
        self.capacity = cap
        self.scheduler.limit = cp.n_batch

    def enter_batch(self, m: Engine) -> None:
        """Copy ``m``'s whole sequence into its sequence of the batch context."""
        m._drop_kept()  # only what it holds, not cells ``forget`` left past its end
        with m._decode_lock:
            if self._ctx is None:
                self._make()
            self.stale.discard(m._member)  # its sequence is replaced below
            # Read with room for the batch context's empty streams: made its layout in place, not copied.
            room = 4 * (self.capacity - 1)
            data = seqstate.widen(_seq_data(m._ctx, SEQ, room=room), self.capacity) if m.n_past else None
            llama_cpp.llama_memory_seq_rm(self._mem, m._member, -1, -1)
            if data is not None:
                src = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
                n = llama_cpp.llama_state_seq_set_data(self._ctx, src, data.size, m._member)
                if n == 0 or llama_cpp.llama_memory_seq_pos_max(self._mem, m._member) != m.n_past - 1:
                    llama_cpp.llama_memory_seq_rm(self._mem, m._member, -1, -1)
                    raise BackendError(f"could not copy the conversation into the batch context: {_last_error()}")
        m._in_batch = True
        m._batch_from = m.n_past

    def leave_batch(self, m: Engine) -> None:
        """Copy the cells ``m`` decoded here back into its own context; drop its sequence here."""
        self._copy_back(m, keep=False)

    def sync(self, m: Engine, cells: np.ndarray | None = None, start: int = -1) -> None:
        """Put the cells ``m`` decoded here into its own context and keep its sequence here (a prompt evaluated
        here: its reply continues here while siblings generate, and its own context must hold the message's
        cells for the state log, which saves them before the reply's first token is decoded). ``cells``: the
        sequence as the decode's leader (``_run``) read it in the same hold of the model's lock, its step
        having begun at ``start``; the step's cells are cut out of it here, without the lock."""
        p0, p1 = m._batch_from, m.n_past
        try:
            if cells is None or start != p0:  # not all of them: read them here
                self._copy_back(m, keep=True)
                return
            m._batch_from = p1
            if p1 > p0:
                m._put_cells(p0, p1, _cut(cells, p0, p1).data)
        except BaseException:
            if cells is not None and p1 > p0:
                del m.tokens[p0:]  # the context must hold what the token list says
                m._drop_logits()
            m._in_batch = False
            with m._decode_lock:
                llama_cpp.llama_memory_seq_rm(self._mem, m._member, -1, -1)
            raise

    def _copy_back(self, m: Engine, *, keep: bool) -> None:
        p0, p1 = m._batch_from, m.n_past
        m._in_batch = keep
        m._batch_from = p1
        with m._decode_lock:
            try:
                if p1 > p0:
                    # The whole sequence (llama.cpp reads no range of one stream), cut to the range once the
                    # lock is let go: its cells lie together in its stream, so a few contiguous copies of about
                    # what its entry copied in (a unified cache read a reply's 47 interleaved cells in 10-16 ms).
                    whole = _seq_data(self._ctx, m._member, "save the batched cells")
            finally:
                if not keep:
                    llama_cpp.llama_memory_seq_rm(self._mem, m._member, -1, -1)
        if p1 > p0:
            try:
                m._put_cells(p0, p1, _cut(whole, p0, p1).data)
            except BaseException:
                # The context must hold what the token list says: without the cells, forget the tokens.
                del m.tokens[p0:]
                m._drop_logits()
                raise

    def _run(self, steps: list[_Step]) -> list[_Done]:
        """Decode ``steps`` in one batch; called by the scheduler with the model's decode lock held.

        A message's cells are read out here too, before the lock is let go: read by each message's own
        thread after the decode, each read waited for the lock again, and the leader of the next round could
        take it first. Measured after 7 messages decoded together: two first tokens came at once, went
        alone, and the other five a decode later, each behind the others' reads (5-65 ms)."""
        o = self.owner
        b = self._batch
        self._drop_stale()
        # In sequence order: llama.cpp splits a batch over several streams into micro-batches of consecutive
        # sequence ids, in the batch's order (llama_batch_allocr::split_equal, ``sequential``).
        order = sorted(range(len(steps)), key=lambda j: steps[j].seq)
        rows = [0] * len(steps)  # each step's last token: its logits' row
        i = 0
        for j in order:
            s = steps[j]
            for k, tok in enumerate(s.tokens):
                b.token[i] = tok
                b.pos[i] = s.pos + k
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = s.seq
                b.logits[i] = False
                i += 1
            b.logits[i - 1] = s.logits
            rows[j] = i - 1
        b.n_tokens = i
        self._applied_threads = _apply_threads(self._ctx, o._decode_threads(), self._applied_threads)
        rc = COMPUTE.run(llama_cpp.llama_decode, self._ctx, b)
        if rc != 0:
            for s in steps:
                llama_cpp.llama_memory_seq_rm(self._mem, s.seq, s.pos, -1)
            raise BackendError(f"llama_decode failed ({rc}): {_last_error() or 'no detail'}")
        out: list[_Done] = []
        for i, s in zip(rows, steps, strict=True):
            row = None
            if s.logits:
                ptr = llama_cpp.llama_get_logits_ith(self._ctx, i)
                row = np.ctypeslib.as_array(ptr, shape=(o.n_vocab,)).copy()
            out.append(_Done(row, _seq_data(self._ctx, s.seq, "save the batched cells") if s.read_back else None))
        return out

    def _drop_stale(self) -> None:
        """Drop the sequences of siblings that left the batch context (the model's lock is held)."""
        while self.stale:
            llama_cpp.llama_memory_seq_rm(self._mem, self.stale.pop(), -1, -1)

    def seq_pos_max(self, seq: int) -> int:
        """The last position sequence ``seq`` holds in the batch context (-1: none)."""
        return -1 if self._mem is None else int(llama_cpp.llama_memory_seq_pos_max(self._mem, seq))

    def close(self) -> None:
        if self._ctx is not None:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
            self._ctx = None


# The engine's errors and data types are the Backend protocol's (re-exported here for older imports).


# llama.cpp logs a lot to stderr; keep the recent lines to explain failures instead of printing them.
_LOG: collections.deque[str] = collections.deque(maxlen=50)


def gbnf_ok(grammar: str, vocab: ctypes.c_void_p | None = None) -> bool:
    """Whether llama.cpp's grammar parser accepts this GBNF. Without a vocabulary (a remote engine's, which
    lives in its server) only grammars that name no tokens (``<[id]>``) can be checked, JSON's among them."""
    g = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    if not g:  # llama.cpp logs why (to _LOG); NULL is all it returns
        return False
    llama_cpp.llama_sampler_free(g)
    return True


def json_gbnf(schema: Mapping[str, Any] | None = None, vocab: ctypes.c_void_p | None = None) -> str:
    """llama.cpp's JSON grammar (an object), or a schema through llama-cpp-python's port of llama.cpp's
    JSON-schema-to-grammar converter (the rules llama-server applies); checked by ``gbnf_ok``. One function
    for the local engine and the remote one, so a request is constrained the same way on both."""
    if schema is None:
        gbnf = str(llama_cpp.llama_grammar.JSON_GBNF)
    else:
        try:
            gbnf = str(llama_cpp.llama_grammar.json_schema_to_gbnf(json.dumps(schema)))
        except Exception as exc:
            # The converter raises whatever it meets (AssertionError for an unresolvable $ref, KeyError,
            # NotImplementedError for an unknown type): all mean "this schema", one line for the caller.
            raise GrammarError(f"the JSON schema cannot be used ({exc})") from None
    if not gbnf_ok(gbnf, vocab):
        raise GrammarError("llama.cpp cannot build a grammar for it")
    return gbnf


@dataclass(frozen=True)
class _LogitPlan:
    """The logit bias and repeat penalty of llama.cpp's sampling chain, applied in numpy (float32, the chain's
    order) before the rest of the chain, or before greedy's maximum.

    Why: ``llama_sampler_sample`` copies 49k candidates, and the penalty step looks every one of them up in a
    hash map: 135 us a token for greedy, 210-310 us with the default repeat penalty, where numpy takes 10-20 us
    (issue #22). The choice is the chain's (tests/test_greedy_sampling.py)."""

    bias_ids: np.ndarray
    bias_values: np.ndarray
    repeat: np.float32
    last_n: int
    greedy: bool
    bias_unique: bool  # each biased id once: one fancy-indexed add (``np.add.at`` took ~45 us a token)
    lowered: frozenset[int] | None  # the biased ids when no bias raises a value (a ban's -inf), else None

    @classmethod
    def of(cls, s: Sampling, n_vocab: int) -> _LogitPlan | None:
        """The plan for ``s``, or None where llama.cpp's chain does it all: a grammar, frequency or presence
        penalties (their ``count * freq + present`` may be fused into one rounding in the C build; numpy
        rounds each operation), token ids out of the vocabulary (the chain's error to raise), or nothing for
        numpy to do before a sampling chain."""
        if s.grammar or s.frequency_penalty or s.presence_penalty:
            return None
        if any(not 0 <= t < n_vocab for t, _ in s.logit_bias):
            return None
        last_n = max(0, s.repeat_last_n)
        repeat = np.float32(s.repeat_penalty or 1.0)
        if repeat == np.float32(1.0):
            last_n = 0  # llama.cpp's "disabled" penalties sampler
        greedy = s.temperature <= 0
        if not greedy and not last_n and not s.logit_bias:
            return None  # the chain's own fill costs what numpy's would
        ids = [t for t, _ in s.logit_bias]
        values = np.asarray([b for _, b in s.logit_bias], dtype=np.float32)
        lowered = frozenset(ids) if bool(np.all(values <= 0)) else None  # NaN is not <= 0
        return cls(np.asarray(ids, dtype=np.int64), values, repeat, last_n, greedy, len(set(ids)) == len(ids),
                   lowered)

    def _apply_into(self, x: np.ndarray, ids: np.ndarray | None) -> None:
        """The bias, then the penalty over the window's ``ids``, written into ``x`` (the chain's order)."""
        if self.bias_ids.size:
            if self.bias_unique:
                x[self.bias_ids] += self.bias_values  # one float32 add per id, as the C loop's
            else:
                np.add.at(x, self.bias_ids, self.bias_values)  # in order, duplicates too, as the C loop adds
        if ids is not None:
            x[ids] = self._penalised(x[ids])

    def window_ids(self, tokens: list[int]) -> np.ndarray | None:
        """The ids of the penalty's window over ``tokens``, each once, in any order (None: no window). Not
        ``np.unique``: numpy 2 imports ``numpy.ma`` on its first call (15-20 ms between the first reply's first
        two decodes), and a set of a 64-token window costs a third of its 12 us."""
        window = tokens[-self.last_n:] if self.last_n else []
        return np.fromiter(set(window), dtype=np.int64) if window else None

    def _penalised(self, v: np.ndarray) -> np.ndarray:
        # float32 throughout, as the C code: multiply the non-positive, divide the positive, once per token
        # however often it occurs in the window.
        return np.where(v <= 0, v * self.repeat, v / self.repeat)

    def apply(self, logits: np.ndarray, tokens: list[int]) -> np.ndarray:
        """``logits`` (never modified) with the bias added and the penalty applied over ``tokens``' window."""
        ids = self.window_ids(tokens)
        if not self.bias_ids.size and ids is None:
            return logits
        x = logits.copy()  # the context's buffer and kept logits stay as computed
        self._apply_into(x, ids)
        return x

    def greedy_pick(self, logits: np.ndarray, tokens: list[int]) -> tuple[int, bool]:
        """The first maximum of ``apply(logits, tokens)`` and whether it is NaN, without its 49k copy (7 of the
        40-50 us a token that ``apply`` took, ~50 us once a decode has cooled the caches): the biased and
        penalised values are written into ``logits`` for the argmax and the originals put back, bit for bit."""
        if self.lowered is not None and self.repeat >= 1:
            # A bias of 0 or less (a ban) and a penalty of 1 or more only lower the values they touch (float32
            # rounding too: the exact result is at most the value, and so is its rounding), so the first maximum
            # stays first unless it is one of them: then the argmax below. Measured: greedy with the default
            # penalty ~120 -> 60-70 us a token (numpy's half-dozen calls each cost 10+ us with the caches a
            # decode has cooled). A NaN goes to the chain whichever it is. (A ban meeting a +inf elsewhere makes a
            # NaN there, which the chain's greedy step, comparing with ">", never picks: the untouched maximum.)
            tok = int(np.argmax(logits))
            x = logits.item(tok)
            if x != x:
                return tok, True
            if tok not in self.lowered and (not self.last_n or tok not in tokens[-self.last_n:]):  # [-0:]: all
                return tok, False
        with self.applied(logits, self.window_ids(tokens)):
            tok = int(np.argmax(logits))
            x = logits.item(tok)  # a Python float: ``x != x`` is NaN's test without numpy's (cold) dispatch
            return tok, x != x

    @contextlib.contextmanager
    def applied(self, logits: np.ndarray, ids: np.ndarray | None) -> Iterator[None]:
        """``logits`` biased and penalised (window ``ids``) in place until the block ends, then the values as
        they were, bit for bit: no 49k copy of the row."""
        if ids is None and not self.bias_ids.size:
            yield
            return
        touched = ids if not self.bias_ids.size else self.bias_ids if ids is None else np.concatenate(
            (self.bias_ids, ids))
        v = logits[touched]  # a copy (fancy indexing): an id in both lists saved twice, the same original value
        try:
            self._apply_into(logits, ids)
            yield
        finally:
            logits[touched] = v


def _apply_threads(ctx: ctypes.c_void_p, want: int, applied: int) -> int:
    """Give ``ctx`` ``want`` CPU threads for its next decode unless it already has them; returns the count
    now applied (a call into llama.cpp only when the count changes)."""
    if want != applied:
        llama_cpp.llama_set_n_threads(ctx, want, want)
    return want


@llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]  # a ctypes CFUNCTYPE
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    try:
        _LOG.append(text.decode("utf-8", errors="replace"))
    except Exception:  # never raise into C
        pass


llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
_BACKEND_READY = False

# Loading a model or making a context, llama.cpp logs ~2,000 lines (the bundled model), each one a call into
# Python (``_log_callback``) that must take the GIL. A process that starts up meanwhile on another thread
# (`serve` imports its HTTP layer while the model loads, the REPL its Markdown parser) holds the GIL for up
# to the interpreter's switch interval (5 ms) at a time, so each line waited for it: measured, the load took
# 2-30x as long next to a thread running Python (0.13 s alone). A shorter interval while llama.cpp loads lets
# each callback in at once; the other thread's Python runs at the same speed, switched more often.
_LOADING_SWITCH_S = 0.00005
_loading_lock = threading.Lock()
_loading_depth = 0
_switch_before = 0.0


@contextlib.contextmanager
def _loading() -> Iterator[None]:
    """Around a llama.cpp call that logs a lot: the short switch interval above (nested and concurrent
    uses keep it until the last ends; then the one before is restored)."""
    global _loading_depth, _switch_before
    with _loading_lock:
        if _loading_depth == 0:
            _switch_before = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_before, _LOADING_SWITCH_S))
        _loading_depth += 1
    try:
        yield
    finally:
        with _loading_lock:
            _loading_depth -= 1
            if _loading_depth == 0:
                sys.setswitchinterval(_switch_before)


def _last_error() -> str:
    for line in reversed(_LOG):
        line = line.strip()
        if line:
            return line
    return ""


# The KV cache types chatcli offers: name -> ggml type (K and V alike; see kvformat.kv_params_for).
KV_TYPES: dict[str, int] = {
    "f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}


@dataclass
class EvalStats:
    """What one evaluation cost."""

    n_eval: int = 0
    seconds: float = 0.0


class Engine:
    """Owns one model and one context for the life of a chatcli process."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_batch: int = 512,
        progress: Callable[[float], None] | None = None,
        kv_type: str = "f16",
    ) -> None:
        global _BACKEND_READY
        if kv_type not in KV_TYPES:  # fails before the model is loaded
            raise BackendError(f"unknown KV type {kv_type!r}: use {', '.join(KV_TYPES)}")
        kv_params = kv_params_for(kv_type)
        if not _BACKEND_READY:
            llama_cpp.llama_backend_init()
            _BACKEND_READY = True
        self.model_path = str(model_path)
        # Made before the model loads: its first look at the machine then judges the load's time (FreeCores).
        free_cores = FreeCores(n_threads or usable_cpus()) if n_threads is None else None
        mparams = llama_cpp.llama_model_default_params()
        if progress is not None:
            def _cb(value: float, _data: ctypes.c_void_p) -> bool:
                progress(value)
                return True

            self._progress_cb = llama_cpp.llama_progress_callback(_cb)
            mparams.progress_callback = self._progress_cb
        with _loading():
            model = llama_cpp.llama_model_load_from_file(self.model_path.encode(), mparams)
        if not model:
            raise BackendError(f"llama.cpp could not load the model {self.model_path}: {_last_error() or 'unknown error'}")
        if llama_cpp.llama_model_is_diffusion(model):
            # No KV memory at all (llama.cpp creates none): text comes from denoising whole blocks, not from
            # a sequence that grows token by token, which is everything chatcli does.
            llama_cpp.llama_model_free(model)
            raise BackendError(f"{self.model_path} is a diffusion language model: chatcli needs an autoregressive "
                              "one (llama.cpp's llama-diffusion-cli runs this kind)")
        self._model = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(model)

        # --threads fixes the count; without it, up to every usable CPU, fewer while other processes hold some.
        threads = n_threads or usable_cpus()
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        # Two sequences in one unified cache: 0 is the conversation, 1 the scratch for partial saves.
        cparams.n_seq_max = 2
        cparams.kv_unified = True
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        # Pinned (never "auto") so the saved V layout (transposed or not) is the same in every process.
        cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if kv_params["flash_attn"]
                                   else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cparams.type_k = KV_TYPES[kv_type]
        cparams.type_v = KV_TYPES[kv_type]
        cparams.no_perf = True
        # Set from a signal handler (Ctrl-C) and checked between tokens: a decode is never cut in half.
        self._cancel_flag = threading.Event()
        with _loading():
            ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            llama_cpp.llama_model_free(model)
            raise BackendError(f"llama.cpp could not create a context of {n_ctx} tokens (KV {kv_type}): "
                              f"{_last_error() or 'unknown error'}")
        self._ctx = ctx
        self._cparams = cparams  # for sibling contexts over the same model
        self._owns_model = True
        self._mem = llama_cpp.llama_get_memory(ctx)
        self.n_ctx = llama_cpp.llama_n_ctx(ctx)
        self.n_threads = threads
        self._free_cores = free_cores
        self._applied_threads = threads
        # Shared with every sibling: one decode at a time across the contexts of a model, so N resident
        # conversations never run N thread teams on the same cores.
        self._decode_lock = threading.Lock()
        self.n_batch = n_batch
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 2)
        self.tokens: list[int] = []
        # Logits for the token after ``tokens`` come from one of two places. Normally the context's own
        # output buffer (``_ctx_logits``: the last decode computed them), which llama.cpp's sampler reads in
        # place. After a rollback or a restore the context has no such logits and ``_logits`` holds the
        # ones saved for this position; they are sampled through a candidates array we fill.
        self._logits: np.ndarray | None = None
        self._ctx_logits = False
        # A numpy view of the context's logits row and its address: building one costs 15-20 us (numpy makes
        # a ctypes array type for it), once per token; llama.cpp keeps the row where it is between decodes.
        self._logits_view: tuple[int, np.ndarray] | None = None
        self.can_shift = bool(llama_cpp.llama_memory_can_shift(self._mem))
        self.n_swa = int(llama_cpp.llama_model_n_swa(model))  # > 0: some layers attend to a sliding window
        # Batched decoding with siblings (see _SharedBatch): none until the first sibling is made.
        self._group: _SharedBatch | None = None
        # The contexts open on this model, this one included (shared with every sibling): with another one
        # open, decodes may come from other threads (``_shared``).
        self._family = _Family()
        self._member = 0  # this engine's sequence in the shared batch context
        self._in_batch = False  # its sequence is in the shared context (cells from _batch_from not yet here)
        self._batch_from = 0  # where they start
        self._shift_pending = False  # a shift's RoPE update waits for the next decode: not copyable yet
        # The tokens of the cells ``forget`` left in the sequence, by position: those past ``n_past`` are
        # taken up by the next evaluation as far as its tokens are the same, the rest dropped then.
        self._kept: list[int] = []
        self.n_evaluated_total = 0
        self.memory_kind, self.can_truncate, self.ranges = self._probe_memory()
        self.n_evaluated_total = 0  # the probe's two tokens are not the conversation's
        self._pieces: tuple[dict[int, bytes], dict[int, bytes]] = ({}, {})  # by ``special``: (False, True)
        self._eog: dict[int, bool] = {}
        self._ids = np.arange(self.n_vocab, dtype=np.int32)
        self._candidates = np.zeros(
            self.n_vocab, dtype=np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
        )
        self.kv_type = kv_type
        self.kv_params = kv_params
        self._closed = False

    @property
    def caps(self) -> Capabilities:
        # A property: ``can_shift`` may be turned off (tests simulate a model whose memory cannot shift).
        # A memory that cannot be cut back cannot shift either, whatever its attention part could: the
        # recurrent state still holds what a shift drops, so the result would match no evaluation.
        return Capabilities(cells=True, checkpoint=False, logits=True, local_sampling=True,
                            shift=self.can_shift and self.can_truncate, truncate=self.can_truncate,
                            ranges=self.ranges, grammar=True,
                            memory="swa" if self.memory_kind == "attention" and self.n_swa else self.memory_kind)

    @property
    def _plain_attention(self) -> bool:
        """A full attention cache, cut back and saved by range anywhere: what batching and ``forget`` need."""
        return self.memory_kind == "attention" and not self.n_swa and self.can_truncate and self.ranges

    def _probe_memory(self) -> tuple[str, bool, bool]:
        """What this context's memory can do: (kind, can truncate, can save position ranges).

        Asked of llama.cpp by trying, never assumed from the architecture's name (a new memory kind must
        not abort the process), and only where llama.cpp calls the architecture recurrent or hybrid, or its
        memory cannot shift: a plain attention cache (and SWA with a full-size cache) always truncates, and
        the probe costs a 2-token decode at load.

        - Truncation, as llama.cpp's common_context_can_seq_rm checks it: decode two tokens, remove the
          second. A recurrent state refuses (it keeps no history), changing nothing.
        - Range saves copy a position range to the scratch sequence (``llama_memory_seq_cp``). Some memories
          assert instead of refusing (DeepSeek-V4: "only supports full sequence copies"), so the copy is
          tried in a forked child: an abort kills only the child. Pure recurrent memories have no cells to
          range over. Without fork (Windows), ranges are not used where truncation fails: whole-sequence
          saves are always safe.
        """
        recurrent = bool(llama_cpp.llama_model_is_recurrent(self._model))
        hybrid = bool(llama_cpp.llama_model_is_hybrid(self._model))
        if not (recurrent or hybrid or not self.can_shift):
            return "attention", True, True
        self._decode([0, min(1, self.n_vocab - 1)], last_logits=False)
        try:
            truncates = bool(llama_cpp.llama_memory_seq_rm(self._mem, SEQ, 1, -1))
        finally:
            self.clear()
        if truncates:
            return "attention", True, True
        if recurrent:
            return "recurrent", False, False
        ranges = _fork_probe(lambda: llama_cpp.llama_memory_seq_cp(self._mem, SEQ, SCRATCH, 0, 1))
        return ("hybrid" if ranges else "whole"), False, ranges

    def identity(self) -> dict[str, Any]:
        """What saved cells must match besides the model: the context size and the pinned KV format."""
        return engine_identity(self.n_ctx, self.kv_params)

    # -- lifecycle ---------------------------------------------------------------------------------

    def sibling(self) -> Engine:
        """Another context over this engine's model: its own KV cache, tokens, logits and cancel flag; the
        model (weights, vocabulary) loaded once. For several conversations resident at once (the server).

        Each conversation keeps a context of its own, because that is what a restore reproduces: measured
        with llama.cpp 0.3.36, a sequence whose cells have another sequence's cells between them gets
        different logits (max |Δ| 0.7) than the same tokens alone. On a plain attention memory the siblings
        also share one batch context (``_SharedBatch``): while two or more of them generate, their next
        tokens are decoded together there and the cells computed are copied back into each one's own
        context, so what is saved is exactly what was computed and a conversation that continues alone
        continues as its restored copy would. Other memory kinds take turns (one decode at a time).
        Close siblings before the engine that owns the model; calls on one sibling must not overlap.
        """
        with _loading():
            ctx = llama_cpp.llama_init_from_model(self._model, self._cparams)
        if not ctx:
            raise BackendError(f"llama.cpp could not create another context: {_last_error() or 'unknown error'}")
        self._family.join()
        other = copy.copy(self)
        other._ctx = ctx
        other._mem = llama_cpp.llama_get_memory(ctx)
        other._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 2)
        other._owns_model = False
        other._applied_threads = self.n_threads  # the new context starts with the cparams' count
        other._closed = False
        other.tokens = []
        other._kept = []  # ``copy.copy`` shares the list: kept cells are this context's, not the new one's
        other._logits = None
        other._logits_view = None
        other._cancel_flag = threading.Event()
        other.n_evaluated_total = 0
        other._candidates = np.zeros_like(self._candidates)
        other._in_batch = False
        other._batch_from = 0
        other._shift_pending = False
        if self._plain_attention:
            if self._group is None:
                self._group = _SharedBatch(self)
            other._group = self._group
            other._member = self._group.add(other)
        else:
            other._group = None
        return other

    @property
    def _shared(self) -> bool:
        """Another context is open on this model: its decodes may come from another thread meanwhile."""
        return self._family.open > 1

    def prepare_batching(self) -> bool:
        """Make the siblings' shared batch context now, once every sibling exists (``serve --parallel``
        calls it at start); True when there is one. Made lazily it was made by the first two requests that
        generated at once, under the model's lock: measured 145 / 282 / 1,434 ms of CPU for 2 / 4 / 8
        siblings of the bundled model (the KV of every sibling's whole context is allocated and cleared),
        during which no conversation decoded a token — in a benchmark's first N=2 run, a tenth of its
        wall time. A sibling made after this has no sequence there and decodes alone (``fits``)."""
        group = self._group
        if group is None:
            return False
        with self._decode_lock:
            if group._ctx is None:
                group._make()
        return True

    def take_notices(self) -> list[str]:
        return []  # everything this engine has to say is an error (raised) or in the conversation's events

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self._ctx)
        self._family.leave()
        if self._owns_model and self._group is not None:
            self._group.close()
        if self._owns_model:
            llama_cpp.llama_model_free(self._model)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- vocabulary ----------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8", errors="replace")
        cap = len(data) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise BackendError("tokenization failed")
        return list(buf[:n])

    def piece(self, token: int, *, special: bool = True) -> bytes:
        # A token's text never changes: asked once per token a reply, a dict beats llama.cpp's call (~15 us
        # with caches a decode has cooled, ~1 us this way). Shared with siblings (the same vocabulary).
        pieces = self._pieces[special]
        got = pieces.get(token)
        if got is None:
            got = pieces[token] = self._piece(token, special)
        return got

    def _piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int], *, special: bool = True) -> str:
        return b"".join(self.piece(t, special=special) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        eog = self._eog.get(token)  # asked once per token a reply, as ``piece``
        if eog is None:
            eog = self._eog[token] = bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))
        return eog

    @property
    def bos_token(self) -> int:
        return int(llama_cpp.llama_vocab_bos(self._vocab))

    @property
    def eos_token(self) -> int:
        return int(llama_cpp.llama_vocab_eos(self._vocab))

    @property
    def add_bos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))

    # -- evaluation ----------------------------------------------------------------------------------

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def eval(self, tokens: Sequence[int]) -> EvalStats:
        """Evaluate ``tokens`` after the current ones; only they are computed."""
        t0 = time.perf_counter()
        n = 0
        for done, _total in self.eval_steps(tokens):
            n = done
        return EvalStats(n_eval=n, seconds=time.perf_counter() - t0)

    def eval_steps(self, tokens: Sequence[int]) -> Iterator[tuple[int, int]]:
        """Evaluate ``tokens`` one batch at a time, yielding (done, total) after each: for progress bars.

        Logits are computed for the last token only. The batch boundaries (every ``n_batch`` tokens) are the
        same however the tokens are evaluated, so the cells are too.
        """
        if self._kept:
            return self._eval_after_kept(tokens)
        group = self._group
        if group is None:
            return eval_batches(self, tokens, lambda part, last: self._decode(part, last_logits=last))
        return self._group_eval(group, tokens)

    def _eval_after_kept(self, tokens: Sequence[int]) -> Iterator[tuple[int, int]]:
        """``eval_steps`` right after ``forget``: the kept cells ``tokens`` start with are taken as they are
        (``kept``), the others dropped, the rest evaluated."""
        tokens = list(tokens)
        if self.n_past + len(tokens) > self.n_ctx:
            self._drop_kept()
            raise ContextFullError(f"{len(tokens)} tokens do not fit: {self.n_past}/{self.n_ctx} in use")
        k = self.kept(tokens)
        if k > 0:
            self.tokens.extend(tokens[:k])
            self._drop_logits()
        self._drop_kept()
        for done, total in self.eval_steps(tokens[k:]):
            yield k + done, k + total

    def forget(self) -> None:
        """Empty the sequence as ``clear`` does, but leave its cells where the memory can be cut back: the
        next evaluation takes up those its tokens start with (``kept``) instead of computing them again, as
        llama-server reuses a slot's cached prompt; ``take_kept`` takes a persona prefix. The caller vouches
        that the cells were computed where they are (no context shift moved them): taken up, they are what
        a fresh evaluation computes."""
        if not self._plain_attention or self._shift_pending:
            self.clear()
            return
        self._detach()
        self._kept = self.tokens[:]
        del self.tokens[:]
        self._drop_logits()

    def kept(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` their evaluation takes up from the cells ``forget`` kept: as far as those hold
        the same tokens, but never the last two, and never just one. A call of one token computes its row
        otherwise than a call of several (llama.cpp's matrix-vector kernels): on f32 weights its logits
        differed (4e-8) from the same token's as a row of the message's batch, while every split into calls
        of two tokens or more gave the same bits (tests/kind_checks.py, ``kept``, on every architecture)."""
        k = min(self._kept_match(tokens), len(tokens) - 2)
        return k if k >= 2 else 0

    def _kept_match(self, tokens: Sequence[int]) -> int:
        k = 0
        for a, b in zip(self._kept[self.n_past:], tokens, strict=False):
            if a != b:
                break
            k += 1
        return k

    def take_kept(self, tokens: Sequence[int]) -> bool:
        """Append ``tokens`` from the kept cells when they hold all of them (no logits then): a persona prefix
        that the context's last conversation started with, evaluated as a call of its own there as here.
        False, changing nothing, when they do not."""
        if not tokens or self._kept_match(tokens) < len(tokens):
            return False
        self.tokens.extend(tokens)
        self._drop_logits()
        return True

    def _drop_kept(self) -> None:
        """Free the kept cells past the context's end: before anything else uses the sequence."""
        if self._kept:
            if len(self._kept) > self.n_past:
                llama_cpp.llama_memory_seq_rm(self._mem, SEQ, self.n_past, -1)
            self._kept = []

    def _group_eval(self, group: _SharedBatch, tokens: Sequence[int]) -> Iterator[tuple[int, int]]:
        """``eval_steps`` of a sibling: with the siblings' next tokens in one decode of the batch context when
        others generate, evaluate or are expected back with a message (``_fuses``), else alone here."""
        sched = group.scheduler
        key = self._member
        sched.join(key)
        fused = self._fuses(group)
        if not fused:
            # Not counted while evaluating alone: no round waits for this one; a message waits for it.
            sched.leave(linger=True, key=key)
            group.alone += 1  # a message that comes meanwhile goes to the batch context, to meet our reply
        try:
            yield from eval_batches(self, tokens, lambda part, last: (
                self._fused_decode(group, part, last) if fused else self._decode_alone(part, last)))
        finally:
            if fused:
                # Its reply's first token follows within milliseconds: the next round of the siblings' tokens
                # waits for it (a few ms), or it decodes alone a round later, one more decode per message.
                sched.leave(key=key, follows=True)
            else:
                group.alone -= 1

    def _fuses(self, group: _SharedBatch) -> bool:
        """Whether this evaluation goes into the batch context (this engine already joined its scheduler).

        Not from an empty context: a persona prefix is evaluated alone, as the prefix cache's copy was. Not
        while alone: a single conversation computes exactly as a single engine does."""
        if self.n_past == 0 or self._shift_pending or group._ctx is None or not group.fits(self):
            return False
        sched = group.scheduler
        return sched.active > 1 or sched.busy or sched.returning() > 0 or group.alone > 0

    def _fused_decode(self, group: _SharedBatch, part: list[int], last: bool) -> None:
        if not self._in_batch:
            group.enter_batch(self)
        done = group.scheduler.submit(_Step(self._member, list(part), self.n_past, last, read_back=True),
                                      gathers_returning=True)
        self.tokens.extend(part)
        self.n_evaluated_total += len(part)
        self._logits = done.logits  # a copy of this sequence's last row (None before a prompt's last chunk)
        self._ctx_logits = False
        group.sync(self, done.cells, self.n_past - len(part))

    def _decode_alone(self, part: list[int], last: bool) -> None:
        self._detach()
        self._decode(part, last_logits=last)

    def _detach(self) -> None:
        """Before this context changes by itself: out of the batch context (whose copy would go stale). With
        nothing to copy back (a message evaluated there was copied at once), its sequence there is dropped
        by the next decode or entry, under the lock they take anyway: a ``clear`` waited 0.9 s for that lock
        behind a sibling's prompt, on a busy machine. Cells ``forget`` kept are dropped."""
        self._drop_kept()
        if self._in_batch:
            group = self._group
            assert group is not None
            if self._batch_from < self.n_past:
                group.leave_batch(self)
            else:
                self._in_batch = False
                group.stale.add(self._member)

    def _decode_threads(self) -> int:
        """Threads for the next decode: the cores other processes leave free, or the fixed count."""
        return self._free_cores.threads() if self._free_cores is not None else self.n_threads

    def _decode(self, part: list[int], *, last_logits: bool) -> None:
        self._drop_kept()  # a cell of the same position must not stay beside the one decoded
        b = self._batch
        n0 = self.n_past
        b.n_tokens = len(part)
        for i, tok in enumerate(part):
            b.token[i] = tok
            b.pos[i] = n0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = SEQ
            b.logits[i] = False
        if last_logits:
            b.logits[len(part) - 1] = True
        with self._decode_lock:
            self._applied_threads = _apply_threads(self._ctx, self._decode_threads(), self._applied_threads)
            rc = COMPUTE.run(llama_cpp.llama_decode, self._ctx, b)
        if rc != 0:
            # A failed decode leaves no cells for this batch; the token list stays as it was. The output
            # buffer may be half-written: the logits of the last good position are gone with it.
            llama_cpp.llama_memory_seq_rm(self._mem, SEQ, n0, -1)
            self._drop_logits()
            raise BackendError(f"llama_decode failed ({rc}): {_last_error() or 'no detail'}")
        self.tokens.extend(part)
        self.n_evaluated_total += len(part)
        self._shift_pending = False
        # No copy here: the logits stay in the context's buffer until someone asks for them.
        self._logits = None
        self._ctx_logits = last_logits

    def _drop_logits(self) -> None:
        self._logits = None
        self._ctx_logits = False

    def logits(self) -> np.ndarray:
        """The logits for the token after ``tokens`` (a copy)."""
        if not self.has_logits:
            raise BackendError("no logits for the current position")
        return self._current_logits().copy()

    @property
    def has_logits(self) -> bool:
        return self._logits is not None or self._ctx_logits

    def set_logits(self, logits: np.ndarray) -> None:
        """Install logits saved earlier for the current position (so rollback needs no re-evaluation)."""
        self._logits = checked_logits(logits, self.n_vocab)

    def ensure_logits(self) -> int:
        """Make logits available for the current position; returns tokens re-evaluated (0 or 1)."""
        return ensure_logits(self)

    # -- generation ----------------------------------------------------------------------------------

    def cancel(self) -> None:
        """Ask a running generation to stop after the current token (safe from a signal handler)."""
        self._cancel_flag.set()

    def reset_cancel(self) -> None:
        """Forget an old cancel request: called when an operation starts, not when sampling starts, so a
        Ctrl-C pressed while the prompt is being evaluated still stops the reply."""
        self._cancel_flag.clear()

    def generate(
        self,
        sampling: Sampling,
        *,
        seed: int,
        max_tokens: int,
        result: GenerationResult | None = None,
        stop_strings: Sequence[str] = (),
        defer_last: bool = False,
    ) -> Iterator[TokenEvent]:
        """Sample a reply token by token from the current logits.

        Each sampled token is decoded into the context before the next is sampled, so ``tokens`` always
        equals what the KV holds; the end-of-turn token is decoded too, so the next turn starts right after
        it (unless ``defer_last``: the reply's last token is left in ``result.undecoded``, see
        ``token_loop``). Closing the generator early (or ``cancel()``) keeps what was produced and stays
        consistent.
        """
        res = result if result is not None else GenerationResult()
        if not self.has_logits:
            self.ensure_logits()
        plan = _LogitPlan.of(sampling, self.n_vocab)
        # With a plan, numpy does the bias and the penalty, the chain the rest (nothing, for greedy).
        chain = self._make_sampler(sampling, seed, pre_applied=plan is not None)
        if plan is None:
            sample: Callable[[], int] = lambda: self._sample(chain)
        elif plan.greedy:
            sample = lambda: self._sample_greedy(plan, sampling, seed)
        else:
            sample = lambda: self._sample_planned(chain, plan)
        group = self._group
        if group is not None:
            group.scheduler.join(self._member)
        # Alone on its model (no sibling context, so nothing else decodes meanwhile) the reply's tokens are
        # decoded on this thread, with no hop to the compute thread per token (compute.py: ``borrowed``).
        shared = self._shared  # as it was when the reply began (a sibling may come or go meanwhile)
        borrow = contextlib.nullcontext() if shared else COMPUTE.borrowed()
        try:
            with borrow:
                yield from token_loop(
                    res, sample=sample,
                    decode=lambda tok, logits: self._step(tok, logits=logits),
                    is_eog=self.is_eog, piece=lambda tok: self.piece(tok, special=False),
                    room=lambda: self.n_ctx - self.n_past, cancelled=self._cancel_flag.is_set,
                    max_tokens=max_tokens, stop_strings=stop_strings, defer_last=defer_last)
        finally:
            if group is not None:
                group.scheduler.leave(linger=True, key=self._member)  # its next message is likely to follow
                if self._in_batch:
                    group.leave_batch(self)
            llama_cpp.llama_sampler_free(chain)
            self._cancel_flag.clear()  # a cancel request ends with the generation it stopped
            # What follows a reply (its commit, the state file, the response, the next prompt) needs the core
            # that OpenMP's workers would spin on for ~10 ms: let them go (compute.py, omp.py). A borrowed
            # reply let its own go when the block ended, and the compute thread's before it began.
            if shared:
                COMPUTE.rest()

    def _step(self, tok: int, *, logits: bool) -> None:
        """Decode one generated token: with the siblings generating now, in one batch, else alone here. Once its
        tokens are in the batch context a reply stays there to its end, alone or not: leaving copies its cells back and the
        next sibling's message would copy them all in again (measured: a reply went in and out twice in its
        last three tokens, 60-70 ms of copies each time on a busy machine)."""
        group = self._group
        # This reply's own cells in the batch context (not its message's: those are copied back at once, and
        # a reply alone from its start decodes here, exactly as a single engine and a resumed one do).
        replying_there = self._in_batch and self._batch_from < self.n_past
        alone = group is None or group.scheduler.active < 2
        if group is None or self._shift_pending or (alone and not replying_there) or not group.fits(self):
            self._detach()  # alone again: this context continues from the cells computed
            self._decode([tok], last_logits=logits)
            return
        if self.n_past + 1 > self.n_ctx:
            raise ContextFullError(f"1 token does not fit: {self.n_past}/{self.n_ctx} in use")
        if not self._in_batch:
            group.enter_batch(self)
        done = group.scheduler.submit(_Step(self._member, [tok], self.n_past, logits))
        self.tokens.append(tok)
        self.n_evaluated_total += 1
        self._logits = done.logits  # a copy of this sequence's row, sampled through the candidates array
        self._ctx_logits = False

    def _current_logits(self) -> np.ndarray:
        """The logits for the token after ``tokens``, without a copy: the ones kept, else the context's buffer."""
        if self._logits is None and self._ctx_logits:
            addr = _LOGITS_ITH(self._ctx, -1)
            view = self._logits_view
            if view is None or view[0] != addr:
                if not addr:
                    raise BackendError("llama.cpp has no logits for the current position")
                row = (ctypes.c_float * self.n_vocab).from_address(addr)
                view = self._logits_view = (addr, np.ctypeslib.as_array(row))
            return view[1]
        assert self._logits is not None
        return self._logits

    def _sample_greedy(self, plan: _LogitPlan, sampling: Sampling, seed: int) -> int:
        """llama.cpp's greedy chain in numpy: the same token (the first maximum, as the C loop's strict ">")."""
        tok, nan = plan.greedy_pick(self._current_logits(), self.tokens)
        if nan:
            # argmax stops at a NaN, the C loop steps over it: let llama.cpp choose (no state to carry over:
            # a fresh chain's penalty window is filled from the token list, greedy has no random state).
            chain = self._make_sampler(sampling, seed)
            try:
                return self._sample(chain)
            finally:
                llama_cpp.llama_sampler_free(chain)
        return tok

    def _sample_planned(self, chain: ctypes.c_void_p, plan: _LogitPlan) -> int:
        """``chain`` (without the bias and the penalties) after ``plan`` (which applies them). The common case,
        logits the last decode computed: applied in the context's buffer for llama.cpp's sampler, which fills
        the candidates as ``_sample_candidates`` does, in C, and the buffer put back as computed: no copy of the
        row, no fill of 49k candidates in numpy (talk's default sampling, replies alternating in one process:
        260-300 -> 180-210 us a token)."""
        if self._logits is None and self._ctx_logits:
            with plan.applied(self._current_logits(), plan.window_ids(self.tokens)):
                return self._sample(chain)
        return self._sample_candidates(chain, plan.apply(self._current_logits(), self.tokens))

    def _sample(self, chain: ctypes.c_void_p) -> int:
        if self._logits is None and self._ctx_logits:
            # The common case: the last decode computed these logits. llama.cpp's sampler builds the same
            # candidates (id i, logit i, p 0, unsorted) from the context's buffer as the path below does
            # from saved logits, applies the chain and accepts the token: same token, no Python refill.
            return int(llama_cpp.llama_sampler_sample(chain, self._ctx, -1))
        # After a rollback or a restore from disk the right logits are the ones we kept, which the
        # context's buffer knows nothing about.
        assert self._logits is not None
        return self._sample_candidates(chain, self._logits)

    def _sample_candidates(self, chain: ctypes.c_void_p, logits: np.ndarray) -> int:
        """Apply ``chain`` to the candidates ``logits`` make (id i, logit i, p 0, unsorted: what
        ``llama_sampler_sample`` builds from the context's buffer) and accept its choice."""
        cand = self._candidates
        cand["id"] = self._ids
        cand["logit"] = logits
        cand["p"] = 0.0
        arr = llama_cpp.llama_token_data_array(
            data=cand.ctypes.data_as(llama_cpp.llama_token_data_p),
            size=self.n_vocab, selected=-1, sorted=False,
        )
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(arr))
        if arr.selected < 0 or arr.selected >= arr.size:
            raise BackendError("sampler selected no token")
        tok = int(arr.data[arr.selected].id)
        llama_cpp.llama_sampler_accept(chain, tok)
        return tok

    def _make_sampler(self, s: Sampling, seed: int, *, pre_applied: bool = False) -> ctypes.c_void_p:
        """llama.cpp's chain for ``s``; ``pre_applied``: without the logit bias and the penalties (a
        ``_LogitPlan`` applies them before the chain)."""
        sparams = llama_cpp.llama_sampler_chain_default_params()
        chain = llama_cpp.llama_sampler_chain_init(sparams)
        try:
            if not pre_applied:
                self._add_constraints(chain, s)
        except BaseException:
            llama_cpp.llama_sampler_free(chain)
            raise
        penalized = not pre_applied and (
            (s.repeat_penalty and s.repeat_penalty != 1.0) or s.frequency_penalty or s.presence_penalty)
        if penalized:
            pen = llama_cpp.llama_sampler_init_penalties(self.n_vocab, s.repeat_last_n, s.repeat_penalty or 1.0,
                                                         s.frequency_penalty, s.presence_penalty)
            llama_cpp.llama_sampler_chain_add(chain, pen)
            # The penalty window is rebuilt from the token list, so it is the same in every process.
            for tok in self.tokens[-s.repeat_last_n:]:
                llama_cpp.llama_sampler_accept(pen, tok)
        if s.temperature <= 0:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        else:
            if s.top_k > 0:
                llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(s.top_k))
            if 0 < s.top_p < 1:
                llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(s.top_p, 1))
            if s.min_p > 0:  # llama.cpp's order: top_k, top_p, min_p, temperature
                llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_min_p(s.min_p, 1))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(s.temperature))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return typing.cast(ctypes.c_void_p, chain)  # llama_cpp's bindings are untyped

    def _add_constraints(self, chain: ctypes.c_void_p, s: Sampling) -> None:
        """Logit bias and grammar first: they decide which tokens may be sampled at all, greedy or not."""
        if s.logit_bias:
            bad = [t for t, _ in s.logit_bias if not 0 <= t < self.n_vocab]
            if bad:
                raise BackendError(f"logit_bias: token {bad[0]} is not in the vocabulary (0..{self.n_vocab - 1})")
            arr = (llama_cpp.llama_logit_bias * len(s.logit_bias))(
                *(llama_cpp.llama_logit_bias(token=tok, bias=bias) for tok, bias in s.logit_bias))
            llama_cpp.llama_sampler_chain_add(
                chain, llama_cpp.llama_sampler_init_logit_bias(self.n_vocab, len(s.logit_bias), arr))
        if s.grammar:
            g = llama_cpp.llama_sampler_init_grammar(self._vocab, s.grammar.encode(), b"root")
            if not g:  # llama.cpp logs why; NULL is all it returns
                raise BackendError("the grammar could not be parsed")
            llama_cpp.llama_sampler_chain_add(chain, g)

    def grammar_ok(self, grammar: str) -> bool:
        """Whether llama.cpp accepts this GBNF (checked before a request writes anything)."""
        return gbnf_ok(grammar, self._vocab)

    def json_grammar(self, schema: Mapping[str, Any] | None = None) -> str:
        return json_gbnf(schema, self._vocab)

    # -- memory ------------------------------------------------------------------------------------

    def truncate(self, n: int) -> int:
        """Forget positions >= n (their cells are freed). Returns the number of tokens dropped.

        A memory that cannot be cut back (``caps.truncate`` false) only truncates to 0 or to where it is:
        going back elsewhere is ``rewind`` from a saved point.
        """
        if n < 0 or n > self.n_past:
            raise BackendError(f"cannot truncate to {n}: context holds {self.n_past}")
        dropped = self.n_past - n
        if dropped and n and not self.can_truncate:
            raise BackendError(f"this model's memory ({self.memory_kind}) cannot be cut back to {n}: it is "
                              "rewound from a saved point instead")
        if dropped:
            self._detach()
            if not llama_cpp.llama_memory_seq_rm(self._mem, SEQ, n, -1):
                raise BackendError("llama.cpp could not remove the cells")
            del self.tokens[n:]
            self._drop_logits()
        return dropped

    def shift(self, keep: int, drop: int) -> None:
        """Drop positions [keep, keep+drop) and move the later cells down by ``drop``.

        llama.cpp applies the RoPE rotation to the moved K cells lazily, at the next decode: the state
        must not be saved before that decode.
        """
        if not self.can_shift:
            raise BackendError("this model's memory cannot be shifted")
        self._detach()
        if drop <= 0:
            return
        if keep + drop > self.n_past:
            raise BackendError("shift beyond the end of the context")
        llama_cpp.llama_memory_seq_rm(self._mem, SEQ, keep, keep + drop)
        llama_cpp.llama_memory_seq_add(self._mem, SEQ, keep + drop, -1, -drop)
        self._shift_pending = True
        del self.tokens[keep:keep + drop]
        # Logits of the last position do not change by moving cells (relative positions are the same).

    def clear(self) -> None:
        self._detach()
        # The cells' metadata only (``data=False``): zeroing the buffers cost 9 ms per 4k context of the
        # 135M model, before the first token of every new or restored conversation. What stays in a freed
        # cell is never read as data: attention masks it (as after ``llama_memory_seq_rm``, which a rollback
        # does), and a recurrent memory zeroes a cell's state when a sequence starts using it.
        llama_cpp.llama_memory_clear(self._mem, False)
        self.tokens = []
        self._drop_logits()

    def save_cells(self, p0: int, p1: int, *, point: bool = True) -> bytes | memoryview:
        """The KV cells of positions [p0, p1) of the conversation, in llama.cpp's sequence-state format
        (a read-only view of the buffer llama.cpp wrote them into: no copy).

        On a memory that cannot be cut back the save also holds the state that is not cells (recurrent)
        as it is now, so p1 must be where the sequence ends — unless ``point`` is False: the caller knows
        that part is stale (cells of old turns, loaded before newer records); on a whole-sequence memory p0
        must be 0 too.
        """
        if not 0 <= p0 <= p1 <= self.n_past:
            raise BackendError(f"bad cell range {p0}..{p1} (context holds {self.n_past})")
        if p0 == p1:
            return b""
        if not self.can_truncate and point and p1 != self.n_past:
            raise BackendError(f"this model's memory ({self.memory_kind}) can only be saved where it ends "
                              f"({self.n_past}), not at {p1}")
        if not self.ranges:
            if p0 != 0:
                raise BackendError(f"this model's memory ({self.memory_kind}) is saved whole, not from {p0}")
            return self._seq_state(SEQ)
        llama_cpp.llama_memory_seq_rm(self._mem, SCRATCH, -1, -1)
        llama_cpp.llama_memory_seq_cp(self._mem, SEQ, SCRATCH, p0, p1)
        try:
            return self._seq_state(SCRATCH)
        finally:
            llama_cpp.llama_memory_seq_rm(self._mem, SCRATCH, -1, -1)

    def _seq_state(self, seq: int) -> memoryview:
        # Not ``tobytes``: a copy of ~11 MB (a 465-token message) cost 5-7 ms between a reply's first two tokens.
        return _seq_data(self._ctx, seq, "save the cells").data.toreadonly()

    def _set_seq_state(self, data: bytes | bytearray | memoryview, seq: int) -> None:
        """Read a saved sequence state into ``seq`` (llama.cpp reads the caller's buffer in place)."""
        # A pointer to the caller's bytes, not a copy: numpy takes read-only buffers (bytes, a read-only
        # mmap) that ctypes' from_buffer refuses.
        view = np.frombuffer(data, dtype=np.uint8)
        src = None
        try:
            src = view.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            n = llama_cpp.llama_state_seq_set_data(self._ctx, src, view.size, seq)
        finally:
            del src, view  # release the buffer export, so a mapped file can be closed right after
        if n == 0:
            llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
            raise BackendError(f"llama.cpp rejected the saved cells: {_last_error() or 'format mismatch'}")

    def _check_span(self, seq: int, p0: int, p1: int) -> None:
        """The sequence's cells cover [p0, p1). Only the end is checked where the minimum means something
        else: a hybrid memory's is its recurrent state's position (the last one), and a sliding-window
        cache saves only the cells inside the window at the save's end (llama.cpp skips masked cells), so
        its minimum is the window's start. Records saved at every message end still cover every window a
        later rollback needs: each holds the window at its end, its predecessor the window before it."""
        lo = llama_cpp.llama_memory_seq_pos_min(self._mem, seq)
        hi = llama_cpp.llama_memory_seq_pos_max(self._mem, seq)
        if hi != p1 - 1 or (self.can_truncate and not self.n_swa and lo != p0):
            llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
            raise BackendError(f"saved cells cover {lo}..{hi + 1}, expected {p0}..{p1}")

    def load_cells(self, p0: int, p1: int, data: bytes | bytearray | memoryview, tokens: Sequence[int]) -> None:
        """Append saved cells of positions [p0, p1) (p0 must equal n_past) with their token ids.

        ``data`` may be any contiguous buffer, a view into a mapped state file included: llama.cpp reads it
        in place (its own copy into the KV cache is the only one).
        """
        check_load(self, p0, p1, tokens)
        self._detach()
        if p0 == p1:
            return
        if not self.ranges:
            # A whole-sequence state goes straight into the (empty) conversation sequence.
            if p0 != 0:
                raise BackendError(f"this model's memory ({self.memory_kind}) is restored whole, not from {p0}")
            self._set_seq_state(data, SEQ)
            self._check_span(SEQ, 0, p1)
        else:
            self._put_cells(p0, p1, data)
        self.tokens.extend(int(t) for t in tokens)
        self._drop_logits()

    def _put_cells(self, p0: int, p1: int, data: bytes | bytearray | memoryview) -> None:
        """Add saved cells [p0, p1) to the conversation's sequence, through the scratch sequence."""
        self._set_seq_state(data, SCRATCH)
        self._check_span(SCRATCH, p0, p1)
        # On a hybrid memory this also makes the record's recurrent state the sequence's own.
        llama_cpp.llama_memory_seq_cp(self._mem, SCRATCH, SEQ, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._mem, SCRATCH, -1, -1)

    def rewind(self, n: int, p0: int, data: bytes | memoryview) -> None:
        """Make the sequence end at ``n``, using the saved record [p0, n) that ended there.

        A truncatable memory just truncates. A whole-sequence memory loads the record (the sequence as it was
        at n). A hybrid memory keeps its own attention cells [0, n) and takes the record's recurrent state:
        the record goes to the scratch sequence, its recurrent state is copied over (llama.cpp copies a
        recurrent state whole, whatever the range; the range [n, n+1) holds no attention cell of the record,
        so none is copied), and then the attention tail can be removed because the recurrent state no
        longer lies in it. The cells [0, n) are the ones computed then: logits that follow are bit-identical.
        """
        if not 0 < n <= self.n_past:
            raise BackendError(f"cannot rewind to {n}: context holds {self.n_past}")
        if self.can_truncate:
            self.truncate(n)
            return
        kept = self.tokens[:n]
        if not self.ranges:
            self.clear()
            self.load_cells(0, n, data, kept)
            return
        self._set_seq_state(data, SCRATCH)
        try:
            self._check_span(SCRATCH, p0, n)
            llama_cpp.llama_memory_seq_cp(self._mem, SCRATCH, SEQ, n, n + 1)
            if not llama_cpp.llama_memory_seq_rm(self._mem, SEQ, n, -1):
                raise BackendError("llama.cpp could not rewind the sequence")
        finally:
            llama_cpp.llama_memory_seq_rm(self._mem, SCRATCH, -1, -1)
        if llama_cpp.llama_memory_seq_pos_max(self._mem, SEQ) != n - 1:
            raise BackendError("the rewound sequence does not end where it should")
        del self.tokens[n:]
        self._drop_logits()

    def seq_pos_max(self) -> int:
        return int(llama_cpp.llama_memory_seq_pos_max(self._mem, SEQ))

    # -- checkpoints: not this engine's granularity (it saves cells, see caps) ----------------------

    def flush(self, n: int | None = None) -> int:
        return 0  # every evaluation already happened

    def checkpoint(self, name: str, n: int | None = None) -> int:
        raise BackendError("the local engine saves cell ranges, not checkpoints")

    def restore_checkpoint(self, name: str, tokens: Sequence[int]) -> bool:
        raise BackendError("the local engine saves cell ranges, not checkpoints")


__all__ = [
    "KV_PARAMS", "KV_TYPES", "KV_TYPE_NAMES", "BackendError", "Capabilities", "ContextFullError", "Engine", "EvalStats",
    "GenerationResult", "Sampling", "TokenEvent",
]
