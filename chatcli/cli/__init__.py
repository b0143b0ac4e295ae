"""The command line; this file imports nothing, so a bare `chatcli ls` (cli.entry) never loads typer."""
