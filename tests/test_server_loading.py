"""`chatcli serve` while its model loads: it listens first and loads the model on a thread; until the model is
loaded every request is answered 503 "Loading model" (llama-server's answer while it loads), and a model
that fails to load on that thread is still one line and the engine's exit code, never a traceback."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient

from chatcli.core.backend import BackendError
from chatcli.server.app import create_app
from chatcli.server.run import Loading
from tests.remote_server import free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key-0123456789"


class LoadedService:
    """What /health and /v1/models read of a ``ChatService``."""

    parallel = 1
    model_id = "fake-model"
    model_name = "Fake"
    index: tuple[object, ...] = ()


@pytest.mark.fast
def test_every_request_is_503_loading_model_until_the_model_is_loaded() -> None:
    app = create_app(None, api_keys=[KEY])
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app) as http:
        for method, path, headers in (("GET", "/health", {}), ("GET", "/health", auth), ("GET", "/v1/models", auth),
                                      ("POST", "/v1/chat/completions", auth), ("GET", "/v1/models", {}),
                                      ("GET", "/nothing", {})):
            r = http.request(method, path, headers=headers,
                             json={"messages": [{"role": "user", "content": "hi"}]} if method == "POST" else None)
            assert r.status_code == 503, (method, path, r.text)
            assert r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["message"] == "Loading model" and set(err) == {"message", "type", "param", "code"}
        app.state.loaded(LoadedService())
        # Loaded: the gate is gone, the key check is back.
        assert http.get("/health").json() == {"status": "ok"}
        health = http.get("/health", headers=auth)
        assert health.status_code == 200 and health.json()["model"] == "fake-model"
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers=auth).json()["data"][0]["id"] == "fake-model"


@pytest.mark.fast
def test_loading_runs_its_callback_once_on_the_loading_thread_whenever_it_is_set() -> None:
    service = LoadedService()
    release = threading.Event()

    def build() -> Any:
        assert release.wait(30)
        return service

    loading = Loading(build)
    calls: list[str] = []
    loading.then(lambda: calls.append(threading.current_thread().name))
    time.sleep(0.05)
    assert calls == []  # not before the build ends
    release.set()
    assert loading.wait() is service and loading.error is None
    assert calls == ["chatcli-serve-load"]

    def fail() -> Any:
        raise BackendError("llama.cpp could not load the model x.gguf")

    failed = Loading(fail)
    assert failed.wait() is None and isinstance(failed.error, BackendError)
    late: list[str] = []
    failed.then(lambda: late.append(threading.current_thread().name))  # already done: at once, here
    assert late == [threading.current_thread().name]


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
    env.update(CHATCLI_HOME=str(home), PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _health(port: int) -> tuple[int, Any] | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    except OSError:
        return None  # not listening yet
    finally:
        conn.close()


def test_health_answers_loading_or_ready_never_anything_else(tmp_path: Path) -> None:
    """Polled from the moment the process starts: nothing but 503 "Loading model" until a 200 that names the
    loaded model (a small model may load before the HTTP layer is up: then the first answer is the 200)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "chatcli", "serve", "--port", str(port), "--n-ctx", "512",
                             "--threads", "2"], env=_env(tmp_path / "home"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    answers: list[tuple[int, Any]] = []
    try:
        deadline = time.monotonic() + 180
        while not answers or answers[-1][0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, answers
            got = _health(port)
            if got is not None:
                answers.append(got)
            time.sleep(0.005)
    finally:
        stop_process(proc)  # type: ignore[arg-type]
    assert proc.stderr is not None
    log = proc.stderr.read().decode()
    for status, doc in answers[:-1]:
        assert status == 503 and doc["error"]["message"] == "Loading model", answers
    assert answers[-1][1]["status"] == "ok" and answers[-1][1]["model"]
    assert "chatcli serve: http://127.0.0.1:" in log and "Traceback" not in log, log


def _unloadable(model: Path, dest: Path) -> Path:
    """A copy of the model that resolves (a valid GGUF header, the tensor data's size) but that llama.cpp
    refuses to load: its architecture renamed. Sparse: the header, then a hole."""
    with model.open("rb") as fh:
        head = fh.read(8 << 20)
    assert head.count(b"llama") >= 1
    with dest.open("wb") as fh:
        fh.write(head.replace(b"llama", b"xxxxx", 1))  # general.architecture comes first
        fh.truncate(model.stat().st_size)
    return dest


def test_a_model_that_fails_to_load_on_the_loading_thread_is_one_line(tmp_path: Path, model_path: Path) -> None:
    bad = _unloadable(model_path, tmp_path / "unknown-arch.gguf")
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "chatcli", "serve", "--port", str(port), "--model", str(bad)],
                          env=_env(tmp_path / "home"), capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 1 and proc.stdout == "", (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: llama.cpp could not load the model"), proc.stderr
    assert str(bad) in lines[0] and "Traceback" not in proc.stderr
    assert took < 60, took  # the server started meanwhile is stopped, not left waiting
