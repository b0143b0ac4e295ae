"""Key bindings of the chat prompt: one factory, one docstring per binding."""

from __future__ import annotations

import time

from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent

# A second Ctrl-C within this many seconds at an empty prompt leaves the REPL.
DOUBLE_CTRL_C = 1.0


def chat_key_bindings() -> KeyBindings:
    kb = KeyBindings()
    last_ctrl_c = [0.0]

    @kb.add("enter")
    def _send(event: KeyPressEvent) -> None:
        """Enter sends the message (completion menu open: accept the completion instead)."""
        buf = event.current_buffer
        if buf.complete_state and buf.complete_state.current_completion:
            buf.apply_completion(buf.complete_state.current_completion)
            return
        buf.validate_and_handle()

    @kb.add("escape", "enter")
    def _newline(event: KeyPressEvent) -> None:
        """Alt-Enter / Esc Enter inserts a newline: multi-line messages."""
        event.current_buffer.insert_text("\n")

    @kb.add("c-c")
    def _clear(event: KeyPressEvent) -> None:
        """Ctrl-C clears the line; twice quickly on an empty line exits."""
        buf = event.current_buffer
        now = time.monotonic()
        if not buf.text and now - last_ctrl_c[0] < DOUBLE_CTRL_C:
            event.app.exit(exception=EOFError())
            return
        last_ctrl_c[0] = now
        buf.reset()

    @kb.add("escape", "left")
    def _prev_alt(event: KeyPressEvent) -> None:
        """Alt-Left shows the previous alternative of the last reply."""
        event.app.exit(result="/alt prev")

    @kb.add("escape", "right")
    def _next_alt(event: KeyPressEvent) -> None:
        """Alt-Right shows the next alternative of the last reply."""
        event.app.exit(result="/alt next")

    return kb
