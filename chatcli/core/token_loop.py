"""The token loop of ``Backend.generate`` for a backend that samples locally: sample, show, decode, until a stop;
and the rules its logits and cells follow (``checked_logits``, ``ensure_logits``, ``check_load``, ``eval_batches``).

The local engine and the tests' fake backend run this one loop and these rules, so the fake keeps the
engine's contract (when a reply stops and why, what joins the context when the consumer goes away, which
saved logits are refused, how missing ones are made: a truncation the memory may refuse) by construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from chatcli.core.backend import Backend, BackendError, ContextFullError, GenerationResult, Logits, TokenEvent


def checked_logits(logits: Logits, n_vocab: int) -> Logits:
    """What ``set_logits`` keeps: a float32 copy of saved logits, refused unless one per vocabulary token."""
    arr = np.asarray(logits, dtype=np.float32)
    if arr.shape != (n_vocab,):
        raise BackendError("saved logits do not match the vocabulary")
    return arr.copy()


def eval_batches(backend: Backend, tokens: Sequence[int],
                 decode: Callable[[list[int], bool], None]) -> Iterator[tuple[int, int]]:
    """``Backend.eval_steps`` of a local backend: refused whole (``ContextFullError``, nothing evaluated)
    when the tokens do not fit, else ``decode(batch, last)`` per ``n_batch`` tokens from the first (``last``:
    the final batch, whose last token's logits are wanted), yielding (done, total) after each."""
    tokens = list(tokens)
    if backend.n_past + len(tokens) > backend.n_ctx:
        raise ContextFullError(f"{len(tokens)} tokens do not fit: {backend.n_past}/{backend.n_ctx} in use")
    done = 0
    while done < len(tokens):
        part = tokens[done:done + backend.n_batch]
        decode(part, done + len(part) == len(tokens))
        done += len(part)
        yield done, len(tokens)


def check_load(backend: Backend, p0: int, p1: int, tokens: Sequence[int]) -> None:
    """What ``load_cells`` refuses before it touches anything: cells that do not start where the context
    ends, token ids that are not one per cell, a range past the context."""
    if p0 != backend.n_past:
        raise BackendError(f"cells start at {p0} but the context holds {backend.n_past}")
    if len(tokens) != p1 - p0:
        raise BackendError("token ids do not match the cell range")
    if p1 > backend.n_ctx:
        raise ContextFullError(f"saved state of {p1} tokens does not fit in n_ctx={backend.n_ctx}")


def ensure_logits(backend: Backend) -> int:
    """``Backend.ensure_logits`` of a backend that holds the logits of its last position only: without them the
    last token is cut off and evaluated again (refused by a memory that cannot be cut back, as its
    ``truncate`` refuses). Returns the tokens re-evaluated (0 or 1)."""
    if backend.has_logits:
        return 0
    if not backend.tokens:
        raise BackendError("empty context has no logits")
    last = backend.tokens[-1]
    backend.truncate(backend.n_past - 1)
    for _ in backend.eval_steps([last]):
        pass  # one token, one batch: nothing to report
    return 1


def token_loop(
    res: GenerationResult, *, sample: Callable[[], int], decode: Callable[[int, bool], None],
    is_eog: Callable[[int], bool], piece: Callable[[int], bytes], room: Callable[[], int],
    cancelled: Callable[[], bool], max_tokens: int, stop_strings: Sequence[str] = (), defer_last: bool = False,
) -> Iterator[TokenEvent]:
    """Sample tokens into ``res`` until the end of generation, ``max_tokens``, no ``room()`` left in the
    context, ``cancelled()`` or one of ``stop_strings`` in the text (``res.stop_reason`` says which).

    Args:
        res: filled in as it goes (tokens, stop reason, time to first token, seconds, tokens decoded).
        sample: the next token, from the current logits.
        decode: ``decode(token, logits)`` puts the token into the context; ``logits``: whether the next
            position's logits are needed (not after the end-of-generation token).
        is_eog: whether a token ends the generation.
        piece: a token's text (not shown for the end-of-generation token).
        room: positions left in the context.
        cancelled: asked before each token (a Ctrl-C, a client gone).
        max_tokens: the longest reply.
        stop_strings: texts that end the reply once they appear in it.
        defer_last: the reply's last token is not decoded but left in ``res.undecoded`` for the caller (a
            server evaluates it with the next prompt, as llama-server does): the one known to be the last
            before its decode (the end of generation, ``max_tokens`` reached, no room for another, a stop
            string in the text, ``cancelled()`` after it was handed out) and the one a consumer closed the
            loop after.

    Each token is yielded before it is decoded, and decoded before the next is sampled, so the context
    always holds the reply so far; a consumer that closes the loop right after a token still gets that token
    into the context (it saw it), with "cancelled" when nothing else had stopped the reply.
    """
    t0 = time.perf_counter()
    text = b""
    pending: int | None = None
    try:
        while True:
            if cancelled():
                res.stop_reason = "cancelled"
                break
            if len(res.tokens) >= max_tokens:
                res.stop_reason = "length"
                break
            if room() < 1:
                res.stop_reason = "context"
                break
            tok = sample()
            if not res.tokens:
                res.ttft = time.perf_counter() - t0
            res.tokens.append(tok)
            pending = tok
            eog = is_eog(tok)
            shown = b"" if eog else piece(tok)
            text += shown
            stop = "eog" if eog else ""
            if not stop and stop_strings:
                decoded = text.decode("utf-8", errors="ignore")
                if any(s in decoded for s in stop_strings):
                    stop = "stop"
            if defer_last and not stop:
                # Known before the decode: the next round would stop here without sampling.
                if len(res.tokens) >= max_tokens:
                    stop = "length"
                elif room() <= 1:
                    stop = "context"
            if defer_last and stop:
                res.stop_reason = stop  # set before the consumer sees the token: its decode is left out
            yield TokenEvent(tok, shown, eog, res.shown(time.perf_counter() - t0))
            if defer_last and not stop and cancelled():
                stop = res.stop_reason = "cancelled"  # seen, and nothing follows: not decoded either
            if defer_last and stop:
                break  # left for the caller: ``finally`` hands it over
            decode(tok, not eog)
            pending = None
            if stop:
                res.stop_reason = stop
                break
    finally:
        if pending is not None:
            if defer_last:
                # The reply's last token (or the one a consumer closed the loop after: it saw it): the caller
                # evaluates it.
                res.undecoded = [pending]
            else:
                # Closed between yield and decode: the consumer saw this token, so it joins the context.
                decode(pending, True)
            res.stop_reason = res.stop_reason or "cancelled"
        res.seconds = time.perf_counter() - t0
        res.n_decoded = len(res.tokens) - len(res.undecoded)


__all__ = ["token_loop"]
