"""Key bindings of the chat prompt: one factory, one docstring per binding."""

from __future__ import annotations

import time
from collections.abc import Callable

from prompt_toolkit.filters import Condition
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent

# A second Ctrl-C within this many seconds at an empty prompt leaves the REPL.
DOUBLE_CTRL_C = 1.0


def chat_key_bindings(hint: Callable[[str], None] | None = None) -> KeyBindings:
    """The chat prompt's bindings; ``hint`` shows a short message in the toolbar ("" clears it)."""
    from prompt_toolkit.application.current import get_app

    kb = KeyBindings()
    last_ctrl_c = [0.0]
    show = hint or (lambda text: None)

    @Condition
    def empty() -> bool:
        return not get_app().current_buffer.text

    @kb.add("enter")
    def _send(event: KeyPressEvent) -> None:
        """Enter sends the message. With a completion selected in the menu it takes it; a command that
        needs an argument then waits for it, anything else is sent at once."""
        from chatcli.repl.commands import REGISTRY

        buf = event.current_buffer
        state = buf.complete_state
        if state and state.current_completion:
            buf.apply_completion(state.current_completion)
            text = buf.text
            cmd = REGISTRY.lookup(text[1:].lower()) if text.startswith("/") and " " not in text else None
            if cmd is not None and cmd.args and not cmd.args.startswith("["):
                buf.insert_text(" ")  # e.g. "/persona " — its completions show next
                buf.start_completion(select_first=False)
                return
        buf.validate_and_handle()

    @kb.add("escape", "enter")
    def _newline(event: KeyPressEvent) -> None:
        """Alt-Enter / Esc Enter inserts a newline: multi-line messages."""
        event.current_buffer.insert_text("\n")

    @kb.add("c-c")
    def _clear(event: KeyPressEvent) -> None:
        """Ctrl-C clears the line; pressed again within a second, it exits (like Ctrl-D)."""
        buf = event.current_buffer
        now = time.monotonic()
        if not buf.text and now - last_ctrl_c[0] < DOUBLE_CTRL_C:
            event.app.exit(exception=EOFError())
            return
        last_ctrl_c[0] = now
        buf.reset()
        show("Ctrl-C again to exit")

        def expire() -> None:
            show("")
            event.app.invalidate()

        try:
            event.app.loop.call_later(DOUBLE_CTRL_C, expire)  # type: ignore[union-attr]
        except (AttributeError, RuntimeError):
            pass

    @kb.add("escape", "left", filter=empty)
    def _prev_alt(event: KeyPressEvent) -> None:
        """Alt-Left (on an empty line) shows the previous alternative of the last reply."""
        event.app.exit(result="/alt prev")

    @kb.add("escape", "right", filter=empty)
    def _next_alt(event: KeyPressEvent) -> None:
        """Alt-Right (on an empty line) shows the next alternative of the last reply."""
        event.app.exit(result="/alt next")

    return kb
