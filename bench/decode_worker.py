"""One measured process for ``bench/decode.py``: chatcli's Engine (or a bare llama.cpp loop) evaluating a
prompt and decoding a reply, reporting tokens/s as one ``BENCH_RESULT`` JSON line.

    python -m bench.decode_worker '{"model_path": ..., "threads": 2, "prompt_tokens": 256, ...}'

The waiting policy under test is whatever the parent put in this process's environment (``OMP_WAIT_POLICY``,
``GOMP_SPINCOUNT``): libgomp reads it once, when llama.cpp's CPU backend is loaded at ``import llama_cpp``,
so it has to be a property of the whole process, not something one process can switch between runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from bench.common import PARAGRAPHS, emit

COUNT_PROMPT = ("<|im_start|>user\nCount from 1 to 1000, separated by commas.<|im_end|>\n"
                "<|im_start|>assistant\n1, 2, 3, 4, 5,")


def filler(prompt: list[int], a: dict[str, Any], n_count: int) -> list[int]:
    """The tokens before the counting prompt, so that decoding starts ``decode_depth`` tokens deep, where the
    streamed rows decode (the cost of a decode grows with the context it attends over)."""
    want = max(0, int(a.get("decode_depth", 0)) - n_count)
    return (prompt * (want // max(1, len(prompt)) + 1))[:want]


def engine_run(a: dict[str, Any]) -> dict[str, Any]:
    from chatcli.backends.llamacpp import Engine, Sampling

    eng = Engine(a["model_path"], n_ctx=a["n_ctx"], n_threads=a["threads"] or None)
    text = " ".join(PARAGRAPHS) * 20
    prompt = eng.tokenize(text)[: a["prompt_tokens"]]
    count = eng.tokenize(COUNT_PROMPT)
    greedy = Sampling(temperature=0.0, repeat_penalty=1.0)
    pp: list[float] = []
    tg: list[float] = []
    for _ in range(a["reps"]):
        eng.clear()
        st = eng.eval(prompt)
        pp.append(len(prompt) / st.seconds)
        eng.clear()
        eng.eval(filler(prompt, a, len(count)) + count)
        t0 = time.perf_counter()
        n = sum(1 for _ in eng.generate(greedy, seed=1, max_tokens=a["decode_tokens"]))
        tg.append(n / (time.perf_counter() - t0))
    # The count the last decode ran with: the default policy's answer to the load at the end of the run.
    return {"prompt_tps": pp, "decode_tps": tg, "threads": eng.n_threads, "threads_used": eng._applied_threads,
            "omp": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}}


def bare_run(a: dict[str, Any]) -> dict[str, Any]:
    """The same work as a bare llama-cpp-python loop (the secondary row: same process kind, no chatcli)."""
    import llama_cpp

    from bench.workers import _bare_context

    model, ctx, batch = _bare_context(a["model_path"], a["n_ctx"], a["threads"], 512)
    mem = llama_cpp.llama_get_memory(ctx)
    vocab = llama_cpp.llama_model_get_vocab(model)

    def tokenize(s: str) -> list[int]:
        data = s.encode()
        buf = (llama_cpp.llama_token * (len(data) + 16))()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, len(buf), False, True)
        return list(buf[:n])

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

    prompt = tokenize(" ".join(PARAGRAPHS) * 20)[: a["prompt_tokens"]]
    count = tokenize(COUNT_PROMPT)
    sampler = llama_cpp.llama_sampler_init_greedy()
    pp: list[float] = []
    tg: list[float] = []
    for _ in range(a["reps"]):
        llama_cpp.llama_memory_clear(mem, True)
        t0 = time.perf_counter()
        decode(prompt, 0)
        pp.append(len(prompt) / (time.perf_counter() - t0))
        llama_cpp.llama_memory_clear(mem, True)
        first = filler(prompt, a, len(count)) + count
        decode(first, 0)
        pos = len(first)
        t0 = time.perf_counter()
        for _ in range(a["decode_tokens"]):
            tok = llama_cpp.llama_sampler_sample(sampler, ctx, -1)
            decode([tok], pos)
            pos += 1
        tg.append(a["decode_tokens"] / (time.perf_counter() - t0))
    return {"prompt_tps": pp, "decode_tps": tg, "threads": a["threads"],
            "omp": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}}


def main() -> int:
    a = json.loads(sys.argv[1])
    emit(bare_run(a) if a.get("bare") else engine_run(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
