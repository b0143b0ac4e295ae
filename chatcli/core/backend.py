"""What the conversation core needs from an inference engine: the ``Backend`` protocol.

One Backend is one *sequence*: an ordered list of token ids whose KV cells the engine holds, and which
the conversation extends, truncates, shifts, saves and restores. The conversation never sees llama.cpp,
HTTP, or any other detail of how the engine computes.

Two granularities of persistence exist, declared by ``caps``:

- ``cells``: the engine can export and import any position range of its cells (the local llama.cpp
  backend: ``llama_state_seq_get/set_data`` through a scratch sequence). The conversation appends each
  turn's cells to its own state log and restores by reading them back.
- ``checkpoint``: the engine saves and restores its whole sequence under a name, on its own side (a remote
  llama-server: ``POST /slots/{id}?action=save|restore``). The conversation records which checkpoint holds
  which tokens; it never sees the bytes.

``logits``: the backend can hand out the next-token logits and take them back later (so regenerate
evaluates nothing). ``local_sampling``: tokens are sampled in this process (``generate`` is exact and
deterministic here); otherwise the engine samples server-side and only promises what it promises.

This module imports nothing heavy (no numpy, no llama_cpp): front ends and the store may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol, Sequence

from chatcli.errors import ChatcliError, DoesNotFitError, Kind

if TYPE_CHECKING:  # numpy only for type checking: importing this module must stay cheap
    import numpy as np
    import numpy.typing as npt

    Logits = npt.NDArray[np.float32]
else:
    Logits = Any


class BackendError(ChatcliError, RuntimeError):
    """The engine refused or failed an operation (model load, decode, restore, connection)."""

    kind: Kind = "engine"


class GrammarError(BackendError):
    """A grammar the backend cannot build: a JSON schema its converter does not handle, a GBNF its parser
    refuses, or no grammar sampler at all (``caps.grammar`` false). The caller's input, not a failure."""

    kind: Kind = "usage"


class ContextFullError(BackendError, DoesNotFitError):
    """The tokens to evaluate do not fit in the remaining context (the engine's own check; nothing evaluated)."""

    kind: Kind = "refused"


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one reply. ``temperature <= 0`` means greedy."""

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    repeat_penalty: float = 1.1
    repeat_last_n: int = 64
    # OpenAI-style extras (the server's request fields); the defaults change nothing.
    presence_penalty: float = 0.0  # subtracted once from every token seen in the penalty window
    frequency_penalty: float = 0.0  # subtracted per occurrence in the penalty window
    min_p: float = 0.0  # drop tokens below min_p × the top token's probability (0: off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    grammar: str = ""  # GBNF the reply must match (root rule "root"); "" = unconstrained


@dataclass(frozen=True)
class Capabilities:
    """What the engine's memory can do; the state log chooses what to save from it (see core/kv/log.py).

    Three kinds of local memory follow from ``truncate`` and ``ranges``:

    - attention (``truncate``, ``ranges``): cut back anywhere, cells saved by position range;
    - hybrid (``ranges`` only: attention + a recurrent state that holds no history, Qwen3.5, Granite-4-H,
      LFM2...): cells saved by range, each save also carrying the recurrent state at its end, so every
      saved record's end is a point the sequence can be rewound to (``rewind``), and only those;
    - whole (neither: pure recurrent Mamba/RWKV, or a memory that copies only whole sequences, DeepSeek-V4's
      compressed cache): each save is the whole sequence state at a point; rewinding loads one.
    """

    cells: bool  # export/import of cells (save_cells / load_cells), by range where ``ranges``
    checkpoint: bool  # whole-sequence save/restore under a name (checkpoint / restore_checkpoint)
    logits: bool  # logits() / set_logits(): regenerate without evaluating anything
    local_sampling: bool  # sampling happens in this process (bit-exact determinism is ours to keep)
    shift: bool  # positions can be moved down without re-evaluating (context shift)
    truncate: bool = True  # the sequence can be cut back to any position (llama_memory_seq_rm of a tail)
    ranges: bool = True  # cells of a position range can be saved alone (else only the whole sequence)
    # What the probe found, for people: attention | hybrid | recurrent | whole (a llama-server, seen from
    # outside: attention | recurrent or hybrid | sliding window).
    memory: str = "attention"
    # A restored checkpoint's tokens are reused by a sequence that extends it (not by a llama-server whose
    # model has a sliding-window cache: nothing of a restored slot is reused there).
    restore_reuse: bool = True
    # Sampling can be constrained by a GBNF grammar (``Sampling.grammar``; ``Backend.json_grammar`` builds one).
    grammar: bool = False


@dataclass
class TokenEvent:
    """One sampled token, as it streams out of ``Backend.generate``."""

    token: int
    piece: bytes
    is_eog: bool
    t_since_start: float


@dataclass
class GenerationResult:
    """How a generation ended; filled in by ``Backend.generate`` as it goes."""

    tokens: list[int] = field(default_factory=list)
    stop_reason: str = ""  # "eog" | "length" | "cancelled" | "stop" | "context"
    ttft: float = 0.0
    seconds: float = 0.0
    n_decoded: int = 0
    # Sampled tokens the context does not hold (``generate(defer_last=True)``): the reply's last, which the
    # caller evaluates later (a server: with the next prompt). Not in ``Backend.tokens``.
    undecoded: list[int] = field(default_factory=list)
    # When the first and the last token were handed out (seconds since the generation started; -1: none
    # yet): the span a decoding rate is counted over (``TurnStats.tokens_per_second``).
    first_shown: float = -1.0
    last_shown: float = -1.0
    # Engines that evaluate prompts lazily (a remote server) report what the prompt cost them here.
    n_prompt_evaluated: int | None = None
    n_prompt_cached: int | None = None

    def shown(self, at: float) -> float:
        """A token handed out ``at`` seconds after the start; returns ``at``."""
        if self.first_shown < 0:
            self.first_shown = at
        self.last_shown = at
        return at


class Backend(Protocol):
    """One sequence of an inference engine. ``tokens`` always equals what the engine's KV holds (but for
    cells ``forget`` left past its end, which the next evaluation takes up or drops)."""

    n_ctx: int  # positions available to this sequence
    n_vocab: int
    n_batch: int
    tokens: list[int]

    @property
    def caps(self) -> Capabilities: ...  # a plain attribute satisfies this too

    @property
    def n_past(self) -> int: ...

    @property
    def n_evaluated_total(self) -> int:
        """Tokens run through the model for this sequence since it was made: prompts, rebuilds and sampled
        tokens (a remote engine: what its server reported, known once the request that carried them ends).
        The difference over an operation is what it evaluated: how a restore proves it evaluated nothing."""
        ...

    def identity(self) -> dict[str, Any]:
        """What saved state must match to be loaded here (model identity, context size, KV format)."""
        ...

    # -- vocabulary --
    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]: ...
    def piece(self, token: int, *, special: bool = True) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    @property
    def bos_token(self) -> int: ...
    @property
    def eos_token(self) -> int: ...
    @property
    def add_bos(self) -> bool: ...

    # -- evaluation and sampling --
    def eval_steps(self, tokens: Sequence[int]) -> Iterator[tuple[int, int]]:
        """Append ``tokens``, yielding (done, total) per batch. Raises ContextFullError if they don't fit."""
        ...

    def generate(
        self, sampling: Sampling, *, seed: int, max_tokens: int, result: GenerationResult | None = None,
        stop_strings: Sequence[str] = (), defer_last: bool = False,
    ) -> Iterator[TokenEvent]:
        """Sample a reply; each token joins ``tokens`` before the next is yielded. Closing early keeps it.
        ``defer_last``: the reply's last token may be left out of the context, in ``result.undecoded``
        (a backend that cannot, or that evaluates lazily anyway, decodes it as any other)."""
        ...

    def json_grammar(self, schema: Mapping[str, Any] | None = None) -> str:
        """The GBNF (``Sampling.grammar``) of a reply that is JSON: an object when ``schema`` is None, else a
        value matching that JSON schema. Checked by the grammar sampler that will use it; raises
        ``GrammarError`` when it cannot be built, always when ``caps.grammar`` is false."""
        ...

    def cancel(self) -> None: ...
    def reset_cancel(self) -> None: ...

    # -- memory --
    def truncate(self, n: int) -> int:
        """Forget positions >= n. Only where ``caps.truncate`` (else only to 0 or to ``n_past``)."""
        ...

    def rewind(self, n: int, p0: int, data: bytes | memoryview) -> None:
        """Make the sequence end at ``n`` with the state saved in the cells record [p0, n) that ended there
        (``save_cells(p0, n)`` when the sequence was at n). On a truncatable memory this is ``truncate``."""
        ...

    def shift(self, keep: int, drop: int) -> None:
        """Drop positions [keep, keep+drop) and move the rest down (only when ``caps.shift``)."""
        ...

    def clear(self) -> None: ...

    def forget(self) -> None:
        """Empty the sequence as ``clear`` does; a local engine whose memory can be cut back leaves the cells,
        for the next evaluation (``eval_steps``) to take up as far as its tokens are the same (``kept``).
        The caller vouches that the cells were computed where they are."""
        ...

    def kept(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` their evaluation would take up from the cells ``forget`` left (0 when none
        are left); the last two are always evaluated."""
        ...

    def take_kept(self, tokens: Sequence[int]) -> bool:
        """Append ``tokens`` from the cells ``forget`` left, when they hold all of them (no logits then);
        False, changing nothing, when they do not."""
        ...

    # -- logits (caps.logits) --
    @property
    def has_logits(self) -> bool: ...
    def logits(self) -> Logits: ...
    def set_logits(self, logits: Logits) -> None: ...
    def ensure_logits(self) -> int: ...

    # -- cells (caps.cells) --
    def save_cells(self, p0: int, p1: int, *, point: bool = True) -> bytes | memoryview: ...
    def load_cells(self, p0: int, p1: int, data: bytes | memoryview, tokens: Sequence[int]) -> None: ...

    def flush(self, n: int | None = None) -> int:
        """Evaluate now what the engine holds back (its first ``n`` tokens): a server evaluates lazily, and
        cuts a slot back only when a request asks. Returns the tokens it evaluated (0 for a local engine)."""
        ...

    # -- checkpoints (caps.checkpoint) --
    def checkpoint(self, name: str, n: int | None = None) -> int:
        """Save the sequence (its first ``n`` tokens: the engine must not hold more of it yet) under ``name``
        on the engine's side; returns bytes written (0 if unknown)."""
        ...

    def restore_checkpoint(self, name: str, tokens: Sequence[int]) -> bool:
        """Restore ``name`` if it holds exactly ``tokens``; False when it is missing or does not match."""
        ...

    def take_notices(self) -> list[str]:
        """What the user should hear about from inside the engine since the last call (e.g. a server
        without persistence); the conversation passes them on as warnings."""
        ...

    def close(self) -> None: ...
