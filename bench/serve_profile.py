"""Where chatcli serve's time to first token goes, step by step, next to llama-cpp-python evaluating the same tokens.

    python -m bench.serve_profile                 # 6 turns of ~370-token messages (~2.3k tokens), 2 reps
    python -m bench.serve_profile --turns 3 --msg-tokens 120 --reps 1

In one process (no HTTP: `python -m bench.serve` measures that, and `chatcli serve` logs its own ttft per
request), a ``ChatService`` serves a growing conversation exactly as ``chatcli serve`` does, with every step
between the request and its first token timed by wrapping the functions that do it (the wrappers cost a few
microseconds each). After each turn, a ``llama_cpp.Llama`` with llama_cpp.server's settings (n_batch/n_ubatch
512, 2 threads, no flash attention, logits for every token as its server's default, or the last only) is
given the same prompt's tokens, the cached prefix already in its context, and evaluates the same new tokens;
then it samples one token. The two engines alternate, so they share the machine's load. Writes
``bench/results/serve_profile.md`` and ``serve_profile.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PARAGRAPHS, compute_runner

SYSTEM = "You are a helpful gardening assistant. Answer briefly."

# (label, owner, attribute): the steps before a reply's first token, in the order they run.
STEPS: list[tuple[str, str, str]] = [
    ("index refresh (stat every transcript)", "index", "PrefixIndex.refresh"),
    ("history split (normalize, personas)", "service", "ChatService._split"),
    ("chain keys (hash every message)", "history", "chain"),
    ("index lookup", "index", "PrefixIndex.lookup"),
    ("check the new messages fit (tokenize)", "service", "ChatService._check_fits"),
    ("acquire: find + lock + stamp (+restore)", "service", "ChatService._acquire"),
    ("  of which stamp() (2 file stats)", "service", "_stamp"),
    ("  of which lock (flock)", "store", "ConversationDir.lock"),
    ("  of which restore from disk", "session", "Session.open_conversation"),
    ("configure", "conversation", "Conversation.set_options"),
    ("render + tokenize the new message", "conversation", "Conversation._user_tokens"),
    ("context room check", "conversation", "Conversation._make_room"),
    ("transcript append (fsync)", "transcript", "Transcript.message"),
    ("prompt eval (llama_decode)", "engine", "Engine.eval_steps"),
    ("user turn's cells + logits to state.kv", "statelog", "CellLog.user_evaluated"),
    ("  of which save_cells (llama_state_seq_get_data)", "engine", "Engine.save_cells"),
    ("  of which append + fsync", "statefile", "StateWriter.append"),
    ("  of which state budget (stat state files)", "session", "Session.budget_notice"),
    ("before_reply (logits ready)", "statelog", "CellLog.before_reply"),
]


# The steps of a client's regenerate (its history minus the last reply): the conversation is forked at the
# user message (its KV records copied) and the reply sampled from the saved logits.
REGEN_STEPS: list[tuple[str, str, str]] = [
    ("fork: transcript prefix + state copy (core.forking.fork_after)", "forking", "fork_after"),
    ("  of which state copy + fsync (core.forking.fork_state)", "forking", "fork_state"),
    ("adopt the resident cells (Session.adopt)", "session", "Session.adopt"),
]


class Timer:
    """Accumulates wall time per label while ``active``; only the first call of a nested label counts."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.active = False
        self._depth: dict[str, int] = defaultdict(int)

    def wrap(self, label: str, fn: Callable[..., Any], gen: bool = False) -> Callable[..., Any]:
        timer = self

        if gen:
            @functools.wraps(fn)
            def wg(*a: Any, **k: Any) -> Iterator[Any]:
                it = fn(*a, **k)
                while True:
                    t0 = time.perf_counter()
                    try:
                        x = next(it)
                    except StopIteration:
                        timer.t[label] += time.perf_counter() - t0 if timer.active else 0
                        return
                    if timer.active:
                        timer.t[label] += time.perf_counter() - t0
                    yield x
            return wg

        @functools.wraps(fn)
        def w(*a: Any, **k: Any) -> Any:
            timer._depth[label] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timer._depth[label] -= 1
                if timer.active and timer._depth[label] == 0:
                    timer.t[label] += time.perf_counter() - t0
        return w


def install(timer: Timer) -> None:
    from chatcli import session
    from chatcli.backends import llamacpp
    from chatcli.core import conversation, forking, transcript
    from chatcli.core.files import store
    from chatcli.core.kv import log as statelog
    from chatcli.core.kv import records as statefile
    from chatcli.server import history, index, service

    mods: dict[str, Any] = {"index": index, "service": service, "history": history, "forking": forking,
                            "store": store, "conversation": conversation, "transcript": transcript,
                            "engine": llamacpp, "statelog": statelog, "statefile": statefile, "session": session}
    for label, owner, attr in STEPS + REGEN_STEPS:
        mod = mods[owner]
        if "." in attr:
            cls_name, meth = attr.split(".")
            cls = getattr(mod, cls_name)
            fn = getattr(cls, meth)
            setattr(cls, meth, timer.wrap(label, fn, gen=meth in ("eval_steps", "_make_room")))
        else:
            fn = getattr(mod, attr)
            w = timer.wrap(label, fn)
            setattr(mod, attr, w)
            # Modules that imported the function by name (``from … import``) see the wrapper too.
            for m in (service, index, history, forking):
                if getattr(m, attr, None) is fn:
                    setattr(m, attr, w)


def sized(count: Callable[[str], int], n: int, seed: int, header: str) -> str:
    words = header.split()
    i = seed
    while count(" ".join(words)) < n:
        words += PARAGRAPHS[i % len(PARAGRAPHS)].split()
        i += 1
    while count(" ".join(words)) > n:
        words.pop()
    return " ".join(words)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--msg-tokens", type=int, default=370)
    ap.add_argument("--reps", type=int, default=2, help="independent conversations (medians are reported)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    o = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import llama_cpp

    from chatcli.config.settings import Settings, get_paths
    from chatcli.core.template import Message
    from chatcli.models.resolve import bundled_model_path
    from chatcli.server.service import ChatRequest, ChatService, Delta, Finished, Started
    from chatcli.session import Session

    timer = Timer()
    install(timer)
    model = bundled_model_path()
    assert model is not None
    home = Path(tempfile.mkdtemp(prefix="chatcli-serveprof-"))
    os.environ["CHATCLI_HOME"] = str(home)
    settings = Settings(threads=o.threads, n_ctx=o.n_ctx)
    paths = get_paths({"CHATCLI_HOME": str(home)})
    sess = Session.build(settings, paths)
    svc = ChatService(sess, parallel=1)
    eng = sess.local_engine
    # llama_cpp.server's settings (its defaults: logits_all true; n_batch 512; flash attention off).
    llm = {la: llama_cpp.Llama(model_path=str(model), n_ctx=o.n_ctx, n_batch=512, n_ubatch=512, n_threads=o.threads,
                               n_threads_batch=o.threads, flash_attn=False, logits_all=la, verbose=False, seed=1)
           for la in (True, False)}

    on_compute = compute_runner()  # llama_cpp's evaluations on chatcli's compute thread, as its own are

    def count(s: str) -> int:
        return len(eng.tokenize(s, add_special=False))

    rows: list[dict[str, Any]] = []
    regens: list[dict[str, Any]] = []
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    for rep in range(o.reps):
        msgs: list[Message] = [Message("system", SYSTEM)]
        prev_tokens: list[int] = []
        for t in range(o.turns):
            text = sized(count, o.msg_tokens, 3 * t + 7 * rep, f"Notebook {rep + 1}, part {t + 1} of my garden notes.")
            msgs.append(Message("user", text))
            timer.t.clear()
            timer.active = True
            ev0 = eng.n_evaluated_total
            t0 = time.perf_counter()
            c0 = time.process_time()
            it = svc.complete(ChatRequest(list(msgs), temperature=0.0, max_tokens=4, seed=1234))
            started: Started | None = None
            first = cpu_first = t_started = 0.0
            reply = ""
            for ev in it:
                if isinstance(ev, Started):
                    started = ev
                    t_started = time.perf_counter() - t0
                elif isinstance(ev, Delta) and not first and ev.text:
                    first = time.perf_counter() - t0
                    cpu_first = time.process_time() - c0
                    timer.active = False
                elif isinstance(ev, Finished):
                    reply = ev.text
            timer.active = False
            total = time.perf_counter() - t0
            assert started is not None
            steps = dict(timer.t)
            evaluated = eng.n_evaluated_total - ev0
            msgs.append(Message("assistant", reply))
            # The same prompt through llama_cpp.Llama: its context already holds everything up to the new
            # message (as llama_cpp.server's does after the previous turn), it evaluates the rest.
            prompt = eng.tokens[:started.prompt_tokens]
            cmp: dict[str, float] = {}
            for la, m in llm.items():
                keep = prev_tokens if prev_tokens and prompt[:len(prev_tokens)] == prev_tokens else []
                cur = [int(x) for x in m.input_ids[:m.n_tokens]]
                if not keep or keep[:len(cur)] != cur:
                    m.reset()  # type: ignore[no-untyped-call]
                    cur = []
                if len(keep) > len(cur):
                    # untimed: the cached prefix (the last reply, as its server evaluated it)
                    on_compute(m.eval, keep[len(cur):])
                t1 = time.perf_counter()
                c1 = time.process_time()
                on_compute(m.eval, prompt[len(keep):])
                te = time.perf_counter() - t1
                on_compute(functools.partial(m.sample, temp=0.0))
                cmp["llama_cpp eval (logits_all)" if la else "llama_cpp eval (last logits)"] = te
                cmp[("llama_cpp eval+sample (logits_all)" if la else "llama_cpp eval+sample (last logits)")] = (
                    time.perf_counter() - t1)
                cmp["cpu " + ("logits_all" if la else "last logits")] = time.process_time() - c1
            # Next turn's cached prefix in llama_cpp terms: everything chatcli's context held after this turn.
            prev_tokens = list(eng.tokens)
            rows.append({"rep": rep + 1, "turn": t + 1, "prompt_tokens": started.prompt_tokens, "evaluated": evaluated,
                         "service_evaluated": started.evaluated, "to_started": t_started, "ttft": first or total,
                         "cpu_to_first": cpu_first,
                         "total": total, "steps": steps, "llama_cpp": cmp, "state": started.state})
            print(f"rep {rep + 1} turn {t + 1}: prompt {started.prompt_tokens} eval {evaluated} "
                  f"ttft {1000 * (first or total):.0f} ms"
                  f" decode {1000 * steps.get('prompt eval (llama_decode)', 0):.0f} ms; llama_cpp "
                  + ", ".join(f"{k} {1000 * v:.0f}" for k, v in cmp.items()), file=sys.stderr, flush=True)
        # A client's regenerate: the history minus the last reply (it ends at the last user message).
        timer.t.clear()
        timer.active = True
        t0 = time.perf_counter()
        c0 = time.process_time()
        ev0 = eng.n_evaluated_total
        first = cpu_first = 0.0
        how = ""
        n_ev: int | None = None
        for ev in svc.complete(ChatRequest(list(msgs[:-1]), temperature=0.0, max_tokens=4, seed=1234)):
            if isinstance(ev, Started):
                how, n_ev = ev.state, ev.evaluated
            elif isinstance(ev, Delta) and not first and ev.text:
                first = time.perf_counter() - t0
                cpu_first = time.process_time() - c0
                timer.active = False
        timer.active = False
        regens.append({"rep": rep + 1, "prompt_tokens": len(eng.tokens), "ttft": first, "cpu_to_first": cpu_first,
                       "evaluated": n_ev, "evaluated_through_reply": eng.n_evaluated_total - ev0, "state": how,
                       "steps": dict(timer.t),
                       "state_bytes": sum(f.stat().st_size for f in sess.paths.conversations_dir.rglob("state.kv"))})
        print(f"rep {rep + 1} regenerate: ttft {1000 * first:.0f} ms, state {how}, steps "
              + ", ".join(f"{k} {1000 * v:.0f}" for k, v in timer.t.items() if v > 0.0005), file=sys.stderr, flush=True)
    svc.close()
    res = {"config": vars(o), "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                          "llama_cpp_python": llama_cpp.__version__, "load_start": load0,
                                          "load_end": os.getloadavg()},
           "seconds": time.perf_counter() - t_start, "rows": rows, "regen": regens}
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_profile.json").write_text(json.dumps(res, indent=1))
    (out / "serve_profile.md").write_text(markdown(res))
    print(markdown(res))
    return 0


def markdown(res: dict[str, Any]) -> str:
    rows = [r for r in res["rows"] if r["turn"] > 1]  # turn 1 creates the conversation: not the steady state
    if not rows:
        rows = res["rows"]
    m = res["machine"]

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    L = ["### Where chatcli serve's time to first token goes (`python -m bench.serve_profile`)\n",
         f"In-process `ChatService` (no HTTP), SmolLM2-135M, {res['config']['threads']} threads, n_ctx "
         f"{res['config']['n_ctx']}, {res['config']['turns']} turns of ~{res['config']['msg_tokens']}-token messages × "
         f"{res['config']['reps']} conversations; turns 2+ (the conversation resident, as in a live server); medians "
         f"over {len(rows)} requests. Load average {m['load_start'][0]:.1f} at start, {m['load_end'][0]:.1f} at end; "
         f"{m['cpus']} CPUs.\n",
         f"Prompt tokens evaluated per request: median {med([r['service_evaluated'] for r in rows]):.0f} "
         f"(prompt {med([r['prompt_tokens'] for r in rows]):.0f}).\n",
         "| step before the first token | ms (median) | share of TTFT |", "|---|---|---|"]
    ttft = med([r["ttft"] for r in rows])
    for label, _o, _a in STEPS:
        v = med([r["steps"].get(label, 0.0) for r in rows])
        L.append(f"| {label} | {1000 * v:.1f} | {100 * v / ttft:.1f} % |")
    known = med([sum(v for k, v in r["steps"].items() if not k.startswith("  ")) for r in rows])
    to_started = med([r["to_started"] for r in rows])
    L.append(f"| everything else up to the reply starting (glue, first events) | {1000 * (to_started - known):.1f} | "
             f"{100 * (to_started - known) / ttft:.1f} % |")
    L.append(f"| first token: sample + detokenize + stream | {1000 * (ttft - to_started):.1f} | "
             f"{100 * (ttft - to_started) / ttft:.1f} % |")
    L.append(f"| **TTFT in the service** | **{1000 * ttft:.1f}** | 100 % |")
    L.append("")
    L.append("**llama-cpp-python evaluating the same new tokens** (same prompt, the cached prefix already in its "
             "context, then one sampled token):\n")
    L.append("| | ms (median) | ÷ chatcli's prompt eval |")
    L.append("|---|---|---|")
    dec = med([r["steps"].get("prompt eval (llama_decode)", 0.0) for r in rows])
    for k in rows[0]["llama_cpp"]:
        if k.startswith("cpu "):
            continue
        v = med([r["llama_cpp"][k] for r in rows])
        L.append(f"| {k} | {1000 * v:.1f} | {v / dec:.2f} |")
    L.append(f"| chatcli prompt eval (llama_decode, last logits) | {1000 * dec:.1f} | 1.00 |")
    L.append("")
    rg = res.get("regen") or []
    if rg:
        L.append("")
        L.append(f"**A client's regenerate** (the history minus the last reply, ~{med([r['prompt_tokens'] for r in rg]):.0f} "
                 f"tokens; median of {len(rg)}; "
                 + (f"prompt tokens evaluated: {', '.join(str(r['evaluated']) for r in rg)}; "
                    if all("evaluated_through_reply" in r for r in rg) else "")
                 + f"how: {', '.join(r['state'] for r in rg)}):\n")
        L.append("| step before the first token | ms (median) |")
        L.append("|---|---|")
        for label, _o, _a in REGEN_STEPS + STEPS:
            v = med([r["steps"].get(label, 0.0) for r in rg])
            if v > 0.0005:
                L.append(f"| {label} | {1000 * v:.1f} |")
        L.append(f"| **TTFT in the service** | **{1000 * med([r['ttft'] for r in rg]):.1f}** |")
        L.append("")
    cc = med([r["cpu_to_first"] for r in rows])
    L.append("CPU time (all threads; load does not stretch it as it stretches wall time): chatcli serve, the whole "
             f"request up to its first token: **{1000 * cc:.0f} ms**; llama-cpp-python evaluating the same tokens and "
             + ", ".join(f"{k[4:]}: **{1000 * med([r['llama_cpp'][k] for r in rows]):.0f} ms**"
                         for k in rows[0]["llama_cpp"] if k.startswith("cpu ")) + " (sampling included).")
    L.append("")
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
