"""Slash commands: one registry, from which /help and completion are generated."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from chatcli.conversation import ConversationError

if TYPE_CHECKING:
    from chatcli.repl import Repl


class ReplExit(Exception):
    """Leave the REPL (raised by /exit; never sys.exit inside a handler)."""


class CommandError(ValueError):
    """Bad use of a command: shown as one line, the loop goes on."""


Handler = Callable[["Repl", str], None]


@dataclass
class Command:
    name: str
    help: str
    handler: Handler
    args: str = ""
    aliases: tuple[str, ...] = ()
    complete: Callable[[Repl], list[str]] | None = None


@dataclass
class Registry:
    commands: dict[str, Command] = field(default_factory=dict)
    _by_alias: dict[str, Command] = field(default_factory=dict)

    def register(self, name: str, help: str, *, args: str = "", aliases: tuple[str, ...] = (),
                 complete: Callable[[Repl], list[str]] | None = None) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            cmd = Command(name, help, fn, args, aliases, complete)
            self.commands[name] = cmd
            for n in (name, *aliases):
                self._by_alias[n] = cmd
            return fn

        return deco

    def lookup(self, name: str) -> Command | None:
        return self._by_alias.get(name)

    def names(self) -> list[str]:
        return sorted(self._by_alias)


REGISTRY = Registry()


def dispatch(repl: Repl, line: str) -> None:
    """Run a slash command line such as ``/undo 2``."""
    word, _, rest = line[1:].partition(" ")
    cmd = REGISTRY.lookup(word.strip().lower())
    if cmd is None:
        raise CommandError(f"unknown command /{word.strip()} (try /help)")
    cmd.handler(repl, rest.strip())


def _int_arg(arg: str, what: str, default: int | None = None) -> int | None:
    if not arg:
        return default
    try:
        return int(arg)
    except ValueError:
        raise CommandError(f"{what} must be a number, not {arg!r}") from None


def _seed_arg(arg: str) -> int | None:
    parts = shlex.split(arg)
    if not parts:
        return None
    if parts[0] == "--seed" and len(parts) == 2:
        return _int_arg(parts[1], "seed")
    raise CommandError("usage: /regen [--seed N]")


@REGISTRY.register("help", "show the commands", aliases=("?",))
def _help(repl: Repl, arg: str) -> None:
    rows = []
    for cmd in sorted(REGISTRY.commands.values(), key=lambda c: c.name):
        name = f"/{cmd.name}" + (f" {cmd.args}" if cmd.args else "")
        alias = ", ".join(f"/{a}" for a in cmd.aliases)
        rows.append({"command": name, "aliases": alias, "what it does": cmd.help})
    repl.renderer.table(rows, ["command", "aliases", "what it does"])
    repl.renderer.notice("Enter sends · Alt-Enter (or Esc Enter) adds a line · Ctrl-C stops a reply · Ctrl-D exits · "
                         "Alt-←/→ switch alternatives")


@REGISTRY.register("exit", "save and leave", aliases=("quit", "q"))
def _exit(repl: Repl, arg: str) -> None:
    raise ReplExit()


@REGISTRY.register("regen", "sample a new reply to your last message (the old one stays as an alternative)",
                   args="[--seed N]", aliases=("r",))
def _regen(repl: Repl, arg: str) -> None:
    seed = _seed_arg(arg)
    repl.run_reply(repl.conv.regen(seed=seed))


@REGISTRY.register("edit", "edit your last message (or message N) and continue from it", args="[N]",
                   complete=lambda repl: [str(i + 1) for i in range(len(repl.conv.user_messages()))])
def _edit(repl: Repl, arg: str) -> None:
    users = repl.conv.user_messages()
    if not users:
        raise CommandError("no message to edit")
    n = _int_arg(arg, "message number", len(users))
    assert n is not None
    if not 1 <= n <= len(users):
        raise CommandError(f"no message {n} (there are {len(users)})")
    text = repl.io.edit_text(users[n - 1].text)
    if text is None or not text.strip():
        repl.renderer.notice("edit cancelled")
        return
    repl.run_reply(repl.conv.edit(n, text))


@REGISTRY.register("undo", "remove the last N exchanges (default 1); /redo brings them back", args="[N]")
def _undo(repl: Repl, arg: str) -> None:
    n = _int_arg(arg, "count", 1)
    assert n is not None
    stats = repl.conv.undo(n)
    repl.renderer.notice(f"undid {n} exchange(s): kept {stats.kept} tokens, dropped {stats.dropped}, re-evaluated 0")


@REGISTRY.register("redo", "bring back what /undo removed")
def _redo(repl: Repl, arg: str) -> None:
    stats = repl.conv.redo()
    repl.renderer.notice(f"redone: {stats.reevaluated} tokens evaluated, history untouched")
    repl.show_last()


def _alt_complete(repl: Repl) -> list[str]:
    last = repl.conv.messages[-1] if repl.conv.messages else None
    if last is None or last.role != "assistant":
        return []
    return [str(i + 1) for i in range(len(repl.conv.r.alternatives(last.turn)))]


@REGISTRY.register("alt", "list the alternatives of the last reply, or switch to alternative N",
                   args="[N|next|prev]", complete=_alt_complete)
def _alt(repl: Repl, arg: str) -> None:
    conv = repl.conv
    last = conv.messages[-1] if conv.messages else None
    if last is None or last.role != "assistant":
        raise CommandError("no reply yet")
    alts = sorted(conv.r.alternatives(last.turn), key=lambda e: int(e.get("alt", 0)))
    current = next(i for i, e in enumerate(alts) if int(e["mid"]) == last.mid)
    if not arg:
        rows = []
        for i, e in enumerate(alts):
            text = " ".join(str(e.get("text", "")).split())
            rows.append({"#": f"{i + 1}{' *' if i == current else ''}", "reply": text[:70] + ("…" if len(text) > 70 else "")})
        repl.renderer.table(rows, ["#", "reply"])
        return
    if arg in ("next", "prev"):
        index = (current + (1 if arg == "next" else -1)) % len(alts)
    else:
        n = _int_arg(arg, "alternative")
        assert n is not None
        index = n - 1
    stats = conv.switch_alt(index)
    repl.renderer.notice(f"alternative {index + 1}/{len(alts)}: kept {stats.kept} tokens, evaluated {stats.n_eval} "
                         f"reply tokens, re-evaluated 0 history tokens")
    repl.show_last()


@REGISTRY.register("title", "rename this conversation", args="TEXT")
def _title(repl: Repl, arg: str) -> None:
    if not arg:
        repl.renderer.notice(f"title: {repl.conv.title or '(none)'}")
        return
    repl.conv.set_title(arg)
    repl.renderer.notice(f"title set: {repl.conv.title}")


@REGISTRY.register("stats", "details of the last turn and of this session")
def _stats(repl: Repl, arg: str) -> None:
    from chatcli.render import human_bytes, stats_line

    conv = repl.conv
    if conv.last_stats:
        repl.renderer.notice("last turn: " + stats_line(conv.last_stats))
    s = conv.session_stats
    rate = s["n_generated"] / s["gen_seconds"] if s["gen_seconds"] else 0.0
    repl.renderer.notice(
        f"session: {int(s['turns'])} replies, {int(s['n_eval'])} tokens evaluated, {int(s['n_generated'])} generated "
        f"({rate:.1f} tok/s) · context {conv.engine.n_past}/{conv.engine.n_ctx} · state file {human_bytes(conv.state_bytes())}"
        f" · conversation {conv.id}")


@REGISTRY.register("persona", "start a new conversation with another persona (this one stays saved)", args="NAME",
                   complete=lambda repl: sorted(repl.session.personas()))
def _persona(repl: Repl, arg: str) -> None:
    if not arg:
        raise CommandError("usage: /persona NAME (" + ", ".join(sorted(repl.session.personas())) + ")")
    repl.switch_persona(arg)


@REGISTRY.register("system", "show the active system prompt")
def _system(repl: Repl, arg: str) -> None:
    sys_msgs = [m.content for m in repl.conv.r.persona_messages if m.role == "system"]
    repl.renderer.notice(sys_msgs[0] if sys_msgs else "(no system prompt)")


@REGISTRY.register("copy", "copy the last reply to the clipboard")
def _copy(repl: Repl, arg: str) -> None:
    replies = [m for m in repl.conv.messages if m.role == "assistant"]
    if not replies:
        raise CommandError("no reply to copy")
    how = repl.io.copy_to_clipboard(replies[-1].text)
    repl.renderer.notice(f"copied ({how})")


@REGISTRY.register("save", "write this conversation as Markdown", args="PATH")
def _save(repl: Repl, arg: str) -> None:
    from chatcli.export import to_markdown

    if not arg:
        raise CommandError("usage: /save PATH")
    path = Path(arg).expanduser()
    try:
        path.write_text(to_markdown(repl.conv.meta, repl.conv.r), encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot write {path}: {exc.strerror}") from None
    repl.renderer.notice(f"saved to {path}")


__all__ = ["REGISTRY", "CommandError", "ConversationError", "ReplExit", "dispatch"]
