"""On-disk format versions: the rule every reader follows, and the place where old formats are upgraded.

A conversation is three files, each with its own format version, a single integer (the *major* version):

- ``meta.json``: its ``"format"`` field;
- ``transcript.jsonl``: the ``"v"`` field of every line;
- ``state.kv`` (and the persona prefix cache files): the ``"format"`` field of the header record, and
  the magic ``CKV1`` in front of every record (a changed record framing would change its digit).

The rule:

1. **Additions keep the version.** A new optional field, a new transcript event type or a new state
   record kind is written under the same version, and only where older readers may ignore it: they skip
   an unknown event type or record kind (never treat it as damage, never cut the file there) and
   continue with what they know. A state record kind may be dropped by an older writer when it compacts
   the file (the state file is a cache), so a new kind must never be needed for correctness.
2. **Anything an older reader would get wrong bumps the version** (a field changes meaning, a record
   kind must not be skipped, the framing changes). A reader that meets a version *newer* than it knows
   refuses the whole conversation with one line naming the version, before writing anything.
3. **Older versions are upgraded on read**, in memory, by the functions below (one step per version);
   the next write uses the current version. Version 1 is the first.

State file versions: 2 added the BASE record (a fork's state refers to its parent's bytes instead of
copying them; an older reader skipping it would restore the wrong cells). Only a file that holds a BASE
record says format 2; every other state file is still written as format 1, which chatcli versions before
2 read too (a state header's format is the lowest version that reads that file correctly). Upgrading a
version-1 header changes nothing.

The REVIVE record (an older record's cells are live again: /redo, /alt) is an addition under format 1
although an older reader cannot follow it: skipping it, that reader finds the next CELLS record not
continuing its state and takes the rest of the file for damage — it restores what comes before, evaluates
the rest from the transcript, says so in one line and rewrites the file. Slower there, never wrong;
a bump would have to be in every file's header (written before any /redo), and that version would
refuse every conversation instead.

REVIVE_LOGITS (the logits /redo and /alt bring back with the last user message) and HISTORY (a digest of the
tokens before a record's cells, checked before /redo or /alt reads dead cells back) are additions under format
1 that an older reader skips whole, as every kind it does not know: it then evaluates one token for /regen
right after a /redo, or reads dead cells back by their positions and tokens alone, as it always did.

This module imports nothing of chatcli's: the store and the state file use it, the front ends may.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chatcli.errors import ChatcliError, Kind

META_VERSION = 1
TRANSCRIPT_VERSION = 1
STATE_VERSION = 2


class FormatError(ChatcliError, ValueError):
    """A file was written by a newer chatcli in a format this one cannot read; nothing was changed."""

    kind: Kind = "io"


def check(what: str, found: object, supported: int, *, where: str = "") -> int:
    """The version ``found`` as an int if this chatcli reads it; FormatError if it is newer.

    ``where`` names the file for the message (e.g. "conversation k3f9x2"). A missing or non-integer
    version is not a newer one: it is damage, reported by the caller (ValueError).
    """
    if isinstance(found, bool) or not isinstance(found, int) or found < 1:
        raise ValueError(f"{what} version {found!r} is not a version")
    if found > supported:
        prefix = f"{where}: " if where else ""
        raise FormatError(f"{prefix}{what} format {found} was written by a newer chatcli (this one reads "
                          f"format {supported} and older); upgrade chatcli to open it")
    return found


# One upgrade step per version: _META_STEPS[v] turns a version-v dict into a version-(v+1) one.
_META_STEPS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}
_EVENT_STEPS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}
_STATE_HEADER_STEPS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: lambda h: h}


def _upgrade(doc: dict[str, Any], key: str, current: int,
             steps: dict[int, Callable[[dict[str, Any]], dict[str, Any]]]) -> dict[str, Any]:
    version = int(doc[key])
    while version < current:
        doc = steps[version](doc)
        version += 1
        doc[key] = version
    return doc


def upgrade_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta.json`` of a version this chatcli reads, as the current version."""
    return _upgrade(meta, "format", META_VERSION, _META_STEPS)


def upgrade_event(event: dict[str, Any]) -> dict[str, Any]:
    """One transcript line of a version this chatcli reads, as the current version."""
    return _upgrade(event, "v", TRANSCRIPT_VERSION, _EVENT_STEPS)


def upgrade_state_header(header: dict[str, Any]) -> dict[str, Any]:
    """A state file's header of a version this chatcli reads, as the current version.

    The cells themselves are never converted: a state file whose cells an upgrade cannot keep is rebuilt
    from the transcript, like any other unusable cache.
    """
    return _upgrade(header, "format", STATE_VERSION, _STATE_HEADER_STEPS)


__all__ = [
    "META_VERSION", "STATE_VERSION", "TRANSCRIPT_VERSION", "FormatError", "check", "upgrade_event",
    "upgrade_meta", "upgrade_state_header",
]
