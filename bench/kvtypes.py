"""KV cache types side by side: state size, restore time and quality of q8_0 and q4_0 against f16.

    python -m bench.kvtypes              # ~2,000-token text, 256 generated tokens (a few minutes on 2 cores)
    python -m bench.kvtypes --quick      # 300 tokens, 32 generated (smoke test)

One process, one chatcli ``Engine`` per KV type loaded in turn (model loading is never timed), the same
model file, thread count and context size. For each type:

- **size**: the conversation's whole state as chatcli saves it (one SNAPSHOT record in a state file:
  record header, token ids, llama.cpp's cell bytes) and the cells alone, per token;
- **restore**: reading that state file and loading its cells into the cleared context (``records.scan``
  + ``read_payload`` + ``Engine.load_cells``: what ``resume`` does), file in the page cache, median of
  ``--reps``, the three types taking turns (order rotated each repetition);
- **rates**: the text is evaluated in 500-token chunks and the greedy tokens decoded one at a time, the
  engines taking turns chunk by chunk and token by token, so every type sees the same machine load;
- **quality** against f16 on the same fixed text: the f16 engine generates 256 greedy tokens (argmax, no
  penalty) after the text; each quantized engine (a) generates its own 256 greedy tokens — agreement is the
  share of positions holding the same token, and the first position that differs — and (b) is fed f16's
  tokens (teacher forcing) so that both see the same context at every step: mean KL(p_f16 ‖ p_type) of the
  next-token distributions over the 256 steps, and how often the two argmaxes agree.

Nothing is tuned: the figures are reported as measured. Results: ``bench/results/kvtypes.md``,
``kvtypes.png``, ``kvtypes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PARAGRAPHS, PERSONA_FACTS
from bench.run import VEGETABLES

TYPES = ["f16", "q8_0", "q4_0"]
# Bytes per 32 values: f16 2 each; q8_0 a 2-byte scale + 32 int8; q4_0 a 2-byte scale + 16 bytes of nibbles.
EXPECTED_RATIO = {"f16": 1.0, "q8_0": 34 / 64, "q4_0": 18 / 64}


def fixed_text() -> str:
    """A fixed, varied English text (no repeated paragraph) long enough for 2,000 tokens."""
    parts = [*PERSONA_FACTS, *PARAGRAPHS]
    for name, month, cm, weeks in VEGETABLES:
        parts.append(f"{name.capitalize()}: sow or plant in {month}, about {cm} cm apart; the first harvest comes "
                     f"after about {weeks} weeks, earlier under fleece and later in a cold, wet spring.")
    for i, (name, month, _cm, _weeks) in enumerate(VEGETABLES):
        nxt = VEGETABLES[(i + 7) % len(VEGETABLES)][0]
        parts.append(f"In the rotation plan, {name} follows {nxt} only after a gap of {2 + i % 3} years; sowing in "
                     f"{month} works when the soil has warmed and dried enough to crumble in the hand.")
    return "\n".join(parts)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float(np.sum(np.exp(lp) * (lp - lq)))


def forced(eng: Any, tokens: list[int]) -> list[np.ndarray]:
    out = []
    for tok in tokens:
        out.append(eng.logits())
        eng.eval([tok])
    return out


def _restore_once(eng: Any, path: Path, n: int) -> float:
    from chatcli.core.kv import records as sf

    eng.clear()
    t0 = time.perf_counter()
    res = sf.scan(path)
    chunks, _, _ = res.live()
    payload = sf.read_payload(path, chunks[0].record)
    toks, kv = sf.split_cells(payload, n)
    eng.load_cells(0, n, kv, toks)
    return 1000 * (time.perf_counter() - t0)


def measure_all(model: str, text_tokens: list[int], o: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """All three engines loaded at once, so the timed parts can take turns: on a busy machine a type
    measured later would otherwise see another load than the one measured first."""
    from chatcli.backends.llamacpp import Engine
    from chatcli.core.kv import records as sf

    engines = {t: Engine(model, n_ctx=o.n_ctx, n_threads=o.threads, kv_type=t) for t in TYPES}
    try:
        rows: dict[str, dict[str, Any]] = {}
        # The text in 500-token chunks, the engines taking turns chunk by chunk (same chunks for every type).
        eval_s = dict.fromkeys(TYPES, 0.0)
        for c0 in range(0, len(text_tokens), 500):
            for t, eng in engines.items():
                t0 = time.perf_counter()
                eng.eval(text_tokens[c0:c0 + 500])
                eval_s[t] += time.perf_counter() - t0
        for t, eng in engines.items():
            n = eng.n_past
            cells = eng.save_cells(0, n)
            path = work / f"{t}.kv"
            recs = [sf.encode_record(sf.HEADER, 0, 0, sf.header_payload({"kv": eng.kv_params})),
                    sf.encode_record(sf.SNAPSHOT, 0, n, sf.cells_payload(list(eng.tokens), cells))]
            sf.StateWriter(path).rewrite(recs)
            logits_after = eng.logits()
            # A probe token decoded after the original context, to compare with the same after a restore
            # (like with like: one decoded token on top of the cells).
            probe = int(np.argmax(logits_after))
            eng.eval([probe])
            probe_logits = eng.logits()
            eng.truncate(n)
            rows[t] = {"kv_type": t, "kv_params": eng.kv_params, "n_tokens": n, "eval_s": eval_s[t],
                       "cells_bytes": len(cells), "file_bytes": path.stat().st_size,
                       "cells_per_token": len(cells) / n, "file_per_token": path.stat().st_size / n,
                       "restore_ms": [], "_path": path, "_logits_after": logits_after, "_probe": probe,
                       "_probe_logits": probe_logits}
        for rep in range(o.reps):  # rotate the order each repetition
            order = TYPES[rep % len(TYPES):] + TYPES[:rep % len(TYPES)]
            for t in order:
                r = rows[t]
                r["restore_ms"].append(_restore_once(engines[t], r["_path"], r["n_tokens"]))
        for t, eng in engines.items():
            r = rows[t]
            n = r["n_tokens"]
            # The restored context must carry on exactly like the one that computed it: check, do not assume.
            eng.eval([r["_probe"]])
            r["restore_logits_identical"] = bool(np.array_equal(eng.logits(), r["_probe_logits"]))
            eng.truncate(n)
            eng.set_logits(r["_logits_after"])
            r["generated"], r["_logits"], r["gen_s"] = [], [], 0.0
        for _ in range(o.gen):  # one greedy token per engine in turn
            for t, eng in engines.items():
                r = rows[t]
                t0 = time.perf_counter()
                lg = eng.logits()
                tok = int(np.argmax(lg))
                eng.eval([tok])
                r["gen_s"] += time.perf_counter() - t0
                r["generated"].append(tok)
                r["_logits"].append(lg)
        ref = rows["f16"]
        for t in TYPES[1:]:
            r, eng = rows[t], engines[t]
            same = [a == b for a, b in zip(r["generated"], ref["generated"], strict=True)]
            r["free_agreement"] = sum(same) / len(same)
            r["first_divergence"] = same.index(False) if False in same else len(same)
            eng.truncate(r["n_tokens"])
            eng.set_logits(r["_logits_after"])
            f_logits = forced(eng, ref["generated"])
            kls = [kl(p, q) for p, q in zip(ref["_logits"], f_logits, strict=True)]
            r["kl_mean"] = float(np.mean(kls))
            r["kl_max"] = float(np.max(kls))
            top1 = [int(np.argmax(q)) == tok for q, tok in zip(f_logits, ref["generated"], strict=True)]
            r["forced_top1_agreement"] = float(np.mean(top1))
        return [rows[t] for t in TYPES]
    finally:
        for eng in engines.values():
            eng.close()


def report(res: dict[str, Any], out: Path) -> list[Path]:
    rows = res["types"]
    f16 = rows[0]
    mach = res["machine"]
    lines = [
        "# KV cache types: size, restore time, quality",
        "",
        (f"Model `{Path(res['model']).name}`, n_ctx {res['n_ctx']}, {res['threads']} threads, text of "
        f"{f16['n_tokens']} tokens, {res['gen']} greedy tokens generated. {mach['cpus']} CPUs, load average "
        f"{mach['load_start'][0]:.1f} at start, {mach['load_end'][0]:.1f} at end; restore = median of {res['reps']} "
        "(state file in the page cache). Generated by `python -m bench.kvtypes`."),
        "",
        ("| KV type | flash attn | state file B/token | cells B/token | × f16 (expected) | restore ms | × f16 | "
        "free-run greedy agreement | first divergence | teacher-forced top-1 agreement | mean KL vs f16 (nats) | max KL "
        "| batch eval tok/s | one-by-one decode tok/s |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f16_restore = statistics.median(f16["restore_ms"])
    for r in rows:
        rest = statistics.median(r["restore_ms"])
        q = r["kv_type"] != "f16"
        lines.append(
            f"| {r['kv_type']} | {'on' if r['kv_params']['flash_attn'] else 'off'} | {r['file_per_token']:,.0f} | "
            f"{r['cells_per_token']:,.0f} | {r['cells_per_token'] / f16['cells_per_token']:.3f} "
            f"({EXPECTED_RATIO[r['kv_type']]:.3f}) | {rest:.1f} | {rest / f16_restore:.2f} | "
            + (f"{100 * r['free_agreement']:.1f} % | {r['first_divergence']} | {100 * r['forced_top1_agreement']:.1f} % | "
               f"{r['kl_mean']:.4f} | {r['kl_max']:.3f} |" if q else "(reference) | – | – | – | – |")
            + f" {r['n_tokens'] / r['eval_s']:,.0f} | {len(r['generated']) / r['gen_s']:,.1f} |")
    lines += [
        "",
        "A token decoded after each restore gave logits bit-identical to the same token decoded after the original "
        "context: "
        + ", ".join(f"{r['kv_type']} {'yes' if r['restore_logits_identical'] else 'NO'}" for r in rows) + ".",
        ("q8_0 and q4_0 run with flash attention (llama.cpp requires it for a quantized V cache), f16 without it "
        "(chatcli's f16 setting): their distance from f16 includes flash attention's different order of summation."),
        ("The last two columns are what rebuilding a conversation from its transcript costs (chatcli replays the "
        "original batching so the rebuilt KV is bit-identical: user messages and the persona in batches, reply "
        "tokens one by one): about (prompt tokens / batch rate) + (reply tokens / one-by-one rate)."),
        ("Expected ratios: q8_0 stores 32 values in 34 bytes (0.531× f16), q4_0 in 18 bytes (0.281×); the cells also "
        "carry a few bytes per cell of positions and sequence ids."),
        "",
    ]
    out.mkdir(parents=True, exist_ok=True)
    md = out / "kvtypes.md"
    md.write_text("\n".join(lines))
    js = out / "kvtypes.json"
    js.write_text(json.dumps({**res, "types": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]},
                             indent=1))
    written = [md, js]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart (pip install matplotlib)", file=sys.stderr)
        return written
    names = [r["kv_type"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    axes[0].bar(names, [r["file_per_token"] / 1024 for r in rows], color=["#777", "#3a7", "#37a"])
    axes[0].set_title("state file KiB per token")
    axes[1].bar(names, [statistics.median(r["restore_ms"]) for r in rows], color=["#777", "#3a7", "#37a"])
    axes[1].set_title(f"restore ms ({f16['n_tokens']} tokens)")
    q = rows[1:]
    axes[2].bar([r["kv_type"] for r in q], [r["kl_mean"] for r in q], color=["#3a7", "#37a"][:len(q)])
    for i, r in enumerate(q):
        axes[2].text(i, r["kl_mean"], f"{100 * r['free_agreement']:.0f} % same tokens", ha="center", va="bottom",
                     fontsize=8)
    axes[2].set_title("mean KL vs f16 (nats)")
    fig.suptitle(f"KV cache types · {Path(res['model']).name} · {res['gen']} greedy tokens after "
                 f"{f16['n_tokens']} tokens of text", fontsize=10)
    fig.tight_layout()
    png = out / "kvtypes.png"
    fig.savefig(png, dpi=110)
    written.append(png)
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the bundled SmolLM2-135M)")
    ap.add_argument("--tokens", type=int, default=2000, help="length of the fixed text in tokens")
    ap.add_argument("--gen", type=int, default=256, help="greedy tokens generated")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--quick", action="store_true", help="300 tokens, 32 generated, 2 reps")
    o = ap.parse_args(argv)
    if o.quick:
        o.tokens, o.gen, o.reps = 300, 32, 2
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from chatcli.backends.llamacpp import Engine
    from chatcli.models.resolve import bundled_model_path

    model = o.model or str(bundled_model_path())
    with Engine(model, n_ctx=o.n_ctx, n_threads=o.threads) as tok_eng:
        ids = tok_eng.tokenize(fixed_text(), add_special=tok_eng.add_bos)
    if len(ids) < o.tokens:
        raise SystemExit(f"the fixed text has only {len(ids)} tokens (< {o.tokens})")
    ids = ids[:o.tokens]
    if o.tokens + o.gen + 1 > o.n_ctx:
        raise SystemExit("--tokens + --gen must fit in --n-ctx")
    res: dict[str, Any] = {"model": model, "n_ctx": o.n_ctx, "threads": o.threads, "gen": o.gen, "reps": o.reps,
                           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                       "load_start": os.getloadavg()}, "types": []}
    with tempfile.TemporaryDirectory(prefix="chatcli-kvbench-") as work:
        res["types"] = measure_all(model, ids, o, Path(work))
    res["machine"]["load_end"] = os.getloadavg()
    for p in report(res, Path(o.out)):
        print(p)
    print((Path(o.out) / "kvtypes.md").read_text())


if __name__ == "__main__":
    main()
