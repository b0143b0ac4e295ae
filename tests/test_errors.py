"""chatcli.errors: one family, and the kind alone decides the exit code and the HTTP status."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import chatcli
from chatcli.cli.errors import CliError, user_errors
from chatcli.config.personas import PersonaError
from chatcli.config.settings import SettingsError
from chatcli.core.backend import BackendError, ContextFullError
from chatcli.core.events import ConversationError, MessageTooLongError
from chatcli.core.files.migrations import FormatError
from chatcli.core.files.store import LockedError, StoreError
from chatcli.core.template import TemplateError
from chatcli.errors import EXIT_CODES, HTTP_STATUSES, ChatcliError, DoesNotFitError
from chatcli.models.resolve import ModelError
from chatcli.units import SizeError

pytestmark = pytest.mark.fast

# Exceptions that are not errors: control flow (leaving the REPL, a stopped read) and the server's wire form of
# an error (what ``server.errors.from_error`` makes of a ChatcliError).
NOT_ERRORS = {"chatcli.repl.commands.ReplExit", "chatcli.repl.loop.ReadingStopped", "chatcli.server.errors.APIError",
              "chatcli.server.service.OpenCancelled"}  # control flow: a client went away mid-restore


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(chatcli.__path__, "chatcli."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                found[f"{info.name}.{name}"] = obj
    return found


def test_every_chatcli_exception_is_a_chatcli_error() -> None:
    classes = _exception_classes()
    assert "chatcli.core.files.store.LockedError" in classes  # the walk really saw the package
    strays = sorted(n for n, c in classes.items() if n not in NOT_ERRORS and not issubclass(c, ChatcliError))
    assert strays == []
    assert NOT_ERRORS <= set(classes)  # the exemptions name classes that still exist


@pytest.mark.parametrize(("exc", "code"), [
    (StoreError("no conversation 'zz'"), 2), (ModelError("no model"), 2), (SettingsError("bad"), 2),
    (PersonaError("bad toml"), 2), (SizeError("12 parsecs"), 2), (CliError("unknown format", 2), 2),
    (LockedError("open in pid 1"), 1), (ConversationError("nothing to undo"), 1), (TemplateError("t"), 1),
    (BackendError("decode failed"), 1), (ContextFullError("full"), 1), (MessageTooLongError("too long"), 1),
    (FormatError("newer"), 1), (CliError("editor failed"), 1),
])
def test_the_cli_exits_with_the_code_of_the_kind(exc: ChatcliError, code: int, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done, user_errors():
        raise exc
    assert done.value.code == code == exc.exit_code
    assert capsys.readouterr().err == f"error: {exc}\n"  # one line, no traceback


def test_kinds_map_to_codes_and_statuses() -> None:
    assert set(EXIT_CODES) == set(HTTP_STATUSES)
    assert StoreError("x").http_status == 404 and LockedError("x").http_status == 409
    assert BackendError("x").http_status == 500 and ConversationError("x").http_status == 400
    assert ChatcliError("x", kind="usage").exit_code == 2  # one raise may override its class's kind


def test_a_message_too_long_is_a_refusal_not_an_engine_failure() -> None:
    assert issubclass(MessageTooLongError, ConversationError) and issubclass(MessageTooLongError, DoesNotFitError)
    assert not issubclass(MessageTooLongError, BackendError)
    assert issubclass(ContextFullError, BackendError) and issubclass(ContextFullError, DoesNotFitError)
    assert ContextFullError("x").kind == MessageTooLongError("x").kind == "refused"


def test_the_server_answers_each_kind_with_its_status() -> None:
    pytest.importorskip("starlette")
    from chatcli.server.errors import from_error
    from chatcli.server.history import HistoryError

    cases = [
        (LockedError("busy"), 409, "conversation_busy", None),
        (StoreError("no conversation 'zz'"), 404, "not_found", "conversation"),
        (MessageTooLongError("too long"), 400, "context_length_exceeded", "messages"),
        (ContextFullError("full"), 400, "context_length_exceeded", "messages"),
        (HistoryError("bad roles", "messages[2].role"), 400, "invalid_request", "messages[2].role"),
        (ConversationError("nothing to regenerate"), 400, "invalid_request", None),
        (BackendError("decode failed"), 500, None, None),
    ]
    for exc, status, code, param in cases:
        err = from_error(exc)
        assert (err.status, err.body()["error"]["code"], err.param) == (status, code, param), exc
        assert err.message == str(exc)
