"""The `chatcli` executable: a bare `chatcli ls` runs straight away, every other command goes to typer.

Importing typer and building the app (every command's signature, read through `inspect`) costs ~100 ms
on this project's 2-core machines: half of what listing 100 conversations may take in total (issue #15
goal 3b). `ls` with only `--json`, `--all` or `--limit N` skips it; anything else, `ls --help` included, gets typer's
full parsing and messages.
"""

from __future__ import annotations

import sys

DEFAULT_LIMIT = 50  # as chatcli.cli.listing.DEFAULT_LIMIT (not imported from there: this module stays tiny)

def _fast_ls(argv: list[str]) -> tuple[bool, int | None] | None:
    """`ls` with only --json, --all or --limit N: (as_json, limit), or None for typer to parse (and explain)."""
    if not argv or argv[0] != "ls":
        return None
    as_json = False
    limit: int | None = DEFAULT_LIMIT
    rest = argv[1:]
    seen: set[str] = set()
    while rest:
        arg = rest.pop(0)
        if arg in seen:
            return None
        seen.add(arg)
        if arg == "--json":
            as_json = True
        elif arg == "--all":
            limit = None
        elif arg == "--limit" and rest and rest[0].isdigit() and int(rest[0]) >= 1:
            limit = int(rest.pop(0))
        else:
            return None
    if {"--all", "--limit"} <= seen:
        return None  # typer says they exclude each other
    return as_json, limit


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        # Before typer's import: a SIGTERM from here on stops the server cleanly (exit 0), not with 143.
        from chatcli.server import early_stop

        early_stop.install()
    fast = _fast_ls(sys.argv[1:])
    if fast is not None:
        from chatcli.cli.errors import user_errors
        from chatcli.cli.listing import list_conversations

        with user_errors():
            list_conversations(as_json=fast[0], limit=fast[1])
        return
    from chatcli.cli.app import main as typer_main

    typer_main()


if __name__ == "__main__":
    main()
