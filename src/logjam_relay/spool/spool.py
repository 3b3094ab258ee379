"""The durable spool: an append-only log of segment files with per-output cursors.

See ``docs/spool-format.md`` for the on-disk format, durability policies and
recovery.  Everything here is synchronous file I/O except :meth:`SpoolReader.wait`
and :meth:`Spool.run`, which use trio.  A :class:`Spool` must be used from one
thread (the trio thread).

The concerns live in separate modules: this one is the writer (appending, periodic
work, stats, closing); ``sealing.py`` sealing segments (and the deferred seal of a full
disk); ``space.py`` the disk bound and the full disk;
``damage.py`` damaged records and the gaps counted as lost; ``reader.py`` the outputs'
view and loss accounting; ``cursors.py`` the durable cursor logs; ``recovery.py``
opening a directory; ``fsck.py`` the offline check/repair; ``errors.py`` exceptions.
"""

from __future__ import annotations

import errno as _errno
import json
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from ..fdreserve import RESERVE as _FDS
from ..ratelimit import RateLimitedLog
from . import segment as fmt
from .api import KIND_LOGJAM, Position, Record  # noqa: F401  (re-exported)
from .damage import DamageMixin
from .errors import HINTS as _HINTS  # noqa: F401
from .errors import (  # noqa: F401  (re-exported)
    SpoolError,
    SpoolLockedError,
    SpoolWriteError,
    is_disk_full,
)
from .errors import reason_of as _reason  # noqa: F401
from .errors import write_error as _write_error
from .reader import SpoolReader
from .recovery import CURSOR_DIR, LOCK_FILE, STATE_FILE, RecoveryMixin, _unlink_quiet  # noqa: F401
from .sealing import SealMixin
from .space import RESERVE_BYTES, RESERVE_FILE, SpaceMixin  # noqa: F401

log = logging.getLogger("logjam_relay.spool")

MiB = 1 << 20
_META = struct.Struct(">HBBIQQ")
_NAME_OK = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")

# indirection so tests can inject write failures without patching the os module
_write = os.write
_fdatasync = getattr(os, "fdatasync", os.fsync)


@dataclass(slots=True)
class _Seg:
    segno: int
    path: str
    created_ms: int
    first_seq: int
    count: int          # data records
    data_end: int       # end of the data records (committed size of the active segment)
    size: int           # bytes on disk
    sealed: bool
    bad_offset: int | None = None    # first corrupt record found while reading (no resync)
    # damaged stretches found while reading: offset -> (resume offset, resume seq)
    holes: dict = field(default_factory=dict)

    @property
    def limit(self) -> int:
        """Where readers stop in this segment."""
        return self.data_end if self.bad_offset is None else self.bad_offset

    @property
    def end_seq(self) -> int:
        return self.first_seq + self.count


# ============================================================================ spool

class Spool(SealMixin, SpaceMixin, DamageMixin, RecoveryMixin):
    """Append-only segment log in ``directory`` read by the named ``readers``.

    * ``policy="block"``: :meth:`would_block` is true while the records no reader
      has acknowledged yet take ``max_bytes`` or more (or the disk is full); the
      caller stops reading ingress.  It clears as soon as an acknowledgement frees
      space, so disk use may exceed ``max_bytes`` by the acknowledged part of the
      oldest segment plus one batch.
    * ``policy="drop_oldest"``: appending deletes the oldest sealed segments to
      stay under ``max_bytes``; unacknowledged records in them are counted as
      ``lost`` per reader.
    * ``fsync``: ``"batch"`` (fdatasync after every append), ``"interval"``
      (at most every ``fsync_interval_s``, on append or :meth:`tick`) or
      ``"never"`` (on seal and close only).
    """

    def __init__(self, directory, *, readers: Sequence[str], segment_bytes: int = 64 * MiB,
                 segment_age_s: float = 300.0, max_bytes: int = 8 << 30,
                 policy: str = "block", fsync: str = "interval",
                 fsync_interval_s: float = 1.0, cursor_flush_s: float = 0.0,
                 on_seal: Callable[[int, str], None] | None = None,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic):
        if policy not in ("block", "drop_oldest"):
            raise ValueError(f"spool policy must be 'block' or 'drop_oldest', not {policy!r}")
        if fsync not in ("batch", "interval", "never"):
            raise ValueError(f"spool fsync must be 'batch', 'interval' or 'never', not {fsync!r}")
        for name in readers:
            if not _NAME_OK.match(name):
                raise ValueError(f"bad spool reader name {name!r} (use [A-Za-z0-9_.-])")
        if len(set(readers)) != len(readers):
            raise ValueError("duplicate spool reader names")
        if max_bytes < 4 * 4096:
            raise ValueError("spool max_bytes is too small")
        self.directory = os.fspath(directory)
        # at least 4 segments fit in max_bytes, so drop_oldest always has sealed ones to drop
        self.segment_bytes = max(4096, min(segment_bytes, max_bytes // 4))
        self.segment_age_s = segment_age_s
        self.max_bytes = max_bytes
        self.policy = policy
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.cursor_flush_s = cursor_flush_s
        self._clock = clock
        self._mono = monotonic
        self._seal_listeners: list[Callable[[int, str], None]] = [on_seal] if on_seal else []
        self._rlog = RateLimitedLog(log)

        self._segs: dict[int, _Seg] = {}      # ascending segno (insertion order)
        self._active: _Seg | None = None
        self._fd: int | None = None           # active segment, O_APPEND
        self._dirty_tail = False              # a failed write may have left bytes after data_end
        self._unsynced = False
        self._last_fsync = self._mono()
        # fsync="batch" with defer_batch_sync: appends do not fsync themselves; the owner
        # awaits sync_async() (fdatasync in a worker thread) before it answers.
        self.defer_batch_sync = False
        # fsync="interval" with defer_interval_sync: neither appends nor tick() fsync; run()
        # does, every fsync_interval_s, in a worker thread (the event loop goes on).
        self.defer_interval_sync = False
        self._next_segno = 0
        self._next_seq = 0
        self._bytes = 0
        self._last_meta: bytes | None = None
        self._appended = trio.Event()
        self._space = trio.Event()
        self._closed = False
        self._lock_fd: int | None = None
        # seq ranges known to be gone, [lo, hi, reason]: readers count them as lost
        self._gaps: list[list] = []
        self._disk_full: str | None = None     # set on ENOSPC, cleared when space is freed
        self._disk_full_at = 0.0
        self._blocked_since: float | None = None
        self._blocked_total = 0.0
        self._reserve_ok = False
        self._pending_seals: list[_Seg] = []     # closed on a full disk, seal record owed
        self._reserve_tried = 0.0
        self._last_cursor_sync = 0.0
        self._pressure_at: float | None = None
        self._pressure_bytes = self.segment_bytes

        # counters
        self.appends = 0
        self.append_batches = 0
        self.bytes_appended = 0
        self.fsyncs = 0
        self.corrupt_tails_cut = 0
        self.corrupt_bytes_cut = 0
        self.corrupt_records = 0
        self.write_errors = 0
        self.write_errors_by_reason: dict[str, int] = {}
        self.dropped_segments = 0
        self.deleted_segments = 0
        self.sealed_segments = 0
        self.enospc_drops = 0
        self.deferred_seals = 0
        self.enospc_seals = 0
        self.reserve_releases = 0
        self.last_error: str | None = None

        self._open_dir()
        try:
            raw_cursors = self._load_cursors()
            self._recover(raw_cursors)
            self.readers: dict[str, SpoolReader] = {}
            for name in readers:
                pos, seq = self._place_cursor(name, raw_cursors.get(name))
                self.readers[name] = SpoolReader(self, name, pos, min(seq, self._next_seq))
            for r in self.readers.values():
                if r.lost:
                    log.error("spool: output %s lost %d records that are not on disk (%s)",
                              r.name, r.lost, ", ".join(f"{k} {v}" for k, v in
                                                        sorted(r.lost_by_reason.items())))
                try:
                    r.persist(force=True)       # every reader has a durable cursor from now on
                except SpoolError:
                    pass
            self._make_reserve()
            if not self._seal_listeners:
                self._maybe_delete()
            # else: segments sealed by the recovery (or sealed before a crash that came
            # between the rename and the listener) were never announced; deleting them
            # now (at once when no output reads the spool) would lose them from the
            # archive too. The owner announces them (Archive.catch_up) and they are
            # deleted on the next seal or acknowledgement.
        except BaseException:
            self._release_lock()
            raise

    # -- helpers ----------------------------------------------------------------
    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _write_json(self, path: str, obj: dict) -> None:
        tmp = path + ".tmp"
        data = json.dumps(obj).encode()
        try:
            fd = _FDS.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                _write_all(fd, data, path)    # a short write must not replace the file
                if self.fsync != "never":
                    os.fsync(fd)
            finally:
                _FDS.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            raise self._count_error(_write_error("writing", path, e)) from None

    def _save_state(self) -> None:
        self._write_json(os.path.join(self.directory, STATE_FILE),
                         {"next_segno": self._next_segno, "next_seq": self._next_seq,
                          "last_logjam_meta": (self._last_meta.hex()
                                               if self._last_meta is not None else None)})

    def _fsync_dir(self) -> None:
        try:
            fd = _FDS.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                _FDS.close(fd)
        except OSError as e:
            raise self._count_error(_write_error("syncing directory", self.directory, e)) from None

    @staticmethod
    def _write_all(fd: int, data: bytes, what: str) -> None:
        _write_all(fd, data, what)

    def _count_error(self, err: SpoolWriteError) -> SpoolWriteError:
        self.write_errors += 1
        self.write_errors_by_reason[err.reason] = self.write_errors_by_reason.get(err.reason, 0) + 1
        self.last_error = str(err)
        self._rlog.error("write_" + err.reason, "%s", err)
        return err

    # -- writing ----------------------------------------------------------------
    def append_batch(self, batch: Sequence[Sequence[bytes]]) -> Position | None:
        """Append logjam messages (each exactly 4 frames: app_env, topic, body, meta)
        with one write.  Returns the position of the first record.  Raises
        :class:`SpoolWriteError` if it could not be handed to the OS."""
        if not batch:
            return None
        data = fmt.encode_logjam_batch(batch, self._next_seq)
        pos = self._append_bytes(data, len(batch))
        self._last_meta = batch[-1][3]
        return pos

    def append_encoded(self, data: bytes, n: int, first_seq: int,
                       last_meta: bytes) -> Position | None:
        """Append ``n`` logjam records already encoded (the relay's C PULL pass) as
        :func:`segment.encode_logjam_batch` encodes them from spool sequence ``first_seq``.
        If something was appended since they were numbered (a heartbeat while a failed
        write waited to be retried), they are numbered again from the spool's next seq."""
        if not n:
            return None
        if first_seq != self._next_seq:
            recs, _, status = fmt.parse_records(data, 0, len(data), n)
            if len(recs) != n or status is not None:
                raise ValueError("append_encoded: data does not hold n logjam records")
            data = fmt.encode_logjam_batch([r[3] for r in recs], self._next_seq)
        pos = self._append_bytes(data, n)
        self._last_meta = last_meta
        return pos

    def append_records(self, records: Sequence[tuple[int, Sequence[bytes]]]) -> Position | None:
        """Append ``(kind, frames)`` records of any kind / frame count with one write."""
        if not records:
            return None
        data = fmt.encode_records(records, self._next_seq)
        pos = self._append_bytes(data, len(records))
        for kind, frames in reversed(records):
            if kind == KIND_LOGJAM and len(frames) == 4:
                self._last_meta = frames[3]
                break
        return pos

    def append(self, frames: Sequence[bytes], kind: int = KIND_LOGJAM) -> Position:
        return self.append_records([(kind, frames)])

    def _append_bytes(self, data: bytes, n: int) -> Position:
        if self._closed:
            raise SpoolError("closed", "spool is closed")
        try:
            pos = self._append_once(data, n)
        except SpoolWriteError as e:
            if not is_disk_full(e):
                raise
            pos = self._append_on_full_disk(data, n, e)
        if self._disk_full is not None:
            self._disk_full = None
            self._space.set()
        return pos

    def _append_once(self, data: bytes, n: int) -> Position:
        now_ms = self._now_ms()
        act = self._active
        if act is not None and act.count and (
                act.data_end + len(data) > self._segment_limit()
                or now_ms - act.created_ms >= self.segment_age_s * 1000):
            self._seal_active()
        if self.policy == "drop_oldest":
            self._make_room(len(data) + (fmt.HEADER_LEN if self._active is None else 0))
        if self._active is None:
            self._create_segment(now_ms)
        seg = self._active
        fd = self._fd
        if self._dirty_tail:
            self._cut_tail()
        start = seg.data_end
        try:
            view = memoryview(data)
            done = 0
            while done < len(data):
                w = _write(fd, view[done:])
                if w <= 0:
                    raise OSError(_errno.ENOSPC, "write returned 0")
                done += w
        except OSError as e:
            self._dirty_tail = True
            err = self._count_error(_write_error("appending to", seg.path, e))
            try:
                self._cut_tail()
            except SpoolWriteError:
                pass
            raise err from None
        seg.data_end += len(data)
        seg.size = seg.data_end
        seg.count += n
        self._next_seq += n
        self._bytes += len(data)
        self.appends += n
        self.append_batches += 1
        self.bytes_appended += len(data)
        self._unsynced = True
        if (self.fsync == "batch" and not self.defer_batch_sync) or (
                self.fsync == "interval" and not self.defer_interval_sync
                and self._mono() - self._last_fsync >= self.fsync_interval_s):
            self.sync()
        ev = self._appended
        self._appended = trio.Event()
        ev.set()
        return Position(seg.segno, start)

    def _cut_tail(self) -> None:
        """Remove bytes a failed write left after the committed end."""
        seg = self._active
        try:
            os.ftruncate(self._fd, seg.data_end)
        except OSError as e:
            raise self._count_error(_write_error("truncating", seg.path, e)) from None
        self._dirty_tail = False

    def sync(self) -> None:
        """fdatasync the active segment now (if anything is unsynced)."""
        if not self._unsynced or self._fd is None:
            return
        try:
            _fdatasync(self._fd)
        except OSError as e:
            raise self._count_error(_write_error("syncing", self._active.path, e)) from None
        self._unsynced = False
        self._last_fsync = self._mono()
        self.fsyncs += 1

    async def sync_async(self) -> None:
        """fdatasync what was appended so far, in a worker thread (the event loop runs on).

        Works on a duplicate of the segment's descriptor, so sealing or rolling the segment
        meanwhile is harmless (sealing fsyncs by itself).  Everything appended before the
        call started is durable when it returns; raises :class:`SpoolWriteError` otherwise.
        The duplicate comes from the fd reserve when the process is out of descriptors.
        """
        if not self._unsynced or self._fd is None:
            return
        upto = self.bytes_appended
        seg = self._active
        path = seg.path if seg else "?"
        try:
            fd = _FDS.dup(self._fd)
        except OSError as e:
            raise self._count_error(_write_error("syncing", path, e)) from None
        try:
            await trio.to_thread.run_sync(_fdatasync, fd)
        except OSError as e:
            raise self._count_error(_write_error("syncing", path, e)) from None
        finally:
            _FDS.close(fd)
        self.fsyncs += 1
        self._last_fsync = self._mono()
        if self.bytes_appended == upto:
            self._unsynced = False

    def _create_segment(self, now_ms: int) -> None:
        segno = self._next_segno
        path = os.path.join(self.directory, fmt.segment_name(segno, False))
        header = fmt.encode_header(segno, now_ms, self._next_seq)
        try:
            fd = _FDS.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                           0o644)
        except OSError as e:
            raise self._count_error(_write_error("creating segment", path, e)) from None
        try:
            _write_all(fd, header, "segment header")
        except OSError as e:
            _FDS.close(fd)
            _unlink_quiet(path)
            raise self._count_error(_write_error("writing segment header to", path, e)) from None
        if self.fsync != "never":
            try:
                self._fsync_dir()
            except SpoolWriteError:
                _FDS.close(fd)
                _unlink_quiet(path)
                raise
        seg = _Seg(segno, path, now_ms, self._next_seq, 0, fmt.HEADER_LEN, fmt.HEADER_LEN, False)
        self._segs[segno] = seg
        self._bytes += fmt.HEADER_LEN
        self._next_segno = segno + 1
        self._active, self._fd = seg, fd

    # -- periodic ---------------------------------------------------------------
    def tick(self) -> None:
        """Periodic work: interval fsync, roll by age, persist cursors, delete consumed."""
        if self._closed:
            return
        if self._interval_sync_due() and not self.defer_interval_sync:
            self.sync()
        act = self._active
        if act is not None and act.count and \
                self._now_ms() - act.created_ms >= self.segment_age_s * 1000:
            self.seal()
        now = self._mono()
        for r in self.readers.values():
            if now - r._last_persist >= self.cursor_flush_s:
                r._persist_quiet()
        # cursor logs: write() on every ack; fdatasync per the fsync policy (interval with
        # defer_interval_sync: run() does it, in a worker thread)
        if self.fsync == "batch" or (self.fsync == "interval" and not self.defer_interval_sync
                                     and now - self._last_cursor_sync >= self.fsync_interval_s):
            self._last_cursor_sync = now
            for r in self.readers.values():
                r.sync_cursor()
        if self._pending_seals:
            self._retry_pending_seals()
        if not self._reserve_ok and self._disk_full is None and now - self._reserve_tried >= 5:
            self._make_reserve()

    def _interval_sync_due(self) -> bool:
        return self.fsync == "interval" and self._unsynced and \
            self._mono() - self._last_fsync >= self.fsync_interval_s

    async def run(self, period: float = 0.25) -> None:
        """Call :meth:`tick` every ``period`` seconds (run it in the spool owner's nursery);
        with ``defer_interval_sync``, the interval fdatasync too, in a worker thread."""
        while True:
            try:
                if self.defer_interval_sync and not self._closed and \
                        self._interval_sync_due():
                    await self.sync_async()
                if self.defer_interval_sync and self.fsync == "interval" and \
                        not self._closed and \
                        self._mono() - self._last_cursor_sync >= self.fsync_interval_s:
                    self._last_cursor_sync = self._mono()
                    for r in list(self.readers.values()):
                        await r.sync_cursor_async()
                self.tick()
            except SpoolWriteError:
                pass                            # counted and logged (rate-limited)
            except OSError as e:                # never the end of the relay: retried
                self._count_error(_write_error("running periodic work in", self.directory, e))
            await trio.sleep(period)

    # -- info -------------------------------------------------------------------
    def reader(self, name: str) -> SpoolReader:
        try:
            return self.readers[name]
        except KeyError:
            raise KeyError(f"no spool reader {name!r} configured "
                           f"(have {sorted(self.readers)})") from None

    @property
    def next_seq(self) -> int:
        """The spool sequence number the next appended record gets."""
        return self._next_seq

    def last_meta(self) -> tuple[int, int, int, int, int, int] | None:
        """``(tag, compression, version, device, created_ms, sequence)`` of the last
        logjam record in the spool, or None."""
        m = self._last_meta
        if m is None or len(m) != _META.size:
            return None
        return _META.unpack(m)

    def last_sequence(self) -> int | None:
        m = self.last_meta()
        return None if m is None else m[5]

    def stats(self) -> dict:
        readers = {n: r.stats() for n, r in self.readers.items()}
        lost: dict[str, int] = {}
        for r in readers.values():
            for k, v in r["lost_by_reason"].items():
                lost[k] = lost.get(k, 0) + v
        return {
            "bytes": self._bytes,
            "max_bytes": self.max_bytes,
            "full": int(self.full),
            "segments": len(self._segs),
            "sealed_segments": self.sealed_segments,
            "deleted_segments": self.deleted_segments,
            "dropped_segments": self.dropped_segments,
            "appends": self.appends,
            "append_batches": self.append_batches,
            "bytes_appended": self.bytes_appended,
            "fsyncs": self.fsyncs,
            "corrupt_tails_cut": self.corrupt_tails_cut,
            "corrupt_bytes_cut": self.corrupt_bytes_cut,
            "corrupt_records": self.corrupt_records,
            "write_errors": self.write_errors,
            "write_errors_by_reason": dict(self.write_errors_by_reason),
            "next_seq": self._next_seq,
            "readers": readers,
            "lost": sum(r["lost"] for r in readers.values()),
            "lost_by_reason": lost,
            "paused": int(self.would_block()),
            "disk_full": int(self._disk_full is not None),
            "enospc_seals": self.enospc_seals,
            "enospc_drops": self.enospc_drops,
            "reserve_releases": self.reserve_releases,
            "deferred_seals": self.deferred_seals,
            "cursor_writes": sum(r["cursor_writes"] for r in readers.values()),
        }

    # -- closing ----------------------------------------------------------------
    def close(self, seal: bool = False) -> None:
        """Sync, persist all cursors and release the directory.  The active segment stays
        open (``.open``) and is continued after the next start unless ``seal``."""
        if self._closed:
            return
        try:
            steps = [self.seal if seal else self._sync_on_close, self._retry_pending_seals,
                     *(r.persist for r in self.readers.values()), self._save_state]
            for step in steps:
                try:
                    step()
                except SpoolError:
                    pass                    # counted and logged; close releases everything
            if self.fsync != "never":
                for r in self.readers.values():
                    r.sync_cursor()
        finally:
            self._closed = True
            for r in self.readers.values():
                r.close()
            if self._fd is not None:
                _FDS.close(self._fd)
                self._fd = None
            self._release_lock()

    def _sync_on_close(self) -> None:
        if self._active is not None:
            self._unsynced = True
            self.sync()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()



def _write_all(fd: int, data: bytes, what: str) -> None:
    """write() until done; a short write is retried, so that a full disk surfaces as
    the ENOSPC of the next call (not as a made-up EIO)."""
    view = memoryview(data)
    done = 0
    while done < len(data):
        w = _write(fd, view[done:])
        if w <= 0:
            raise OSError(_errno.ENOSPC, f"short write of {what}")
        done += w

