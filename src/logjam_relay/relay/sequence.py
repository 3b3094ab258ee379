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

After a crash, :meth:`SequenceState.skipped` gives the numbers that were reserved but,
as far as the spool and the state file tell, never used: the relay spools a restart
marker naming them (relay/ticker.py, docs/spool-format.md "Restart marker").
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import threading
import time
from pathlib import Path

import trio

from ..fdreserve import RESERVE as _FDS

log = logging.getLogger("logjam_relay.sequence")

MAX_SEQUENCE = 2**64 - 1


_LOSS = "the sequence state could not be kept (numbers would be reused after a restart)"


class StateDirError(OSError):
    """The state directory cannot hold the sequence state: unwritable, or locked by another
    relay with the same device id.  ``cause`` is the operator-facing reason."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


class SequenceState:
    def __init__(self, path: Path | None, device: int, *, min_reserve: int = 100_000):
        self.path = path
        self.device = device
        self.min_reserve = min_reserve
        self.last = 0           # last number handed out
        self.reserved = 0       # persisted upper bound while running
        self.recovered_from = "none"   # none | clean | crash | spool
        self._skipped: tuple[int, int] | None = None    # set by load() after a crash
        self.write_errors = 0
        self._lock_fd: int | None = None
        # reserve_async writes from a worker thread: one writer at a time, and a
        # reservation never replaces a higher one already on disk
        self._write_lock = threading.Lock()
        self._on_disk_reserved = 0

    # ---------------------------------------------------------------- locking
    @property
    def lock_path(self) -> Path | None:
        return None if self.path is None else self.path.with_suffix(".lock")

    def acquire(self) -> None:
        """Create the directory, take the OS lock and prove the state can be written.

        The lock (``flock`` on ``sequence-device-N.lock``) is held until :meth:`release`
        or the process ends, however it ends: a second relay with the same state
        directory and device id cannot run, so the two can never hand out the same
        numbers.  Raises :class:`StateDirError` with the cause.
        """
        if self.path is None or self._lock_fd is not None:
            return
        d = self.path.parent
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StateDirError(f"cannot create the directory ({_why(e)}): {_LOSS}") from None
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StateDirError(f"cannot write in it ({_why(e)}): {_LOSS}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            try:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            except OSError:
                pass
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StateDirError(
                    f"locked by another relay with device_id {self.device}"
                    f"{f' (pid {holder})' if holder.isdigit() else ''}: two relays must not "
                    "share a state directory and device id") from None
            raise StateDirError(f"cannot lock {self.lock_path.name} ({_why(e)})") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            probe = self.path.with_suffix(".probe")
            with open(probe, "w") as fh:
                fh.write("probe")
                fh.flush()
                os.fsync(fh.fileno())
            os.unlink(probe)
        except OSError as e:
            os.close(fd)
            raise StateDirError(f"cannot write in it ({_why(e)}): {_LOSS}") from None
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---------------------------------------------------------------- loading
    def load(self, spool_last: int | None = None) -> int:
        """Read the state file; return the first number to use next."""
        data = None
        if self.path is not None and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                int(data.get("sequence", 0)), int(data.get("reserved", 0))     # numbers?
                if int(data.get("device", self.device)) != self.device:
                    log.warning("state file %s is for device %s, not %s: starting at 1",
                                self.path, data.get("device"), self.device)
                    data = None
            except (OSError, ValueError, TypeError, AttributeError) as e:
                # the next number is unknown: starting at 1 could reuse numbers importers
                # have seen, so refuse (the operator moves the file aside to accept that)
                raise StateDirError(
                    f"state file {self.path.name} is unreadable ({e}): the next sequence "
                    "number is unknown and numbers could be reused; move the file aside "
                    "to start again at 1") from None
        last = 0
        used = 0                # the highest number known to have been handed out
        self._skipped = None
        if data is not None:
            if data.get("clean"):
                last = int(data.get("sequence", 0))
                self.recovered_from = "clean"
            else:
                used = int(data.get("sequence", 0))
                last = max(used, int(data.get("reserved", 0)))
                self.recovered_from = "crash"
                log.warning("relay did not shut down cleanly: continuing after the reserved "
                            "sequence number %d (importers will see a gap)", last)
        if spool_last is not None and spool_last > last:
            last = spool_last
            self.recovered_from = "spool"
        if last >= MAX_SEQUENCE:
            last = 0
        if self.recovered_from == "crash":
            used = max(used, spool_last or 0)
            if used + 1 <= last:
                self._skipped = (used + 1, last)
        self.last = last
        return last + 1

    def skipped(self) -> tuple[int, int] | None:
        """After :meth:`load` found a crash: ``(first, last)``, the numbers this start
        skips (they were reserved before the crash, and neither the spool nor the state
        file's last checkpoint shows them used): from 1 + the highest number known to
        have been used (the spool's last sequence, the state file's ``sequence``) to the
        number before the one :meth:`load` returned.  None after a clean stop, without
        state, when the spool is ahead of the state file, or when nothing was skipped."""
        return self._skipped

    # --------------------------------------------------------------- writing
    def _write(self, payload: dict) -> None:
        with self._write_lock:
            reserved = payload.get("reserved")
            if reserved is not None and reserved < self._on_disk_reserved:
                return                          # a higher reservation is on disk already
            self._write_locked(payload)
            if reserved is not None:
                self._on_disk_reserved = reserved

    def _write_locked(self, payload: dict) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # from the fd reserve when the relay is out of descriptors (fdreserve.py)
            fd = _FDS.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                data = json.dumps(payload).encode()
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, "short write of the sequence state")
                os.fsync(fd)
            finally:
                _FDS.close(fd)
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

    async def reserve_async(self, current: int, rate_hint: int = 0) -> int:
        """:meth:`reserve` with the write and its fsync in a worker thread (the event loop
        goes on: an fsync behind a busy disk took milliseconds on the loop).  The new bound
        counts once the call returns; meanwhile the old one holds (the ingest reserves on
        the loop, with :meth:`reserve`, if it reaches it first)."""
        margin = max(self.min_reserve, 4 * rate_hint)
        new = min(current + margin, MAX_SEQUENCE)
        await trio.to_thread.run_sync(
            self._write, {"device": self.device, "sequence": current, "reserved": new,
                          "clean": False, "time": time.time()})
        if new > self.reserved:
            self.reserved = new
        return self.reserved

    def save_clean(self, last: int) -> None:
        self.last = last
        self._write({"device": self.device, "sequence": last, "clean": True,
                     "time": time.time()})


def _why(e: OSError) -> str:
    return (e.strerror or str(e)).lower()
