"""The real spool writer, readers and recovery on a model file system (tests/model_fs.py):
what a power loss keeps of data that was, or was not, synced; torn writes; short writes.

The model keeps what was fsynced (data and directory entries) and drops the rest on
:meth:`ModelFS.crash`, or keeps a prefix of the unsynced tail (a torn write)."""

from __future__ import annotations

import os

import pytest

from logjam_relay.spool import segment as fmt
from logjam_relay.spool.spool import Spool, SpoolWriteError
from logjam_relay.spool.writer import SPARE_FILE
from logjam_relay.spool.fsyncpolicy import FsyncPolicy
from model_fs import ModelFS


def msg(i: int) -> list[bytes]:
    meta = (0xCABD).to_bytes(2, "big") + bytes([0, 1]) + (0).to_bytes(4, "big") + \
        (1_700_000_000_000 + i).to_bytes(8, "big") + i.to_bytes(8, "big")
    return [b"app-prod", b"logs.app", b'{"i":%d,"pad":"%s"}' % (i, b"x" * (i % 37)), meta]


def open_spool(d, fs, **kw) -> Spool:
    kw.setdefault("segment_bytes", 8192)
    kw.setdefault("max_bytes", 1 << 20)
    kw.setdefault("fsync", "interval")
    kw.setdefault("fsync_interval_s", 3600.0)     # nothing is synced unless asked
    return Spool(d, readers=["out"], fs=fs, **kw)


def bodies(sp: Spool) -> list[bytes]:
    r = sp.reader("out")
    out = []
    while True:
        recs = r.read(1000)
        if not recs:
            return out
        out.extend(rec.frames[2] for rec in recs)


def test_synced_records_survive_a_power_loss_unsynced_ones_are_gone(tmp_path):
    fs = ModelFS()
    d = str(tmp_path / "spool")
    sp = open_spool(d, fs)
    for i in range(0, 300, 10):                  # several segments are sealed (and synced)
        sp.append_batch([msg(j) for j in range(i, i + 10)])
    sp.sync()
    synced = sp.next_seq
    sp.append_batch([msg(j) for j in range(300, 305)])       # not synced: may be lost
    assert sp.stats()["sealed_segments"] > 3
    assert len(bodies(sp)) == 305                 # before the crash the reader sees all

    after = fs.crash()                             # no close: the process is gone
    sp2 = open_spool(d, after)
    got = bodies(sp2)
    assert got == [msg(j)[2] for j in range(synced)]
    assert sp2.next_seq == synced                  # the numbering goes on after the loss
    assert sp2.stats()["lost"] == 0                # never promised, so not counted as lost
    pos = sp2.append_batch([msg(999)])
    assert pos.segment > max(s for s in sp2.ledger.segs if s != pos.segment)
    assert bodies(sp2) == [msg(999)[2]]
    sp2.close()


@pytest.mark.parametrize("torn", [1, 7, 40, 90])
def test_a_torn_unsynced_tail_is_cut_by_the_recovery(tmp_path, torn):
    fs = ModelFS()
    d = str(tmp_path / "spool")
    sp = open_spool(d, fs, segment_bytes=1 << 16)
    sp.append_batch([msg(j) for j in range(20)])
    sp.sync()
    sp.append_batch([msg(j) for j in range(20, 23)])          # each record is > 90 bytes
    seg = sp.writer.active
    assert seg.count == 23

    after = fs.crash(torn=torn)                    # a prefix of the unsynced batch survives
    assert len(after.file(seg.path)) == seg.data_end - sum(
        len(fmt.encode_logjam_batch([msg(j)], j)) for j in range(20, 23)) + torn
    sp2 = open_spool(d, after)
    assert bodies(sp2) == [msg(j)[2] for j in range(20)]
    assert sp2.corrupt_tails_cut == 1 and 0 < sp2.corrupt_bytes_cut <= torn
    assert sp2.next_seq == 20
    sp2.append_batch([msg(20)])                    # appending goes on at the cut
    assert bodies(sp2) == [msg(20)[2]]
    sp2.close()
    sp3 = open_spool(d, after)                     # and that is what a restart finds
    assert sp3.stats()["lost"] == 0 and sp3.next_seq == 21
    sp3.close()


def test_a_short_write_is_cut_off_and_nothing_of_it_is_readable(tmp_path):
    fs = ModelFS()
    d = str(tmp_path / "spool")
    sp = open_spool(d, fs, segment_bytes=1 << 16)
    sp.append_batch([msg(j) for j in range(5)])
    seg = sp.writer.active
    end = seg.data_end
    fs.fail_writes(50)                             # 50 bytes of the batch, then ENOSPC
    with pytest.raises(SpoolWriteError) as e:
        sp.append_batch([msg(j) for j in range(5, 10)])
    assert e.value.reason == "enospc"
    assert len(fs.file(seg.path)) == end           # the 50 bytes were cut off again
    assert sp.next_seq == 5 and bodies(sp) == [msg(j)[2] for j in range(5)]
    fs.fail_writes(None)
    sp.append_batch([msg(j) for j in range(5, 10)])
    assert bodies(sp) == [msg(j)[2] for j in range(5, 10)]
    sp.sync()
    sp2 = open_spool(d, fs.crash())
    assert bodies(sp2) == [msg(j)[2] for j in range(10)]
    assert sp2.corrupt_tails_cut == 0
    sp2.close()


def test_a_segment_whose_name_was_never_synced_is_lost_with_fsync_never(tmp_path):
    """fsync="never" syncs on seal and close only: a power loss before either takes the
    whole segment (its name was never made durable), and the spool starts empty."""
    fs = ModelFS()
    d = str(tmp_path / "spool")
    sp = open_spool(d, fs, fsync="never")
    sp.append_batch([msg(j) for j in range(5)])
    assert os.path.basename(sp.writer.active.path) in fs.listdir(d)
    sp2 = open_spool(d, fs.crash(), fsync="never")
    assert bodies(sp2) == [] and sp2.next_seq == 0 and not sp2.ledger.segs
    sp2.close()


# -- background seals (spool/writer.py SealJob): a roll closes the segment and its seal
#    (seal record + fsync, rename, directory fsync, state) runs off the event loop

def roll_deferred(sp: Spool, start: int) -> tuple[int, object]:
    """Append batches from message ``start`` until a roll queues a seal; returns the
    next message number and the job."""
    w = sp.writer
    n = start
    while not w.sealing:
        sp.append_batch([msg(j) for j in range(n, n + 10)])
        n += 10
    return n, w.sealing[0]


@pytest.mark.parametrize("stage", ["queued", "written", "renamed", "done"])
def test_a_power_loss_during_a_background_seal(tmp_path, stage):
    """A crash at every stage of a background seal: what was synced survives, the closed
    segment comes back sealed (or is continued when it was the newest name on disk),
    nothing is reported lost, and the numbering goes on."""
    fs = ModelFS()
    d = str(tmp_path / "spool")
    sp = open_spool(d, fs)
    w = sp.writer
    sp.append_batch([msg(j) for j in range(10)])
    sp.sync()                                     # the first segment's name and 10 records
    w.defer_seals = True                          # the test is the sealer: stage by stage
    n, job = roll_deferred(sp, 10)
    closed = job.seg
    assert closed.closed and not closed.sealed and w.active is not closed
    assert w.dir_synced < w.dir_gen               # the new segment's name is not durable
    assert len(bodies(sp)) == n                   # readers read on past the closed segment
    if stage != "queued":
        w._seal_written(job, w._seal_write(job))
        assert job.stage == job.RENAME
    if stage in ("renamed", "done"):
        w._seal_rename(job)
        assert closed.path.endswith(".seg") and not closed.sealed
    if stage == "done":
        gen = w.dir_gen
        w._seal_finish(job, w._seal_dirsync(job), gen)
        assert closed.sealed and w.dir_synced == gen
    after = fs.crash()
    sp2 = open_spool(d, after)
    got = bodies(sp2)
    upto = 10 if stage == "queued" else closed.end_seq     # synced: the seal fsyncs all
    assert got == [msg(j)[2] for j in range(upto)]
    assert sp2.next_seq == upto and sp2.stats()["lost"] == 0
    if stage != "queued":
        seg = sp2.ledger.segs[closed.segno]
        assert seg.sealed and seg.path.endswith(".seg") and seg.count == closed.count
    sp2.append_batch([msg(999)])                  # appending goes on after it
    assert bodies(sp2) == [msg(999)[2]]
    sp2.close()


def test_a_power_loss_after_the_seal_record_with_the_next_segment_synced(tmp_path):
    """The state a sync after a roll may return in: the closed segment's seal record is
    synced but the segment not yet renamed, the next segment's name and records are
    durable.  After a power loss the closed segment comes back sealed and every record of
    both is there."""
    fs = ModelFS()
    d = str(tmp_path / "spool")
    sp = open_spool(d, fs)
    w = sp.writer
    sp.append_batch([msg(j) for j in range(10)])
    sp.sync()
    w.defer_seals = True
    n, job = roll_deferred(sp, 10)
    sp.append_batch([msg(j) for j in range(n, n + 4)])          # into the next segment
    w._seal_written(job, w._seal_write(job))                     # the seal record's fsync
    assert job.stage == job.RENAME and job.seg.path.endswith(".open")
    w.sync_dir()                                                 # the next segment's name
    fs.fsync(w.fd)                                               # and its records
    sp2 = open_spool(d, fs.crash())
    assert bodies(sp2) == [msg(j)[2] for j in range(n + 4)]
    assert sp2.stats()["lost"] == 0 and sp2.corrupt_tails_cut == 0
    seg = sp2.ledger.segs[job.seg.segno]
    assert seg.sealed and seg.path.endswith(".seg") and seg.count == job.seg.count
    sp2.append_batch([msg(999)])
    assert bodies(sp2)[-1] == msg(999)[2]
    sp2.close()


def test_sync_waits_for_the_queued_seal_and_the_new_segments_name(tmp_path):
    fs = ModelFS()
    d = str(tmp_path / "spool")
    sp = open_spool(d, fs)
    sp.writer.defer_seals = True
    n, job = roll_deferred(sp, 0)
    sp.sync()                                     # finishes the seal here, then syncs
    assert not sp.writer.sealing and job.seg.sealed
    sp2 = open_spool(d, fs.crash())
    assert bodies(sp2) == [msg(j)[2] for j in range(n)]
    assert sp2.stats()["lost"] == 0 and sp2.corrupt_tails_cut == 0
    sp2.close()


class SlowSyncFS(ModelFS):
    """fsync in a worker thread takes 50 ms: a sync_async that did not wait for the seal
    would return before the closed segment's records are synced."""

    def fsync(self, fd: int) -> None:
        import threading
        import time
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)
        super().fsync(fd)

    fdatasync = fsync


async def test_sync_async_covers_records_of_a_segment_whose_seal_runs(tmp_path):
    """fsync="batch" as the relay runs it: Spool.run seals in the background, and what
    sync_async returned for survives a power loss (the closed segment's records, the
    next segment's name and records)."""
    import trio
    import trio.testing
    fs = SlowSyncFS()
    d = str(tmp_path / "spool")
    sealed = []
    sp = open_spool(d, fs, fsync=FsyncPolicy("batch", off_loop=True),
                    on_seal=lambda no, path: sealed.append(no))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sp.run)
        await trio.testing.wait_all_tasks_blocked()
        assert sp.writer.defer_seals
        # the next segment's file is made ahead, off the loop
        with trio.fail_after(5):
            while sp.writer.spare_fd is None:
                await trio.sleep(0.001)
        assert SPARE_FILE in fs.listdir(d) and sp.writer.spare_fd is not None
        n, job = roll_deferred(sp, 0)
        assert sp.writer.spare_fd is None        # the new segment is the spare, renamed
        assert sealed == []                       # announced only once sealed
        await sp.sync_async()
        # the closed segment's records are synced (its seal record's fsync): the seal's
        # rename, directory fsync and state file need not be done yet
        assert job.stage != job.WRITE
        with trio.fail_after(5):
            while job.stage != job.DONE:
                await trio.sleep(0.001)
        assert sealed == [job.seg.segno]
        crashed = fs.crash()
        nursery.cancel_scope.cancel()
    assert not sp.writer.defer_seals
    sp2 = open_spool(d, crashed, fsync="batch")
    assert bodies(sp2) == [msg(j)[2] for j in range(n)]
    assert sp2.stats()["lost"] == 0 and sp2.corrupt_tails_cut == 0
    assert SPARE_FILE not in crashed.listdir(d)     # the recovery deletes a spare
    sp2.close()
    sp.close()
    assert SPARE_FILE not in fs.listdir(d)


class HeldSealFS(ModelFS):
    """One stage of a background seal waits until ``release`` is set: ``"write"`` the
    seal record's fsync (its first stage), ``"state"`` the state file's fsync (its last,
    DIRSYNC).  An fdatasync is never held."""

    def __init__(self, held: str) -> None:
        import threading
        super().__init__()
        self.held = held
        self.release = threading.Event()

    def name(self, fd: int) -> str:
        """The file's name now (a handle keeps the name it was opened by: a segment made
        from the spare file is still ``next-segment.tmp`` there)."""
        h = self.handles.get(fd)
        if h is None or h.inode is None:
            return ""
        return next((p for p, ino in list(self.names.items()) if ino is h.inode), h.path)

    def fsync(self, fd: int) -> None:
        path = self.name(fd)
        if (self.held == "write" and path.endswith(".open")) or \
                (self.held == "state" and path.endswith(".seal.tmp")):
            self.release.wait(30)
        super().fsync(fd)

    fdatasync = ModelFS.fsync


@pytest.mark.parametrize("held", ["write", "state"])
async def test_sync_async_after_a_roll_does_not_wait_for_the_seal(tmp_path, held):
    """A round after a roll makes the closed segment's records durable itself (their
    fdatasync) and the new segment's name and records; it waits for no stage of the
    closed segment's seal, which runs in worker threads (issue 44: each of their
    hand-backs waits for the GIL on a busy event loop; a round after a roll took ~100 ms).
    What it returned for survives a power loss while the seal has not finished: the
    recovery seals the closed segment, with or without its seal record."""
    import trio
    fs = HeldSealFS(held)
    d = str(tmp_path / "spool")
    sp = open_spool(d, fs, fsync=FsyncPolicy("batch", off_loop=True))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sp.run)
            await trio.testing.wait_all_tasks_blocked()
            assert sp.writer.defer_seals
            n, job = roll_deferred(sp, 0)
            sp.append_batch([msg(j) for j in range(n, n + 3)])   # into the new segment
            # held in its first stage: before, the round waited for the seal record's
            # fsync (released only after 30 s, so this fails); in its last: the state file
            with trio.fail_after(15):
                await sp.sync_async()
            expect = job.WRITE if held == "write" else job.DIRSYNC
            with trio.fail_after(15):
                while job.stage != expect:        # the seal's worker is where it is held
                    await trio.sleep(0.001)
            assert not job.seg.sealed
            crashed = fs.crash()
            fs.release.set()
            nursery.cancel_scope.cancel()
    finally:
        fs.release.set()
    sp2 = open_spool(d, crashed, fsync="batch")
    assert bodies(sp2) == [msg(j)[2] for j in range(n + 3)]
    assert sp2.stats()["lost"] == 0 and sp2.corrupt_tails_cut == 0
    assert sp2.ledger.segs[job.seg.segno].sealed
    sp2.close()
    sp.close()


async def test_a_failed_sync_of_a_closed_segment_fails_the_round_and_names_it(tmp_path):
    """The closed segment's fdatasync fails (EIO) in a round after a roll: no 202 (the
    error is raised and counted, naming that segment); the next round syncs it again."""
    import errno

    import trio
    import trio.testing

    class FailingFS(HeldSealFS):
        bad: str | None = None

        def fdatasync(self, fd: int) -> None:
            if self.name(fd) == self.bad:
                raise OSError(errno.EIO, "Input/output error (model)")
            ModelFS.fsync(self, fd)

    fs = FailingFS("write")
    d = str(tmp_path / "spool")
    sp = open_spool(d, fs, fsync=FsyncPolicy("batch", off_loop=True))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sp.run)
            await trio.testing.wait_all_tasks_blocked()
            n, job = roll_deferred(sp, 0)
            sp.append_batch([msg(n)])
            fs.bad = job.seg.path
            failures = sp.errors.total
            with pytest.raises(SpoolWriteError) as e:
                await sp.sync_async()
            assert e.value.path == job.seg.path and e.value.errno == errno.EIO
            assert sp.errors.total == failures + 1 and "syncing" in sp.errors.last
            assert job.unsynced                   # still owed
            fs.bad = None
            with trio.fail_after(15):
                await sp.sync_async()
            assert not job.unsynced
            fs.release.set()
            nursery.cancel_scope.cancel()
    finally:
        fs.release.set()
    sp.close()


def test_a_closed_segment_is_deleted_only_once_sealed(tmp_path):
    fs = ModelFS()
    d = str(tmp_path / "spool")
    sp = open_spool(d, fs)
    sp.writer.defer_seals = True
    n, job = roll_deferred(sp, 0)
    r = sp.reader("out")
    recs = r.read(10_000)
    assert len(recs) == n
    r.ack(recs[-1].position)                      # past the closed segment
    assert job.seg.segno in sp.ledger.segs        # not sealed yet: kept
    sp.writer.finish_seals()
    sp.delete_acknowledged()
    assert job.seg.segno not in sp.ledger.segs
    sp.close()


def test_a_segment_dropped_while_its_seal_runs_is_not_sealed_again(tmp_path):
    fs = ModelFS()
    d = str(tmp_path / "spool")
    sp = open_spool(d, fs, policy="drop_oldest")
    w = sp.writer
    w.defer_seals = True
    n, job = roll_deferred(sp, 0)
    w._seal_written(job, w._seal_write(job))
    sp._drop_segments([job.seg], "dropped")       # as the budget would
    w.finish_seals()
    assert not job.seg.sealed and job.seg.segno not in sp.ledger.segs
    assert not any(p.endswith(".seg") for p in fs.listdir(d))     # no file comes back
    sp.close()


@pytest.mark.parametrize("how", ["sync", "sync_async"])
async def test_a_new_segments_name_is_durable_after_a_sync(tmp_path, how):
    """With background seals a segment is created without the directory fsync; the next
    sync (or sync_async) does it before it returns."""
    fs = ModelFS()
    d = str(tmp_path / "spool")
    sp = open_spool(d, fs)
    sp.writer.defer_seals = True
    sp.append_batch([msg(j) for j in range(5)])
    assert sp.writer.dir_synced < sp.writer.dir_gen
    if how == "sync":
        sp.sync()
    else:
        await sp.sync_async()
    sp2 = open_spool(d, fs.crash())
    assert bodies(sp2) == [msg(j)[2] for j in range(5)]
    sp2.close()
