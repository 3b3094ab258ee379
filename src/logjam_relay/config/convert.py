"""Converters: a raw value (TOML, environment, flag) to a validated setting value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..units import duration, size  # noqa: F401  (converters of the table, re-exported)

# ----------------------------------------------------------------- converters

def integer(lo: int | None = None, hi: int | None = None) -> Callable[[Any], int]:
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
    return integer(0, 65535)(v)


def number(lo: float = 0.0) -> Callable[[Any], float]:
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
