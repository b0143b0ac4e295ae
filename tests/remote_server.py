"""A real llama-server process for tests and benchmarks: loopback only, a free port, stopped by its owner.

The binary is built by ``scripts/build_llama_server.sh`` (``scripts/setup.sh --with-server``) and found
through ``$CHATCLI_LLAMA_SERVER`` or that script's cache directory.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

LLAMA_VERSION = "0.3.36"
FLAVOUR = "portable"


@functools.cache
def server_binary() -> Path | None:
    """The llama-server to test with, or None when it was not built. Looked up once, at collection (the
    tests' autouse fixture clears CHATCLI_* variables later)."""
    explicit = os.environ.get("CHATCLI_LLAMA_SERVER")
    if explicit:
        path = Path(explicit)
        return path if path.is_file() and os.access(path, os.X_OK) else None
    root = os.environ.get("CHATCLI_LLAMA_SERVER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "chatcli")
    path = Path(root) / f"llama-server-{LLAMA_VERSION}-{FLAVOUR}" / "bin" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


SKIP_REASON = ("llama-server is not built: run scripts/build_llama_server.sh (or scripts/setup.sh --with-server), "
               "or point CHATCLI_LLAMA_SERVER at a llama-server binary")


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float = 30.0) -> None:
    """End a test's server: SIGTERM (it writes what it held back and exits), then SIGKILL if it hangs."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One llama-server process. ``start()`` waits until the model is loaded; ``stop()``/``kill()`` end it."""

    def __init__(
        self, model: Path, *, n_ctx: int = 2048, slot_save_path: Path | None = None, log_path: Path,
        threads: int = 2, extra: Sequence[str] = (), binary: Path | None = None,
    ) -> None:
        self.binary = binary or server_binary()
        if self.binary is None:
            raise RuntimeError(SKIP_REASON)
        self.model = model
        self.n_ctx = n_ctx
        self.slot_save_path = slot_save_path
        self.log_path = log_path
        self.threads = threads
        self.extra = list(extra)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, port: int | None = None, timeout: float = 120.0) -> LlamaServer:
        """Start on ``port`` (a free one by default) and wait until the model is loaded."""
        self.port = port or free_port()
        args = [str(self.binary), "-m", str(self.model), "-c", str(self.n_ctx), "--host", "127.0.0.1",
                "--port", str(self.port), "-np", "1", "-t", str(self.threads), "-tb", str(self.threads),
                "--no-warmup", *self.extra]
        if self.slot_save_path is not None:
            self.slot_save_path.mkdir(parents=True, exist_ok=True)
            # llama-server joins the path and the file name as strings: the trailing slash matters.
            args += ["--slot-save-path", str(self.slot_save_path) + os.sep]
        log = open(self.log_path, "ab")
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                status, _ = self.get("/health")
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"llama-server did not become ready in {timeout:g} s: {self.log_tail()}")

    def log_tail(self, n: int = 8) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-n:])
        except OSError:
            return ""

    def get(self, path: str) -> tuple[int, Any]:
        return self.call("GET", path, None)

    def call(self, method: str, path: str, payload: Any) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            body = None if payload is None else json.dumps(payload).encode()
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
            try:
                return resp.status, json.loads(raw)
            except ValueError:
                return resp.status, raw
        finally:
            conn.close()

    def stop(self) -> None:
        """End the server (SIGTERM, then SIGKILL) and reap it."""
        if self.proc is None:
            return
        stop_process(self.proc, timeout=10)
        self.proc = None

    def kill(self) -> None:
        """Die at once, like a crashed or unplugged server."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        if self.proc is proc:  # called from another thread, start() may already have run again
            self.proc = None


def running_server(model_path: Path, base: Path, n_ctx: int) -> Iterator[LlamaServer]:
    """A module's llama-server (slots saved under ``base``), stopped when the module is done."""
    srv = LlamaServer(model_path, n_ctx=n_ctx, slot_save_path=base / "slots", log_path=base / "server.log")
    srv.start()
    yield srv
    srv.stop()
