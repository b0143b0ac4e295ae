"""Sizes in bytes, read and written one way everywhere: ``parse_size`` for settings and flags, ``format_size``
for what chatcli prints. Powers of 1024 both ways. ``counted`` for counts of things in what chatcli says. A
leaf: imports nothing of chatcli, so core may use it.
"""

from __future__ import annotations

import re

from chatcli.errors import ChatcliError, Kind

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNLIMITED = frozenset({"0", "none", "unlimited", "off", ""})


class SizeError(ChatcliError, ValueError):
    """A size that cannot be read; the message is one line."""

    kind: Kind = "usage"


def parse_size(text: str) -> int | None:
    """Bytes from ``20GB``, ``500MB``, ``1.5G``, ``750k``, ``4096``; None (no limit) for ``0``/``none``.

    Units are powers of 1024, the way chatcli prints sizes (``KB``, ``KiB`` and ``K`` all mean 1024 bytes).
    """
    s = str(text).strip().lower()
    if s in _UNLIMITED:
        return None
    m = _SIZE_RE.match(s)
    if not m:
        raise SizeError(f"not a size: {text!r} (use e.g. 20GB, 500MB, or 0/none for no limit)")
    number, unit = float(m[1]), m[2].lower()
    if m[3] and m[3].lower() == "ib" and not unit:
        raise SizeError(f"not a size: {text!r} (use e.g. 20GB, 500MB, or 0/none for no limit)")
    n = int(number * _UNITS[unit])
    return n if n > 0 else None


def format_size(n: float) -> str:
    """``512 B``, ``1.5 KB``, ``2.2 MB``, ``20.0 GB`` (GB is the largest unit)."""
    x = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if x < 1024 or unit == "GB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} GB"  # pragma: no cover


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``1 exchange``, ``3 exchanges``: a count and its noun agreeing (not ``1 exchange(s)``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
