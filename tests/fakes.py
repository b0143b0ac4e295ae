"""A fake backend for policy tests: a real ``chatcli.core.backend.Backend`` that runs no model.

Tokens are bytes (0..255) plus two specials spelled as ChatML's markers, so the packaged ChatML fallback
template renders as it would on SmolLM2 (``<|im_end|>`` is one token and ends a reply). ``generate`` plays
back queued replies, like llm's ``MockModel``; with nothing queued it answers ``"reply <seed>"`` so that two
seeds give two different alternatives. The "KV" is a list of what each cell was computed from, kept apart
from ``tokens``: saved cells carry their tokens, and loading cells that do not match their token ids is an
error, so a state log that restores the wrong cells fails here instead of replying differently.

The memory's abilities are data (``caps``, a constructor argument): pass ``replace(ALL_CAPS, shift=False)``
to run the same policy over a memory that cannot shift, ``HYBRID_CAPS`` / ``WHOLE_CAPS`` for memories that
cannot be cut back (rewound to saved records), ``CHECKPOINT_CAPS`` for a llama-server-like one.
A new ``Capabilities`` field is added in ``ALL_CAPS`` (and where the fake honours it), nowhere else.

Conversation policy (rollback, shift, alternatives, forks, undo/redo, edit) is tested on it in
milliseconds; bit-exactness is proven on the real engine (tests/test_engine.py, tests/test_persistence.py).
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from chatcli.core.backend import (
    BackendError,
    Capabilities,
    GenerationResult,
    GrammarError,
    Logits,
    Sampling,
    TokenEvent,
)
from chatcli.core.conversation import Conversation
from chatcli.core.files.store import ConversationStore
from chatcli.core.loading import create_conversation, open_conversation
from chatcli.core.steps import drain
from chatcli.core.template import ChatTemplate, Message
from chatcli.core.token_loop import check_load, checked_logits, ensure_logits, eval_batches, token_loop

EOS = 256  # "<|im_end|>": ends a reply, as on SmolLM2
BOS = 257  # "<|im_start|>"
SPECIALS = {EOS: b"<|im_end|>", BOS: b"<|im_start|>"}
N_VOCAB = 258

ALL_CAPS = Capabilities(cells=True, checkpoint=False, logits=True, local_sampling=True, shift=True, truncate=True,
                        ranges=True, memory="attention", restore_reuse=True)
# The local memories the engine's probe finds (backends/llamacpp.py), and a llama-server's slot files.
HYBRID_CAPS = replace(ALL_CAPS, shift=False, truncate=False, memory="hybrid")  # ranges, rewound to a record's end
WHOLE_CAPS = replace(ALL_CAPS, shift=False, truncate=False, ranges=False, memory="whole")  # the whole sequence only
CHECKPOINT_CAPS = replace(ALL_CAPS, cells=False, checkpoint=True, logits=False, local_sampling=False, shift=False)

_CELLS_MAGIC = b"FKV1"


def text_tokens(text: str) -> list[int]:
    """Token ids of ``text`` as the fake tokenizes it with specials parsed."""
    out: list[int] = []
    data = text.encode("utf-8")
    i = 0
    while i < len(data):
        for tok, spelled in SPECIALS.items():
            if data.startswith(spelled, i):
                out.append(tok)
                i += len(spelled)
                break
        else:
            out.append(data[i])
            i += 1
    return out


def logits_for(tokens: Sequence[int]) -> Logits:
    """The fake's logits after ``tokens``: a function of the whole token list, so saved logits that belong to
    another position (a rollback installing the wrong ones) differ from what evaluating would give."""
    seed = int.from_bytes(hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).digest()[:8], "little")
    return np.random.default_rng(seed).standard_normal(N_VOCAB).astype(np.float32)


class FakeBackend:
    """One sequence of a pretend engine (see the module docstring). Counters let tests assert the cost:
    ``n_evaluated_total`` (tokens evaluated, sampled ones included), ``loads`` (cell ranges loaded)."""

    def __init__(self, *, n_ctx: int = 512, n_batch: int = 64, caps: Capabilities = ALL_CAPS,
                 replies: Iterable[str] = (), cell_bytes: int = 1024) -> None:
        self.n_ctx = n_ctx
        # Bytes per saved cell: a real KV cell outweighs a position's logits record, as the state log's
        # compaction rule (dead bytes > live bytes) expects; with 4-byte cells it would compact every undo.
        self.cell_words = max(1, cell_bytes // 4)
        self.n_vocab = N_VOCAB
        self.n_batch = n_batch
        self.caps = caps
        self.tokens: list[int] = []
        self.kv: list[int] = []  # what each cell was computed from (must always equal ``tokens``)
        self.replies: deque[str] = deque(replies)
        self.n_evaluated_total = 0
        self.loads = 0
        self.checkpoints: dict[str, list[int]] = {}
        self.notices: list[str] = []
        self._logits: Logits | None = None
        self._cancel = False
        self.closed = False

    # -- the test's side -----------------------------------------------------------------------------

    def queue(self, *texts: str) -> None:
        """Replies for the next generations, in order."""
        self.replies.extend(texts)

    # -- Backend -------------------------------------------------------------------------------------

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def identity(self) -> dict[str, Any]:
        return {"n_ctx": self.n_ctx, "kv": "fake"}

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        toks = text_tokens(text) if parse_special else list(text.encode("utf-8"))
        return [BOS, *toks] if add_special and self.add_bos else toks

    def piece(self, token: int, *, special: bool = True) -> bytes:
        if token in SPECIALS:
            return SPECIALS[token] if special else b""
        if not 0 <= token < 256:
            raise BackendError(f"token {token} is not in the fake vocabulary")
        return bytes([token])

    def is_eog(self, token: int) -> bool:
        return token == EOS

    @property
    def bos_token(self) -> int:
        return BOS

    @property
    def eos_token(self) -> int:
        return EOS

    @property
    def add_bos(self) -> bool:
        return False

    def eval_steps(self, tokens: Sequence[int]) -> Iterator[tuple[int, int]]:
        return eval_batches(self, tokens, lambda part, last: self._decode(part))

    def _decode(self, part: Sequence[int]) -> None:
        self.tokens.extend(part)
        self.kv.extend(part)
        self.n_evaluated_total += len(part)
        self._logits = logits_for(self.tokens)

    def generate(self, sampling: Sampling, *, seed: int, max_tokens: int, result: GenerationResult | None = None,
                 stop_strings: Sequence[str] = (), defer_last: bool = False) -> Iterator[TokenEvent]:
        res = result if result is not None else GenerationResult()
        if not self.has_logits:
            self.ensure_logits()
        text = self.replies.popleft() if self.replies else f"reply {seed}"
        planned = iter([*text_tokens(text), EOS])
        try:
            yield from token_loop(
                res, sample=lambda: next(planned), decode=lambda tok, logits: self._decode([tok]),
                is_eog=self.is_eog, piece=lambda tok: self.piece(tok, special=False),
                room=lambda: self.n_ctx - self.n_past, cancelled=lambda: self._cancel,
                max_tokens=max_tokens, stop_strings=stop_strings, defer_last=defer_last)
        finally:
            self._cancel = False

    def json_grammar(self, schema: Mapping[str, Any] | None = None) -> str:
        raise GrammarError("the fake backend has no grammar sampler")

    def cancel(self) -> None:
        self._cancel = True

    def reset_cancel(self) -> None:
        self._cancel = False

    def truncate(self, n: int) -> int:
        if not 0 <= n <= self.n_past:
            raise BackendError(f"cannot truncate to {n}: context holds {self.n_past}")
        dropped = self.n_past - n
        if dropped and n and not self.caps.truncate:
            raise BackendError(f"this memory ({self.caps.memory}) cannot be cut back to {n}")
        if dropped:
            del self.tokens[n:]
            del self.kv[n:]
            self._logits = None
        return dropped

    def rewind(self, n: int, p0: int, data: bytes | memoryview) -> None:
        """End at ``n`` with the state of the saved record [p0, n) (see ``Backend.rewind``)."""
        if not 0 < n <= self.n_past:
            raise BackendError(f"cannot rewind to {n}: context holds {self.n_past}")
        if self.caps.truncate:
            self.truncate(n)
            return
        kept = self.tokens[:n]
        if not self.caps.ranges:
            self.clear()
            self.load_cells(0, n, data, kept)
            return
        # Hybrid: the attention cells [0, n) stay, the record brings the recurrent state it ended with.
        self._check_cells(p0, n, data, kept[p0:])
        del self.tokens[n:]
        del self.kv[n:]
        self._logits = None
        self.loads += 1

    def shift(self, keep: int, drop: int) -> None:
        if not self.caps.shift:
            raise BackendError("this memory cannot be shifted")
        if drop <= 0:
            return
        if keep + drop > self.n_past:
            raise BackendError("shift beyond the end of the context")
        del self.tokens[keep:keep + drop]
        del self.kv[keep:keep + drop]

    def clear(self) -> None:
        self.tokens = []
        self.kv = []
        self._logits = None

    def forget(self) -> None:
        self.clear()  # keeps nothing: the real engine's taking up of kept cells is tested on llama.cpp

    def kept(self, tokens: Sequence[int]) -> int:
        return 0

    def take_kept(self, tokens: Sequence[int]) -> bool:
        return False

    @property
    def has_logits(self) -> bool:
        return self._logits is not None

    def logits(self) -> Logits:
        if self._logits is None:
            raise BackendError("no logits for the current position")
        return self._logits.copy()

    def set_logits(self, logits: Logits) -> None:
        self._logits = checked_logits(logits, N_VOCAB)

    def ensure_logits(self) -> int:
        return ensure_logits(self)

    def save_cells(self, p0: int, p1: int, *, point: bool = True) -> bytes:
        if not self.caps.cells:
            raise BackendError("this memory saves no cell ranges")
        if not 0 <= p0 <= p1 <= self.n_past:
            raise BackendError(f"bad cell range {p0}..{p1} (context holds {self.n_past})")
        if p0 == p1:
            return b""
        # The recurrent part is as it is now (``point`` False: the caller knows it is stale, as the engine's).
        if not self.caps.truncate and point and p1 != self.n_past:
            raise BackendError(f"this memory ({self.caps.memory}) can only be saved where it ends, not at {p1}")
        if not self.caps.ranges and p0 != 0:
            raise BackendError(f"this memory ({self.caps.memory}) is saved whole, not from {p0}")
        cells = [t for t in self.kv[p0:p1] for _ in range(self.cell_words)]
        return _CELLS_MAGIC + struct.pack(f"<ii{len(cells)}i", p0, p1, *cells)

    def load_cells(self, p0: int, p1: int, data: bytes | memoryview, tokens: Sequence[int]) -> None:
        if not self.caps.cells:
            raise BackendError("this memory loads no cell ranges")
        check_load(self, p0, p1, tokens)
        if p0 == p1:
            return
        if not self.caps.ranges and p0 != 0:
            raise BackendError(f"this memory ({self.caps.memory}) is restored whole, not from {p0}")
        cells = self._check_cells(p0, p1, data, tokens)
        self.tokens.extend(int(t) for t in tokens)
        self.kv.extend(cells)
        self._logits = None
        self.loads += 1

    def _check_cells(self, p0: int, p1: int, data: bytes | memoryview, tokens: Sequence[int]) -> list[int]:
        raw = bytes(data)
        n_words = (p1 - p0) * self.cell_words
        if not raw.startswith(_CELLS_MAGIC) or len(raw) != len(_CELLS_MAGIC) + 4 * (2 + n_words):
            raise BackendError("not fake cells")
        lo, hi, *words = struct.unpack(f"<ii{n_words}i", raw[len(_CELLS_MAGIC):])
        cells: list[int] = words[::self.cell_words]
        if (lo, hi) != (p0, p1) or cells != [int(t) for t in tokens]:
            raise BackendError(f"saved cells {lo}..{hi} do not hold the tokens {p0}..{p1}")
        return cells

    def flush(self, n: int | None = None) -> int:
        return 0  # every evaluation already happened

    def checkpoint(self, name: str, n: int | None = None) -> int:
        if not self.caps.checkpoint:
            raise BackendError("this memory saves cell ranges, not checkpoints")
        if n is not None and n != self.n_past:
            raise BackendError(f"a checkpoint is of the whole sequence ({self.n_past}), not of {n}")
        self.checkpoints[name] = list(self.kv)
        return 4 * len(self.kv)

    def restore_checkpoint(self, name: str, tokens: Sequence[int]) -> bool:
        if not self.caps.checkpoint:
            raise BackendError("this memory saves cell ranges, not checkpoints")
        saved = self.checkpoints.get(name)
        if saved is None or saved != list(tokens):
            return False
        self.tokens = list(saved)
        self.kv = list(saved)
        self._logits = None
        self.loads += 1
        return True

    def take_notices(self) -> list[str]:
        out, self.notices = self.notices, []
        return out

    def close(self) -> None:
        self.closed = True


# -- conversations over the fake, without a Session (no model, no settings) -----------------------------

PERSONA = [Message("system", "You are terse.")]
IDENTITY = {"name": "fake-model", "fingerprint": "fake"}


def new_conversation(backend: FakeBackend, store_dir: Path, *, seed: int = 7, max_tokens: int = 64,
                     reserve: int = 16, persona: Sequence[Message] = PERSONA) -> Conversation:
    """A conversation created on ``backend`` in a store at ``store_dir`` (ChatML, persona ``PERSONA``)."""
    return create_conversation(
        ConversationStore(store_dir), backend, ChatTemplate(None), persona_name="fake",
        persona_messages=list(persona), persona_hash="fake-persona", identity=IDENTITY, model_path="fake.gguf",
        sampling=Sampling(temperature=0.0), seed=seed, max_tokens=max_tokens, reserve=reserve).conversation


def open_again(backend: FakeBackend, store_dir: Path, conv_id: str, *, max_tokens: int = 64,
               reserve: int = 16) -> tuple[Conversation, Any]:
    """Open ``conv_id`` on ``backend`` as a new process would (after ``backend.clear()``); (conversation, report)."""
    opening = open_conversation(
        ConversationStore(store_dir), conv_id, backend, ChatTemplate(None), identity=IDENTITY,
        sampling=Sampling(temperature=0.0), max_tokens=max_tokens, reserve=reserve, persona_messages=list(PERSONA))
    return opening.conversation, opening.report


def say(conv: Conversation, text: str, *, reply: str | None = None) -> str:
    """Send ``text`` (the fake answers ``reply`` when given); returns the reply's text."""
    if reply is not None:
        assert isinstance(conv.backend, FakeBackend)
        conv.backend.queue(reply)
    drain(conv.send(text))
    return conv.messages[-1].text
