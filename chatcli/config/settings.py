"""Where chatcli keeps its files, and the settings it runs with.

Settings are merged in layers, each overriding the one before:
defaults < packaged commented config < the user's config file < ``CHATCLI_*`` environment variables < flags.
Every value is checked against one table of rules, so a bad value is reported once, in one line, naming
where it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import platformdirs

from chatcli.backends.kvformat import KV_TYPE_NAMES  # no llama_cpp behind it
from chatcli.errors import ChatcliError, Kind

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

import tomllib

APP_NAME = "chatcli"
ENV_PREFIX = "CHATCLI_"
HOME_ENV = "CHATCLI_HOME"


class SettingsError(ChatcliError, ValueError):
    """A setting or config file is invalid; the message is one line and says where the value came from."""

    kind: Kind = "usage"


# ---------------------------------------------------------------------------------------------- paths


@dataclass
class Paths:
    """The directories chatcli uses; `get_paths` is the only place that decides them."""

    home: Path | None
    data_dir: Path
    cache_dir: Path
    config_dir: Path

    @property
    def config_file(self) -> Path:
        return self.config_dir / "config.toml"

    @property
    def personas_dir(self) -> Path:
        return self.config_dir / "personas"

    @property
    def history_file(self) -> Path:
        return self.data_dir / "history"

    @property
    def conversations_dir(self) -> Path:
        return self.data_dir / "conversations"

    @property
    def prefix_cache_dir(self) -> Path:
        return self.cache_dir / "prefix"



def get_paths(env: Mapping[str, str] | None = None) -> Paths:
    """Resolve chatcli's directories: all under ``$CHATCLI_HOME`` if set, else the platform's user dirs."""
    env = os.environ if env is None else env
    home_text = env.get(HOME_ENV, "")
    if home_text:
        # Absolute now, so a later chdir cannot move the data directory.
        home = Path(home_text).expanduser().absolute()
        return Paths(home=home, data_dir=home / "data", cache_dir=home / "cache", config_dir=home / "config")
    return Paths(
        home=None,
        data_dir=platformdirs.user_data_path(APP_NAME),
        cache_dir=platformdirs.user_cache_path(APP_NAME),
        config_dir=platformdirs.user_config_path(APP_NAME),
    )


# -------------------------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """Everything that can be configured, with its default."""

    model: str | None = None
    n_ctx: int = 4096
    threads: int = 0  # 0 = let llama.cpp choose
    seed: int | None = None  # None = random
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    repeat_penalty: float = 1.1
    max_tokens: int = 1024
    reserve: int = 256  # tokens kept free for a reply when the context must shift
    persona: str = "alice"
    plain: bool = False
    history_preview: int = 3  # exchanges shown on resume
    server: str | None = None  # http://HOST:PORT of a llama-server to use instead of the local model
    server_slot: int = 0  # the server slot this process uses (llama-server -np N gives N slots)
    server_connect_timeout: float = 10.0  # seconds
    server_read_timeout: float = 600.0  # seconds of silence from the server before giving up
    server_api_key: str | None = None  # llama-server --api-key (better in CHATCLI_SERVER_API_KEY than in a file)
    kv_type: str = "f16"  # KV cache type of new conversations: f16 | q8_0 | q4_0
    chat_template: str | None = None  # a Jinja chat template file used instead of the model's own
    thinking: bool | None = None  # enable_thinking for templates that read it; None = the template's default
    show_reasoning: bool = False  # the REPL shows a reply's reasoning in full (else folded to one line)
    state_budget: str = "20GB"  # bound on all KV state files + persona prefix cache; 0/none = no limit
    # `chatcli serve`
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8765
    parallel: int = 1  # conversations resident at once
    api_key: str | None = None  # when set, every request needs Authorization: Bearer KEY
    api_keys_file: str | None = None  # more keys, one a line: each key is a client with its own conversations
    api_repl_access: bool = False  # API clients may match, name and fork conversations made in the REPL
    max_queue: int = 16  # chat requests waiting for a context beyond the running ones; more: 503 Retry-After


SETTING_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Settings))

# name -> (value type, may be None). One table, so TOML, env, flags and personas share the same checks.
_KINDS: dict[str, tuple[type, bool]] = {
    "model": (str, True),
    "n_ctx": (int, False),
    "threads": (int, False),
    "seed": (int, True),
    "temperature": (float, False),
    "top_p": (float, False),
    "top_k": (int, False),
    "repeat_penalty": (float, False),
    "max_tokens": (int, False),
    "reserve": (int, False),
    "persona": (str, False),
    "plain": (bool, False),
    "history_preview": (int, False),
    "server": (str, True),
    "server_slot": (int, False),
    "server_connect_timeout": (float, False),
    "server_read_timeout": (float, False),
    "server_api_key": (str, True),
    "kv_type": (str, False),
    "chat_template": (str, True),
    "thinking": (bool, True),
    "show_reasoning": (bool, False),
    "state_budget": (str, False),
    "host": (str, False),
    "port": (int, False),
    "parallel": (int, False),
    "api_key": (str, True),
    "api_keys_file": (str, True),
    "api_repl_access": (bool, False),
    "max_queue": (int, False),
}



def _is_size(value: str) -> bool:
    from chatcli.units import SizeError, parse_size

    try:
        parse_size(value)
    except SizeError:
        return False
    return True

# name -> (predicate, what the value must be). Ranges follow what llama.cpp accepts.
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model": (lambda v: bool(v.strip()), "must not be empty"),
    "n_ctx": (lambda v: v >= 64, "must be at least 64"),
    "threads": (lambda v: v >= 0, "must be 0 (auto) or more"),
    "seed": (lambda v: 0 <= v <= 0xFFFFFFFF, "must be between 0 and 4294967295"),
    "temperature": (lambda v: v >= 0, "must be 0 or more"),
    "top_p": (lambda v: 0 < v <= 1, "must be greater than 0 and at most 1"),
    "top_k": (lambda v: v >= 0, "must be 0 or more"),
    "repeat_penalty": (lambda v: v > 0, "must be greater than 0"),
    "max_tokens": (lambda v: v >= 1, "must be at least 1"),
    "reserve": (lambda v: v >= 0, "must be 0 or more"),
    "persona": (lambda v: bool(v.strip()), "must not be empty"),
    "history_preview": (lambda v: v >= 0, "must be 0 or more"),
    "server": (lambda v: re.fullmatch(r"(https?://)?[^\s/?#]+(/[^\s?#]*)?", v.strip()) is not None,
               "must be a URL such as http://HOST:PORT"),
    "server_slot": (lambda v: v >= 0, "must be 0 or more"),
    "server_connect_timeout": (lambda v: v > 0, "must be greater than 0"),
    "server_read_timeout": (lambda v: v > 0, "must be greater than 0"),
    "chat_template": (lambda v: bool(v.strip()), "must be a file path"),
    "kv_type": (lambda v: v in KV_TYPE_NAMES, f"must be one of {', '.join(KV_TYPE_NAMES)}"),
    "state_budget": (_is_size, "must be a size such as 20GB or 500MB, or 0/none for no limit"),
    "host": (lambda v: bool(v.strip()), "must not be empty"),
    "port": (lambda v: 1 <= v <= 65535, "must be between 1 and 65535"),
    "parallel": (lambda v: 1 <= v <= 64, "must be between 1 and 64"),
    "api_key": (lambda v: len(v.strip()) >= 8, "must be at least 8 characters"),
    "api_keys_file": (lambda v: bool(v.strip()), "must not be empty"),
    "max_queue": (lambda v: 0 <= v <= 4096, "must be between 0 and 4096"),
}

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NONE = frozenset({"", "none"})
_TYPE_WORDS: dict[type, str] = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _describe_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


def _unknown_setting(name: str) -> str:
    close = difflib.get_close_matches(name, SETTING_NAMES, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(SETTING_NAMES)})"
    return f"unknown setting '{name}'{hint}"


def check_setting(name: str, value: Any) -> Any:
    """Validate a typed value (from TOML or code) for setting `name`; return it normalised.

    Raises SettingsError without an origin; callers prefix where the value came from.
    """
    if name not in _KINDS:
        raise SettingsError(_unknown_setting(name))
    kind, optional = _KINDS[name]
    if name == "state_budget" and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # `state_budget = 0` in TOML: a size in bytes
    # TOML has no null, so "none" (or "") is how a file resets an optional setting such as seed.
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in _NONE)):
        return None
    # bool is an int subclass: `n_ctx = true` must not quietly mean 1.
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise SettingsError(f"{name} must be {_TYPE_WORDS[kind]}, got {_describe_type(value)} ({value!r})")
    if kind is float and not math.isfinite(value):
        raise SettingsError(f"{name} must be a finite number (got {value!r})")
    rule = _RULES.get(name)
    if rule is not None and not rule[0](value):
        got = f"{len(value)} characters" if name.endswith("api_key") else repr(value)  # never echo a secret
        raise SettingsError(f"{name} {rule[1]} (got {got})")
    return value


def parse_setting(name: str, text: str) -> Any:
    """Parse the text form of a setting (an environment variable, a REPL `/set`) and validate it."""
    if name not in _KINDS:
        raise SettingsError(_unknown_setting(name))
    kind, optional = _KINDS[name]
    stripped = text.strip()
    if optional and stripped.lower() in _NONE:
        return None
    value: Any
    try:
        if kind is bool:
            lowered = stripped.lower()
            if lowered not in _TRUE | _FALSE:
                raise ValueError
            value = lowered in _TRUE
        elif kind is int:
            value = int(stripped)
        elif kind is float:
            value = float(stripped)
        else:
            value = stripped
    except ValueError:
        words = "1/0, true/false or yes/no" if kind is bool else _TYPE_WORDS[kind]
        raise SettingsError(f"{name} must be {words} (got {text!r})") from None
    return check_setting(name, value)


def toml_error_message(path: object, exc: tomllib.TOMLDecodeError) -> str:
    """One line naming the file and the line, e.g. ``x.toml: invalid TOML at line 3, column 7: Invalid value``."""
    text = str(exc).replace("\n", " ")
    m = re.fullmatch(r"(.*?)\s*\(at (line \d+, column \d+|end of document)\)", text)
    if m:
        return f"{path}: invalid TOML at {m[2]}: {m[1]}"
    return f"{path}: invalid TOML: {text}"


def packaged_config_file() -> Traversable:
    """The commented config shipped inside the package (merged under the user's own file)."""
    return resources.files("chatcli") / "data" / "config.toml"


def _read_toml(source: Traversable | Path, label: str) -> dict[str, Any]:
    try:
        raw = source.read_bytes()
    except OSError as exc:
        raise SettingsError(f"cannot read {label}: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise SettingsError(f"{label}: not valid UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(toml_error_message(label, exc)) from None


def _flag_label(name: str) -> str:
    return f"flag --{name.replace('_', '-')}"


def _layers(
    flags: Mapping[str, Any] | None, paths: Paths, env: Mapping[str, str]
) -> list[tuple[str, str, dict[str, Any], bool]]:
    """Each layer as (origin shown to users, label used in errors, values, values-are-text)."""
    layers: list[tuple[str, str, dict[str, Any], bool]] = []
    packaged = packaged_config_file()
    if packaged.is_file():
        label = str(packaged)
        layers.append(("packaged config", label, _read_toml(packaged, label), False))
    user_file = paths.config_file
    if user_file.exists():
        layers.append((str(user_file), str(user_file), _read_toml(user_file, str(user_file)), False))
    for name in SETTING_NAMES:
        var = ENV_PREFIX + name.upper()
        if var in env:
            origin = f"env {var}"
            layers.append((origin, origin, {name: env[var]}, True))
    for name, value in (flags or {}).items():
        if value is None:  # a flag left at None was not given
            continue
        if name not in _KINDS:
            raise SettingsError(f"{_flag_label(name)}: {_unknown_setting(name)}")
        origin = _flag_label(name)
        # Typer hands over typed values; a string for a non-string setting is parsed like the env.
        layers.append((origin, origin, {name: value}, isinstance(value, str) and _KINDS[name][0] is not str))
    return layers


def _resolve(
    flags: Mapping[str, Any] | None, paths: Paths | None, env: Mapping[str, str] | None
) -> tuple[Settings, dict[str, str]]:
    env = os.environ if env is None else env
    paths = get_paths(env) if paths is None else paths
    values: dict[str, Any] = dataclasses.asdict(Settings())
    origins: dict[str, str] = {name: "default" for name in SETTING_NAMES}
    for origin, label, layer, is_text in _layers(flags, paths, env):
        for name, value in layer.items():
            if name not in _KINDS:
                raise SettingsError(f"{label}: {_unknown_setting(name)}")
            try:
                values[name] = parse_setting(name, value) if is_text else check_setting(name, value)
            except SettingsError as exc:
                raise SettingsError(f"{label}: {exc}") from None
            origins[name] = origin
    # The one rule that involves two settings: a reserve that fills the context leaves no room at all.
    if values["reserve"] >= values["n_ctx"]:
        raise SettingsError(
            f"{origins['reserve']}: reserve ({values['reserve']}) must be less than n_ctx "
            f"({values['n_ctx']}, from {origins['n_ctx']})"
        )
    return Settings(**values), origins


def load_settings(
    flags: Mapping[str, Any] | None = None,
    *,
    paths: Paths | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Merge defaults, packaged config, user config, ``CHATCLI_*`` env vars and flags (None = not given)."""
    return _resolve(flags, paths, env)[0]


def fit_reserve(settings: Settings, explicit: set[str]) -> None:
    """The reserve rule again once a resumed conversation's saved ``n_ctx`` replaced the setting (a context
    of 256 with the default reserve of 256 would refuse every message). A reserve the user set must fit
    (SettingsError); a default one shrinks to a quarter of the context."""
    if settings.reserve < settings.n_ctx:
        return
    if "reserve" in explicit:
        raise SettingsError(f"reserve ({settings.reserve}) must be less than the conversation's n_ctx "
                            f"({settings.n_ctx}): resume with a smaller --reserve or a larger --n-ctx")
    settings.reserve = settings.n_ctx // 4


def load_settings_explicit(
    flags: Mapping[str, Any] | None = None,
    *,
    paths: Paths | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[Settings, set[str]]:
    """``load_settings``, and the names the user set for this run (a flag or a ``CHATCLI_*`` variable).

    Those win over a persona's own sampling defaults; the config file and the defaults do not.
    """
    settings, origins = _resolve(flags, paths, env)
    explicit = {name for name, origin in origins.items() if origin.startswith(("env ", "flag "))}
    return settings, explicit


def describe_settings(
    paths: Paths | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> list[tuple[str, Any, str]]:
    """(name, value, origin) for every setting; origin is "default", "packaged config", a path or "env X"."""
    settings, origins = _resolve(flags, paths, env)
    return [(name, getattr(settings, name), origins[name]) for name in SETTING_NAMES]
