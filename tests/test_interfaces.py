"""Front ends see a conversation through one public interface (issue #12 item 4).

``ChatConversation`` lists what the REPL and slash commands may use; the real ``Conversation`` and the UI
tests' fake both provide every name of it (mypy checks the real one's types: cli/app.py passes it as one).
"""

from __future__ import annotations

import inspect

from chatcli.core.conversation import Conversation
from chatcli.repl import commands
from chatcli.repl.context import ChatConversation, CommandContext
from tests.test_repl import FakeConversation


def _members(proto: type) -> set[str]:
    return {n for n in vars(proto) if not n.startswith("_")}


def test_the_real_conversation_and_the_fake_implement_the_public_interface() -> None:
    names = _members(ChatConversation)
    assert {"send", "regen", "edit", "undo", "redo", "switch_alt", "alternatives", "context", "n_exchanges"} <= names
    fake = FakeConversation()
    for name in sorted(names):
        # An attribute set in __init__ is declared (annotated) on the class or its views.
        assert any(name in vars(k) or name in getattr(k, "__annotations__", {}) for k in Conversation.__mro__), \
            f"Conversation lacks {name}"
        assert hasattr(fake, name), f"the test fake lacks {name}"


def test_slash_commands_get_the_command_context_not_the_repl() -> None:
    for cmd in commands.REGISTRY.commands.values():
        params = list(inspect.signature(cmd.handler).parameters.values())
        assert params[0].annotation in ("CommandContext", CommandContext), (cmd.name, params[0].annotation)
    assert "Repl" not in inspect.getsource(commands).replace("ReplExit", "")
