"""Help text for operators: reST markup removed, sizes and durations in human units."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_EMPH = re.compile(r"(?<![`\w])`([^`]+)`(?![`\w])")


def plain(doc: str | None) -> str:
    """A module docstring as argparse description: no ``literal``, :role:`x` or `x` markup."""
    if not doc:
        return ""
    text = _ROLE.sub(r"\1", doc)
    text = _LITERAL.sub(r"\1", text)
    return _EMPH.sub(r"\1", text)


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


def display_value(name: str, value: Any) -> str:
    """A setting's value as an operator reads it: sizes in KiB/MiB/GiB, durations in
    ms/s/min/h/d, lists comma-separated, None as 'off'."""
    from .config import _BY_NAME, duration, size
    f = _BY_NAME.get(name)
    conv = f.metadata["conv"] if f is not None else None
    if value is None:
        return "off"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) if value else "none"
    if conv is size:
        return human_size(value)
    if conv is duration or (f is not None and f.metadata["metavar"] == "SECONDS"):
        return human_duration(value)
    return str(value)


def effective_values(s) -> list[tuple[str, str, str]]:
    """(name, value as displayed, source) of every setting, with what the relay will really
    use: the resolved state_dir, spool_dir and fqdn rather than their unset defaults."""
    from .config import SETTING_FIELDS
    out = []
    for f in SETTING_FIELDS:
        name, value = f.name, getattr(s, f.name)
        shown = display_value(name, value)
        if name == "state_dir" and value is None:
            shown = f"{s.resolved_state_dir()} (resolved)"
        elif name == "fqdn" and value is None:
            shown = f"{s.resolved_fqdn()} (resolved)"
        elif name == "spool_dir" and value is None:
            sd = s.resolved_spool_dir()
            shown = f"{sd} (resolved)" if sd else "off (no output or archive configured)"
        elif value is None:
            # the help says what an unset value stands for, e.g. <state_dir>/dead-letters
            m = re.search(r"\(default:? ([^)]*)\)", f.metadata["help"])
            if m:
                shown = f"unset: {m.group(1)}"
        out.append((name, shown, s.source_label(name)))
    return out
