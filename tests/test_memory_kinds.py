"""The acceptance matrix of issue #20: every state promise on every memory kind llama.cpp has, on the real llama.cpp.

The models are llama.cpp's own random-weight fixtures (tests/archs.py: ``test-llama-archs`` writes them at test
time; nothing is shipped or downloaded). Random weights do not matter: every claim is about identical
computation. Per architecture, tests/kind_checks.py runs in its own process (a llama.cpp abort is that
architecture's failure, never the session's) with one model load for all its checks: resume, regen, undo,
redo, edit, ``switch_alt``, fork, eviction rebuild, and the context shift or, where the memory cannot shift,
the rebuild policy — each compared with a fresh evaluation of the same history, logits bit-identical
(DeepSeek-V4 within 1e-4: see kind_checks' docstring for why).

``serve`` continue/regenerate after a server restart runs on one architecture per memory kind (two server
processes and a restart each: the slowest part of the matrix).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.archs import ArchFixtures
from tests.kind_checks import CHECKS

ROOT = Path(__file__).resolve().parent.parent

# architecture (test-llama-archs' name) → the memory kind the engine's probe must find
ARCHS = {
    "llama": "attention", "qwen3": "attention", "deepseek2": "attention", "phi3": "attention",
    "gemma3": "swa", "gpt-oss": "swa", "gemma2": "swa", "cohere2": "swa", "granite_swa": "swa",
    "mamba": "recurrent", "mamba2": "recurrent",
    "lfm2": "hybrid", "lfm2moe": "hybrid", "qwen35": "hybrid", "qwen35moe": "hybrid", "qwen3next": "hybrid",
    "granitehybrid": "hybrid", "nemotron_h": "hybrid", "nemotron_h_moe": "hybrid", "jamba": "hybrid",
    "falcon-h1": "hybrid", "kimi-linear": "hybrid", "minimax-01": "hybrid", "plamo2": "hybrid",
    "deepseek4": "whole",
}
# (architecture, check) → why it fails today: xfail strict, so a fix must remove the entry. Empty since
# a whole-state file ending in a TRUNCATE (an undo, a fork's cut) resumes from the point there.
KNOWN: dict[tuple[str, str], str] = {}
# Not chat models: no KV memory (non-causal diffusion); refused at load in one line.
DIFFUSION = ("dream", "llada")
# One architecture per memory kind for the serve restart.
SERVE = ("llama", "gemma3", "granitehybrid", "mamba", "deepseek4")


class Results:
    """Each architecture's kind_checks run, once per session (its own process and CHATCLI_HOME)."""

    def __init__(self, fixtures: ArchFixtures, root: Path) -> None:
        self.fixtures = fixtures
        self.root = root
        self._done: dict[str, dict[str, Any]] = {}

    def __getitem__(self, arch: str) -> dict[str, Any]:
        if arch not in self._done:
            self._done[arch] = self._run(arch)
        return self._done[arch]

    def _run(self, arch: str) -> dict[str, Any]:
        home = self.root / arch
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
        env.update(CHATCLI_HOME=str(home), NO_COLOR="1",
                   PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tests.kind_checks", str(self.fixtures.path(arch))],
                              capture_output=True, text=True, env=env, timeout=900, cwd=str(ROOT))
        lines = proc.stdout.strip().splitlines()
        out: dict[str, Any] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {}
        out.update(rc=proc.returncode, stderr=proc.stderr[-3000:], seconds=time.perf_counter() - started)
        return out


@pytest.fixture(scope="module")
def results(arch_fixtures: ArchFixtures, tmp_path_factory: pytest.TempPathFactory) -> Results:
    return Results(arch_fixtures, tmp_path_factory.mktemp("kinds"))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_nothing_aborts_and_the_probe_finds_the_kind(results: Results, arch: str) -> None:
    res = results[arch]
    assert res["rc"] == 0, f"{arch}: kind_checks exited {res['rc']}: {res['stderr']}"
    assert res["memory"] == ARCHS[arch]
    assert not res["shift"] or ARCHS[arch] in ("attention", "swa")  # only a memory that can be cut back shifts


def _cases() -> Iterator[Any]:
    for arch in sorted(ARCHS):
        for check in CHECKS:
            why = KNOWN.get((arch, check))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            yield pytest.param(arch, check, marks=marks, id=f"{arch}-{check}")


@pytest.mark.parametrize(("arch", "check"), list(_cases()))
def test_promise_holds(results: Results, arch: str, check: str) -> None:
    res = results[arch]
    assert res["rc"] == 0, f"{arch}: kind_checks exited {res['rc']}: {res['stderr']}"
    assert res["checks"][check] == "ok"


@pytest.mark.parametrize("arch", DIFFUSION)
def test_a_diffusion_model_is_refused_in_one_line(arch_fixtures: ArchFixtures, arch: str) -> None:
    """Diffusion models (Dream, LLaDA) have no KV memory to keep: not a chat model, said in one line."""
    env = {k: v for k, v in os.environ.items()}
    proc = subprocess.run([sys.executable, "-m", "chatcli", "talk", "-m", str(arch_fixtures.path(arch)),
                           "--n-ctx", "256", "--reserve", "32"], input="hello\n", capture_output=True, text=True, env=env,
                          timeout=300, cwd=str(ROOT))
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "diffusion" in lines[0].lower()


# -- serve: continue and regenerate after a restart, one architecture per memory kind -----------------------

class Serve:
    """``chatcli serve`` on a fixture, its own CHATCLI_HOME; SIGKILLed and started again by the test."""

    def __init__(self, home: Path, model: Path) -> None:
        self.home, self.model = home, model
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> None:
        from tests.test_server import free_port, request

        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
        env.update(CHATCLI_HOME=str(self.home), PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
        # --reserve again on every start: a conversation does not keep it yet (issue #24 item 20).
        args = [sys.executable, "-m", "chatcli", "serve", "-m", str(self.model), "--port", str(self.port),
                "--n-ctx", "256", "--reserve", "32", "--max-tokens", "8", "--threads", "1"]
        log = self.home / "server.log"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(args, env=env, stdout=out, stderr=out, cwd=str(self.home))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log.read_text()[-3000:]
            try:
                if request(self.port, "GET", "/health", timeout=2).status_code == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("server did not start: " + log.read_text()[-3000:])

    def stop(self, sig: int = 15) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)

    def user_p0(self, cid: str, n: int) -> int:
        """Where the n-th user message (0-based) of a stored conversation starts, or where the previous
        reply's closing does when it was evaluated with the message (``with_closing``: the server leaves a
        reply's closing to the next prompt, as llama-server does, so it is not in the saved state)."""
        from chatcli.core.files.store import ConversationDir
        from chatcli.core.transcript import replay_events

        rp = replay_events(ConversationDir(self.home / "data" / "conversations" / cid).read_transcript().events)
        m = [m for m in rp.active if m.role == "user"][n]
        return m.p0 - m.with_closing

    def chat(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0,
                               timeout=300)
        raw = client.chat.completions.with_raw_response.create(model="any", messages=messages, max_tokens=8,
                                                               temperature=0)
        comp = raw.parse()
        from tests.golden import wait_written

        if raw.headers.get("x-chatcli-conversation"):
            wait_written(self.home / "data" / "conversations" / raw.headers["x-chatcli-conversation"])
        return {"conv": raw.headers.get("x-chatcli-conversation"), "text": comp.choices[0].message.content,
                "prompt": comp.usage.prompt_tokens, "cached": comp.usage.prompt_tokens_details.cached_tokens,
                **((comp.model_extra or {}).get("chatcli") or {})}


SYSTEM = "You are terse."
QUESTIONS = ["hello there", "tell me of the sea", "and the hills"]


def _converse(srv: Serve, questions: list[str], msgs: list[dict[str, str]] | None = None
              ) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    msgs = msgs if msgs is not None else [{"role": "system", "content": SYSTEM}]
    replies = []
    for q in questions:
        msgs.append({"role": "user", "content": q})
        r = srv.chat(msgs)
        replies.append(r)
        msgs.append({"role": "assistant", "content": r["text"]})
    return msgs, replies


@pytest.mark.parametrize("arch", SERVE)
def test_serve_continues_and_regenerates_after_a_restart(arch_fixtures: ArchFixtures, tmp_path: Path,
                                                         arch: str) -> None:
    """SIGKILL between turns, then: the next message evaluates only itself, a regenerate evaluates nothing,
    and the replies are those of a server that was never restarted (no 500 on any memory kind)."""
    pytest.importorskip("openai")
    pytest.importorskip("starlette")
    model = arch_fixtures.path(arch)
    srv, ref = Serve(tmp_path / "srv", model), Serve(tmp_path / "ref", model)
    try:
        srv.start()
        msgs, first = _converse(srv, QUESTIONS[:2])
        cid = first[-1]["conv"]
        srv.stop(9)
        srv.start()
        msgs, [third] = _converse(srv, QUESTIONS[2:], msgs)
        assert third["conv"] == cid
        assert third["evaluated_tokens"] == third["prompt"] - third["cached"] > 0
        # The whole history before it came from the saved state but, on a memory that can be cut back, the last
        # reply's end (its last sampled token and closing): the server left it to the next prompt (as
        # llama-server does) and the kill took it; it is evaluated with this request. (A memory that cannot be
        # cut back saved its point after it.)
        assert 0 <= srv.user_p0(cid, 2) - third["cached"] <= 1 + 3
        regen = srv.chat(msgs[:-1])
        assert regen["evaluated_tokens"] == 0 and regen["text"] == third["text"]
        srv.stop()
        ref.start()
        _, whole = _converse(ref, QUESTIONS)
        assert [r["text"] for r in whole] == [r["text"] for r in [*first, third]]
    finally:
        srv.stop()
        ref.stop()
