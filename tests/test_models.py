"""Which model chatcli loads, and how a bad one is refused: before llama.cpp ever sees it.

Resolution order is ``--model`` > ``CHATCLI_MODEL`` > config file > the bundled SmolLM2. Broken files
(missing, a directory, not GGUF, truncated) and unusable ``hf:`` specs end in one line on stderr and exit
code 2; no model is loaded. The GGUF reader is checked against the real bundled file.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.config.settings import get_paths, load_settings
from chatcli.models.gguf import GGUFError, read_gguf
from chatcli.models.resolve import ModelError, ModelRef, bundled_model_path, resolve_model

runner = CliRunner()


# ------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record (and refuse) any attempt to build an Engine: errors must come before the model loads."""
    calls: list[str] = []

    def refuse(path: object, *args: object, **kwargs: object) -> None:
        calls.append(str(path))
        raise AssertionError(f"a model was loaded: {path}")

    monkeypatch.setattr("chatcli.session.Engine", refuse)
    monkeypatch.setattr("chatcli.backends.llamacpp.Engine", refuse)
    return calls


def write_config(text: str) -> Path:
    path = get_paths().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def copy_header(model: Path, dest: Path, *, size: int | None = None, patch: tuple[bytes, bytes] | None = None) -> Path:
    """A sparse copy of the model: its first 8 MB (the whole header), then a hole up to `size` bytes.

    Cheap to make, and to the GGUF reader (which never reads tensor data) the same as a full copy.
    """
    full = model.stat().st_size
    with model.open("rb") as fh:
        head = fh.read(8 << 20)
    if patch is not None:
        old, new = patch
        assert len(old) == len(new) and head.count(old) >= 1
        head = head.replace(old, new, 1)
    with dest.open("wb") as fh:
        fh.write(head[: size if size is not None else full])
        fh.truncate(full if size is None else size)
    return dest


def assert_one_line_error(result: object, *needles: str, code: int = 2) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)  # type: ignore[attr-defined]
    # Only SystemExit (typer.Exit) may end the command: anything else would be a traceback for the user.
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception  # type: ignore[attr-defined]
    lines = result.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1, result.stderr  # type: ignore[attr-defined]
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr  # type: ignore[attr-defined]
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


# -------------------------------------------------------------------------------------------- resolution


@pytest.fixture
def three_models(tmp_path: Path, model_path: Path) -> dict[str, Path]:
    """Three names for the real model, one per layer, so we can tell which layer won."""
    out = {}
    for name in ("flag", "env", "config"):
        link = tmp_path / f"{name}.gguf"
        link.symlink_to(model_path)
        out[name] = link
    return out


def test_resolution_order_flag_env_config_bundled(
    three_models: dict[str, Path], model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def resolved(flag: str | None) -> ModelRef:
        settings = load_settings({"model": flag}, paths=get_paths())
        return resolve_model(settings.model)

    assert resolved(None).path == model_path  # nothing configured: the bundled model
    assert resolved(None).path == bundled_model_path()
    write_config(f'model = "{three_models["config"]}"\n')
    assert resolved(None).path == three_models["config"]
    monkeypatch.setenv("CHATCLI_MODEL", str(three_models["env"]))
    assert resolved(None).path == three_models["env"]
    assert resolved(str(three_models["flag"])).path == three_models["flag"]


def test_resolve_model_arguments_and_origin(three_models: dict[str, Path], model_path: Path) -> None:
    env = {"CHATCLI_MODEL": str(three_models["env"])}
    ref = resolve_model(str(three_models["flag"]), str(three_models["config"]), env)
    assert (ref.path, ref.origin) == (three_models["flag"], "flag")
    ref = resolve_model(None, str(three_models["config"]), env)
    assert (ref.path, ref.origin) == (three_models["env"], "env")
    ref = resolve_model(None, str(three_models["config"]), {})
    assert (ref.path, ref.origin) == (three_models["config"], "config")
    ref = resolve_model(None, None, {})
    assert (ref.path, ref.origin) == (model_path, "bundled")
    # Same file under another name: the same identity, so saved states stay valid.
    assert ref.identity() == resolve_model(str(three_models["flag"])).identity()


def test_relative_model_path_is_made_absolute(
    three_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversation stores its model's path; `resume` from another directory must still find it."""
    monkeypatch.chdir(tmp_path)
    ref = resolve_model("flag.gguf")
    assert ref.path.is_absolute() and ref.path == three_models["flag"]


def test_cli_uses_the_same_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_model_load: list[str]) -> None:
    """Each layer names a different missing file: the error says which one the CLI tried."""
    write_config(f'model = "{tmp_path / "from-config.gguf"}"\n')
    result = runner.invoke(app, ["talk"], input="hi\n")
    assert_one_line_error(result, "from-config.gguf")
    monkeypatch.setenv("CHATCLI_MODEL", str(tmp_path / "from-env.gguf"))
    result = runner.invoke(app, ["talk"], input="hi\n")
    assert_one_line_error(result, "from-env.gguf")
    result = runner.invoke(app, ["talk", "--model", str(tmp_path / "from-flag.gguf")], input="hi\n")
    assert_one_line_error(result, "from-flag.gguf")
    assert no_model_load == []


# ------------------------------------------------------------------------------------------ bad files


def _bad_model(kind: str, tmp_path: Path, model_path: Path) -> Path:
    if kind == "missing":
        return tmp_path / "nope.gguf"
    if kind == "directory":
        d = tmp_path / "models.gguf"
        d.mkdir()
        return d
    if kind == "not-gguf":
        p = tmp_path / "notes.gguf"
        p.write_text("hello, I am not a model\n" * 10)
        return p
    if kind == "truncated-1mb":
        p = tmp_path / "cut.gguf"
        with model_path.open("rb") as src:
            p.write_bytes(src.read(1 << 20))
        return p
    if kind == "truncated-last-byte":
        return copy_header(model_path, tmp_path / "short.gguf", size=model_path.stat().st_size - 1)
    raise AssertionError(kind)


BAD = {
    "missing": "not found",
    "directory": "directory",
    "not-gguf": "not a GGUF",
    "truncated-1mb": "truncated",
    "truncated-last-byte": "truncated",  # tensor data cut short: caught from the tensor sizes, not by llama.cpp
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_model_file_is_one_line_exit_2_before_loading(
    kind: str, tmp_path: Path, model_path: Path, no_model_load: list[str]
) -> None:
    bad = _bad_model(kind, tmp_path, model_path)
    with pytest.raises(ModelError, match=BAD[kind]):
        resolve_model(str(bad))
    result = runner.invoke(app, ["talk", "--model", str(bad)], input="hi\n")
    line = assert_one_line_error(result, BAD[kind], str(bad))
    assert line.count("\n") == 0
    assert no_model_load == []


def test_bad_model_in_a_real_process_has_no_traceback(tmp_path: Path, model_path: Path) -> None:
    bad = _bad_model("truncated-1mb", tmp_path, model_path)
    proc = subprocess.run(
        [sys.executable, "-m", "chatcli", "talk", "--model", str(bad)],
        input="hi\n", capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: corrupt or truncated GGUF header: {bad}"]


def test_hf_spec_without_huggingface_hub(monkeypatch: pytest.MonkeyPatch, no_model_load: list[str]) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails, installed or not
    with pytest.raises(ModelError, match="huggingface_hub"):
        resolve_model("hf:owner/repo:model.gguf")
    result = runner.invoke(app, ["talk", "--model", "hf:owner/repo:model.gguf"], input="hi\n")
    assert_one_line_error(result, "huggingface_hub", "pip install")
    assert no_model_load == []


def test_hf_spec_offline(monkeypatch: pytest.MonkeyPatch, no_model_load: list[str]) -> None:
    fake = types.ModuleType("huggingface_hub")

    def hf_hub_download(repo_id: str, filename: str) -> str:
        raise OSError("We couldn't connect to 'https://huggingface.co' to load this file.\nCheck your connection.")

    fake.hf_hub_download = hf_hub_download  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    with pytest.raises(ModelError, match=r"cannot fetch owner/repo/model\.gguf from Hugging Face \(We couldn't connect"):
        resolve_model("hf:owner/repo:model.gguf")
    result = runner.invoke(app, ["talk", "--model", "hf:owner/repo:model.gguf"], input="hi\n")
    line = assert_one_line_error(result, "cannot fetch owner/repo/model.gguf")
    assert "Check your connection" not in line  # only the first line of the library's message
    assert no_model_load == []


def test_malformed_hf_spec(no_model_load: list[str]) -> None:
    result = runner.invoke(app, ["talk", "--model", "hf:just-a-repo"], input="hi\n")
    assert_one_line_error(result, "hf:OWNER/REPO:FILE.gguf")


# ------------------------------------------------------------------------------------------ GGUF reader


def test_gguf_reader_on_the_bundled_model(model_path: Path) -> None:
    info = read_gguf(model_path)
    assert info.architecture == "llama"
    assert info.context_length == 8192
    assert info.chat_template is not None and "<|im_start|>" in info.chat_template
    assert info.version in (2, 3)
    assert info.n_tensors > 0
    assert info.file_size == model_path.stat().st_size
    assert len(info.header_sha256) == 64


def test_identity_is_stable_and_follows_the_header(tmp_path: Path, model_path: Path) -> None:
    first = resolve_model(str(model_path)).identity()
    assert resolve_model(str(model_path)).identity() == first
    # A copy with the same header bytes (tensor data is never read) has the same identity ...
    same = copy_header(model_path, tmp_path / "same.gguf")
    assert resolve_model(str(same)).identity() == first
    # ... and one changed byte in the header (a letter of general.name) gives another.
    name = read_gguf(model_path).name.encode()
    changed = copy_header(model_path, tmp_path / "changed.gguf", patch=(name, b"X" + name[1:]))
    info = read_gguf(changed)
    assert info.name == "X" + name[1:].decode()
    other = resolve_model(str(changed)).identity()
    assert other["header_sha256"] != first["header_sha256"]
    assert other != first


def test_gguf_errors_are_gguf_errors(tmp_path: Path) -> None:
    p = tmp_path / "v9.gguf"
    p.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(40))
    with pytest.raises(GGUFError, match="unsupported GGUF version 9"):
        read_gguf(p)
    p.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (1 << 40).to_bytes(8, "little"))
    with pytest.raises(GGUFError, match="corrupt GGUF header"):
        read_gguf(p)


def test_native_gguf_reader_gives_the_python_parsers_identity(tmp_path: Path, model_path: Path) -> None:
    """ggml's reader (fast path) and the pure-Python walk (the one that wrote every existing state file's
    identity) agree on everything, the header fingerprint included, for the bundled model and a renamed one."""
    from chatcli.models import gguf

    assert gguf._ggml_lib() is not None, "ggml's library was not found: the fast path is not being tested"
    name = read_gguf(model_path).name.encode()
    renamed = copy_header(model_path, tmp_path / "renamed.gguf", patch=(name, b"Y" + name[1:]))
    for path in (model_path, renamed):
        native = gguf._read_native(path)
        python = read_gguf(path, native=False)
        assert native is not None
        assert native == python
    assert gguf._read_native(renamed).header_sha256 != gguf._read_native(model_path).header_sha256  # type: ignore[union-attr]
    # A file ggml refuses falls back to the Python parser and its one-line error.
    cut = copy_header(model_path, tmp_path / "cut.gguf", size=model_path.stat().st_size - 1)
    with pytest.raises(GGUFError, match="truncated GGUF file"):
        read_gguf(cut)


def test_state_written_with_the_python_identity_resumes_without_reevaluating(monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversation saved by a process that computed the identity the old way (the Python parser) is
    restored from its state file by a process using ggml's reader: the identities match."""
    from tests.drive import run_process, says

    monkeypatch.setenv("CHATCLI_GGUF_PYTHON", "1")
    first = run_process("--new", *says(["Hi! What is your name?"]))
    monkeypatch.delenv("CHATCLI_GGUF_PYTHON")
    again = run_process("--resume", first["id"])
    assert again["report"]["reason"] == ""
    assert again["report"]["reevaluated"] == 0
    assert again["report"]["restored_tokens"] == len(first["tokens"])
