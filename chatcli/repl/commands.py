"""Slash commands: one registry, from which /help and completion are generated."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from chatcli.core.events import ConversationError, TurnStats
from chatcli.errors import ChatcliError, Kind
from chatcli.units import counted

if TYPE_CHECKING:
    from chatcli.repl.context import CommandContext


class ReplExit(Exception):
    """Leave the REPL (raised by /exit; never sys.exit inside a handler)."""


class CommandError(ChatcliError, ValueError):
    """Bad use of a command: shown as one line, the loop goes on."""

    kind: Kind = "usage"


class UnknownCommand(CommandError):
    """No such command (maybe a message that starts with "/"): the line comes back to the prompt."""


Handler = Callable[["CommandContext", str], None]


# Completion options: plain values, or (value, description) pairs shown beside them in the menu.
Completions = list[str] | list[tuple[str, str]]


@dataclass
class Command:
    name: str
    help: str
    handler: Handler
    args: str = ""
    aliases: tuple[str, ...] = ()
    complete: Callable[[CommandContext], Completions] | None = None

    @property
    def usage(self) -> str:
        return f"/{self.name}" + (f" {self.args}" if self.args else "")


@dataclass
class Registry:
    commands: dict[str, Command] = field(default_factory=dict)
    _by_alias: dict[str, Command] = field(default_factory=dict)

    def register(self, name: str, help: str, *, args: str = "", aliases: tuple[str, ...] = (),
                 complete: Callable[[CommandContext], Completions] | None = None) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            cmd = Command(name, help, fn, args, aliases, complete)
            self.commands[name] = cmd
            for n in (name, *aliases):
                self._by_alias[n] = cmd
            return fn

        return deco

    def lookup(self, name: str) -> Command | None:
        return self._by_alias.get(name)

    def resolve(self, word: str) -> Command:
        """A command by name, alias or unambiguous prefix (``/he`` is ``/help``)."""
        word = word.strip().lower()
        cmd = self._by_alias.get(word)
        if cmd is not None:
            return cmd
        matches = {c.name: c for n, c in self._by_alias.items() if word and n.startswith(word)}
        if len(matches) == 1:
            return next(iter(matches.values()))
        if matches:
            raise UnknownCommand(f"/{word} could be " + ", ".join("/" + n for n in sorted(matches)))
        raise UnknownCommand(f"unknown command /{word} (try /help; //text sends a message starting with /)")

    def names(self) -> list[str]:
        return sorted(self._by_alias)


REGISTRY = Registry()


def dispatch(ctx: CommandContext, line: str) -> None:
    """Run a slash command line such as ``/undo 2``."""
    word, _, rest = line[1:].partition(" ")
    if "\n" in word:  # "/cmd" followed by a newline typed with Alt-Enter
        word, _, more = word.partition("\n")
        rest = more + " " + rest
    REGISTRY.resolve(word).handler(ctx, rest.strip())


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


KEYS_HELP = ("Enter sends · Alt-Enter (or Esc Enter) adds a line · Tab completes · Ctrl-C stops a reply or clears "
             "the line, twice exits · Ctrl-D exits · Alt-←/→ switch alternatives · //text sends text starting with /")


@REGISTRY.register("help", "show the commands", aliases=("?",))
def _help(ctx: CommandContext, arg: str) -> None:
    rows = []
    for cmd in sorted(REGISTRY.commands.values(), key=lambda c: c.name):
        alias = " (" + ", ".join(f"/{a}" for a in cmd.aliases) + ")" if cmd.aliases else ""
        rows.append((cmd.usage, cmd.help + alias))
    ctx.renderer.commands(rows, KEYS_HELP)


@REGISTRY.register("exit", "save and leave", aliases=("quit", "q"))
def _exit(ctx: CommandContext, arg: str) -> None:
    raise ReplExit()


@REGISTRY.register("regen", "sample a new reply to your last message (the old one stays as an alternative)",
                   args="[--seed N]", aliases=("r",))
def _regen(ctx: CommandContext, arg: str) -> None:
    seed = _seed_arg(arg)
    ctx.run_reply(ctx.conv.regen(seed=seed))


def _edit_complete(ctx: CommandContext) -> list[tuple[str, str]]:
    users = ctx.conv.user_messages()
    short = [" ".join(m.text.split()) for m in users]
    return [(str(i + 1), t[:40] + "…" if len(t) > 40 else t) for i, t in enumerate(short)]


@REGISTRY.register("edit", "edit your last message (or message N) and continue from it", args="[N]",
                   complete=_edit_complete)
def _edit(ctx: CommandContext, arg: str) -> None:
    users = ctx.conv.user_messages()
    if not users:
        raise CommandError("no message to edit")
    n = _int_arg(arg, "message number", len(users))
    assert n is not None
    if not 1 <= n <= len(users):
        raise CommandError(f"no message {n} (there are {len(users)})")
    text = ctx.io.edit_text(users[n - 1].text)
    if text is None or not text.strip():
        ctx.renderer.notice("edit cancelled")
        return
    ctx.run_reply(ctx.conv.edit(n, text))


def _warn(ctx: CommandContext, stats: TurnStats) -> None:
    for n in stats.notices:  # e.g. the state could not be saved: said when it happens
        ctx.renderer.notice(n.text, n.level)


@REGISTRY.register("undo", "remove the last N exchanges (default 1); /redo brings them back", args="[N]")
def _undo(ctx: CommandContext, arg: str) -> None:
    n = _int_arg(arg, "count", 1)
    assert n is not None
    stats = ctx.renderer.steps(ctx.conv.undo_steps(n), "undoing")  # a bar while a rollback rebuilds, as /regen shows
    _warn(ctx, stats)
    ctx.renderer.notice(f"undid {counted(n, 'exchange')}: kept {stats.kept} tokens, dropped {stats.dropped}, "
                        f"re-evaluated {stats.reevaluated or 0}")


@REGISTRY.register("redo", "bring back what /undo removed")
def _redo(ctx: CommandContext, arg: str) -> None:
    n_before = len(ctx.conv.messages)
    stats = ctx.renderer.steps(ctx.conv.redo_steps(), "redoing")
    _warn(ctx, stats)
    back = ctx.conv.messages[n_before:]
    n_users = sum(1 for m in back if m.role == "user")
    ctx.renderer.notice(f"redone {counted(n_users, 'exchange')}: {stats.reevaluated} tokens evaluated, history untouched")
    ctx.renderer.history(back, n_users)  # what came back, your messages too (not only the last reply)


def _alt_complete(ctx: CommandContext) -> list[tuple[str, str]]:
    alts = ctx.conv.alternatives()
    if not alts:
        return []
    out = []
    for a in alts:
        text = " ".join(a.text.split())
        out.append((str(a.index + 1), ("* " if a.active else "") + (text[:40] + "…" if len(text) > 40 else text)))
    return [*out, ("next", "the next alternative"), ("prev", "the previous alternative")]


@REGISTRY.register("alt", "list the alternatives of the last reply, or switch to alternative N",
                   args="[N|next|prev]", complete=_alt_complete)
def _alt(ctx: CommandContext, arg: str) -> None:
    conv = ctx.conv
    alts = conv.alternatives()
    if not alts:
        raise CommandError("no reply yet")
    current = next(a.index for a in alts if a.active)
    if not arg:
        texts = [" ".join(a.text.split()) for a in alts]
        # Alternatives often open alike: show each from a little before where they part ways.
        common = len(os.path.commonprefix(texts)) if len(texts) > 1 else 0  # noqa: RUF071 (characters wanted)
        start = max(0, common - 15) if common > 30 else 0
        rows = []
        for i, text in enumerate(texts):
            part = text[start:start + 70]
            shown = ("…" if start and part else "") + part + ("…" if len(text) > start + 70 else "")
            rows.append({"#": f"{i + 1}{' *' if i == current else ''}", "reply": shown or "(same as above)",
                         "tokens": str(alts[i].n_tokens)})
        ctx.renderer.table(rows, ["#", "reply", "tokens"], to_err=True)
        return
    if arg in ("next", "prev") and len(alts) == 1:
        raise CommandError("this reply has no alternatives yet: /regen makes one")
    if arg in ("next", "prev"):
        index = (current + (1 if arg == "next" else -1)) % len(alts)
    else:
        n = _int_arg(arg, "alternative")
        assert n is not None
        index = n - 1
    stats = ctx.renderer.steps(conv.switch_alt_steps(index), "switching")
    _warn(ctx, stats)
    ctx.renderer.notice(f"alternative {index + 1}/{len(alts)}: kept {stats.kept} tokens, evaluated {stats.n_eval} "
                         f"reply tokens, re-evaluated {stats.reevaluated or 0} history tokens")
    ctx.show_last()


@REGISTRY.register("title", "rename this conversation", args="TEXT")
def _title(ctx: CommandContext, arg: str) -> None:
    if not arg:
        ctx.renderer.notice(f"title: {ctx.conv.title or '(none)'}")
        return
    ctx.conv.set_title(arg)
    ctx.renderer.notice(f"title set: {ctx.conv.title}")


@REGISTRY.register("stats", "details of the last turn and of this session")
def _stats(ctx: CommandContext, arg: str) -> None:
    from chatcli.units import format_size

    conv = ctx.conv
    use = conv.context
    last = conv.last_stats
    if last is not None:
        rows = [("evaluated", f"{last.n_eval} tokens ({last.n_prompt} of your message, read in "
                              f"{last.prompt_seconds * 1000:.0f} ms)")]
        if last.n_generated:
            # The rate as the stats line and llama-server count it (after the first token), not n / seconds.
            rows.append(("generated", f"{last.n_generated} tokens in {last.gen_seconds:.1f} s "
                                      f"({last.tokens_per_second:.1f} tok/s after the first), "
                                      f"first after {last.ttft * 1000:.0f} ms"))
        rows.append(("stopped", {"eog": "the model finished", "length": "at --max-tokens",
                                 "cancelled": "by Ctrl-C (partial reply kept)", "context": "context full",
                                 "stop": "at a stop string"}.get(last.stop_reason, last.stop_reason or "-")))
        if last.kept is not None:
            rows.append(("rollback", f"kept {last.kept}, dropped {last.dropped or 0}, "
                                     f"re-evaluated {last.reevaluated or 0} tokens"))
        if last.state_bytes:
            rows.append(("saved", f"{format_size(last.state_bytes)} of state in {last.save_ms:.0f} ms"))
        ctx.renderer.fields("last turn", rows)
    s = conv.session_stats
    ctx.renderer.fields("session", [
        ("replies", f"{s.turns}"),
        ("tokens", f"{s.n_eval} evaluated, {s.n_generated} generated ({s.tokens_per_second:.1f} tok/s)"),
        ("context", f"{use.n_past}/{use.n_ctx} tokens ({100 * use.n_past / use.n_ctx if use.n_ctx else 0.0:.0f}%)"),
        ("state file", format_size(conv.state_bytes())),
        ("conversation", f"{conv.id} · {conv.title or '(untitled)'} · {counted(conv.n_turns, 'exchange')}"),
    ])


def _persona_complete(ctx: CommandContext) -> list[tuple[str, str]]:
    return [(name, p.description) for name, p in sorted(ctx.personas().items())]


@REGISTRY.register("persona", "start a new conversation with another persona (this one stays saved)", args="NAME",
                   complete=_persona_complete)
def _persona(ctx: CommandContext, arg: str) -> None:
    if not arg:
        current = ctx.conv.persona_name
        names = [n + (" (current)" if n == current else "") for n in sorted(ctx.personas())]
        raise CommandError("usage: /persona NAME — one of: " + ", ".join(names))
    names = sorted(ctx.personas())
    if arg not in names:
        matches = [n for n in names if n.startswith(arg)]
        if len(matches) == 1:
            arg = matches[0]
    ctx.switch_persona(arg)


@REGISTRY.register("system", "show the persona's system prompt")
def _system(ctx: CommandContext, arg: str) -> None:
    if arg:
        raise CommandError("the system prompt belongs to the persona: start one with /persona NAME, "
                           "or write your own persona file (see `chatcli personas`)")
    ctx.renderer.notice(ctx.conv.system_prompt or "(no system prompt)")


def _last_code_block(text: str) -> str | None:
    blocks = re.findall(r"^ {0,3}(```|~~~)[^\n]*\n(.*?)^ {0,3}\1[ \t]*$", text, re.M | re.S)
    if blocks:
        return str(blocks[-1][1])
    # An unterminated fence (a reply stopped early) still counts.
    m = re.search(r"^ {0,3}(```|~~~)[^\n]*\n(.*)\Z", text, re.M | re.S)
    return m.group(2) if m else None


@REGISTRY.register("copy", "copy the last reply (or its last code block) to the clipboard", args="[code]",
                   complete=lambda ctx: [("code", "only the last code block")])
def _copy(ctx: CommandContext, arg: str) -> None:
    replies = [m for m in ctx.conv.messages if m.role == "assistant"]
    if not replies:
        raise CommandError("no reply to copy")
    text = replies[-1].shown
    what = "the last reply"
    if arg in ("code", "c"):
        block = _last_code_block(text)
        if block is None:
            raise CommandError("the last reply has no code block")
        text, what = block, "its last code block"
    elif arg:
        raise CommandError("usage: /copy [code]")
    how = ctx.io.copy_to_clipboard(text)
    ctx.renderer.notice(f"copied {what} ({len(text)} characters, via {how})")


@REGISTRY.register("think", "show the last reply's reasoning in full (reasoning models)")
def _think(ctx: CommandContext, arg: str) -> None:
    if arg:
        raise CommandError("usage: /think")
    replies = [m for m in ctx.conv.messages if m.role == "assistant"]
    if not replies or not replies[-1].reasoning:
        raise CommandError("the last reply has no reasoning")
    ctx.renderer.reasoning(replies[-1].reasoning, replies[-1].reasoning_tokens, full=True)


@REGISTRY.register("save", "write this conversation as Markdown (default: ./chatcli-ID.md)", args="[PATH]")
def _save(ctx: CommandContext, arg: str) -> None:
    path = Path(arg).expanduser() if arg else Path(f"chatcli-{ctx.conv.id}.md")
    if path.is_dir():
        path = path / f"chatcli-{ctx.conv.id}.md"
    try:
        # The whole conversation, also what left the model's context (`chatcli export --in-context` has not).
        path.write_text(ctx.conv.to_markdown(), encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from None
    ctx.renderer.notice(f"saved {counted(ctx.conv.n_exchanges, 'exchange')} to {path}")


@REGISTRY.register("search", "search every conversation's messages (`chatcli search` for filters)", args="TEXT")
def _search(ctx: CommandContext, arg: str) -> None:
    if not arg.strip():
        raise CommandError("usage: /search TEXT")
    lines = ctx.search(arg)
    ctx.renderer.notice("\n".join(lines) if lines else f"nothing matches {arg!r}")


__all__ = ["REGISTRY", "CommandError", "ConversationError", "ReplExit", "UnknownCommand", "dispatch"]
