"""Persistence on the real model: a conversation resumed in a new process continues exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chatcli.core.kv import records as sf
from chatcli.models.gguf import read_gguf
from tests.drive import run_process as drive
from tests.drive import says

DRIVE = str(Path(__file__).parent / "drive.py")
MSGS = ["Hi! What is your name?", "What is the capital of France?", "And of Italy?"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three greedy turns in one process (its own CHATCLI_HOME), with the logits before each reply."""
    home = tmp_path_factory.mktemp("whole")
    env = {**os.environ, "CHATCLI_HOME": str(home)}
    out = home / "logits.npy"
    proc = subprocess.run([sys.executable, DRIVE, "--new", *says(MSGS), "--logits", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["logits"] = np.load(out)
    return res


def conv_dir(conv_id: str) -> Path:
    return Path(os.environ["CHATCLI_HOME"]) / "data" / "conversations" / conv_id


def test_resume_in_new_process_gives_identical_tokens_and_logits(uninterrupted: dict[str, Any], tmp_path: Path) -> None:
    first = drive("--new", *says(MSGS[:2]))
    assert first["replies"] == uninterrupted["replies"][:2]
    res = drive("--resume", first["id"], *says(MSGS[2:]), logits=tmp_path / "l.npy")
    assert res["report"]["reevaluated"] == 0
    assert res["evaluated_after_open"] == 0  # resume evaluated no history token
    assert res["report"]["restored_tokens"] == len(first["tokens"])
    logits = np.load(tmp_path / "l.npy")
    assert np.array_equal(logits[0], uninterrupted["logits"][2])  # bit-identical, not just close
    assert res["replies"][0] == uninterrupted["replies"][2]
    assert res["tokens"] == uninterrupted["tokens"]


def test_seeded_sampling_resumes_exactly(tmp_path: Path) -> None:
    opts = ["--temperature", "0.9", "--seed", "77"]
    whole = drive("--new", *opts, *says(MSGS))
    part = drive("--new", *opts, *says(MSGS[:2]))
    assert part["replies"] == whole["replies"][:2]
    rest = drive("--resume", part["id"], *opts, *says(MSGS[2:]))
    assert rest["replies"][0] == whole["replies"][2]
    # and the seed matters: another seed gives another conversation
    other = drive("--new", "--temperature", "0.9", "--seed", "78", *says(MSGS[:1]))
    assert other["replies"][0] != whole["replies"][0]


def test_state_file_grows_by_the_new_cells_only(model_path: Path) -> None:
    from tests.drive import build_session, drain, say

    info = read_gguf(model_path)
    arch = info.architecture
    n_layer = int(info.metadata[f"{arch}.block_count"])
    n_head = int(info.metadata[f"{arch}.attention.head_count"])
    n_head_kv = int(info.metadata[f"{arch}.attention.head_count_kv"])
    head_dim = int(info.metadata[f"{arch}.embedding_length"]) // n_head
    row = 2 * n_head_kv * head_dim  # f16 K row and V column bytes per cell and layer

    def kv_bytes(n: int) -> int:
        # llama-context.cpp state_seq_get_data: io magic, seq id; then llama-kv-cache.cpp state_write:
        # n_stream, cell_count, (pos, n_seq_id, seq_id) per cell, v_trans, n_layer, per layer K (type, row
        # size, rows) and transposed V (type, element size, n_embd, values).
        return 4 + 4 + 4 + 4 + 12 * n + 4 + 4 + n_layer * (4 + 8) + n_layer * (4 + 4 + 4) + n * n_layer * 2 * row

    session = build_session()
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    path = conv.dir.state_path
    initial = path.stat().st_size
    sizes = []
    for msg in MSGS:
        before = path.stat().st_size
        n0 = conv.engine.n_past
        reply, _ = say(conv, msg)
        user_tokens = conv.messages[-2].tokens
        n_vocab = conv.engine.n_vocab
        history = len(sf.history_record(1, [0]))  # before each record of cells: the digest of the tokens before
        expected = (history + sf.record_size_for_cells(len(user_tokens), kv_bytes(len(user_tokens)))
                    + sf.HEADER_SIZE + 4 * n_vocab  # logits after the user message
                    + history + sf.record_size_for_cells(len(reply), kv_bytes(len(reply))))
        assert path.stat().st_size - before == expected
        assert conv.engine.n_past - n0 == len(user_tokens) + len(reply)
        sizes.append(path.stat().st_size - before)
    # Appending costs O(new tokens): nothing earlier was rewritten.
    assert path.stat().st_size == initial + sum(sizes)
    conv.close()
    session.close()


def _damage_last_record(path: Path, how: str) -> int:
    res = sf.scan(path)
    last = res.records[-1]
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[last.offset + sf.HEADER_SIZE + last.length // 2] ^= 0x40
    elif how == "truncate":
        del data[last.offset + last.size // 2:]
    elif how == "zero":
        data[last.offset:last.offset + last.size] = bytes(last.size)
    path.write_bytes(bytes(data))
    return last.p1 - last.p0


@pytest.mark.parametrize("how", ["flip", "truncate", "zero"])
def test_damaged_last_record_is_dropped_and_tail_reevaluated(uninterrupted: dict[str, Any], how: str) -> None:
    first = drive("--new", *says(MSGS[:2]))
    lost = _damage_last_record(conv_dir(first["id"]) / "state.kv", how)
    res = drive("--resume", first["id"], *says(MSGS[2:]))
    assert res["report"]["reevaluated"] == lost > 0
    assert "dropped" in res["report"]["reason"] or "damaged" in res["report"]["reason"]
    assert res["replies"][0] == uninterrupted["replies"][2]
    # and the state file was repaired: the next resume restores everything without evaluating
    again = drive("--resume", first["id"])
    assert again["report"]["reevaluated"] == 0 and again["report"]["reason"] == ""


def test_different_model_rebuilds_from_tokens(uninterrupted: dict[str, Any], model_path: Path, tmp_path: Path) -> None:
    # Same weights, different header (renamed): a different identity, so the saved KV must not be used.
    other = tmp_path / "renamed.gguf"
    data = bytearray(model_path.read_bytes())
    name = read_gguf(model_path).metadata["general.name"].encode()
    i = data.index(name)
    data[i:i + len(name)] = name.upper()
    other.write_bytes(bytes(data))
    first = drive("--new", *says(MSGS[:2]))
    res = drive("--resume", first["id"], "--model", str(other), *says(MSGS[2:]))
    assert "another model" in res["report"]["reason"]
    assert res["report"]["restored_tokens"] == 0
    assert res["report"]["reevaluated"] == len(first["tokens"])
    # The history is the transcript's exact token ids; the new reply follows them. (It need not equal the
    # uninterrupted reply: the rebuild evaluates replies in batches, which round differently from the
    # one-token decodes that produced them.)
    assert res["tokens"][: len(first["tokens"])] == first["tokens"]
    assert len(res["replies"][0]) > 0
    again = drive("--resume", first["id"], "--model", str(other))
    assert again["report"]["reevaluated"] == 0 and again["evaluated_after_open"] == 0


def test_missing_state_file_rebuilds(uninterrupted: dict[str, Any]) -> None:
    first = drive("--new", *says(MSGS[:2]))
    (conv_dir(first["id"]) / "state.kv").unlink()
    res = drive("--resume", first["id"], *says(MSGS[2:]))
    assert res["report"]["reevaluated"] == len(first["tokens"])
    assert res["tokens"][: len(first["tokens"])] == first["tokens"]
    again = drive("--resume", first["id"])
    assert again["report"]["reevaluated"] == 0
