"""`chatcli ls`: the conversations, most recent first, as a table, tab-separated lines or JSON.

Kept apart from the typer app so that chatcli.cli.entry can run a bare `chatcli ls` without importing typer or
building the app (issue #15 goal 3b: listing 100 conversations within 0.2 s, whole process).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import unicodedata
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

DEFAULT_LIMIT = 50  # `ls` shows the most recent ones; `--all` or `--limit N` for more


def list_conversations(*, as_json: bool, limit: int | None = DEFAULT_LIMIT, grep: str | None = None) -> None:
    """Print the list (``limit`` None: all). Core errors propagate: the caller maps them to one line
    (chatcli.cli.errors)."""
    # Only what listing needs: the transcript replay (and jinja2 behind it) only for a conversation whose
    # metadata summary is missing or stale; never rich (sizes come from chatcli.units, not the renderer).
    from chatcli.config.settings import get_paths
    from chatcli.core.files.store import ConversationStore
    from chatcli.core.kv.budget import prefix_bytes

    paths = get_paths()
    store = ConversationStore(paths.conversations_dir)
    got = _rows_from_index(store, limit, grep, prefix_bytes(paths.prefix_cache_dir))
    if got is None:  # no usable index (locked past the busy timeout, a read-only data dir): read every folder
        rows, problems, n, n_warm = _rows_from_folders(store, grep)
        n_all, state_total = len(rows), None
        if limit is not None:
            rows = rows[:limit]
    else:
        found, problems, n, n_warm, n_all, state_total = got
        if not as_json and not sys.stdout.isatty() and found:
            # Into a pipe: lines straight from the index's rows, no dict per row (`ls --all` at 100,000).
            for problem in problems:
                print(f"warning: {problem}", file=sys.stderr)
            sys.stdout.write(_tsv(found))
            if len(found) < n_all:
                print(f"… {n_all - len(found)} older not shown (--all, or --limit N)", file=sys.stderr)
            print(_usage_line(n, n_warm, state_total), file=sys.stderr)
            return
        if not as_json and found:
            # A terminal: the screen's cells straight from the index's rows too (no dict per row).
            for problem in problems:
                print(f"warning: {problem}", file=sys.stderr)
            lines = _screen_lines(found, shutil.get_terminal_size().columns, bold_header=not os.environ.get("NO_COLOR"))
            sys.stdout.write("\n".join(lines) + "\n")
            if len(found) < n_all:
                print(f"… {n_all - len(found)} older not shown (--all, or --limit N)")
            print(_usage_line(n, n_warm, state_total))
            return
        rows = [r.as_listing() for r in found]
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    if as_json:
        # One conversation per line: json's C encoder runs only without ``indent`` (indented, 10,000
        # rows took ~0.1 s of a 0.2 s `ls --all --json`), and a row per line reads well in a pager too.
        body = ",\n".join("  " + json.dumps(r, ensure_ascii=False) for r in rows)
        print(f"[\n{body}\n]" if rows else "[]")
        return
    if not rows:
        print("no conversations yet: start one with `chatcli talk`" if grep is None else f"no conversation mentions {grep!r}")
        return
    _print_rows(rows)
    out = sys.stdout if sys.stdout.isatty() else sys.stderr
    if len(rows) < n_all:
        print(f"… {n_all - len(rows)} older not shown (--all, or --limit N)", file=out)
    # The total goes to stderr when stdout is a pipe: scripts read one row per conversation.
    print(_usage_line(n, n_warm, state_total), file=out)


def _rows_from_index(store: Any, limit: int | None, grep: str | None, prefix_total: int,
                     ) -> tuple[list[Any], list[str], int, int, int, int] | None:
    import sqlite3

    from chatcli.core.files.index import IndexUnavailable

    index = store.index
    if index is None:
        return None
    try:
        index.reconcile(progress=_progress)
        ids = index.matching_ids(grep) if grep is not None else None
        found = index.rows(limit=limit, ids=ids)
        found = index.check_rows(found, lambda cid: _replay_counts(store, cid))
        n, n_warm = index.count()
        out = (found, index.problems(), n, n_warm, len(ids) if ids is not None else n,
               index.state_total() + prefix_total)
    except (sqlite3.Error, IndexUnavailable) as exc:
        index.notices.append(f"index unusable ({exc}): listing from the folders")
        out = None
    for notice in index.notices:
        print(f"note: {notice}", file=sys.stderr)
    return out


def _progress(done: int, total: int) -> None:
    """The index being (re)built: a counter on a terminal's stderr, nothing on a pipe."""
    if sys.stderr.isatty():
        end = "\n" if done == total else ""
        print(f"\rindexing conversations: {done}/{total}", end=end, file=sys.stderr, flush=True)


def _replay_counts(store: Any, cid: str) -> tuple[tuple[int, int], list[int]] | None:
    """(exchanges, in context) replayed from the transcript (the truth), with the stamp they describe."""
    from chatcli.core.export import exchange_counts
    from chatcli.core.files.migrations import FormatError
    from chatcli.core.transcript import replay_events

    conv = store.dir(cid)
    stamp = conv.transcript_stamp()
    try:
        return exchange_counts(replay_events(conv.read_transcript().events)), stamp
    except FormatError:
        return None


def _rows_from_folders(store: Any, grep: str | None) -> tuple[list[dict[str, Any]], list[str], int, int]:
    """`ls` without the index: every meta.json read (what `ls` did before the index)."""
    from chatcli.core.files.migrations import FormatError

    rows = []
    problems: list[str] = []
    for conv, meta in store.list(problems):
        counts = conv.cached_counts(meta)
        if counts is None:
            got = _replay_counts(store, conv.id)
            if got is None:
                problems.append(f"conversation {conv.id}: its transcript is unreadable")
                continue
            counts = got[0]
        if grep is not None:
            try:
                text = "\n".join(str(e.get("text", "")) for e in conv.read_transcript().events)
            except FormatError:
                continue
            if grep.lower() not in text.lower():
                continue
        turns, in_context = counts
        state_bytes = conv.state_size()
        rows.append({
            "id": conv.id, "title": meta.get("title", ""), "persona": meta.get("persona", ""),
            "turns": turns, "in_context": in_context, "tokens": meta.get("tokens", 0),
            "state_bytes": state_bytes, "updated": meta.get("updated", 0),
            # warm: its KV state is on disk (resume loads it); cold: evicted or never saved (resume rebuilds)
            "warm": state_bytes > 0, "kv_type": str((meta.get("params") or {}).get("type_k", "f16")),
            "from": "api" if meta.get("source") == "api" else "",
        })
        server = (meta.get("model") or {}).get("server")
        if server:  # a llama-server conversation: its state is the slot file on the server
            ck = meta.get("checkpoint")
            rows[-1]["server"] = server
            rows[-1]["state_bytes"] = int(ck.get("bytes", 0)) if isinstance(ck, dict) else 0
            rows[-1]["warm"] = bool(rows[-1]["state_bytes"])
    return rows, problems, len(rows), sum(1 for r in rows if r["warm"])


def _tsv(rows: Sequence[Any]) -> str:
    """The index's rows (``core.files.index.Row``) as `ls`'s tab-separated lines: the same columns and
    cells as ``_print_rows`` makes for a pipe, without a dict per row."""
    import time

    from chatcli.units import format_size

    where = any(r.server for r in rows)
    source = any(r.source == "api" for r in rows)
    localtime, strftime = time.localtime, time.strftime
    sizes: dict[int, str] = {}  # most rows share a size (every cold one's is 0)
    out: list[str] = []
    append = out.append
    # Unpacked, not read by attribute: a named tuple's fields are descriptors (~2× slower at 100,000 rows);
    # one f-string a row, not a list of cells joined (0.82 → 0.44 s at 100,000, most of it localtime).
    for cid, title, persona, _model, src, server, kv_type, tokens, updated, turns, in_context, state in rows:
        size = sizes.get(state)
        if size is None:
            size = sizes[state] = format_size(state)
        line = f"{cid}\t{title}\t{persona}\t{turns}\t{in_context}\t{tokens}\t{size}"
        if where:
            line += "\t" + (server.split("://", 1)[-1] if server else "local")
        line += "\t" + strftime("%Y-%m-%d %H:%M", localtime(float(updated))) + (
            "\twarm " + kv_type if state > 0 else "\tcold")
        if source:
            line += "\tapi" if src == "api" else "\tcli"
        append(line)
    return "\n".join(out) + "\n"


def _screen_lines(rows: Sequence[Any], width: int, *, bold_header: bool) -> list[str]:
    """The index's rows (``core.files.index.Row``) as the terminal's lines: the same as ``_print_rows``
    shows a terminal (``_screen_columns``, ``format_columns``), without a dict per row or two copies of
    it (`ls --all` at 100,000 on a terminal: 5.9-7.0 → 2.1-2.3 s of CPU, whole process)."""
    from chatcli.units import format_size

    this_year = datetime.now().year
    fromtimestamp = datetime.fromtimestamp
    where = any(r.server and str(r.server).split("://", 1)[-1] != "local" for r in rows)
    source = any(r.source == "api" for r in rows)
    shifted = any(r.in_context != r.turns for r in rows)
    sizes: dict[int, str] = {}
    cells: list[list[str]] = []
    append = cells.append
    for cid, title, persona, _model, src, server, kv_type, tokens, updated, turns, in_context, state in rows:
        if state > 0:
            size = sizes.get(state)
            if size is None:
                size = sizes[state] = format_size(state)
            shown = size if kv_type == "f16" else f"{size} {kv_type}"
        else:
            shown = "cold"
        when = fromtimestamp(float(updated))
        row = [str(cid), str(title), str(persona), str(turns), *([str(in_context)] if shifted else []),
               str(tokens), shown]
        if where:
            row.append(str(server).split("://", 1)[-1] if server else "local")
        row.append(when.strftime("%m-%d %H:%M" if when.year == this_year else "%Y-%m-%d"))
        if source:
            row.append("api" if src == "api" else "cli")
        append(row)
    columns = ["id", "title", "persona", "turns", *(["in_context"] if shifted else []), "tokens", "state",
               *(["server"] if where else []), "updated", *(["from"] if source else [])]
    return _format_cells(cells, columns, width, bold_header=bold_header)


def _print_rows(rows: list[dict[str, Any]]) -> None:
    from chatcli.units import format_size

    for r in rows:
        r["state"] = format_size(r["state_bytes"])
        r["kv"] = f"warm {r['kv_type']}" if r["warm"] else "cold"
        r["updated_at"] = datetime.fromtimestamp(float(r["updated"]))
        r["updated"] = r["updated_at"].strftime("%Y-%m-%d %H:%M")
        r["server"] = str(r["server"]).split("://", 1)[-1] if r.get("server") else "local"
    # The server column only once some conversation runs on a llama-server (its state lives there);
    # the "from" column only once some conversation came from the API (an empty column is noise).
    where = ["server"] if any(r["server"] != "local" for r in rows) else []
    source = ["from"] if any(r["from"] for r in rows) else []
    for r in rows:
        r["from"] = r["from"] or "cli"  # shown only next to "api": made by `chatcli talk` (or forked)
    columns = ["id", "title", "persona", "turns", "in_context", "tokens", "state", *where, "updated", "kv", *source]
    if not sys.stdout.isatty():  # one tab-separated line per conversation, for scripts: a stable set of columns
        sys.stdout.write("".join("\t".join([str(r.get(c, "")) for c in columns]) + "\n" for r in rows))
    else:
        # One write: a terminal's stdout is line-buffered, and a print a line made 100,000 writes.
        lines = format_columns(*_screen_columns(rows, columns), shutil.get_terminal_size().columns,
                               bold_header=not os.environ.get("NO_COLOR"))
        sys.stdout.write("\n".join(lines) + "\n")


def _usage_line(n: int, n_warm: int, state_total: int | None) -> str:
    """The total under `ls`: warm/cold counts, the bytes of all state, and the budget they are held to."""
    from chatcli.config.settings import SettingsError, get_paths, load_settings
    from chatcli.core.kv.budget import scan_usage
    from chatcli.units import format_size, parse_size

    paths = get_paths()
    if state_total is None:
        state_total = scan_usage(paths.conversations_dir, paths.prefix_cache_dir).total
    try:
        limit = parse_size(load_settings(paths=paths).state_budget)
        budget = f" of a {format_size(limit)} budget" if limit is not None else ", no budget"
    except SettingsError:
        budget = ", budget unreadable (see `chatcli config show`)"
    # One line of an 80-column terminal. The total includes the persona prefix cache (the budget covers
    # it too; `chatcli personas` lists it).
    return (f"{n} conversation{'' if n == 1 else 's'}: {n_warm} warm, {n - n_warm} cold · KV state "
            f"{format_size(state_total)}{budget}")


def _screen_columns(rows: list[dict[str, Any]], columns: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The terminal's narrower form, so that the title keeps some room at 80 columns: "in_context" only
    when some conversation has shifted, the KV type folded into "state" (a size when warm, else "cold"),
    "updated" without the year when it is this year's."""
    this_year = datetime.now().year
    shown = []
    for r in rows:
        when = r["updated_at"]
        state = "cold" if not r["warm"] else r["state"] + ("" if r["kv_type"] == "f16" else f" {r['kv_type']}")
        shown.append({**r, "state": state, "updated": when.strftime("%m-%d %H:%M" if when.year == this_year else "%Y-%m-%d")})
    drop = {"kv"} | ({"in_context"} if all(r["in_context"] == r["turns"] for r in rows) else set())
    return shown, [c for c in columns if c not in drop]


# Columns whose values are numbers or sizes: right-aligned, so that magnitudes line up.
_RIGHT = frozenset({"turns", "in_context", "tokens", "state"})
# The column that gives up width when the line does not fit the terminal (the others are short).
_ELASTIC = "title"
_GAP = "  "


def format_columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], width: int, *,
                   bold_header: bool) -> list[str]:
    """Rows as aligned text lines at most ``width`` cells wide, the header first.

    Not rich's Table: importing rich and measuring a boxed table of 100 rows took ~200 ms, more than the
    rest of `ls` together, and at 80 columns it wrapped cells over two lines. Here a long title is cut
    with "…" instead; control characters in user text are shown as spaces, never sent to the terminal.
    """
    return _format_cells([[str(r.get(c, "")) for c in columns] for r in rows], columns, width,
                         bold_header=bold_header)


def _format_cells(cells: list[list[str]], columns: Sequence[str], width: int, *, bold_header: bool) -> list[str]:
    """``format_columns`` of the rows' cells as text (each row's cells in ``columns``' order)."""
    cells = [[_printable(v) for v in row] for row in cells]
    everything = "".join(map("".join, cells))
    # Every cell ASCII and printable (the usual case): one terminal cell a character, so widths are lengths
    # and each line one str.format, in C (100,000 rows: 0.57 → 0.32 s of CPU).
    plain = everything.isascii() and everything.isprintable()
    if plain:
        widths = [max([len(c), *map(len, col)]) for c, col in zip(columns, zip(*cells, strict=True), strict=True)] \
            if cells else [len(c) for c in columns]
    else:
        widths = [max([_width(c)] + [_width(row[i]) for row in cells]) for i, c in enumerate(columns)]
    if _ELASTIC in columns:
        i = columns.index(_ELASTIC)
        others = sum(w for j, w in enumerate(widths) if j != i) + len(_GAP) * (len(columns) - 1)
        widths[i] = max(min(widths[i], width - others), len(_ELASTIC))
    header = _GAP.join(_fit(c, w, c in _RIGHT) for c, w in zip(columns, widths, strict=True)).rstrip()
    lines = [f"\x1b[1m{header}\x1b[0m" if bold_header else header]
    if plain:
        # Only the elastic column can be narrower than its cells: cut those as ``_fit`` does, pad the rest.
        if _ELASTIC in columns:
            i, w = columns.index(_ELASTIC), widths[columns.index(_ELASTIC)]
            for row in cells:
                if len(row[i]) > w:
                    row[i] = row[i][:max(w - 1, 0)] + "…"
        fmt = _GAP.join(f"{{:{'>' if c in _RIGHT else '<'}{w}}}" for c, w in zip(columns, widths, strict=True))
        lines += [fmt.format(*row).rstrip() for row in cells]
        return lines
    for row in cells:
        lines.append(_GAP.join(_fit(v, w, c in _RIGHT) for v, c, w in zip(row, columns, widths, strict=True)).rstrip())
    return lines


def _printable(text: str) -> str:
    if text.isprintable():  # no control character (the usual case: a test in C, not a loop per character)
        return text
    return "".join(" " if unicodedata.category(ch) == "Cc" else ch for ch in text)


def _char_width(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def _width(text: str) -> int:
    if text.isascii() and text.isprintable():  # one cell each: `ls --all` at 100,000 rows measured 2 million
        return len(text)                       # cells a character at a time (5 s of CPU on a terminal)
    return sum(_char_width(ch) for ch in text)


def _fit(text: str, width: int, right: bool) -> str:
    """``text`` padded to ``width`` terminal cells, or cut to ``width - 1`` cells and "…"."""
    if text.isascii() and text.isprintable():  # one cell a character: ``_width``
        if len(text) > width:
            text = text[:max(width - 1, 0)] + "…"
        pad = " " * (width - len(text))
        return pad + text if right else text + pad
    if _width(text) > width:
        kept, used = [], 0
        for ch in text:
            w = _char_width(ch)
            if used + w > width - 1:
                break
            kept.append(ch)
            used += w
        text = "".join(kept) + "…"
    pad = " " * (width - _width(text))
    return pad + text if right else text + pad
