"""On-disk format versions (issue #11 item 5), with crafted files around a real conversation.

The rule (chatcli/core/files/migrations.py): a newer major version of any file is refused in one line naming the
version, before anything is written; an unknown transcript event type or state record kind of a known
version is skipped, never taken for damage.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.config.settings import get_paths
from chatcli.core.files import migrations
from chatcli.core.files.store import ConversationDir
from chatcli.core.kv import records as sf

runner = CliRunner()
FILES = ("meta.json", "transcript.jsonl", "state.kv")
RESUMED = re.compile(r"resumed \w+: restored (\d+) tokens .* re-evaluated (\d+) tokens")


@pytest.fixture(scope="module")
def chat_home(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    home = tmp_path_factory.mktemp("formats") / "home"
    env = {"CHATCLI_HOME": str(home), "NO_COLOR": "1", "CHATCLI_THREADS": "1"}
    result = runner.invoke(app, ["talk", "--temperature", "0", "--max-tokens", "16"], input="Hi!\nName a colour.\n", env=env)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    (cid,) = [p.name for p in (home / "data" / "conversations").iterdir()]
    return home, cid


@pytest.fixture
def conv(chat_home: tuple[Path, str], chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> ConversationDir:
    """This test's own copy of the two-exchange conversation."""
    monkeypatch.setenv("CHATCLI_THREADS", "1")
    shutil.copytree(chat_home[0], chatcli_home)
    return ConversationDir(get_paths().conversations_dir / chat_home[1])


def snapshot(conv: ConversationDir) -> dict[str, bytes]:
    return {name: (conv.path / name).read_bytes() for name in FILES}


def one_line_error(result: Any, code: int, *needles: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def resume(cid: str) -> Any:
    return runner.invoke(app, ["resume", cid, "--temperature", "0"], input="")


def rewrite_state_header(path: Path, header: dict[str, Any], magic: bytes = sf.MAGIC) -> None:
    """Replace the header record with ``header`` (a valid record: right length and crc)."""
    data = path.read_bytes()
    first = sf.scan(path).records[0]
    rec = sf.encode_record(sf.HEADER, 0, 0, json.dumps(header, sort_keys=True).encode())
    path.write_bytes(magic + rec[4:] + data[first.size:])


def test_newer_metadata_is_refused_by_every_command_and_nothing_changes(conv: ConversationDir) -> None:
    meta = json.loads(conv.meta_path.read_text())
    conv.meta_path.write_text(json.dumps({**meta, "format": 2}))
    before = snapshot(conv)
    for cmd in (["show", conv.id], ["export", conv.id], ["fork", conv.id], ["regen", conv.id], ["resume", conv.id]):
        one_line_error(runner.invoke(app, cmd, input=""), 1, f"conversation {conv.id}", "metadata format 2",
                       "newer chatcli")
    # `ls` names it on stderr and lists the others; `rm` still deletes it.
    result = runner.invoke(app, ["ls", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout) == []
    assert "metadata format 2" in result.stderr
    assert snapshot(conv) == before
    assert runner.invoke(app, ["rm", "--yes", conv.id]).exit_code == 0 and not conv.path.exists()


def test_newer_transcript_line_is_refused_and_nothing_changes(conv: ConversationDir) -> None:
    line = {"v": 2, "ts": 0, "type": "message", "mid": 99, "role": "user", "text": "from the future"}
    with conv.transcript_path.open("a") as fh:
        fh.write(json.dumps(line) + "\n")
    before = snapshot(conv)
    for cmd in (["show", conv.id], ["export", conv.id], ["fork", conv.id], ["resume", conv.id]):
        one_line_error(runner.invoke(app, cmd, input=""), 1, "transcript format 2", "line 6", "newer chatcli")
    result = runner.invoke(app, ["ls", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout) == [] and "transcript format 2" in result.stderr
    assert snapshot(conv) == before


def test_newer_torn_tail_is_not_cut(conv: ConversationDir) -> None:
    """A last line without its newline that parses as an event of a newer version is not ours to cut."""
    with conv.transcript_path.open("a") as fh:
        fh.write(json.dumps({"v": 2, "type": "message"}))
    size = conv.transcript_path.stat().st_size
    conv.repair_transcript_tail()
    assert conv.transcript_path.stat().st_size == size + 1  # terminated, not truncated


@pytest.mark.parametrize("how", ["header", "framing"])
def test_newer_state_file_is_refused_before_loading_and_never_rebuilt_over(conv: ConversationDir, how: str) -> None:
    header = sf.scan(conv.state_path).header
    assert header is not None and header["format"] == sf.FORMAT_VERSION  # upgraded in memory
    if how == "header":
        newer = sf.FORMAT_VERSION + 1
        rewrite_state_header(conv.state_path, {**header, "format": newer})
        needle = f"state file format {newer}"
    else:
        rewrite_state_header(conv.state_path, header, magic=b"CKV2")
        needle = "state file record framing format 2"
    before = snapshot(conv)
    assert sf.scan(conv.state_path).newer_format
    for cmd in (["resume", conv.id], ["regen", conv.id], ["show", conv.id], ["fork", conv.id]):
        one_line_error(runner.invoke(app, cmd, input=""), 1, needle, "newer chatcli")
    assert snapshot(conv) == before


def test_unknown_record_kind_is_skipped_not_cut(conv: ConversationDir) -> None:
    """A record of a kind this version does not know (added by a newer chatcli under the same major version)
    between two turns' cells: every cell still loads, nothing is re-evaluated, the file stays as it is."""
    path = conv.state_path
    res = sf.scan(path)
    n_tokens = res.live()[2]
    cells = [r for r in res.records if r.kind == sf.CELLS]
    assert len(cells) >= 3
    at = cells[1].offset + cells[1].size  # after the first exchange's user cells
    data = path.read_bytes()
    unknown = sf.encode_record(42, 7, 3, b"something a newer chatcli understands")  # p1 < p0: not ours to judge
    path.write_bytes(data[:at] + unknown + data[at:])
    scanned = sf.scan(path)
    assert scanned.dropped_bytes == 0 and scanned.problem == "" and scanned.live()[2] == n_tokens
    assert [r.kind for r in scanned.records].count(42) == 1
    before = snapshot(conv)
    result = resume(conv.id)
    assert result.exit_code == 0, result.stderr
    m = RESUMED.search(result.stderr)
    assert m and (int(m.group(1)), int(m.group(2))) == (n_tokens, 0), result.stderr
    assert "warning" not in result.stderr
    assert snapshot(conv) == before  # not cut there, not rewritten


def test_unknown_transcript_event_type_is_skipped(conv: ConversationDir) -> None:
    with conv.transcript_path.open("a") as fh:
        fh.write(json.dumps({"v": 1, "ts": 0, "type": "bookmark", "name": "added by a newer chatcli"}) + "\n")
    result = resume(conv.id)
    assert result.exit_code == 0, result.stderr
    m = RESUMED.search(result.stderr)
    assert m and int(m.group(2)) == 0 and "warning" not in result.stderr, result.stderr
    assert "bookmark" in conv.transcript_path.read_text()


def test_version_check_and_v1_migrations_are_identities() -> None:
    with pytest.raises(migrations.FormatError, match=r"^x: metadata format 3 was written by a newer chatcli"):
        migrations.check("metadata", 3, 1, where="x")
    for bad in (None, "1", 0, True, 1.0):
        with pytest.raises(ValueError) as info:
            migrations.check("metadata", bad, 1)
        assert not isinstance(info.value, migrations.FormatError)
    assert migrations.check("transcript", 1, 1) == 1
    meta = {"format": 1, "title": "t"}
    assert migrations.upgrade_meta(dict(meta)) == meta
    assert migrations.upgrade_event({"v": 1, "type": "x"}) == {"v": 1, "type": "x"}
    # State format 2 added the BASE record (forks sharing bytes): a version-1 header reads unchanged.
    assert migrations.upgrade_state_header({"format": 1, "identity": {}}) == {"format": 2, "identity": {}}
    # The record header layout the crafted files above rely on.
    assert struct.calcsize("<4sBBHiiQI") == sf.HEADER_SIZE
