"""fdatasync off the event loop, handed back without the GIL: the I/O adapter of the
group commit's syncs (:meth:`SegmentWriter.sync_async
<logjam_relay.spool.writer.SegmentWriter.sync_async>`).

:class:`SyncThread` owns a thread of its own (``_syncthread.c``, POSIX, never takes the
GIL) and an eventfd: :meth:`SyncThread.fdatasync` hands the thread a descriptor, waits on
the eventfd in trio (``wait_readable``) and raises the thread's errno as ``OSError``.
With ``trio.to_thread.run_sync`` the worker thread has to take the GIL to report back
(through ``run_sync_soon``), while a busy relay's ingest holds it; measured at 100k msg/s
on a 2-core machine (bench/stall_trace.py, ``--fsync batch``): fdatasync took 0.57 ms at
the median and ``sync_async`` 1.20 ms -- half a round was the hand-back.

A round after a segment roll owes more than the active segment's fdatasync: the closed
segment's records (its seal record may not be synced yet) and the directory's fsync (the
new segment's name).  :meth:`SyncThread.start_many` hands them over as one job, synced in
order by the same thread; before, the round waited for the seal's and the directory's
fsyncs in trio's worker threads, and on a busy event loop every one of their calls that
gave the GIL away waited for it again (a switch interval, 5 ms): ~100 ms per roll at 100k
msg/s, one message per ingest pass (docs/spool-format.md, the `batch` 202's stall).

One sync at a time: while one is in flight (two tasks sync at once, rare) the second goes
to a worker thread as before (the writer asks :meth:`SyncThread.busy` first).  A
cancelled wait still waits for the thread (shielded) and returns its result, as
``to_thread.run_sync`` does; the cancel is seen at the next checkpoint: the descriptor
must not be closed while the thread syncs it.  (No cancel
scope on the common path: measured, entering and leaving one per round was a visible part
of the loop's time.)

Without the C extension (no compiler at install, ``LOGJAM_RELAY_PURE_PYTHON=1``) or with
``LOGJAM_RELAY_SYNC_THREAD=0``, :func:`make` returns None and the writer uses
``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import os

import trio

from .. import _native

_c = _native.load("logjam_relay.spool._syncthread")

#: the C extension is there (it may still be switched off: :data:`OFF_REASON`)
BUILT = _c is not None
#: why the C thread is not used ("" when it is)
OFF_REASON = ""
if _c is None:
    OFF_REASON = ("LOGJAM_RELAY_PURE_PYTHON is set" if _native.PURE_PYTHON
                  else "the C extension _syncthread is not built")
elif not hasattr(os, "eventfd"):
    OFF_REASON = "no eventfd on this system"
elif os.environ.get("LOGJAM_RELAY_SYNC_THREAD", "").strip().lower() in ("0", "false", "no",
                                                                       "off"):
    OFF_REASON = "LOGJAM_RELAY_SYNC_THREAD=0"


#: the most descriptors one job of :meth:`SyncThread.start_many` syncs (``_syncthread.c``)
MAX_ITEMS = 16


class SyncThread:
    """fdatasync in the C thread; see the module text."""

    def __init__(self) -> None:
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            self._c = _c.Syncer(self._efd)
        except BaseException:
            os.close(self._efd)
            raise
        self.closed = False

    @property
    def jobs(self) -> int:
        """Syncs the thread finished."""
        return self._c.jobs

    def busy(self) -> bool:
        return self.closed or self._c.busy

    def done(self) -> bool:
        """The sync handed over is done and its result not yet taken (:meth:`finish`
        returns without waiting)."""
        return not self.closed and self._c.done

    async def fdatasync(self, fd: int) -> float:
        """fdatasync ``fd`` in the thread (``OSError`` as ``os.fdatasync`` raises it);
        returns the seconds the syscall took.  The caller checks :meth:`busy` first; ``fd``
        stays open until this returns."""
        await trio.lowlevel.checkpoint_if_cancelled()   # as to_thread.run_sync does
        self.start(fd)
        return await self.finish()

    def start(self, fd: int) -> None:
        """Hand ``fd`` to the thread (its fdatasync starts now); :meth:`finish` waits for
        it.  The caller checks :meth:`busy` first and keeps ``fd`` open until
        :meth:`finish` returned or raised."""
        self._c.submit(fd)

    def start_many(self, datasync: list[int], fsync: list[int]) -> None:
        """As :meth:`start`, one job of several syncs, in order: ``fdatasync`` each of
        ``datasync``, then ``fsync`` each of ``fsync`` (a directory); at most
        :data:`MAX_ITEMS` together.  An error ends the job: :meth:`finish` raises it with
        ``sync_index``, the failed descriptor's index in ``datasync + fsync``."""
        self._c.submit_many(datasync, fsync)

    async def finish(self) -> float:
        """Wait for the sync :meth:`start` handed over; as :meth:`fdatasync` returns."""
        try:
            res = await self._result()
        except BaseException as e:
            # the descriptor is in use until the thread is done with it: wait for it.  As
            # with to_thread.run_sync, a cancel lets the result stand (the caller may
            # release what it made durable) and is seen at the caller's next checkpoint
            # (trio's cancellation is level-triggered); anything else (KeyboardInterrupt)
            # goes on once the thread is done, and its result is taken (the thread is
            # free for the next sync)
            with trio.CancelScope(shield=True):
                res = await self._result()
            if not isinstance(e, trio.Cancelled):
                raise
        err, seconds, index = res
        if err:
            e = OSError(err, os.strerror(err))
            e.sync_index = index
            raise e
        return seconds

    async def _result(self) -> tuple[int, float, int]:
        """Wait for the job's result.  A wake-up may be left from a job that was done
        before its caller looked (the eventfd was not read then): one more turn."""
        c = self._c
        efd = self._efd
        while (res := c.result()) is None:
            try:
                await trio.lowlevel.wait_readable(efd)
            except trio.ClosedResourceError:
                pass
            if self.closed:
                # close() ran meanwhile (before or after the wake-up): it joined the
                # thread, so the result is there; the eventfd's number may already be
                # another file's -- not to be read
                continue
            try:
                os.eventfd_read(efd)                # consume the wake-up
            except BlockingIOError:
                pass                                # none left (another turn took it)
        return res

    def close(self) -> None:
        """End the thread (after a sync in flight) and close the eventfd.  From the trio
        thread (a caller waiting on the eventfd is woken through ``notify_closing``)."""
        if self.closed:
            return
        self.closed = True
        self._c.close()
        try:
            trio.lowlevel.notify_closing(self._efd)
        except RuntimeError:
            pass                                    # not in a trio thread
        os.close(self._efd)


    def __del__(self) -> None:
        # dropped without close() (an owner that never closed it): the thread first (it
        # may still write to the eventfd), then the eventfd -- nothing else closes it
        if getattr(self, "closed", True):
            return
        self.closed = True
        self._c.close()
        try:
            os.close(self._efd)
        except OSError:
            pass


def make() -> SyncThread | None:
    """A :class:`SyncThread`, or None where it cannot be used (:data:`OFF_REASON`)."""
    if OFF_REASON:
        return None
    return SyncThread()
