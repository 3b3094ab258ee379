"""The kernel's writeback of appended ranges (:class:`Writeback`) and the timing of the
appends' fdatasyncs (:class:`SyncTimes`, :func:`timed_fdatasync`): helpers of the segment
writer (writer.py) that own their own thread or counters and touch no segment state.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque

from .fs import Filesystem

#: fsync="interval": the appends are handed to the kernel's writeback every this many bytes
#: (2026-11-26, 200k msg/s of 300 B: the interval fdatasync 4-31 ms -> 1-1.5 ms, the
#: relay's one-way p99.9 7.1 -> 3.4-3.8 ms, bench_latency.py)
WRITEBACK_BYTES = 1 << 20
#: ranges handed over and not yet started: more are skipped (advisory)
WRITEBACK_PENDING = 4


class Writeback:
    """The thread that starts the kernel's writeback of appended ranges
    (:meth:`Filesystem.start_writeback`): the call does the block layer's and the file
    system's allocation work in the caller, which is not to be the event loop (on the
    loop it cost the durable ingest ~0.15 us of CPU per message).  A range is handed over
    with the segment's descriptor number, not a duplicate: a duplicate would take a
    descriptor (or the fd reserve's last ones) from a relay at its limit.  Should the
    segment be closed before the thread gets to it, the call fails or starts the writeback
    of whatever file now has that number: harmless, it writes nothing of its own.  At most
    ``WRITEBACK_PENDING`` wait, more are skipped (the hint is advisory)."""

    def __init__(self, fs: Filesystem):
        self._fs = fs
        self._q: deque = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.started = 0          # ranges handed to the kernel
        self.skipped = 0          # not handed over: the thread was behind, or no descriptor

    @property
    def pending(self) -> int:
        return len(self._q)

    def submit(self, fd: int, offset: int, size: int) -> None:
        if self._stop or len(self._q) >= WRITEBACK_PENDING:
            self.skipped += 1
            return
        with self._cv:
            self._q.append((fd, offset, size))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="spool-writeback",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._stop:
                    self._cv.wait()
                if not self._q:
                    return
                fd, offset, size = self._q.popleft()
            try:
                self._fs.start_writeback(fd, offset, size)
                self.started += 1
            except OSError:
                self.skipped += 1

    def close(self, timeout: float = 5.0) -> None:
        """Start what is queued, then end the thread."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)


#: upper bounds (seconds) of the buckets of :class:`SyncTimes`, as etcd's WAL fsync histogram
SYNC_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256,
                0.512, 1.024, 2.048, 4.096)


class SyncTimes:
    """How long the fdatasyncs of appended records took (the syscall alone: what a 202
    under ``batch`` waits for at least), as a histogram: counts per bucket of
    :data:`SYNC_BUCKETS` and above, their sum."""

    __slots__ = ("counts", "sum", "count", "max")

    def __init__(self) -> None:
        self.counts = [0] * (len(SYNC_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0
        self.max = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect_left(SYNC_BUCKETS, seconds)] += 1   # the first bound >= it
        self.sum += seconds
        self.count += 1
        if seconds > self.max:
            self.max = seconds

    def stats(self) -> dict:
        """``{"buckets": {upper bound: cumulative count, ..., inf: count}, "sum", "count"}``."""
        buckets, n = {}, 0
        for le, c in zip((*SYNC_BUCKETS, float("inf")), self.counts, strict=True):
            n += c
            buckets[le] = n
        return {"buckets": buckets, "sum": self.sum, "count": self.count}


def timed_fdatasync(fs: Filesystem, fd: int) -> float:
    """``fs.fdatasync(fd)`` (in a worker thread); returns the seconds it took."""
    t0 = time.perf_counter()
    fs.fdatasync(fd)
    return time.perf_counter() - t0
