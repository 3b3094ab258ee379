"""The segment writer (:class:`SegmentWriter`): append, the fsync policy, sealing.

It owns the active segment and its descriptor.  Appending writes the encoded records with
one ``write()`` to the active ``.open`` segment (O_APPEND) and moves the ledger's
positions; a failed write is cut off again (nothing of it is readable).  When it
fdatasyncs it asks the spool's :class:`~.fsyncpolicy.FsyncPolicy` (``self.fsync``):
``"batch"`` (after every append, or by the owner through :meth:`sync_async` off the
loop), ``"interval"`` (at most every ``interval_s``) or ``"never"`` (on close only).

A segment is sealed by appending its seal record, fsyncing it and renaming ``.open`` to
``.seg``; the seal listeners (the archive output) are then told.  On a full disk the
space budget's reserve is given back first; if even that does not make room the segment
is closed in memory without its seal record (*deferred seal*: readers treat it as
sealed, it can be deleted once acknowledged) and :meth:`retry_pending_seals` writes the
record once there is space again.  A crash meanwhile is harmless: an ``.open`` segment
that is not the newest is sealed by the recovery.  See docs/spool-format.md, "Full disk".

*Background seals* (:attr:`SegmentWriter.defer_seals`, on while :meth:`Spool.run
<logjam_relay.spool.spool.Spool.run>` runs :meth:`SegmentWriter.run_seals` and the owner's
syncs are off the loop too): a roll only *closes* the active segment (no record is
appended to it any more; readers may read to its end and go on with the next one) and
the next append creates the next segment at once; the seal -- seal record and fsync,
rename, directory fsync (which also makes the new segment's name durable), state file --
runs as a :class:`SealJob`, its waits in worker threads, so the event loop never waits
for the disk at a roll.  The segment is *sealed* (deletable, announced to the seal
listeners) only once all of it is durable.  :meth:`SegmentWriter.sync_async` and
:meth:`SegmentWriter.sync` return only once the records of the segments closed before
them are on disk (:meth:`~SegmentWriter.sync` finishes the seals; ``sync_async`` and
``sync_begin`` fdatasync a duplicate of each closed segment's descriptor whose seal record
is not synced yet, beside the active segment and the directory, as one job of the C sync
thread: no wait for a seal's worker thread, whose every hand-back needs the GIL) and a new
segment's name is durable.  A crash in the middle
leaves an ``.open`` segment that is not the newest (sealed by the recovery), or one with
its seal record (renamed by the recovery), or a sealed ``.seg``.  The next segment's file
is created ahead by :meth:`SegmentWriter.run_seals` (:data:`SPARE_FILE`, in a worker
thread) and renamed at the roll.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from . import segment as fmt
from .api import Position
from .errors import SpoolWriteError, WriteErrors, is_disk_full, write_error
from .fs import Filesystem, unlink_quiet, write_all
from .fsyncpolicy import FsyncPolicy
from .ledger import Ledger, Seg
from .syncthread import MAX_ITEMS as MAX_SYNC_ITEMS
from .syncthread import SyncThread
from .syncthread import make as make_sync_thread
from .writeback import (  # noqa: F401  (re-exported: relay/groupcommit.py, the tests)
    SYNC_BUCKETS,
    WRITEBACK_BYTES,
    WRITEBACK_PENDING,
    SyncTimes,
    Writeback,
    timed_fdatasync,
)

log = logging.getLogger("logjam_relay.spool")

STATE_FILE = "spool.state"
#: the next segment's file, created ahead by run_seals (in a worker thread) and renamed to
#: its segment name when a roll needs it; the recovery deletes it (``*.tmp``)
SPARE_FILE = "next-segment.tmp"
class Reserve(Protocol):
    """What the writer asks of the space budget."""

    def segment_limit(self) -> int: ...

    def release_reserve(self) -> bool: ...


class SealJob:
    """The seal of a segment a roll closed (see the module text), done in stages:
    ``WRITE`` (seal record + fsync, worker thread), ``RENAME`` (on the loop),
    ``DIRSYNC`` (directory fsync + state file, worker thread), ``DONE``."""

    WRITE, RENAME, DIRSYNC, DONE = range(4)
    __slots__ = ("seg", "fd", "rec", "state", "unsynced", "stage", "error", "changed",
                 "idle", "attempts", "runner")

    def __init__(self, seg: Seg, fd: int, rec: bytes, state: dict, unsynced: bool) -> None:
        self.seg = seg
        self.fd: int | None = fd
        self.rec = rec
        self.state = state              # spool.state as of the roll (nothing newer is synced)
        self.unsynced = unsynced
        self.stage = SealJob.WRITE
        self.error: SpoolWriteError | None = None     # the last attempt failed
        self.changed = trio.Event()     # set (and replaced) when stage or error change
        self.idle = threading.Event()   # clear while a stage runs in a worker thread
        self.idle.set()
        self.attempts = 0
        self.runner: object | None = None   # the run_seals stage in a worker thread

    def announce(self) -> None:
        ev, self.changed = self.changed, trio.Event()
        ev.set()


class SyncJob:
    """The syncs :meth:`SegmentWriter.sync_begin` started: the duplicated descriptor of the
    active segment (-1: its records were synced already), what it covers
    (``bytes_appended`` at the start), the segment's path for an error; and what a roll
    owes beside it (background seals): ``closed``, the seal jobs of the closed segments
    whose records may not be durable yet, with a duplicate of each one's descriptor
    (``closed_fds``), and ``dir_fd``, the directory to fsync (-1: none owed) for the
    directory generation ``dir_gen``."""
    __slots__ = ("fd", "upto", "path", "closed", "closed_fds", "dir_fd", "dir_gen")

    def __init__(self, fd: int, upto: int, path: str):
        self.fd = fd
        self.upto = upto
        self.path = path
        self.closed: list[SealJob] = []
        self.closed_fds: list[int] = []
        self.dir_fd = -1
        self.dir_gen = 0

    def empty(self) -> bool:
        return self.fd < 0 and not self.closed_fds and self.dir_fd < 0

    def fds(self) -> tuple[list[int], list[int]]:
        """(to fdatasync, to fsync), in the order they are synced."""
        data = list(self.closed_fds)
        if self.fd >= 0:
            data.append(self.fd)
        return data, [self.dir_fd] if self.dir_fd >= 0 else []

    def what(self, index: int, directory: str) -> tuple[str, str]:
        """The error message's verb and path of the descriptor ``index`` of :meth:`fds`."""
        data, _ = self.fds()
        if 0 <= index < len(self.closed_fds):
            return "syncing", self.closed[index].seg.path
        if index >= len(data):
            return "syncing directory", directory
        return "syncing", self.path


class SegmentWriter:
    def __init__(self, directory: str, fs: Filesystem, ledger: Ledger, errors: WriteErrors,
                 budget: Reserve, *, fsync: FsyncPolicy,
                 segment_age_s: float, clock: Callable[[], float],
                 monotonic: Callable[[], float]) -> None:
        self.directory = directory
        self._fs = fs
        self._ledger = ledger
        self._errors = errors
        self._budget = budget
        self.fsync = fsync                      # asked, never changed (fsyncpolicy.py)
        self.segment_age_s = segment_age_s
        self._clock = clock
        self._mono = monotonic
        self.seal_listeners: list[Callable[[int, str], None]] = []
        self.active: Seg | None = None
        self.fd: int | None = None              # active segment, O_APPEND
        self.dirty_tail = False                 # a failed write may have left bytes after data_end
        self.unsynced = False
        self.last_fsync = monotonic()
        self.writeback_from = 0            # the active segment's offset not yet handed over
        self.writeback = Writeback(fs)
        # sync_async's fdatasync thread in C (syncthread.py), made at the first sync_async
        # on the real file system; None: trio's worker threads
        self.sync_thread: SyncThread | None = None
        self._sync_thread_tried = False
        self.pending_seals: list[Seg] = []      # closed on a full disk, seal record owed
        # background seals (module text): on while run_seals() runs
        self.defer_seals = False
        self.sealing: deque[SealJob] = deque()  # closed by a roll, seal not yet done
        self._seal_wake = trio.Event()
        self.dir_gen = 0                        # segments created, directory fsync owed
        self.dir_synced = 0                     # dir_gen covered by a directory fsync
        self.spare_fd: int | None = None        # SPARE_FILE, open O_APPEND, empty
        self._closed = False
        self._state_lock = threading.Lock()
        self._state_written: tuple[int, int] = (-1, -1)
        self.appends = 0
        self.append_batches = 0
        self.bytes_appended = 0
        self.fsyncs = 0
        self.sync_times = SyncTimes()           # the records' fdatasyncs (sync, sync_async)
        self.sealed_segments = 0
        self.deferred_seals = 0

    def now_ms(self) -> int:
        return int(self._clock() * 1000)

    # -- recovery of the writer's side --------------------------------------------
    def recover(self, active: Seg | None, to_seal: list[Seg]) -> None:
        """Take over what the recovery found: seal the ``.open`` segments that must not
        be continued (not announced: the owner catches up on sealed segments), then
        continue the newest one (``active``)."""
        for seg in to_seal:
            self.active = seg
            self.fd = self._fs.open(seg.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            self.seal_active(notify=False)
        if active is not None:
            self.fd = self._fs.open(active.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            self.active = active

    # -- appending ----------------------------------------------------------------
    def roll_due(self, nbytes: int, now_ms: int) -> bool:
        """The active segment is full or old: seal it before appending ``nbytes``."""
        act = self.active
        return act is not None and act.count > 0 and (
            act.data_end + nbytes > self._budget.segment_limit()
            or now_ms - act.created_ms >= self.segment_age_s * 1000)

    def roll(self) -> None:
        """The active segment is full or old: seal it, or with :attr:`defer_seals` close
        it and queue its seal (:meth:`run_seals`); the next append creates the next one."""
        if self.active is None:
            return
        if not self.defer_seals or self.active.count == 0:
            self.seal_active()
            return
        seg, fd = self.active, self.fd
        if self.dirty_tail:
            self.cut_tail()
        rec = fmt.encode_seal(seg.end_seq, seg.count, seg.data_end, self.now_ms())
        job = SealJob(seg, fd, rec, self._ledger.state(), self.unsynced)
        seg.closed = True
        self.active, self.fd = None, None
        self.unsynced = False
        self.sealing.append(job)
        self._seal_wake.set()

    def append(self, data, n: int, now_ms: int) -> Position:
        """Write ``n`` encoded records (numbered from the ledger's next seq) with one
        write; raises :class:`SpoolWriteError` (counted) with nothing of it readable."""
        if self.active is None:
            self._create_segment(now_ms)
        seg = self.active
        fd = self.fd
        if self.dirty_tail:
            self.cut_tail()
        start = seg.data_end
        try:
            view = memoryview(data)
            done = 0
            while done < len(data):
                w = self._fs.write(fd, view[done:])
                if w <= 0:
                    raise OSError(errno.ENOSPC, "write returned 0")
                done += w
        except OSError as e:
            self.dirty_tail = True
            err = self._errors.count(write_error("appending to", seg.path, e))
            try:
                self.cut_tail()
            except SpoolWriteError:
                pass
            raise err from None
        led = self._ledger
        seg.data_end += len(data)
        seg.size = seg.data_end
        if self.fsync.writeback and seg.data_end - self.writeback_from >= WRITEBACK_BYTES:
            # the interval's fdatasync would otherwise write a second of appends at once,
            # and the appends meanwhile wait for it (ext4's journal), holding the loop
            self.writeback.submit(fd, self.writeback_from, seg.data_end - self.writeback_from)
            self.writeback_from = seg.data_end
        seg.count += n
        led.count_appended(n, len(data))
        self.appends += n
        self.append_batches += 1
        self.bytes_appended += len(data)
        self.unsynced = True
        if self.fsync.append_syncs(self._mono() - self.last_fsync):
            self.sync()
        led.announce_append()
        return Position(seg.segno, start)

    def cut_tail(self) -> None:
        """Remove bytes a failed write left after the committed end."""
        seg = self.active
        try:
            self._fs.ftruncate(self.fd, seg.data_end)
        except OSError as e:
            raise self._errors.count(write_error("truncating", seg.path, e)) from None
        self.dirty_tail = False

    def _create_segment(self, now_ms: int) -> None:
        fs = self._fs
        led = self._ledger
        segno = led.next_segno
        path = os.path.join(self.directory, fmt.segment_name(segno, False))
        header = fmt.encode_header(segno, now_ms, led.next_seq)
        fd = self._take_spare(path)
        try:
            if fd is None:
                fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND |
                             os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise self._errors.count(write_error("creating segment", path, e)) from None
        try:
            write_all(fs, fd, header, "segment header")
        except OSError as e:
            fs.close(fd)
            unlink_quiet(path, fs)
            raise self._errors.count(write_error("writing segment header to", path, e)) \
                from None
        if self.fsync.syncs and self.defer_seals:
            self.dir_gen += 1                   # by the seal job or the next sync
        elif self.fsync.syncs:
            try:
                self.sync_dir()
            except SpoolWriteError:
                fs.close(fd)
                unlink_quiet(path, fs)
                raise
        seg = Seg(segno, path, now_ms, led.next_seq, 0, fmt.HEADER_LEN, fmt.HEADER_LEN, False)
        self.writeback_from = 0
        led.open_segment(seg)
        self.active, self.fd = seg, fd

    def _take_spare(self, path: str) -> int | None:
        """The spare file (created ahead off the loop) renamed to ``path``, or None."""
        fd = self.spare_fd
        if fd is None:
            return None
        self.spare_fd = None
        self._seal_wake.set()                   # run_seals creates the next spare
        fs = self._fs
        spare = os.path.join(self.directory, SPARE_FILE)
        try:
            if fs.exists(path):
                raise FileExistsError(path)     # never over a segment (O_EXCL's promise)
            fs.replace(spare, path)
        except OSError:
            fs.close(fd)
            unlink_quiet(spare, fs)
            return None
        return fd

    async def _make_spare(self) -> None:
        """Create the spare file in a worker thread (run_seals, when idle)."""
        fs = self._fs
        path = os.path.join(self.directory, SPARE_FILE)
        try:
            fd = await trio.to_thread.run_sync(
                fs.open, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND |
                os.O_CLOEXEC, 0o644)
        except OSError:
            return                              # the next segment is created on the loop
        if self._closed or self.spare_fd is not None:
            fs.close(fd)
            if self._closed:
                unlink_quiet(path, fs)
            return
        self.spare_fd = fd

    # -- syncing ------------------------------------------------------------------
    def sync(self) -> None:
        """fdatasync the active segment now (if anything is unsynced), after the seals
        queued so far (done here, blocking, if need be) and the directory fsync a new
        segment is owed."""
        if self.sealing:
            self.finish_seals()
        if self.dir_synced < self.dir_gen:
            gen = self.dir_gen
            self.sync_dir()
            self.dir_synced = max(self.dir_synced, gen)
        if not self.unsynced or self.fd is None:
            return
        try:
            took = timed_fdatasync(self._fs, self.fd)
        except OSError as e:
            raise self._errors.count(write_error("syncing", self.active.path, e)) from None
        self.sync_times.add(took)
        self.unsynced = False
        self.last_fsync = self._mono()
        self.fsyncs += 1

    async def sync_async(self) -> None:
        """fdatasync what was appended so far, in the C sync thread (``syncthread.py``) or
        a worker thread (the event loop runs on).

        Works on a duplicate of the segment's descriptor, so sealing or rolling the segment
        meanwhile is harmless (sealing fsyncs by itself).  Everything appended before the
        call started is durable when it returns; raises :class:`SpoolWriteError` otherwise.
        The duplicate comes from the fd reserve when the process is out of descriptors.
        After a roll it also makes the records of the segments closed before the call
        durable (an fdatasync of each one whose seal record is not synced yet; the seal
        itself goes on in the background) and a new segment's name (the directory's
        fsync): one job of the same thread, so a round after a roll costs a few disk
        flushes and no wait for the seal's worker threads (on a busy event loop
        each of their hand-backs waits for the GIL, ~100 ms per roll).
        """
        await trio.lowlevel.checkpoint_if_cancelled()   # as to_thread.run_sync does
        job = self.sync_begin()
        if job is not None:
            await self.sync_end(job)
            return
        # no C thread (or it is busy): the same syncs in a worker thread
        job = self._sync_job()
        if job.empty():
            return
        await self._end(job, trio.to_thread.run_sync(self._sync_all, job))

    def _sync_all(self, job: SyncJob) -> float:
        """(worker thread) The syncs of ``job``, in order; returns the seconds they took.
        An ``OSError`` names the failed descriptor's index (``sync_index``)."""
        data, full = job.fds()
        t0 = time.perf_counter()
        for i, fd in enumerate(data + full):
            try:
                if i < len(data):
                    self._fs.fdatasync(fd)
                else:
                    self._fs.fsync(fd)
            except OSError as e:
                e.sync_index = i
                raise
        return time.perf_counter() - t0

    def sync_begin(self) -> SyncJob | None:
        """:meth:`sync_async` without waiting: the syncs start in the C sync thread now,
        and ``await sync_end(job)`` returns as ``sync_async`` would have (everything
        appended before this call is durable then).  None where they cannot start so (no C
        thread, or it is busy): the caller awaits :meth:`sync_async` instead.  Lets the
        owner do other work on the loop while the disk syncs (the group commit sends the
        previous round's replies).  Raises :class:`SpoolWriteError` when a descriptor
        cannot be duplicated, or the error of a closed segment's seal that failed."""
        st = self._sync_thread()
        if st is None or st.busy():
            return None
        job = self._sync_job()
        if job.empty():
            return job                      # nothing to sync
        data, full = job.fds()
        if len(data) + len(full) > MAX_SYNC_ITEMS:
            self._close_job(job)            # many rolls since the last sync: a worker
            return None
        try:
            if len(data) == 1 and not full:
                st.start(data[0])
            else:
                st.start_many(data, full)
        except BaseException:
            self._close_job(job)
            raise
        return job

    def _sync_job(self) -> SyncJob:
        """What a sync started now must make durable, with duplicates of the descriptors:
        the active segment's records (if any are unsynced), the records of the closed
        segments whose seal record is not synced yet (if any were unsynced at the roll),
        the directory when a new segment's name is owed.  Raises the error of a closed
        segment's seal that failed (no 202 until it is retried with success)."""
        seg = self.active
        job = SyncJob(-1, self.bytes_appended, seg.path if seg else "?")
        try:
            for sj in self.sealing:
                if sj.stage != SealJob.WRITE:
                    continue                # its seal record (and records) are synced
                if sj.error is not None:
                    raise sj.error
                if sj.unsynced and sj.fd is not None:
                    job.closed_fds.append(self._dup(sj.fd, sj.seg.path))
                    job.closed.append(sj)
            if self.dir_synced < self.dir_gen:
                job.dir_gen = self.dir_gen
                try:
                    job.dir_fd = self._fs.open(self.directory,
                                               os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                except OSError as e:
                    raise self._errors.count(write_error("syncing directory",
                                                         self.directory, e)) from None
            if self.unsynced and self.fd is not None:
                job.fd = self._dup(self.fd, job.path)
        except BaseException:
            self._close_job(job)
            raise
        return job

    def _dup(self, fd: int, path: str) -> int:
        try:
            return self._fs.dup(fd)
        except OSError as e:
            raise self._errors.count(write_error("syncing", path, e)) from None

    def _close_job(self, job: SyncJob) -> None:
        for fd in (*job.closed_fds, job.fd, job.dir_fd):
            if fd >= 0:
                self._fs.close(fd)
        job.closed_fds = []
        job.fd = job.dir_fd = -1

    async def sync_end(self, job: SyncJob) -> None:
        """Wait for the syncs :meth:`sync_begin` started (see there)."""
        if job.empty():
            return
        st = self.sync_thread
        assert st is not None
        await self._end(job, st.finish())

    async def _end(self, job: SyncJob, syncing: Awaitable[float]) -> None:
        """Await ``job``'s syncs (their seconds), close the duplicates, count them."""
        try:
            took = await syncing
        except OSError as e:
            verb, path = job.what(getattr(e, "sync_index", -1), self.directory)
            raise self._errors.count(write_error(verb, path, e)) from None
        finally:
            active = job.fd >= 0
            self._close_job(job)
        for sj in job.closed:
            sj.unsynced = False             # its records are durable: not synced again
        if job.dir_gen:
            self.dir_synced = max(self.dir_synced, job.dir_gen)
        self.fsyncs += len(job.closed)
        if not active:
            return
        self.sync_times.add(took)
        self.fsyncs += 1
        self.last_fsync = self._mono()
        if self.bytes_appended == job.upto:
            self.unsynced = False

    def sync_ready(self, job: SyncJob) -> bool:
        """The syncs of ``job`` are done: ``sync_end(job)`` returns without waiting."""
        st = self.sync_thread
        return job.empty() or (st is not None and st.done())

    def interval_sync_due(self) -> bool:
        return self.fsync.interval_due(self.unsynced, self._mono() - self.last_fsync)

    def sync_on_close(self) -> None:
        if self.active is not None:
            self.unsynced = True
            self.sync()

    def sync_dir(self) -> None:
        try:
            self._fs.sync_dir(self.directory)
        except OSError as e:
            raise self._errors.count(write_error("syncing directory", self.directory, e)) \
                from None

    # -- small files --------------------------------------------------------------
    def write_json(self, path: str, obj: dict) -> None:
        try:
            self._write_json(path, obj)
        except OSError as e:
            raise self._errors.count(write_error("writing", path, e)) from None

    def _write_json(self, path: str, obj: dict, tmp: str | None = None) -> None:
        """Replace ``path`` by ``obj`` (raises ``OSError``; no counting: a worker thread
        calls it too)."""
        fs = self._fs
        tmp = tmp or path + ".tmp"
        data = json.dumps(obj).encode()
        fd = fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            write_all(fs, fd, data, path)    # a short write must not replace the file
            if self.fsync.syncs:
                fs.fsync(fd)
        finally:
            fs.close(fd)
        fs.replace(tmp, path)

    def save_state(self) -> None:
        try:
            self._save_state(self._ledger.state(), ".tmp")
        except OSError as e:
            raise self._errors.count(write_error("writing", self._state_path(), e)) from None

    def _state_path(self) -> str:
        return os.path.join(self.directory, STATE_FILE)

    def _save_state(self, state: dict, suffix: str) -> None:
        """Write ``state`` unless a newer one was written (a seal job's worker thread and
        the loop may both write it; the numbering in the file never goes back)."""
        key = (state["next_segno"], state["next_seq"])
        with self._state_lock:
            if key < self._state_written:
                return
            path = self._state_path()
            self._write_json(path, state, path + suffix)
            self._state_written = key

    # -- sealing ------------------------------------------------------------------
    def seal_active(self, notify: bool = True) -> None:
        """Seal the active segment (drop it if it holds no record)."""
        fs = self._fs
        led = self._ledger
        seg, fd = self.active, self.fd
        if seg.count == 0:
            fs.close(fd)
            self.active, self.fd = None, None
            led.remove(seg)
            unlink_quiet(seg.path, fs)
            return
        if self.dirty_tail:
            self.cut_tail()
        rec = fmt.encode_seal(seg.end_seq, seg.count, seg.data_end, self.now_ms())
        try:
            try:
                write_all(fs, fd, rec, "seal record")
            except OSError as e:
                if not is_disk_full(e):
                    raise
                # a segment can always be sealed: the reserve file gives the space back
                fs.ftruncate(fd, seg.data_end)
                if not self._budget.release_reserve():
                    raise
                write_all(fs, fd, rec, "seal record")
            fs.fsync(fd)                       # always: sealed segments are published
        except OSError as e:
            if is_disk_full(e) and self._seal_later(seg, fd, e, self.unsynced):
                self.active, self.fd = None, None
                self.unsynced = False
                self.dirty_tail = False
                return
            self.dirty_tail = True
            raise self._errors.count(write_error("sealing", seg.path, e)) from None
        self.fsyncs += 1
        fs.close(fd)
        self.active, self.fd = None, None
        self.unsynced = False
        seg.sealed = True
        try:
            self._sealed_on_disk(seg, len(rec), save_state=True)
        except OSError as e:
            # the seal record is on disk; recovery renames it.  Readers keep using the
            # old name.
            self._errors.count(write_error("renaming sealed segment", seg.path, e))
            return
        if notify:
            self._notify_sealed(seg)

    def _sealed_on_disk(self, seg: Seg, rec_len: int, *, save_state: bool) -> bool:
        """The seal record of ``seg`` is written and synced: account for it and rename
        the file to its sealed name.  An ``OSError`` of the rename is raised; False when
        the directory sync or the state save failed (counted and logged by them)."""
        seg.size = seg.data_end + rec_len
        self._ledger.count_bytes(rec_len)
        self.sealed_segments += 1
        new = os.path.join(self.directory, fmt.segment_name(seg.segno, True))
        self._fs.replace(seg.path, new)
        seg.path = new
        try:
            self.sync_dir()
            if save_state:
                self.save_state()
        except SpoolWriteError:
            return False
        return True

    def _notify_sealed(self, seg: Seg) -> None:
        for cb in self.seal_listeners:
            try:
                cb(seg.segno, seg.path)
            except Exception:
                log.exception("spool: seal listener %r failed", cb)

    def _seal_later(self, seg: Seg, fd: int, err: OSError, unsynced: bool) -> bool:
        """The disk is full and the reserve is gone: close the segment (and ``fd``) in
        memory and owe its seal record (written by :meth:`retry_pending_seals`)."""
        fs = self._fs
        try:
            fs.ftruncate(fd, seg.data_end)
        except OSError:
            return False
        self._errors.count(write_error("sealing", seg.path, err))
        if unsynced:
            # its records are no longer the active segment's: sync() would not reach them
            try:
                fs.fdatasync(fd)
                self.fsyncs += 1
            except OSError:
                pass
        fs.close(fd)
        seg.sealed = True
        self.deferred_seals += 1
        self.pending_seals.append(seg)
        log.warning("spool: disk full; segment %d closed without its seal record (written "
                    "once there is space)", seg.segno)
        return True

    def retry_pending_seals(self) -> None:
        fs = self._fs
        for seg in list(self.pending_seals):
            if self._ledger.segs.get(seg.segno) is not seg:
                self.pending_seals.remove(seg)       # acknowledged and deleted meanwhile
                if self.seal_listeners:
                    log.warning("spool: segment %d was deleted before its seal record could "
                                "be written: it was not archived", seg.segno)
                continue
            rec = fmt.encode_seal(seg.end_seq, seg.count, seg.data_end, self.now_ms())
            try:
                fd = fs.open(seg.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                write_all(fs, fd, rec, "seal record")
                fs.fsync(fd)
            except OSError:
                try:
                    fs.ftruncate(fd, seg.data_end)
                except OSError:
                    pass
                continue
            finally:
                fs.close(fd)
            self.pending_seals.remove(seg)
            try:
                if not self._sealed_on_disk(seg, len(rec), save_state=False):
                    continue
            except OSError:
                continue
            self._notify_sealed(seg)

    # -- background seals (module text) ---------------------------------------------
    def can_defer_seals(self) -> bool:
        """Background seals only where the owner's syncs wait off the loop too (else
        :meth:`sync` would wait for them on the loop anyway)."""
        return self.fsync.seals_off_loop

    async def run_seals(self, on_sealed: Callable[[], Awaitable[None]],
                        retry_s: float = 0.5) -> None:
        """Do the queued seals, in order, their waits in worker threads (the spool's
        :meth:`run`); ``await on_sealed()`` after each.  A failed seal is counted and retried
        (meanwhile :meth:`sync_async` raises its error)."""
        while True:
            if not self.sealing:
                if self.spare_fd is None and not self._closed:
                    await self._make_spare()
                    if self.sealing:
                        continue
                self._seal_wake = trio.Event()
                await self._seal_wake.wait()
                continue
            job = self.sealing[0]
            if job.stage == SealJob.WRITE:
                job.runner = token = object()
                job.idle.clear()
                try:
                    err = await trio.to_thread.run_sync(self._seal_write, job)
                finally:
                    job.idle.set()
                if job.runner is not token:
                    continue                    # done meanwhile by finish_seals (close)
                self._seal_written(job, err)
            if job.stage == SealJob.RENAME:
                self._seal_rename(job)
            if job.stage == SealJob.DIRSYNC:
                gen = self.dir_gen
                job.runner = token = object()
                job.idle.clear()
                try:
                    err = await trio.to_thread.run_sync(self._seal_dirsync, job)
                finally:
                    job.idle.set()
                if job.runner is not token:
                    continue
                self._seal_finish(job, err, gen)
            if job.stage == SealJob.DONE:
                self.sealing.popleft()
                job.announce()
                await on_sealed()
            else:
                await trio.sleep(retry_s)

    def finish_seals(self, final: bool = False) -> None:
        """Do the queued seals here and now (blocking: closing, or a sync on the loop).
        A seal that fails raises its :class:`SpoolWriteError`; with ``final`` (closing)
        its segment is left ``.open`` instead (the recovery seals it) and the rest go on."""
        while self.sealing:
            job = self.sealing[0]
            job.idle.wait()                   # a stage running in a worker thread
            job.runner = None                 # its result is stale now: done again here
            if job.stage == SealJob.WRITE:
                self._seal_written(job, self._seal_write(job))
            if job.stage == SealJob.RENAME:
                self._seal_rename(job)
            if job.stage == SealJob.DIRSYNC:
                gen = self.dir_gen
                self._seal_finish(job, self._seal_dirsync(job), gen)
            if job.stage != SealJob.DONE:
                if not final:
                    raise job.error
                if job.fd is not None:
                    self._fs.close(job.fd)
                    job.fd = None
                job.stage = SealJob.DONE
            self.sealing.popleft()
            job.announce()

    def _seal_write(self, job: SealJob) -> OSError | None:
        """(worker thread) Append the seal record and fsync: every record of the
        segment is durable then."""
        fs = self._fs
        try:
            if job.attempts:
                fs.ftruncate(job.fd, job.seg.data_end)      # what a failed attempt left
            job.attempts += 1
            write_all(fs, job.fd, job.rec, "seal record")
            fs.fsync(job.fd)
        except OSError as e:
            return e
        return None

    def _seal_written(self, job: SealJob, err: OSError | None) -> None:
        seg, fd = job.seg, job.fd
        if err is not None and is_disk_full(err):
            # the reserve gives a seal its space (on the loop: a full disk is rare)
            fs = self._fs
            try:
                fs.ftruncate(fd, seg.data_end)
                if not self._budget.release_reserve():
                    raise err
                write_all(fs, fd, job.rec, "seal record")
                fs.fsync(fd)
                err = None
            except OSError as e:
                if is_disk_full(e) and self._seal_later(seg, fd, e, job.unsynced):
                    job.fd = None
                    job.stage = SealJob.DONE
                    job.error = None
                    job.announce()
                    return
                err = e
        if err is not None:
            job.error = self._errors.count(write_error("sealing", seg.path, err))
            job.announce()
            return
        self.fsyncs += 1
        job.error = None
        job.stage = SealJob.RENAME
        job.announce()

    def _seal_rename(self, job: SealJob) -> None:
        """(loop) The seal record is durable: rename the segment to its sealed name."""
        seg = job.seg
        self._fs.close(job.fd)
        job.fd = None
        if self._ledger.segs.get(seg.segno) is not seg:
            job.stage = SealJob.DONE             # dropped meanwhile: nothing to announce
            return
        seg.size = seg.data_end + len(job.rec)
        self._ledger.count_bytes(len(job.rec))
        self.sealed_segments += 1
        new = os.path.join(self.directory, fmt.segment_name(seg.segno, True))
        try:
            self._fs.replace(seg.path, new)
        except OSError as e:
            # the seal record is on disk; recovery renames it.  Readers keep the old name.
            self._errors.count(write_error("renaming sealed segment", seg.path, e))
            seg.sealed = True
            job.stage = SealJob.DONE
            return
        seg.path = new
        job.stage = SealJob.DIRSYNC

    def _seal_dirsync(self, job: SealJob) -> OSError | None:
        """(worker thread) fsync the directory (the rename, and the names of segments
        created since), then the state file as of the roll."""
        try:
            self._fs.sync_dir(self.directory)
            self._save_state(job.state, ".seal.tmp")
        except OSError as e:
            return e
        return None

    def _seal_finish(self, job: SealJob, err: OSError | None, gen: int) -> None:
        """(loop) The segment is sealed: announce it."""
        seg = job.seg
        if err is not None:
            # counted; the seal record is durable, the name is fixed up by the recovery
            self._errors.count(write_error("syncing directory", self.directory, err))
        else:
            self.dir_synced = max(self.dir_synced, gen)
        job.stage = SealJob.DONE
        if self._ledger.segs.get(seg.segno) is seg:
            seg.sealed = True
            self._notify_sealed(seg)
            self._ledger.announce_append()     # readers and output workers look again

    def _sync_thread(self) -> SyncThread | None:
        """The C fdatasync thread, made at the first call where it can be used: on the real
        file system with its own fdatasync (a model file system or an injected failure goes
        through :meth:`Filesystem.fdatasync` in a worker thread)."""
        if not self._sync_thread_tried and not self._closed:
            self._sync_thread_tried = True
            if self._fs.native_fdatasync:
                try:
                    self.sync_thread = make_sync_thread()
                except OSError as e:      # no descriptor or thread left: trio's threads
                    log.warning("spool: no fdatasync thread of its own (%s); syncing in "
                                "worker threads", e)
        st = self.sync_thread
        return st if st is not None and self._fs.native_fdatasync else None

    def close(self) -> None:
        self._closed = True
        self.writeback.close()
        if self.sync_thread is not None:
            self.sync_thread.close()
        if self.spare_fd is not None:
            self._fs.close(self.spare_fd)
            self.spare_fd = None
            unlink_quiet(os.path.join(self.directory, SPARE_FILE), self._fs)
        if self.fd is not None:
            self._fs.close(self.fd)
            self.fd = None
