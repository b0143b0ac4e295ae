"""SmolLM2's chat template, rendered incrementally."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatcli.models.gguf import read_gguf
from chatcli.core.template import CHATML, ChatTemplate, Message, TemplateError


@pytest.fixture(scope="module")
def smol(model_path: Path) -> ChatTemplate:
    return ChatTemplate(read_gguf(model_path).chat_template)


def test_smollm2_renders_chatml(smol: ChatTemplate) -> None:
    text = smol.render([Message("system", "S"), Message("user", "U")], add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_prefix_is_the_persona_part(smol: ChatTemplate) -> None:
    persona = [Message("system", "S"), Message("user", "ex"), Message("assistant", "ans")]
    assert smol.prefix(persona) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nex<|im_end|>\n<|im_start|>assistant\nans<|im_end|>\n"


def test_incremental_turns_concatenate_to_the_full_rendering(smol: ChatTemplate) -> None:
    history = [Message("system", "S")]
    text = smol.prefix(history)
    for user, reply in [("a", "b"), ("c", "d"), ("e", "f")]:
        text += smol.user_turn(history, user)
        history += [Message("user", user), Message("assistant", reply)]
        text += reply + smol.closing(history)
    assert text == smol.render(history, add_generation_prompt=False)


def test_default_system_prompt_is_injected_without_persona(smol: ChatTemplate) -> None:
    assert "You are a helpful AI assistant named SmolLM" in smol.user_turn([], "hi")


def test_closing_and_stop_strings(smol: ChatTemplate) -> None:
    assert smol.closing([Message("user", "a"), Message("assistant", "b")]) == "<|im_end|>\n"
    assert smol.reply_stop_strings() == ["<|im_end|>\n<|im_start|>user"] or smol.reply_stop_strings()[0].startswith("<|im_end|>")


def test_missing_template_falls_back_to_chatml() -> None:
    t = ChatTemplate(None)
    assert t.is_fallback and t.source == CHATML


def test_template_errors_are_one_line() -> None:
    with pytest.raises(TemplateError):
        ChatTemplate("{% for %}")
    t = ChatTemplate("{{ raise_exception('no system role') }}")
    with pytest.raises(TemplateError, match="no system role"):
        t.render([Message("user", "x")], add_generation_prompt=True)
