"""--server on a model whose memory cannot be cut back (granitehybrid: attention + a recurrent state).

llama-server cannot drop the tail of such a slot: a prompt shorter than what the slot holds (a regenerate,
an alternative) is served from one of its in-RAM context checkpoints or, with none — after a restart or a
slot restore, which clears them —, evaluated from the start. chatcli saves a slot file at each regenerate
point (the history but the user message's last token) and restores it there. Every claim below is checked
with the server's own counts (its ``timings``), and replies are greedy, so equal tokens mean equal state.

The models are llama.cpp's own random-weight fixtures (tests/archs.py): dummy 5-characters-per-token
tokenizer, no EOS (every reply runs to --max-tokens), no chat template (ChatML is used), n_ctx_train 256.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatcli.backends.llama_server import LlamaServerBackend
from chatcli.cli.app import app
from chatcli.core.conversation import Conversation
from chatcli.core.events import Notice, Progress, ReplyEnd
from chatcli.session import Session
from tests.archs import ArchFixtures
from tests.drive import drain
from tests.remote_drive import alive, reopen_after_a_crash, say
from tests.remote_drive import remote_session as shared_session
from tests.remote_server import SKIP_REASON, LlamaServer, server_binary

pytestmark = pytest.mark.skipif(server_binary() is None, reason=SKIP_REASON)

N_CTX = 256
MSGS = ["Hi! What is your name?", "Name one colour."]
NEXT = "And a fruit?"


def fixture_server(model: Path, base: Path) -> LlamaServer:
    return LlamaServer(model, n_ctx=N_CTX, slot_save_path=base / "slots", log_path=base / "server.log")


@pytest.fixture(scope="module")
def hybrid(arch_fixtures: ArchFixtures, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    srv = fixture_server(arch_fixtures.path("granitehybrid"), tmp_path_factory.mktemp("llama-server-hybrid"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def live(hybrid: LlamaServer) -> LlamaServer:
    return alive(hybrid)


FLAGS = {"max_tokens": 8, "reserve": 32}  # a 256-token context


def remote_session(url: str) -> Session:
    return shared_session(url, **FLAGS)


def regen(conv: Conversation) -> ReplyEnd:
    return drain(conv.regen())[2][-1]


def backend(session: Session) -> LlamaServerBackend:
    assert isinstance(session.engine, LlamaServerBackend)
    return session.engine


def test_regen_after_a_server_restart_evaluates_one_token_not_the_history(live: LlamaServer) -> None:
    s1 = remote_session(live.url)
    assert backend(s1).caps.truncate is False  # probed: this server cannot cut a slot back
    conv, _, _ = drain(s1.new_conversation("alice"))
    assert conv is not None
    first = [say(conv, m) for m in MSGS]
    # Each turn's server cost is its new tokens, split between the regenerate point's save and the reply.
    n_user = len(s1.engine.tokenize(s1.template.user_turn(conv.history()[:-1], MSGS[1])))
    assert first[1].stats.server_evaluated == n_user
    n_history = conv.context.n_past - len(first[1].message.tokens)
    # In the same process: the regenerate point's file, not the server's RAM checkpoints (4 tokens here).
    again = regen(conv)
    assert again.message.tokens == first[1].message.tokens
    assert (again.stats.server_evaluated, again.stats.server_cached) == (1, n_history - 1)
    assert again.stats.reevaluated == 1  # what the server re-evaluated, never a 0 that hides it
    # Back to the first alternative: the regenerate point again, then only the reply's own tokens.
    before = backend(s1).stats.prompt_evaluated
    conv.switch_alt(0)
    assert backend(s1).stats.prompt_evaluated - before <= 1 + len(first[1].message.tokens)
    conv_id = conv.id
    conv.close()
    s1.close()

    s2, conv, _ = reopen_after_a_crash(live, conv_id, **FLAGS)
    after = regen(conv)
    assert after.message.tokens == first[1].message.tokens  # the same state: the same greedy reply
    assert (after.stats.server_evaluated, after.stats.server_cached) == (1, n_history - 1)
    assert after.stats.reevaluated == 1
    # Continuing still costs only the new message (plus the regenerated reply's last token and closing, which
    # its end-of-turn save did not need to evaluate: the reply was the same, so was the saved file).
    n_new = len(s2.engine.tokenize(s2.template.user_turn(conv.history(), NEXT)))
    third = say(conv, NEXT)
    assert third.stats.server_evaluated is not None and third.stats.server_cached is not None
    assert n_new <= third.stats.server_evaluated <= n_new + len(after.message.tokens)
    assert third.stats.server_cached >= n_history
    conv.close()
    s2.close()


def test_a_message_evaluated_at_once_still_leaves_its_regenerate_point(live: LlamaServer) -> None:
    # A long message (more than n_batch new tokens: 512, here 8) is evaluated as soon as it is read, with a
    # progress bar; on a slot that cannot go back, all but its last token, or no regenerate point is left.
    s1 = remote_session(live.url)
    backend(s1).n_batch = 8
    conv, _, _ = drain(s1.new_conversation("alice"))
    assert conv is not None
    events = list(conv.send(MSGS[0]))
    assert any(isinstance(ev, Progress) and ev.total > 8 for ev in events)
    end = [ev for ev in events if isinstance(ev, ReplyEnd)][-1]
    assert [ev for ev in events if isinstance(ev, Notice)] == []
    assert conv.meta["checkpoint"]["regen"]["tokens"] == end.message.p0 - 1
    again = regen(conv)
    assert again.message.tokens == end.message.tokens and again.stats.server_evaluated == 1
    conv.close()
    s1.close()


def test_undo_reports_what_the_server_evaluated_to_cut_back(live: LlamaServer) -> None:
    s1 = remote_session(live.url)
    conv, _, _ = drain(s1.new_conversation("alice"))
    assert conv is not None
    for m in MSGS:
        say(conv, m)
    before = backend(s1).stats.prompt_evaluated
    stats = conv.undo(1)
    assert stats.notices == [] and conv.meta["checkpoint"]["tokens"] == stats.kept == conv.context.n_past
    # The server cannot drop the undone exchange: it goes back through its own RAM checkpoint (or from the
    # start). Whatever it evaluated is what the undo says, plus the one token its save added after it.
    assert stats.reevaluated is not None and stats.reevaluated >= 1
    assert backend(s1).stats.prompt_evaluated - before == stats.reevaluated + 1
    conv_id = conv.id
    conv.close()
    s1.close()
    s2, conv, report = reopen_after_a_crash(live, conv_id, **FLAGS)
    assert report.restored_tokens == stats.kept
    conv.close()
    s2.close()


def test_cli_regenerate_after_a_restart_reports_what_the_server_evaluated(live: LlamaServer) -> None:
    runner = CliRunner()
    common = ["--temperature", "0", "--max-tokens", "8", "--reserve", "32"]
    res = runner.invoke(app, ["talk", "--server", live.url, *common], input=f"{MSGS[0]}\n{MSGS[1]}\n")
    assert res.exit_code == 0, res.stderr
    live.kill()
    live.start()
    res = runner.invoke(app, ["regen", "--server", live.url, "--plain", "--max-tokens", "8"])
    assert res.exit_code == 0, res.stderr
    out = res.stderr + res.stdout
    server = re.search(r"server evaluated (\d+), reused (\d+)", out)
    rolled = re.search(r"kept \d+, dropped \d+, re-evaluated (\d+)", out)
    assert server and rolled, out
    assert int(server[1]) == 1 and int(server[2]) > 40, out  # the history came from the regenerate point
    assert int(rolled[1]) == int(server[1]), out
    # Resuming after the restart: the end-of-turn save, nothing re-evaluated.
    live.kill()
    live.start()
    res = runner.invoke(app, ["resume", "--server", live.url, "--plain", "--max-tokens", "8"], input=f"{NEXT}\n")
    assert res.exit_code == 0, res.stderr
    m = re.search(r"restored (\d+) tokens .* re-evaluated (\d+) tokens", res.stderr)
    assert m and int(m[1]) > 0 and int(m[2]) == 0, res.stderr


def test_slot_files_per_conversation(live: LlamaServer) -> None:
    s1 = remote_session(live.url)
    conv, _, _ = drain(s1.new_conversation("alice"))
    assert conv is not None
    say(conv, MSGS[0])
    name = str(conv.meta["checkpoint"]["name"])
    regen_info = conv.meta["checkpoint"]["regen"]
    reply = conv.messages[-1]
    assert regen_info["name"] == f"{name}-regen" and regen_info["tokens"] == reply.p0 - 1
    assert live.slot_save_path is not None
    assert (live.slot_save_path / f"{name}.bin").is_file() and (live.slot_save_path / f"{name}-regen.bin").is_file()
    conv.close()
    s1.close()


def test_sliding_window_server_saves_no_points_and_regenerates_as_before(arch_fixtures: ArchFixtures,
                                                                         tmp_path: Path) -> None:
    # gemma3's sliding-window cache (32 tokens in the fixture): the server cannot cut it back, but after a slot
    # restore the window's oldest cell sits exactly at its reuse threshold, so a restored point would make a
    # regenerate evaluate the whole history (measured: 203 tokens at 214) instead of the 1 token its own
    # in-RAM context checkpoints cost in the same process. The probe tells: no points there.
    srv = fixture_server(arch_fixtures.path("gemma3"), tmp_path).start()
    try:
        session = remote_session(srv.url)
        caps = backend(session).caps
        assert (caps.truncate, caps.restore_reuse, caps.memory) == (False, False, "sliding window")
        conv, _, _ = drain(session.new_conversation("alice"))
        assert conv is not None
        say(conv, MSGS[0])
        say(conv, MSGS[1])
        assert "regen" not in conv.meta["checkpoint"]
        assert srv.slot_save_path is not None and not list(srv.slot_save_path.glob("*-regen.bin"))
        again = regen(conv)
        # The rollback cuts the slot back (through the server's RAM checkpoint), the reply evaluates 1 token:
        # both are re-evaluated history, said as such.
        assert again.stats.server_evaluated == 1
        assert again.stats.reevaluated is not None and 1 < again.stats.reevaluated <= 5
        conv.close()
        session.close()
    finally:
        srv.stop()


def test_probe_tells_the_memory_kinds_apart(live: LlamaServer, arch_fixtures: ArchFixtures, tmp_path: Path) -> None:
    session = remote_session(live.url)
    assert backend(session).caps.memory == "recurrent or hybrid"
    session.close()
    srv = fixture_server(arch_fixtures.path("mamba"), tmp_path).start()  # recurrent only
    try:
        session = remote_session(srv.url)
        caps = backend(session).caps
        assert (caps.truncate, caps.restore_reuse, caps.memory) == (False, True, "recurrent or hybrid")
        session.close()
    finally:
        srv.stop()
