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

from chatcli.errors import EXIT_CODES, ChatcliError

if TYPE_CHECKING:
    from rich.console import Console

EXIT_USAGE = EXIT_CODES["usage"]


class CliError(ChatcliError):
    """A command's own refusal (a missing extra, an unknown format), with the exit code it gives."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message, kind="usage" if code == EXIT_USAGE else "refused")
        self.code = code

    @property
    def exit_code(self) -> int:
        return self.code


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
    except ChatcliError as exc:  # before OSError: a chatcli error may also be one
        fail(first_line(exc), exc.exit_code)
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except Exception as exc:
        if isinstance(exc, BrokenPipeError):
            # The reader left (`chatcli ls | head -1`): nothing to report, and nothing more to write.
            _drop_stdout()
            raise SystemExit(1) from None
        if isinstance(exc, OSError):
            fail(f"{exc.strerror or exc}" + (f": {exc.filename}" if getattr(exc, "filename", None) else ""), 1)
        raise


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
