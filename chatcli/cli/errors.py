"""How the command line fails: one line on stderr and an exit code, never a traceback.

Without typer, so that the fast path of `chatcli ls` (chatcli.cli.entry) fails the same way as every command.
Failing raises SystemExit: typer lets it through, and its test runner records the code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

EXIT_USAGE = 2


class CliError(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def err_console() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 1) -> None:
    if _color():
        from rich.markup import escape

        # The message quotes user input (ids, paths): it is text, never markup.
        err_console().print(f"[bold red]error:[/] {escape(message)}", markup=True)
    else:
        print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _color() -> bool:
    return sys.stderr.isatty() and not os.environ.get("NO_COLOR")


@contextmanager
def user_errors() -> Iterator[None]:
    """Core errors become one line and an exit code, never a traceback."""
    try:
        yield
    except CliError as exc:
        fail(str(exc), exc.code)
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except Exception as exc:
        code = _user_error_code(exc)  # first: a core error may also be an OSError
        if code is not None:
            fail(first_line(exc), code)
        if isinstance(exc, BrokenPipeError):
            # The reader left (`chatcli ls | head -1`): nothing to report, and nothing more to write.
            _drop_stdout()
            raise SystemExit(1) from None
        if isinstance(exc, OSError):
            fail(f"{exc.strerror or exc}" + (f": {exc.filename}" if getattr(exc, "filename", None) else ""), 1)
        raise


# The core's errors that are the user's to fix (exit 2) or that say what went wrong (exit 1), by module.
# They are looked up when one is raised, and only in modules already imported (an exception's class is
# imported by whoever raised it): `chatcli ls` does not import the model and template modules for this.
_USAGE_ERRORS = (("chatcli.models.resolve", "ModelError"), ("chatcli.models.gguf", "GGUFError"),
                 ("chatcli.config.settings", "SettingsError"), ("chatcli.config.personas", "PersonaError"),
                 ("chatcli.core.files.store", "StoreError"))
_RUN_ERRORS = (("chatcli.core.events", "ConversationError"), ("chatcli.core.template", "TemplateError"),
               ("chatcli.core.backend", "BackendError"), ("chatcli.core.files.migrations", "FormatError"))


def _loaded(names: tuple[tuple[str, str], ...]) -> tuple[type[BaseException], ...]:
    return tuple(getattr(sys.modules[m], c) for m, c in names if m in sys.modules)


def _user_error_code(exc: Exception) -> int | None:
    """The exit code for a core error (a locked conversation is not a usage error), None for anything else."""
    if isinstance(exc, _loaded(_USAGE_ERRORS)):
        locked = _loaded((("chatcli.core.files.store", "LockedError"),))
        return 1 if locked and isinstance(exc, locked) else EXIT_USAGE
    if isinstance(exc, _loaded(_RUN_ERRORS)):
        return 1
    return None


def _drop_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise a second BrokenPipeError."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (tests capture stdout in memory)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def first_line(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__).splitlines()[0]
