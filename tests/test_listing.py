"""`chatcli ls` on a terminal (aligned columns that fit its width) and the executable's fast path for it
(no typer: issue #15 goal 3b), which must fail like every other command: one line and an exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chatcli.cli.listing import _width, format_columns
from chatcli.config.settings import get_paths
from chatcli.core.files.store import ConversationStore

ROWS = [
    {"id": "abc123", "title": "a fairly long title about gardens and rivers", "turns": 12, "state": "41.4 MB"},
    {"id": "def456", "title": "日本語のタイトルです、長いです", "turns": 3, "state": "cold"},
    {"id": "ghi789", "title": "evil\x1b[31mred\ttab", "turns": 100, "state": "2.0 MB"},
]
COLUMNS = ["id", "title", "turns", "state"]


@pytest.mark.parametrize("width", [40, 50, 80, 200])
def test_lines_fit_the_terminal_and_columns_line_up(width: int) -> None:
    lines = format_columns(ROWS, COLUMNS, width, bold_header=False)
    assert len(lines) == 1 + len(ROWS)
    assert all(_width(line) <= width for line in lines), [(_width(x), x) for x in lines]
    # Every column starts at the same cell on every line: the header's "turns" ends where the numbers end.
    end = lines[0].index("turns") + len("turns")
    assert [_cells(line, end).split()[-1] for line in lines[1:]] == ["12", "3", "100"]
    natural = max(_width(line) for line in format_columns(ROWS, COLUMNS, 1000, bold_header=False))
    if width >= natural:  # room enough: nothing is cut
        assert ROWS[0]["title"] in lines[1] and "…" not in "".join(lines)
    else:  # the title gave up the width, and the lines are as wide as the terminal allows
        assert "…" in lines[1] and max(_width(line) for line in lines) == width


def _cells(line: str, n: int) -> str:
    """The first ``n`` terminal cells of ``line``."""
    out = ""
    for ch in line:
        if _width(out + ch) > n:
            break
        out += ch
    return out


def test_wide_characters_count_two_cells_and_are_never_split() -> None:
    lines = format_columns(ROWS, COLUMNS, 45, bold_header=False)
    title = lines[2][len("def456  "):].split("  ")[0]
    assert title.endswith("…") and _width(title) <= 45
    assert set(title[:-1]) <= set(str(ROWS[1]["title"]))


def test_control_characters_never_reach_the_terminal() -> None:
    text = "\n".join(format_columns(ROWS, COLUMNS, 200, bold_header=True))
    assert "\x1b[31m" not in text and "\t" not in text
    assert text.startswith("\x1b[1m") and text.count("\x1b") == 2  # only the bold header's own codes


def test_a_title_is_never_cut_below_its_header() -> None:
    lines = format_columns(ROWS, COLUMNS, 10, bold_header=False)
    assert lines[0].split()[:2] == ["id", "title"]  # too narrow a terminal: lines wrap, nothing vanishes


WRAPPER = """
import json, sys
sys.argv = ["chatcli", *sys.argv[1:]]
from chatcli.cli.entry import main
try:
    main()
    code = 0
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "typer": "typer" in sys.modules}))
"""


def run_entry(*args: str) -> tuple[dict[str, object], str, str]:
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env={**os.environ})
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout, proc.stderr


def test_bare_ls_skips_typer_and_lists_the_same(chatcli_home: Path) -> None:
    store = ConversationStore(get_paths().conversations_dir)
    conv = store.create({"title": "hand-made", "persona": "alice", "model": {"name": "none"}, "seed": 1})
    result, out, _ = run_entry("ls", "--json")
    assert result == {"code": 0, "typer": False}
    assert [r["id"] for r in json.loads(out[: out.rindex("]") + 1])] == [conv.id]
    result, out, err = run_entry("ls")
    assert result == {"code": 0, "typer": False} and out.startswith(conv.id + "\thand-made")
    assert "1 conversation:" in err
    # Anything more than the bare forms goes through typer: its help and its usage errors.
    result, out, _ = run_entry("ls", "--help")
    assert result == {"code": 0, "typer": True} and "--json" in out
    result, _, err = run_entry("ls", "--jsn")
    assert result["code"] == 2 and "No such option" in err


def test_the_fast_path_fails_in_one_line(chatcli_home: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    import chatcli.cli.listing
    from chatcli.cli.entry import main
    from chatcli.core.files.store import StoreError

    def broken(**_: object) -> None:
        raise StoreError("the store is unreadable")

    monkeypatch.setattr(chatcli.cli.listing, "list_conversations", broken)
    monkeypatch.setattr(sys, "argv", ["chatcli", "ls"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "error: the store is unreadable\n"


def test_the_screen_shows_in_context_only_after_a_shift_and_folds_the_kv_type() -> None:
    from datetime import datetime

    from chatcli.cli.listing import _screen_columns

    cols = ["id", "turns", "in_context", "state", "updated", "kv"]
    now = datetime.now()
    base = {"id": "a", "turns": 3, "in_context": 3, "state": "2.0 MB", "warm": True, "kv_type": "f16",
            "updated_at": now, "updated": now.strftime("%Y-%m-%d %H:%M"), "kv": "warm f16"}
    rows, shown = _screen_columns([base, {**base, "id": "b", "warm": False, "state": "0 B"}], cols)
    assert shown == ["id", "turns", "state", "updated"]
    assert [r["state"] for r in rows] == ["2.0 MB", "cold"] and rows[0]["updated"] == now.strftime("%m-%d %H:%M")
    rows, shown = _screen_columns([{**base, "in_context": 1, "kv_type": "q8_0"}], cols)
    assert shown == ["id", "turns", "in_context", "state", "updated"] and rows[0]["state"] == "2.0 MB q8_0"
