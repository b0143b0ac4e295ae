"""A measured process for ``bench/decode.py``: chatcli's Engine (or a bare llama.cpp loop) that stays up for
the whole run and answers one request per round, each a JSON line on stdin, each answer a ``BENCH_RESULT``
JSON line on stdout.

    python -m bench.decode_worker '{"model_path": ..., "n_ctx": 4096, "threads": 0, "bare": false}'
    (a bare loop may add "flash_attn": true)
    stdin: {"prefix": [token ids], "prompt": [token ids], "decode": 96}

A request is the work ``chatcli talk`` does for one message: the prefix (the persona's tokens) in the context,
untimed; the prompt (the message's tokens) evaluated at that depth and timed; then ``decode`` tokens decoded
greedily from there and timed. The context is cut back to the prefix before the next request.

The waiting policy under test is whatever the parent put in this process's environment (``OMP_WAIT_POLICY``,
``GOMP_SPINCOUNT``): libgomp reads it once, when llama.cpp's CPU backend is loaded at ``import llama_cpp``,
so it has to be a property of the whole process, not something one process can switch between runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.common import emit

# (prefix, prompt, tokens to decode, seconds after which decoding stops early or None): the round's result.
Runner = Callable[[list[int], list[int], int, float | None], dict[str, Any]]


def engine_runner(a: dict[str, Any]) -> Runner:
    from chatcli.backends.llamacpp import Engine, Sampling

    eng = Engine(a["model_path"], n_ctx=a["n_ctx"], n_threads=a["threads"] or None)
    greedy = Sampling(temperature=0.0, repeat_penalty=1.0)

    def run(prefix: list[int], prompt: list[int], n: int, cap: float | None) -> dict[str, Any]:
        if eng.tokens[: len(prefix)] == prefix and eng.n_past >= len(prefix):
            eng.truncate(len(prefix))
        else:
            eng.clear()
            eng.eval(prefix)
        st = eng.eval(prompt)
        t0 = time.perf_counter()
        got = 0
        for _ in eng.generate(greedy, seed=1, max_tokens=n):
            got += 1
            if cap is not None and time.perf_counter() - t0 > cap:
                break  # the generator, once closed, decodes the token it yielded (after the clock stopped)
        tg = got / (time.perf_counter() - t0)
        # The count the last decode ran with: the default policy's answer to the load at that moment.
        return {"prompt_tps": len(prompt) / st.seconds, "decode_tps": tg, "tokens": got,
                "threads_used": eng._applied_threads}

    return run


def bare_runner(a: dict[str, Any]) -> Runner:
    """The same work as a bare llama-cpp-python loop (the secondary row: same process kind, no chatcli)."""
    import llama_cpp

    from bench.workers import _bare_context

    _model, ctx, batch = _bare_context(a["model_path"], a["n_ctx"], a["threads"], 512, bool(a.get("flash_attn")))
    mem = llama_cpp.llama_get_memory(ctx)
    sampler = llama_cpp.llama_sampler_init_greedy()
    held: list[int] = []

    def decode(tokens: list[int], start: int) -> None:
        for off in range(0, len(tokens), 512):
            part = tokens[off:off + 512]
            batch.n_tokens = len(part)
            for i, t in enumerate(part):
                batch.token[i] = t
                batch.pos[i] = start + off + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(part) - 1
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

    def run(prefix: list[int], prompt: list[int], n: int, cap: float | None) -> dict[str, Any]:
        if held[: len(prefix)] == prefix and len(held) >= len(prefix):
            llama_cpp.llama_memory_seq_rm(mem, 0, len(prefix), -1)
        else:
            llama_cpp.llama_memory_clear(mem, True)
            decode(prefix, 0)
        held[:] = prefix
        t0 = time.perf_counter()
        decode(prompt, len(prefix))
        pp = len(prompt) / (time.perf_counter() - t0)
        pos = len(prefix) + len(prompt)
        t0 = time.perf_counter()
        got = 0
        while got < n and (cap is None or time.perf_counter() - t0 <= cap):
            tok = llama_cpp.llama_sampler_sample(sampler, ctx, -1)
            decode([tok], pos)
            pos += 1
            got += 1
        return {"prompt_tps": pp, "decode_tps": got / (time.perf_counter() - t0), "tokens": got}

    return run


def main() -> int:
    a = json.loads(sys.argv[1])
    run = bare_runner(a) if a.get("bare") else engine_runner(a)
    omp = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    emit({"ready": True, "omp": omp})
    for line in sys.stdin:
        req = json.loads(line)
        emit(run(req["prefix"], req["prompt"], int(req["decode"]), req.get("cap")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
