"""The steps the remote end-to-end tests share (test_remote_e2e: an attention model; test_remote_hybrid: a
memory that cannot be cut back): a session over a live llama-server, a reply, and a conversation opened
again after the server was killed and started again, which must restore its slot file cleanly."""

from __future__ import annotations

from typing import Any

from chatcli.config.settings import get_paths, load_settings
from chatcli.core.conversation import Conversation
from chatcli.core.events import ReplyEnd, ResumeReport
from chatcli.session import Session
from tests.drive import drain
from tests.remote_server import LlamaServer


def alive(server: LlamaServer) -> LlamaServer:
    """The module's server, started again if the previous test killed it (the ``live`` fixtures)."""
    if server.proc is None or server.proc.poll() is not None:
        server.start()
    return server


def remote_session(url: str, **flags: Any) -> Session:
    """A session over the server at ``url``: greedy, seeded, persona alice; ``flags`` override settings."""
    base = {"server": url, "temperature": 0.0, "seed": 1234, "max_tokens": 32, "persona": "alice", **flags}
    return Session.build_remote(load_settings(base, paths=get_paths()), get_paths(), explicit=set(base))


def say(conv: Conversation, text: str) -> ReplyEnd:
    return drain(conv.send(text))[2][-1]


def reopen_after_a_crash(server: LlamaServer, conv_id: str, **flags: Any) -> tuple[Session, Conversation, ResumeReport]:
    """Kill the server (as a crash would), start it again and open ``conv_id`` in a new session over it
    (``flags`` as ``remote_session``'s). The restore must be clean: the whole context from the slot file."""
    server.kill()
    server.start()
    session = remote_session(server.url, **flags)
    conv, report, _ = drain(session.open_conversation(conv_id))
    assert conv is not None and report is not None
    assert report.reason == "" and report.reevaluated == 0 and report.restored_tokens == conv.context.n_past > 0
    return session, conv, report
