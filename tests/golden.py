"""The real-model conversation the promise tests share (docs/PROMISES.md), and their helpers.

One engine per test module (``base_session``), bound to each test's CHATCLI_HOME (``sess``); ``golden`` is a
greedy two-exchange conversation made once per module, which ``install`` copies into a test's home so the
test may damage it. tests/conftest.py loads this module as a plugin: a test asks for the fixtures by name."""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from chatcli.config.settings import get_paths
from chatcli.core.conversation import Conversation
from chatcli.core.events import ReplyEnd, ResumeReport
from chatcli.core.files.store import ConversationStore
from chatcli.core.kv import records as sf
from chatcli.core.steps import drain

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("chatcli_faults", REPO / "bench" / "faults.py")
assert _spec is not None and _spec.loader is not None
faults = importlib.util.module_from_spec(_spec)
sys.modules["chatcli_faults"] = faults
_spec.loader.exec_module(faults)

runner = CliRunner()
MSGS = ["Hi! What is your name?", "What is the capital of France?", "And of Italy?"]
N_CTX = 1024
GUARD = 600  # seconds: only ever a hang guard for subprocesses, never an assertion about speed


@pytest.fixture
def one_thread(chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One llama.cpp thread: on a busy 2-core machine two threads spin-waiting on each other run ~5x slower."""
    monkeypatch.setenv("CHATCLI_THREADS", "1")


def new_conv(session: Any, *msgs: str) -> Conversation:
    """A new conversation of the alice persona with ``msgs`` sent (each got a reply)."""
    conv = session.new_conversation("alice").conversation
    for m in msgs:
        assert drain(conv.send(m)).ends
    return conv


def open_conv(session: Any, cid: str) -> tuple[Conversation, ResumeReport, list[str]]:
    opened = drain(session.open_conversation(cid))
    assert opened.conversation is not None and opened.report is not None
    return opened.conversation, opened.report, [n.text for n in opened.notices]


def reply(events: Iterator[Any]) -> ReplyEnd:
    ends = drain(events).ends
    assert ends, "no reply"
    return ends[-1]


def state_tokens(path: Path) -> list[int] | None:
    """The tokens the state file's live cells hold, or None if it does not scan clean."""
    res = sf.scan(path)
    if res.header is None or res.dropped_bytes:
        return None
    chunks, _, _ = res.live()
    out: list[int] = []
    for ch in chunks:
        toks, _ = sf.split_cells(sf.read_payload(path, ch.record), ch.record.p1 - ch.record.p0)
        out.extend(toks[: ch.end - ch.record.p0])
    return out


def conv_path(cid: str) -> Path:
    return get_paths().conversations_dir / cid


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()}
    env.update(PYTHONUNBUFFERED="1", NO_COLOR="1", **extra)
    return env


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def wait_for(predicate: Any, what: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll until ``predicate()``; a hang guard, not a timing assertion."""
    deadline = time.monotonic() + GUARD
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def base_session(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The real model loaded once per module; a module's ``BASE_SESSION`` dict overrides these settings."""
    from tests.drive import isolated_session

    kw = {"threads": 1, "n_ctx": N_CTX, "max_tokens": 12, "reserve": 64,
          **getattr(request.module, "BASE_SESSION", {})}
    session = isolated_session(tmp_path_factory.mktemp("base") / "home", **kw)
    yield session
    session.close()


@pytest.fixture
def sess(base_session: Any, chatcli_home: Path) -> Any:
    """The module's session (its engine) bound to this test's CHATCLI_HOME."""
    from tests.drive import rebind

    return rebind(base_session)


@pytest.fixture
def chat_service(sess: Any, tmp_path: Path) -> Iterator[Any]:
    """A ``ChatService`` (one context) over the module's engine, cleared first, on this test's store and index:
    the server's service in-process, for modules that set ``BASE_SESSION`` as they need."""
    from chatcli.server.service import ChatService

    sess.engine.clear()
    svc = ChatService(sess, parallel=1, index_path=tmp_path / "index.json")
    yield svc
    svc.close()


@pytest.fixture
def chat_http(chat_service: Any) -> Iterator[Any]:
    """The HTTP app over ``chat_service``, as a starlette ``TestClient`` (needs the 'serve' extra)."""
    from starlette.testclient import TestClient

    from chatcli.server.app import create_app

    with TestClient(create_app(chat_service)) as client:
        yield client


@pytest.fixture(scope="module")
def golden(base_session: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A greedy two-exchange conversation saved as a folder, what came next, and another conversation."""
    root = tmp_path_factory.mktemp("golden")
    session = dataclasses.replace(base_session, store=ConversationStore(root / "made"))
    out: dict[str, Any] = {}
    for name, msgs in (("main", MSGS[:2]), ("other", ["Tell me a joke.", "Another one, please."])):
        conv = session.new_conversation("alice").conversation
        for m in msgs:
            reply(conv.send(m))
        shutil.copytree(conv.dir.path, root / name)
        out[name] = {"path": root / name, "id": conv.id, "tokens": list(session.engine.tokens),
                     "messages": [(m.role, m.text, list(m.tokens)) for m in conv.messages]}
        if name == "main":
            end = reply(conv.send(MSGS[2]))
            out["next_reply"] = list(end.message.tokens)
            assert conv.turn_logits is not None
            out["next_logits"] = conv.turn_logits[1].copy()
        conv.close()
    return out


def install(golden: dict[str, Any], which: str = "main") -> str:
    """Copy a golden conversation into this test's CHATCLI_HOME; returns its id."""
    g = golden[which]
    dest = get_paths().conversations_dir / g["id"]
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    shutil.copytree(g["path"], dest)
    return g["id"]


class DiskFull:
    """os.write that fills the disk for chosen files: the first write gets half its bytes in, then ENOSPC."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.real = os.write
        self.failures = 0

    def _target(self, fd: int) -> bool:
        try:
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return False
        return any(name == n or (name.startswith(f".{n}.") and name.endswith(".tmp")) for n in self.names)

    def __call__(self, fd: int, data: Any) -> int:
        if not self._target(fd):
            return self.real(fd, data)
        raw = bytes(data)
        if len(raw) > 1 and not getattr(self, "_half_done", False):
            self._half_done = True
            return self.real(fd, raw[: len(raw) // 2])  # a short write, as when the disk fills up mid-way
        self._half_done = False
        self.failures += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def wait_written(conv_dir: Path, timeout: float = 60.0) -> None:
    """Until a server has written a conversation's last turn. `serve` answers a reply's end first and then
    writes its state, holding the conversation's lock from the request until that is done; a test that
    reads the files or kills the server "between turns" waits for it as a client's next request does."""
    from chatcli.core.files.fsutil import try_lock

    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(conv_dir / "lock", os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            if try_lock(fd):
                return  # closing the descriptor lets go of it at once
        finally:
            os.close(fd)
        if time.monotonic() > deadline:
            raise AssertionError(f"{conv_dir.name}: still being written after {timeout:.0f} s")
        time.sleep(0.01)
