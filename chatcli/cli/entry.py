"""The `chatcli` executable: a bare `chatcli ls` runs straight away, every other command goes to typer.

Importing typer and building the app (every command's signature, read through `inspect`) costs ~100 ms
on this project's 2-core machines: half of what listing 100 conversations may take in total (issue #15
goal 3b). `ls` and `ls --json` take no other arguments worth parsing, so they skip it; anything else,
`ls --help` included, gets typer's full parsing and messages.
"""

from __future__ import annotations

import sys

_FAST = {("ls",): False, ("ls", "--json"): True}


def main() -> None:
    as_json = _FAST.get(tuple(sys.argv[1:]))
    if as_json is not None:
        from chatcli.cli.errors import user_errors
        from chatcli.cli.listing import list_conversations

        with user_errors():
            list_conversations(as_json=as_json)
        return
    from chatcli.cli.app import main as typer_main

    typer_main()


if __name__ == "__main__":
    main()
