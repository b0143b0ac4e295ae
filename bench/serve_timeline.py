"""Every decode and every scheduler wait of ``chatcli serve --parallel N`` for one section-2 run, next to llama-server's.

    python -m bench.serve_timeline                       # N = 2, 4, 8; bench/decode.py --quick's work
    python -m bench.serve_timeline --clients 2 --full    # FULL's work (3 turns, 48-token replies)
    python -m bench.serve_timeline --chatcli /work/main  # another tree's chatcli (an A/B of the counts)
    python -m bench.serve_timeline --clients 1 --full --reps 3  # runs 0-2 on each (a new conversation
                                                                # after the first: its persona prefix cached)

Each N starts a fresh ``chatcli serve`` (as bench/decode.py does) inside this script's ``--serve`` mode,
which wraps the functions that decode and wait (``COMPUTE.run`` for every ``llama_decode``, the scheduler's
``submit``/``_lead``/``_regather``, the batch context's copies, the service's requests) and writes what
they did when the server stops; then a ``llama-server -np N --kv-unified`` (``--metrics -v
--log-timestamps``: its decodes counted and timed from its log, ``n_decode_total`` from ``/metrics``). The
same clients as bench/decode.py section 2 (N at once, each its own conversation, greedy) run once on each.

Counts (decodes, tokens and sequences per decode, copies, waits taken) do not depend on the machine's load;
durations do. Writes ``<out>/serve_timeline.md`` (summary + chatcli's timeline) and ``serve_timeline.json``.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import functools
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__" and "--serve" in sys.argv:
    # The served chatcli is the one on $CHATCLI_TIMELINE_PATH (another tree's), ahead of this script's own.
    target = os.environ.get("CHATCLI_TIMELINE_PATH")
    if target:
        sys.path.insert(0, target)
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


# -- the wrapped server -------------------------------------------------------------------------------------

EVENTS: dict[str, list[dict[str, Any]]] = {"decode": [], "submit": [], "lead": [], "regather": [], "copy": [],
                                           "request": [], "join": [], "copy_work": [], "mark": []}

# The steps of a request around its decodes, each timed where it runs (module, attribute): a timeline line each.
MARKS: list[tuple[str, str]] = [
    ("chatcli.server.schemas", "parse_chat_request"),
    ("chatcli.server.service", "ChatService._prepare"),
    ("chatcli.server.service", "ChatService._acquire"),
    ("chatcli.server.service", "ChatService._release"),
    ("chatcli.core.files.store", "ConversationStore.create"),
    ("chatcli.core.files.store", "ConversationDir.lock"),
    ("chatcli.core.files.store", "ConversationDir.write_meta"),
    ("chatcli.core.files.store", "ConversationDir.append_event"),
    ("chatcli.core.files.store", "ConversationDir.read_transcript"),
    ("chatcli.core.files.fsutil", "append_durably"),
    ("chatcli.core.files.fsutil", "atomic_write_with"),
    ("chatcli.core.files.fsutil", "fsync_dir"),
    ("chatcli.core.kv.records", "StateWriter.append"),
    ("chatcli.core.kv.log", "CellLog.start"),
    ("chatcli.core.kv.log", "CellLog.commit"),
    ("chatcli.core.conversation", "Conversation._user_tokens"),
    ("chatcli.core.conversation", "Conversation._saved"),
    ("chatcli.core.conversation", "Conversation._write_meta"),
    ("chatcli.core.kv.log", "CellLog.settle"),
    ("chatcli.core.kv.log", "CellLog._point_record"),
    ("chatcli.backends.llamacpp", "Engine.save_cells"),
    ("chatcli.server.service", "ChatService._settle"),
    ("chatcli.server.index", "PrefixIndex.refresh"),
    ("chatcli.server.index", "PrefixIndex.lookup"),
    ("chatcli.server.index", "PrefixIndex.update"),
    ("chatcli.server.service", "ChatService._split"),
    ("chatcli.server.service", "ChatService._choose"),
    ("chatcli.server.service", "ChatService._open"),
    ("chatcli.core.conversation", "Conversation._touch_meta"),
    ("chatcli.core.reply", "closing_tokens"),
    ("chatcli.core.reply", "reasoning_parts"),
    ("chatcli.core.transcript", "Transcript.message"),
    ("chatcli.core.kv.log", "CellLog.reply_done"),
]


def _now() -> float:
    return time.monotonic()  # CLOCK_MONOTONIC: the clients' perf_counter reads the same clock on Linux


def install() -> None:
    import llama_cpp

    from chatcli.backends import batching, llamacpp
    from chatcli.server import service

    compute = llamacpp.COMPUTE
    # The batch contexts (``_SharedBatch``), by address: told apart from a conversation's own context by
    # that, not by their sequence count (a batch context of two streams has as many as an own context).
    batch_ctx: set[int] = set()
    make0 = llamacpp._SharedBatch._make

    def make(self: Any) -> None:
        make0(self)
        batch_ctx.add(ctypes.cast(self._ctx, ctypes.c_void_p).value or 0)

    llamacpp._SharedBatch._make = make  # type: ignore[method-assign]

    def is_batch(ctx: Any) -> bool:
        return (ctypes.cast(ctx, ctypes.c_void_p).value or 0) in batch_ctx
    run0 = compute.run
    mem_of: dict[int, Any] = {}

    def run(fn: Any, *args: Any) -> Any:
        if fn is not llama_cpp.llama_decode:
            return run0(fn, *args)
        ctx, b = args
        addr = ctypes.cast(ctx, ctypes.c_void_p).value or 0
        mem = mem_of.get(addr)
        if mem is None:
            mem = mem_of[addr] = llama_cpp.llama_get_memory(ctx)
        n_seq = llama_cpp.llama_n_seq_max(ctx)
        cells = 0
        for s in range(n_seq):
            hi = llama_cpp.llama_memory_seq_pos_max(mem, s)
            if hi >= 0:
                cells += hi - llama_cpp.llama_memory_seq_pos_min(mem, s) + 1
        seqs: dict[int, int] = {}
        for i in range(b.n_tokens):
            sid = int(b.seq_id[i][0])
            seqs[sid] = seqs.get(sid, 0) + 1
        inner: list[float] = []

        def timed(*a: Any) -> Any:  # on the compute thread: the C call alone, without the hop and the GIL
            i0 = _now()
            try:
                return fn(*a)
            finally:
                inner.append(_now() - i0)

        t0 = _now()
        try:
            return run0(timed, *args)
        finally:
            EVENTS["decode"].append({"t0": t0, "t1": _now(), "batch": addr in batch_ctx, "ctx": addr, "n_tokens": int(b.n_tokens),
                                     "seqs": seqs, "cells": cells, "thread": threading.current_thread().name,
                                     "inner": inner[0] if inner else 0.0})

    compute.run = run  # type: ignore[method-assign]

    # The thread count decodes are given (the machine's load as chatcli judged it): a line when it changes.
    from chatcli.backends import cpuload

    threads0 = cpuload.FreeCores.threads
    last: dict[int, int] = {}

    @functools.wraps(threads0)
    def threads(self: Any) -> int:
        t0 = _now()
        n = threads0(self)
        if last.get(id(self)) != n:
            last[id(self)] = n
            EVENTS["mark"].append({"t0": t0, "t1": _now(), "what": f"threads -> {n}",
                                   "thread": threading.current_thread().name})
        return n

    cpuload.FreeCores.threads = threads  # type: ignore[method-assign]

    sched = batching.BatchScheduler
    submit0, lead0, regather0, join0, leave0 = sched.submit, sched._lead, sched._regather, sched.join, sched.leave

    @functools.wraps(submit0)
    def submit(self: Any, request: Any, **kw: Any) -> Any:
        e = {"t0": _now(), "size": len(request.tokens), "seq": request.seq, "gr": bool(kw.get("gathers_returning")),
             "active": self.active, "returning": self.returning(), "pending": len(self._pending),
             "thread": threading.current_thread().name}
        try:
            return submit0(self, request, **kw)
        finally:
            e["t1"] = _now()
            EVENTS["submit"].append(e)

    @functools.wraps(lead0)
    def lead(self: Any, own: Any) -> Any:
        e = {"t0": _now(), "pending": len(self._pending), "expected": self._expected(), "active": self.active,
             "window": self._window(), "first": self._first, "thread": threading.current_thread().name}
        try:
            return lead0(self, own)
        finally:
            e["t1"] = _now()
            EVENTS["lead"].append(e)

    @functools.wraps(regather0)
    def regather(self: Any) -> Any:
        e = {"t0": _now(), "pending": len(self._pending), "expected": self._expected()}
        try:
            return regather0(self)
        finally:
            e["t1"] = _now()
            e["pending_after"] = len(self._pending)
            EVENTS["regather"].append(e)

    @functools.wraps(join0)
    def join(self: Any, *a: Any, **kw: Any) -> Any:
        EVENTS["join"].append({"t": _now(), "what": "join", "returning": self.returning(), "active": self.active,
                               "thread": threading.current_thread().name})
        return join0(self, *a, **kw)

    @functools.wraps(leave0)
    def leave(self: Any, *a: Any, **kw: Any) -> Any:
        EVENTS["join"].append({"t": _now(), "what": "leave", "linger": bool(kw.get("linger")), "active": self.active,
                               "thread": threading.current_thread().name})
        return leave0(self, *a, **kw)

    sched.submit, sched._lead, sched._regather = submit, lead, regather  # type: ignore[method-assign]
    sched.join, sched.leave = join, leave  # type: ignore[method-assign]

    group = llamacpp._SharedBatch
    for name in ("enter_batch", "_copy_back"):
        fn0 = getattr(group, name)

        def wrapped(self: Any, m: Any, *a: Any, _fn: Any = fn0, _name: str = name, **kw: Any) -> Any:
            e = {"t0": _now(), "what": _name, "member": m._member, "from": m._batch_from, "n_past": m.n_past,
                 "keep": kw.get("keep"), "thread": threading.current_thread().name}
            try:
                return _fn(self, m, *a, **kw)
            finally:
                e["t1"] = _now()
                EVENTS["copy"].append(e)

        setattr(group, name, functools.wraps(fn0)(wrapped))

    # The copies' own work (no lock wait): reading a sequence out, writing one in.
    seq_data0 = llamacpp._seq_data
    set_data0 = llama_cpp.llama_state_seq_set_data

    def seq_data(ctx: Any, seq: int, what: str = "read out the cells") -> Any:
        t0 = _now()
        try:
            return seq_data0(ctx, seq, what)
        finally:
            EVENTS["copy_work"].append({"t0": t0, "t1": _now(), "what": "get", "batch": is_batch(ctx)})

    def set_data(ctx: Any, src: Any, size: int, seq: int) -> Any:
        t0 = _now()
        try:
            return set_data0(ctx, src, size, seq)
        finally:
            EVENTS["copy_work"].append({"t0": t0, "t1": _now(), "what": "set", "batch": is_batch(ctx),
                                        "bytes": size})

    llamacpp._seq_data = seq_data
    llama_cpp.llama_state_seq_set_data = set_data

    complete0 = service.ChatService.complete

    @functools.wraps(complete0)
    def complete(self: Any, req: Any, **kw: Any) -> Any:
        e: dict[str, Any] = {"t0": _now(), "first": None, "thread": threading.current_thread().name}
        try:
            for ev in complete0(self, req, **kw):
                if e["first"] is None and type(ev).__name__ == "Delta":
                    e["first"] = _now()
                yield ev
        finally:
            e["t1"] = _now()
            EVENTS["request"].append(e)

    service.ChatService.complete = complete  # type: ignore[method-assign]

    import importlib
    import inspect

    for mod_name, attr in MARKS:
        owner: Any = importlib.import_module(mod_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn0 = inspect.getattr_static(owner, name)
        label = f"{mod_name.rsplit('.', 1)[-1]}.{attr}"

        def marked(*a: Any, _fn: Any = fn0, _label: str = label, **kw: Any) -> Any:
            t0 = _now()
            try:
                out = _fn(*a, **kw)
            finally:
                EVENTS["mark"].append({"t0": t0, "t1": _now(), "what": _label, "thread": threading.current_thread().name})
            if inspect.isgenerator(out):  # a generator's work runs when it is iterated: time that too
                out = _timed_gen(out, _label)
            return out

        setattr(owner, name, functools.wraps(fn0)(marked))
        if not path:  # a module function: the modules that imported it by name call their own reference
            for m in list(sys.modules.values()):
                if getattr(m, "__name__", "").startswith("chatcli") and getattr(m, name, None) is fn0:
                    setattr(m, name, getattr(owner, name))


def _timed_gen(gen: Any, label: str) -> Any:
    t0 = _now()
    try:
        return (yield from gen)
    finally:
        EVENTS["mark"].append({"t0": t0, "t1": _now(), "what": label + " (iterated)",
                               "thread": threading.current_thread().name})


def serve_main(out: str, args: list[str]) -> None:
    install()

    def dump() -> None:
        Path(out).write_text(json.dumps(EVENTS))

    atexit.register(dump)
    from chatcli.cli.entry import main

    sys.argv = ["chatcli", "serve", *args]
    main()


# -- the driver ---------------------------------------------------------------------------------------------

_TS = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")


def _log_seconds(line: str) -> float | None:
    m = _TS.match(line)
    if not m:
        return None
    mnt, sec, ms, us = (int(x) for x in m.groups())  # llama.cpp's common/log.cpp: minutes.seconds.ms.us
    return mnt * 60 + sec + ms / 1e3 + us / 1e6


def parse_llama_log(path: Path) -> list[dict[str, Any]]:
    """llama-server's decodes from its ``-v --log-timestamps`` log: one per ``srv decode:`` line, timed to the
    ``done yielding to queue`` after it (the decode itself ran between); what it held from the lines before
    it (a generated token each ``slot decode token``, a prompt each ``new prompt``, with its whole length:
    the cached part is not subtracted)."""
    out: list[dict[str, Any]] = []
    start: float | None = None
    slots = 0
    prompt_tokens = 0
    prompts = 0
    with open(path, errors="replace") as fh:
        for line in fh:
            if "slot decode token" in line:
                slots += 1
            elif "new prompt, n_ctx_slot" in line:
                prompts += 1
                m = re.search(r"task\.n_tokens = (\d+)", line)
                if m:
                    prompt_tokens += int(m.group(1))
            elif "srv        decode: n_batch" in line:
                start = _log_seconds(line)
            elif "done yielding to queue" in line and start is not None:
                t1 = _log_seconds(line)
                out.append({"t0": start, "t1": t1 if t1 is not None else start, "slots": slots, "prompts": prompts,
                            "prompt_tokens": prompt_tokens})
                start = None
                slots = prompts = prompt_tokens = 0
    return out


def metrics(port: int) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.partition(" ")
            out[k.split(":", 1)[-1]] = float(v)
    return out


def clients(port: int, n: int, cfg: dict[str, Any], extra: dict[str, Any], reps: int = 1) -> dict[str, Any]:
    """bench/decode.py section 2's clients (same messages, ``extra`` its ``fixed_length`` fields) for runs 0
    to ``reps - 1``, one after another, each request's send, first and last token kept."""
    runs = [_clients(port, n, cfg, extra, rep) for rep in range(reps)]
    reqs = [q for r in runs for q in r["requests"]]
    lat = sorted(r["end"] - r["t0"] for r in reqs)
    return {"t0": runs[0]["t0"], "wall": runs[-1]["t0"] + runs[-1]["wall"] - runs[0]["t0"], "requests": reqs,
            "tokens": sum(r["tokens"] for r in reqs), "p50": lat[len(lat) // 2] if lat else None}


def _clients(port: int, n: int, cfg: dict[str, Any], extra: dict[str, Any], rep: int) -> dict[str, Any]:
    from bench.common import PARAGRAPHS
    from bench.decode import SYSTEM
    from bench.serve import chat

    reqs: list[dict[str, Any]] = []
    guard = threading.Lock()
    start = threading.Barrier(n)

    def client(i: int) -> None:
        msgs = [{"role": "system", "content": SYSTEM}]
        start.wait()
        for t in range(cfg["turns"]):
            para = PARAGRAPHS[(i * 5 + t + rep) % len(PARAGRAPHS)]
            msgs.append({"role": "user", "content": f"Client {i}, run {rep}, turn {t}. {para} What should I do?"})
            t0 = time.perf_counter()
            r = chat(port, msgs, cfg["reply"], extra)
            n_tok = (r.usage or {}).get("completion_tokens") or (r.timings or {}).get("predicted_n") or 0
            with guard:
                reqs.append({"client": i, "rep": rep, "turn": t, "t0": t0, "first": t0 + r.ttft, "last": t0 + r.last,
                             "end": t0 + r.total, "tokens": int(n_tok)})
            msgs.append({"role": "assistant", "content": r.text})

    th = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(r["end"] - r["t0"] for r in reqs)
    return {"t0": t0, "wall": wall, "requests": reqs, "tokens": sum(r["tokens"] for r in reqs),
            "p50": lat[len(lat) // 2] if lat else None}


def summarize_chatcli(ev: dict[str, list[dict[str, Any]]], t0: float, t1: float) -> dict[str, Any]:
    dec = [d for d in ev["decode"] if t0 <= d["t0"] <= t1]
    batch = [d for d in dec if d["batch"]]
    sizes: dict[str, int] = {}
    for d in batch:
        k = f"{len(d['seqs'])}"
        sizes[k] = sizes.get(k, 0) + 1
    prompts_alone = [d for d in dec if not d["batch"] and d["n_tokens"] > 1]
    tokens_alone = [d for d in dec if not d["batch"] and d["n_tokens"] == 1]
    prompts_batch = [d for d in batch if any(v > 1 for v in d["seqs"].values())]
    copies = [c for c in ev["copy"] if t0 <= c["t0"] <= t1]
    leads = [e for e in ev["lead"] if t0 <= e["t0"] <= t1]
    subs = [e for e in ev["submit"] if t0 <= e["t0"] <= t1]
    reg = [e for e in ev["regather"] if t0 <= e["t0"] <= t1]
    # A round's gather wait: from its oldest request to its leader's start.
    gather = [e["t0"] - e["first"] for e in leads]
    one_wide = [d for d in batch if len(d["seqs"]) == 1]
    return {
        "decodes": len(dec), "decode_s": sum(d["t1"] - d["t0"] for d in dec),
        "decode_inner_s": sum(d.get("inner", 0.0) for d in dec),
        "batch_decodes": len(batch), "batch_s": sum(d["t1"] - d["t0"] for d in batch),
        "own_decodes": len(dec) - len(batch), "own_s": sum(d["t1"] - d["t0"] for d in dec if not d["batch"]),
        "prompts_alone": len(prompts_alone), "tokens_alone": len(tokens_alone), "batch_with_prompt": len(prompts_batch),
        "prompt_decodes_s": sum(d["t1"] - d["t0"] for d in [*prompts_alone, *prompts_batch]),
        "token_decodes_s": sum(d["t1"] - d["t0"] for d in dec if not any(v > 1 for v in d["seqs"].values())),
        "one_wide_batch": len(one_wide), "seqs_per_batch_decode": dict(sorted(sizes.items(), key=lambda kv: int(kv[0]))),
        "mean_cells_batch": statistics.mean(d["cells"] for d in batch) if batch else 0,
        "copies": len(copies), "copy_s": sum(c["t1"] - c["t0"] for c in copies),
        "copy_work_s": sum(c["t1"] - c["t0"] for c in ev.get("copy_work", []) if t0 <= c["t0"] <= t1),
        "enter": sum(c["what"] == "enter_batch" for c in copies),
        "gather_waits_s": sum(gather), "gather_waits_over_2ms": sum(g > 0.002 for g in gather),
        "regathers": len(reg), "regather_s": sum(e["t1"] - e["t0"] for e in reg),
        "submits_waiting_returning": sum(1 for e in subs if e["gr"] and e["returning"] > 0 and e["active"] <= 1),
        "submit_wait_s": sum(e["t1"] - e["t0"] for e in subs),
    }


def summarize_llama(dec: list[dict[str, Any]]) -> dict[str, Any]:
    slots: dict[str, int] = {}
    for d in dec:
        k = str(d["slots"] + d["prompts"])
        slots[k] = slots.get(k, 0) + 1
    return {"decodes": len(dec), "decode_s": sum(d["t1"] - d["t0"] for d in dec),
            "with_prompt": sum(1 for d in dec if d["prompts"]),
            "prompt_decodes_s": sum(d["t1"] - d["t0"] for d in dec if d["prompts"]),
            "token_decodes_s": sum(d["t1"] - d["t0"] for d in dec if not d["prompts"]),
            "slots_per_decode": dict(sorted(slots.items()))}


def timeline_lines(ev: dict[str, list[dict[str, Any]]], run: dict[str, Any]) -> list[str]:
    """chatcli's run in time order: requests (client side), decodes, copies, leads, regathers."""
    t0 = run["t0"]
    rows: list[tuple[float, str]] = []
    for r in run["requests"]:
        rows.append((r["t0"], f"client {r['client']} run {r['rep']} turn {r['turn']} sends"))
        rows.append((r["first"], f"client {r['client']} turn {r['turn']} first token ({1000 * (r['first'] - r['t0']):.0f} ms)"))
        took = 1000 * (r["end"] - r["t0"])
        rows.append((r["end"], f"client {r['client']} turn {r['turn']} done ({r['tokens']} tokens, {took:.0f} ms)"))
    for d in ev["decode"]:
        if d["t0"] < t0:
            continue
        where = "batch" if d["batch"] else "own  "
        rows.append((d["t0"], f"  decode {where} {d['seqs']} cells {d['cells']} {1000 * (d['t1'] - d['t0']):.1f} ms"))
    for c in ev["copy"]:
        if c["t0"] >= t0:
            rows.append((c["t0"], f"  {c['what']} m{c['member']} [{c['from']},{c['n_past']}) keep={c['keep']} "
                                  f"{1000 * (c['t1'] - c['t0']):.1f} ms"))
    for e in ev["lead"]:
        if e["t0"] >= t0:
            rows.append((e["t0"], f"  lead: pending {e['pending']}/{e['expected']} active {e['active']} "
                                  f"after {1000 * (e['t0'] - e['first']):.1f} ms (window {1000 * e['window']:.1f})"))
    for e in ev["regather"]:
        if e["t0"] >= t0:
            rows.append((e["t0"], f"  regather {e['pending']}->{e['pending_after']}/{e['expected']} "
                                  f"{1000 * (e['t1'] - e['t0']):.1f} ms"))
    for e in ev.get("mark", []):
        if e["t0"] >= t0:
            rows.append((e["t0"], f"  . {e['what']} {1000 * (e['t1'] - e['t0']):.2f} ms"))
    for e in ev["submit"]:
        if e["t0"] >= t0 and (e["size"] > 1 or e["gr"]):
            rows.append((e["t0"], f"  submit m{e['seq']} {e['size']} tokens gr={e['gr']} active {e['active']} "
                                  f"returning {e['returning']} -> {1000 * (e['t1'] - e['t0']):.1f} ms"))
    rows.sort()
    return [f"{1000 * (t - t0):8.1f}  {s}" for t, s in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="2,4,8")
    ap.add_argument("--full", action="store_true", help="FULL's work (3 turns of 48 tokens), not QUICK's")
    ap.add_argument("--chatcli", help="the tree whose chatcli is served (default: this one)")
    ap.add_argument("--reps", type=int, default=1, help="runs per server (bench/decode.py's messages of runs 0, 1, ...)")
    ap.add_argument("--skip-llama-server", action="store_true")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    o = ap.parse_args(argv)

    from bench.common import REPO
    from bench.decode import FULL, QUICK, SEED, SETTLE_S, fixed_length
    from bench.serve import Proc, find_llama_server, free_port
    from chatcli.models.resolve import bundled_model_path

    cfg = FULL if o.full else QUICK
    model = str(bundled_model_path())
    extra = fixed_length(model)  # the vocabulary read before the servers start
    work = Path(tempfile.mkdtemp(prefix="chatcli-timeline-"))
    tree = o.chatcli or str(REPO)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "CHATCLI_THREADS")}
    env["PYTHONPATH"] = tree
    env["CHATCLI_TIMELINE_PATH"] = tree
    res: dict[str, Any] = {"tree": tree, "cfg": {"turns": cfg["turns"], "reply": cfg["reply"]}, "runs": []}
    md: list[str] = []

    for n in [int(x) for x in o.clients.split(",")]:
        port = free_port()
        ev_path = work / f"events-{n}.json"
        p = Proc([sys.executable, str(Path(__file__).resolve()), "--serve", str(ev_path), "--host", "127.0.0.1",
                  "--port", str(port), "--model", model, "--parallel", str(n)],
                 {**env, "CHATCLI_HOME": str(work / f"home-{n}"), "CHATCLI_N_CTX": str(o.n_ctx)}, work,
                 work / f"chatcli-{n}.log")
        try:
            p.wait_ready(port)
            time.sleep(SETTLE_S)  # as bench/decode.py section 2 waits (see SETTLE_S there)
            run_c = clients(port, n, cfg, extra, o.reps)
        finally:
            p.stop()
        ev = json.loads(ev_path.read_text())
        sc = summarize_chatcli(ev, run_c["t0"], run_c["t0"] + run_c["wall"])  # not the closings at shutdown
        row: dict[str, Any] = {"clients": n, "chatcli": {**sc, "wall": run_c["wall"], "p50": run_c["p50"]},
                               "chatcli_events": ev, "chatcli_run": run_c}
        if not o.skip_llama_server:
            ls = find_llama_server()
            assert ls, "no llama-server"
            port = free_port()
            log = work / f"llama-server-{n}.log"
            q = Proc([ls, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", str(o.n_ctx), "-np", str(n),
                      "--kv-unified", "-t", str(o.threads), "-tb", str(o.threads), "-b", "512", "-ub", "512",
                      "-fa", "off", "-ctk", "f16", "-ctv", "f16", "--seed", str(SEED), "--metrics", "-v",
                      "--log-timestamps"], env, work, log)
            try:
                q.wait_ready(port)
                time.sleep(SETTLE_S)
                m0 = metrics(port)
                run_l = clients(port, n, cfg, extra, o.reps)
                m1 = metrics(port)
            finally:
                q.stop()
            ld = parse_llama_log(log)
            row["llama_run"] = run_l
            row["llama-server"] = {**summarize_llama(ld), "n_decode_total": m1["n_decode_total"] - m0["n_decode_total"],
                                   "wall": run_l["wall"], "p50": run_l["p50"]}
        res["runs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k in ("clients", "chatcli", "llama-server")}), flush=True)
        md += [f"## N = {n}", "", "```", json.dumps({k: v for k, v in row.items()
                                                     if k in ("chatcli", "llama-server")}, indent=1), "```", "",
               "```", *timeline_lines(ev, run_c), "```", ""]
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_timeline.json").write_text(json.dumps(res))
    (out / "serve_timeline.md").write_text("\n".join(md))
    print(f"wrote {out / 'serve_timeline.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if "--serve" in sys.argv:
        i = sys.argv.index("--serve")
        serve_main(sys.argv[i + 1], sys.argv[i + 2:])
    else:
        raise SystemExit(main())
