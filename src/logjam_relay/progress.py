"""A one-line progress display for long commands, on a terminal only.

``Progress(label)`` draws ``label: 12/40 segments (30 %) · 3.2 s · note`` on standard
error, redrawn in place (carriage return, erase to the end of the line) at most every
``interval`` seconds, and erases it when done.  When the stream is not a terminal (piped,
redirected to a file, captured) it writes nothing at all, so logs and pipes stay clean:
the command's real output (stdout, and its own log lines) is never changed by it.

    with Progress("spool fsck", unit="segments", total=n) as p:
        for i, seg in enumerate(segs, 1):
            ...
            p.update(i, note=seg)

Lines that a command prints while a progress line is shown go through :meth:`print` (or
call :meth:`clear` first), so that they do not end up glued to the progress text.
Thread-safe: a background thread may :meth:`update` while the main thread prints.
"""

from __future__ import annotations

import sys
import threading
import time

ERASE = "\r\x1b[K"


def on_terminal(stream) -> bool:
    """Whether ``stream`` is an interactive terminal (not a pipe, a file or a capture)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class Progress:
    def __init__(self, label: str, *, total: int | None = None, unit: str = "",
                 stream=None, enabled: bool | None = None, interval: float = 0.2,
                 clock=time.monotonic):
        self.label = label
        self.total = total
        self.unit = unit
        self.stream = sys.stderr if stream is None else stream
        self.enabled = on_terminal(self.stream) if enabled is None else enabled
        self.interval = interval
        self.clock = clock
        self.done: int | None = None
        self.note = ""
        self._t0 = clock()
        self._last = None           # time of the last draw (None: nothing drawn yet)
        self._shown = False         # a line is on the screen
        self._closed = False
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- state

    def update(self, done: int | None = None, *, total: int | None = None,
               note: str | None = None, force: bool = False) -> None:
        """New figures; redrawn when ``interval`` has passed since the last draw (the first
        update is always drawn), or with ``force``."""
        if not self.enabled or self._closed:
            return
        with self._lock:
            if done is not None:
                self.done = done
            if total is not None:
                self.total = total
            if note is not None:
                self.note = note
            now = self.clock()
            if force or self._last is None or now - self._last >= self.interval:
                self._draw(now)

    def text(self, now: float | None = None) -> str:
        parts = []
        if self.done is not None:
            if self.total:
                pct = 100.0 * self.done / self.total
                parts.append(f"{self.done:,}/{self.total:,} {self.unit}".rstrip()
                             + f" ({pct:.0f} %)")
            else:
                parts.append(f"{self.done:,} {self.unit}".rstrip())
        parts.append(f"{(self.clock() if now is None else now) - self._t0:.1f} s")
        if self.note:
            parts.append(self.note)
        return f"{self.label}: " + " · ".join(parts)

    # ---------------------------------------------------------------- output

    def _write(self, s: str) -> None:
        try:
            self.stream.write(s)
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False        # the terminal went away: stop drawing

    def _draw(self, now: float) -> None:
        line = self.text(now)
        width = _columns(self.stream)
        if width and len(line) >= width:
            line = line[:width - 2] + "…"
        self._write(ERASE + line)
        self._last = now
        self._shown = True

    def clear(self) -> None:
        """Erase the progress line (it comes back at the next update)."""
        if not self.enabled:
            return
        with self._lock:
            if self._shown:
                self._write(ERASE)
                self._shown = False
                self._last = None

    def print(self, *args, file=None, **kw) -> None:
        """``print`` that first erases the progress line."""
        self.clear()
        print(*args, file=file, flush=True, **kw)

    def close(self) -> None:
        """Draw the final figures once, then erase the line (again: nothing)."""
        if not self.enabled or self._closed:
            return
        self.update(force=True)
        self.clear()
        self._closed = True         # later updates draw nothing

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _columns(stream) -> int:
    import os
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0
