"""Sizes and durations: parsing what operators write, printing what they read.

The bottom floor (docs/architecture.md): the configuration layer converts settings with
:func:`size` and :func:`duration`, and the subsystems parse the same units in their own
URL parameters (``window_bytes=4MiB``, ``ack_timeout=250ms``) without reaching up into
the configuration.  :func:`human_size` and :func:`human_duration` are the way back, for
``--help``, ``--check-config`` and log lines.
"""

from __future__ import annotations

import re
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.I)
_SIZE_MULT = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
              "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
              "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
              "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4}


def size(v: Any) -> int:
    """Bytes: 1048576, "64MiB", "10GB"."""
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    m = _SIZE.match(str(v))
    if not m:
        raise ValueError(f"expected a size like 512MiB or 10GB, got {v!r}")
    return int(float(m.group(1)) * _SIZE_MULT[(m.group(2) or "").lower()])


_DUR = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|min|m|h|d)?\s*$", re.I)
_DUR_MULT = {"ms": 0.001, "s": 1, "": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def duration(v: Any) -> float:
    """Seconds: 5, 2.5, "250ms", "10m" (or "10 min", as :func:`human_duration` prints it),
    "7d"."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
        return float(v)
    m = _DUR.match(str(v))
    if not m:
        raise ValueError(f"expected a duration like 250ms, 10s, 10m or 7d, got {v!r}")
    return float(m.group(1)) * _DUR_MULT[(m.group(2) or "").lower()]


def human_size(n: int) -> str:
    """10737418240 -> '10 GiB'; exact binary multiples keep their unit, others one decimal."""
    n = int(n)
    for unit, mult in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= mult:
            v = n / mult
            return f"{v:.0f} {unit}" if n % mult == 0 else f"{v:.1f} {unit}"
    return f"{n} B"


def human_duration(s: float) -> str:
    """1.0 -> '1 s', 0.25 -> '250 ms', 300 -> '5 min', 604800 -> '7 d'."""
    s = float(s)
    if s == 0:
        return "0 s"
    if s < 1:
        return f"{s * 1000:g} ms"
    for unit, mult in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= mult and s % mult == 0:
            return f"{s / mult:g} {unit}"
    return f"{s:g} s"
