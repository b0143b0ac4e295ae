"""The command line: parses arguments, builds the core objects, maps errors to one line and an exit code.

No chat logic lives here.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Callable

import typer

from chatcli import __version__
from chatcli.cli.errors import EXIT_USAGE, CliError, err_console, first_line, user_errors

if TYPE_CHECKING:  # imported where used, so that `chatcli ls` never loads what only `talk` needs

    from chatcli.config.settings import Paths, Settings
    from chatcli.core.conversation import Conversation
    from chatcli.repl.render import Renderer
    from chatcli.session import Session

app = typer.Typer(
    name="chatcli",
    help="Terminal chat with a local LLM whose conversation state persists: resume, regenerate and edit "
    "without re-processing the history.\n\n"
    "Examples:\n\n"
    "  chatcli talk --persona alice          chat (type /help inside for commands)\n\n"
    "  chatcli resume                        continue the most recent conversation\n\n"
    "  chatcli ls; chatcli show ID           list conversations, print one\n\n"
    "  printf 'hi\\n' | chatcli talk --temperature 0    one reply per input line, on stdout\n\n"
    "Settings, strongest first: command-line flags > CHATCLI_* environment variables > your config file "
    "(chatcli config path) > built-in defaults. Data lives under $CHATCLI_HOME when it is set.\n\n"
    "Shell completion: chatcli --install-completion",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
config_app = typer.Typer(
    help="Show or edit the configuration file.\n\n"
    "Settings, strongest first: command-line flags > CHATCLI_* environment variables (CHATCLI_N_CTX=8192) > "
    "the config file > built-in defaults. `chatcli config show` says where each value came from.\n\n"
    "Examples:\n\n  chatcli config show\n\n  EDITOR=nano chatcli config edit",
    no_args_is_help=True,
)
app.add_typer(config_app, name="config")

def _version(value: bool) -> None:
    if value:
        print(f"chatcli {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[bool | None, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")] = None,
) -> None:
    """chatcli: resume, regenerate and edit local-LLM chats without re-processing them."""


# -- shared options -------------------------------------------------------------------------------------

# One help text per option that several commands take; ``_opt`` builds the typer option from it.
_HELP = {
    "--model": "GGUF file, or hf:REPO:FILE. Default: bundled SmolLM2.",
    "--n-ctx": "Context size in tokens (capped at the model's).",
    "--threads": "CPU threads (0 = all cores).",
    "--seed": "Sampling seed (same seed ⇒ same replies).",
    "--temperature": "Randomness of replies; 0 means greedy (always the likeliest token).",
    "--top-p": "Nucleus sampling: sample from the likeliest tokens adding up to this probability.",
    "--top-k": "Sample only from the K likeliest tokens (0 = no limit).",
    "--repeat-penalty": "Penalty for repeating recent tokens (1.0 = none).",
    "--max-tokens": "Longest reply in tokens.",
    "--reserve": "Tokens kept free for a reply when old turns must leave the context.",
    "--plain/--rich": "Plain text: no colours, no Markdown rendering, no toolbar (also when NO_COLOR is set or "
                      "output is piped).",
    "--server": "Run the model on a llama-server at this URL (http://HOST:PORT; 'none' = the local model).",
    "--kv-type": "KV cache type: f16, q8_0 (about half the state bytes) or q4_0. "
                 "A conversation keeps its type; resuming with another rebuilds its KV.",
    "--chat-template": "A Jinja chat template file to use instead of the model's own ('none' = the model's). "
                       "A conversation remembers it.",
    "--thinking/--no-thinking": "Reasoning models: thinking on or off (the template's enable_thinking). "
                                "A conversation remembers it.",
    "--reasoning": "Include each reply's reasoning (reasoning models), apart from its answer.",
    "--state-budget": "Disk budget for all saved KV state, e.g. 20GB, 500MB; 0/none = no limit. "
                      "Least recently used conversations' state is dropped (their transcripts stay).",
}


def _opt(*names: str, metavar: str | None = None) -> Any:
    """The typer option ``names`` (long name first), with its help text from ``_HELP``."""
    return typer.Option(*names, help=_HELP[names[0]], metavar=metavar)


ModelOpt = Annotated[str | None, _opt("--model", "-m")]
NCtxOpt = Annotated[int | None, _opt("--n-ctx")]
ThreadsOpt = Annotated[int | None, _opt("--threads", "-t")]
SeedOpt = Annotated[int | None, _opt("--seed")]
TempOpt = Annotated[float | None, _opt("--temperature")]
TopPOpt = Annotated[float | None, _opt("--top-p")]
TopKOpt = Annotated[int | None, _opt("--top-k")]
RepeatOpt = Annotated[float | None, _opt("--repeat-penalty")]
MaxTokOpt = Annotated[int | None, _opt("--max-tokens")]
ReserveOpt = Annotated[int | None, _opt("--reserve")]
PlainOpt = Annotated[bool | None, _opt("--plain/--rich")]
ServerOpt = Annotated[str | None, _opt("--server")]
KvTypeOpt = Annotated[str | None, _opt("--kv-type")]
TemplateOpt = Annotated[str | None, _opt("--chat-template", metavar="FILE")]
ThinkingOpt = Annotated[bool | None, _opt("--thinking/--no-thinking")]
ReasoningOpt = Annotated[bool, _opt("--reasoning")]
BudgetOpt = Annotated[str | None, _opt("--state-budget")]


def _settings(flags: Mapping[str, object]) -> tuple[Settings, Paths, set[str]]:
    from chatcli.config.settings import get_paths, load_settings_explicit

    paths = get_paths()
    settings, explicit = load_settings_explicit(flags, paths=paths)
    return settings, paths, explicit


def _build_session(settings: Settings, paths: Paths, explicit: set[str], *, model_path: str | None = None,
                   quiet: bool = False, chat_template: tuple[str, str] | None = None) -> Session:
    from chatcli.models.resolve import resolve_model
    from chatcli.session import Session

    # The console (rich: ~0.1 s to import) only for the spinner: `serve` and a pipe load without it.
    console = err_console() if not quiet and sys.stderr.isatty() else None
    build: Callable[[], Session]
    if settings.server:
        label = f"connecting to {settings.server} …"
        build = lambda: Session.build_remote(settings, paths, explicit=explicit, chat_template=chat_template)
    else:
        ref = resolve_model(model_path or settings.model)
        label = f"loading {ref.path.name} …"
        build = lambda: Session.build(settings, paths, model=ref, explicit=explicit, chat_template=chat_template)
    with console.status(label) if console is not None else contextlib.nullcontext():
        # Started once the spinner runs: the main thread imports nothing more until the model is loaded.
        if not quiet:
            _warm_front_end()
        session = build()
    return session


def _warm_front_end() -> None:
    """Import the REPL's modules (rich, prompt_toolkit, the loop: ~0.1 s) on a thread while the model loads
    (in llama.cpp's C code, the GIL released) instead of after it. Started once the main thread has
    imported all it needs until the model is loaded; when it later needs a module this thread is
    importing, it waits for it, inside no import of its own (so the two never wait for each other)."""

    def warm() -> None:
        try:
            import chatcli.repl.loop
            import chatcli.repl.terminal  # noqa: F401
        except Exception:  # imported again where it is needed, which then says what is wrong
            pass

    threading.Thread(target=warm, name="chatcli-warm", daemon=True).start()


def _warm_markdown(renderer: Renderer) -> None:
    """Render Markdown once on a thread (``markdown.WarmUp``) while the first prompt waits for the user:
    the first reply's first frame would otherwise import the parser and a lexer (~40 ms) between two
    decodes. Not while the model loads, nor while the prompt is first drawn (0.5 s later): neither needs
    it, and next to them it delayed them. The renderer finishes it before it streams anything."""
    from chatcli.repl.markdown import WarmUp

    renderer.warm = WarmUp(0.5)


def _renderer(settings: Settings, interactive: bool) -> Renderer:
    from rich.console import Console

    from chatcli.repl.render import Renderer

    plain = bool(settings.plain) or not interactive or bool(os.environ.get("NO_COLOR"))
    console = Console(highlight=False, no_color=plain, force_terminal=None if not plain else False, soft_wrap=False)
    return Renderer(console, plain=plain, show_reasoning=settings.show_reasoning)


def _run_repl(session: Session, conv: Conversation, renderer: Renderer, interactive: bool) -> int:
    from chatcli.repl.context import ChatIO
    from chatcli.repl.loop import Repl
    from chatcli.repl.terminal import LineIO, TerminalIO

    factory: Callable[[Repl], ChatIO]
    if interactive:
        factory = lambda repl: TerminalIO(repl, history_file=session.paths.history_file)
    else:
        stdin = sys.stdin
        if hasattr(stdin, "reconfigure"):
            stdin.reconfigure(errors="replace")  # non-UTF-8 bytes become U+FFFD instead of a crash
        factory = lambda repl: LineIO(stdin)
    repl = Repl(session, conv, renderer, factory)
    if interactive and not renderer.plain:
        _warm_markdown(renderer)
    code = repl.run()
    # A script piping messages must be able to tell that one was refused (too long, a bad command):
    # each said so on stderr as it happened; the exit status says it once more.
    return 1 if code == 0 and repl.failures and not interactive else code


def _interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


# -- commands ----------------------------------------------------------------------------------------


@app.command()
def talk(
    persona: Annotated[str | None, typer.Option("--persona", "-p", help="Persona name (see `chatcli personas`).")] = None,
    model: ModelOpt = None, n_ctx: NCtxOpt = None, threads: ThreadsOpt = None, seed: SeedOpt = None,
    temperature: TempOpt = None, top_p: TopPOpt = None, top_k: TopKOpt = None, repeat_penalty: RepeatOpt = None,
    max_tokens: MaxTokOpt = None, reserve: ReserveOpt = None, plain: PlainOpt = None,
    kv_type: KvTypeOpt = None, state_budget: BudgetOpt = None, server: ServerOpt = None,
    chat_template: TemplateOpt = None, thinking: ThinkingOpt = None,
) -> None:
    """Start a new conversation.

    In a terminal: Enter sends, Alt-Enter adds a line, Tab completes /commands, Ctrl-C stops a reply
    (twice at the prompt exits), Ctrl-D saves and exits; /help lists the commands. With stdin piped,
    each line is one message and only the replies go to stdout.

    Examples: chatcli talk --persona alice · chatcli talk -m ~/models/qwen.gguf --n-ctx 8192 ·
    echo 'Name a colour' | chatcli talk --temperature 0
    """
    flags = dict(model=model, n_ctx=n_ctx, threads=threads, seed=seed, temperature=temperature, top_p=top_p,
                 top_k=top_k, repeat_penalty=repeat_penalty, max_tokens=max_tokens, reserve=reserve, plain=plain,
                 persona=persona, kv_type=kv_type, state_budget=state_budget, server=server,
                 chat_template=chat_template, thinking=thinking)
    with user_errors():
        settings, paths, explicit = _settings(flags)
        from chatcli.config.personas import get_persona

        get_persona(settings.persona, paths.personas_dir)  # fail fast, before loading a model
        interactive = _interactive()
        session = _build_session(settings, paths, explicit)
        from chatcli.repl.loop import open_events  # imported while the model loaded (_warm_front_end)

        renderer = _renderer(settings, interactive)
        for n in session.notices:
            renderer.notice(n, "warn")
        conv, _ = open_events(session.new_conversation(settings.persona), renderer)
        if interactive:
            renderer.notice(f"conversation {conv.id} · persona {settings.persona} · {session.model_name} · "
                            "/help for commands")
        if conv.greeting and interactive:
            renderer.reply_text(conv.greeting)
        code = _run_repl(session, conv, renderer, interactive)
    raise typer.Exit(code)


@app.command()
def resume(
    conv_id: Annotated[str | None, typer.Argument(
        metavar="[ID]",
        help="Conversation id or unique prefix (default: most recent).")] = None,
    model: ModelOpt = None, n_ctx: NCtxOpt = None, threads: ThreadsOpt = None,
    temperature: TempOpt = None, top_p: TopPOpt = None, top_k: TopKOpt = None, repeat_penalty: RepeatOpt = None,
    max_tokens: MaxTokOpt = None, reserve: ReserveOpt = None, plain: PlainOpt = None,
    kv_type: KvTypeOpt = None, state_budget: BudgetOpt = None, server: ServerOpt = None,
    chat_template: TemplateOpt = None, thinking: ThinkingOpt = None,
) -> None:
    """Continue a conversation where it stopped, restoring its KV state (no re-processing).

    Shows the last exchanges, then the chat goes on as with `talk`.

    Examples: chatcli resume · chatcli resume k3f9x2 · chatcli resume k3 --max-tokens 200
    """
    flags = dict(model=model, n_ctx=n_ctx, threads=threads, temperature=temperature, top_p=top_p, top_k=top_k,
                 repeat_penalty=repeat_penalty, max_tokens=max_tokens, reserve=reserve, plain=plain,
                 kv_type=kv_type, state_budget=state_budget, server=server,
                 chat_template=chat_template, thinking=thinking)
    with user_errors():
        settings, paths, explicit = _settings(flags)
        session, conv, renderer, interactive = _open(settings, paths, explicit, conv_id, model, n_ctx,
                                                     kv_type_flag=kv_type)
        code = _run_repl(session, conv, renderer, interactive)
    raise typer.Exit(code)


def _open(settings: Settings, paths: Paths, explicit: set[str], conv_id: str | None, model_flag: str | None,
          n_ctx_flag: int | None, *, show_history: bool = True,
          kv_type_flag: str | None = None) -> tuple[Session, Conversation, Renderer, bool]:
    """Resume a conversation with the session's resume policy (``Session.open``) and show how it went."""
    from chatcli.session import Session
    from chatcli.units import format_size

    session, opening = Session.open(
        settings, paths, conv_id, explicit=explicit, model=model_flag, n_ctx=n_ctx_flag, kv_type=kv_type_flag,
        build=lambda s, model_path, template: _build_session(s, paths, explicit, model_path=model_path,
                                                             chat_template=template))
    from chatcli.repl.loop import open_events  # imported while the model loaded (_warm_front_end)

    interactive = _interactive()
    renderer = _renderer(settings, interactive)
    conv, report = open_events(opening, renderer)
    if show_history:
        renderer.history(conv.messages, settings.history_preview)
    if report is not None:
        if report.reason:
            renderer.notice(report.reason + "; rebuilt from the transcript's tokens", "warn")
        renderer.notice(
            f"resumed {conv.id}: restored {report.restored_tokens} tokens ({format_size(report.restored_bytes)}) "
            f"in {report.seconds * 1000:.0f} ms · re-evaluated {report.reevaluated} tokens")
    return session, conv, renderer, interactive


@app.command()
def regen(
    conv_id: Annotated[str | None, typer.Argument(metavar="[ID]", help="Conversation (default: most recent).")] = None,
    seed: SeedOpt = None,
    interactive_flag: Annotated[bool, typer.Option("--interactive", "-i", help="Continue in the REPL afterwards.")] = False,
    model: ModelOpt = None, temperature: TempOpt = None, max_tokens: MaxTokOpt = None, plain: PlainOpt = None,
    server: ServerOpt = None,
) -> None:
    """Replace the last reply of a conversation with a new one (the old one stays as an alternative).

    Example: chatcli regen k3f9x2 --seed 7
    """
    flags = dict(model=model, temperature=temperature, max_tokens=max_tokens, plain=plain, server=server)
    with user_errors():
        settings, paths, explicit = _settings(flags)
        session, conv, renderer, interactive = _open(settings, paths, explicit, conv_id, model, None, show_history=False)
        end = renderer.stream(conv.regen(seed=seed))
        if end is not None:
            renderer.stats(end.stats)
        if interactive_flag and interactive:
            code = _run_repl(session, conv, renderer, True)
        else:
            conv.close()
            code = 0
    raise typer.Exit(code)


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(
        "--host", help="Address to listen on (default 127.0.0.1: this machine only).")] = None,
    port: Annotated[int | None, typer.Option("--port", help="TCP port (default 8765).")] = None,
    model: ModelOpt = None, n_ctx: NCtxOpt = None, threads: ThreadsOpt = None,
    parallel: Annotated[int | None, typer.Option("--parallel", help="Conversations kept resident at once.")] = None,
    api_key: Annotated[list[str] | None, typer.Option(
        "--api-key", help="Require 'Authorization: Bearer KEY' on every request; repeat for several clients, "
        "each with its own conversations.")] = None,
    api_keys_file: Annotated[str | None, typer.Option(
        "--api-keys-file", help="More API keys, one a line (each a client with its own conversations).")] = None,
    repl_conversations: Annotated[bool | None, typer.Option(
        "--repl-conversations/--no-repl-conversations",
        help="Let API clients reach conversations made in the REPL (default: they cannot).")] = None,
    max_queue: Annotated[int | None, typer.Option(
        "--max-queue", help="Requests that may wait for a context; more get 503 + Retry-After (default 16).")] = None,
    max_tokens: MaxTokOpt = None, reserve: ReserveOpt = None,
    kv_type: KvTypeOpt = None, state_budget: BudgetOpt = None,
    chat_template: TemplateOpt = None, thinking: ThinkingOpt = None,
) -> None:
    """Serve an OpenAI-compatible API whose conversations never re-ingest their history, even after a restart.

    Point any OpenAI client at http://127.0.0.1:8765/v1. Each conversation is stored like a REPL one
    (`chatcli ls` marks them "api"); a client that resends a history continues the stored conversation
    with the longest common history, evaluating only the new message.

    Examples: chatcli serve · chatcli serve --port 9000 --api-key $(openssl rand -hex 16)
    """
    keys = list(api_key or [])
    flags = dict(host=host, port=port, model=model, n_ctx=n_ctx, threads=threads, parallel=parallel,
                 api_key=keys[0] if keys else None, api_keys_file=api_keys_file, api_repl_access=repl_conversations,
                 max_queue=max_queue, max_tokens=max_tokens, reserve=reserve, kv_type=kv_type,
                 state_budget=state_budget, chat_template=chat_template, thinking=thinking)
    with user_errors():
        # Found, not imported: the HTTP layer is imported by chatcli.server.run while the model loads.
        from importlib.util import find_spec

        for name in ("starlette", "uvicorn", "pydantic"):
            if find_spec(name) is None:
                raise CliError(f"chatcli serve needs the 'serve' extra ({name} is missing): "
                               "pip install 'chatcli[serve]'")
        from chatcli.server.run import ApiKeysError, api_keys
        from chatcli.server.run import serve as run_server

        settings, paths, explicit = _settings(flags)
        try:
            all_keys = api_keys(settings, keys[1:])  # before the model loads: a bad key file is said at once
        except ApiKeysError as exc:
            raise CliError(str(exc)) from None
        # The port is taken first (in use: one line), then the model loads on a thread while the server starts.
        code = run_server(settings, paths, lambda: _build_session(settings, paths, explicit, quiet=True), all_keys)
    raise typer.Exit(code)


@app.command()
def fork(
    conv_id: Annotated[str, typer.Argument(metavar="ID", help="Conversation to fork.")],
    at: Annotated[int | None, typer.Option(
        "--at", help="Keep exchanges 1..TURN, counted as `chatcli ls` counts turns (default: all).")] = None,
) -> None:
    """Start a new conversation sharing the history up to a turn (its KV state is shared or copied, never
    re-evaluated). After a context shift the fork holds the exchanges still in context up to TURN."""
    from chatcli.config.settings import get_paths
    from chatcli.core.files.store import ConversationStore
    from chatcli.core.forking import fork_conversation

    with user_errors():
        store = ConversationStore(get_paths().conversations_dir)
        new_id, n_tokens = fork_conversation(store, conv_id, at)
        print(f"forked into {new_id} ({n_tokens} tokens of state kept) · resume with: chatcli resume {new_id}")


@app.command("ls")
def list_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    limit: Annotated[int | None, typer.Option("--limit", "-n", min=1,
                                              help="Show the N most recent (default 50).")] = None,
    show_all: Annotated[bool, typer.Option("--all", "-a", help="Show every conversation.")] = False,
    grep: Annotated[str | None, typer.Option("--grep", help="Only conversations with a message matching TEXT "
                                             "(every word; see `chatcli search`).")] = None,
) -> None:
    """List conversations, most recent first (the 50 most recent unless --limit N or --all).

    "turns" counts every exchange of the conversation; "in_context" those the model's context still holds
    (fewer once old exchanges left it in a context shift). A "from" column (api / cli) appears once some
    conversation was made through `chatcli serve`.
    """
    from chatcli.cli.listing import DEFAULT_LIMIT, list_conversations

    with user_errors():
        if show_all and limit is not None:
            raise CliError("--all and --limit exclude each other", EXIT_USAGE)
        list_conversations(as_json=as_json, limit=None if show_all else (limit or DEFAULT_LIMIT), grep=grep)


@app.command()
def search(
    text: Annotated[str, typer.Argument(help="Words to find (all of them; the last may be a prefix).")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    persona: Annotated[str | None, typer.Option("--persona", help="Only conversations of this persona.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Only conversations whose model name contains this.")] = None,
    since: Annotated[str | None, typer.Option("--since", help="Only messages from this date on (YYYY-MM-DD).")] = None,
    until: Annotated[str | None, typer.Option("--until", help="Only messages before this date (YYYY-MM-DD).")] = None,
    api: Annotated[bool | None, typer.Option("--api/--no-api", help="Only API conversations / only the others.")] = None,
    reasoning: Annotated[bool, typer.Option("--reasoning", help="Also search the replies' reasoning.")] = False,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="At most N hits.")] = 20,
) -> None:
    """Search every conversation's messages (SQLite FTS5), best match first.

    Each hit gives the conversation, its title, the exchange and a snippet, and how to continue there:
    `chatcli resume ID` or `chatcli fork ID --at N`. Example: chatcli search "binary tree" --since 2026-01-01
    """
    from chatcli.config.settings import get_paths
    from chatcli.core.files.store import ConversationStore
    from chatcli.core.search import hit_lines, hits_json, run_search

    with user_errors():
        hits, notices = run_search(text, ConversationStore(get_paths().conversations_dir), persona=persona,
                                   model=model, since=since, until=until, api=api, reasoning=reasoning, limit=limit)
        for notice in notices:
            print(f"note: {notice}", file=sys.stderr)
        if as_json:
            print(hits_json(hits))
        elif not hits:
            print(f"nothing matches {text!r}")
        else:
            for line in hit_lines(hits, bold=sys.stdout.isatty() and not os.environ.get("NO_COLOR")):
                print(line)


@app.command()
def gc(
    budget: Annotated[str | None, typer.Option(
        "--budget",
        help="Apply this size instead of state_budget, e.g. 500MB; 0 drops every state file not in use.")] = None,
) -> None:
    """Apply the state budget now: drop the least recently used KV state files until all fit.

    Transcripts are never touched and open conversations are spared; a dropped conversation resumes by
    re-evaluating its transcript. Example: chatcli gc --budget 2GB
    """
    from chatcli.config.settings import get_paths
    from chatcli.core.files.store import ConversationStore
    from chatcli.core.kv.budget import enforce, resync_index
    from chatcli.units import SizeError, parse_size

    with user_errors():
        settings, paths, _ = _settings({})
        paths = get_paths()
        text = settings.state_budget if budget is None else budget
        try:
            # `gc --budget 0` means "keep nothing": in a setting 0 means no limit, here it is a size.
            limit = 0 if budget is not None and budget.strip() == "0" else parse_size(text)
        except SizeError as exc:
            raise CliError(f"--budget: {exc}", EXIT_USAGE) from None
        freed = enforce(paths.conversations_dir, paths.prefix_cache_dir, limit)
        resync_index(ConversationStore(paths.conversations_dir).index, paths.conversations_dir)
        print(freed.summary())


@app.command()
def show(
    conv_id: Annotated[str | None, typer.Argument(metavar="[ID]")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The transcript's events as JSON.")] = False,
    reasoning: ReasoningOpt = False,
) -> None:
    """Print a conversation's transcript (messages that left the model's context are marked)."""
    from chatcli.config.settings import get_paths
    from chatcli.core.files.store import ConversationStore
    from chatcli.core.transcript import message_parts, replay_events

    with user_errors():
        store = ConversationStore(get_paths().conversations_dir)
        conv = store.resolve(conv_id)
        meta = conv.read_meta()
        tr = conv.read_transcript()
        r = replay_events(tr.events)
        if as_json:
            print(json.dumps({"meta": meta, "events": tr.events}, indent=2, ensure_ascii=False))
            return
        # Messages are printed as written: no hard wrap at 80 columns in a pipe, no ":smile:" → emoji,
        # and every user-supplied string escaped (a title such as "what is [/]?" is not markup).
        from rich.console import Console

        out = Console(highlight=False, emoji=False, soft_wrap=True,
                      no_color=not sys.stdout.isatty() or bool(os.environ.get("NO_COLOR")))
        out.print(f"[bold]{_esc(str(meta.get('title') or conv.id))}[/] · {conv.id} · "
                  f"persona {_esc(str(meta.get('persona', '')))}")
        for mid in r.out_of_context:
            ev = r.all.get(mid)
            if ev:
                who = "you" if ev["role"] == "user" else "assistant"
                rsn, answer, _ = message_parts(ev)
                if reasoning and rsn:
                    out.print(f"[dim]{who} (left the context, reasoning): {_esc(rsn)}[/]")
                out.print(f"[dim]{who} (left the context): {_esc(ev.get('text', '') if answer is None else answer)}[/]")
        for m in r.active:
            who = "you" if m.role == "user" else "assistant"
            if reasoning and m.reasoning:
                out.print(f"[dim]{who} (reasoning): {_esc(m.reasoning)}[/]")
            out.print(f"[bold]{who}:[/] {_esc(m.shown)}")
        for p in tr.problems + r.problems:
            print(f"warning: {p}", file=sys.stderr)


def _esc(text: str) -> str:
    from rich.markup import escape

    return escape(text)


@app.command()
def export(
    conv_id: Annotated[str | None, typer.Argument(metavar="[ID]")] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="md, or json: an OpenAI messages list (system first).")] = "md",
    in_context: Annotated[bool, typer.Option(
        "--in-context",
        help="Only the messages the model's context still holds (not those that left it in a context shift).")] = False,
    reasoning: ReasoningOpt = False,
) -> None:
    """Write a conversation to stdout as Markdown or JSON: every message, in order (the active path
    through alternatives, edits and undos), including those that left the model's context."""
    from chatcli.config.settings import get_paths
    from chatcli.core.export import to_markdown, to_messages
    from chatcli.core.files.store import ConversationStore
    from chatcli.core.transcript import replay_events

    with user_errors():
        if fmt not in ("md", "json"):
            raise CliError(f"unknown format {fmt!r}: use md or json", EXIT_USAGE)
        store = ConversationStore(get_paths().conversations_dir)
        conv = store.resolve(conv_id)
        meta = conv.read_meta()
        r = replay_events(conv.read_transcript().events)
        if fmt == "json":
            # Exactly an OpenAI chat `messages` list, so it can be sent to an API or loaded as-is.
            print(json.dumps(to_messages(r, in_context=in_context, reasoning=reasoning), indent=2, ensure_ascii=False))
        else:
            sys.stdout.write(to_markdown(meta, r, in_context=in_context, reasoning=reasoning))


@app.command()
def rm(
    conv_ids: Annotated[list[str], typer.Argument(metavar="ID...", help="Conversations to delete.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
) -> None:
    """Delete conversations."""
    from chatcli.config.settings import get_paths
    from chatcli.core.files.migrations import FormatError
    from chatcli.core.files.store import ConversationStore, StoreError

    with user_errors():
        store = ConversationStore(get_paths().conversations_dir)
        # Resolve all first (a typo deletes nothing); an id given twice, or by two prefixes, is deleted once.
        convs = list({conv.id: conv for conv in (store.resolve(c) for c in conv_ids)}.values())
        for conv in convs:
            try:
                title = conv.read_meta().get("title", "")
            except (StoreError, FormatError):
                title = ""  # damaged or of a newer chatcli: it can still be deleted
            if not yes:
                if not sys.stdin.isatty():
                    raise CliError("refusing to delete without --yes (stdin is not a terminal)", EXIT_USAGE)
                if not typer.confirm(f"delete {conv.id} ({title})?", default=False):
                    continue
            store.remove(conv)
            print(f"deleted {conv.id}")


@app.command()
def personas(
    warm: Annotated[bool, typer.Option("--warm", help="Evaluate and cache persona prefixes for the current model.")] = False,
    name: Annotated[str | None, typer.Argument(help="Only this persona.")] = None,
    model: ModelOpt = None, n_ctx: NCtxOpt = None,
) -> None:
    """List personas and whether their prefix is cached for the current model."""
    from chatcli.config.personas import get_persona, load_personas, persona_problems
    from chatcli.persona_prefixes import prefix_status, warm_prefix
    from chatcli.repl.render import Renderer

    with user_errors():
        settings, paths, explicit = _settings(dict(model=model, n_ctx=n_ctx))
        found = load_personas(paths.personas_dir)
        chosen = [get_persona(name, paths.personas_dir)] if name else [found[k] for k in sorted(found)]
        session = None
        if warm:
            session = _build_session(settings, paths, explicit)
        rows = []
        for p in chosen:
            if warm and session is not None:
                renderer = _renderer(settings, sys.stderr.isatty())
                renderer.stream(warm_prefix(session, p))
            status = prefix_status(settings, paths, p, session)
            rows.append({"name": p.name, "description": p.description, "prefix cache": status})
        plain = not sys.stdout.isatty() or bool(os.environ.get("NO_COLOR"))
        from rich.console import Console

        Renderer(Console(highlight=False), plain=plain).table(rows, ["name", "description", "prefix cache"])
        for problem in persona_problems(paths.personas_dir):
            print(f"warning: {problem}", file=sys.stderr)


@config_app.command("path")
def config_path() -> None:
    """Print the config file's path."""
    from chatcli.config.settings import get_paths

    print(get_paths().config_file)


@config_app.command("show")
def config_show() -> None:
    """Show every setting, its value and where it came from."""
    from chatcli.config.settings import describe_settings

    with user_errors():
        for name, value, origin in describe_settings():
            print(_config_line(name, value, origin))


def _config_line(name: str, value: object, origin: str) -> str:
    """One setting as a TOML line that can be pasted into the config file (an unset one commented out)."""
    if value is None:
        return f"# {name} = (not set)  # {origin}"
    if name.endswith("api_key"):
        return f'{name} = "***"  # {origin} (a secret: where it is set, never its value)'
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (int, float)):
        text = repr(value)
    else:
        text = json.dumps(str(value), ensure_ascii=False)  # a TOML basic string uses JSON's escapes
    return f"{name} = {text}  # {origin}"


@config_app.command("edit")
def config_edit() -> None:
    """Open the config file in $EDITOR (created from the commented defaults if missing)."""
    import importlib.resources
    import shlex
    import subprocess

    from chatcli.config.settings import get_paths
    from chatcli.core.files.fsutil import ensure_private_dir

    with user_errors():
        path = get_paths().config_file
        if not path.exists():
            ensure_private_dir(path.parent)
            path.write_text((importlib.resources.files("chatcli") / "data" / "config.toml").read_text("utf-8"), "utf-8")
            os.chmod(path, 0o600)
        editor = os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
        rc = subprocess.call([*shlex.split(editor), str(path)])
        if rc != 0:
            raise CliError(f"{editor} exited with {rc}")
        from chatcli.config.settings import SettingsError, describe_settings

        try:
            describe_settings()  # a mistake is reported now, not at the next chat
        except SettingsError as exc:
            raise CliError(f"the config file has a problem: {first_line(exc)} (fix it with `chatcli config edit`)") from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
