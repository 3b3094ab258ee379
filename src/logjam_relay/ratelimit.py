"""Rate-limited logging for bad input: a few lines per reason per interval, then a summary."""

from __future__ import annotations

import logging
import re
import time

# C0 controls (newline, carriage return, ESC...), DEL, C1 controls and the Unicode line
# separators: what lets a client forge a log line or drive the operator's terminal.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
MAX_FIELD = 256


def _esc(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control character written as ``\\xNN`` (one line, no escapes)."""
    return _CONTROLS.sub(_esc, text)


def safe(value, limit: int = MAX_FIELD) -> str:
    """Client-chosen bytes or text made fit for a log line.

    Bytes that are not UTF-8 and every control character (newline, ESC...) become
    ``\\xNN``; anything longer than ``limit`` characters is cut, with the full length
    noted, so one client cannot forge lines, move the cursor or flood a line.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        n = len(raw)
        text = raw[:limit * 4].decode("utf-8", "backslashreplace")
    else:
        text = str(value)
        n = len(text)
    cut = len(text) > limit
    text = escape_controls(text[:limit])
    if cut:
        text += f"...({n} {'bytes' if isinstance(value, (bytes, bytearray, memoryview)) else 'chars'})"
    return text


class RateLimitedLog:
    """Log at most ``burst`` lines per ``reason`` every ``interval`` seconds.

    Suppressed lines are counted and reported in the next line that gets through.
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0, burst: int = 5,
                 clock=time.monotonic):
        self.logger = logger
        self.interval = interval
        self.burst = burst
        self._clock = clock
        self._windows: dict[str, list] = {}  # reason -> [window_start, count_in_window, suppressed]

    def log(self, level: int, reason: str, msg: str, *args) -> None:
        now = self._clock()
        w = self._windows.get(reason)
        if w is None or now - w[0] >= self.interval:
            suppressed = w[2] if w is not None else 0
            w = self._windows[reason] = [now, 0, 0]
            if suppressed:
                self.logger.log(level, "%s: %d similar messages suppressed", reason, suppressed)
        if w[1] < self.burst:
            w[1] += 1
            # bad input is what this class logs: every text argument may be client-chosen
            self.logger.log(level, msg, *[safe(a) if isinstance(a, (str, bytes, bytearray))
                                          else a for a in args])
        else:
            w[2] += 1

    def warning(self, reason: str, msg: str, *args) -> None:
        self.log(logging.WARNING, reason, msg, *args)

    def error(self, reason: str, msg: str, *args) -> None:
        self.log(logging.ERROR, reason, msg, *args)
