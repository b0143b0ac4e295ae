"""Turns the raw results of ``run.py`` into ``results.md`` and PNG charts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def med(xs: Sequence[float]) -> float:
    xs = [float(x) for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def f_ms(x: float) -> str:
    if x != x:  # nan
        return "–"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def f_x(x: float) -> str:
    if x != x or x in (float("inf"), 0):
        return "–"
    return f"{x:,.0f}×" if x >= 100 else f"{x:.1f}×" if x >= 1 else f"{x:.2f}×"


def f_mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Medians per length of every figure; what the tables and the headline are made of."""
    rows = []
    for ck in res["checkpoints"]:
        key = str(ck["target"])
        r = res["resume"][key]
        row = {
            "target": ck["target"], "tokens": ck["n_tokens"],
            "chatcli_ttft": med([x["ttft_ms"] for x in r["resume"]]),
            "chatcli_restore": med([x["restore_ms"] for x in r["resume"]]),
            "state_restore": med([x["state_restore_ms"] for x in r["resume"]]),
            "cold_restore": med([x["cold_state_restore_ms"] for x in r["resume"]]),
            "cold_read": med([x["cold_plain_read_ms"] for x in r["resume"]]),
            "plain_read": med([x["plain_read_ms"] for x in r["resume"]]),
            "reevaluated": max((x["reevaluated"] + x["cold_reevaluated"] for x in r["resume"]), default=0),
            "cold_ttft": med([p[key]["cold_ms"] for p in res["reingest"]]),
            "ls_ttft": med([x["ttft_ms"] for x in r["llama_state"]]),
            "ls_restore": med([x["restore_ms"] for x in r["llama_state"]]),
            "dc_ttft": med([x["ttft_ms"] for x in r["llama_diskcache"]]),
            "dc_restore": med([x["restore_ms"] for x in r["llama_diskcache"]]),
            "dc_hit": all(x["hit"] for x in r["llama_diskcache"]),
            "chatcli_bytes": med([x["state_file_bytes"] for x in r["resume"]]),
            "ls_bytes": ck.get("llama_state_file_bytes", float("nan")),
            "ls_raw_bytes": ck.get("llama_state_bytes", float("nan")),
            "dc_bytes": ck.get("diskcache_bytes", float("nan")),
        }
        rb = res["rollback"][key]
        row.update({
            "regen": med(rb["regen_ms"]), "regen_re": med([p[key]["regen_ms"] for p in res["reingest"]]),
            "edit": med(rb["edit_ms"]), "edit_re": med([p[key]["edit_ms"] for p in res["reingest"]]),
            "regen_tokens": res["reingest"][0][key]["regen_tokens"], "edit_tokens": res["reingest"][0][key]["edit_tokens"],
        })
        rows.append(row)
    t = res["throughput"]
    def overhead(c: list[float], b: list[float]) -> float:
        # Paired: each pair ran back to back, so the per-pair ratio cancels most of the machine's drift.
        return 100 * (1 - med([x / y for x, y in zip(c, b, strict=True)]))

    thr: dict[str, float] = {
        "prompt_tokens": t["prompt_tokens"][0], "decode_tokens": med(t["decode_n"]), "pairs": len(t["decode_n"]),
    }
    for kind in ("prompt", "decode"):
        for clock in ("", "_cpu"):
            c, b = t[f"chatcli_{kind}{clock}_tps"], t[f"bare_{kind}{clock}_tps"]
            # Pooled rate (all tokens / all time: the harmonic mean); the overhead uses the per-pair ratios.
            thr[f"chatcli_{kind}{clock}"] = statistics.harmonic_mean(c)
            thr[f"bare_{kind}{clock}"] = statistics.harmonic_mean(b)
            thr[f"{kind}{clock}_overhead"] = overhead(c, b)
    p = res["persona"]
    per = {"prefix_tokens": p.get("prefix_tokens", 0), "uncached": med(p["uncached_ms"]), "cached": med(p["cached_ms"]),
           "hit": p["all_cached_hit"]}
    return {"rows": rows, "thr": thr, "persona": per, "ba": before_after(res, rows)}


def _thr_overheads(t: dict[str, Any]) -> dict[str, float]:
    def overhead(c: list[float], b: list[float]) -> float:
        return 100 * (1 - med([x / y for x, y in zip(c, b, strict=False)]))

    return {f"{kind}{clock}": overhead(t[f"chatcli_{kind}{clock}_tps"], t[f"bare_{kind}{clock}_tps"])
            for kind in ("prompt", "decode") for clock in ("", "_cpu")}


_STEPS = ("interpreter_ms", "imports_ms", "identity_ms", "model_load_ms", "conversation_ms", "first_token_ms", "total_ms")


def before_after(res: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Issue #15's figures: chatcli as of ``--before`` next to this tree, measured in the same run."""
    if not res.get("before"):
        return None
    out: dict[str, Any] = {"rev": res["before"], "rows": []}
    for row, ck in zip(rows, res["checkpoints"], strict=False):
        rb = res["resume"][str(ck["target"])].get("resume_before", [])
        out["rows"].append({
            "target": row["target"], "tokens": row["tokens"],
            "restore_before": med([x["state_restore_ms"] for x in rb]),
            "read_before": med([x["plain_read_ms"] for x in rb]),
            "ratio_before": med([x["state_restore_ms"] / x["plain_read_ms"] for x in rb]),
            "ttft_before": med([x["ttft_ms"] for x in rb]),
            "restore_after": row["state_restore"], "read_after": row["plain_read"],
            "ratio_after": med([x["state_restore_ms"] / x["plain_read_ms"] for x in res["resume"][str(ck["target"])]["resume"]]),
            "ttft_after": row["chatcli_ttft"], "cold": row["cold_ttft"], "load_state": row["ls_ttft"],
        })
    out["thr_after"] = _thr_overheads(res["throughput"])
    out["thr_before"] = _thr_overheads(res["throughput_before"]) if res.get("throughput_before") else None
    st = res.get("startup")
    if st:
        out["startup"] = {"tokens": st["tokens"]}
        for tree in ("after", "before"):
            if tree not in st:
                continue
            d = st[tree]
            out["startup"][tree] = {
                "talk_cli": med(d["talk_cli_ms"]), "resume_cli": med(d["resume_cli_ms"]), "ls_cli": med(d["ls_cli_ms"]),
                "talk": {k: med([x[k] for x in d["talk"]]) for k in _STEPS},
                "resume": {k: med([x[k] for x in d["resume"]]) for k in _STEPS},
                "reevaluated": max([x["reevaluated"] for x in d["resume"]], default=0),
            }
    return out


def headline(res: dict[str, Any], s: dict[str, Any]) -> list[str]:
    last = s["rows"][-1]
    turns = res["build"]["turns"]
    tl = turns[-1]
    m = res["memory"]
    return [f"- **Resume** a {last['tokens']:,}-token conversation in a new process: first token after "
        f"**{f_ms(last['chatcli_ttft'])} ms** vs {f_ms(last['cold_ttft'])} ms re-ingesting it "
        f"(**{f_x(last['cold_ttft'] / last['chatcli_ttft'])} faster**); llama-cpp-python `load_state` "
        f"{f_ms(last['ls_ttft'])} ms, `LlamaDiskCache` {f_ms(last['dc_ttft'])} ms.",
        f"- **Per-turn save** at {tl['n_past']:,} tokens: chatcli appends {f_mib(tl['append_bytes'])} in "
        f"{f_ms(tl['append_ms'])} ms; rewriting the whole state would write {f_mib(tl['rewrite_bytes'])} in "
        f"{f_ms(tl['rewrite_ms'])} ms ({f_x(tl['rewrite_bytes'] / max(1, tl['append_bytes']))} the bytes).",
        f"- **/regen** at {last['tokens']:,} tokens: {f_ms(last['regen'])} ms to the first new token vs "
        f"{f_ms(last['regen_re'])} ms re-ingesting ({f_x(last['regen_re'] / last['regen'])}); **/edit** "
        f"{f_ms(last['edit'])} ms vs {f_ms(last['edit_re'])} ms ({f_x(last['edit_re'] / last['edit'])}).",
        f"- **Engine overhead** vs a bare llama-cpp-python loop (per CPU-second / wall clock): prompt eval "
        f"{s['thr']['prompt_cpu_overhead']:+.1f} % / {s['thr']['prompt_overhead']:+.1f} %, decode "
        f"{s['thr']['decode_cpu_overhead']:+.1f} % / {s['thr']['decode_overhead']:+.1f} % (positive = chatcli slower).",
        f"- **Memory**: `chatcli talk` peaks at {f_mib(m['chatcli_talk_rss'])} = "
        f"{f_x(m['chatcli_talk_rss'] / (m['model_file_bytes'] + m['kv_bytes']))} model + KV "
        f"({f_mib(m['model_file_bytes'] + m['kv_bytes'])}); bare `Llama` peaks at {f_mib(m['llama_rss'])}.",
        f"- **Persona prefix cache** ({s['persona']['prefix_tokens']:,} tokens): new conversation to first token in "
        f"{f_ms(s['persona']['cached'])} ms cached vs {f_ms(s['persona']['uncached'])} ms uncached "
        f"({f_x(s['persona']['uncached'] / s['persona']['cached'])}).", *_headline_ba(s.get("ba"))]


def _headline_ba(ba: dict[str, Any] | None) -> list[str]:
    if not ba:
        return []
    lines = []
    rows = ba["rows"]
    lines.append("- **State restore ÷ plain read** of the same bytes (page cache warm), before → after (#15): " + ", ".join(
        f"{r['tokens']:,} tok {f_x(r['ratio_before'])} → **{f_x(r['ratio_after'])}**" for r in rows) + ".")
    tb, ta = ba["thr_before"], ba["thr_after"]
    if tb:
        lines.append(f"- **Decode overhead** vs the bare loop (CPU / wall), before → after: {tb['decode_cpu']:+.1f} % / "
                     f"{tb['decode']:+.1f} % → **{ta['decode_cpu']:+.1f} % / {ta['decode']:+.1f} %**.")
    st = ba.get("startup")
    if st and "after" in st:
        a = st["after"]
        b = st.get("before")
        resume_talk = _ratio(a["resume_cli"], a["talk_cli"])
        txt = (f"- **Whole process** at {st['tokens']:,} tokens: `resume` ÷ `talk` = **{f_x(resume_talk)}**"
               + (f" (before {f_x(_ratio(b['resume_cli'], b['talk_cli']))})" if b else "")
               + f"; `chatcli ls` with 100 conversations **{f_ms(a['ls_cli'])} ms**"
               + (f" (before {f_ms(b['ls_cli'])} ms)" if b else "")
               + f"; model identity {f_ms(a['resume']['identity_ms'])} ms"
               + (f" (before {f_ms(b['resume']['identity_ms'])} ms)." if b else "."))
        lines.append(txt)
    return lines


def markdown(res: dict[str, Any], s: dict[str, Any], charts: list[str]) -> str:
    c = res["config"]
    b = res["build"]
    mach = res["machine"]
    out: list[str] = []
    w = out.append
    w("# chatcli benchmark results\n")
    w(f"Model **{b['model_name']}** ({f_mib(b['model_file_bytes'])}), n_ctx {b['n_ctx']}, {b['threads']} threads, "
      f"greedy decoding; {c['reps']} repetition(s) of each measurement and {c.get('reingest_reps', c['reps'])} of each "
      "full re-ingest baseline, medians shown. "
      f"{'Quick variant. ' if c['quick'] else ''}Run {time.strftime('%Y-%m-%d %H:%M')} in {res['seconds'] / 60:.1f} min "
      f"on {mach['cpus']} CPUs ({mach['platform']}, Python {mach['python']}, llama-cpp-python "
      f"{mach.get('llama_cpp_python', '?')}, typer {mach.get('typer', '?')}); load average {mach['load_start'][0]:.1f} at start, "
      f"{mach['load_end'][0]:.1f} at end; OMP_WAIT_POLICY={c['omp_wait_policy']}"
      f"{'; bytecode ' + mach['bytecode'] if mach.get('bytecode') else ''}.\n")
    w(f"Command: `{res.get('command', 'python -m bench.run')}`. Every number compares methods measured side by side "
      "in this run; absolute times depend on the machine and its load, the ratios are the point. "
      "See `bench/README.md` for the methodology.\n")
    w("## Headline\n")
    out.extend(headline(res, s))
    w("")

    w("## 1. Resume: time to the first token of the next reply, in a new process (ms)\n")
    w("Each method restores the conversation in a fresh process (model already loaded), evaluates the same next "
      "message and samples its first token. Cold re-ingest = a fresh context evaluates the whole history and "
      "the message (one pass measures every length: see the README).\n")
    w("| target | tokens | chatcli resume | cold re-ingest | llama-cpp-python load_state | LlamaDiskCache | "
      "cold ÷ chatcli | load_state ÷ chatcli | DiskCache ÷ chatcli |")
    w("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in s["rows"]:
        w(f"| {r['target']} | {r['tokens']:,} | {f_ms(r['chatcli_ttft'])} | {f_ms(r['cold_ttft'])} | "
          f"{f_ms(r['ls_ttft'])} | {f_ms(r['dc_ttft'])} | {f_x(r['cold_ttft'] / r['chatcli_ttft'])} | "
          f"{f_x(r['ls_ttft'] / r['chatcli_ttft'])} | {f_x(r['dc_ttft'] / r['chatcli_ttft'])} |")
    w("")
    w("### 1b. Restore time (ms)\n")
    w("| target | tokens | chatcli open | chatcli state restore | plain read | restore ÷ read | "
      "state restore, cache dropped | plain read, cache dropped | restore ÷ read | "
      "load_state restore | DiskCache restore |")
    w("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in s["rows"]:
        w(f"| {r['target']} | {r['tokens']:,} | {f_ms(r['chatcli_restore'])} | {f_ms(r['state_restore'])} | "
          f"{f_ms(r['plain_read'])} | {f_x(r['state_restore'] / r['plain_read'])} | {f_ms(r['cold_restore'])} | "
          f"{f_ms(r['cold_read'])} | {f_x(r['cold_restore'] / r['cold_read'])} | {f_ms(r['ls_restore'])} | "
          f"{f_ms(r['dc_restore'])} |")
    w("")
    w("chatcli open = `Session.open_conversation` until the Conversation is ready (transcript, lock, state "
      "file → KV cells), timed inside the new process; chatcli state restore = the part that reads state.kv "
      "and loads the cells (`ResumeReport.seconds`); plain read = `open().read()` of the same number of bytes, "
      "in the same process right after. Both are first measured with the file in the page cache (it was just "
      "copied there), then again, in the same process, after dropping the file from the page cache (fsync + "
      "`posix_fadvise(POSIX_FADV_DONTNEED)`, which needs no root). load_state restore = reading the file + "
      "`Llama.load_state`; DiskCache restore = the cache lookup (unpickle) + `load_state`.\n")
    w("### 1c. Bytes on disk\n")
    w("| target | tokens | chatcli state.kv | LlamaState file | LlamaDiskCache dir | KV cells alone |")
    w("|---:|---:|---:|---:|---:|---:|")
    bpt = res["build"]["kv_bytes_per_token"]
    for r in s["rows"]:
        w(f"| {r['target']} | {r['tokens']:,} | {f_mib(r['chatcli_bytes'])} | {f_mib(r['ls_bytes'])} | "
          f"{f_mib(r['dc_bytes'])} | {f_mib(r['tokens'] * bpt)} |")
    w("")
    reev = [r for r in s["rows"] if r["reevaluated"]]
    miss = [r for r in s["rows"] if not r["dc_hit"]]
    w("KV cells alone = tokens × KV bytes per token. chatcli's state.kv also holds the token ids and, per turn, "
      "a LOGITS record (one float32 per vocabulary entry) so /regen evaluates nothing; superseded ones go at "
      "compaction. "
      "LlamaState file = `Llama.save_state()` fields written without "
      "pickle (token ids + llama.cpp state; its `scores` rows are never filled with `logits_all=False` and are "
      "not stored); LlamaDiskCache stores the pickled `LlamaState` including those rows."
      + (f" **Warning:** chatcli re-evaluated tokens on resume at {[r['target'] for r in reev]}." if reev else
         " chatcli re-evaluated 0 tokens on every resume.")
      + (f" **Warning:** LlamaDiskCache missed at {[r['target'] for r in miss]}." if miss else "") + "\n")

    w("## 2. Per-turn snapshot: chatcli's append vs rewriting the whole state\n")
    w("| turn | context tokens | chatcli append | chatcli ms | whole-state rewrite | rewrite ms | bytes ratio | time ratio |")
    w("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in res["build"]["turns"]:
        w(f"| {t['turn']} | {t['n_past']:,} | {f_mib(t['append_bytes'])} | {f_ms(t['append_ms'])} | "
          f"{f_mib(t['rewrite_bytes'])} | {f_ms(t['rewrite_ms'])} | {f_x(t['rewrite_bytes'] / max(1, t['append_bytes']))} | "
          f"{f_x(_ratio(t['rewrite_ms'], t['append_ms']))} |")
    w("")
    w("chatcli ms = extracting the turn's KV cells (`llama_state_seq_get_data`) + appending and fsyncing the "
      "records (`TurnStats.save_ms`); rewrite = `engine.save_cells(0, n)` + the logits written as one snapshot "
      "with chatcli's own atomic write (temp file, fsync, rename, fsync dir). A turn's append holds the user "
      "message's cells, the reply's cells and the logits after the user message (kept so /regen evaluates "
      "nothing).\n")

    w("## 3. /regen and /edit: time to the first new token (ms)\n")
    w("| target | tokens | /regen | re-ingest | speedup | /edit | re-ingest | speedup |")
    w("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in s["rows"]:
        w(f"| {r['target']} | {r['tokens']:,} | {f_ms(r['regen'])} | {f_ms(r['regen_re'])} | "
          f"{f_x(r['regen_re'] / r['regen'])} | {f_ms(r['edit'])} | {f_ms(r['edit_re'])} | "
          f"{f_x(r['edit_re'] / r['edit'])} |")
    w("")
    w("chatcli: a fresh copy of the conversation opened in one process, `conv.regen()` then "
      "`conv.edit(None, text)` of the last message, each timed to its first token. Re-ingest = a fresh context "
      "evaluates every token up to the end of the user message being answered (the original one for /regen, "
      "the edited one for /edit) and samples; tokens evaluated (/regen, /edit): "
      + ", ".join(f"{r['regen_tokens']:,.0f}/{r['edit_tokens']:,.0f}" for r in s["rows"])
      + ". chatcli's /regen evaluates nothing (the logits after the user message are saved); its /edit "
      "evaluates only the new message.\n")

    t = s["thr"]
    w("## 4. Throughput: chatcli's engine vs a bare llama-cpp-python loop (tokens/s)\n")
    w("| | chatcli | bare llama_decode loop | overhead | chatcli per CPU-s | bare per CPU-s | overhead (CPU) |")
    w("|---|---:|---:|---:|---:|---:|---:|")
    for kind, label in (("prompt", f"prompt eval ({t['prompt_tokens']} tokens)"),
                        ("decode", f"decode ({t['decode_tokens']:.0f} tokens, greedy)")):
        w(f"| {label} | {t['chatcli_' + kind]:,.1f} | {t['bare_' + kind]:,.1f} | {t[kind + '_overhead']:+.1f} % | "
          f"{t['chatcli_' + kind + '_cpu']:,.1f} | {t['bare_' + kind + '_cpu']:,.1f} | "
          f"{t[kind + '_cpu_overhead']:+.1f} % |")
    w("")
    w(f"Same process, same model file, identical context parameters; {t['pairs']} pair(s) after a short warm-up, "
      "order flipped every pair. Prompt eval: both contexts evaluate the same tokens from empty, "
      f"{res['config'].get('prompt_chunk', '?')} tokens at a time, taking turns; decode: both decode greedily "
      "from the same prompt, one token each in turn. So both sides see the same machine load; each side's time "
      "is the sum of its own steps. Per CPU-s = tokens per second "
      "of this process's CPU time (all threads): on a busy machine the wall clock also counts time other "
      "processes held the cores. Rates are pooled over all pairs; overhead = 1 − median of the per-pair ratios "
      "(goal: within 3 %), which cancels load changes between pairs.\n")

    m = res["memory"]
    mk = m["model_file_bytes"] + m["kv_bytes"]
    w("## 5. Memory: peak RSS\n")
    w("| | bytes | ÷ (model + KV) |")
    w("|---|---:|---:|")
    w(f"| `chatcli {m['cmd']}` (stdin `hi`) | {f_mib(m['chatcli_talk_rss'])} | {f_x(m['chatcli_talk_rss'] / mk)} |")
    if m.get("chatcli_resume_rss"):
        w(f"| `chatcli resume` of the {m['resume_tokens']:,}-token conversation (state.kv "
          f"{f_mib(m['resume_state_bytes'])}), stdin `hi` | {f_mib(m['chatcli_resume_rss'])} | "
          f"{f_x(m['chatcli_resume_rss'] / mk)} |")
    w(f"| llama-cpp-python `Llama` + one chat completion | {f_mib(m['llama_rss'])} | {f_x(m['llama_rss'] / mk)} |")
    if m.get("python_imports_rss"):
        w(f"| Python importing chatcli (no model) | {f_mib(m['python_imports_rss'])} | |")
    w(f"| model file | {f_mib(m['model_file_bytes'])} | |")
    w(f"| KV cache: {m['n_ctx']} × {m['kv_bytes_per_token']:,} B/token | {f_mib(m['kv_bytes'])} | |")
    w(f"| model + KV | {f_mib(mk)} | 1.00× |")
    w("")
    w("Peak RSS of that one child (`os.wait4`). KV bytes per token from the GGUF metadata (layers × KV heads × "
      f"(K + V head size) × 2 bytes, f16); `Engine.save_cells` gives {res['build']['kv_bytes_per_token_saved']:,} "
      "B/token (the same plus llama.cpp's per-cell position and sequence ids).\n")

    p = s["persona"]
    w("## 6. Persona prefix cache: new conversation to first token (ms)\n")
    w("| persona prefix tokens | uncached | cached | speedup |")
    w("|---:|---:|---:|---:|")
    w(f"| {p['prefix_tokens']:,} | {f_ms(p['uncached'])} | {f_ms(p['cached'])} | {f_x(p['uncached'] / p['cached'])} |")
    w("")
    w("Uncached = `<CHATCLI_HOME>/cache/prefix` deleted first." + ("" if p["hit"] else
      " **Warning:** a cached run did not report a cache hit.") + "\n")
    _section_ba(w, s.get("ba"))
    if charts:
        w("## Charts\n")
        for ch in charts:
            w(f"![{ch}]({ch})\n")
    return "\n".join(out)


def charts(res: dict[str, Any], s: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    turns = res["build"]["turns"]
    x = [t["n_past"] for t in turns]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(x, [t["append_bytes"] / 2**20 for t in turns], "o-",
            label="chatcli append (this turn's cells: ∝ the turn's tokens)")
    a1.plot(x, [t["rewrite_bytes"] / 2**20 for t in turns], "s--", label="rewrite whole state")
    a1.set_xlabel("conversation length (tokens)")
    a1.set_ylabel("MiB written per turn")
    a1.set_ylim(bottom=0)
    a1.legend()
    a1.grid(alpha=0.3)
    a2.plot(x, [t["append_ms"] for t in turns], "o-", label="chatcli append")
    a2.plot(x, [t["rewrite_ms"] for t in turns], "s--", label="rewrite whole state")
    a2.set_xlabel("conversation length (tokens)")
    a2.set_ylabel("ms per turn (KV extraction + write + fsync)")
    a2.set_ylim(bottom=0)
    a2.legend()
    a2.grid(alpha=0.3)
    fig.suptitle(f"Per-turn state snapshot cost — {res['build']['model_name']}")
    fig.tight_layout()
    fig.savefig(out / "snapshot_cost.png", dpi=110)
    plt.close(fig)
    files.append("snapshot_cost.png")

    rows = s["rows"]
    labels = [f"{r['tokens']:,}" for r in rows]
    series = [("chatcli resume", "chatcli_ttft"), ("cold re-ingest", "cold_ttft"),
              ("llama-cpp-python load_state", "ls_ttft"), ("LlamaDiskCache", "dc_ttft")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(series)
    for i, (name, key) in enumerate(series):
        ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))], [r[key] for r in rows], width,
               label=name)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_xlabel("conversation length (tokens)")
    ax.set_ylabel("ms to first token of the next reply (log)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    ax.set_title("Resume in a new process: time to first token")
    fig.tight_layout()
    fig.savefig(out / "resume_ttft.png", dpi=110)
    plt.close(fig)
    files.append("resume_ttft.png")
    return files


def write(res: dict[str, Any], out: Path) -> list[Path]:
    s = summarize(res)
    made = charts(res, s, out)
    (out / "results.md").write_text(markdown(res, s, made))
    return [out / "results.md", *(out / f for f in made)]


def _section_ba(w: Any, ba: dict[str, Any] | None) -> None:
    if not ba:
        return
    rev = ba["rev"]
    w(f"## 7. Before / after issue #15: chatcli at `{rev['describe']}` (`--before {rev['rev']}`) vs this tree, same run\n")
    w("Both trees measured by the same workers in this run, alternating, on the same checkpoints "
      "(the state files the new tree wrote; their identity is unchanged, so the old tree restores them too).\n")
    w("### 7a. Resume (ms; page cache warm)\n")
    w("| tokens | state restore before | after | plain read | restore ÷ read before | after (goal ≤ 2×) | "
      "resume TTFT before | after | cold ÷ after (goal ≥ 50×) | load_state ÷ after (goal > 1×) |")
    w("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in ba["rows"]:
        w(f"| {r['tokens']:,} | {f_ms(r['restore_before'])} | {f_ms(r['restore_after'])} | {f_ms(r['read_after'])} | "
          f"{f_x(r['ratio_before'])} | {f_x(r['ratio_after'])} | {f_ms(r['ttft_before'])} | {f_ms(r['ttft_after'])} | "
          f"{f_x(_ratio(r['cold'], r['ttft_after']))} | {f_x(_ratio(r['load_state'], r['ttft_after']))} |")
    w("")
    w("restore ÷ read = the median over repetitions of each process's own ratio (state restore ÷ a plain "
      "`read()` of the same number of bytes right after, in the same process).\n")
    ta, tb = ba["thr_after"], ba["thr_before"]
    w("### 7b. Engine overhead vs a bare llama-cpp-python loop (positive = chatcli slower)\n")
    w("| | before (CPU) | before (wall) | after (CPU) | after (wall) |")
    w("|---|---:|---:|---:|---:|")
    for kind in ("prompt", "decode"):
        b = f"{tb[kind + '_cpu']:+.1f} % | {tb[kind]:+.1f} %" if tb else "– | –"
        w(f"| {kind} | {b} | {ta[kind + '_cpu']:+.1f} % | {ta[kind]:+.1f} % |")
    w("")
    w("Two runs of the throughput worker (section 4), one per tree; each compares its engine with the bare loop "
      "in the same process, interleaved. Goal for decode: ≤ 1 %.\n")
    st = ba.get("startup")
    if not st:
        return
    trees = [t for t in ("before", "after") if t in st]
    w(f"### 7c. Whole process to the first token ({st['tokens']:,}-token conversation), and `ls` (ms)\n")
    w("| | " + " | ".join(trees) + " |")
    w("|---|" + "---:|" * len(trees))
    rows = [("`chatcli talk` (new conversation, persona prefix cached), stdin `hi`, 1 token", "talk_cli"),
            ("`chatcli resume ID`, stdin `hi`, 1 token", "resume_cli")]
    for label, k in rows:
        w(f"| {label} | " + " | ".join(f_ms(st[t][k]) for t in trees) + " |")
    w("| resume ÷ talk (goal ≤ 1.05×) | " + " | ".join(f_x(_ratio(st[t]['resume_cli'], st[t]['talk_cli'])) for t in trees) + " |")
    w("| `chatcli ls`, 100 conversations (goal ≤ 200 ms) | " + " | ".join(f_ms(st[t]["ls_cli"]) for t in trees) + " |")
    w("")
    w("Wall time of the whole `python -m chatcli …` process, spawn to exit, `--max-tokens 1`.\n")
    w("### 7d. Where a process's time goes (ms, in-process marks on the wall clock)\n")
    labels = {"interpreter_ms": "interpreter start", "imports_ms": "imports (chatcli, llama_cpp, numpy, …)",
              "identity_ms": "model identity (GGUF header)", "model_load_ms": "model load + context (llama.cpp)",
              "conversation_ms": "new conversation / resume (state restore)", "first_token_ms": "message → first token",
              "total_ms": "total to the first token"}
    cols = [(t, kind) for kind in ("talk", "resume") for t in trees]
    w("| step | " + " | ".join(f"{kind} {t}" for t, kind in cols) + " |")
    w("|---|" + "---:|" * len(cols))
    for k, label in labels.items():
        w(f"| {label} | " + " | ".join(f_ms(st[t][kind][k]) for t, kind in cols) + " |")
    w("")
    w("The `startup` worker: spawn time from the parent, then marks after the imports the CLI needs, "
      "`resolve_model`, `Session.build` (llama.cpp load), `new_conversation`/`open_conversation`, and the first "
      f"token of the reply to the next message. Resumes re-evaluated {max(st[t]['reevaluated'] for t in trees)} tokens.\n")
