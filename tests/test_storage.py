"""State that fits: the state budget (LRU eviction) and quantized KV types, on the real model."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chatcli import units
from chatcli.config.settings import SettingsError, get_paths, load_settings
from chatcli.core.conversation import Conversation
from chatcli.core.events import Notice, Progress
from chatcli.core.files.store import ConversationDir, ConversationStore
from chatcli.core.kv import budget
from chatcli.core.kv import records as sf
from tests.drive import build_session, drain, says
from tests.drive import run_process as drive

DRIVE = str(Path(__file__).parent / "drive.py")
MSGS = ["Hi! What is your name?", "What is the capital of France?", "And of Italy?"]


# -- sizes and settings (no model) -------------------------------------------------------------------


def test_counts_agree_with_their_noun() -> None:
    assert [units.counted(n, "exchange") for n in (0, 1, 2)] == ["0 exchanges", "1 exchange", "2 exchanges"]
    assert units.counted(1, "conversation folder") == "1 conversation folder"
    assert units.counted(3, "index", "indexes") == "3 indexes"


def test_sizes_parse_like_chatcli_prints_them() -> None:
    assert units.parse_size("20GB") == 20 << 30
    assert units.parse_size("500MB") == units.parse_size("500 MiB") == units.parse_size("500m") == 500 << 20
    assert units.parse_size("1.5G") == 3 << 29
    assert units.parse_size("4096") == 4096
    for unlimited in ("0", "none", "None", "unlimited", ""):
        assert units.parse_size(unlimited) is None
    for bad in ("lots", "5 parsecs", "-1", "1e9", "GB"):
        with pytest.raises(units.SizeError):
            units.parse_size(bad)


def test_budget_and_kv_type_settings(chatcli_home: Path) -> None:
    from chatcli.backends.llamacpp import KV_TYPES
    from chatcli.config.settings import KV_TYPE_NAMES

    assert tuple(KV_TYPES) == KV_TYPE_NAMES
    s = load_settings(env={"CHATCLI_STATE_BUDGET": "500MB", "CHATCLI_KV_TYPE": "q8_0", "CHATCLI_HOME": str(chatcli_home)})
    assert (s.state_budget, s.kv_type) == ("500MB", "q8_0")
    assert load_settings({"state_budget": "none"}).state_budget == "none"
    assert units.parse_size(load_settings().state_budget) == 20 << 30  # the default
    with pytest.raises(SettingsError, match=r"CHATCLI_STATE_BUDGET.*size"):
        load_settings(env={"CHATCLI_STATE_BUDGET": "lots", "CHATCLI_HOME": str(chatcli_home)})
    with pytest.raises(SettingsError, match=r"--kv-type.*f16, q8_0, q4_0"):
        load_settings({"kv_type": "q5_1"})
    cfg = chatcli_home / "config"
    cfg.mkdir(parents=True)
    (cfg / "config.toml").write_text("state_budget = 0\n")
    assert units.parse_size(load_settings().state_budget) is None  # an integer in TOML is a size in bytes


# -- in-process sessions (one model load per KV type for the module) -----------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    home = tmp_path_factory.mktemp("engines-home")
    old = os.environ.get("CHATCLI_HOME")
    os.environ["CHATCLI_HOME"] = str(home)
    try:
        made = {t: build_session(kv_type=t, max_tokens=12) for t in ("f16", "q8_0")}
    finally:
        if old is None:
            os.environ.pop("CHATCLI_HOME", None)
        else:
            os.environ["CHATCLI_HOME"] = old
    yield made
    for s in made.values():
        s.close()


def here(session: Any, **settings: Any) -> Any:
    """The module's session (its engine) with this test's CHATCLI_HOME and settings."""
    paths = get_paths()
    return dataclasses.replace(session, paths=paths, store=ConversationStore(paths.conversations_dir),
                               settings=dataclasses.replace(session.settings, **settings))


def new_conv(session: Any, persona: str, text: str) -> Conversation:
    conv, _, _ = drain(session.new_conversation(persona))
    assert conv is not None
    drain(conv.send(text))
    return conv


def set_last_use(session: Any, conv_id: str, t: float) -> None:
    d = session.store.resolve(conv_id)
    meta = d.read_meta()
    meta["updated"] = t
    d.write_meta(meta)
    os.utime(d.state_path, (t, t))


def test_tiny_budget_evicts_in_lru_order_and_spares_the_open_conversation(engines: dict[str, Any]) -> None:
    s = here(engines["f16"])
    a = new_conv(s, "alice", "Hello there.")
    a.close()
    b = new_conv(s, "pirate", "Ahoy.")
    b.close()
    c = new_conv(s, "pirate", "Where is the treasure?")
    c.close()
    prefixes = sorted(s.paths.prefix_cache_dir.glob("*.kv"))
    assert len(prefixes) == 2  # alice's and the pirate's persona prefixes
    pirate_prefix = next(p for p in prefixes if p != _prefix_of(s, a.id))
    # Last use: a (oldest) < pirate prefix < b < c < alice prefix.
    set_last_use(s, a.id, 1_000_000)
    os.utime(pirate_prefix, (1_500_000, 1_500_000))
    set_last_use(s, b.id, 2_000_000)
    set_last_use(s, c.id, 3_000_000)
    os.utime(_prefix_of(s, a.id), (4_000_000, 4_000_000))

    conv, report, _ = drain(s.open_conversation(a.id))  # the oldest is the open one
    assert conv is not None and report is not None and report.restored_tokens > 0
    usage = budget.scan_usage(s.paths.conversations_dir, s.paths.prefix_cache_dir)
    size = {i.conv_id or i.path.name: i.size for i in usage.items}
    limit = usage.total - size[pirate_prefix.name] - size[b.id]  # exactly what dropping the two LRU files frees
    freed = budget.enforce(s.paths.conversations_dir, s.paths.prefix_cache_dir, limit, keep_prefixes=[_prefix_of(s, a.id)])
    assert [i.conv_id or i.path.name for i in freed.evicted] == [pirate_prefix.name, b.id]
    assert freed.spared_open == [a.id]  # recognised by its lock alone (keep_ids was not given)
    assert freed.after == limit and not freed.over_budget
    assert not pirate_prefix.exists() and not s.store.resolve(b.id).state_path.exists()
    assert s.store.resolve(c.id).state_path.exists() and s.store.resolve(a.id).state_path.exists()
    for cid in (a.id, b.id, c.id):  # transcripts are never touched
        assert s.store.resolve(cid).transcript_path.stat().st_size > 0
    assert budget.was_evicted(s.store.resolve(b.id).read_meta())
    assert f"{b.id}" in freed.summary() and "1 persona prefix" in freed.summary()

    # The hook after a save: a tiny budget drops everything not in use, says so in the reply's events,
    # and leaves the open conversation (and its persona's prefix) alone.
    conv.after_save = lambda: s.budget_notice([conv])
    s.settings.state_budget = "1KB"
    notices = [ev.text for ev in conv.send("One more thing.") if isinstance(ev, Notice)]
    assert len([n for n in notices if "state budget" in n]) == 1, notices
    line = next(n for n in notices if "state budget" in n)
    assert c.id in line and "still over" in line and a.id in line
    assert not s.store.resolve(c.id).state_path.exists()
    assert s.store.resolve(a.id).state_path.exists() and _prefix_of(s, a.id).exists()
    conv.close()
    # Opening an evicted conversation rebuilds its KV with a progress bar and says why.
    s.settings.state_budget = "20GB"
    opening = s.open_conversation(b.id)
    events = list(opening)
    bars = [ev for ev in events if isinstance(ev, Progress)]
    assert bars and bars[-1].label == "rebuilding context from the transcript" and bars[-1].done == bars[-1].total
    report = opening.report
    assert report is not None and "state budget" in report.reason and report.restored_tokens == 0
    opening.conversation.close()


def _prefix_of(session: Any, conv_id: str) -> Path:
    from chatcli.core.kv import prefix

    meta = session.store.resolve(conv_id).read_meta()
    ident = prefix.state_identity(session.identity(), session.engine.identity())
    return prefix.cache_path(session.paths.prefix_cache_dir, ident, meta["persona_hash"], session.template.source)


def test_state_of_one_kv_type_is_never_loaded_into_another(engines: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    q8, f16 = here(engines["q8_0"]), here(engines["f16"])
    conv = new_conv(q8, "alice", MSGS[0])
    cid = conv.id
    conv.close()
    state = q8.store.resolve(cid).state_path
    ident = sf.scan(state).header["identity"]  # type: ignore[index]
    assert (ident["type_k"], ident["type_v"], ident["flash_attn"]) == ("q8_0", "q8_0", True)
    assert q8.store.resolve(cid).read_meta()["params"]["type_k"] == "q8_0"  # the conversation remembers its type
    # Persona prefix cache keyed by the KV type: the f16 context does not see the q8_0 prefix.
    assert _prefix_of(q8, cid).exists() and not _prefix_of(f16, cid).exists()

    for src, dst in ((q8, f16), (f16, q8)):
        loads: list[int] = []
        real = dst.engine.load_cells
        def counted(*a: Any, loads: list[int] = loads, real: Any = real) -> Any:
            loads.append(a[1] - a[0])
            return real(*a)

        monkeypatch.setattr(dst.engine, "load_cells", counted)
        opened, report, _ = drain(dst.open_conversation(cid))
        assert opened is not None and report is not None
        want = src.engine.kv_type, dst.engine.kv_type
        assert f"KV type {want[0]}" in report.reason and want[1] in report.reason, report.reason
        assert loads == [] and report.restored_tokens == 0
        assert report.reevaluated == opened.engine.n_past == len(opened.r.tokens())
        # The state file and the metadata now hold the new type: the next resume loads it.
        assert sf.scan(state).header["identity"]["type_k"] == dst.engine.kv_type  # type: ignore[index]
        assert dst.store.resolve(cid).read_meta()["params"]["type_k"] == dst.engine.kv_type
        opened.close()
    again, report, _ = drain(q8.open_conversation(cid))
    assert again is not None and report is not None
    assert report.reason == "" and report.reevaluated == 0 and report.restored_tokens == again.engine.n_past
    again.close()
    # Same tokens, both contexts: q8_0 cells take 34 bytes per 32 values where f16 takes 64.
    n = q8.engine.n_past
    assert f16.engine.tokens[:n] == q8.engine.tokens
    ratio = len(q8.engine.save_cells(0, n)) / len(f16.engine.save_cells(0, n))
    assert 0.52 < ratio < 0.545, ratio


# -- new processes: evicted resume and q8_0 resume ---------------------------------------------------------


def run(args: list[str], home: Path, logits: Path | None = None) -> dict[str, Any]:
    env = {**os.environ, "CHATCLI_HOME": str(home)}
    cmd = [sys.executable, DRIVE, *args] + (["--logits", str(logits)] if logits else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return res


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Three greedy turns in one process, per KV type, with the logits before each reply."""
    out = {}
    for t in ("f16", "q8_0"):
        home = tmp_path_factory.mktemp(f"whole-{t}")
        res = run(["--new", "--kv-type", t, *says(MSGS)], home, logits=home / "l.npy")
        res["logits"] = np.load(home / "l.npy")
        out[t] = res
    return out


def test_q8_0_resume_is_bit_identical_to_the_uninterrupted_process(uninterrupted: dict[str, Any], tmp_path: Path) -> None:
    whole = uninterrupted["q8_0"]
    first = drive("--new", "--kv-type", "q8_0", *says(MSGS[:2]))
    assert first["replies"] == whole["replies"][:2]
    res = drive("--resume", first["id"], "--kv-type", "q8_0", *says(MSGS[2:]), logits=tmp_path / "l.npy")
    assert res["report"]["reevaluated"] == 0 and res["evaluated_after_open"] == 0
    assert res["report"]["restored_tokens"] == len(first["tokens"])
    assert np.array_equal(np.load(tmp_path / "l.npy")[0], whole["logits"][2])  # bit-identical logits
    assert res["tokens"] == whole["tokens"]


def test_evicted_conversation_resumes_with_identical_greedy_tokens(uninterrupted: dict[str, Any]) -> None:
    from typer.testing import CliRunner

    from chatcli.cli.app import app

    whole = uninterrupted["f16"]
    first = drive("--new", *says(MSGS[:2]))
    other = drive("--new", *says(MSGS[:1]))
    conv_dir = ConversationStore(get_paths().conversations_dir).resolve(first["id"])
    size = conv_dir.state_size()
    runner = CliRunner()
    ls = runner.invoke(app, ["ls"])
    assert ls.exit_code == 0 and "2 warm, 0 cold" in ls.output
    gc = runner.invoke(app, ["gc", "--budget", "0"])
    assert gc.exit_code == 0, gc.output
    assert first["id"] in gc.stdout and other["id"] in gc.stdout and "freed" in gc.stdout
    assert not conv_dir.state_path.exists() and conv_dir.transcript_path.exists()
    ls = runner.invoke(app, ["ls", "--json"])
    rows = {r["id"]: r for r in json.loads(ls.stdout)}
    assert rows[first["id"]]["warm"] is False and rows[first["id"]]["state_bytes"] == 0
    cold = runner.invoke(app, ["ls"])
    assert "0 warm, 2 cold" in cold.output and cold.stdout.count("\tcold") == 2
    assert runner.invoke(app, ["gc", "--budget", "lots"]).exit_code == 2

    res = drive("--resume", first["id"], *says(MSGS[2:]))
    rep = res["report"]
    assert "state budget" in rep["reason"]
    assert rep["restored_tokens"] == 0 and rep["reevaluated"] == len(first["tokens"])
    assert res["replies"][0] == whole["replies"][2]  # as if nothing had been evicted
    assert res["tokens"] == whole["tokens"]
    assert conv_dir.state_size() > 0 and size > 0  # warm again
    assert not budget.was_evicted(conv_dir.read_meta())


def test_cli_budget_notice_and_evicted_resume_line() -> None:
    """The CLI path: one line says what the budget freed; an evicted conversation says why it is rebuilt."""
    first = drive("--new", *says(MSGS[:1]))
    env = {**os.environ, "CHATCLI_STATE_BUDGET": "1KB"}
    # Any save over a 1 KB budget evicts every conversation not open: here `other` (first is open).
    other = drive("--new", *says(MSGS[:1]))
    proc = subprocess.run([sys.executable, "-m", "chatcli", "resume", first["id"], "--temperature", "0",
                           "--n-ctx", "2048", "--max-tokens", "8"], input="Thanks!\n", capture_output=True,
                          text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "state budget 1.0 KB: freed" in proc.stderr and other["id"] in proc.stderr
    assert not ConversationStore(get_paths().conversations_dir).resolve(other["id"]).state_path.exists()
    proc = subprocess.run([sys.executable, "-m", "chatcli", "resume", other["id"], "--temperature", "0",
                           "--max-tokens", "8"], input="Thanks!\n", capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "state budget" in ln]
    assert len(lines) == 1 and "rebuilt from the transcript" in lines[0], proc.stderr


def test_kvtypes_bench_quick(tmp_path: Path) -> None:
    """The benchmark's quick variant writes its table, chart and raw results, and what it measured holds:
    every restore was bit-identical, and the sizes are the quantized formats' (never timings)."""
    proc = subprocess.run([sys.executable, "-m", "bench.kvtypes", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, check=False,
                          cwd=str(Path(__file__).resolve().parent.parent))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {p.name for p in tmp_path.iterdir()} >= {"kvtypes.md", "kvtypes.json", "kvtypes.png"}
    res = json.loads((tmp_path / "kvtypes.json").read_text())
    rows = {r["kv_type"]: r for r in res["types"]}
    assert set(rows) == {"f16", "q8_0", "q4_0"}
    assert all(r["restore_logits_identical"] for r in rows.values())
    assert abs(rows["q8_0"]["cells_per_token"] / rows["f16"]["cells_per_token"] - 34 / 64) < 0.01
    assert abs(rows["q4_0"]["cells_per_token"] / rows["f16"]["cells_per_token"] - 18 / 64) < 0.01
    assert rows["q8_0"]["kv_params"]["flash_attn"] and not rows["f16"]["kv_params"]["flash_attn"]
    assert 0 <= rows["q4_0"]["kl_mean"] and 0 <= rows["q8_0"]["forced_top1_agreement"] <= 1


def test_server_conversations_apply_the_budget_too(engines: dict[str, Any]) -> None:
    """`chatcli serve` creates conversations from a request's messages (``Session.new_conversation_from``, in
    one of its contexts): the hook is attached there too."""
    s = here(engines["f16"], state_budget="1KB")
    old = new_conv(s, "pirate", "Ahoy.")  # the Session's own hook: nothing else to drop yet
    old.close()
    assert s.store.resolve(old.id).state_path.exists()  # spared while open; closed now
    opening = s.new_conversation_from([], persona_name="alice", persona_hash="x", seed=1,
                                      sampling=build_sampling(), max_tokens=8, meta={}, backend=s.engine)
    notices = [ev.text for ev in opening if isinstance(ev, Notice)]
    conv = opening.conversation
    assert conv.after_save is not None
    notices += [ev.text for ev in conv.send("Hello.") if isinstance(ev, Notice)]
    assert any(old.id in n and "freed" in n for n in notices), notices
    assert not s.store.resolve(old.id).state_path.exists()
    assert s.store.resolve(conv.id).state_path.exists()
    conv.close()


def test_a_server_conversation_is_whole_from_its_first_metadata_write(engines: dict[str, Any],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``Session.new_conversation_from`` (serve's new conversations): the request's fields (whose it is) and
    the template's go into the metadata written when the folder is made. A second write after the prefix
    cost an atomic write (two fsyncs) before the first token, and a crash between the two left a client's
    conversation without its owner; the template was never recorded, so a resume rendered it otherwise."""
    s = here(engines["f16"])
    template = copy.copy(s.template)
    template.enable_thinking = False
    s = dataclasses.replace(s, template=template)
    writes: list[dict[str, Any]] = []
    write_meta = ConversationDir.write_meta

    def spy(self: ConversationDir, meta: dict[str, Any]) -> None:
        writes.append(dict(meta))
        write_meta(self, meta)

    monkeypatch.setattr(ConversationDir, "write_meta", spy)
    opening = s.new_conversation_from([], persona_name="alice", persona_hash="x", seed=1,
                                      sampling=build_sampling(), max_tokens=8,
                                      meta={"source": "api", "api_client": "k1"}, backend=s.engine)
    assert not [ev for ev in opening if isinstance(ev, Notice)]
    conv = opening.conversation
    try:
        assert len(writes) == 1, writes
        assert writes[0]["source"] == "api" and writes[0]["api_client"] == "k1" and writes[0]["thinking"] is False
        on_disk = s.store.resolve(conv.id).read_meta()
        assert on_disk["api_client"] == "k1" and on_disk["thinking"] is False
    finally:
        conv.close()


def build_sampling() -> Any:
    from chatcli.core.backend import Sampling

    return Sampling(temperature=0.0)
