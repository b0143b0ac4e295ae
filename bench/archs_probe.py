"""Which state promises hold on which llama.cpp memory kind, through the CLI as a user drives it (issue #20).

    python -m bench.archs_probe [--arch REGEX] [--out DIR] [--markdown]

For every fixture GGUF that ``test-llama-archs`` writes (see tests/archs.py), in a subprocess per fixture so that
a llama.cpp abort costs one row, not the probe, it runs chatcli with piped stdin, greedy, a small context:

- control: ``talk`` m1 m2 m3 in one process (and ``talk`` m1 m3, the history an undo of m2 leaves);
- resume: ``talk`` m1 m2, then ``resume`` + m3: same reply as the control, 0 tokens re-evaluated;
- regen: ``regen`` of the control's last reply: the same reply (greedy), 0 re-evaluated;
- undo: ``talk`` m1 m2, then ``resume`` + ``/undo`` + m3: the reply of ``talk`` m1 m3, 0 re-evaluated.

Each cell says ``ok``, ``re-evaluated N`` (right reply, history evaluated again), ``differs`` (wrong reply),
the error line, or ``aborted (SIGABRT)``. The memory kind comes from llama.cpp itself (``llama_model_is_recurrent``
/ ``_hybrid`` / ``_diffusion``, ``llama_model_n_swa``) and the GGUF's keys (MLA: ``*.attention.kv_lora_rank``; DeepSeek-V4's
compressed cache: architecture ``deepseek4``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.archs import SKIP_REASON, archs_binary, generate

MESSAGES = ("hello there, how are you", "tell me about the sea", "and the mountains")
# The fixtures have no EOS and a trained context of 256: short replies, a context that holds three exchanges
# after the persona's system prompt (~60 tokens with the dummy tokenizer).
# `regen` takes only these; `talk` and `resume` take the context's too (a conversation does not keep --reserve).
FLAGS = ("--temperature", "0", "--max-tokens", "8")
TALK_FLAGS = (*FLAGS, "--threads", "1", "--n-ctx", "256", "--reserve", "32")
CALL_TIMEOUT = 300.0
OPERATIONS = ("control", "resume", "regen", "undo")


@dataclass
class Call:
    """One chatcli process: its exit code, replies (stdout lines) and stderr."""

    code: int
    replies: list[str]
    stderr: str

    def failure(self) -> str | None:
        """Why this call failed, as one line, or None when it exited 0."""
        if self.code < 0:
            # llama.cpp says why before it aborts: the GGML_ASSERT line is what to fix.
            why = next((ln.strip() for ln in self.stderr.splitlines() if "GGML_ASSERT" in ln), "")
            why = why[why.find("GGML_ASSERT"):][:120] if why else ""
            return f"aborted ({signal.Signals(-self.code).name}{': ' + why if why else ''})"
        if self.code == 0:
            return None
        # Typer draws usage errors in a box: keep the text inside.
        lines = [s for s in (ln.strip(" │╭╰╮╯─") for ln in self.stderr.splitlines()) if s]
        picked = next((ln for ln in reversed(lines) if re.match(r"(error|\w*Error|GGML_ASSERT|.*assert)", ln)), None)
        return f"exit {self.code}: {(picked or (lines[-1] if lines else 'no output'))[:160]}"

    def reevaluated(self) -> int:
        """The largest 're-evaluated N' chatcli reported (resume, undo and regen lines say it)."""
        found = [int(n) for n in re.findall(r"re-evaluated (\d+)", self.stderr)]
        return max(found, default=0)

    def conversation_id(self) -> str | None:
        m = re.search(r"conversation (\w+) saved", self.stderr)
        return m.group(1) if m else None


def chatcli(home: Path, args: list[str], stdin: str = "") -> Call:
    env = {**os.environ, "CHATCLI_HOME": str(home), "NO_COLOR": "1"}
    cmd = [sys.executable, "-m", "chatcli", *args] if _has_main() else [_script(), *args]
    try:
        proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, timeout=CALL_TIMEOUT)
    except subprocess.TimeoutExpired:
        return Call(124, [], f"error: timed out after {CALL_TIMEOUT:.0f} s")
    return Call(proc.returncode, [ln for ln in proc.stdout.splitlines() if ln.strip()], proc.stderr)


def _has_main() -> bool:
    return (Path(__file__).resolve().parent.parent / "chatcli" / "__main__.py").is_file()


def _script() -> str:
    return str(Path(sys.executable).with_name("chatcli"))


def last_reply(call: Call) -> str | None:
    return call.replies[-1] if call.replies else None


def verdict(call: Call, got: str | None, want: str | None) -> str:
    failed = call.failure()
    if failed:
        return failed
    if got is None or want is None or got != want:
        return "differs"
    n = call.reevaluated()
    return "ok" if n == 0 else f"re-evaluated {n}"


_QUIET: object = None


def memory_kind(model: Path) -> str:
    """The kinds of memory llama.cpp builds for ``model``: recurrent / hybrid / SWA / MLA / DSV4, else attention."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    # Quiet: llama.cpp's load log is pages per model. The callback must outlive the call (ctypes keeps no ref).
    global _QUIET
    _QUIET = llama_cpp.llama_log_callback(lambda *_: None)
    llama_cpp.llama_log_set(_QUIET, None)
    params = llama_cpp.llama_model_default_params()
    # A whole load: a vocab-only one skips the hyperparameters (n_swa reads 0 there).
    params.n_gpu_layers = 0
    model_p = llama_cpp.llama_model_load_from_file(str(model).encode(), params)
    if not model_p:
        return "unloadable"
    try:
        def meta(key: str) -> str | None:
            buf = bytes(256)
            n = llama_cpp.llama_model_meta_val_str(model_p, key.encode(), buf, len(buf))
            return buf[:n].decode() if n >= 0 else None

        arch = meta("general.architecture") or "?"
        kinds = []
        if llama_cpp.llama_model_is_hybrid(model_p):
            kinds.append("hybrid")
        elif llama_cpp.llama_model_is_recurrent(model_p):
            kinds.append("recurrent")
        if llama_cpp.llama_model_n_swa(model_p) > 0:
            kinds.append("SWA")
        if meta(f"{arch}.attention.kv_lora_rank") not in (None, "0"):
            kinds.append("MLA")
        if arch == "deepseek4":
            kinds.append("DSV4")
        if llama_cpp.llama_model_is_diffusion(model_p):
            kinds.append("diffusion")  # non-causal (Dream, LLaDA): so its row is not read as plain attention
        return "+".join(kinds) or "attention"
    finally:
        llama_cpp.llama_model_free(model_p)


def kind_in_child(model: Path) -> str:
    """``memory_kind`` in its own process: a load that aborts is this column's result, not the row's."""
    proc = subprocess.run([sys.executable, "-m", "bench.archs_probe", "--kind", str(model)], capture_output=True,
                          text=True, timeout=CALL_TIMEOUT)
    if proc.returncode < 0:
        return f"load aborted ({signal.Signals(-proc.returncode).name})"
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if proc.returncode == 0 and lines else f"load failed (exit {proc.returncode})"


@dataclass
class Row:
    fixture: str
    kind: str = "?"
    cells: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def probe_one(model: Path, work: Path) -> Row:
    """All operations on one fixture (runs in the per-fixture subprocess)."""
    row = Row(model.stem, kind_in_child(model))
    if "diffusion" in row.kind:
        # Non-causal (Dream, LLaDA): no KV memory to keep; chatcli refuses it at load in one line.
        refused = chatcli(work / "control", ["talk", "-m", str(model), *TALK_FLAGS], f"{MESSAGES[0]}\n")
        row.cells = {op: "not a chat model" if refused.code > 0 else (refused.failure() or "loaded")
                     for op in OPERATIONS}
        return row
    m = ["-m", str(model)]
    m1, m2, m3 = MESSAGES
    control = chatcli(work / "control", ["talk", *m, *TALK_FLAGS], f"{m1}\n{m2}\n{m3}\n")
    skipped = chatcli(work / "skipped", ["talk", *m, *TALK_FLAGS], f"{m1}\n{m3}\n")
    failed = control.failure() or skipped.failure()
    want3 = control.replies[2] if len(control.replies) == 3 else None
    want_undo = skipped.replies[1] if len(skipped.replies) == 2 else None
    row.cells["control"] = failed or ("ok" if want3 and want_undo else f"{len(control.replies)} replies of 3")

    first = chatcli(work / "resume", ["talk", *m, *TALK_FLAGS], f"{m1}\n{m2}\n")
    resumed = chatcli(work / "resume", ["resume", *m, *TALK_FLAGS], f"{m3}\n")
    row.cells["resume"] = first.failure() or verdict(resumed, last_reply(resumed), want3)

    conv = control.conversation_id()
    if conv is None:
        row.cells["regen"] = failed or "no conversation"
    else:
        regen = chatcli(work / "control", ["regen", conv, *m, *FLAGS])
        row.cells["regen"] = verdict(regen, last_reply(regen), want3)

    first = chatcli(work / "undo", ["talk", *m, *TALK_FLAGS], f"{m1}\n{m2}\n")
    undone = chatcli(work / "undo", ["resume", *m, *TALK_FLAGS], f"/undo\n{m3}\n")
    row.cells["undo"] = first.failure() or verdict(undone, last_reply(undone), want_undo)
    return row


def run_child(model: Path, timeout: float) -> Row:
    """``probe_one`` in its own process: a llama.cpp abort (in the memory probe or anywhere) is one row's result."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="archs-probe-") as work:
        cmd = [sys.executable, "-m", "bench.archs_probe", "--one", str(model), "--work", work]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            row = Row(model.stem, cells={op: f"timed out after {timeout:.0f} s" for op in OPERATIONS})
        else:
            lines = proc.stdout.strip().splitlines()
            if proc.returncode == 0 and lines:
                data = json.loads(lines[-1])
                row = Row(data["fixture"], data["kind"], data["cells"])
            else:
                why = (f"probe aborted ({signal.Signals(-proc.returncode).name})" if proc.returncode < 0
                       else f"probe exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:160]}")
                row = Row(model.stem, cells={op: why for op in OPERATIONS})
    row.seconds = time.perf_counter() - started
    return row


def table(rows: list[Row]) -> str:
    head = ["fixture", "memory", *OPERATIONS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r.fixture, r.kind, *(r.cells.get(op, "") for op in OPERATIONS)]) + " |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    """Fixtures grouped by their whole result, most common first: the issue's table."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for r in rows:
        groups.setdefault(tuple(r.cells.get(op, "") for op in OPERATIONS[1:]), []).append(f"{r.fixture} ({r.kind})")
    out = ["| resume · regen · undo | fixtures |", "|---|---|"]
    for key, names in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        out.append(f"| {' · '.join(key)} | {len(names)}: {', '.join(names)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--arch", help="architecture name or regex (test-llama-archs -a); default: all")
    ap.add_argument("--out", type=Path, help="keep the fixtures here (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per fixture")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--kind", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.kind is not None:
        print(memory_kind(args.kind))
        return 0
    if args.one is not None:
        row = probe_one(args.one, args.work)
        print(json.dumps({"fixture": row.fixture, "kind": row.kind, "cells": row.cells}))
        return 0
    if archs_binary() is None:
        print(f"error: {SKIP_REASON}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="archs-fixtures-") as tmp:
        out = args.out or Path(tmp)
        started = time.perf_counter()
        fixtures = generate(out, args.arch)
        print(f"generated {len(fixtures)} fixtures in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        rows = []
        for name, path in sorted(fixtures.items()):
            rows.append(run_child(path, args.timeout))
            r = rows[-1]
            print(f"{name:28} {r.kind:16} {' | '.join(r.cells.get(op, '') for op in OPERATIONS)}  "
                  f"({r.seconds:.1f} s)", file=sys.stderr, flush=True)
    print(table(rows))
    print()
    print(summary(rows))
    print(f"\n{len(rows)} fixtures in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1), "utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
