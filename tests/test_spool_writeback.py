"""spool_fsync = interval hands the appends to the kernel's writeback every
WRITEBACK_BYTES (spool/writer.py): the ranges are contiguous, start at each new segment
and cover what was appended; batch and never do not; the real call is advisory (a file,
a closed descriptor: no exception), and the records read back are those appended."""

from __future__ import annotations

import os
import time

import pytest

from logjam_relay.spool import fs as spool_fs
from logjam_relay.spool import writer as spool_writer
from logjam_relay.spool.spool import Spool


class RecordingFS(spool_fs.Filesystem):
    def __init__(self):
        self.calls: list[tuple[int, int, int]] = []

    def start_writeback(self, fd: int, offset: int, size: int) -> None:
        self.calls.append((fd, offset, size))
        super().start_writeback(fd, offset, size)


def wait_idle(wb, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while wb.pending:
        assert time.monotonic() - t0 < timeout, "the writeback thread is stuck"
        time.sleep(0.001)


def records(n: int, size: int) -> list[list[bytes]]:
    meta = bytes.fromhex("cabd0001") + bytes(20)
    return [[b"app-env", b"logs.app", (b"%08d" % i) * (size // 8), meta] for i in range(n)]


@pytest.mark.parametrize("fsync", ["interval", "batch", "never"])
def test_interval_hands_appends_to_writeback_in_contiguous_ranges(tmp_path, fsync):
    rfs = RecordingFS()
    sp = Spool(tmp_path / "sp", readers=["a"], fsync=fsync, segment_bytes=4 << 20, fs=rfs)
    try:
        for _ in range(120):                      # 120 x 100 x ~1 KiB: 3 segments of 4 MiB
            sp.append_batch(records(100, 1000))
            wait_idle(sp.writer.writeback)        # a thread behind skips ranges: not here
        rd = sp.reader("a")
        got = []
        while batch := rd.read(10_000):
            got += batch
        assert len(got) == 12_000
    finally:
        sp.close()                                # the writeback thread ends first
    if fsync != "interval":
        assert rfs.calls == []
        return
    wb = sp.writer.writeback
    assert wb.skipped == 0 and wb.started == len(rfs.calls) >= 4
    runs: list[list[tuple[int, int]]] = []      # one per segment: from offset 0
    for _fd, off, size in rfs.calls:
        assert size >= spool_writer.WRITEBACK_BYTES
        if off == 0:
            runs.append([])
        runs[-1].append((off, size))
    assert len(runs) >= 3                     # each new segment starts over at 0
    for ranges in runs:
        for (o1, s1), (o2, _) in zip(ranges, ranges[1:], strict=False):
            assert o2 == o1 + s1               # contiguous, nothing skipped
        assert ranges[-1][0] + ranges[-1][1] <= 4 << 20


def test_the_real_call_is_advisory(tmp_path):
    p = tmp_path / "f"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"x" * 100_000)
        spool_fs.OS.start_writeback(fd, 0, 100_000)
        spool_fs.OS.start_writeback(fd, 50_000, 1 << 30)    # past the end
    finally:
        os.close(fd)
    spool_fs.OS.start_writeback(fd, 0, 10)                  # closed: EBADF, ignored
    assert p.read_bytes() == b"x" * 100_000


def test_a_stuck_writeback_skips_ranges_and_leaks_no_descriptor(tmp_path):
    """The kernel's writeback call blocked (a congested disk): the appends go on, at most
    WRITEBACK_PENDING ranges wait, the rest are skipped and counted, and no descriptor is
    taken for them (a relay at its fd limit needs every one)."""
    import threading
    release = threading.Event()

    class StuckFS(RecordingFS):
        def start_writeback(self, fd, offset, size):
            release.wait(10)
            super().start_writeback(fd, offset, size)
    fds0 = len(os.listdir("/proc/self/fd"))
    sp = Spool(tmp_path / "sp", readers=["a"], fsync="interval", segment_bytes=64 << 20,
               fs=StuckFS())
    try:
        for _ in range(200):                      # ~20 MiB: 20 ranges
            sp.append_batch(records(100, 1000))
        wb = sp.writer.writeback
        assert wb.pending <= spool_writer.WRITEBACK_PENDING and wb.skipped >= 10
    finally:
        release.set()
        sp.close()
    assert wb.started + wb.skipped >= 19
    assert len(os.listdir("/proc/self/fd")) <= fds0


def test_sync_times_buckets_take_their_upper_bound_inclusively():
    """The fdatasync histogram (Prometheus ``le``): a time equal to a bound counts in that
    bound's bucket, one just above it in the next, one above the last in +Inf."""
    from logjam_relay.spool.writer import SYNC_BUCKETS, SyncTimes

    t = SyncTimes()
    for s in (0.0, SYNC_BUCKETS[0], SYNC_BUCKETS[0] * 1.001, SYNC_BUCKETS[-1],
              SYNC_BUCKETS[-1] * 2):
        t.add(s)
    st = t.stats()
    assert st["count"] == 5 and t.max == SYNC_BUCKETS[-1] * 2
    b = st["buckets"]
    assert b[SYNC_BUCKETS[0]] == 2 and b[SYNC_BUCKETS[1]] == 3
    assert b[SYNC_BUCKETS[-2]] == 3 and b[SYNC_BUCKETS[-1]] == 4 and b[float("inf")] == 5
