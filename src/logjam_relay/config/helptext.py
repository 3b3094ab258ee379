"""Help text for operators: reST markup removed, sizes and durations in human units."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..units import duration, human_duration, human_size, size
from .settings import BY_NAME, RESOLVED, SETTING_FIELDS

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


_DEFAULT_TEXT = re.compile(r"\(default:? ([^)]*)\)")


def has_default_text(help_text: str) -> bool:
    """Whether a setting's help already says its default, ``(default: ...)``."""
    return _DEFAULT_TEXT.search(help_text) is not None


def default_text(defaults, name: str) -> str:
    """A setting's default for --help: its value, and what the relay makes of it when that
    is a stand-in (``zmq_max_msg_bytes``: ``0 B, which is 40 MiB``)."""
    raw = getattr(defaults, name)
    text = display_value(name, raw)
    if name in RESOLVED:
        eff = defaults.effective(name)
        if eff is not None and str(eff) != str(raw):
            text += f", which is {display_value(name, eff)}"
    return text


def effective_values(s, resolved: Mapping[str, Any] | None = None) -> list[tuple[str, str, str]]:
    """(name, value as displayed, source) of every setting, with what the relay will really
    use: a setting of :data:`~logjam_relay.config.settings.RESOLVED` (an unset
    ``state_dir``, ``spool_dir``, ``fqdn``, ``zmq_max_msg_bytes``...) as its ``resolved_*``
    method makes it, marked ``(resolved)``.  ``resolved`` adds values that the subsystems
    resolve (the composition root passes them, e.g. ``cmdp_name``)."""
    resolved = resolved or {}
    out = []
    for f in SETTING_FIELDS:
        name, value = f.name, getattr(s, f.name)
        shown = display_value(name, value)
        if name in resolved or name in RESOLVED:
            eff = resolved[name] if name in resolved else s.effective(name)
            if eff is None:
                shown = "off (no output, input or archive configured)" \
                    if name == "spool_dir" else shown
            elif str(eff) != str(value):
                shown = f"{display_value(name, eff)} (resolved)"
        elif value is None:
            # the help says what an unset value stands for, e.g. all interfaces
            m = _DEFAULT_TEXT.search(f.metadata["help"])
            if m:
                shown = f"unset: {m.group(1)}"
        out.append((name, shown, s.source_label(name)))
    return out
