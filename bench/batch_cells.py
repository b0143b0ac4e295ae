"""Reading a member's cells out of a batch context: interleaved by batched decoding vs contiguous.

    python -m bench.batch_cells                 # the bundled model, 47 cells (a FULL section-2 reply)
    python -m bench.batch_cells --cells 96 --reps 9

`serve --parallel N` decodes the siblings generating at once in one batch context (one unified KV cache), one
token per member per decode, so llama.cpp puts their cells side by side: member A's reply ends up one cell per
range (A B A B ...). Copying the reply back to A's own context reads A's cells out (``llama_state_seq_get_data``
of a scratch sequence tagged with them, as ``_SharedBatch._copy_back`` does). With flash attention off (f16) V
is stored transposed and llama.cpp's state writer reads one piece per range per V row per layer, so the
interleaved cells cost far more than the same number of contiguous ones. This times both in one process: a
raw llama.cpp context like the batch context (n_seq_max 3, unified, f16, no flash attention), two 200-token
prefixes decoded apart (contiguous), then ``--cells`` steps of one token each for both sequences in one batch.
Prints the median read time of each and their ratio (no file written: the figures go to the issue note).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.batch_cells", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the bundled SmolLM2-135M)")
    ap.add_argument("--cells", type=int, default=47, help="tokens decoded per member side by side (default 47)")
    ap.add_argument("--prefix", type=int, default=200, help="each member's prefix, decoded alone (default 200)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    o = ap.parse_args(argv)

    import llama_cpp
    import numpy as np

    from chatcli.models.resolve import bundled_model_path

    model_path = o.model or str(bundled_model_path())
    if o.cells > o.prefix:
        raise SystemExit("--cells must not exceed --prefix (the contiguous read takes cells of the prefix)")
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise SystemExit(f"could not load {model_path}")
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = 2 * (o.prefix + o.cells) + 256
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = 3  # two members and the scratch sequence, as the batch context has
    cp.kv_unified = True
    cp.flash_attn_type = 0  # f16 without flash attention: chatcli's default
    cp.n_threads = cp.n_threads_batch = o.threads
    ctx = llama_cpp.llama_init_from_model(model, cp)
    mem = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(512, 0, 3)
    scratch = 2

    def decode(items: list[tuple[int, int, int]]) -> None:
        batch.n_tokens = len(items)
        for i, (tok, pos, seq) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = i == len(items) - 1
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")

    for seq in (0, 1):
        for start in range(0, o.prefix, 512):
            decode([(100 + i % 50, i, seq) for i in range(start, min(o.prefix, start + 512))])
    for k in range(o.cells):
        decode([(200 + k, o.prefix + k, 0), (300 + k, o.prefix + k, 1)])

    def read(p0: int, p1: int) -> float:
        llama_cpp.llama_memory_seq_rm(mem, scratch, -1, -1)
        llama_cpp.llama_memory_seq_cp(mem, 0, scratch, p0, p1)
        t = time.perf_counter()
        n = llama_cpp.llama_state_seq_get_size(ctx, scratch)
        buf = np.empty(n, dtype=np.uint8)
        if llama_cpp.llama_state_seq_get_data(ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), n,
                                              scratch) == 0:
            raise SystemExit("llama_state_seq_get_data failed")
        dt = time.perf_counter() - t
        llama_cpp.llama_memory_seq_rm(mem, scratch, -1, -1)
        return dt

    interleaved: list[float] = []
    contiguous: list[float] = []
    for _ in range(o.reps):  # taking turns, so both see the same machine
        interleaved.append(read(o.prefix, o.prefix + o.cells))
        contiguous.append(read(o.prefix - o.cells, o.prefix))
    a, b = statistics.median(interleaved), statistics.median(contiguous)
    print(f"{o.cells} cells of one member: interleaved with another's {1e3 * a:.2f} ms, contiguous {1e3 * b:.2f} ms "
          f"({a / b:.0f}x; median of {o.reps}, {o.threads} threads)")
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
