"""The durable spool: appends, per-reader cursors, deletion, full policies, memory, accounting."""

import os
import subprocess
import sys
import textwrap
import tracemalloc

import pytest
import trio

from logjam_relay.spool import fs as fs_mod
from logjam_relay.spool import segment as fmt
from logjam_relay.spool.api import KIND_LOGJAM, KIND_SAMWISE, Position
from logjam_relay.spool.spool import Spool, SpoolError, SpoolLockedError
from logjam_relay.spool.fsyncpolicy import FsyncPolicy
from spool_helpers import drain, fill, msg, open_spool, segment_files, seq_of

# ---------------------------------------------------------------------------- basics

def test_round_trip_many_segments(tmp_path):
    sp = open_spool(tmp_path)
    fill(sp, 0, 500)
    assert sp.stats()["segments"] > 5
    for name in ("a", "b"):
        recs = drain(sp.reader(name), batch=37)
        assert [seq_of(r) for r in recs] == list(range(500))
        assert recs[3].frames == msg(3) and recs[3].kind == KIND_LOGJAM
        assert [r.position for r in recs] == sorted(r.position for r in recs)
    files = segment_files(tmp_path)
    assert all(f.endswith(".seg") for f in files[:-1]) and files[-1].endswith(".open")
    for f in files[:-1]:
        assert fmt.read_seal(tmp_path / f) is not None      # sealed files are self-describing
    assert sp.stats()["appends"] == 500
    sp.close()


def test_mixed_kinds(tmp_path):
    sp = open_spool(tmp_path, readers=["a"])
    sp.append_records([(KIND_SAMWISE, [b"req", b"body"]), (KIND_LOGJAM, msg(1))])
    sp.append(msg(2))
    sp.append([b"x"], kind=KIND_SAMWISE)
    recs = sp.reader("a").read(10)
    assert [(r.kind, r.frames) for r in recs] == [
        (KIND_SAMWISE, [b"req", b"body"]), (KIND_LOGJAM, msg(1)), (KIND_LOGJAM, msg(2)),
        (KIND_SAMWISE, [b"x"])]
    assert sp.last_sequence() == 2
    sp.close()


def test_unknown_reader_and_bad_config(tmp_path):
    sp = open_spool(tmp_path / "x", readers=["a"])
    with pytest.raises(KeyError, match="no spool reader 'zz'"):
        sp.reader("zz")
    sp.close()
    with pytest.raises(ValueError):
        open_spool(tmp_path / "y", readers=["../evil"])
    with pytest.raises(ValueError):
        open_spool(tmp_path / "y", policy="wait")
    with pytest.raises(ValueError):
        open_spool(tmp_path / "y", fsync="sometimes")


def test_second_process_is_locked_out(tmp_path):
    sp = open_spool(tmp_path, readers=["a"])
    code = textwrap.dedent(f"""
        from logjam_relay.spool.spool import Spool, SpoolLockedError
        try:
            Spool({str(tmp_path)!r}, readers=["a"])
        except SpoolLockedError as e:
            print("LOCKED", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert "LOCKED" in out.stdout and "in use by another process" in out.stdout, out.stderr
    sp.close()
    assert SpoolLockedError.__mro__[1] is SpoolError


# ---------------------------------------------------------------------------- cursors

def test_cursor_persists_across_reopen(tmp_path):
    sp = open_spool(tmp_path)
    fill(sp, 0, 300)
    a, b = sp.reader("a"), sp.reader("b")
    recs = a.read(120)
    a.ack(recs[99].position)                 # 100 acknowledged, 20 read but not acked
    b.ack(b.read(7)[-1].position)
    sp.close()
    sp = open_spool(tmp_path)
    assert [seq_of(r) for r in drain(sp.reader("a"))] == list(range(100, 300))
    assert [seq_of(r) for r in drain(sp.reader("b"))] == list(range(7, 300))
    st = sp.reader("a").stats()
    assert st["backlog_records"] == 200
    sp.close()


def test_stale_cursor_only_duplicates_after_crash(tmp_path):
    sp = open_spool(tmp_path, readers=["a"], cursor_flush_s=3600)
    fill(sp, 0, 200)
    a = sp.reader("a")
    a.ack(a.read(50)[-1].position)
    a.persist()                              # cursor on disk: 50
    a.ack(a.read(100)[-1].position)          # 150 in memory only
    # crash: the object is abandoned without close()
    sp2 = open_spool(tmp_path, readers=["a"])
    seqs = [seq_of(r) for r in drain(sp2.reader("a"))]
    # restarts from the persisted cursor (50), or, if segments that were acknowledged in
    # memory were deleted, from the cursor written (and synced) before they were (150):
    # duplicates at most, no gap
    assert 50 <= seqs[0] <= 150 and seqs == list(range(seqs[0], 200))
    sp2.close()
    # with a second reader holding the segments, the restart is exactly at the cursor
    d = tmp_path / "two"
    sp = open_spool(d, readers=["a", "hold"], cursor_flush_s=3600)
    fill(sp, 0, 200)
    a = sp.reader("a")
    a.ack(a.read(50)[-1].position)
    a.persist()
    a.ack(a.read(100)[-1].position)
    sp2 = open_spool(d, readers=["a", "hold"])
    assert [seq_of(r) for r in drain(sp2.reader("a"))] == list(range(50, 200))
    sp2.close()


def test_ack_in_the_middle_and_out_of_order(tmp_path):
    sp = open_spool(tmp_path, readers=["a"])
    fill(sp, 0, 100)
    a = sp.reader("a")
    recs = a.read(100)
    a.ack(recs[40].position)                 # not the last served: looked up on disk
    a.ack(recs[10].position)                 # older ack is ignored
    assert a.stats()["backlog_records"] == 59
    a.rewind()
    assert seq_of(a.read(1)[0]) == 41
    with pytest.raises(ValueError):
        a.ack(Position(recs[-1].position.segment, 10**9))
    sp.close()


def test_rewind(tmp_path):
    sp = open_spool(tmp_path, readers=["a"])
    fill(sp, 0, 100)
    a = sp.reader("a")
    first = a.read(30)
    a.ack(first[9].position)
    a.read(30)
    a.rewind()
    assert [seq_of(r) for r in a.read(5)] == [10, 11, 12, 13, 14]
    a.rewind()
    assert [seq_of(r) for r in drain(a)] == list(range(10, 100))
    sp.close()


async def test_wait_wakes_on_append(tmp_path):
    sp = open_spool(tmp_path, readers=["a"])
    a = sp.reader("a")
    got = []

    async def consumer():
        await a.wait()
        got.extend(a.read(10))

    async with trio.open_nursery() as n:
        n.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        assert not got
        sp.append_batch([msg(1), msg(2)])
    assert [seq_of(r) for r in got] == [1, 2]
    assert a.read(0) == []
    sp.append_batch([msg(3)])
    with trio.fail_after(5):
        await a.wait()                        # data available: returns at once
    sp.close()


# ---------------------------------------------------------------------------- deletion

def test_segments_deleted_when_consumed_by_all_readers(tmp_path):
    sp = open_spool(tmp_path)
    fill(sp, 0, 400)
    nseg = len(segment_files(tmp_path))
    a, b = sp.reader("a"), sp.reader("b")
    a.ack(drain(a)[-1].position)
    assert len(segment_files(tmp_path)) == nseg          # b still needs them
    recs = drain(b)
    b.ack(recs[len(recs) // 2].position)
    mid = len(segment_files(tmp_path))
    assert 1 < mid < nseg
    b.ack(recs[-1].position)
    assert segment_files(tmp_path) == [fmt.segment_name(sp._active.segno, False)]
    sp.seal()                                              # consumed active -> deleted too
    assert segment_files(tmp_path) == []
    assert sp.stats()["bytes"] == 0
    fill(sp, 400, 10)                                      # numbering continues
    assert [seq_of(r) for r in a.read(100)] == list(range(400, 410))
    sp.close()
    sp = open_spool(tmp_path)
    assert [seq_of(r) for r in drain(sp.reader("b"))] == list(range(400, 410))
    assert sp.stats()["next_seq"] == 410
    sp.close()


def test_numbering_survives_restart_with_empty_spool(tmp_path):
    sp = open_spool(tmp_path)
    fill(sp, 0, 300)
    for r in sp.readers.values():
        r.ack(drain(r)[-1].position)
    sp.close(seal=True)
    assert segment_files(tmp_path) == []
    sp = open_spool(tmp_path)
    fill(sp, 300, 5)
    assert [seq_of(r) for r in drain(sp.reader("a"))] == list(range(300, 305))
    assert min(int(f[:20]) for f in segment_files(tmp_path)) > 0
    sp.close()


# ---------------------------------------------------------------------------- full policies

async def test_block_policy(tmp_path):
    sp = open_spool(tmp_path, readers=["a", "b"], segment_bytes=8192, max_bytes=40_000,
                    policy="block")
    n = 0
    while not sp.would_block():
        fill(sp, n, 10)
        n += 10
        assert n < 1000
    assert sp.full and sp.stats()["full"] == 1
    assert sp.stats()["bytes"] < 40_000 + 10 * 400 + fmt.HEADER_LEN     # bound: one batch
    woke = []

    async def writer():
        await sp.wait_writable()
        woke.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer)
        await trio.testing.wait_all_tasks_blocked()
        a, b = sp.reader("a"), sp.reader("b")
        a.ack(drain(a)[-1].position)
        assert sp.would_block()                # b has not acknowledged yet
        await trio.testing.wait_all_tasks_blocked()
        assert not woke
        b.ack(drain(b)[-1].position)
        assert not sp.would_block()
    assert woke
    assert sp.reader("a").stats()["lost"] == 0 and sp.reader("b").stats()["lost"] == 0
    sp.close()


def test_drop_oldest_counts_lost_per_reader(tmp_path):
    sp = open_spool(tmp_path, readers=["fast", "slow", "mid"], segment_bytes=8192,
                    max_bytes=40_000, policy="drop_oldest")
    fast, slow, mid = sp.reader("fast"), sp.reader("slow"), sp.reader("mid")
    total = 0
    mid_read = []
    for k in range(30):
        fill(sp, total, 10)
        total += 10
        recs = fast.read(1000)
        fast.ack(recs[-1].position)
        if k == 2:
            mid_read = mid.read(15)
            mid.ack(mid_read[4].position)     # acked 5, 10 more read but unacked
        assert sp.stats()["bytes"] <= 40_000
    st = sp.stats()
    assert st["dropped_segments"] > 0 and not sp.would_block()
    assert fast.stats()["lost"] == 0
    slow_recs = drain(slow)
    slow_seqs = [seq_of(r) for r in slow_recs]
    assert slow_seqs == list(range(slow_seqs[0], total))      # contiguous newest part
    assert slow.stats()["lost"] == slow_seqs[0] == total - len(slow_seqs)
    mid_recs = drain(mid)
    # read-but-unacked records of a dropped segment count as lost once the output
    # gives up on them (rewind); until then they may still be acknowledged
    assert mid.stats()["lost"] == seq_of(mid_recs[0]) - 15
    mid.rewind()
    assert mid.stats()["lost"] == seq_of(mid_recs[0]) - 5
    sp.close()


# ---------------------------------------------------------------------------- memory

def test_memory_flat_with_large_backlog(tmp_path):
    sp = open_spool(tmp_path, readers=["down", "up"], segment_bytes=1 << 20)
    up = sp.reader("up")
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for k in range(0, 20_000, 500):                      # ~7 MB backlog for "down"
            sp.append_batch([msg(i) for i in range(k, k + 500)])
            up.ack(up.read(1000)[-1].position)
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.reset_peak()
        n = 0
        down = sp.reader("down")
        while recs := down.read(200):
            n += len(recs)
            down.ack(recs[-1].position)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert n == 20_000
    assert grown < 1_000_000, grown          # the backlog is on disk, not in memory
    assert peak < 3_000_000, peak            # reader: one chunk + one batch
    assert sp.stats()["bytes"] < 2 << 20     # consumed segments were deleted
    sp.close()


async def test_batch_fsync_deferred_to_a_worker_thread(tmp_path, monkeypatch):
    synced = []
    real = fs_mod._fdatasync

    def spy(fd):
        synced.append(trio.lowlevel.in_trio_run())
        real(fd)

    monkeypatch.setattr(fs_mod, "_fdatasync", spy)
    sp = Spool(tmp_path / "sp", readers=["a"], fsync=FsyncPolicy("batch", off_loop=True),
               segment_bytes=64 * 1024)
    sp.append_batch([msg(i) for i in range(10)])
    assert synced == [] and sp.fsyncs == 0          # the append itself did not fsync
    await sp.sync_async()
    assert sp.fsyncs == 1 and len(synced) == 1
    assert synced[0] is False                       # ran outside the trio thread
    await sp.sync_async()                            # nothing new: no second fsync
    assert sp.fsyncs == 1
    # a seal between the append and the sync is harmless (works on a dup'd descriptor)
    sp.append_batch([msg(i) for i in range(10, 20)])
    sp.seal()
    await sp.sync_async()
    sp.close()
    r = Spool(tmp_path / "sp", readers=["a"]).reader("a")
    assert len(r.read(100)) == 20


async def test_interval_fsync_deferred_to_a_worker_thread(tmp_path, monkeypatch):
    """"interval" off the loop (the relay's policy): appends and tick() never fdatasync
    on the event loop; run() does, once the interval has passed, in a worker thread.
    Inline (the samwise spool's), the append syncs itself."""
    synced = []
    real = fs_mod._fdatasync

    def spy(fd):
        synced.append(trio.lowlevel.in_trio_run())
        real(fd)

    monkeypatch.setattr(fs_mod, "_fdatasync", spy)
    now = [100.0]
    sp = Spool(tmp_path / "sp", readers=["a"], fsync=FsyncPolicy("interval", 1.0, True),
               segment_bytes=64 * 1024, monotonic=lambda: now[0])
    sp.append_batch([msg(i) for i in range(10)])
    now[0] += 5
    sp.append_batch([msg(i) for i in range(10, 20)])
    sp.tick()
    assert synced == [] and sp.fsyncs == 0          # due, but not on the event loop
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sp.run, 0.01)
            while not synced:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert synced == [False] and sp.fsyncs == 1 and not sp._unsynced
    sp.close()
    synced.clear()
    sp = Spool(tmp_path / "sp", readers=["a"], fsync=FsyncPolicy("interval", 1.0),
               segment_bytes=64 * 1024, monotonic=lambda: now[0])
    sp.append_batch([msg(20)])                      # inline: the append syncs itself
    now[0] += 5
    sp.append_batch([msg(21)])
    assert synced == [True] and sp.fsyncs == 1
    sp.close()


async def test_interval_cursor_sync_deferred_to_a_worker_thread(tmp_path, monkeypatch):
    """"interval" off the loop: the cursor logs are fdatasynced by run(), in a worker
    thread, once per interval and only when an ack wrote to them; tick() does not."""
    from logjam_relay.spool import reader as reader_mod
    synced = []
    real = reader_mod._fdatasync

    def spy(fd):
        synced.append((trio.lowlevel.in_trio_run(), os.fstat(fd).st_size))
        real(fd)

    monkeypatch.setattr(reader_mod, "_fdatasync", spy)
    monkeypatch.setattr(fs_mod, "_fdatasync", lambda fd: None)
    now = [100.0]
    sp = Spool(tmp_path / "sp", readers=["a"], fsync=FsyncPolicy("interval", 1.0, True),
               segment_bytes=64 * 1024, monotonic=lambda: now[0])
    r = sp.reader("a")
    sp.append_batch([msg(i) for i in range(10)])
    recs = r.read(5)
    r.ack(recs[-1].position)                          # one cursor entry written
    now[0] += 5
    sp.tick()
    assert synced == []                               # due, but not on the event loop
    log_path = r._log.path

    async def run_once():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sp.run, 0.01)
                await trio.sleep(0.1)
                nursery.cancel_scope.cancel()

    await run_once()
    assert synced == [(False, os.path.getsize(log_path))] and not r._log.dirty
    now[0] += 5
    await run_once()
    assert len(synced) == 1                           # nothing acked since: no sync
    r.ack(r.read(5)[-1].position)
    assert r._log.dirty
    now[0] += 5
    await run_once()
    assert len(synced) == 2 and synced[1][0] is False and not r._log.dirty
    assert r.cursor_errors == 0
    sp.close()


def test_drop_oldest_counts_lost_events_not_the_heartbeats_dropped_with_them(tmp_path):
    """The relay spools its heartbeats (``append_batch(..., heartbeat=True)``) among the
    events; a segment dropped under ``drop_oldest`` takes some with it.  A reader that
    had not read it counts the events lost, exactly; the heartbeats are counted apart
    (``dropped_heartbeats``).  Before: the lost counter was over by the heartbeats
    (9-10 a minute through the real command)."""
    from logjam_relay.protocols import logjam as L
    sp = open_spool(tmp_path, readers=["out"], segment_bytes=8192, max_bytes=40_000,
                    policy="drop_oldest")
    out = sp.reader("out")
    events = heartbeats = 0
    kinds = []                                  # per seq: "e" or "h"
    for k in range(400):
        sp.append_batch([msg(events + i, 200) for i in range(3)])
        events += 3
        kinds += "eee"
        if k % 4 == 0:
            sp.append_batch([L.heartbeat_frames("vm", 9606, 0, 1700000000000 + k,
                                                events + heartbeats)], heartbeat=True)
            heartbeats += 1
            kinds.append("h")
    assert sp.stats()["dropped_segments"] > 5
    recs = drain(out)
    out.ack(recs[-1].position)
    first = len(kinds) - len(recs)              # the seqs before it were dropped
    assert [r.frames[0] == b"heartbeat" for r in recs] == [c == "h" for c in kinds[first:]]
    gone = kinds[:first]
    st = out.stats()
    print(f"dropped {first} records: {gone.count('e')} events, {gone.count('h')} "
          f"heartbeats; lost counted {st['lost']}")
    assert gone.count("h") > 0
    assert st["lost"] == st["lost_by_reason"]["dropped"] == gone.count("e")
    assert sp.stats()["dropped_heartbeats"] == gone.count("h")
    assert st["backlog_records"] == 0
    sp.close()


# ------------------------------------------------------------- accounting and cursors

def test_drop_oldest_accounting_is_exact(tmp_path):
    """acked + backlog + lost == appended, with pipelined windows, rewinds and drops
    that hit records an output had read but not yet acknowledged."""
    import random
    from collections import deque
    rng = random.Random(11)
    sp = open_spool(tmp_path, readers=["o"], segment_bytes=8192, max_bytes=40_000,
                    policy="drop_oldest")
    r = sp.reader("o")
    inflight: deque = deque()
    acked = appended = 0

    def settled():
        st = r.stats()
        return acked + st["backlog_records"] + st["lost"]

    for _ in range(3000):
        n = rng.randint(1, 12)
        sp.append_batch([msg(appended + i, 200) for i in range(n)])
        appended += n
        if rng.random() < 0.6:
            recs = r.read(rng.randint(1, 40))
            if recs:
                inflight.append((recs[-1].position, len(recs)))
        if inflight and rng.random() < 0.45:
            pos, k = inflight.popleft()
            r.ack(pos)
            acked += k
        if rng.random() < 0.02:
            inflight.clear()                     # reconnect: unacked windows given up
            r.rewind()
            assert settled() == appended
    assert sp.stats()["dropped_segments"] > 10 and r.stats()["lost"] > 0
    while inflight:
        pos, k = inflight.popleft()
        r.ack(pos)
        acked += k
    while True:
        recs = r.read(50)
        if not recs:
            break
        r.ack(recs[-1].position)
        acked += len(recs)
    assert r.stats()["backlog_records"] == 0
    assert acked + r.stats()["lost"] == appended
    assert set(r.stats()["lost_by_reason"]) == {"dropped"}
    sp.close()


def test_every_ack_is_durable_without_close(tmp_path):
    sp = open_spool(tmp_path, readers=["a"])
    fill(sp, 0, 300)
    a = sp.reader("a")
    for _ in range(7):
        a.ack(a.read(31)[-1].position)
    # crash: abandoned without close(); the cursor log has every ack
    sp2 = open_spool(tmp_path, readers=["a"])
    assert [seq_of(r) for r in drain(sp2.reader("a"))] == list(range(217, 300))
    sp2.close()


def test_cursor_log_torn_tail_and_compaction(tmp_path, monkeypatch):
    from logjam_relay.spool import cursors as curlog
    monkeypatch.setattr(curlog, "COMPACT_ENTRIES", 8)
    sp = open_spool(tmp_path, readers=["a"])
    fill(sp, 0, 100)
    a = sp.reader("a")
    for _ in range(20):
        a.ack(a.read(3)[-1].position)
    sp.close()
    path = tmp_path / "cursors" / "a.cursors"
    assert os.path.getsize(path) <= 8 * curlog.ENTRY_LEN      # compacted
    with open(path, "ab") as f:
        f.write(b"\x01" * 20)                                  # a torn entry
    sp = open_spool(tmp_path, readers=["a"])
    assert seq_of(sp.reader("a").read(1)[0]) == 60
    sp.close()


async def test_a_cursor_sync_still_running_is_not_taken_for_durable(tmp_path, monkeypatch):
    """A cursor fdatasync running in a worker thread marks the log clean when it starts;
    a deletion on the loop meanwhile must sync again (its own fdatasync), not find the log
    clean and delete a segment whose cursor is not on disk yet (a power loss would then
    report delivered records as lost)."""
    from logjam_relay.spool import cursors as cursors_mod
    from logjam_relay.spool import reader as reader_mod
    release = trio.Event()
    token = trio.lowlevel.current_trio_token()
    loop_syncs = []

    def slow_thread_sync(fd):                       # the worker thread's fdatasync, held
        trio.from_thread.run_sync(lambda: None, trio_token=token)
        trio.from_thread.run(release.wait, trio_token=token)

    monkeypatch.setattr(reader_mod, "_fdatasync", slow_thread_sync)
    monkeypatch.setattr(cursors_mod, "_fdatasync", lambda fd: loop_syncs.append(fd))
    sp = open_spool(tmp_path, readers=["a"], fsync="interval", segment_bytes=1 << 20)
    fill(sp, 0, 20)                                 # one segment, still active
    r = sp.reader("a")
    recs = drain(r)
    r.ack(recs[-1].position)                        # written, nothing to delete yet
    assert r._log.dirty and loop_syncs == [] and sp.stats()["segments"] == 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(r.sync_cursor_async)
        await trio.sleep(0.05)                      # its fdatasync is running (held)
        assert not r._log.dirty and loop_syncs == []
        sp.seal()                                   # sealed, acknowledged: deleted
        assert len(loop_syncs) == 1                 # ... after a sync of its own
        assert sp.stats()["segments"] == 0
        release.set()
    assert await r.sync_cursor_async() is True      # nothing left to sync
    sp.close()


def test_no_deletion_when_the_cursor_cannot_be_made_durable(tmp_path, monkeypatch):
    from logjam_relay.spool import cursors as cursors_mod
    fail = [True]

    def sync(fd):
        if fail[0]:
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(cursors_mod, "_fdatasync", sync)
    sp = open_spool(tmp_path, readers=["a"], fsync="interval")
    fill(sp, 0, 200)
    r = sp.reader("a")
    recs = drain(r)
    r.ack(recs[-1].position)
    before = sp.stats()["segments"]
    sp.delete_acknowledged()
    assert sp.stats()["segments"] == before and r.cursor_errors >= 1
    fail[0] = False
    sp.delete_acknowledged()
    assert sp.stats()["segments"] < before
    sp.close()


def test_the_fsync_policy_is_one_object_fixed_when_the_spool_is_built(tmp_path):
    """spool/fsyncpolicy.py: the spool, its writer and its readers ask the same policy;
    it cannot be changed afterwards; a mode string is short for the inline policy."""
    import dataclasses
    pol = FsyncPolicy("batch", 0.5, off_loop=True)
    sp = Spool(tmp_path / "sp", readers=["a"], fsync=pol)
    try:
        assert sp.fsync is pol and sp.writer.fsync is pol
        with pytest.raises(dataclasses.FrozenInstanceError):
            pol.off_loop = False
        assert not hasattr(sp, "defer_batch_sync") and not hasattr(sp.writer,
                                                                   "defer_batch_sync")
    finally:
        sp.close()
    sp = Spool(tmp_path / "sp2", readers=[], fsync="never", fsync_interval_s=2.0)
    assert sp.fsync == FsyncPolicy("never", 2.0, off_loop=False)
    sp.close()
    with pytest.raises(ValueError):
        FsyncPolicy("sometimes")
    with pytest.raises(ValueError):
        FsyncPolicy("interval", -1.0)
    assert FsyncPolicy("interval", 0.0).append_syncs(0.0)      # spool_fsync_interval = 0
    # the decisions, mode by mode
    inline_b, loop_b = FsyncPolicy("batch"), FsyncPolicy("batch", off_loop=True)
    assert inline_b.append_syncs(0.0) and not loop_b.append_syncs(99.0)
    assert loop_b.owner_syncs_batches and not inline_b.owner_syncs_batches
    inline_i, loop_i = FsyncPolicy("interval", 1.0), FsyncPolicy("interval", 1.0, True)
    assert not inline_i.append_syncs(0.5) and inline_i.append_syncs(1.0)
    assert not loop_i.append_syncs(5.0) and loop_i.run_syncs_interval
    assert inline_i.tick_syncs_cursors(1.0) and not loop_i.tick_syncs_cursors(5.0)
    assert loop_i.run_syncs_cursors(1.0) and not inline_i.run_syncs_cursors(5.0)
    never = FsyncPolicy("never")
    assert not never.syncs and never.seals_off_loop and not never.append_syncs(99.0)
    assert not inline_b.seals_off_loop and loop_b.seals_off_loop and loop_i.seals_off_loop


def test_the_relay_and_the_samwise_spool_policies():
    """The relay's spool syncs off the loop (group commit / Spool.run), the samwise
    spool inline (its endpoint answers when append returns): docs/architecture.md."""
    from logjam_relay.config import Settings
    from logjam_relay.relay.spoolwrite import relay_fsync_policy, samwise_fsync_policy
    s = Settings(spool_fsync="batch", spool_fsync_interval=0.25)
    assert relay_fsync_policy(s) == FsyncPolicy("batch", 0.25, off_loop=True)
    assert samwise_fsync_policy(s) == FsyncPolicy("batch", 0.25, off_loop=False)
