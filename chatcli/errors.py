"""The one error family: every chatcli error is a ``ChatcliError`` whose kind says what the user can do about it.

Front ends map the kind in one place each: the command line to an exit code (``cli/errors.py``), the REPL to
one line and the loop goes on, the server to an HTTP status and an OpenAI error object (``server/errors.py``).
A leaf: imports nothing of chatcli, so the fast path of ``chatcli ls`` and every core module may import it.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["usage", "refused", "conflict", "not_found", "engine", "io"]
"""What failed, from the user's side:

- ``usage``: the input is wrong (a flag, a setting, a persona file, a model path, a command's arguments);
- ``refused``: a valid request that the conversation refuses as it stands (nothing to undo, too long): nothing changed;
- ``conflict``: someone else holds it (a conversation open in another process) or it changed meanwhile: retry;
- ``not_found``: no such conversation (or an id that cannot be one);
- ``engine``: the inference engine failed (model load, decode, restore, a lost connection);
- ``io``: data on disk cannot be read or written as it is (a format from a newer chatcli, a damaged file).
"""

# The exit codes keep those chatcli always had: 2 is "fix what you typed" (as for a bad flag), 1 the rest.
EXIT_CODES: dict[Kind, int] = {"usage": 2, "not_found": 2, "refused": 1, "conflict": 1, "engine": 1, "io": 1}
HTTP_STATUSES: dict[Kind, int] = {"usage": 400, "refused": 400, "conflict": 409, "not_found": 404,
                                  "engine": 500, "io": 500}


class ChatcliError(Exception):
    """Base of every chatcli error. ``kind`` is a class default that one raise may override."""

    kind: Kind = "engine"

    def __init__(self, *args: object, kind: Kind | None = None) -> None:
        super().__init__(*args)
        if kind is not None:
            self.kind = kind

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.kind]

    @property
    def http_status(self) -> int:
        return HTTP_STATUSES[self.kind]


class DoesNotFitError(ChatcliError):
    """What was asked does not fit the context (a message, a history, saved cells): refused, nothing changed.

    The engine's ``ContextFullError`` and the conversation's ``MessageTooLongError`` share it, so a front end
    can say "too long" (HTTP: ``context_length_exceeded``) without knowing which of them refused.
    """

    kind: Kind = "refused"
