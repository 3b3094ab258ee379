"""Converters: a raw value (TOML, environment, flag) to a validated setting value."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# ----------------------------------------------------------------- converters

def _int(lo: int | None = None, hi: int | None = None) -> Callable[[Any], int]:
    def conv(v: Any) -> int:
        if isinstance(v, bool):
            raise ValueError(f"expected an integer, got {v!r}")
        try:
            n = int(v, 0) if isinstance(v, str) else int(v)
        except (TypeError, ValueError):
            raise ValueError(f"expected an integer, got {v!r}") from None
        if isinstance(v, float) and v != n:
            raise ValueError(f"expected an integer, got {v!r}")
        if lo is not None and n < lo:
            raise ValueError(f"must be >= {lo}, got {n}")
        if hi is not None and n > hi:
            raise ValueError(f"must be <= {hi}, got {n}")
        return n
    return conv


def port(v: Any) -> int:
    return _int(0, 65535)(v)


def _float(lo: float = 0.0) -> Callable[[Any], float]:
    def conv(v: Any) -> float:
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {v!r}") from None
        if x < lo:
            raise ValueError(f"must be >= {lo}, got {x}")
        return x
    return conv


def boolean(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true/false, got {v!r}")


def choice(*options: str | None) -> Callable[[Any], str | None]:
    def conv(v: Any) -> str | None:
        if v is None or (isinstance(v, str) and v.lower() in ("", "none", "off")
                         and None in options):
            return None
        s = str(v).lower()
        if s not in options:
            names = ", ".join(o for o in options if o is not None)
            raise ValueError(f"must be one of {names}, got {v!r}")
        return s
    return conv


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


_DUR = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.I)
_DUR_MULT = {"ms": 0.001, "s": 1, "": 1, "m": 60, "h": 3600, "d": 86400}


def duration(v: Any) -> float:
    """Seconds: 5, 2.5, "250ms", "10m", "7d"."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
        return float(v)
    m = _DUR.match(str(v))
    if not m:
        raise ValueError(f"expected a duration like 250ms, 10s, 10m or 7d, got {v!r}")
    return float(m.group(1)) * _DUR_MULT[(m.group(2) or "").lower()]


def string(v: Any) -> str:
    if not isinstance(v, (str, int, float)) or isinstance(v, bool):
        raise ValueError(f"expected a string, got {v!r}")
    return str(v)


def opt_string(v: Any) -> str | None:
    return None if v is None or v == "" else string(v)


def string_list(v: Any) -> list[str]:
    if isinstance(v, str):
        return [s for s in (x.strip() for x in v.split(",")) if s] if "://" not in v else [v]
    if isinstance(v, (list, tuple)):
        return [string(x) for x in v]
    raise ValueError(f"expected a list of strings, got {v!r}")


def rpc_methods(v: Any) -> list[str]:
    """samwise rpc method names (``exchange.declare``, ``exchange.delete``)."""
    from ..samwise.config import RPC_METHODS
    items = [] if v in ("", None) else string_list(v)
    for m in items:
        if m not in RPC_METHODS:
            raise ValueError(f"unknown rpc method {m!r} (known: {', '.join(RPC_METHODS)})")
    return items
