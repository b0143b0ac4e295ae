"""Fork cost: a fork that shares the parent's state bytes (hard link + BASE record) against a byte copy.

    python -m bench.fork [--tokens 2000] [--reps 5]

Builds one conversation of about ``--tokens`` tokens (long user messages, short greedy replies) in a
temporary CHATCLI_HOME, then forks it at its last user message (what a client's regenerate does) with
each method, alternately, ``--reps`` times: wall time of the fork, bytes it added to the disk (each inode
counted once), and the time to open the fork again (restore) to check it costs the same either way.
Results: bench/results/fork.md and fork.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results"
PARAGRAPH = ("Tell me about the garden: the tomatoes were sown in March and planted out in May, the basil "
             "went into pots by the kitchen window, and the runner beans climbed the fence by July. ")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="chatcli-forkbench-"))
    os.environ["CHATCLI_HOME"] = str(home)

    from chatcli.config.settings import get_paths
    from chatcli.core.files.store import ConversationStore
    from chatcli.core.forking import fork_state
    from chatcli.core.kv.budget import total_bytes
    from tests.drive import build_session, drain

    session = build_session(n_ctx=max(4096, a.tokens + 512), max_tokens=8)
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    t0 = time.perf_counter()
    while session.engine.n_past < a.tokens - 120:
        drain(conv.send(PARAGRAPH * 4))
    build_s = time.perf_counter() - t0
    r = conv.r
    cut = [m for m in r.active if m.role == "user"][-1].p1  # regenerate: the history minus the last reply
    n_tokens = session.engine.n_past
    conv.close()
    paths = get_paths()
    store = ConversationStore(paths.conversations_dir)
    parent = store.resolve(conv.id)
    state_bytes = parent.state_path.stat().st_size

    rows: dict[str, dict[str, list[float]]] = {m: {"fork_ms": [], "bytes": [], "restore_ms": []} for m in ("copy", "link")}
    for rep in range(a.reps):
        for method in (("copy", "link") if rep % 2 == 0 else ("link", "copy")):
            child = store.create({"title": "bench fork"})
            before = total_bytes(paths.conversations_dir, None)
            t = time.perf_counter()
            n = fork_state(parent.state_path, child.state_path, cut, share=(method == "link"))
            rows[method]["fork_ms"].append(1000 * (time.perf_counter() - t))
            rows[method]["bytes"].append(total_bytes(paths.conversations_dir, None) - before)
            assert n == cut
            # Reading the fork back (the index and every crc, as a restore does).
            from chatcli.core.kv import records as sf

            t = time.perf_counter()
            res = sf.scan(child.state_path)
            rows[method]["restore_ms"].append(1000 * (time.perf_counter() - t))
            assert res.problem == "" and res.live()[2] == cut
            store.remove(child)
    session.close()
    shutil.rmtree(home, ignore_errors=True)
    load = os.getloadavg()
    out: dict[str, Any] = {"tokens": n_tokens, "cut": cut, "parent_state_bytes": state_bytes, "reps": a.reps,
                           "build_s": round(build_s, 1), "loadavg": [round(x, 2) for x in load],
                           "results": {m: {k: statistics.median(v) for k, v in d.items()} for m, d in rows.items()}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fork.json").write_text(json.dumps(out, indent=2) + "\n")
    res_c, res_l = out["results"]["copy"], out["results"]["link"]
    md = [
        "# Fork: shared bytes (hard link + BASE record) vs byte copy",
        "",
        f"A {n_tokens}-token conversation (state file {state_bytes / 2**20:.1f} MiB), forked at its last user "
        f"message (a client's regenerate), {a.reps} times per method, alternately; medians. "
        f"Load average {load[0]:.2f} (2 cores shared).",
        "",
        "| method | fork time | bytes added on disk | scan of the fork (crc of all it uses) |",
        "|---|---:|---:|---:|",
        f"| copy (before) | {res_c['fork_ms']:.1f} ms | {res_c['bytes'] / 2**20:.2f} MiB | {res_c['restore_ms']:.1f} ms |",
        f"| link (now) | {res_l['fork_ms']:.1f} ms | {res_l['bytes'] / 1024:.2f} KiB | {res_l['restore_ms']:.1f} ms |",
        "",
        f"Ratio: fork time {res_c['fork_ms'] / max(res_l['fork_ms'], 1e-6):.0f}x faster, "
        f"{res_c['bytes'] / max(res_l['bytes'], 1):.0f}x fewer bytes.",
        "",
    ]
    (RESULTS / "fork.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
