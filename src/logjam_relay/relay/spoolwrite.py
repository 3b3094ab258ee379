"""The ingest's writes into the spool outside the group commit, and the time ingress was
paused for the spool (:class:`SpoolWrites`).

A committed batch is appended before its replies leave, so a 202 always means "in the spool".  On a
write error the batch is kept and ingress pauses, retried with a backoff (or at once when
the spool frees space); during shutdown it is given up after one more attempt (the batch
was published on PUB, not spooled).  Failures and paused time are counted here
(``logjam_relay_spool_write_errors_total``, ``logjam_relay_spool_blocked_seconds``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from ..ratelimit import RateLimitedLog
from ..spool.fsyncpolicy import FsyncPolicy
from ..spool.spool import SpoolWriteError

log = logging.getLogger("logjam_relay.relay")
rlog = RateLimitedLog(log)


def relay_fsync_policy(settings) -> FsyncPolicy:
    """The relay spool's fsync policy (spool_fsync, spool_fsync_interval): off the loop.
    ``batch``: the group commit awaits the fdatasync before the replies leave
    (relay/groupcommit.py); ``interval``: ``Spool.run`` syncs in a worker thread."""
    return FsyncPolicy(settings.spool_fsync, settings.spool_fsync_interval, off_loop=True)


def samwise_fsync_policy(settings) -> FsyncPolicy:
    """The samwise spool's: the same settings, inline.  Its endpoint answers a request
    once ``append`` returned, and no group commit waits for an off-loop fdatasync, so
    the append syncs itself (docs/architecture.md, "Who owns what")."""
    return FsyncPolicy(settings.spool_fsync, settings.spool_fsync_interval)


class SpoolWrites:
    def __init__(self, stopping: Callable[[], bool]):
        self._stopping = stopping
        self.failures = 0
        self.blocked_seconds = 0.0

    async def paused(self, wait: Callable[[], Awaitable[object]]) -> None:
        """``await wait()``, counted as time ingress was paused."""
        t0 = trio.current_time()
        try:
            await wait()
        finally:
            self.blocked_seconds += trio.current_time() - t0

    def failed(self, e) -> None:
        """The group commit's append or fdatasync failed (retried, ingress paused
        meanwhile)."""
        self.failures += 1
        rlog.error("spool_write", "spool write or sync failed (%s): %s; ingress paused, "
                   "retrying", getattr(e, "reason", "io"), e)

    async def write(self, spool, records: list[tuple] | None, encoded: tuple | None = None,
                    *, failed: SpoolWriteError | None = None) -> bool:
        """Append a committed batch (``records``, or ``encoded``: ``(data, n, first_seq,
        last_meta)``, records the C PULL pass encoded), retried until it is in the spool
        (True); False only when shutting down gave up on it.  ``failed``: the caller's
        first attempt failed with it (counted, logged and retried here).  The caller is
        shielded from cancellation."""
        delay = 0.05
        while True:
            if failed is None:
                try:
                    if encoded is not None:
                        spool.append_encoded(*encoded)
                    else:
                        spool.append_batch(records)
                    return True
                except SpoolWriteError as e:
                    failed = e
            self.failures += 1
            rlog.error("spool_write", "spool write failed (%s): %s; ingress paused, retrying",
                       failed.reason, failed)
            failed = None
            if self._stopping():
                return False
            # paused (counted in blocked_seconds while it lasts); retried at once when
            # the spool frees space, else after the backoff
            t0 = trio.current_time()
            with trio.move_on_after(delay):
                if spool.would_block():
                    await spool.wait_writable()
                else:
                    await trio.sleep(delay)
            self.blocked_seconds += trio.current_time() - t0
            delay = min(delay * 2, 2.0)
