"""Commands that never run the model load neither llama.cpp nor numpy (issue #12 item 3).

Each command runs in a fresh interpreter, so what it imports is exactly what it needs; the conversation it
reads is written by hand here (these commands only read files).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chatcli.config.settings import get_paths
from chatcli.core.files.store import ConversationStore
from tests.golden import REPO

HEAVY = ("llama_cpp", "numpy")
ROOT = Path(__file__).resolve().parent.parent

# Runs the CLI in-process with the given arguments, then reports what it imported (last stdout line).
WRAPPER = f"""
import json, sys
from chatcli.cli.app import app
code = 0
try:
    app(sys.argv[1:], prog_name="chatcli")
except SystemExit as exc:
    code = exc.code or 0
print()
print(json.dumps({{"code": code, "heavy": [m for m in {HEAVY!r} if m in sys.modules],
                  "modules": sorted({{m.split(".")[0] for m in sys.modules}})}}))
"""


@pytest.fixture
def conv_id(chatcli_home: Path) -> str:
    store = ConversationStore(get_paths().conversations_dir)
    conv = store.create({"title": "hand-made", "persona": "alice", "model": {"name": "none"}, "seed": 1})
    conv.append_event({"type": "prefix", "persona": "alice", "messages": [{"role": "system", "content": "S"}],
                       "tokens": [1, 2, 3], "span": [0, 3]})
    conv.append_event({"type": "message", "mid": 0, "role": "user", "text": "hi", "tokens": [4, 5], "span": [3, 5], "turn": 0})
    conv.append_event({"type": "message", "mid": 1, "role": "assistant", "text": "hello", "tokens": [6, 7],
                       "span": [5, 7], "turn": 0})
    return conv.id


def run_cli(*args: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, (args, proc.stdout, proc.stderr)
    return result


@pytest.mark.parametrize("args", [
    ["ls"], ["ls", "--json"], ["show", "{id}"], ["show", "{id}", "--json"], ["export", "{id}"],
    ["export", "{id}", "--format", "json"], ["config", "show"], ["config", "path"], ["personas"],
    ["rm", "--yes", "{id}"],
])
def test_commands_that_do_not_run_the_model_import_neither_llama_cpp_nor_numpy(conv_id: str, args: list[str]) -> None:
    result = run_cli(*(a.format(id=conv_id) for a in args))
    assert result["heavy"] == [], f"`chatcli {' '.join(args)}` imported {result['heavy']}"


def test_ls_loads_no_renderer_template_engine_or_pydantic(conv_id: str) -> None:
    """`chatcli ls` into a pipe (issue #15 goal 3b): the metadata summary spares the transcript replay and
    its chat-template module (jinja2), plain output needs no rich, and typer < 0.29 needs no pydantic."""
    conv = ConversationStore(get_paths().conversations_dir).resolve(conv_id)
    meta = conv.read_meta()
    conv.write_meta({**meta, "summary": conv.make_summary(1, 1, conv.transcript_stamp())})
    for args in (["ls"], ["ls", "--json"]):
        modules = run_cli(*args)["modules"]
        assert isinstance(modules, list)
        assert not {"rich", "jinja2", "pydantic"} & set(modules), f"`chatcli {' '.join(args)}` imported {modules}"
    # Without the summary (a conversation written before it existed) ls replays the transcript: still correct.
    # (The index would remember the counts of this very transcript: it goes too, as in an older data dir.)
    conv.write_meta(meta)
    for f in get_paths().data_dir.glob("index.sqlite*"):
        f.unlink()
    assert "jinja2" in run_cli("ls")["modules"]


def test_the_wrapper_sees_heavy_imports() -> None:
    """The check above can fail: a command that loads the model's modules is seen doing so."""
    proc = subprocess.run([sys.executable, "-c", "import chatcli.backends.llamacpp\n" + WRAPPER, "--version"],
                          capture_output=True, text=True, timeout=120)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["heavy"] == list(HEAVY)


def _module_map(design: str) -> set[str]:
    """The modules DESIGN.md's module-map table names: each row's first cell, one or more backticked paths."""
    section = design.split("## Module map", 1)[1].split("\n## ", 1)[0]
    listed: set[str] = set()
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) < 3 or not line.startswith("|"):
            continue
        listed.update(re.findall(r"`([\w/]+\.py)`", cells[1]))
    return listed


def test_design_module_map_matches_the_tree() -> None:
    """DESIGN.md's module map lists every module under chatcli/ and no module that does not exist."""
    package = ROOT / "chatcli"
    tree = {p.relative_to(package).as_posix() for p in package.rglob("*.py")
            if p.name not in ("__init__.py", "__main__.py") and "data" not in p.relative_to(package).parts[:1]}
    listed = _module_map((ROOT / "docs" / "DESIGN.md").read_text("utf-8"))
    assert listed, "no module map table found in docs/DESIGN.md"
    assert not tree - listed, f"modules missing from DESIGN.md's module map: {sorted(tree - listed)}"
    assert not listed - tree, f"DESIGN.md's module map names files that do not exist: {sorted(listed - tree)}"


def test_no_pickle_eval_or_exec_of_anything() -> None:
    banned = re.compile(r"\bpickle\b|\bmarshal\b|\bshelve\b|allow_pickle\s*=\s*True|(?<![.\w])(?<!def )(eval|exec)\s*\(")
    hits = []
    for src in sorted((REPO / "chatcli").rglob("*.py")):
        for n, line in enumerate(src.read_text("utf-8").splitlines(), 1):
            if banned.search(line.split("#", 1)[0]):
                hits.append(f"{src.relative_to(REPO)}:{n}: {line.strip()}")
    assert hits == []
    assert banned.search("x = pickle.loads(data)") and banned.search("eval(text)") and not banned.search("eng.eval(t)")
