"""The command line end to end, on the real bundled model.

Most commands run in-process through Typer's CliRunner (stdout and stderr checked separately); the
console script and cross-process determinism run as real processes. One two-exchange conversation is
made once per session and copied into each test's private CHATCLI_HOME, so tests may change it freely.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from chatcli import __version__
from chatcli.cli.app import app
from chatcli.config.settings import get_paths
from chatcli.core.backend import BackendError
from chatcli.core.files.store import ConversationDir
from chatcli.core.kv import records as sf
from chatcli.models.resolve import bundled_model_path
from chatcli.units import format_size

runner = CliRunner()

FIRST = "  Hi there,   who are you?  "  # the title is this, trimmed and with spaces collapsed
FIRST_TITLE = "Hi there, who are you?"
SECOND = "Name one colour."
GREEDY = ["--temperature", "0", "--max-tokens", "24"]
COMMANDS = ("talk", "resume", "regen", "ls", "show", "export", "rm", "fork", "personas", "config")
PERSONAS = ("alice", "coder", "pirate", "tutor")
STATS_RE = re.compile(r"^\d+ tok evaluated · ttft \d+ ms · [\d.]+ tok/s · (?:prompt \d+ tok/s · )?ctx \d+/\d+ · "
                      r"saved [\d.]+ [KMG]?B in \d+ ms",
                      re.M)


def script() -> str:
    """The `chatcli` console script installed next to this interpreter."""
    path = shutil.which("chatcli", path=str(Path(sys.executable).parent))
    assert path is not None, f"no chatcli script next to {sys.executable}"
    return path


def run(args: list[str], input: str | None = None) -> Any:
    return runner.invoke(app, args, input=input)


def ok(args: list[str], input: str | None = None) -> Any:
    result = run(args, input)
    assert result.exit_code == 0, (args, result.exit_code, result.stdout, result.stderr, result.exception)
    return result


def one_line_error(result: Any, code: int, *needles: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def ls_json() -> list[dict[str, Any]]:
    return json.loads(ok(["ls", "--json"]).stdout)


def messages(conv_id: str) -> list[dict[str, str]]:
    return json.loads(ok(["export", conv_id, "--format", "json"]).stdout)


@pytest.fixture(autouse=True)
def one_thread(chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One llama.cpp thread: on a busy 2-core machine two threads spin-waiting on each other run ~5x slower."""
    monkeypatch.setenv("CHATCLI_THREADS", "1")


@pytest.fixture(scope="session")
def chat_home(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A CHATCLI_HOME holding one piped, greedy, two-exchange conversation with alice."""
    home = tmp_path_factory.mktemp("chat") / "home"
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("CHATCLI_")}
    env.update(CHATCLI_HOME=str(home), NO_COLOR="1", CHATCLI_THREADS="1")
    result = runner.invoke(app, ["talk", *GREEDY], input=f"{FIRST}\n{SECOND}\n", env=env)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    ids = [p.name for p in (home / "data" / "conversations").iterdir()]
    assert len(ids) == 1
    return home, ids[0]


@pytest.fixture
def conv(chat_home: tuple[Path, str], chatcli_home: Path) -> str:
    """This test's own copy of the session's conversation; returns its id."""
    src, conv_id = chat_home
    shutil.copytree(src, chatcli_home)
    return conv_id


# --------------------------------------------------------------------------------------- installation


def test_console_script_entry_point() -> None:
    dist = importlib.metadata.distribution("chatcli")
    scripts = [ep for ep in dist.entry_points if ep.group == "console_scripts" and ep.name == "chatcli"]
    assert len(scripts) == 1
    assert scripts[0].value == "chatcli.cli.entry:main"
    assert dist.version == __version__


def test_version_from_module_and_script() -> None:
    for argv in ([sys.executable, "-m", "chatcli", "--version"], [script(), "--version"]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"chatcli {__version__}\n"


def test_help_lists_every_command() -> None:
    proc = subprocess.run([script(), "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stderr
    listed = set(re.findall(r"^│ (\w+)\s", proc.stdout, re.M))
    assert set(COMMANDS) <= listed, proc.stdout


# ------------------------------------------------------------------------------------------ piped talk


def test_piped_talk_prints_only_the_reply_and_is_deterministic_across_processes() -> None:
    outputs = []
    for _ in range(2):  # the second run also takes the persona prefix from the cache the first one wrote
        proc = subprocess.run([script(), "talk", "--temperature", "0"], input="hi\n", capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert STATS_RE.search(proc.stderr), proc.stderr
        assert "Traceback" not in proc.stderr
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1]
    convs = ls_json()
    assert len(convs) == 2
    for c in convs:
        reply = messages(c["id"])[-1]
        assert reply["role"] == "assistant" and reply["content"].strip()
        assert outputs[0] == reply["content"] + "\n"  # stdout is exactly the reply, nothing else


# ------------------------------------------------------------------------------------ ls / show / export


def test_ls_table_and_json(conv: str) -> None:
    rows = ls_json()
    assert len(rows) == 1
    row = rows[0]
    assert set(row) == {"id", "title", "persona", "turns", "in_context", "tokens", "state_bytes", "updated",
                        "warm", "kv_type", "from"}
    assert row["from"] == ""  # "api" for conversations made by `chatcli serve`
    assert row["id"] == conv
    assert row["title"] == FIRST_TITLE
    assert (row["persona"], row["turns"], row["in_context"]) == ("alice", 2, 2)
    assert row["tokens"] > 0 and row["state_bytes"] > 0 and row["updated"] > 0

    table = ok(["ls"]).stdout.splitlines()
    assert len(table) == 1
    cells = table[0].split("\t")
    assert cells[:6] == [conv, FIRST_TITLE, "alice", "2", "2", str(row["tokens"])]
    assert cells[6] == format_size(row["state_bytes"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", cells[7])
    assert cells[8] == "warm f16" and row["warm"] is True and row["kv_type"] == "f16"


def test_ls_with_no_conversations() -> None:
    assert ok(["ls"]).stdout.startswith("no conversations yet")
    assert json.loads(ok(["ls", "--json"]).stdout) == []


def test_show_and_show_json(conv: str) -> None:
    msgs = messages(conv)
    out = ok(["show", conv]).stdout.splitlines()
    assert out[0] == f"{FIRST_TITLE} · {conv} · persona alice"
    assert out[1] == f"you: {FIRST}"
    assert out[2] == f"assistant: {msgs[-3]['content']}"
    assert out[3] == f"you: {SECOND}"
    assert out[4] == f"assistant: {msgs[-1]['content']}"

    data = json.loads(ok(["show", conv, "--json"]).stdout)
    assert set(data) == {"meta", "events"}
    assert data["meta"]["id"] == conv and data["meta"]["turns"] == 2
    said = [(e["role"], e["text"]) for e in data["events"] if e["type"] == "message"]
    assert said == [("user", FIRST), ("assistant", msgs[-3]["content"]), ("user", SECOND),
                    ("assistant", msgs[-1]["content"])]


def test_show_prints_text_verbatim(conv: str) -> None:
    """Titles and messages are data: no markup, no emoji codes, no hard wrap at 80 columns in a pipe."""
    meta_path = get_paths().conversations_dir / conv / "meta.json"
    meta = json.loads(meta_path.read_text())
    title = "what is [/] or [bold]x :smile: \\ " + "y" * 120
    meta_path.write_text(json.dumps({**meta, "title": title}))
    out = ok(["show", conv]).stdout.splitlines()
    assert out[0] == f"{title} · {conv} · persona alice"
    assert out[1] == f"you: {FIRST}"


def test_closed_stdout_is_not_an_error(conv: str) -> None:
    """`chatcli show --json ID | head -1`: the reader leaving is no reason for an error message."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([script(), "show", conv, "--json"], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=60)
    finally:
        os.close(write_end)
    assert proc.returncode == 1
    assert proc.stderr == ""


def test_export_json_is_an_openai_messages_list(conv: str) -> None:
    msgs = messages(conv)
    assert isinstance(msgs, list)
    assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in msgs)
    assert msgs[0]["role"] == "system"
    assert all(m["role"] != "system" for m in msgs[1:])
    assert [m["role"] for m in msgs[-4:]] == ["user", "assistant", "user", "assistant"]
    assert [msgs[-4]["content"], msgs[-2]["content"]] == [FIRST, SECOND]


def test_export_markdown(conv: str) -> None:
    msgs = messages(conv)
    md = ok(["export", conv, "--format", "md"]).stdout
    assert md.startswith(f"# {FIRST_TITLE}\n")
    assert f"`{conv}`" in md and "persona alice" in md
    assert "> **system:** " + msgs[0]["content"].split("\n")[0] in md
    assert md.count("**You:**") == 2 and md.count("**Assistant:**") == 2
    assert md.index(SECOND) < md.index(msgs[-1]["content"])


def test_export_unknown_format(conv: str) -> None:
    one_line_error(run(["export", conv, "--format", "html"]), 2, "unknown format 'html'")


def test_id_prefixes(conv: str) -> None:
    # A unique prefix is enough.
    assert json.loads(ok(["show", conv[:2], "--json"]).stdout)["meta"]["id"] == conv
    # Make a second conversation whose id starts with the first one's.
    twin = get_paths().conversations_dir / (conv + "x")
    shutil.copytree(get_paths().conversations_dir / conv, twin)
    assert json.loads(ok(["show", conv, "--json"]).stdout)["meta"]["id"] == conv  # an exact id still wins
    for cmd in (["show"], ["export"], ["rm", "--yes"], ["fork"], ["resume"]):
        one_line_error(run([*cmd, conv[:3]]), 2, "ambiguous", conv, conv + "x")
        one_line_error(run([*cmd, "000"]), 2, "no conversation '000'")  # 0 is never in an id
    one_line_error(run(["show", "../etc"]), 2, "invalid conversation id")
    assert twin.is_dir() and (get_paths().conversations_dir / conv).is_dir()


# --------------------------------------------------------------------------------------------- resume


def test_resume_by_id_restores_everything_and_continues(conv: str) -> None:
    before = ls_json()[0]
    first_reply = messages(conv)[-3]["content"]
    result = ok(["resume", conv, *GREEDY], input="/title Colours\nAnd another one?\n")
    err = result.stderr
    # The last exchanges, then the report: all of the state came from disk.
    assert f"you: {FIRST}\n" in err and f"assistant: {first_reply}\n" in err and f"you: {SECOND}\n" in err
    m = re.search(rf"^resumed {conv}: restored (\d+) tokens \([\d.]+ [KMG]?B\) in \d+ ms · re-evaluated 0 tokens$",
                  err, re.M)
    assert m, err
    assert int(m.group(1)) == before["tokens"]
    assert err.index(f"you: {SECOND}") < m.start()
    assert "title set: Colours" in err
    assert STATS_RE.search(err)
    # It answered, on stdout, the reply and nothing else.
    msgs = messages(conv)
    assert msgs[-2] == {"role": "user", "content": "And another one?"}
    assert result.stdout == msgs[-1]["content"] + "\n"
    after = ls_json()[0]
    assert (after["title"], after["turns"]) == ("Colours", 3)
    assert after["tokens"] > before["tokens"]
    assert ok(["ls"]).stdout.split("\t")[1] == "Colours"


def test_resume_uses_the_conversations_own_model(conv: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only --model overrides the model a conversation was made with (its KV state is for that model)."""
    def engine(path: Path, *args: object, **kwargs: object) -> None:
        raise BackendError(f"would load {path}")  # stop before loading anything

    monkeypatch.setattr("chatcli.session.Engine", engine)
    meta_path = get_paths().conversations_dir / conv / "meta.json"
    saved = json.loads(meta_path.read_text())["model"]["path"]
    monkeypatch.setenv("CHATCLI_MODEL", str(tmp_path / "env.gguf"))
    one_line_error(run(["resume", conv]), 1, f"would load {saved}")
    one_line_error(run(["resume", conv, "--model", str(tmp_path / "flag.gguf")]), 2, "not found", "flag.gguf")
    # The conversation's model is gone: the configured one is the fallback.
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "model": {**meta["model"], "path": str(tmp_path / "moved.gguf")}}))
    one_line_error(run(["resume", conv]), 2, "not found", "env.gguf")
    monkeypatch.delenv("CHATCLI_MODEL")
    one_line_error(run(["resume", conv]), 1, f"would load {bundled_model_path()}")


def test_a_conversation_open_elsewhere_is_refused_before_loading(conv: str, monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[object] = []
    monkeypatch.setattr("chatcli.session.Engine", lambda *a, **k: loads.append(a))
    holder = ConversationDir(get_paths().conversations_dir / conv)
    holder.lock()  # as a running `chatcli resume` would
    try:
        one_line_error(run(["resume", conv]), 1, f"conversation {conv} is open in process {os.getpid()}")
        one_line_error(run(["rm", conv, "--yes"]), 1, "is open in process")
    finally:
        holder.unlock()
    assert loads == []
    assert [r["id"] for r in ls_json()] == [conv]


def test_fork_at_1_then_resume_without_id_picks_it(conv: str) -> None:
    parent = messages(conv)
    out = ok(["fork", conv, "--at", "1"]).stdout
    m = re.fullmatch(r"forked into (\w+) \((\d+) tokens of state kept\) · resume with: chatcli resume \1\n", out)
    assert m, out
    child, copied = m.group(1), int(m.group(2))
    assert child != conv
    # The child holds exactly the first exchange (after the same persona messages).
    assert messages(child) == parent[:-2]
    rows = {r["id"]: r for r in ls_json()}
    assert rows[child]["turns"] == 1 and rows[child]["tokens"] == copied
    assert rows[child]["title"] == f"{FIRST_TITLE} (fork at 1)"
    assert ls_json()[0]["id"] == child  # the most recent
    assert sf.scan(get_paths().conversations_dir / child / "state.kv").live()[2] == copied

    result = ok(["resume"], input="")  # no id: the most recent conversation, i.e. the fork
    assert re.search(rf"^resumed {child}: restored {copied} tokens \(.+\) in \d+ ms · re-evaluated 0 tokens$",
                     result.stderr, re.M), result.stderr
    assert result.stdout == ""
    assert messages(child) == parent[:-2]
    assert messages(conv) == parent  # the parent is untouched


def test_fork_whole_conversation_copies_state_and_logits(conv: str) -> None:
    out = ok(["fork", conv]).stdout
    child = out.split()[2]
    assert messages(child) == messages(conv)
    parent_state = sf.scan(get_paths().conversations_dir / conv / "state.kv").live()
    _, logits, n = sf.scan(get_paths().conversations_dir / child / "state.kv").live()
    assert n == parent_state[2] == ls_json()[0]["tokens"]
    # The logits after the last user message came along: /regen on the fork evaluates nothing either.
    assert logits is not None and parent_state[1] is not None and logits.p0 == parent_state[1].p0 < n


def test_fork_at_out_of_range(conv: str) -> None:
    one_line_error(run(["fork", conv, "--at", "3"]), 1, "--at must be between 0 and 2")
    assert len(ls_json()) == 1


# ------------------------------------------------------------------------------------------------- rm


def test_rm_needs_yes_without_a_terminal(conv: str) -> None:
    one_line_error(run(["rm", conv]), 2, "refusing to delete without --yes")
    assert [r["id"] for r in ls_json()] == [conv]
    assert ok(["rm", conv[:3], conv, "--yes"]).stdout == f"deleted {conv}\n"  # named twice, deleted once
    assert ls_json() == []
    assert not (get_paths().conversations_dir / conv).exists()
    one_line_error(run(["show", conv]), 2, "no conversation")


# ------------------------------------------------------------------------------------------- personas


def _persona_rows(stdout: str) -> dict[str, str]:
    rows = {}
    for line in stdout.splitlines():
        name, _description, status = line.split("\t")
        rows[name] = status
    return rows


def test_personas_list_and_warm() -> None:
    assert _persona_rows(ok(["personas"]).stdout) == {p: "not cached" for p in PERSONAS}
    warm = ok(["personas", "--warm", "alice"])
    assert _persona_rows(warm.stdout) == {"alice": "cached"}
    assert re.search(r"^alice: \d+ prefix tokens cached$", warm.stderr, re.M), warm.stderr
    assert _persona_rows(ok(["personas"]).stdout) == {p: "cached" if p == "alice" else "not cached" for p in PERSONAS}


def test_unknown_persona(monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[object] = []
    monkeypatch.setattr("chatcli.session.Engine", lambda *a, **k: loads.append(a))
    one_line_error(run(["talk", "--persona", "nobody"], input="hi\n"), 2,
                   "unknown persona 'nobody'", "available: alice, coder, pirate, tutor")
    one_line_error(run(["personas", "nobody"]), 2, "unknown persona 'nobody'")
    assert loads == []  # refused before loading the model
