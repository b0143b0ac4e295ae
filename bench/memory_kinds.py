"""What each llama.cpp memory kind costs chatcli: resume vs re-ingest, regenerate, bytes per turn (issue #20).

    python -m bench.memory_kinds [--arch NAME ...] [--reps N] [--out bench/results]

On llama.cpp's own random-weight fixtures (tests/archs.py; generated here, never shipped): one per memory
kind — attention (llama), SWA (gemma3), MLA (deepseek2), hybrid (granitehybrid, qwen35), recurrent (mamba),
whole-sequence (deepseek4). Each runs in its own process (an abort is one row). Per fixture, greedy, 8-token
replies, n_ctx 256 (the fixtures' trained context): a conversation grows until the next exchange would not fit
without dropping one (the longest history the context allows); then, ``--reps`` times each, the median of:

- resume: ``open_conversation`` from the state file (wall time; tokens re-evaluated);
- re-ingest: the same after the state file is deleted (what eviction costs: the transcript evaluated again);
- regenerate: ``regen`` of the last reply after a resume (wall time; history tokens evaluated);
- bytes per turn: the state file's growth per exchange (``state.kv`` after the persona prefix vs at the end).

The fixtures are tiny (hidden size 64–256): their recurrent states are KBs, where real models' are MBs to
~150 MiB, so the bytes say how each kind scales, not what a real model writes. The machine's load average is
printed with the results (timings on a shared machine vary).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FIXTURES = {"llama": "attention", "gemma3": "SWA", "deepseek2": "MLA", "granitehybrid": "hybrid",
            "qwen35": "hybrid", "mamba": "recurrent", "deepseek4": "whole"}
N_CTX, RESERVE, MAX_TOKENS = 256, 32, 8
MESSAGES = ["hello there", "tell me of the sea", "and the hills", "what of the sky", "and the rivers",
            "the woods", "the stars at night", "the long road home", "a small boat", "the harbour"]
RESULT = "MEMORY_KINDS "


def measure(model: Path, reps: int) -> dict[str, Any]:
    """One fixture's numbers (runs in its own process, CHATCLI_HOME set by the caller)."""
    from chatcli.config.settings import get_paths
    from chatcli.core.files.store import ConversationStore
    from tests.drive import build_session, drain, say

    session = build_session(model=str(model), n_ctx=N_CTX, reserve=RESERVE, max_tokens=MAX_TOKENS, threads=1)
    eng = session.engine
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    cid = conv.id
    store = ConversationStore(get_paths().conversations_dir)
    state = store.resolve(cid).state_path
    prefix_bytes = state.stat().st_size
    per_exchange = 0
    turns = 0
    for text in MESSAGES:
        # The next exchange must fit with the reserve kept free: a shift would rewrite the state file.
        if turns and eng.n_past + per_exchange + RESERVE > N_CTX:
            break
        before = eng.n_past
        say(conv, text)
        per_exchange = max(per_exchange, eng.n_past - before)
        turns += 1
    n_tokens = eng.n_past
    conv.close()
    end_bytes = state.stat().st_size

    def open_timed() -> tuple[float, int, Any]:
        t0 = time.perf_counter()
        c, report, _ = drain(session.open_conversation(cid))
        took = time.perf_counter() - t0
        assert c is not None and report is not None
        return took, report.reevaluated, c

    resume, regen, regen_eval, resumed_eval = [], [], [], []
    for _ in range(reps):
        took, reevaluated, c = open_timed()
        resume.append(took)
        resumed_eval.append(reevaluated)
        c.close()
    for _ in range(reps):
        _, _, c = open_timed()
        evaluated = eng.n_evaluated_total
        t0 = time.perf_counter()
        _, _, ends = drain(c.regen())
        regen.append(time.perf_counter() - t0)
        # history tokens evaluated: all evaluated minus the new reply's own decoded tokens
        regen_eval.append(max(0, eng.n_evaluated_total - evaluated - len(ends[-1].message.tokens)))
        c.switch_alt(0)  # keep the history the same for the next repetition
        c.close()
    reingest, reingest_eval = [], []
    for _ in range(reps):
        state.unlink()
        took, reevaluated, c = open_timed()
        reingest.append(took)
        reingest_eval.append(reevaluated)
        c.close()
    session.close()
    return {
        "fixture": model.stem, "memory": eng.caps.memory, "turns": turns, "tokens": n_tokens,
        "resume_s": statistics.median(resume), "resume_reevaluated": max(resumed_eval),
        "reingest_s": statistics.median(reingest), "reingest_reevaluated": max(reingest_eval),
        "regen_s": statistics.median(regen), "regen_history_evaluated": max(regen_eval),
        "prefix_bytes": prefix_bytes, "end_bytes": end_bytes,
        "bytes_per_turn": (end_bytes - prefix_bytes) / turns if turns else 0.0,
    }


def run_child(arch: str, model: Path, reps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="memkinds-") as home:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
        env.update(CHATCLI_HOME=home, NO_COLOR="1", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-m", "bench.memory_kinds", "--one", str(model), "--reps", str(reps)],
                              capture_output=True, text=True, env=env, timeout=1800, cwd=str(REPO))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return {"fixture": model.stem, "kind": FIXTURES[arch], "error": f"exit {proc.returncode}: {why}"}
    out: dict[str, Any] = json.loads(lines[-1][len(RESULT):])
    out["kind"] = FIXTURES[arch]
    return out


def kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:,.2f} MiB"


def markdown(rows: list[dict[str, Any]], load: tuple[float, float, float], reps: int) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = [f"# Memory kinds: resume, re-ingest, regenerate, bytes per turn ({when})",
           "",
           "`python -m bench.memory_kinds` on llama.cpp's random-weight fixtures (tiny: hidden size 64-256; on real "
           "models the recurrent state is MBs to ~150 MiB per point). n_ctx 256, the longest history the context "
           f"allows before a shift, greedy 8-token replies, 1 thread, median of {reps}. "
           f"Machine: {os.cpu_count()} cores shared with other work, load average {load[0]:.2f} / {load[1]:.2f} / "
           f"{load[2]:.2f} (1/5/15 min) at the start: the times are noisy; the token counts and bytes are exact.",
           "",
           "| fixture | kind | turns | tokens | resume | (re-evaluated) | re-ingest | (re-evaluated) | regenerate | "
           "(history evaluated) | persona prefix | bytes per turn | state file |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['fixture']} | {r['kind']} | {r['error']} |" + " |" * 10)
            continue
        out.append(
            f"| {r['fixture']} | {r['kind']} | {r['turns']} | {r['tokens']} | {r['resume_s'] * 1000:.1f} ms | "
            f"{r['resume_reevaluated']} | {r['reingest_s'] * 1000:.1f} ms | {r['reingest_reevaluated']} | "
            f"{r['regen_s'] * 1000:.1f} ms | {r['regen_history_evaluated']} | {kib(r['prefix_bytes'])} | "
            f"{kib(r['bytes_per_turn'])} | {kib(r['end_bytes'])} |")
    return "\n".join(out) + "\n"


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    names = [f"{r['fixture'].rsplit('-', 1)[0]}\n({r['kind']})" for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    xs = range(len(ok))
    width = 0.27
    for i, (key, label) in enumerate((("resume_s", "resume"), ("reingest_s", "re-ingest"),
                                      ("regen_s", "regenerate"))):
        ax1.bar([x + (i - 1) * width for x in xs], [r[key] * 1000 for r in ok], width, label=label)
    ax1.set_xticks(list(xs), names, fontsize=7, rotation=30)
    ax1.set_ylabel("ms (median)")
    ax1.set_title("at the longest history n_ctx 256 allows")
    ax1.legend()
    ax2.bar(list(xs), [r["bytes_per_turn"] / 1024 for r in ok], color="tab:purple")
    ax2.set_xticks(list(xs), names, fontsize=7, rotation=30)
    ax2.set_ylabel("KiB per exchange")
    ax2.set_title("state file growth per exchange (tiny fixtures)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--arch", action="append", choices=sorted(FIXTURES), help="fixture(s); default: all")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, help="write memory_kinds.{md,json,png} here")
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one is not None:
        print(RESULT + json.dumps(measure(args.one, args.reps)))
        return 0
    from tests.archs import SKIP_REASON, ArchFixtures, archs_binary

    if archs_binary() is None:
        print(f"error: {SKIP_REASON}", file=sys.stderr)
        return 2
    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="memkinds-fixtures-") as tmp:
        fixtures = ArchFixtures(Path(tmp))
        for arch in args.arch or list(FIXTURES):
            rows.append(run_child(arch, fixtures.path(arch), args.reps))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    text = markdown(rows, load, args.reps)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "memory_kinds.md").write_text(text, "utf-8")
        (args.out / "memory_kinds.json").write_text(json.dumps({"load": load, "rows": rows}, indent=1), "utf-8")
        chart(rows, args.out / "memory_kinds.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
