"""The segment writer (:class:`SegmentWriter`): append, the fsync policy, sealing.

It owns the active segment and its descriptor.  Appending writes the encoded records with
one ``write()`` to the active ``.open`` segment (O_APPEND) and moves the ledger's
positions; a failed write is cut off again (nothing of it is readable).  ``fsync``:
``"batch"`` (fdatasync after every append, or by the owner through :meth:`sync_async`
with ``defer_batch_sync``), ``"interval"`` (at most every ``fsync_interval_s``) or
``"never"`` (on seal and close only).

A segment is sealed by appending its seal record, fsyncing it and renaming ``.open`` to
``.seg``; the seal listeners (the archive output) are then told.  On a full disk the
space budget's reserve is given back first; if even that does not make room the segment
is closed in memory without its seal record (*deferred seal*: readers treat it as
sealed, it can be deleted once acknowledged) and :meth:`retry_pending_seals` writes the
record once there is space again.  A crash meanwhile is harmless: an ``.open`` segment
that is not the newest is sealed by the recovery.  See docs/spool-format.md, "Full disk".
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Callable
from typing import Protocol

import trio

from . import segment as fmt
from .api import Position
from .errors import SpoolWriteError, WriteErrors, is_disk_full, write_error
from .fs import Filesystem, unlink_quiet, write_all
from .ledger import Ledger, Seg

log = logging.getLogger("logjam_relay.spool")

STATE_FILE = "spool.state"


class Reserve(Protocol):
    """What the writer asks of the space budget."""

    def segment_limit(self) -> int: ...

    def release_reserve(self) -> bool: ...


class SegmentWriter:
    def __init__(self, directory: str, fs: Filesystem, ledger: Ledger, errors: WriteErrors,
                 budget: Reserve, *, fsync: str, fsync_interval_s: float,
                 segment_age_s: float, clock: Callable[[], float],
                 monotonic: Callable[[], float]) -> None:
        self.directory = directory
        self._fs = fs
        self._ledger = ledger
        self._errors = errors
        self._budget = budget
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.segment_age_s = segment_age_s
        self._clock = clock
        self._mono = monotonic
        self.seal_listeners: list[Callable[[int, str], None]] = []
        self.active: Seg | None = None
        self.fd: int | None = None              # active segment, O_APPEND
        self.dirty_tail = False                 # a failed write may have left bytes after data_end
        self.unsynced = False
        self.last_fsync = monotonic()
        # fsync="batch" with defer_batch_sync: appends do not fsync themselves; the owner
        # awaits sync_async() (fdatasync in a worker thread) before it answers.
        self.defer_batch_sync = False
        # fsync="interval" with defer_interval_sync: neither appends nor tick() fsync; the
        # spool's run() does, every fsync_interval_s, in a worker thread.
        self.defer_interval_sync = False
        self.pending_seals: list[Seg] = []      # closed on a full disk, seal record owed
        self.appends = 0
        self.append_batches = 0
        self.bytes_appended = 0
        self.fsyncs = 0
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
        seg.count += n
        led.next_seq += n
        led.bytes += len(data)
        self.appends += n
        self.append_batches += 1
        self.bytes_appended += len(data)
        self.unsynced = True
        if (self.fsync == "batch" and not self.defer_batch_sync) or (
                self.fsync == "interval" and not self.defer_interval_sync
                and self._mono() - self.last_fsync >= self.fsync_interval_s):
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
        try:
            fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                         0o644)
        except OSError as e:
            raise self._errors.count(write_error("creating segment", path, e)) from None
        try:
            write_all(fs, fd, header, "segment header")
        except OSError as e:
            fs.close(fd)
            unlink_quiet(path, fs)
            raise self._errors.count(write_error("writing segment header to", path, e)) \
                from None
        if self.fsync != "never":
            try:
                self.sync_dir()
            except SpoolWriteError:
                fs.close(fd)
                unlink_quiet(path, fs)
                raise
        seg = Seg(segno, path, now_ms, led.next_seq, 0, fmt.HEADER_LEN, fmt.HEADER_LEN, False)
        led.add(seg)
        led.next_segno = segno + 1
        self.active, self.fd = seg, fd

    # -- syncing ------------------------------------------------------------------
    def sync(self) -> None:
        """fdatasync the active segment now (if anything is unsynced)."""
        if not self.unsynced or self.fd is None:
            return
        try:
            self._fs.fdatasync(self.fd)
        except OSError as e:
            raise self._errors.count(write_error("syncing", self.active.path, e)) from None
        self.unsynced = False
        self.last_fsync = self._mono()
        self.fsyncs += 1

    async def sync_async(self) -> None:
        """fdatasync what was appended so far, in a worker thread (the event loop runs on).

        Works on a duplicate of the segment's descriptor, so sealing or rolling the segment
        meanwhile is harmless (sealing fsyncs by itself).  Everything appended before the
        call started is durable when it returns; raises :class:`SpoolWriteError` otherwise.
        The duplicate comes from the fd reserve when the process is out of descriptors.
        """
        if not self.unsynced or self.fd is None:
            return
        fs = self._fs
        upto = self.bytes_appended
        seg = self.active
        path = seg.path if seg else "?"
        try:
            fd = fs.dup(self.fd)
        except OSError as e:
            raise self._errors.count(write_error("syncing", path, e)) from None
        try:
            await trio.to_thread.run_sync(fs.fdatasync, fd)
        except OSError as e:
            raise self._errors.count(write_error("syncing", path, e)) from None
        finally:
            fs.close(fd)
        self.fsyncs += 1
        self.last_fsync = self._mono()
        if self.bytes_appended == upto:
            self.unsynced = False

    def interval_sync_due(self) -> bool:
        return self.fsync == "interval" and self.unsynced and \
            self._mono() - self.last_fsync >= self.fsync_interval_s

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
        fs = self._fs
        tmp = path + ".tmp"
        data = json.dumps(obj).encode()
        try:
            fd = fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                write_all(fs, fd, data, path)    # a short write must not replace the file
                if self.fsync != "never":
                    fs.fsync(fd)
            finally:
                fs.close(fd)
            fs.replace(tmp, path)
        except OSError as e:
            raise self._errors.count(write_error("writing", path, e)) from None

    def save_state(self) -> None:
        self.write_json(os.path.join(self.directory, STATE_FILE), self._ledger.state())

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
            if is_disk_full(e) and self._seal_later(seg, fd, e):
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
        self._ledger.bytes += rec_len
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

    def _seal_later(self, seg: Seg, fd: int, err: OSError) -> bool:
        """The disk is full and the reserve is gone: close the segment in memory and owe
        its seal record (written by :meth:`retry_pending_seals`)."""
        fs = self._fs
        try:
            fs.ftruncate(fd, seg.data_end)
        except OSError:
            return False
        self._errors.count(write_error("sealing", seg.path, err))
        if self.unsynced:
            # its records are no longer the active segment's: sync() would not reach them
            try:
                fs.fdatasync(fd)
                self.fsyncs += 1
            except OSError:
                pass
        fs.close(fd)
        self.active, self.fd = None, None
        self.unsynced = False
        self.dirty_tail = False
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

    def close(self) -> None:
        if self.fd is not None:
            self._fs.close(self.fd)
            self.fd = None
