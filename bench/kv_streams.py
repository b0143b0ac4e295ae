"""A batched decode of N sequences, one token each: one unified KV cache vs a stream per sequence.

    python -m bench.kv_streams                        # N = 2, 4, 8; 250 cells per sequence
    python -m bench.kv_streams --clients 4 --cells 400 --out bench/results/kv_streams.md

`serve --parallel N` decodes the conversations generating at once in one batch context (``_SharedBatch``).
With one unified cache (``kv_unified``) every sequence's attention spans every sequence's cells (masked), and
a batched decode costs more the more conversations there are; with a stream per sequence each one attends over
its own. This times both in one process on a raw llama.cpp context like the batch context (f16, no flash
attention): each sequence gets a prompt of ``cells - 48`` tokens, then 48 batched steps (the unified cache
interleaves those), then the timed steps: all N sequences, and all but the second (a stream cache splits a
batch into micro-batches of consecutive sequence ids, so a gap costs it a second pass). Methods alternate,
twice each; medians in milliseconds per decode.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_streams", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the bundled SmolLM2-135M)")
    ap.add_argument("--clients", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--cells", type=int, default=250, help="each sequence's cells before the timed steps")
    ap.add_argument("--steps", type=int, default=60, help="timed decodes per method and run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="also write the table to this markdown file")
    o = ap.parse_args(argv)

    import llama_cpp
    import numpy as np

    from chatcli.models.resolve import bundled_model_path

    model_path = o.model or str(bundled_model_path())
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), llama_cpp.llama_model_default_params())
    rng = np.random.default_rng(0)

    def decode(ctx: Any, b: Any, items: list[tuple[int, int, int]]) -> None:
        b.n_tokens = len(items)
        for i, (tok, pos, seq) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, True
            b.seq_id[i][0] = seq
        if llama_cpp.llama_decode(ctx, b) != 0:
            raise SystemExit("llama_decode failed")

    def run(n: int, unified: bool) -> tuple[float, float]:
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max, cp.kv_unified = n * 1024, n, unified
        cp.n_batch, cp.n_ubatch = 512, 128 + n
        cp.n_threads = cp.n_threads_batch = o.threads
        ctx = llama_cpp.llama_init_from_model(model, cp)
        b = llama_cpp.llama_batch_init(512, 0, 1)
        try:
            for s in range(n):
                toks = rng.integers(100, 30000, o.cells - 48).tolist()
                for c0 in range(0, len(toks), 64):
                    decode(ctx, b, [(t, c0 + k, s) for k, t in enumerate(toks[c0:c0 + 64])])
            pos = o.cells - 48
            times: dict[bool, list[float]] = {True: [], False: []}
            for step in range(48 + o.steps + o.steps // 2):
                gap = step >= 48 + o.steps
                seqs = [s for s in range(n) if not (gap and s == 1)]
                t = time.perf_counter()
                decode(ctx, b, [(int(rng.integers(100, 30000)), pos, s) for s in seqs])
                if step >= 48:
                    times[gap].append(time.perf_counter() - t)
                pos += 1
            return statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
        finally:
            llama_cpp.llama_batch_free(b)
            llama_cpp.llama_free(ctx)

    lines = [f"Model `{Path(model_path).name}`, {o.threads} threads, {o.cells} cells per sequence, f16 KV, no flash "
             "attention; ms per batched decode (median of each method's runs).", "",
             "| sequences | unified: all | streams: all | ratio | unified: all but one | streams: all but one "
             "| ratio |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for n in o.clients:
        res: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for unified in (True, False, False, True):
            res[unified].append(run(n, unified))
        u = [statistics.median(x[k] for x in res[True]) for k in (0, 1)]
        s = [statistics.median(x[k] for x in res[False]) for k in (0, 1)]
        lines.append(f"| {n} | {u[0]:.1f} | {s[0]:.1f} | {s[0] / u[0]:.2f} | {u[1]:.1f} | {s[1]:.1f} "
                     f"| {s[1] / u[1]:.2f} |")
        print(lines[-1], flush=True)
    llama_cpp.llama_model_free(model)
    if o.out:
        o.out.write_text("# Batched decode: unified KV cache vs a stream per sequence\n\n"
                         f"`python -m bench.kv_streams {' '.join(argv if argv is not None else sys.argv[1:])}`, "
                         f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
