"""Personas: who the assistant is (system prompt, example exchanges, greeting, sampling defaults).

A persona is a TOML file — data, never code. The ones shipped with chatcli live in the package's
``personas`` directory; files in the user's personas directory add to them or replace them by name.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from chatcli.config.settings import SettingsError, check_setting, toml_error_message
from chatcli.core.template import Message
from chatcli.errors import ChatcliError, Kind

NAME_RE = re.compile(r"[a-z0-9_-]+")
SAMPLING_KEYS: tuple[str, ...] = ("temperature", "top_p", "top_k", "repeat_penalty", "max_tokens")
_KEYS = frozenset({"name", "description", "system", "greeting", "examples", "sampling"})


class PersonaError(ChatcliError, ValueError):
    """A persona is unknown or its file is invalid; the message is one line naming the file and field."""

    kind: Kind = "usage"


@dataclass(frozen=True)
class Persona:
    """One persona, as loaded from its TOML file. Frozen and hashable, so it can key caches."""

    name: str
    description: str
    system: str
    greeting: str | None = None
    examples: tuple[tuple[str, str], ...] = ()
    # Pairs rather than a dict so the dataclass stays hashable; `sampling_dict()` gives the mapping.
    sampling: tuple[tuple[str, float | int], ...] = ()
    source: Path | None = None

    def sampling_dict(self) -> dict[str, float | int]:
        """The persona's sampling defaults (they override settings that were not set explicitly)."""
        return dict(self.sampling)

    def messages(self) -> list[Message]:
        """The conversation prefix: system prompt, example exchanges, then the greeting."""
        out = [Message("system", self.system)]
        for user, assistant in self.examples:
            out.append(Message("user", user))
            out.append(Message("assistant", assistant))
        if self.greeting:
            out.append(Message("assistant", self.greeting))
        return out

    def text_hash(self) -> str:
        """sha256 of exactly what is rendered into the prefix, so a cached prefix state is reused only
        while the text it was computed from is unchanged (the description is not rendered)."""
        canonical = json.dumps(
            {"system": self.system, "examples": [list(e) for e in self.examples], "greeting": self.greeting},
            sort_keys=True,
            ensure_ascii=False,
            separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def packaged_personas_dir() -> Path:
    """The personas shipped with chatcli: inside the wheel, or the repo's ``personas/`` in a dev checkout."""
    shipped = resources.files("chatcli") / "personas"
    # Only a real directory can be globbed; zipped installs are not supported for personas.
    if isinstance(shipped, Path) and shipped.is_dir():
        return shipped
    return Path(__file__).resolve().parents[2] / "personas"


def _type_word(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)


def _optional(data: Mapping[str, Any], key: str, where: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise PersonaError(f"{where}: '{key}' must be a string, got {_type_word(value)}")
    return value


def _required(data: Mapping[str, Any], key: str, where: str) -> str:
    value = _optional(data, key, where)
    if value is None:
        raise PersonaError(f"{where}: missing required field '{key}'")
    return value


def parse_persona(data: Mapping[str, Any], path: Path) -> Persona:
    """Validate parsed TOML `data` from `path` and build the Persona."""
    where = str(path)
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise PersonaError(f"{where}: unknown field '{unknown[0]}' (allowed: {', '.join(sorted(_KEYS))})")
    name = _required(data, "name", where)
    description = _required(data, "description", where)
    system = _required(data, "system", where)
    greeting = _optional(data, "greeting", where)
    if not NAME_RE.fullmatch(name):
        raise PersonaError(f"{where}: 'name' must use only a-z, 0-9, '_' and '-' (got {name!r})")
    # The file name is how a persona is requested, so the two must agree or lookups would be ambiguous.
    if name != path.stem:
        raise PersonaError(f"{where}: 'name' is {name!r} but must match the file name {path.stem!r}")
    if not system.strip():
        raise PersonaError(f"{where}: 'system' must not be empty")

    raw_examples = data.get("examples", [])
    if not isinstance(raw_examples, list):
        raise PersonaError(f"{where}: 'examples' must be an array of tables ([[examples]])")
    examples: list[tuple[str, str]] = []
    for i, item in enumerate(raw_examples, start=1):
        label = f"examples[{i}]"
        if not isinstance(item, dict):
            raise PersonaError(f"{where}: {label} must be a table with 'user' and 'assistant'")
        extra = sorted(set(item) - {"user", "assistant"})
        if extra:
            raise PersonaError(f"{where}: {label} has unknown field '{extra[0]}' (allowed: assistant, user)")
        examples.append(
            (_required(item, "user", f"{where}: {label}"), _required(item, "assistant", f"{where}: {label}"))
        )

    raw_sampling = data.get("sampling", {})
    if not isinstance(raw_sampling, dict):
        raise PersonaError(f"{where}: 'sampling' must be a table ([sampling])")
    sampling: list[tuple[str, float | int]] = []
    for key in sorted(raw_sampling):
        if key not in SAMPLING_KEYS:
            allowed = ", ".join(SAMPLING_KEYS)
            raise PersonaError(f"{where}: [sampling] has unknown key '{key}' (allowed: {allowed})")
        try:
            # The same rules as the settings these values stand in for.
            sampling.append((key, check_setting(key, raw_sampling[key])))
        except SettingsError as exc:
            raise PersonaError(f"{where}: [sampling] {exc}") from None

    return Persona(
        name=name,
        description=description,
        system=system,
        greeting=greeting,
        examples=tuple(examples),
        sampling=tuple(sampling),
        source=path,
    )


def load_persona_file(path: Path) -> Persona:
    """Read and validate one persona file."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PersonaError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise PersonaError(f"{path}: not valid UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise PersonaError(toml_error_message(path, exc)) from None
    return parse_persona(data, path)


def _persona_files(user_dir: Path | None) -> dict[str, Path]:
    """name -> file; user files replace packaged ones of the same name."""
    files: dict[str, Path] = {}
    for directory in (packaged_personas_dir(), user_dir):
        if directory is not None and directory.is_dir():
            for path in sorted(directory.glob("*.toml")):
                files[path.stem] = path
    return files


def _scan(user_dir: Path | None) -> tuple[dict[str, Persona], list[PersonaError]]:
    personas: dict[str, Persona] = {}
    problems: list[PersonaError] = []
    for stem, path in sorted(_persona_files(user_dir).items()):
        # A broken user file hides the packaged persona of the same name instead of silently falling back
        # to it: the user asked for their version, and `persona_problems` says why it is missing.
        try:
            personas[stem] = load_persona_file(path)
        except PersonaError as exc:
            problems.append(exc)
    return personas, problems


def load_personas(user_dir: Path | None = None, *, strict: bool = False) -> dict[str, Persona]:
    """All personas by name: packaged ones plus ``user_dir/*.toml`` (None = packaged only).

    Bad files are skipped (see `persona_problems`) unless `strict`, which raises the first one.
    """
    personas, problems = _scan(user_dir)
    if strict and problems:
        raise problems[0]
    return personas


def persona_problems(user_dir: Path | None = None) -> list[str]:
    """One line per persona file that cannot be loaded."""
    return [str(exc) for exc in _scan(user_dir)[1]]


def get_persona(name: str, user_dir: Path | None = None) -> Persona:
    """The persona called `name`; a malformed file for it raises that file's error."""
    # The name becomes a file name: never let it walk out of the personas directories.
    if not NAME_RE.fullmatch(name):
        raise PersonaError(f"invalid persona name {name!r}: use only a-z, 0-9, '_' and '-'")
    path = _persona_files(user_dir).get(name)
    if path is None:
        available = ", ".join(sorted(load_personas(user_dir))) or "none"
        raise PersonaError(f"unknown persona {name!r} (available: {available})")
    return load_persona_file(path)
