"""libgomp's spin count (``GOMP_SPINCOUNT``) for chatcli: how long a waiting OpenMP thread busy-waits.

    python -m bench.omp_spin                               # default vs 3k, 10k, 30k, 100k spins; 8 rounds
    python -m bench.omp_spin --counts 10000,30000 --rounds 12

llama.cpp's CPU threads meet at a barrier after every operation of a graph; a thread that arrives early spins
``GOMP_SPINCOUNT`` times, then sleeps in the kernel. Unset, libgomp spins 300,000 times ("about 3 ms" in its
source; measured below for this CPU). Between two decodes the worker spins too, on a core that chatcli's
Python threads (the token loop, the server's event loop) want: a thread woken then can wait behind it for a
scheduler slice (the hop outliers of ``bench.serve_timeline``, ~3 ms about twice a reply here). Fewer spins
free the core sooner; too few make the barriers inside a decode sleep (``OMP_WAIT_POLICY=PASSIVE``, zero
spins, decodes 2.7x slower here). libgomp reads the variable once, when it loads, so every variant is a
whole process of its own.

First the cost of one spin here: a libgomp parallel region started through ctypes in a child process, then
the worker thread's CPU time until it sleeps (``/proc/self/task/<tid>/schedstat``; Linux only). Then, round
by round with the variants' order rotating, each variant's processes do the same work:

1. the Engine's decode rate (``bench.decode_worker``: a prompt, then 96 greedy tokens; bench.decode's row);
2. ``chatcli serve --parallel 2`` with 1 and with 2 clients (bench.decode section 2's clients: 3 turns of
   48-token replies): total tokens/s and p50 request latency.

Ratios are each variant's over the default's, per round (the same round's work, back to back), then the
median of the rounds. Writes ``results/omp_spin.md`` and ``omp_spin.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.decode import FULL, Bench, Worker, load

DEFAULT = "default"
CALIBRATE = r"""
import ctypes, ctypes.util, sys, threading, time
gomp = ctypes.CDLL(ctypes.util.find_library("gomp") or "libgomp.so.1")
seen = set()
Body = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
body = Body(lambda _data: seen.add(threading.get_native_id()))
gomp.GOMP_parallel.argtypes = [Body, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
gomp.GOMP_parallel(body, None, 2, 0)
worker = next(t for t in seen if t != threading.get_native_id())
def ran():
    with open(f"/proc/self/task/{worker}/schedstat") as fh:
        return int(fh.read().split()[0])
t0 = ran()
time.sleep(float(sys.argv[1]))
print((ran() - t0) / int(sys.argv[2]))
"""


def spin_ns(count: int = 2_000_000, wait: float = 1.0) -> float | None:
    """Nanoseconds one libgomp spin takes here (None where it cannot be measured)."""
    env = {**os.environ, "GOMP_SPINCOUNT": str(count)}
    env.pop("OMP_WAIT_POLICY", None)
    try:
        out = subprocess.run([sys.executable, "-c", CALIBRATE, str(wait), str(count)], env=env,
                             capture_output=True, text=True, timeout=60)
        return float(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def work_tokens(n: int) -> list[int]:
    """A prompt of ``n`` ordinary token ids (a speed measurement: the text does not matter)."""
    return [1000 + (i * 7919) % 30000 for i in range(n)]


class SpinBench:
    def __init__(self, o: argparse.Namespace) -> None:
        ns = argparse.Namespace(model=o.model, threads=2, n_ctx=4096, reserve=None, fixed_threads=False, work=None)
        if ns.model is None:
            from chatcli.models.resolve import bundled_model_path
            ns.model = str(bundled_model_path())
        self.b = Bench(ns, {**FULL, "turns": 3, "reply": 48})
        self.variants = [DEFAULT, *o.counts.split(",")]
        self.rounds = o.rounds

    def env(self, v: str) -> dict[str, str]:
        return {} if v == DEFAULT else {"GOMP_SPINCOUNT": v}

    def start(self) -> dict[str, tuple[Worker, int]]:
        out = {}
        for v in self.variants:
            w = self.b.start_worker(f"spin-{v}", extra_env=self.env(v))
            _proc, port = self.b.start_chatcli(2, f"spin-{v}", extra_env=self.env(v))
            out[v] = (w, port)
        time.sleep(1.5)  # chatcli's thread policy looks at the load: the last start is a second in the past
        return out

    def run(self) -> dict[str, Any]:
        t0 = time.time()
        ns = spin_ns()
        self.b.log(f"one spin: {ns} ns")
        procs = self.start()
        omp = {v: w.ready.get("omp") for v, (w, _port) in procs.items()}
        prompt = work_tokens(128)
        rows: list[dict[str, Any]] = []
        try:
            for rnd in range(self.rounds):
                k = rnd % len(self.variants)
                for v in self.variants[k:] + self.variants[:k]:
                    w, port = procs[v]
                    la = load()
                    e = w.run({"prefix": [], "prompt": prompt, "decode": 96})
                    row: dict[str, Any] = {"round": rnd, "variant": v, "load": la, "engine_tps": e["decode_tps"]}
                    for n in (1, 2):
                        c = self.b.clients(port, n, rnd)
                        row[f"n{n}_tps"], row[f"n{n}_p50"] = c["tok_s"], c["p50"]
                    rows.append(row)
                    self.b.log(f"round {rnd} {v}: engine {e['decode_tps']:.1f} tok/s, serve N=1 "
                               f"{row['n1_tps']:.1f} tok/s p50 {row['n1_p50']:.3f}, N=2 {row['n2_tps']:.1f} "
                               f"p50 {row['n2_p50']:.3f}")
        finally:
            for w, _ in procs.values():
                w.close()
            for p in list(self.b.live):
                self.b.stop(p)
        return {"started": t0, "ended": time.time(), "spin_ns": ns, "variants": self.variants, "worker_omp": omp,
                "rounds": self.rounds, "rows": rows, "cpu": platform.processor() or platform.machine(),
                "cpus": os.cpu_count()}


KEYS = (("engine_tps", "Engine decode tok/s"), ("n1_tps", "serve N=1 tok/s"), ("n1_p50", "serve N=1 p50 s"),
        ("n2_tps", "serve N=2 tok/s"), ("n2_p50", "serve N=2 p50 s"))


def paired(rows: list[dict[str, Any]], v: str, key: str) -> list[float]:
    base = {r["round"]: r[key] for r in rows if r["variant"] == DEFAULT}
    return [r[key] / base[r["round"]] for r in rows if r["variant"] == v and base.get(r["round"])]


def markdown(res: dict[str, Any]) -> str:
    ns = res["spin_ns"]

    def label(v: str) -> str:
        n = 300_000 if v == DEFAULT else int(v)
        us = f" ≈ {n * ns / 1000:,.0f} µs" if ns else ""
        return f"{'default (300,000)' if v == DEFAULT else f'{n:,}'}{us}"

    rows = res["rows"]
    loads = [r["load"] for r in rows]
    out = [
        "# libgomp's spin count for chatcli",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M', time.gmtime(res['started']))}–"
        f"{time.strftime('%H:%M UTC', time.gmtime(res['ended']))}; `python -m bench.omp_spin`. {res['cpus']} CPUs "
        f"({res['cpu']}); " + (f"one spin {ns:.1f} ns here. " if ns else "one spin: not measured. ")
        + f"{res['rounds']} rounds, the variants' order rotating; load average {min(loads):.1f}–{max(loads):.1f}. "
        "Each variant: one `bench.decode_worker` (chatcli's Engine, 2 threads by its policy) and one "
        "`chatcli serve --parallel 2`, started with `GOMP_SPINCOUNT` set (default: unset).",
        "",
        "Medians over the rounds; in brackets the median of the per-round ratios to the default "
        "(tok/s: above 1 is faster; latency: below 1 is sooner).",
        "",
        "| spins | " + " | ".join(k[1] for k in KEYS) + " |",
        "|---|" + "---:|" * len(KEYS),
    ]
    for v in res["variants"]:
        mine = [r for r in rows if r["variant"] == v]
        cells = []
        for key, _name in KEYS:
            m = statistics.median(r[key] for r in mine)
            ratio = "" if v == DEFAULT else f" ({statistics.median(paired(rows, v, key)):.3f})"
            cells.append(f"{m:.3f}{ratio}" if key.endswith("p50") else f"{m:.1f}{ratio}")
        out.append(f"| {label(v)} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.omp_spin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="3000,10000,30000,100000", help="spin counts to compare with the default")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--model", help="GGUF model file (default: the bundled SmolLM2-135M)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--from-json", help="only re-render omp_spin.md from an omp_spin.json")
    o = ap.parse_args(argv)
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    res = json.loads(Path(o.from_json).read_text()) if o.from_json else SpinBench(o).run()
    if not o.from_json:
        (out / "omp_spin.json").write_text(json.dumps(res, indent=1))
    (out / "omp_spin.md").write_text(markdown(res))
    print(f"wrote {out / 'omp_spin.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
