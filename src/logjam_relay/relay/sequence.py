"""The device's sequence number, persisted so a restart neither wraps nor reuses numbers.

logjam-device starts at 1 after every restart, which importers read as a device
restart (or a wrap).  The relay keeps a small state file per device:

* on a **clean shutdown** it writes the last used number with ``clean: true``;
  the next start continues at exactly ``last + 1``;
* while running it writes a **reservation** ("hi-lo" allocation): a number
  ``reserved`` that the running relay will not pass without writing a new
  reservation first.  After a crash the next start continues at
  ``reserved + 1`` (or after the last number found in the spool, whichever is
  higher), so a number is never handed out twice; the price is a visible gap,
  which is the honest signal that a crash may have lost messages.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("logjam_relay.sequence")

MAX_SEQUENCE = 2**64 - 1


class SequenceState:
    def __init__(self, path: Path | None, device: int, *, min_reserve: int = 100_000):
        self.path = path
        self.device = device
        self.min_reserve = min_reserve
        self.last = 0           # last number handed out
        self.reserved = 0       # persisted upper bound while running
        self.recovered_from = "none"   # none | clean | crash | spool
        self.write_errors = 0

    # ---------------------------------------------------------------- loading
    def load(self, spool_last: int | None = None) -> int:
        """Read the state file; return the first number to use next."""
        data = None
        if self.path is not None and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                if int(data.get("device", self.device)) != self.device:
                    log.warning("state file %s is for device %s, not %s: starting at 1",
                                self.path, data.get("device"), self.device)
                    data = None
            except (OSError, ValueError, TypeError) as e:
                log.warning("state file %s unreadable (%s): starting at 1", self.path, e)
                data = None
        last = 0
        if data is not None:
            if data.get("clean"):
                last = int(data.get("sequence", 0))
                self.recovered_from = "clean"
            else:
                last = max(int(data.get("sequence", 0)), int(data.get("reserved", 0)))
                self.recovered_from = "crash"
                log.warning("relay did not shut down cleanly: continuing after the reserved "
                            "sequence number %d (importers will see a gap)", last)
        if spool_last is not None and spool_last > last:
            last = spool_last
            self.recovered_from = "spool"
        if last >= MAX_SEQUENCE:
            last = 0
        self.last = last
        return last + 1

    # --------------------------------------------------------------- writing
    def _write(self, payload: dict) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as fh:
                json.dump(payload, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            self.write_errors += 1
            if self.write_errors in (1, 10, 100) or self.write_errors % 1000 == 0:
                log.error("cannot write sequence state %s: %s", self.path, e)

    def reserve(self, current: int, rate_hint: int = 0) -> int:
        """Persist a reservation above ``current``; returns the new bound."""
        margin = max(self.min_reserve, 4 * rate_hint)
        self.reserved = min(current + margin, MAX_SEQUENCE)
        self._write({"device": self.device, "sequence": current, "reserved": self.reserved,
                     "clean": False, "time": time.time()})
        return self.reserved

    def save_clean(self, last: int) -> None:
        self.last = last
        self._write({"device": self.device, "sequence": last, "clean": True,
                     "time": time.time()})
