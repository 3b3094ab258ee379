"""Help text for operators: reST markup removed, sizes and durations in human units."""

from __future__ import annotations

import re
from typing import Any

from ..units import duration, human_duration, human_size, size
from .settings import BY_NAME, SETTING_FIELDS

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


def display_value(name: str, value: Any) -> str:
    """A setting's value as an operator reads it: sizes in KiB/MiB/GiB, durations in
    ms/s/min/h/d, lists comma-separated, None as 'off'."""
    f = BY_NAME.get(name)
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
