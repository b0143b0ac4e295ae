"""Settings: paths, layering (defaults < packaged < user file < env < flags), parsing and error messages."""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import tomllib
from pathlib import Path

import platformdirs
import pytest

from chatcli.config import settings as settings_mod
from chatcli.config.settings import (
    SETTING_NAMES,
    Paths,
    Settings,
    SettingsError,
    describe_settings,
    get_paths,
    load_settings,
    packaged_config_file,
    parse_setting,
)
from chatcli.core.files.fsutil import ensure_private_dir


@pytest.fixture
def home(chatcli_home: Path) -> Path:
    """The private CHATCLI_HOME of conftest's autouse fixture (no stray CHATCLI_* variables either)."""
    return chatcli_home


@pytest.fixture
def paths() -> Paths:
    p = get_paths()
    p.config_dir.mkdir(parents=True, exist_ok=True)
    return p


@pytest.fixture
def packaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Replace the shipped config with a test file (initially empty) so its layer can be exercised."""
    path = tmp_path / "packaged.toml"
    path.write_text("")
    monkeypatch.setattr(settings_mod, "packaged_config_file", lambda: path)
    return path


# ------------------------------------------------------------------------------------------------ paths


def test_paths_live_under_chatcli_home(home: Path) -> None:
    p = get_paths()
    assert p.home == home
    assert p.data_dir == home / "data"
    assert p.cache_dir == home / "cache"
    assert p.config_dir == home / "config"
    assert p.config_file == home / "config" / "config.toml"
    assert p.personas_dir == home / "config" / "personas"
    assert p.history_file == home / "data" / "history"
    assert p.conversations_dir == home / "data" / "conversations"
    assert p.prefix_cache_dir == home / "cache" / "prefix"


def test_paths_without_chatcli_home_use_platformdirs() -> None:
    p = get_paths(env={})
    assert p.home is None
    assert p.data_dir == platformdirs.user_data_path("chatcli")
    assert p.cache_dir == platformdirs.user_cache_path("chatcli")
    assert p.config_dir == platformdirs.user_config_path("chatcli")


def test_relative_chatcli_home_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    p = get_paths(env={"CHATCLI_HOME": "rel"})
    assert p.home == tmp_path / "rel"
    assert p.data_dir.is_absolute()


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_ensure_dir_creates_private_dirs_and_tightens_existing(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        created = ensure_private_dir(tmp_path / "a" / "b")
        assert created == tmp_path / "a" / "b"
        assert stat.S_IMODE(created.stat().st_mode) == 0o700
        loose = tmp_path / "loose"
        loose.mkdir(mode=0o755)
        assert stat.S_IMODE(loose.stat().st_mode) == 0o755
        ensure_private_dir(loose)
        assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    finally:
        os.umask(old)


# --------------------------------------------------------------------------------------------- layering


def test_defaults_when_nothing_is_configured() -> None:
    s = load_settings()
    assert s == Settings()
    assert (s.n_ctx, s.temperature, s.persona, s.seed, s.model) == (4096, 0.7, "alice", None, None)
    assert all(origin == "default" for _, _, origin in describe_settings())


def test_precedence_defaults_packaged_user_env_flags(packaged: Path, paths: Paths) -> None:
    packaged.write_text("n_ctx = 1000\ntemperature = 0.5\ntop_k = 10\nmax_tokens = 100\nseed = 1\n")
    paths.config_file.write_text("temperature = 0.6\ntop_k = 20\nmax_tokens = 200\n")
    env = {"CHATCLI_TOP_K": "30", "CHATCLI_MAX_TOKENS": "300", "CHATCLI_HOME": str(paths.home)}
    flags = {"max_tokens": 400, "top_k": None, "temperature": None}

    s = load_settings(flags, paths=paths, env=env)
    assert s.top_p == 0.95  # default
    assert s.n_ctx == 1000 and s.seed == 1  # packaged
    assert s.temperature == 0.6  # user file over packaged; a None flag is "not given"
    assert s.top_k == 30  # env over user file
    assert s.max_tokens == 400  # flag over env

    origins = {name: origin for name, _, origin in describe_settings(paths, env=env, flags=flags)}
    assert origins["top_p"] == "default"
    assert origins["n_ctx"] == "packaged config"
    assert origins["temperature"] == str(paths.config_file)
    assert origins["top_k"] == "env CHATCLI_TOP_K"
    assert origins["max_tokens"] == "flag --max-tokens"


def test_env_is_read_from_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHATCLI_PERSONA", "pirate")
    monkeypatch.setenv("CHATCLI_N_CTX", "2048")
    s = load_settings()
    assert (s.persona, s.n_ctx) == ("pirate", 2048)


def test_user_file_can_reset_packaged_seed_with_none(packaged: Path, paths: Paths) -> None:
    packaged.write_text("seed = 5\n")
    assert load_settings(paths=paths).seed == 5
    paths.config_file.write_text('seed = "none"\n')
    assert load_settings(paths=paths).seed is None


def test_integer_in_toml_is_accepted_for_a_float_setting(paths: Paths) -> None:
    paths.config_file.write_text("temperature = 1\n")
    value = load_settings(paths=paths).temperature
    assert value == 1.0 and isinstance(value, float)


# ------------------------------------------------------------------------------------------ env parsing


@pytest.mark.parametrize(
    ("var", "text", "field", "expected"),
    [
        ("CHATCLI_N_CTX", "8192", "n_ctx", 8192),
        ("CHATCLI_TEMPERATURE", "0", "temperature", 0.0),
        ("CHATCLI_TOP_P", " 0.5 ", "top_p", 0.5),
        ("CHATCLI_SEED", "42", "seed", 42),
        ("CHATCLI_SEED", "none", "seed", None),
        ("CHATCLI_SEED", "", "seed", None),
        ("CHATCLI_PLAIN", "1", "plain", True),
        ("CHATCLI_PLAIN", "YES", "plain", True),
        ("CHATCLI_PLAIN", "true", "plain", True),
        ("CHATCLI_PLAIN", "no", "plain", False),
        ("CHATCLI_PLAIN", "0", "plain", False),
        ("CHATCLI_MODEL", "/models/x.gguf", "model", "/models/x.gguf"),
        ("CHATCLI_PERSONA", "coder", "persona", "coder"),
    ],
)
def test_env_values_are_parsed_to_the_field_type(
    paths: Paths, var: str, text: str, field: str, expected: object
) -> None:
    s = load_settings(paths=paths, env={var: text})
    value = getattr(s, field)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("var", "text", "fragment"),
    [
        ("CHATCLI_N_CTX", "big", "n_ctx must be an integer"),
        ("CHATCLI_N_CTX", "32", "n_ctx must be at least 64"),
        ("CHATCLI_PLAIN", "maybe", "plain must be 1/0, true/false or yes/no"),
        ("CHATCLI_TEMPERATURE", "nan", "temperature must be a finite number"),
        ("CHATCLI_SEED", "-3", "seed must be between 0 and"),
    ],
)
def test_bad_env_values_name_the_variable(paths: Paths, var: str, text: str, fragment: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(paths=paths, env={var: text})
    message = str(info.value)
    assert message.startswith(f"env {var}: ")
    assert fragment in message
    assert "\n" not in message


def test_parse_setting_matches_env_rules() -> None:
    assert parse_setting("top_k", "7") == 7
    with pytest.raises(SettingsError, match="unknown setting 'temprature' \\(did you mean 'temperature'\\?\\)"):
        parse_setting("temprature", "1")


# ------------------------------------------------------------------------------------------ file errors


def test_bad_toml_names_file_and_line(paths: Paths) -> None:
    paths.config_file.write_text("n_ctx = 2048\n\ntemperature = = 3\n")
    with pytest.raises(SettingsError) as info:
        load_settings(paths=paths)
    message = str(info.value)
    assert message.startswith(f"{paths.config_file}: invalid TOML at line 3, column ")
    assert "\n" not in message


def test_bad_packaged_toml_names_that_file(packaged: Path, paths: Paths) -> None:
    packaged.write_text("n_ctx = 2048\nseed = ]\n")
    with pytest.raises(SettingsError) as info:
        load_settings(paths=paths)
    assert str(info.value) == f"{packaged}: invalid TOML at line 2, column 8: Invalid value"


def test_truncated_toml_says_end_of_document(paths: Paths) -> None:
    paths.config_file.write_text("seed = [\n")
    with pytest.raises(SettingsError) as info:
        load_settings(paths=paths)
    assert str(info.value).startswith(f"{paths.config_file}: invalid TOML at end of document: ")


def test_unknown_key_names_key_and_file(paths: Paths) -> None:
    paths.config_file.write_text("n_ctx = 2048\ncontext = 10\n")
    with pytest.raises(SettingsError) as info:
        load_settings(paths=paths)
    assert str(info.value).startswith(f"{paths.config_file}: unknown setting 'context'")


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("n_ctx = 10", "n_ctx must be at least 64 (got 10)"),
        ('n_ctx = "4096"', "n_ctx must be an integer, got a string"),
        ("n_ctx = true", "n_ctx must be an integer, got a boolean"),
        ("temperature = -0.1", "temperature must be 0 or more"),
        ("top_p = 0", "top_p must be greater than 0 and at most 1"),
        ("top_p = 1.5", "top_p must be greater than 0 and at most 1"),
        ("top_k = -1", "top_k must be 0 or more"),
        ("max_tokens = 0", "max_tokens must be at least 1"),
        ("threads = -2", "threads must be 0 (auto) or more"),
        ("plain = 1", "plain must be a boolean, got an integer"),
        ("persona = 3", "persona must be a string, got an integer"),
        ("temperature = inf", "temperature must be a finite number"),
    ],
)
def test_bad_values_in_file_name_setting_and_file(paths: Paths, line: str, fragment: str) -> None:
    paths.config_file.write_text(line + "\n")
    with pytest.raises(SettingsError) as info:
        load_settings(paths=paths)
    message = str(info.value)
    assert message.startswith(f"{paths.config_file}: ")
    assert fragment in message


def test_bad_flag_value_names_the_flag(paths: Paths) -> None:
    with pytest.raises(SettingsError, match=r"^flag --top-p: top_p must be greater than 0 and at most 1"):
        load_settings({"top_p": 2.0}, paths=paths)


def test_unknown_flag_key_is_rejected(paths: Paths) -> None:
    with pytest.raises(SettingsError, match=r"^flag --colour: unknown setting 'colour'"):
        load_settings({"colour": True}, paths=paths)


def test_reserve_must_leave_room_in_the_context(paths: Paths) -> None:
    paths.config_file.write_text("n_ctx = 512\n")
    with pytest.raises(SettingsError) as info:
        load_settings({"reserve": 512}, paths=paths)
    assert str(info.value) == (
        f"flag --reserve: reserve (512) must be less than n_ctx (512, from {paths.config_file})"
    )
    assert load_settings({"reserve": 511}, paths=paths).reserve == 511


# -------------------------------------------------------------------------------------- shipped config


def _commented_assignments() -> dict[str, object]:
    """Every ``# key = value`` line of the shipped config, uncommented and parsed."""
    text = packaged_config_file().read_text(encoding="utf-8")
    lines = [ln[2:] for ln in text.splitlines() if re.match(r"# [a-z_]+ = ", ln)]
    return tomllib.loads("\n".join(lines))


def test_shipped_config_sets_nothing_and_documents_every_default() -> None:
    assert tomllib.loads(packaged_config_file().read_text(encoding="utf-8")) == {}
    documented = _commented_assignments()
    assert sorted(documented) == sorted(SETTING_NAMES)
    defaults = dataclasses.asdict(Settings())
    for name, value in documented.items():
        if defaults[name] is not None:  # None defaults (model, seed) show an example instead
            assert value == defaults[name], name


def test_explicit_settings_are_the_flags_and_env_given_not_the_files(packaged: Path, paths: Paths) -> None:
    """What beats a persona's sampling defaults: a flag or a CHATCLI_* variable, never a config file."""
    from chatcli.config.settings import load_settings_explicit

    packaged.write_text("top_k = 7\n")
    paths.config_file.write_text("top_p = 0.5\n")
    env = {"CHATCLI_HOME": str(paths.home), "CHATCLI_REPEAT_PENALTY": "1.2"}
    settings, explicit = load_settings_explicit({"temperature": 0.0, "max_tokens": None}, paths=paths, env=env)
    assert (settings.temperature, settings.top_p, settings.top_k, settings.repeat_penalty) == (0.0, 0.5, 7, 1.2)
    assert explicit == {"temperature", "repeat_penalty"}
