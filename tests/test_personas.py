"""Personas: shipped files, user overrides, validation messages, prefix messages and the text hash."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from chatcli.cli.app import app
from chatcli.config.personas import (
    Persona,
    PersonaError,
    get_persona,
    load_persona_file,
    load_personas,
    packaged_personas_dir,
    persona_problems,
)
from chatcli.config.settings import Settings, get_paths
from chatcli.core.template import Message
from tests.golden import install, one_line, open_conv, runner

SHIPPED = {"alice", "coder", "pirate", "tutor"}


@pytest.fixture(autouse=True)
def user_dir(chatcli_home: Path) -> Path:
    """The user's personas directory under conftest's private CHATCLI_HOME."""
    directory = get_paths().personas_dir
    directory.mkdir(parents=True)
    return directory


def write(directory: Path, stem: str, text: str) -> Path:
    path = directory / f"{stem}.toml"
    path.write_text(text, encoding="utf-8")
    return path


def persona_toml(name: str, system: str = "Be brief.", description: str = "A test persona.") -> str:
    return f'name = "{name}"\ndescription = "{description}"\nsystem = "{system}"\n'


# -------------------------------------------------------------------------------------------- shipped


def test_shipped_personas_all_load_cleanly() -> None:
    assert (packaged_personas_dir() / "alice.toml").is_file()
    personas = load_personas(strict=True)
    assert set(personas) == SHIPPED
    assert persona_problems() == []
    assert Settings().persona in personas


def test_shipped_alice_has_greeting_and_example_and_someone_has_sampling() -> None:
    personas = load_personas()
    alice = personas["alice"]
    assert alice.greeting and alice.greeting.strip()
    assert len(alice.examples) == 1
    assert any(p.sampling for p in personas.values())
    assert personas["coder"].sampling_dict()["temperature"] == 0.2
    for persona in personas.values():
        # The test model is a 135M SmolLM2: system prompts stay short.
        assert 0 < len(persona.system) < 300, persona.name
        assert persona.source is not None and persona.source.stem == persona.name


def test_messages_order_system_examples_greeting() -> None:
    persona = Persona(
        name="t",
        description="d",
        system="SYS",
        greeting="HELLO",
        examples=(("u1", "a1"), ("u2", "a2")),
    )
    assert persona.messages() == [
        Message("system", "SYS"),
        Message("user", "u1"),
        Message("assistant", "a1"),
        Message("user", "u2"),
        Message("assistant", "a2"),
        Message("assistant", "HELLO"),
    ]
    assert Persona(name="t", description="d", system="S").messages() == [Message("system", "S")]


def test_shipped_alice_messages_come_from_the_file() -> None:
    alice = get_persona("alice")
    roles = [m.role for m in alice.messages()]
    assert roles == ["system", "user", "assistant", "assistant"]
    assert alice.messages()[0].content == alice.system
    assert alice.messages()[-1].content == alice.greeting


# ------------------------------------------------------------------------------------------ text hash


def test_text_hash_follows_rendered_text_only() -> None:
    base = Persona(name="t", description="d", system="S", greeting="G", examples=(("u", "a"),))
    same = base.text_hash()
    assert len(same) == 64 and int(same, 16) >= 0
    assert dataclasses.replace(base, description="other").text_hash() == same
    assert dataclasses.replace(base, sampling=(("temperature", 0.1),)).text_hash() == same
    assert dataclasses.replace(base, system="S2").text_hash() != same
    assert dataclasses.replace(base, greeting=None).text_hash() != same
    assert dataclasses.replace(base, examples=(("u", "b"),)).text_hash() != same


def test_text_hash_changes_when_the_file_system_prompt_is_edited(user_dir: Path) -> None:
    path = write(user_dir, "bob", persona_toml("bob", system="One."))
    first = load_persona_file(path).text_hash()
    write(user_dir, "bob", persona_toml("bob", system="One.", description="Edited description."))
    assert load_persona_file(path).text_hash() == first
    write(user_dir, "bob", persona_toml("bob", system="Two."))
    assert load_persona_file(path).text_hash() != first


def test_persona_is_hashable() -> None:
    persona = get_persona("coder")
    assert {persona: 1}[get_persona("coder")] == 1


# ------------------------------------------------------------------------------------ user overrides


def test_user_persona_is_added_and_overrides_packaged(user_dir: Path) -> None:
    write(user_dir, "bob", persona_toml("bob", system="I am Bob."))
    alice_path = write(user_dir, "alice", persona_toml("alice", system="I am the user's Alice."))
    personas = load_personas(user_dir)
    assert set(personas) == SHIPPED | {"bob"}
    assert personas["bob"].system == "I am Bob."
    assert personas["alice"].system == "I am the user's Alice."
    alice = get_persona("alice", user_dir)
    assert alice.source == alice_path
    assert alice.greeting is None
    # Without the user dir the packaged one is back.
    assert get_persona("alice").system != "I am the user's Alice."


def test_unknown_persona_lists_available_ones(user_dir: Path) -> None:
    write(user_dir, "bob", persona_toml("bob"))
    with pytest.raises(PersonaError) as info:
        get_persona("zed", user_dir)
    assert str(info.value) == "unknown persona 'zed' (available: alice, bob, coder, pirate, tutor)"


@pytest.mark.parametrize("name", ["../alice", "a/b", "a\\b", "", "Alice"])
def test_names_that_are_not_plain_names_are_rejected(name: str) -> None:
    with pytest.raises(PersonaError, match=r"^invalid persona name"):
        get_persona(name)


def test_non_toml_files_are_ignored(user_dir: Path) -> None:
    (user_dir / "notes.txt").write_text("not a persona")
    assert set(load_personas(user_dir)) == SHIPPED


# ------------------------------------------------------------------------------------------ bad files


def test_malformed_toml_names_file_line_and_column(user_dir: Path) -> None:
    path = write(user_dir, "bob", 'name = "bob"\ndescription = "x"\nsystem = = "y"\n')
    with pytest.raises(PersonaError) as info:
        get_persona("bob", user_dir)
    message = str(info.value)
    assert message == f"{path}: invalid TOML at line 3, column 10: Invalid value"


def test_bad_file_is_skipped_but_reported_unless_strict(user_dir: Path) -> None:
    path = write(user_dir, "bob", "name = \n")
    write(user_dir, "carol", persona_toml("carol"))
    personas = load_personas(user_dir)
    assert "bob" not in personas and "carol" in personas
    problems = persona_problems(user_dir)
    assert len(problems) == 1 and problems[0].startswith(f"{path}: invalid TOML at line 1")
    with pytest.raises(PersonaError, match="invalid TOML at line 1"):
        load_personas(user_dir, strict=True)


def test_broken_user_override_hides_packaged_persona(user_dir: Path) -> None:
    path = write(user_dir, "alice", 'name = "alice"\n')
    assert "alice" not in load_personas(user_dir)
    with pytest.raises(PersonaError) as info:
        get_persona("alice", user_dir)
    assert str(info.value) == f"{path}: missing required field 'description'"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('description = "d"\nsystem = "s"\n', "missing required field 'name'"),
        ('name = "bob"\nsystem = "s"\n', "missing required field 'description'"),
        ('name = "bob"\ndescription = "d"\n', "missing required field 'system'"),
        ('name = "bob"\ndescription = "d"\nsystem = 3\n', "'system' must be a string, got an integer"),
        ('name = "bob"\ndescription = "d"\nsystem = "  "\n', "'system' must not be empty"),
        ('name = "bob"\ndescription = "d"\nsystem = "s"\ngreeting = ["hi"]\n', "'greeting' must be a string"),
        ('name = "rob"\ndescription = "d"\nsystem = "s"\n', "'name' is 'rob' but must match the file name 'bob'"),
        ('name = "bob"\ndescription = "d"\nsytem = "s"\n', "unknown field 'sytem'"),
        (
            'name = "bob"\ndescription = "d"\nsystem = "s"\n[[examples]]\nuser = "u"\n',
            "examples[1]: missing required field 'assistant'",
        ),
        (
            'name = "bob"\ndescription = "d"\nsystem = "s"\nexamples = "u"\n',
            "'examples' must be an array of tables",
        ),
        (
            'name = "bob"\ndescription = "d"\nsystem = "s"\n[sampling]\nmin_p = 0.1\n',
            "[sampling] has unknown key 'min_p'",
        ),
        (
            'name = "bob"\ndescription = "d"\nsystem = "s"\n[sampling]\ntemperature = -1\n',
            "[sampling] temperature must be 0 or more",
        ),
        (
            'name = "bob"\ndescription = "d"\nsystem = "s"\n[sampling]\ntop_k = 1.5\n',
            "[sampling] top_k must be an integer, got a number",
        ),
    ],
)
def test_invalid_persona_names_file_and_field(user_dir: Path, text: str, fragment: str) -> None:
    path = write(user_dir, "bob", text)
    with pytest.raises(PersonaError) as info:
        get_persona("bob", user_dir)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert fragment in message
    assert "\n" not in message


def test_valid_sampling_and_examples_are_parsed(user_dir: Path) -> None:
    write(
        user_dir,
        "bob",
        persona_toml("bob")
        + 'greeting = "Hey"\n[[examples]]\nuser = "u1"\nassistant = "a1"\n'
        + "[sampling]\ntemperature = 1\ntop_k = 5\n",
    )
    bob = get_persona("bob", user_dir)
    assert bob.examples == (("u1", "a1"),)
    assert bob.greeting == "Hey"
    assert bob.sampling_dict() == {"temperature": 1.0, "top_k": 5}
    assert isinstance(bob.sampling_dict()["temperature"], float)


def test_malformed_user_persona_names_file_and_line_before_loading(
    chatcli_home: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    loads: list[object] = []
    monkeypatch.setattr("chatcli.session.Engine", lambda *a, **k: loads.append(a))
    personas = chatcli_home / "config" / "personas"  # made by this module's user_dir fixture
    assert personas.is_dir()
    bad = personas / "x.toml"
    bad.write_text('name = "x"\nsystem = "unterminated\n')
    result = runner.invoke(app, ["talk", "--persona", "x"], input="hi\n")
    assert result.exit_code == 2
    line = one_line(result.stderr)
    assert str(bad) in line and "line 2" in line
    bad.write_bytes(b'system = "caf\xe9"\n')
    result = runner.invoke(app, ["talk", "--persona", "x"], input="hi\n")
    assert result.exit_code == 2 and str(bad) in one_line(result.stderr)
    assert loads == []


def test_conversation_whose_persona_file_broke_still_resumes(sess: Any, golden: dict[str, Any]) -> None:
    cid = install(golden)
    personas = get_paths().personas_dir
    personas.mkdir(parents=True, exist_ok=True)
    (personas / "alice.toml").write_text("system = [unclosed\n")
    conv, report, _ = open_conv(sess, cid)
    conv.close()
    assert report.reevaluated == 0 and sess.engine.tokens == golden["main"]["tokens"]
