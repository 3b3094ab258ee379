"""The log format, one for every process of the relay (the relay and its output workers).

``text`` (the default): ``2026-11-22 21:09:31,123 [W] logjam_relay.outputs.lumberjack:
message``; ``json`` (``log_format = "json"``): one JSON object a line with ``time``,
``level``, ``logger``, ``message`` (``exc`` with a traceback) and, in an output worker,
``worker`` (the output's name).  Control characters in a message are escaped in both, so
a client cannot forge a line; secrets are redacted in both (``redact``).

:func:`setup` installs the format on the root logger; :func:`current_format` tells what
the relay runs with, so that it can hand the same to the workers it starts.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys

from ..ratelimit import escape_controls
from ..redact import install_log_redaction, redact_exceptions

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s [%(levelname).1s] %(name)s: %(message)s"

_current = "text"


def iso_time(created: float) -> str:
    """ISO-8601 UTC with milliseconds: 2026-11-22T21:09:31.123Z."""
    t = datetime.datetime.fromtimestamp(created, datetime.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


class JSONFormatter(logging.Formatter):
    def __init__(self, worker: str | None = None):
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        # json.dumps escapes every control character: no line can be forged
        d = {"time": iso_time(record.created), "level": record.levelname,
             "logger": record.name, "message": record.getMessage()}
        if self.worker is not None:
            d["worker"] = self.worker
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d)


class TextFormatter(logging.Formatter):
    """One record, one line: control characters in the message (client-chosen bytes that
    reached it) are escaped as \\xNN, so nobody can forge a line or send terminal escapes."""

    def __init__(self, fmt: str = TEXT_FORMAT):
        super().__init__(fmt)

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


def setup(level: int, fmt: str = "text", worker: str | None = None) -> logging.Handler:
    """Log records of ``level`` and above to stderr in ``fmt`` (text or json); returns the
    handler (the root logger's only one)."""
    global _current
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: want one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter(worker) if fmt == "json" else TextFormatter())
    install_log_redaction()
    redact_exceptions(handler.formatter)        # tracebacks too
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    _current = fmt
    return handler


def current_format() -> str:
    """The format :func:`setup` last installed in this process (``text`` before)."""
    return _current
