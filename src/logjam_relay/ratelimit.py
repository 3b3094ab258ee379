"""Rate-limited logging for bad input: a few lines per reason per interval, then a summary."""

from __future__ import annotations

import logging
import time


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
            self.logger.log(level, msg, *args)
        else:
            w[2] += 1

    def warning(self, reason: str, msg: str, *args) -> None:
        self.log(logging.WARNING, reason, msg, *args)

    def error(self, reason: str, msg: str, *args) -> None:
        self.log(logging.ERROR, reason, msg, *args)
