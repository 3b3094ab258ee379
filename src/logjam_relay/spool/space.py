"""The disk bound and the full disk (:class:`SpaceBudget`).

``block``: ingress pauses while the records the slowest reader has not acknowledged
fill ``max_bytes`` and resumes on the acknowledgement that frees space.  ``drop_oldest``:
the oldest segments are dropped (budget, or ENOSPC); the budget picks them
(:meth:`SpaceBudget.to_drop`), the spool drops them and counts what the readers lose.
A full disk never deadlocks: the ``RESERVE`` ballast file is given back so that a segment
can always be sealed, the active segment is sealed at once (so that acknowledging it frees
it) and segments are small for a while.  See docs/spool-format.md, "Disk bound".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import trio

from .fs import Filesystem, unlink_quiet
from .ledger import Ledger, Seg

log = logging.getLogger("logjam_relay.spool")

RESERVE_FILE = "RESERVE"
RESERVE_BYTES = 256 * 1024   # ballast freed when sealing hits a full disk


class SpaceBudget:
    """Limits (``max_bytes``, segment size), the reserve file, the full-disk state, the
    drop policy and the pause of ingress.  ``live_bytes()`` is what the slowest reader
    has not acknowledged (the spool computes it from the readers' cursors)."""

    def __init__(self, directory: str, fs: Filesystem, ledger: Ledger, *, max_bytes: int,
                 policy: str, segment_bytes: int, monotonic: Callable[[], float],
                 live_bytes: Callable[[], int]) -> None:
        self.directory = directory
        self._fs = fs
        self._ledger = ledger
        self.max_bytes = max_bytes
        self.policy = policy
        self.segment_bytes = segment_bytes
        self._mono = monotonic
        self._live_bytes = live_bytes
        self.space = trio.Event()                # set when space was freed
        self.disk_full: str | None = None        # set on ENOSPC, cleared when space is freed
        self.disk_full_at = 0.0
        self.blocked_since: float | None = None
        self.reserve_ok = False
        self.reserve_tried = 0.0
        self._pressure_at: float | None = None
        self._pressure_bytes = segment_bytes
        self.enospc_seals = 0
        self.enospc_drops = 0
        self.reserve_releases = 0

    # -- full disk --------------------------------------------------------------
    def under_pressure(self) -> None:
        """ENOSPC: segments are 1/16 of the configured size and of the file system for
        a minute, so that space is freed (and ``block`` resumes) in small steps."""
        self._pressure_at = self._mono()
        disk = self._fs.disk_bytes(self.directory)
        self._pressure_bytes = max(64 * 1024, min(self.segment_bytes // 16,
                                                  disk // 16 if disk else self.segment_bytes))

    def mark_full(self) -> None:
        self.disk_full = f"disk full (ENOSPC) on {self.directory}"
        self.disk_full_at = self._mono()

    def freed(self) -> None:
        """Space was freed (a segment deleted, an append went through): ingress retries."""
        self.disk_full = None
        self.space.set()

    def segment_limit(self) -> int:
        """Segment size; smaller for a minute after the disk ran full."""
        if self._pressure_at is not None and self._mono() - self._pressure_at < 60.0:
            return min(self.segment_bytes, self._pressure_bytes)
        return self.segment_bytes

    # -- reserve ----------------------------------------------------------------
    def make_reserve(self) -> None:
        """Keep :data:`RESERVE_BYTES` allocated in ``RESERVE`` (not counted in ``bytes``):
        freed when a seal finds the disk full, re-created once there is space again."""
        self.reserve_tried = self._mono()
        fs = self._fs
        path = os.path.join(self.directory, RESERVE_FILE)
        try:
            if fs.getsize(path) >= RESERVE_BYTES:
                self.reserve_ok = True
                return
        except OSError:
            pass
        try:
            fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fs.fallocate(fd, 0, RESERVE_BYTES)
            finally:
                fs.close(fd)
            self.reserve_ok = True
        except OSError:
            unlink_quiet(path, fs)
            self.reserve_ok = False

    def release_reserve(self) -> bool:
        """Give the reserve's space back (a seal found the disk full); False if there is
        none."""
        if not self.reserve_ok:
            return False
        unlink_quiet(os.path.join(self.directory, RESERVE_FILE), self._fs)
        self.reserve_ok = False
        self.reserve_releases += 1
        log.warning("spool: disk full on %s; released the %d-byte reserve to seal a segment",
                    self.directory, RESERVE_BYTES)
        return True

    def reserve_due(self) -> bool:
        """Time to try to re-create the reserve (every 5 s while it is missing)."""
        return not self.reserve_ok and self.disk_full is None and \
            self._mono() - self.reserve_tried >= 5

    # -- the bound --------------------------------------------------------------
    def would_block(self) -> bool:
        """True if ingress should pause: the disk is full, or with the ``block`` policy
        the unacknowledged records take ``max_bytes``."""
        if self.disk_full is not None:
            return True
        return self.policy == "block" and self._ledger.bytes >= self.max_bytes and \
            self._live_bytes() >= self.max_bytes

    def paused_reason(self) -> str | None:
        """Why ingress is paused (for ``/readyz``), or None."""
        if self.disk_full is not None:
            return self.disk_full
        if self.policy == "block" and self._ledger.bytes >= self.max_bytes:
            live = self._live_bytes()
            if live >= self.max_bytes:
                return f"spool full ({_size(live)} of {_size(self.max_bytes)}) on " \
                       f"{self.directory}: ingress paused until outputs catch up"
        return None

    @property
    def full(self) -> bool:
        return self._ledger.bytes >= self.max_bytes

    async def wait_writable(self) -> None:
        """Return once :meth:`would_block` is false.  After a full disk it returns at
        least once a second so that the caller retries (space may be freed outside)."""
        if self.would_block() and self.blocked_since is None:
            self.blocked_since = self._mono()
        try:
            while self.would_block():
                self.space = trio.Event() if self.space.is_set() else self.space
                if self.disk_full is not None:
                    with trio.move_on_after(1.0):
                        await self.space.wait()
                    break
                await self.space.wait()
        finally:
            self.blocked_since = None
        await trio.lowlevel.checkpoint()

    def blocked_in_progress(self) -> float:
        """Seconds the current pause (in :meth:`wait_writable`) has lasted so far."""
        since = self.blocked_since
        return 0.0 if since is None else max(0.0, self._mono() - since)

    def to_drop(self, need: int, active: Seg | None) -> list[Seg]:
        """``drop_oldest``: the oldest segments to drop so that ``need`` more bytes stay
        under ``max_bytes`` (never the active one)."""
        drop = []
        total = self._ledger.bytes
        for seg in self._ledger.segs.values():
            if total + need <= self.max_bytes or seg is active:
                break
            drop.append(seg)
            total -= seg.size
        return drop


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)
