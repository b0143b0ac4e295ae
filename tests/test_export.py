"""Exports hold the whole conversation, also what left the model's context (issue #11 item 2).

One real conversation at n_ctx 512 runs long enough to shift several times, with an /undo, a /regen
and an /edit on the way, so the active path differs from "every message ever written".
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.core.conversation import Conversation
from chatcli.repl.commands import dispatch
from chatcli.repl.context import CommandContext
from chatcli.repl.render import Renderer
from chatcli.repl.terminal import LineIO
from tests.drive import build_session, drain

runner = CliRunner()
N_CTX = 512


def long_message(i: int) -> str:
    return (f"Message {i}. Please remember the number {i * 7} and tell me a short fact about the sea, "
            "the mountains, the rivers and the stars, in one sentence.")


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A conversation whose oldest exchanges left the context; returns what its active path must be."""
    home = tmp_path_factory.mktemp("export") / "home"
    mp = pytest.MonkeyPatch()
    mp.setenv("CHATCLI_HOME", str(home))
    try:
        session = build_session(n_ctx=N_CTX, reserve=64, max_tokens=40)
        conv, _, _ = drain(session.new_conversation("alice"))
        assert isinstance(conv, Conversation)
        path: list[tuple[str, str]] = []  # (role, text) of the active path, kept by hand

        def send(text: str) -> None:
            _, _, ends = drain(conv.send(text))
            path.extend([("user", text), ("assistant", ends[-1].message.text)])

        for i in range(12):
            send(long_message(i))
            if i == 2:  # an exchange that is undone must not be exported
                send("This one gets undone.")
                conv.undo(1)
                del path[-2:]
            if i == 4:  # a regenerated reply: only the active alternative is exported
                _, _, ends = drain(conv.regen(seed=99))
                path[-1] = ("assistant", ends[-1].message.text)
            if i == 6:  # an edited message replaces the old one
                _, _, ends = drain(conv.edit(None, "Edited message six."))
                path[-2:] = [("user", "Edited message six."), ("assistant", ends[-1].message.text)]
        in_context = [(m.role, m.text) for m in conv.messages]
        assert conv.r.out_of_context and len(in_context) < len(path)  # the test really crossed shifts
        assert path[-len(in_context):] == in_context
        persona = [m.as_dict() for m in conv.r.persona_messages]
        save_target = home.parent / "saved.md"
        out = io.StringIO()
        ctx = CommandContext(conv=conv, renderer=Renderer(Console(file=out), plain=True, err=out), io=LineIO(io.StringIO()),
                             run_reply=lambda events: None, personas=dict, switch_persona=lambda name: None)
        dispatch(ctx, f"/save {save_target}")
        saved_notice = out.getvalue()
        conv.close()
        session.close()
        return {"home": home, "id": conv.id, "path": path, "in_context": in_context, "persona": persona,
                "saved": save_target.read_text("utf-8"), "saved_notice": saved_notice}
    finally:
        mp.undo()


def cli(chat: dict[str, Any], monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    monkeypatch.setenv("CHATCLI_HOME", str(chat["home"]))
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result.stdout


def test_export_json_holds_every_message_of_the_active_path(chat: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    msgs = json.loads(cli(chat, monkeypatch, "export", chat["id"], "--format", "json"))
    assert msgs[: len(chat["persona"])] == chat["persona"]
    assert [(m["role"], m["content"]) for m in msgs[len(chat["persona"]):]] == chat["path"]
    assert "This one gets undone." not in json.dumps(msgs)


def test_export_in_context_gives_only_what_the_context_holds(chat: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    msgs = json.loads(cli(chat, monkeypatch, "export", chat["id"], "--format", "json", "--in-context"))
    assert [(m["role"], m["content"]) for m in msgs[len(chat["persona"]):]] == chat["in_context"]


def _md_messages(md: str) -> list[tuple[str, str]]:
    """(role, text) of a Markdown export's messages, in order."""
    out: list[tuple[str, str]] = []
    for block in md.split("**You:**\n\n")[1:]:
        user, _, rest = block.partition("\n\n**Assistant:**\n\n")
        out += [("user", user), ("assistant", rest.rstrip("\n"))]
    return out


def test_export_markdown_and_save_hold_every_message(chat: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    md = cli(chat, monkeypatch, "export", chat["id"], "--format", "md")
    assert _md_messages(md) == chat["path"]
    assert chat["saved"] == md  # /save writes the same Markdown
    exchanges = len(chat["path"]) // 2
    assert f"saved {exchanges} exchange{'' if exchanges == 1 else 's'} to " in chat["saved_notice"]
    md_in = cli(chat, monkeypatch, "export", chat["id"], "--format", "md", "--in-context")
    assert _md_messages(md_in) == chat["in_context"]


def test_ls_counts_every_exchange_and_those_in_context(chat: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    (row,) = json.loads(cli(chat, monkeypatch, "ls", "--json"))
    assert row["turns"] == len(chat["path"]) // 2 == 12
    assert row["in_context"] == len(chat["in_context"]) // 2 < row["turns"]
    table = cli(chat, monkeypatch, "ls").split("\t")
    assert table[3:5] == [str(row["turns"]), str(row["in_context"])]


def test_ls_reads_the_counts_from_the_metadata_summary_until_the_transcript_changes(
        chat: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """meta.json caches what `ls` shows (issue #15 goal 3b); the transcript stays the truth."""
    import shutil

    from chatcli.core.export import exchange_counts
    from chatcli.core.files.store import ConversationDir
    from chatcli.core.transcript import replay_events

    home = tmp_path / "home"
    shutil.copytree(chat["home"], home)  # copy2: sizes and mtimes kept, so the summary still holds
    conv = ConversationDir(home / "data" / "conversations" / chat["id"])
    meta = json.loads(conv.meta_path.read_text("utf-8"))
    truth = exchange_counts(replay_events(conv.read_transcript().events))
    # Written by the real conversation (shifts, /undo, /regen, /edit on the way), and current.
    assert conv.cached_counts(meta) == truth == (12, len(chat["in_context"]) // 2)
    # ls takes the cached counts without reading the transcript: a summary saying otherwise is believed...
    meta["summary"].update(exchanges=40, in_context=30)
    conv.meta_path.write_text(json.dumps(meta), "utf-8")
    moved = {**chat, "home": home}
    (row,) = json.loads(cli(moved, monkeypatch, "ls", "--json"))
    assert (row["turns"], row["in_context"]) == (40, 30)
    # ...until the transcript grows (an event of a newer chatcli's unknown type: replay skips it).
    with conv.transcript_path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps({"v": 1, "type": "future-note", "ts": 0}) + "\n")
    assert conv.cached_counts(meta) is None
    (row,) = json.loads(cli(moved, monkeypatch, "ls", "--json"))
    assert (row["turns"], row["in_context"]) == truth


def test_a_new_conversation_never_inherits_a_summary(tmp_path: Path) -> None:
    """A fork copies its parent's metadata: the parent's summary describes another transcript."""
    from chatcli.core.files.store import ConversationStore

    store = ConversationStore(tmp_path / "conversations")
    parent = store.create({"title": "p"})
    parent.append_event({"type": "prefix", "tokens": [1], "messages": []})
    summary = parent.make_summary(3, 2, parent.transcript_stamp())
    child = store.create({"title": "c", "summary": summary})
    meta = child.read_meta()
    assert "summary" not in meta and child.cached_counts({**meta, "summary": summary}) is None
    assert parent.cached_counts({"summary": summary}) == (3, 2)


def test_ls_from_column_only_next_to_api_conversations(chatcli_home: Path) -> None:
    from chatcli.config.settings import get_paths
    from chatcli.core.files.store import ConversationStore

    store = ConversationStore(get_paths().conversations_dir)
    store.create({"title": "mine", "persona": "alice", "updated": 1})
    out = runner.invoke(app, ["ls"])
    assert out.exit_code == 0, out.stderr
    (row,) = out.stdout.splitlines()
    assert not row.endswith("\t") and len(row.split("\t")) == 9  # no empty trailing "from" cell
    assert "1 conversation:" in out.stderr  # singular
    store.create({"title": "served", "persona": "alice", "source": "api"})
    out = runner.invoke(app, ["ls"])
    assert sorted(r.split("\t")[-1] for r in out.stdout.splitlines()) == ["api", "cli"]
    assert "2 conversations:" in out.stderr


def test_export_path_of_a_crafted_transcript(tmp_path: Path) -> None:
    """The order rule without a model: shifted-out messages first, then the context; undone ones absent."""
    from chatcli.core.export import conversation_path, exchange_counts
    from chatcli.core.transcript import replay_events

    def msg(mid: int, role: str, p0: int, n: int = 2, turn: int = 0) -> dict[str, Any]:
        return {"type": "message", "mid": mid, "role": role, "text": f"m{mid}", "tokens": [1] * n,
                "span": [p0, p0 + n], "turn": turn}

    events = [
        {"type": "prefix", "tokens": [1, 1], "messages": []},
        msg(0, "user", 2), msg(1, "assistant", 4), msg(2, "user", 6, turn=1), msg(3, "assistant", 8, turn=1),
        {"type": "shift", "keep": 2, "drop": 4},  # m0, m1 leave the context
        msg(4, "user", 6, turn=2), msg(5, "assistant", 8, turn=2),
        {"type": "truncate", "to": 6, "reason": "undo"},  # m4, m5 undone
        msg(6, "user", 6, turn=3), msg(7, "assistant", 8, turn=3),
    ]
    r = replay_events(events)
    assert [(m.text, m.in_context) for m in conversation_path(r)] == [
        ("m0", False), ("m1", False), ("m2", True), ("m3", True), ("m6", True), ("m7", True)]
    assert exchange_counts(r) == (3, 2)


def test_fork_at_counts_exchanges_as_show_does_after_a_shift(chat: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    """`--at N` counts exchanges as `ls`'s turns and `show` do, also once old exchanges left the context; a
    fork before the context's first exchange is refused in one line and creates nothing."""
    import shutil

    home = tmp_path / "home"
    shutil.copytree(chat["home"], home)
    moved = {**chat, "home": home}
    turns = len(chat["path"]) // 2
    gone = turns - len(chat["in_context"]) // 2
    assert gone > 0
    monkeypatch.setenv("CHATCLI_HOME", str(home))
    refused = runner.invoke(app, ["fork", chat["id"], "--at", str(gone - 1)])
    assert refused.exit_code == 1 and refused.stderr.count("\n") == 1
    assert f"exchanges 1..{gone} left the context" in refused.stderr
    assert len(json.loads(cli(moved, monkeypatch, "ls", "--json"))) == 1  # nothing was created
    at = gone + 2
    child = cli(moved, monkeypatch, "fork", chat["id"], "--at", str(at)).split()[2]
    msgs = json.loads(cli(moved, monkeypatch, "export", child, "--format", "json"))
    # The fork holds the whole history up to exchange `at`: the shifted-out exchanges come along as such
    # (issue #24 item 9), the context's ones up to `at` after them.
    assert [(m["role"], m["content"]) for m in msgs[len(chat["persona"]):]] == chat["path"][:2 * at]
    assert chat["path"][2 * at - 2:2 * at] == chat["in_context"][2:4]
    rows = {r["id"]: r for r in json.loads(cli(moved, monkeypatch, "ls", "--json"))}
    assert rows[child]["turns"] == at and rows[child]["title"].endswith(f"(fork at {at})")
