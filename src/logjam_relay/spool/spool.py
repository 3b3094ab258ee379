"""The durable spool: an append-only log of segment files with per-output cursors.

See ``docs/spool-format.md`` for the on-disk format, durability policies and
recovery.  Everything here is synchronous file I/O except :meth:`SpoolReader.wait`
and :meth:`Spool.run`, which use trio.  A :class:`Spool` must be used from one
thread (the trio thread).
"""

from __future__ import annotations

import errno as _errno
import fcntl
import json
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from ..ratelimit import RateLimitedLog
from . import segment as fmt
from .api import KIND_LOGJAM, Position, Record

log = logging.getLogger("logjam_relay.spool")

MiB = 1 << 20
_META = struct.Struct(">HBBIQQ")
_NAME_OK = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
STATE_FILE = "spool.state"
LOCK_FILE = "LOCK"
CURSOR_DIR = "cursors"

# indirection so tests can inject write failures without patching the os module
_write = os.write
_fdatasync = getattr(os, "fdatasync", os.fsync)


class SpoolError(Exception):
    """Spool misuse or an unusable spool directory.  ``reason`` is a metric label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class SpoolWriteError(SpoolError):
    """Writing to the spool failed (disk full, permissions, I/O error).

    Nothing of the failed batch is readable from the spool (a partial write is
    cut off again); the caller must not acknowledge the batch to its clients and
    should stop reading ingress and retry later."""

    def __init__(self, reason: str, message: str, errno: int | None = None,
                 path: str | None = None):
        super().__init__(reason, message)
        self.errno = errno
        self.path = path


class SpoolLockedError(SpoolError):
    pass


def _reason(e: OSError) -> str:
    return {
        _errno.ENOSPC: "enospc", _errno.EDQUOT: "edquot", _errno.EACCES: "eacces",
        _errno.EPERM: "eperm", _errno.EROFS: "erofs", _errno.ENOTDIR: "enotdir",
        _errno.ENOENT: "enoent", _errno.EIO: "eio", _errno.EEXIST: "eexist",
    }.get(e.errno, "oserror")


_HINTS = {
    "enospc": "the disk is full; free space or lower spool max_bytes",
    "edquot": "the disk quota is exhausted",
    "eacces": "permission denied; check owner/mode of the spool directory",
    "eperm": "operation not permitted; check owner/mode of the spool directory",
    "erofs": "the file system is read-only",
    "enotdir": "a path component of the spool directory is not a directory",
    "enoent": "the spool directory disappeared",
    "eio": "I/O error from the storage device",
}


def _write_error(what: str, path: str, e: OSError) -> SpoolWriteError:
    reason = _reason(e)
    hint = _HINTS.get(reason, "")
    msg = f"spool: {what} {path!r} failed: {e.strerror or e} (errno {e.errno})"
    if hint:
        msg += f" -- {hint}"
    return SpoolWriteError(reason, msg, e.errno, path)


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
    bad_offset: int | None = None    # first corrupt record found while reading

    @property
    def limit(self) -> int:
        """Where readers stop in this segment."""
        return self.data_end if self.bad_offset is None else self.bad_offset

    @property
    def end_seq(self) -> int:
        return self.first_seq + self.count


# ============================================================================ reader

class SpoolReader:
    """One output's view of the spool; implements :class:`spool.api.SpoolReader`."""

    CHUNK = 1 * MiB

    def __init__(self, spool: Spool, name: str, pos: Position, seq: int):
        self.name = name
        self._spool = spool
        self._ack_pos = pos          # first unacknowledged record
        self._ack_seq = seq
        self._read_pos = pos         # next record read() returns
        self._read_seq = seq
        self._persisted: tuple | None = None
        self._last_persist = 0.0
        self._last_served: tuple | None = None   # (Position, end offset, seq)
        self._fd: int | None = None
        self._fd_seg = -1
        self._buf = b""
        self._buf_seg = -1
        self._buf_base = 0
        self.lost = 0
        self.acks = 0
        self.records_read = 0
        self.cursor_writes = 0
        self.corrupt_skips = 0
        self._bad_counted: set[int] = set()
        self._normalize_ack(count_lost=False)

    # -- positions --------------------------------------------------------------
    def _normalize(self, pos: Position, seq: int) -> tuple[Position, int, int]:
        """Move ``pos`` past the end of sealed segments and over deleted ones.
        Returns ``(pos, seq, skipped, bad)``: ``skipped`` records were in deleted segments,
        ``bad`` lists ``(segno, n)`` unreadable records after a corrupt one."""
        sp = self._spool
        segs = sp._segs
        skipped = 0
        bad = None
        while True:
            if segs:
                first = next(iter(segs))
                if pos.segment < first:
                    new = segs[first].first_seq
                    skipped += max(0, new - seq)
                    pos, seq = Position(first, fmt.HEADER_LEN), max(seq, new)
                    continue
            seg = segs.get(pos.segment)
            if seg is None:
                if pos.segment < sp._next_segno:      # deleted, and nothing after it yet
                    skipped += max(0, sp._next_seq - seq)
                    pos, seq = Position(sp._next_segno, fmt.HEADER_LEN), max(seq, sp._next_seq)
                return pos, seq, skipped, bad
            if seg.sealed and pos.offset >= seg.limit:
                # end of a sealed segment, or of its readable part (before a corrupt record)
                if seg.bad_offset is not None and seq < seg.end_seq:
                    bad = bad or []
                    bad.append((seg.segno, seg.end_seq - seq))
                pos, seq = Position(seg.segno + 1, fmt.HEADER_LEN), max(seq, seg.end_seq)
                continue
            return pos, seq, skipped, bad

    def _normalize_read(self) -> None:
        self._read_pos, self._read_seq, _, bad = self._normalize(self._read_pos, self._read_seq)
        if bad:
            # unreadable records are lost for this reader; counted once per segment
            for segno, n in bad:
                if segno not in self._bad_counted:
                    self._bad_counted.add(segno)
                    self.lost += n

    def _normalize_ack(self, count_lost: bool = True) -> None:
        pos, seq, skipped, _ = self._normalize(self._ack_pos, self._ack_seq)
        if count_lost:
            self.lost += skipped
        self._ack_pos, self._ack_seq = pos, seq
        if self._read_seq < seq or self._read_pos < pos:
            self._read_pos, self._read_seq = pos, seq

    def _forget(self, segno: int) -> None:
        if self._fd_seg == segno and self._fd is not None:
            os.close(self._fd)
            self._fd, self._fd_seg = None, -1
        if self._buf_seg == segno:
            self._buf, self._buf_seg = b"", -1

    def _fd_for(self, seg: _Seg) -> int:
        if self._fd_seg != seg.segno:
            if self._fd is not None:
                os.close(self._fd)
                self._fd, self._fd_seg = None, -1
            self._fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
            self._fd_seg = seg.segno
        return self._fd

    def _load(self, seg: _Seg, off: int, need: int) -> None:
        size = min(max(self.CHUNK, need), seg.limit - off)
        buf = os.pread(self._fd_for(seg), size, off)
        self._buf, self._buf_seg, self._buf_base = buf, seg.segno, off
        if len(buf) < size:
            raise fmt.SegmentTruncated("short_file", "segment file shorter than expected",
                                       off + len(buf))

    # -- protocol ---------------------------------------------------------------
    def read(self, max_records: int) -> list[Record]:
        sp = self._spool
        out: list[Record] = []
        while len(out) < max_records:
            self._normalize_read()
            if self._read_seq >= sp._next_seq:
                break
            seg = sp._segs.get(self._read_pos.segment)
            if seg is None:
                break
            off = self._read_pos.offset
            if off >= seg.limit:
                break                              # end of the active segment
            try:
                if not (self._buf_seg == seg.segno
                        and self._buf_base <= off < self._buf_base + len(self._buf)):
                    self._load(seg, off, 0)
                buf, base = self._buf, self._buf_base
                stop = min(len(buf), seg.limit - base)
                recs, _, status = fmt.parse_records(buf, off - base, stop,
                                                    max_records - len(out), base)
                if recs:
                    segno = seg.segno
                    # tuple.__new__ builds the NamedTuples without their Python-level __new__
                    tnew = tuple.__new__
                    out.extend([tnew(Record, (tnew(Position, (segno, r[0])), r[1], r[3]))
                                for r in recs])
                    last = recs[-1]
                    self._read_pos = Position(segno, last[4])
                    self._read_seq = last[2] + 1
                    self._last_served = (Position(segno, last[0]), last[4], last[2])
                    continue
                if status is None:
                    continue
                if status == "partial":
                    need = fmt.PREFIX_LEN + (fmt.PREFIX.unpack_from(buf, off - base)[0]
                                             if stop - (off - base) >= fmt.PREFIX_LEN else 0)
                    if base == off and len(buf) >= min(need, seg.limit - off):
                        raise fmt.SegmentTruncated("torn", "record crosses the committed end",
                                                   off)
                    self._load(seg, off, need)
                    continue
                if status == "seal":
                    raise fmt.SegmentCorrupt("unexpected_seal", "seal record inside data", off)
                raise status
            except fmt.SegmentError as e:
                sp._on_corrupt(self, seg, e)
            except OSError as e:
                sp._on_corrupt(self, seg, fmt.SegmentError(
                    "unreadable", f"cannot read segment: {e}", off))
        self.records_read += len(out)
        return out

    async def wait(self) -> None:
        sp = self._spool
        while True:
            self._normalize_read()
            if self._read_seq < sp._next_seq:
                await trio.lowlevel.checkpoint()
                return
            await sp._appended.wait()

    def ack(self, upto: Position) -> None:
        if upto < self._ack_pos:
            return
        sp = self._spool
        seg = sp._segs.get(upto.segment)
        if seg is None:
            return
        ls = self._last_served
        if ls is not None and ls[0] == upto:
            end, seq = ls[1], ls[2]
        else:
            head = os.pread(self._fd_for(seg), fmt.MIN_RECORD, upto.offset)
            if len(head) < fmt.MIN_RECORD:
                raise ValueError(f"ack: no record at {upto}")
            body_len, _, _, _, _, seq = fmt._FULL_HEAD.unpack_from(head)
            end = upto.offset + fmt.PREFIX_LEN + body_len
            if end > seg.limit:
                raise ValueError(f"ack: no record at {upto}")
        old_segment = self._ack_pos.segment
        self._ack_pos, self._ack_seq = Position(upto.segment, end), seq + 1
        self._normalize_ack()
        self.acks += 1
        if sp._mono() - self._last_persist >= sp.cursor_flush_s:
            try:
                self.persist()
            except SpoolError:
                pass                # counted and logged; a stale cursor only causes duplicates
        if self._ack_pos.segment != old_segment:
            sp._maybe_delete()

    def rewind(self) -> None:
        self._normalize_ack()
        self._read_pos, self._read_seq = self._ack_pos, self._ack_seq

    # -- cursor -----------------------------------------------------------------
    def persist(self, force: bool = False) -> None:
        """Write the cursor file (tmp + fsync + rename) if it changed."""
        state = (self._ack_pos.segment, self._ack_pos.offset, self._ack_seq)
        self._last_persist = self._spool._mono()
        if state == self._persisted and not force:
            return
        self._spool._write_json(self._spool._cursor_path(self.name),
                                {"reader": self.name, "segment": state[0],
                                 "offset": state[1], "seq": state[2]})
        self._persisted = state
        self.cursor_writes += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd, self._fd_seg = None, -1
        self._buf, self._buf_seg = b"", -1

    def stats(self) -> dict:
        sp = self._spool
        self._normalize_ack()
        backlog = max(0, sp._next_seq - self._ack_seq)
        nbytes = 0
        age = 0.0
        if backlog:
            for seg in sp._segs.values():
                if seg.segno >= self._ack_pos.segment:
                    nbytes += seg.limit - fmt.HEADER_LEN
            nbytes -= max(0, self._ack_pos.offset - fmt.HEADER_LEN)
            seg = sp._segs.get(self._ack_pos.segment)
            if seg is not None:
                age = max(0.0, sp._clock() - seg.created_ms / 1000.0)
        return {
            "backlog_records": backlog,
            "backlog_bytes": max(0, nbytes),
            "oldest_unacked_age_s": age,
            "lost": self.lost,
            "acks": self.acks,
            "records_read": self.records_read,
            "cursor_writes": self.cursor_writes,
            "corrupt_skips": self.corrupt_skips,
            "cursor_segment": self._ack_pos.segment,
            "cursor_offset": self._ack_pos.offset,
        }


# ============================================================================ spool

class Spool:
    """Append-only segment log in ``directory`` read by the named ``readers``.

    * ``policy="block"``: :meth:`would_block` is true while the spool holds
      ``max_bytes`` or more; the caller stops reading ingress.  (Disk use may
      exceed ``max_bytes`` by one batch plus one segment header.)
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
                 fsync_interval_s: float = 1.0, cursor_flush_s: float = 0.5,
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
        self._next_segno = 0
        self._next_seq = 0
        self._bytes = 0
        self._last_meta: bytes | None = None
        self._appended = trio.Event()
        self._space = trio.Event()
        self._closed = False
        self._lock_fd: int | None = None

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
        self.last_error: str | None = None

        self._open_dir()
        try:
            raw_cursors = self._load_cursors()
            self._recover(raw_cursors)
            self.readers: dict[str, SpoolReader] = {}
            for name in readers:
                cur = raw_cursors.get(name)
                if cur is None:
                    first = next(iter(self._segs), self._next_segno)
                    seq = self._segs[first].first_seq if first in self._segs else self._next_seq
                    pos = Position(first, fmt.HEADER_LEN)
                else:
                    pos, seq = Position(cur[0], cur[1]), cur[2]
                self.readers[name] = SpoolReader(self, name, pos, min(seq, self._next_seq))
            self._maybe_delete()
        except BaseException:
            self._release_lock()
            raise

    # -- opening / recovery -----------------------------------------------------
    def _open_dir(self) -> None:
        d = self.directory
        try:
            os.makedirs(os.path.join(d, CURSOR_DIR), exist_ok=True)
            fd = os.open(os.path.join(d, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise _write_error("opening spool directory", d, e) from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise SpoolLockedError("locked", f"spool directory {d!r} is in use by another "
                                             f"process") from None
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _cursor_path(self, name: str) -> str:
        return os.path.join(self.directory, CURSOR_DIR, name + ".cursor")

    def _load_cursors(self) -> dict[str, tuple[int, int, int]]:
        out = {}
        cdir = os.path.join(self.directory, CURSOR_DIR)
        for fn in os.listdir(cdir):
            path = os.path.join(cdir, fn)
            if fn.endswith(".tmp"):
                _unlink_quiet(path)
                continue
            if not fn.endswith(".cursor"):
                continue
            try:
                with open(path, "rb") as f:
                    d = json.loads(f.read())
                out[fn[:-7]] = (int(d["segment"]), int(d["offset"]), int(d["seq"]))
            except (OSError, ValueError, KeyError, TypeError) as e:
                # a stale/missing cursor only causes duplicates (the reader starts earlier)
                log.warning("spool: ignoring unreadable cursor %s: %s", path, e)
        return out

    def _recover(self, cursors: dict[str, tuple[int, int, int]]) -> None:
        d = self.directory
        found: dict[int, tuple[str, bool]] = {}
        for fn in os.listdir(d):
            parsed = fmt.parse_segment_name(fn)
            if parsed is None:
                if fn.endswith(".tmp"):
                    _unlink_quiet(os.path.join(d, fn))
                continue
            segno, sealed = parsed
            if segno in found and found[segno][1]:
                continue                       # prefer the sealed name
            found[segno] = (os.path.join(d, fn), sealed)
        state = self._read_json(os.path.join(d, STATE_FILE)) or {}
        next_segno = int(state.get("next_segno", 0))
        next_seq = int(state.get("next_seq", 0))
        for c in cursors.values():
            next_segno = max(next_segno, c[0] + (1 if c[1] > fmt.HEADER_LEN else 0))
            next_seq = max(next_seq, c[2])

        order = sorted(found)
        for i, segno in enumerate(order):
            path, sealed = found[segno]
            is_last = i == len(order) - 1
            seg = self._recover_one(segno, path, sealed, is_last, cursors)
            if seg is not None:
                self._segs[segno] = seg
                self._bytes += seg.size
                next_segno = max(next_segno, segno + 1)
                next_seq = max(next_seq, seg.end_seq)
        self._next_segno = next_segno
        self._next_seq = next_seq
        if self._last_meta is None:
            last = next(reversed(self._segs.values()), None)
            if last is None or state.get("next_seq") == last.end_seq:
                # the state file is written at every seal and close, after the rename:
                # it is current unless we crashed in between
                try:
                    self._last_meta = bytes.fromhex(state.get("last_logjam_meta") or "")
                except (TypeError, ValueError):
                    pass
                self._last_meta = self._last_meta or None
            else:
                for seg in reversed(list(self._segs.values())):
                    res = fmt.scan_segment(seg.path)
                    if res.last_logjam_meta is not None:
                        self._last_meta = res.last_logjam_meta
                        break
        self._save_state()

    def _recover_one(self, segno, path, sealed, is_last, cursors) -> _Seg | None:
        if sealed:
            seal = fmt.read_seal(path)
            try:
                header = fmt.read_header(path)
            except fmt.SegmentError:
                header = None
            if seal is not None and header is not None:
                count, data_end, _ = seal
                return _Seg(segno, path, header.created_ms, header.first_seq, count, data_end,
                            data_end + fmt.SEAL_RECORD_LEN, True)
        res = fmt.scan_segment(path)
        if res.header is None:
            self.corrupt_tails_cut += 1
            self.corrupt_bytes_cut += res.file_size
            if res.file_size < fmt.HEADER_LEN:
                log.warning("spool: removing segment %s with a torn header (%d bytes)",
                            path, res.file_size)
                _unlink_quiet(path)
            else:
                log.error("spool: segment %s has an invalid header (%s); moved aside as "
                          "%s.corrupt", path, res.error, path)
                os.replace(path, path + ".corrupt")
            return None
        h = res.header
        if is_last and res.last_logjam_meta is not None:
            self._last_meta = res.last_logjam_meta
        if res.sealed:
            if not sealed:                      # sealed, but the rename did not happen
                new = os.path.join(self.directory, fmt.segment_name(segno, True))
                os.replace(path, new)
                path = new
            return _Seg(segno, path, h.created_ms, h.first_seq, res.records, res.valid_end,
                        res.file_size, True)
        if sealed:
            # a .seg without a valid seal: never rewritten (it may be hard-linked into the
            # archive); readers stop at the last valid record
            self.corrupt_tails_cut += 1
            self.corrupt_bytes_cut += res.cut_bytes
            log.error("spool: sealed segment %s is damaged (%s at offset %d); %d records "
                      "readable, %d bytes unreadable", path, res.error, res.error_offset,
                      res.records, res.cut_bytes)
            return _Seg(segno, path, h.created_ms, h.first_seq, res.records, res.valid_end,
                        res.file_size, True)
        # an open segment: cut a torn/corrupt tail
        if res.cut_bytes:
            self.corrupt_tails_cut += 1
            self.corrupt_bytes_cut += res.cut_bytes
            log.warning("spool: cut %d bytes of torn/corrupt tail (%s at offset %d) from %s; "
                        "%d records kept", res.cut_bytes, res.error or "torn", res.valid_end,
                        path, res.records)
            with open(path, "r+b") as f:
                f.truncate(res.valid_end)
                os.fsync(f.fileno())
        seg = _Seg(segno, path, h.created_ms, h.first_seq, res.records, res.valid_end,
                   res.valid_end, False)
        if res.records == 0:
            _unlink_quiet(path)
            return None
        beyond = any(c[0] == segno and c[1] > res.valid_end for c in cursors.values())
        if is_last and not res.cut_bytes and not beyond:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            self._active = seg
            return seg
        # not the last one, or a reader may have seen data that is gone: seal it so that
        # new records never reuse its offsets
        self._segs[segno] = seg
        self._bytes += seg.size
        self._active = seg
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._seal_active(notify=False)
        del self._segs[segno]
        self._bytes -= seg.size
        return seg

    # -- helpers ----------------------------------------------------------------
    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _read_json(self, path: str) -> dict | None:
        try:
            with open(path, "rb") as f:
                return json.loads(f.read())
        except (OSError, ValueError):
            return None

    def _write_json(self, path: str, obj: dict) -> None:
        tmp = path + ".tmp"
        data = json.dumps(obj).encode()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                _write(fd, data)
                if self.fsync != "never":
                    os.fsync(fd)
            finally:
                os.close(fd)
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
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise self._count_error(_write_error("syncing directory", self.directory, e)) from None

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
        now_ms = self._now_ms()
        act = self._active
        if act is not None and act.count and (
                act.data_end + len(data) > self.segment_bytes
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
                    raise OSError(_errno.EIO, "write returned 0")
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
                self.fsync == "interval"
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
        """
        if not self._unsynced or self._fd is None:
            return
        upto = self.bytes_appended
        seg = self._active
        fd = os.dup(self._fd)
        try:
            await trio.to_thread.run_sync(_fdatasync, fd)
        except OSError as e:
            raise self._count_error(_write_error("syncing", seg.path if seg else "?", e)) \
                from None
        finally:
            os.close(fd)
        self.fsyncs += 1
        self._last_fsync = self._mono()
        if self.bytes_appended == upto:
            self._unsynced = False

    def _create_segment(self, now_ms: int) -> None:
        segno = self._next_segno
        path = os.path.join(self.directory, fmt.segment_name(segno, False))
        header = fmt.encode_header(segno, now_ms, self._next_seq)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                         0o644)
        except OSError as e:
            raise self._count_error(_write_error("creating segment", path, e)) from None
        try:
            if _write(fd, header) != len(header):
                raise OSError(_errno.EIO, "short write of segment header")
        except OSError as e:
            os.close(fd)
            _unlink_quiet(path)
            raise self._count_error(_write_error("writing segment header to", path, e)) from None
        if self.fsync != "never":
            self._fsync_dir()
        seg = _Seg(segno, path, now_ms, self._next_seq, 0, fmt.HEADER_LEN, fmt.HEADER_LEN, False)
        self._segs[segno] = seg
        self._bytes += fmt.HEADER_LEN
        self._next_segno = segno + 1
        self._active, self._fd = seg, fd

    def seal(self) -> None:
        """Seal the active segment now (no-op if there is none)."""
        if self._active is not None:
            self._seal_active()
            self._maybe_delete()

    def _seal_active(self, notify: bool = True) -> None:
        seg, fd = self._active, self._fd
        if seg.count == 0:
            os.close(fd)
            self._active, self._fd = None, None
            del self._segs[seg.segno]
            self._bytes -= seg.size
            _unlink_quiet(seg.path)
            return
        if self._dirty_tail:
            self._cut_tail()
        rec = fmt.encode_seal(seg.end_seq, seg.count, seg.data_end, self._now_ms())
        try:
            if _write(fd, rec) != len(rec):
                raise OSError(_errno.EIO, "short write of seal record")
            os.fsync(fd)                       # always: sealed segments are published
        except OSError as e:
            self._dirty_tail = True
            raise self._count_error(_write_error("sealing", seg.path, e)) from None
        self.fsyncs += 1
        os.close(fd)
        self._active, self._fd = None, None
        self._unsynced = False
        seg.size = seg.data_end + len(rec)
        self._bytes += len(rec)
        seg.sealed = True
        self.sealed_segments += 1
        new = os.path.join(self.directory, fmt.segment_name(seg.segno, True))
        try:
            os.replace(seg.path, new)
            seg.path = new
            self._fsync_dir()
            self._save_state()
        except OSError as e:
            # the seal record is on disk; recovery renames it.  Readers keep using the
            # old name.
            self._count_error(_write_error("renaming sealed segment", seg.path, e))
            return
        except SpoolWriteError:
            pass
        if notify:
            for cb in self._seal_listeners:
                try:
                    cb(seg.segno, seg.path)
                except Exception:
                    log.exception("spool: seal listener %r failed", cb)

    def add_seal_listener(self, cb: Callable[[int, str], None]) -> None:
        """``cb(segno, path)`` is called right after a segment was sealed (before it can
        be deleted): e.g. the archive output hard-links ``path``."""
        self._seal_listeners.append(cb)

    # -- space ------------------------------------------------------------------
    def would_block(self) -> bool:
        """True if the ``block`` policy says: stop reading ingress."""
        return self.policy == "block" and self._bytes >= self.max_bytes

    @property
    def full(self) -> bool:
        return self._bytes >= self.max_bytes

    async def wait_writable(self) -> None:
        """Return once :meth:`would_block` is false."""
        while self.would_block():
            self._space = trio.Event() if self._space.is_set() else self._space
            await self._space.wait()
        await trio.lowlevel.checkpoint()

    def _make_room(self, need: int) -> None:
        while self._bytes + need > self.max_bytes and self._segs:
            oldest = next(iter(self._segs.values()))
            if oldest is self._active:
                break
            self._delete(oldest)
            self.dropped_segments += 1
            log.warning("spool: full (%d bytes), dropped oldest segment %d", self._bytes,
                        oldest.segno)
        for r in self.readers.values():
            r._normalize_ack(count_lost=True)

    def _maybe_delete(self) -> None:
        readers = self.readers.values()
        for r in readers:
            r._normalize_ack()
        while self._segs:
            oldest = next(iter(self._segs.values()))
            if not oldest.sealed or any(r._ack_pos.segment <= oldest.segno for r in readers):
                break
            self._delete(oldest)
            self.deleted_segments += 1

    def _delete(self, seg: _Seg) -> None:
        for r in self.readers.values():
            r._forget(seg.segno)
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._count_error(_write_error("deleting", seg.path, e)) from None
        del self._segs[seg.segno]
        self._bytes -= seg.size
        if not self.would_block():
            self._space.set()

    def _on_corrupt(self, reader: SpoolReader, seg: _Seg, err: fmt.SegmentError) -> None:
        """A reader found a corrupt record: nothing after it in this segment is served."""
        off = err.offset if err.offset >= 0 else reader._read_pos.offset
        self.corrupt_records += 1
        reader.corrupt_skips += 1
        self._rlog.error("corrupt_record", "spool: %s at %s offset %d (%s); the rest of "
                         "segment %d (records %d..%d) is not readable and counted as lost",
                         err, seg.path, off, err.reason, seg.segno,
                         reader._read_seq, seg.end_seq - 1)
        if seg.bad_offset is None or off < seg.bad_offset:
            seg.bad_offset = off
        reader._buf, reader._buf_seg = b"", -1
        if not seg.sealed:
            self._seal_active()
        reader._normalize_ack(count_lost=False)
        reader._normalize_read()

    # -- periodic ---------------------------------------------------------------
    def tick(self) -> None:
        """Periodic work: interval fsync, roll by age, persist cursors, delete consumed."""
        if self._closed:
            return
        if self.fsync == "interval" and self._unsynced and \
                self._mono() - self._last_fsync >= self.fsync_interval_s:
            self.sync()
        act = self._active
        if act is not None and act.count and \
                self._now_ms() - act.created_ms >= self.segment_age_s * 1000:
            self.seal()
        now = self._mono()
        for r in self.readers.values():
            if now - r._last_persist >= self.cursor_flush_s:
                try:
                    r.persist()
                except SpoolError:
                    pass            # counted and logged

    async def run(self, period: float = 0.25) -> None:
        """Call :meth:`tick` every ``period`` seconds (run it in the spool owner's nursery)."""
        while True:
            try:
                self.tick()
            except SpoolWriteError:
                pass                            # counted and logged (rate-limited)
            await trio.sleep(period)

    # -- info -------------------------------------------------------------------
    def reader(self, name: str) -> SpoolReader:
        try:
            return self.readers[name]
        except KeyError:
            raise KeyError(f"no spool reader {name!r} configured "
                           f"(have {sorted(self.readers)})") from None

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
            "readers": {n: r.stats() for n, r in self.readers.items()},
        }

    # -- closing ----------------------------------------------------------------
    def close(self, seal: bool = False) -> None:
        """Sync, persist all cursors and release the directory.  The active segment stays
        open (``.open``) and is continued after the next start unless ``seal``."""
        if self._closed:
            return
        try:
            steps = [self.seal if seal else self._sync_on_close,
                     *(r.persist for r in self.readers.values()), self._save_state]
            for step in steps:
                try:
                    step()
                except SpoolError:
                    pass                    # counted and logged; close releases everything
        finally:
            self._closed = True
            for r in self.readers.values():
                r.close()
            if self._fd is not None:
                os.close(self._fd)
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


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass

