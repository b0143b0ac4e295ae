"""Every chat template llama.cpp ships (its own test fixtures), rendered incrementally as a conversation does.

No model: the context is built from the same pieces ``Conversation`` evaluates — the persona prefix, then per
turn ``user_turn`` + the reply as generated + ``closing`` — over three turns, with and without a system
prompt, with plain replies and with replies that reason first. The reply "as generated" is what a model
trained on the template writes after the generation prompt: the template's own rendering of that reply as
the last message, from the end of the generation prompt to the end of the content (where that rendering
does not start with the generation prompt, the content itself).

Checked for all 70 × 4 renderings:
- nothing is shown twice: every question, answer, reasoning and the system prompt appears in the context
  exactly once (no template here shows one more often than once);
- the context equals the template's own full rendering of the conversation, except for the templates in
  ``DIFFERENCES``: there each difference is named, and the two must be equal once exactly those fragments
  are taken out of both (anything else differing fails).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from chatcli.core.template import _S_END, ChatTemplate, Message

_DIRS = [Path.home() / ".cache/chatcli/llama-server-0.3.36-portable/templates",
         Path("/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates")]
TEMPLATE_DIR = next((d for d in _DIRS if d.is_dir() and any(d.glob("*.jinja"))), None)
NAMES = sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja")) if TEMPLATE_DIR else []

_THINK = r"<think>.*?</think>\s*"  # a reasoning block (empty or not) and the blank after it
_PRESERVED = "drops the reasoning of turns before the last user message; the context keeps it as generated"
_OPEN_LAST = ("the template leaves the last reply open (its closing follows only when another message does); "
              "the context closes every reply")
_EMPTY_THINK = ("writes an empty think block into earlier turns that the generation prompt does not open "
                "(the model writes its own)")

# template → (why the context differs from the template's full rendering, fragments that make up the
# difference). The context is never re-rendered: it holds what the model generated, reasoning included.
DIFFERENCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "Apriel-1.6-15b-Thinker-fixed": ("the generation prompt opens 'Here are my reasoning steps:', which the "
                                     "template leaves out of earlier turns; " + _OPEN_LAST,
                                     (r"Here are my reasoning steps:\n", r"\n<\|end\|>\n$")),
    "Cohere2MoE": ("the generation prompt opens a thinking block; earlier turns are rendered as a text block",
                   (r"<\|START_(THINKING|TEXT)\|>", r"<\|END_(THINKING|TEXT)\|>", _THINK)),
    "CohereForAI-c4ai-command-r-plus-tool_use": (
        "the generation prompt carries the 'Action:' tool instructions only for the turn being answered; the "
        "template opens the next turn after every reply, so the context's last closing holds its start token",
        (r"<\|START_OF_TURN_TOKEN\|><\|SYSTEM_TOKEN\|>Write 'Action:'.*?<\|END_OF_TURN_TOKEN\|>",
         r"<\|START_OF_TURN_TOKEN\|>$")),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": (
        "the generation prompt opens a thinking block; earlier turns are rendered as a response block; the "
        "template writes the next assistant header after the last reply even without a generation prompt",
        (r"<\|START_(THINKING|RESPONSE)\|>", r"<\|END_(THINKING|RESPONSE)\|>", _THINK,
         r"<\|START_OF_TURN_TOKEN\|>(<\|CHATBOT_TOKEN\|>)?$")),
    "GLM-4.6": (_PRESERVED, (r"(?<=<think>)\s*REASON\d\s*(?=</think>)",)),
    "GLM-4.7-Flash": (_PRESERVED + "; " + _EMPTY_THINK, (_THINK, r"</think>")),
    "Kimi-K2-Thinking": (_EMPTY_THINK + "; " + _PRESERVED, (_THINK,)),
    "Kimi-K3": ("earlier turns get empty think/response sections the generation prompt leaves to the model",
                (r"<\|open\|>think<\|sep\|>.*?<\|close\|>think<\|sep\|>", r"<\|(open|close)\|>response(<\|sep\|>)?",
                 r"<\|sep\|>", r"<\|close\|>think", _THINK)),
    "LFM2.5-8B-A1B": (_PRESERVED, (_THINK,)),
    "LFM2.5-Instruct": (_PRESERVED, (_THINK,)),
    "MiniMax-M2": (_PRESERVED, (_THINK,)),
    "MiniMax-M3": (_EMPTY_THINK, (r"</?mm:think>",)),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": (_PRESERVED + "; empty think block of earlier turns",
                                            (_THINK, r"</?think>\s*")),
    "NVIDIA-Nemotron-Nano-v2": (_PRESERVED + "; the last turn keeps only the generation prompt's open tag",
                                (_THINK, r"</?think>\s*")),
    "Qwen-QwQ-32B": (_PRESERVED + " (and the generation prompt's open think tag)", (_THINK, r"</?think>\s*")),
    "Qwen-Qwen3-0.6B": (_PRESERVED + " (an empty block too)", (_THINK,)),
    "Qwen3.5-4B": (_PRESERVED + " (the generation prompt opens it)", (_THINK, r"</?think>\s*")),
    "StepFun3.5-Flash": (_PRESERVED + " (the generation prompt opens it)", (_THINK, r"</?think>\s*")),
    "Reka-Edge": ("earlier answers are written with a leading space the generation prompt does not have "
                  "(and without their reasoning)", (_THINK, r"(?<=assistant:) +")),
    "Apertus-8B-Instruct": (_OPEN_LAST, (r"<\|assistant_end\|>$",)),
    "tencent-Hy3": (_OPEN_LAST, (r"<｜hy_eos:opensource｜>$",)),
    "Spark2.5": (_EMPTY_THINK + " (the generation prompt opens one, the model closes it)", (r"</?think>\s*",)),
    "llama-cpp-rwkv-world": ("earlier answers are written with a leading space the generation prompt does not "
                             "have (and without their reasoning)", (_THINK, r"(?<=Assistant:) +")),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": (_PRESERVED + " (the generation prompt opens it)",
                                                 (_THINK, r"</?think>\s*")),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (_PRESERVED + " (the generation prompt opens it)",
                                                 (_THINK, r"</?think>\s*")),
    "llama-cpp-deepseek-r1": (_PRESERVED + " (the generation prompt opens it)", (_THINK, r"</?think>\s*")),
    "deepseek-ai-DeepSeek-V3.2": ("the generation prompt opens a think tag earlier turns do not have",
                                  (_THINK, r"</?think>")),
    "fireworks-ai-llama-3-firefunction-v2": (
        "the full rendering ends with an empty assistant header (it always adds one)",
        (r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n$",)),
    "google-gemma-4-31B-it": ("the generation prompt opens an empty thought channel earlier turns do not have",
                              (r"<\|channel>thought\n<channel\|>", _THINK)),
    "google-gemma-4-31B-it-interleaved": (
        "the generation prompt opens an empty thought channel earlier turns do not have",
        (r"<\|channel>thought\n<channel\|>", _THINK)),
    "meetkai-functionary-medium-v3.2": ("earlier answers carry the 'all' recipient the model writes itself",
                                        (r"(?<=>>>)(all\n)+",)),
    "microsoft-Phi-3.5-mini-instruct": ("the full rendering ends with EOS (a training form); the conversation "
                                        "goes on", (r"</s>$",)),
    "mistralai-Mistral-Nemo-Instruct-2407": (
        "the template puts the system prompt into the last user turn; the context holds it once, in the first",
        (r"SYSPROMPT\n\n",)),
    "muse-glimmer": ("earlier answers carry the 'to=user' recipient the model writes itself",
                     (r" to=user<\|message\|>",)),
    "openai-gpt-oss-120b": ("earlier answers carry the final channel the model writes itself, and the last ends "
                            "with <|return|> where the conversation, going on, has <|end|>",
                            (r"<\|channel\|>final<\|message\|>", r"<\|(return|end)\|>$", _THINK)),
    "poolside-Laguna-S-2.1": (_EMPTY_THINK, (r"</?think>",)),
    "poolside-Laguna-XS-2.1": (_PRESERVED, (_THINK, r"</?think>\s*")),
    "poolside-Laguna-XS.2": (_PRESERVED, (_THINK, r"</?think>\s*")),
    "upstage-Solar-Open-100B": ("earlier answers carry the content marker the model writes itself",
                                (r"<\|content\|>", _THINK)),
    "inclusionai-ling-3.0-flash": (_EMPTY_THINK + "; " + _PRESERVED, (_THINK, r"</?think>\s*")),
    "Bielik-11B-v3.0-Instruct": (_PRESERVED, (_THINK,)),
    "deepseek-ai-DeepSeek-V3.1": (_PRESERVED, (_THINK, r"</?think>")),
    "HuggingFaceTB-SmolLM3-3B": (_PRESERVED, (_THINK,)),
    "ibm-granite-granite-3.3-2B-Instruct": (_PRESERVED, (_THINK,)),
    "openbmb-MiniCPM5-1B": (_PRESERVED, (_THINK,)),
    "deepseek-ai-DeepSeek-V4": (_PRESERVED, (_THINK,)),
    "deepseek-ai-DeepSeek-V4-Flash-0731": (_PRESERVED, (_THINK,)),
}


def _generated(t: ChatTemplate, hist: list[Message], content: str) -> str:
    """What a model trained on ``t`` writes after the generation prompt for a reply with ``content``."""
    prompt = t.render(hist, add_generation_prompt=True)
    final = t.render([*hist, Message("assistant", content + _S_END)], add_generation_prompt=False)
    if final.startswith(prompt) and _S_END in final:
        text = final[len(prompt):final.index(_S_END)]
        # A template that has no place for reasoning leaves it out: the model writes it all the same.
        words = re.findall(r"(?:REASON|ANSWER)\d|</think>", content)
        if all(w in text for w in words):
            return text
    return content


def converse(t: ChatTemplate, *, system: bool, think: bool, turns: int = 3) -> tuple[str, str]:
    """(the context chatcli builds, the template's full rendering of the same conversation)."""
    persona = [Message("system", "SYSPROMPT")] if system else []
    hist = list(persona)
    ctx = t.prefix(persona)
    for i in range(1, turns + 1):
        ctx += t.user_turn(hist, f"QUESTION{i}")
        hist.append(Message("user", f"QUESTION{i}"))
        if t.opens_reasoning():
            content = (f"\nREASON{i}\n" if think else "\n") + f"</think>\n\nANSWER{i}"
        else:
            content = (f"<think>\nREASON{i}\n</think>\n\n" if think else "") + f"ANSWER{i}"
        reply = _generated(t, hist, content)
        hist.append(Message("assistant", reply))
        ctx += reply + t.closing(hist)
    return ctx, t.render(hist, add_generation_prompt=False)


@functools.cache
def _template(name: str) -> ChatTemplate:
    assert TEMPLATE_DIR is not None
    return ChatTemplate((TEMPLATE_DIR / f"{name}.jinja").read_text(), bos_token="<s>", eos_token="</s>")


def test_the_templates_are_there() -> None:
    if TEMPLATE_DIR is None:
        pytest.skip("llama.cpp's models/templates not found (sdist or built llama-server)")
    assert len(NAMES) == 70
    assert set(DIFFERENCES) <= set(NAMES), set(DIFFERENCES) - set(NAMES)


@pytest.mark.parametrize("think", [False, True], ids=["plain", "reasoning"])
@pytest.mark.parametrize("system", [False, True], ids=["no-system", "system"])
@pytest.mark.parametrize("name", NAMES)
def test_incremental_context(name: str, system: bool, think: bool) -> None:
    t = _template(name)
    ctx, full = converse(t, system=system, think=think)
    words = [f"QUESTION{i}" for i in (1, 2, 3)] + [f"ANSWER{i}" for i in (1, 2, 3)]
    words += ["SYSPROMPT"] if system else []
    words += [f"REASON{i}" for i in (1, 2, 3)] if think else []
    for w in words:
        assert ctx.count(w) == 1, f"{w} appears {ctx.count(w)} times in the context:\n{ctx!r}"
    if name not in DIFFERENCES:
        assert ctx == full
        return
    _reason, fragments = DIFFERENCES[name]

    def without(text: str) -> str:
        for f in fragments:
            text = re.sub(f, "", text, flags=re.S)
        return text

    assert without(ctx) == without(full), f"\ncontext {ctx!r}\nfull    {full!r}"


def test_a_template_refusing_a_system_role_gets_the_persona_in_the_first_user_message() -> None:
    if TEMPLATE_DIR is None:
        pytest.skip("llama.cpp's models/templates not found")
    from chatcli.session import template_notices

    t = _template("google-gemma-2-2b-it")
    assert t.folds_system
    ctx, _ = converse(t, system=True, think=False)
    assert "<start_of_turn>user\nSYSPROMPT\n\nQUESTION1<end_of_turn>" in ctx and ctx.count("SYSPROMPT") == 1
    assert any("refuses a system role" in n for n in template_notices(t, "the model"))
    assert not _template("Qwen3.5-4B").folds_system  # it refuses a conversation without a user message only


def test_qwen35_persona_prefix_needs_no_user_message_of_its_own() -> None:
    """Qwen3.5 raises "No user query found" on a persona alone: the prefix is cut from a rendering that has
    one, and the first turn continues it exactly."""
    if TEMPLATE_DIR is None:
        pytest.skip("llama.cpp's models/templates not found")
    t = _template("Qwen3.5-4B")
    persona = [Message("system", "S"), Message("assistant", "Hello!")]
    head = t.prefix(persona)
    assert head.endswith("Hello!<|im_end|>\n") and "user" not in head
    full = t.render([*persona, Message("user", "Q")], add_generation_prompt=True)
    assert head + t.user_turn(persona, "Q") == full


@pytest.mark.parametrize("name", NAMES)
def test_a_persona_with_a_greeting(name: str) -> None:
    """REPL personas end with a greeting (an assistant message before any user one). Templates that insist on
    alternation (Mistral, Gemma 2) refuse it: the model then does not see it, and every other one sees it once."""
    t = _template(name)
    persona = [Message("system", "SYSPROMPT"), Message("assistant", "GREETING")]
    hist = list(persona)
    ctx = t.prefix(persona)
    for i in (1, 2):
        ctx += t.user_turn(hist, f"QUESTION{i}")
        hist += [Message("user", f"QUESTION{i}"), Message("assistant", f"ANSWER{i}")]
        ctx += f"ANSWER{i}" + t.closing(hist)
    assert ctx.count("GREETING") == (0 if t.drops_greeting else 1)
    for w in ("SYSPROMPT", "QUESTION1", "ANSWER1", "QUESTION2", "ANSWER2"):
        assert ctx.count(w) == 1, (w, ctx)
    assert t.drops_greeting == (name in {"Mistral-Small-3.2-24B-Instruct-2506", "google-gemma-2-2b-it",
                                         "mistralai-Ministral-3-14B-Reasoning-2512",
                                         "mistralai-Mistral-Nemo-Instruct-2407"})
