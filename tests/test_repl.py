"""The REPL driven through prompt_toolkit's pipe input, its output captured from a rich Console.

UI-only behaviour (keys, completion, toolbar, commands, rendering) runs against a fake conversation
whose replies are scripted; what the REPL does to a real conversation runs on the real model, and the
piped `chatcli talk` runs end to end through Typer's CliRunner.
"""

from __future__ import annotations

import io
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any, Generator, Iterator

import pytest
from prompt_toolkit.document import Document
from prompt_toolkit.formatted_text import to_plain_text
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.core.events import (
    ContextUsage,
    ConversationError,
    Notice,
    Progress,
    ReplyEnd,
    ReplyStart,
    ReplyText,
    SessionStats,
    TurnStats,
)
from chatcli.core.export import to_markdown
from chatcli.core.opening import Opening
from chatcli.core.template import Message
from chatcli.core.transcript import ActiveMessage, Replay
from chatcli.core.views import Alternative
from chatcli.repl.commands import REGISTRY, CommandError
from chatcli.repl.loop import Repl, open_events
from chatcli.repl.render import Renderer, stats_line
from chatcli.repl.terminal import LineIO, SlashCompleter, TerminalIO, copy_to_clipboard
from chatcli.repl.toolbar import context_bar
from chatcli.units import counted

CODE_REPLY = "Here you are:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nThat is **all**."


# -- a fake conversation: scripted replies, real Replay bookkeeping -----------------------------------


class FakeConversation:
    """Just enough of a Conversation's public interface for the UI: replies come from a script, one piece
    per word. The bookkeeping (messages, alternatives) uses the real ``Replay``."""

    def __init__(self, cid: str = "abc123", persona: str = "alice", replies: list[str] | None = None,
                 on_piece: Any = None) -> None:
        self.id = cid
        self.persona_name = persona
        self.title = ""
        self.n_ctx = 2048
        self.tokens: list[int] = list(range(40))  # the persona prefix
        self.cancelled = False
        self._r = Replay(prefix_tokens=list(range(40)), persona=persona,
                         persona_messages=[Message("system", f"You are {persona}."), Message("assistant", "Hello!")])
        self.greeting: str | None = "Hello!"
        self.system_prompt: str | None = f"You are {persona}."
        self.replies = list(replies or ["Hello there."])
        self.on_piece = on_piece  # called after each piece (tests send a SIGINT from it)
        self.last_stats: TurnStats | None = None
        self.session_stats = SessionStats()
        self.save_error = ""
        self.pending_notices: list[Notice] = []  # what take_notices() hands the REPL (e.g. the state budget)
        self.closed = False
        self.sent: list[str] = []
        self.rebuild = 0  # Progress steps each rollback's *_steps form yields (a memory that cannot be cut back)

    def take_notices(self) -> list[Notice]:
        out, self.pending_notices = self.pending_notices, []
        return out

    # -- views --
    @property
    def messages(self) -> list[ActiveMessage]:
        return list(self._r.active)

    def user_messages(self) -> list[ActiveMessage]:
        return [m for m in self._r.active if m.role == "user"]

    @property
    def n_turns(self) -> int:
        return len(self.user_messages())

    @property
    def n_exchanges(self) -> int:
        return self.n_turns  # nothing ever leaves a fake's context

    @property
    def pending_user(self) -> bool:
        return bool(self._r.active) and self._r.active[-1].role == "user"

    @property
    def context(self) -> ContextUsage:
        return ContextUsage(len(self.tokens), self.n_ctx)

    def holds_context(self) -> bool:
        return True

    def state_bytes(self) -> int:
        return 3 * 1024 * 1024

    def alternatives(self) -> list[Alternative]:
        last = self._r.active[-1] if self._r.active else None
        if last is None or last.role != "assistant":
            return []
        alts = sorted(self._r.alternatives(last.turn), key=lambda e: e["alt"])
        return [Alternative(i, e["mid"], e["text"], len(e["tokens"]), e["mid"] == last.mid) for i, e in enumerate(alts)]

    def to_markdown(self) -> str:
        return to_markdown({"id": self.id, "persona": self.persona_name}, self._r)

    # -- operations --
    def _add(self, role: str, text: str, turn: int, alt: int = 0) -> ActiveMessage:
        mid = self._r.next_mid
        self._r.next_mid += 1
        toks = list(range(1000, 1000 + max(1, len(text.split()))))
        msg = ActiveMessage(mid, role, text, toks, len(self.tokens), turn, alt)
        self._r.all[mid] = {"mid": mid, "role": role, "text": text, "tokens": toks, "turn": turn, "alt": alt}
        self._r.active.append(msg)
        self.tokens.extend(toks)
        return msg

    def _scripted_reply(self, turn: int, alt: int) -> Iterator[Any]:
        self.cancelled = False
        text = self.replies.pop(0) if self.replies else "Fine."
        stats = TurnStats()
        yield ReplyStart(turn, alt)
        shown = ""
        for word in re.findall(r"\S+\s*|\s+", text):
            if self.cancelled:
                stats.stop_reason = "cancelled"
                break
            shown += word
            yield ReplyText(word)
            if self.on_piece is not None:
                self.on_piece(self, shown)
        else:
            stats.stop_reason = "eog"
        msg = self._add("assistant", shown, turn, alt)
        stats.n_generated = len(msg.tokens)
        stats.n_eval = len(msg.tokens) + 3
        stats.gen_seconds = 0.5
        stats.n_past, stats.n_ctx = len(self.tokens), self.n_ctx
        self.last_stats = stats
        self.session_stats.add(stats)
        yield ReplyEnd(msg, stats)

    def send(self, text: str, *, seed: int | None = None) -> Iterator[Any]:
        if not text.strip():
            raise ConversationError("empty message")
        self.sent.append(text)
        turn = self.n_turns
        self._add("user", text, turn)
        yield from self._scripted_reply(turn, alt=0)

    def regen(self, *, seed: int | None = None) -> Iterator[Any]:
        last = self._r.active[-1]
        if last.role != "assistant":
            raise ConversationError("nothing to regenerate yet")
        self._drop_to(last.p0)
        yield from self._scripted_reply(last.turn, alt=len(self._r.alternatives(last.turn)))

    def _drop_to(self, p0: int) -> None:
        self._r.active = [m for m in self._r.active if m.p0 < p0]
        del self.tokens[p0:]

    def undo(self, n: int = 1) -> TurnStats:
        users = self.user_messages()
        if len(users) < n:
            raise ConversationError(f"only {counted(len(users), 'exchange')} to undo")
        dropped = len(self.tokens) - users[-n].p0
        self._drop_to(users[-n].p0)
        return TurnStats(kept=len(self.tokens), dropped=dropped, reevaluated=0)

    def redo(self) -> TurnStats:
        raise ConversationError("nothing to redo")

    def _rebuilt(self, stats: TurnStats) -> Generator[Progress, None, TurnStats]:
        for i in range(1, self.rebuild + 1):
            yield Progress("rebuilding context from a saved point", 10 * i, 10 * self.rebuild, 0.1 * i)
        return stats

    # The real ones check before anything changes and change the context as they are iterated; here the
    # change is made at the call, which the UI cannot tell apart.
    def undo_steps(self, n: int = 1) -> Generator[Progress, None, TurnStats]:
        return self._rebuilt(self.undo(n))

    def redo_steps(self) -> Generator[Progress, None, TurnStats]:
        return self._rebuilt(self.redo())

    def switch_alt_steps(self, index: int) -> Generator[Progress, None, TurnStats]:
        return self._rebuilt(self.switch_alt(index))

    def switch_alt(self, index: int) -> TurnStats:
        alts = self.alternatives()
        if not 0 <= index < len(alts):
            raise ConversationError(f"no alternative {index + 1} (this turn has {len(alts)})")
        self._drop_to(self._r.active[-1].p0)
        e = self._r.all[alts[index].mid]
        msg = ActiveMessage(e["mid"], "assistant", e["text"], e["tokens"], len(self.tokens), e["turn"], e["alt"])
        self._r.active.append(msg)
        self.tokens.extend(e["tokens"])
        return TurnStats(kept=msg.p0, dropped=0, reevaluated=0, n_eval=0)

    def edit(self, n: int | None, text: str, *, seed: int | None = None) -> Iterator[Any]:
        users = self.user_messages()
        self._drop_to(users[(n or len(users)) - 1].p0)
        yield from self.send(text)

    def set_title(self, title: str) -> None:
        self.title = title

    def cancel(self) -> None:
        self.cancelled = True

    def close(self) -> None:
        self.closed = True


class FakeModel:
    class info:
        name = "Tiny Test Model"


class FakePersona:
    def __init__(self, description: str) -> None:
        self.description = description


class FakeSession:
    model = FakeModel()

    def __init__(self) -> None:
        self.created: list[FakeConversation] = []

    def personas(self) -> dict[str, FakePersona]:
        return {"alice": FakePersona("friendly"), "pirate": FakePersona("arr"), "coder": FakePersona("terse")}

    def new_conversation(self, name: str) -> Opening[Any]:
        def steps() -> Generator[Any, None, tuple[Any, None]]:
            if name not in self.personas():
                raise ConversationError(f"unknown persona {name!r}")
            yield Progress("evaluating persona prefix", 10, 10, 0.1)
            conv = FakeConversation(cid=f"new{len(self.created)}", persona=name)
            self.created.append(conv)
            return conv, None

        return Opening(steps())  # a FakeConversation stands for the real one


# -- helpers ---------------------------------------------------------------------------------------------


def rich_renderer(width: int = 100, **kw: Any) -> tuple[Renderer, io.StringIO]:
    out = io.StringIO()
    return Renderer(Console(file=out, width=width, height=30, highlight=False, color_system=None, **kw),
                    err=io.StringIO()), out


def drive(keys: str, conv: FakeConversation | None = None, *, session: Any = None, width: int = 100,
          plain: bool = False, terminal: bool = False) -> tuple[Repl, str, str]:
    """Run a REPL on a pipe fed with ``keys`` (end with Ctrl-D); returns it and its stdout/stderr text.
    ``terminal``: the console is a terminal's (live areas drawn, with their escape codes)."""
    conv = conv or FakeConversation()
    out, err = io.StringIO(), io.StringIO()
    renderer = Renderer(Console(file=out, width=width, height=30, highlight=False, color_system=None,
                                force_terminal=terminal or None), plain=plain, err=err)
    with create_pipe_input() as pipe:
        pipe.send_text(keys)
        # A test whose keys do not end the session would wait for input forever: end it after a while.
        fired = threading.Event()

        def stop() -> None:
            fired.set()
            pipe.send_text("\x03\x03\x03")

        watchdog = threading.Timer(60, stop)
        watchdog.start()
        try:
            repl = Repl(session or FakeSession(), conv, renderer,
                        lambda r: TerminalIO(r, input=pipe, output=DummyOutput()))
            assert repl.run() == 0
        finally:
            watchdog.cancel()
        assert not fired.is_set(), "the keys sent did not end the session"
    return repl, out.getvalue(), err.getvalue()


# -- commands, completion, toolbar ------------------------------------------------------------------------


def test_help_is_generated_from_the_registry_one_line_per_command() -> None:
    _, out, _ = drive("/help\r\x04")
    lines = out.splitlines()
    for cmd in REGISTRY.commands.values():
        hits = [ln for ln in lines if ln.startswith(cmd.usage + " ")]
        assert len(hits) == 1, (cmd.usage, out)
        assert cmd.help in hits[0]  # the description sits on the same line
        for alias in cmd.aliases:
            assert f"/{alias}" in hits[0]
    assert "/copy [code]" in out  # an argument in brackets is text, not rich markup


def test_help_in_a_narrow_terminal_keeps_each_command_on_its_own_row() -> None:
    _, out, _ = drive("/help\r\x04", width=40)
    starts = [ln.split()[0] for ln in out.splitlines() if re.match(r"/[a-z]", ln)]
    assert sorted(set(starts)) == sorted(c.usage.split()[0] for c in REGISTRY.commands.values())
    assert all(len(ln) <= 40 for ln in out.splitlines())


def test_commands_resolve_by_unique_prefix_and_report_ambiguity() -> None:
    assert REGISTRY.resolve("he").name == "help"
    assert REGISTRY.resolve("Q").name == "exit"
    with pytest.raises(CommandError, match="could be"):
        REGISTRY.resolve("re")  # /redo, /regen
    with pytest.raises(CommandError, match="unknown command /nope"):
        REGISTRY.resolve("nope")


def test_completion_of_commands_and_their_arguments() -> None:
    conv = FakeConversation(replies=["one", "two"])
    repl, _, _ = drive("hi\r/regen\r\x04", conv)
    comp = SlashCompleter(repl)

    def texts(s: str) -> list[str]:
        return [c.text for c in comp.get_completions(Document(s), None)]

    assert texts("/he") == ["/help"]
    assert set(texts("/re")) == {"/redo", "/regen"}
    assert texts("/persona p") == ["pirate"]
    assert set(texts("/persona ")) == {"alice", "coder", "pirate"}
    assert texts("/alt ")[:2] == ["1", "2"]  # the two alternatives of the last reply
    assert texts("/edit ") == ["1"]
    assert texts("hello /he") == [] and texts("//he") == []
    metas = {c.text: c.display_meta_text for c in comp.get_completions(Document("/persona "), None)}
    assert metas["pirate"] == "arr"


def test_toolbar_shows_persona_model_id_context_state_and_keys_and_fits_narrow_terminals() -> None:
    conv = FakeConversation(cid="zz9abc")
    repl = Repl(FakeSession(), conv, rich_renderer()[0], lambda r: LineIO(io.StringIO()))
    wide = to_plain_text(repl.toolbar(width=200))
    for needle in ("alice", "Tiny Test Model", "zz9abc", "ctx 40/2048", context_bar(40 / 2048), "state 3.0 MB", "/help"):
        assert needle in wide, (needle, wide)
    narrow = to_plain_text(repl.toolbar(width=36))
    assert len(narrow) <= 36 and "alice" in narrow and "ctx 40/2048" in narrow
    repl.set_hint("Ctrl-C again to exit")
    hinted = to_plain_text(repl.toolbar(width=60))
    assert "Ctrl-C again to exit" in hinted


def test_context_bar_fills_in_eighths() -> None:
    assert context_bar(0) == "░" * 10
    assert context_bar(1) == "█" * 10
    assert context_bar(0.05) == "▌" + "░" * 9
    assert all(len(context_bar(f / 100)) == 10 for f in range(101))


# -- conversation commands --------------------------------------------------------------------------------


def test_message_streams_and_renders_markdown_then_stats() -> None:
    conv = FakeConversation(replies=[CODE_REPLY])
    _, out, _ = drive("Show me code\r\x04", conv)
    assert conv.sent == ["Show me code"]
    assert "def add(a, b):" in out and "return a + b" in out
    assert "```" not in out and "**" not in out  # rendered, not raw Markdown
    assert "That is all." in out
    assert stats_line(conv.last_stats) in out
    assert "conversation abc123 saved · resume with: chatcli resume abc123" in out


def test_regen_undo_alt_and_stats() -> None:
    conv = FakeConversation(replies=["First answer.", "Second answer."])
    _, out, _ = drive("hi\r/regen\r/alt\r/alt 1\r/stats\r/undo\r\x04", conv)
    assert out.index("First answer.") < out.index("Second answer.")
    alt_table = out[out.index("/alt\n") if "/alt\n" in out else 0:]
    assert "1" in alt_table and "2 *" in out  # the listing marks the active alternative
    assert "alternative 1/2" in out
    assert "last turn" in out and "session" in out and "context" in out
    assert "undid 1 exchange:" in out
    assert conv.messages == []  # undone


LIVE = "\x1b[?25l"  # a live area starts (rich hides the cursor)
ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.mark.parametrize("rebuild", [0, 3])
def test_undo_and_alt_show_the_rebuild_bar_only_when_the_rollback_evaluates(rebuild: int) -> None:
    conv = FakeConversation(replies=["First.", "Second."])
    conv.rebuild = rebuild
    _, out, _ = drive("hi\r/regen\r/alt 1\r/undo\r\x04", conv, terminal=True)
    alt_at, undo_at = out.index("alternative 1/2"), out.index("undid 1 exchange:")
    # From the end of /regen's stats line to /alt's line; from the reply /alt shows again to /undo's line.
    alt = out[out.index("\n", out.rindex("tok evaluated", 0, alt_at)):alt_at]
    undo = out[out.index("First.", alt_at) + len("First."):undo_at]
    if rebuild:
        for part in (alt, undo):  # the bar /regen shows, each of its steps, drawn before the command's line
            assert part.count(LIVE) == 1
            assert all(f"{10 * i}/30 tok" in part for i in (1, 2, 3)), part
            assert "rebuilding context from a saved point" in part
    else:  # a plain truncation: nothing drawn at all (the live area opened and closed, empty)
        assert "rebuilding" not in out and ESCAPES.sub("", alt + undo).split() == []
    assert "re-evaluated 0" in out[undo_at:] and conv.messages == []


def test_the_rebuild_bar_is_not_drawn_in_plain_mode() -> None:
    conv = FakeConversation(replies=["First."])
    conv.rebuild = 2
    _, out, err = drive("hi\r/undo\r\x04", conv, plain=True)
    assert "undid 1 exchange:" in err and "rebuilding" not in out + err and conv.messages == []


def test_alt_keys_only_act_on_an_empty_line() -> None:
    conv = FakeConversation(replies=["First.", "Second."])
    # Alt-Left (Esc + Left) on an empty line runs "/alt prev"; with text typed it must not eat the text.
    _, out, _ = drive("hi\r/regen\r\x1b[1;3D\x04", conv)
    assert "alternative 1/2" in out and conv.messages[-1].text == "First."
    conv2 = FakeConversation(replies=["First."])
    drive("hi\rabc\x1b[1;3D\r\x04", conv2)
    assert conv2.sent == ["hi", "abc"]


def test_ctrl_c_at_the_prompt_clears_the_line_and_twice_exits() -> None:
    conv = FakeConversation()
    _, _out, _ = drive("typo\x03hello\r\x03\x03", conv)  # no Ctrl-D: the double Ctrl-C must end the loop
    assert conv.sent == ["hello"]
    assert conv.closed


def test_ctrl_d_exits_and_the_conversation_is_closed() -> None:
    conv = FakeConversation()
    _, out, _ = drive("\x04", conv)
    assert conv.closed and conv.sent == []
    assert "chatcli resume abc123" in out


def test_ctrl_c_during_a_reply_stops_it_keeps_the_text_and_the_loop_goes_on() -> None:
    def interrupt(conv: FakeConversation, shown: str) -> None:
        if shown.count(" ") == 3 and not conv.cancelled:
            os.kill(os.getpid(), signal.SIGINT)  # what the terminal does on Ctrl-C

    story = "Once upon a time there was a dragon who loved long stories and never stopped telling them."
    conv = FakeConversation(replies=[story, "Still here."], on_piece=interrupt)
    before = signal.getsignal(signal.SIGINT)
    _, out, _ = drive("tell a story\rhello again\r\x04", conv)
    first = conv.messages[1]
    assert first.text.startswith("Once upon a") and len(first.text) < len(story)
    assert "stopped by Ctrl-C: partial reply kept" in out
    assert conv.sent == ["tell a story", "hello again"] and "Still here." in out
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_edit_offers_the_old_message_for_editing_and_continues_from_it() -> None:
    conv = FakeConversation(replies=["A.", "B.", "C."])
    # /edit 1 puts "first" in the prompt; Ctrl-U clears it and the new text replaces the message.
    drive("first\rsecond\r/edit 1\r\x15changed\r\x04", conv)
    assert [m.text for m in conv.messages] == ["changed", "C."]
    conv = FakeConversation(replies=["A."])
    _, out, _ = drive("first\r/edit\r\x03\r\x04", conv)  # cleared with Ctrl-C and sent empty: nothing changes
    assert "edit cancelled" in out and [m.text for m in conv.messages] == ["first", "A."]


def test_ctrl_c_during_an_operation_that_cannot_stop_lets_it_finish() -> None:
    class SlowSession(FakeSession):
        def new_conversation(self, name: str) -> Opening[Any]:
            inner = super().new_conversation(name)

            def interrupted() -> Generator[Any, None, tuple[Any, None]]:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the persona prefix is evaluated
                yield from inner
                return inner.conversation, None

            return Opening(interrupted())

    session = SlowSession()
    repl, out, _ = drive("/persona pirate\rstill alive\r\x04", FakeConversation(), session=session)
    assert "Ctrl-C: that operation cannot stop halfway; it has finished" in out
    assert repl.conv is session.created[0] and repl.conv.sent == ["still alive"]


def test_an_error_in_the_middle_of_a_reply_keeps_what_was_shown() -> None:
    from chatcli.core.backend import BackendError

    def boom(conv: FakeConversation, shown: str) -> None:
        if shown.count(" ") == 2:
            raise BackendError("llama_decode failed (1): out of memory")

    conv = FakeConversation(replies=["one two three four five six"], on_piece=boom)
    _, out, _ = drive("go\r\x04", conv)
    assert "error: llama_decode failed (1): out of memory" in out
    assert out.index("one two") < out.index("error: llama_decode")  # the words shown stay on screen


def test_errors_are_one_line_and_the_message_comes_back_to_the_prompt() -> None:
    class Failing(FakeConversation):
        def send(self, text: str, *, seed: int | None = None) -> Iterator[Any]:
            raise ConversationError("the last message has no reply yet: /regen to generate it\nsecond line")

    conv = Failing()
    _, out, _ = drive("keep me\r\r\x03\x04", conv)
    assert out.count("error: the last message has no reply yet") == 2  # the text was offered again and re-sent
    assert "second line" not in out
    conv = FakeConversation()
    # An unknown command comes back to the prompt: Home, "/" and Enter send it as a message.
    _, out, _ = drive("/etc/hosts?\r\x01/\r/undo 9\r/alt x\r\x04", conv)
    assert "error: unknown command /etc/hosts? (try /help" in out
    assert conv.sent == ["/etc/hosts?"]
    assert "error: only 1 exchange to undo" in out
    assert "error: alternative must be a number, not 'x'" in out


def test_system_copy_and_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    copied: list[str] = []
    monkeypatch.setattr(TerminalIO, "copy_to_clipboard", lambda self, text: copied.append(text) or "test")
    conv = FakeConversation(replies=[CODE_REPLY])
    target = tmp_path / "chat.md"
    _, out, _ = drive(f"code please\r/system\r/copy\r/copy code\r/save {target}\r\x04", conv)
    assert "You are alice." in out
    assert copied == [CODE_REPLY, "def add(a, b):\n    return a + b\n"]
    md = target.read_text()
    assert "code please" in md and "```python" in md and "> **system:** You are alice." in md
    assert f"saved 1 exchange to {target}" in out


def test_copy_falls_back_to_osc52_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Tty()
    assert copy_to_clipboard("héllo", term) == "OSC 52"
    assert term.getvalue() == "\x1b]52;c;aMOpbGxv\x07"
    with pytest.raises(CommandError, match="no clipboard"):
        copy_to_clipboard("x", io.StringIO())  # a pipe is no terminal: say so rather than write junk


def test_persona_switch_starts_a_new_conversation_and_closes_the_old_one() -> None:
    session = FakeSession()
    conv = FakeConversation()
    repl, out, _ = drive("/persona pir\r/persona nobody\r\x04", conv, session=session)
    assert conv.closed and [c.persona_name for c in session.created] == ["pirate"]
    assert repl.conv is session.created[0] and repl.conv.closed  # closed when the REPL ended
    assert "conversation abc123 saved" in out and "new conversation new0 with persona pirate" in out
    assert "Hello!" in out  # the new persona's greeting
    assert "error: unknown persona 'nobody'" in out


def test_plain_mode_writes_replies_to_stdout_and_everything_else_to_stderr() -> None:
    conv = FakeConversation(replies=[CODE_REPLY])
    _, out, err = drive("hi\r/stats\r/help\r\x04", conv, plain=True)
    assert out == CODE_REPLY + "\n"  # undecorated Markdown source, nothing else
    assert "tok evaluated" in err and "last turn" in err and "/regen" in err


def test_piped_lines_are_messages_and_commands() -> None:
    conv = FakeConversation(replies=["A.", "B."])
    out, err = io.StringIO(), io.StringIO()
    renderer = Renderer(Console(file=out, highlight=False, color_system=None), plain=True, err=err)
    repl = Repl(FakeSession(), conv, renderer, lambda r: LineIO(io.StringIO("one\n\n//slash\n/title T\n")))
    repl.run()
    assert conv.sent == ["one", "/slash"]
    assert out.getvalue() == "A.\nB.\n"
    assert "title set: T" in err.getvalue()


# -- the renderer ----------------------------------------------------------------------------------------


def test_renderer_streams_progress_notices_and_a_reply_without_losing_text() -> None:
    renderer, out = rich_renderer(width=60)
    long = "\n\n".join(f"Paragraph {i}: " + "word " * 30 for i in range(12))  # far taller than the screen
    msg = ActiveMessage(1, "assistant", long, [1], 0, 0)

    def events() -> Iterator[Any]:
        yield Notice("note before")
        yield Progress("reading", 5, 10, 0.1)
        yield Progress("reading", 10, 10, 0.2)
        yield ReplyStart(0, 0)
        for i in range(0, len(long), 7):
            yield ReplyText(long[i:i + 7])
        yield ReplyEnd(msg, TurnStats())

    end = renderer.stream(events())
    assert end is not None and end.message is msg
    text = out.getvalue()
    assert text.startswith("note before\n")
    for i in range(12):
        assert text.count(f"Paragraph {i}:") == 1, i  # each exactly once: nothing lost or repeated
    assert [ln.rstrip() for ln in text.splitlines()[1:]] == [
        "".join(s.text for s in line) for line in renderer.markdown_lines(long)]


def test_live_display_on_a_real_terminal_screen_shows_the_final_markdown() -> None:
    pyte = pytest.importorskip("pyte")
    out = io.StringIO()
    console = Console(file=out, width=50, height=12, force_terminal=True, color_system="standard", highlight=False)
    renderer = Renderer(console)
    long = "# Title\n\n" + "\n".join(f"- item {i}" for i in range(30)) + "\n\n```python\nx = 1\n```\n\nThe end."
    msg = ActiveMessage(1, "assistant", long, [1], 0, 0)

    def events() -> Iterator[Any]:
        yield ReplyStart(0, 0)
        for i in range(0, len(long), 3):
            yield ReplyText(long[i:i + 3])
        yield ReplyEnd(msg, TurnStats())

    renderer.stream(events())
    screen = pyte.HistoryScreen(50, 12, history=500)
    pyte.Stream(screen).feed(out.getvalue().replace("\n", "\r\n"))
    rows = ["".join(line[x].data for x in range(50)).rstrip() for line in screen.history.top]
    rows += [ln.rstrip() for ln in screen.display]
    while rows and not rows[-1]:
        rows.pop()
    want = ["".join(s.text for s in line).rstrip() for line in renderer.markdown_lines(long)]
    assert rows == want


def test_a_fence_closing_nothing_at_the_end_is_not_drawn_as_an_empty_code_block() -> None:
    renderer, out = rich_renderer(width=60)
    renderer.reply_text('def f(x):\n    return x\n\n# Example\nprint(f(1))\n```')  # as small models write
    lines = out.getvalue().splitlines()
    assert lines[-1] == "print(f(1))" and "```" not in out.getvalue()
    renderer, out = rich_renderer(width=60)
    renderer.reply_text("```python\nx = 1\n```")
    assert "x = 1" in out.getvalue()  # a complete block is untouched


def test_plain_renderer_strips_escape_codes_only_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    msg = ActiveMessage(1, "assistant", "a\x1b[2Jb", [1], 0, 0)
    events = [ReplyStart(0, 0), ReplyText("a\x1b[2Jb"), ReplyEnd(msg, TurnStats())]
    tty, pipe = Tty(), io.StringIO()
    Renderer(Console(file=tty), plain=True, err=io.StringIO()).stream(events)
    Renderer(Console(file=pipe), plain=True, err=io.StringIO()).stream(events)
    assert tty.getvalue() == "a[2Jb\n"
    assert pipe.getvalue() == "a\x1b[2Jb\n"  # a pipe gets the model's text exactly


# -- on the real model -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    home = tmp_path_factory.mktemp("repl-home")
    old = os.environ.get("CHATCLI_HOME")
    os.environ["CHATCLI_HOME"] = str(home)
    try:
        from tests.drive import build_session

        session = build_session(max_tokens=12, threads=1)  # one thread: steady on a busy 2-core box
    finally:
        if old is None:
            os.environ.pop("CHATCLI_HOME", None)
        else:
            os.environ["CHATCLI_HOME"] = old
    yield session
    session.close()


def test_repl_on_the_real_model_keeps_the_context_equal_to_the_transcript(real_session: Any) -> None:
    renderer, out = rich_renderer()
    conv, _ = open_events(real_session.new_conversation("alice"), renderer)
    with create_pipe_input() as pipe:
        pipe.send_text("Hi! Who are you?\r/regen\rName a colour.\r/undo\r/alt\r/stats\r\x04")
        repl = Repl(real_session, conv, renderer, lambda r: TerminalIO(r, input=pipe, output=DummyOutput()))
        repl.run()
    text = out.getvalue()
    assert text.count("tok evaluated") == 3  # two replies and the regenerated one
    assert "undid 1 exchange:" in text and "last turn" in text
    assert [m.role for m in conv.messages] == ["user", "assistant"]
    assert len(conv.r.alternatives(conv.messages[-1].turn)) == 2
    assert list(conv.engine.tokens) == conv.r.tokens()  # the context is exactly what the transcript says
    assert conv.messages[-1].text in text or conv.messages[-1].text.split()[0] in text


def test_ctrl_c_on_the_real_model_keeps_the_partial_reply_and_a_consistent_context(real_session: Any) -> None:
    class InterruptingRenderer(Renderer):
        """Presses Ctrl-C (a real SIGINT) as soon as the first words of the reply are shown."""

        def stream(self, events: Any, label: str = "working") -> Any:
            def watch() -> Iterator[Any]:
                sent = False
                for ev in events:
                    yield ev
                    if isinstance(ev, ReplyText) and not sent:
                        sent = True
                        os.kill(os.getpid(), signal.SIGINT)
            return super().stream(watch(), label)

    out = io.StringIO()
    renderer = InterruptingRenderer(Console(file=out, width=100, color_system=None), err=io.StringIO())
    conv, _ = open_events(real_session.new_conversation("alice"), renderer)
    conv.max_tokens = 200
    with create_pipe_input() as pipe:
        pipe.send_text("Tell me a long story about a dragon.\r\x04")
        repl = Repl(real_session, conv, renderer, lambda r: TerminalIO(r, input=pipe, output=DummyOutput()))
        repl.run()
    reply = conv.messages[-1]
    assert reply.role == "assistant" and reply.stop == "cancelled"
    assert 0 < len(reply.tokens) < 20
    assert "stopped by Ctrl-C: partial reply kept" in " ".join(out.getvalue().split())
    assert list(conv.engine.tokens) == conv.r.tokens()
    # The conversation goes on from the partial reply.
    conv2, report = open_events(real_session.open_conversation(conv.id), Renderer(Console(file=io.StringIO())))
    assert report is not None and report.reevaluated == 0 and conv2.messages[-1].text == reply.text
    conv2.close()


def test_persona_switch_on_the_real_model(real_session: Any) -> None:
    renderer, _out = rich_renderer()
    conv, _ = open_events(real_session.new_conversation("alice"), renderer)
    with create_pipe_input() as pipe:
        pipe.send_text("/persona pirate\r\x04")
        repl = Repl(real_session, conv, renderer, lambda r: TerminalIO(r, input=pipe, output=DummyOutput()))
        repl.run()
    assert repl.conv.id != conv.id and repl.conv.meta["persona"] == "pirate"
    assert list(repl.conv.engine.tokens) == repl.conv.r.tokens()
    ids = [c.id for c, _ in real_session.store.list()]
    assert conv.id in ids and repl.conv.id in ids  # the old one is kept
    old = real_session.store.resolve(conv.id)
    old.lock()  # no longer locked by the REPL
    old.unlock()


# -- `chatcli talk` with piped stdin, end to end ---------------------------------------------------------


def test_piped_talk_prints_only_the_reply_on_stdout_and_stats_on_stderr() -> None:
    result = CliRunner().invoke(app, ["talk", "--temperature", "0", "--max-tokens", "16", "--threads", "1"],
                                input="Hi!\n/stats\n")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    from chatcli.config.settings import get_paths
    from chatcli.core.files.store import ConversationStore

    (conv_dir, _meta), = ConversationStore(get_paths().conversations_dir).list()
    from chatcli.core.transcript import replay_events

    r = replay_events(conv_dir.read_transcript().events)
    reply = r.active[-1].text
    assert result.stdout == reply + "\n"  # nothing but the reply: no prompt, no colours, no stats
    assert "\x1b" not in result.stdout and "\x1b" not in result.stderr
    assert re.search(r"^\d+ tok evaluated · ttft \d+ ms · [\d.]+ tok/s · prompt \d+ tok/s · ctx \d+/\d+", result.stderr,
                     re.M)
    assert "last turn" in result.stderr and "session" in result.stderr
    assert f"resume with: chatcli resume {conv_dir.id}" in result.stderr


def test_notices_raised_outside_a_reply_are_shown_after_the_command() -> None:
    """E.g. the state budget's line after an /undo or /alt wrote state: shown once, after the command."""
    conv = FakeConversation()
    conv.pending_notices.append(Notice("state budget 1.0 KB: freed 5.0 MB by dropping the KV state of 1 conversation"))
    _, out, err = drive("/help\r/help\r\x04", conv)
    assert (out + err).count("state budget 1.0 KB: freed 5.0 MB") == 1
    assert conv.pending_notices == []
