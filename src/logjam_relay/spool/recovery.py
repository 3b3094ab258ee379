"""Opening a spool directory: lock, segments, cursors (mixed into :class:`Spool`).

Rules (docs/spool-format.md, "Recovery"): damage costs only the damaged records.
A segment whose header is damaged is read all the same (records carry their own CRC
and seq); one with no readable record at all is moved aside (``*.corrupt``); a torn
``.open`` tail is cut; a ``.seg`` is never modified.  Every stretch of seqs that is
gone is registered as a *gap* with a reason, so the readers count exactly those
records as lost when their cursor passes it.  A cursor that does not point at a record
(past the end, not on a record boundary) is relocated by its seq.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os

from . import cursors as curlog
from . import segment as fmt
from .api import Position
from .errors import SpoolLockedError, write_error

log = logging.getLogger("logjam_relay.spool")

STATE_FILE = "spool.state"
LOCK_FILE = "LOCK"
CURSOR_DIR = "cursors"


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class RecoveryMixin:
    # -- directory --------------------------------------------------------------
    def _open_dir(self) -> None:
        d = self.directory
        try:
            os.makedirs(os.path.join(d, CURSOR_DIR), exist_ok=True)
            fd = os.open(os.path.join(d, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise write_error("opening spool directory", d, e) from None
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

    @property
    def _cursor_dir(self) -> str:
        return os.path.join(self.directory, CURSOR_DIR)

    def _load_cursors(self) -> dict[str, tuple[int, int, int]]:
        out = {}
        cdir = self._cursor_dir
        for fn in os.listdir(cdir):
            if fn.endswith(".tmp"):
                _unlink_quiet(os.path.join(cdir, fn))
        for name in curlog.names(cdir):
            try:
                cur = curlog.load(cdir, name)
            except (OSError, ValueError) as e:
                # a stale/missing cursor only causes duplicates (the reader starts earlier)
                log.warning("spool: ignoring unreadable cursor of %s: %s", name, e)
                continue
            if cur is not None:
                out[name] = cur
        return out

    # -- segments ---------------------------------------------------------------
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
        state = self._read_json(os.path.join(d, STATE_FILE))
        if state is None:
            state = {}
            # without a state file the cursors are the only record of the numbering
            for c in cursors.values():
                state["next_segno"] = max(state.get("next_segno", 0),
                                          c[0] + (1 if c[1] > fmt.HEADER_LEN else 0))
                state["next_seq"] = max(state.get("next_seq", 0), c[2])
        next_segno = int(state.get("next_segno", 0))
        next_seq = int(state.get("next_seq", 0))
        damaged: dict[int, str] = {}          # segno -> reason its records are gone

        order = sorted(found)
        for i, segno in enumerate(order):
            path, sealed = found[segno]
            is_last = i == len(order) - 1
            seg = self._recover_one(segno, path, sealed, is_last, cursors, damaged)
            if seg is not None:
                self._segs[segno] = seg
                self._bytes += seg.size
                next_segno = max(next_segno, segno + 1)
                next_seq = max(next_seq, seg.end_seq)
        self._next_segno = next_segno
        self._next_seq = next_seq
        self._register_recovery_gaps(damaged)
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

    def _register_recovery_gaps(self, damaged: dict[int, str]) -> None:
        """Seq ranges that are not on disk, with why, for the loss counters and a log line."""
        prev_seg = None
        prev_end, prev_no = None, -1
        segs = list(self._segs.values())
        for seg in segs + [None]:
            lo = prev_end
            hi = seg.first_seq if seg is not None else self._next_seq
            upto = seg.segno if seg is not None else self._next_segno
            reasons = [r for no, r in damaged.items() if prev_no < no < upto]
            if prev_seg is not None and prev_seg.segno in damaged:
                reasons.insert(0, damaged[prev_seg.segno])
            if lo is None:
                if reasons:
                    self._add_gap(0, hi, reasons[0])
            elif hi > lo:
                reason = reasons[0] if reasons else "missing"
                self._add_gap(lo, hi, reason)
                log.error("spool: records %d..%d are not on disk (%s, between segment %s and "
                          "%s); they are counted as lost", lo, hi - 1, reason,
                          prev_seg.segno if prev_seg else "-",
                          seg.segno if seg is not None else "the next one")
            if seg is None:
                break
            prev_seg, prev_end, prev_no = seg, seg.end_seq, seg.segno

    def _recover_one(self, segno, path, sealed, is_last, cursors, damaged):
        from .spool import _Seg
        if sealed:
            seal = fmt.read_seal(path)
            try:
                header = fmt.read_header(path)
            except (fmt.SegmentError, OSError):
                header = None
            if seal is not None and header is not None and header.segno == segno:
                count, data_end, _ = seal
                return _Seg(segno, path, header.created_ms, header.first_seq, count, data_end,
                            data_end + fmt.SEAL_RECORD_LEN, True)
        res = fmt.salvage_segment(path, segno)
        if res.header is None:
            self.corrupt_tails_cut += 1
            self.corrupt_bytes_cut += res.file_size
            damaged[segno] = "corrupt"
            if res.file_size < fmt.HEADER_LEN and not sealed:
                log.warning("spool: removing segment %s with a torn header (%d bytes)",
                            path, res.file_size)
                _unlink_quiet(path)
            else:
                log.error("spool: segment %s holds no readable record (%s); moved aside as "
                          "%s.corrupt", path, res.error, path)
                os.replace(path, path + ".corrupt")
            return None
        h = res.header
        if res.error == "header":
            log.error("spool: segment %s has a damaged header; its %d records are read all "
                      "the same (seq %d..%d)", path, res.records, h.first_seq,
                      h.first_seq + res.records - 1)
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
            damaged[segno] = "truncated" if res.error in ("torn", None) else "corrupt"
            log.error("spool: sealed segment %s is damaged (%s at offset %d); %d records "
                      "readable, %d bytes unreadable", path, res.error, res.error_offset,
                      res.records, res.cut_bytes)
            return _Seg(segno, path, h.created_ms, h.first_seq, res.records, res.valid_end,
                        res.file_size, True)
        # an open segment: cut a torn/corrupt tail
        if res.cut_bytes and res.error != "header":
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
        if is_last and not res.cut_bytes and not beyond and res.error != "header":
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            self._active = seg
            return seg
        # not the last one, or a reader may have seen data that is gone: seal it so that
        # new records never reuse its offsets
        if res.error == "header" and res.cut_bytes:
            with open(path, "r+b") as f:
                f.truncate(res.valid_end)
        self._segs[segno] = seg
        self._bytes += seg.size
        self._active = seg
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._seal_active(notify=False)
        del self._segs[segno]
        self._bytes -= seg.size
        return seg

    # -- cursors ----------------------------------------------------------------
    def _place_cursor(self, name: str, cur: tuple[int, int, int] | None) -> tuple[Position, int]:
        """Where reader ``name`` starts: its cursor if that points at a record (or at a
        segment that is gone, whose records are then counted as lost); otherwise the
        record with the cursor's seq; otherwise the oldest record (duplicates only)."""
        segs = self._segs
        first = next(iter(segs.values()), None)
        oldest = (Position(first.segno, fmt.HEADER_LEN), first.first_seq) if first else \
            (Position(self._next_segno, fmt.HEADER_LEN), self._next_seq)
        if cur is None:
            return oldest
        segno, off, seq = cur
        seg = segs.get(segno)
        why = None
        if seg is None:
            before = [s for s in segs.values() if s.segno < segno]
            floor = before[-1].end_seq if before else 0
            if (segno < self._next_segno and floor <= seq <= self._next_seq) or \
                    (segno == self._next_segno and seq == self._next_seq):
                return Position(segno, fmt.HEADER_LEN if segno == self._next_segno else off), \
                    seq                                 # a segment that is gone (or next)
            why = "points past the end of the spool"
        elif off == fmt.HEADER_LEN and seq == seg.first_seq:
            return Position(segno, off), seq
        elif off == seg.data_end and seq == seg.end_seq:
            return Position(segno, off), seq
        elif fmt.HEADER_LEN < off < seg.data_end:
            try:
                with open(seg.path, "rb", buffering=0) as f:
                    head = os.pread(f.fileno(), fmt.MIN_RECORD, off)
            except OSError:
                head = b""
            if len(head) == fmt.MIN_RECORD and \
                    fmt._FULL_HEAD.unpack_from(head)[5] == seq:
                return Position(segno, off), seq
            why = "is not at the record it names"
        else:
            why = "points past the end of its segment"
        pos = self._find_seq(seq)
        if pos is not None:
            log.error("spool: cursor of %s (segment %d, offset %d, seq %d) %s; resuming at "
                      "the record with that seq (segment %d, offset %d)", name, segno, off,
                      seq, why, pos.segment, pos.offset)
            return pos, seq
        log.error("spool: cursor of %s (segment %d, offset %d, seq %d) %s and no record has "
                  "that seq; resuming at the oldest record (duplicates, no loss)", name, segno,
                  off, seq, why)
        return oldest

    def _find_seq(self, seq: int) -> Position | None:
        for seg in self._segs.values():
            if seg.first_seq <= seq < seg.end_seq:
                try:
                    for off, _kind, s, _fr, _end in _iter_with_seq(seg.path, seg.limit):
                        if s == seq:
                            return Position(seg.segno, off)
                except (fmt.SegmentError, OSError):
                    return None
                return None
            if seq == seg.end_seq and seg is self._active:
                return Position(seg.segno, seg.data_end)
        if seq == self._next_seq:
            return Position(self._next_segno, fmt.HEADER_LEN)
        return None

    # -- small files ------------------------------------------------------------
    def _read_json(self, path: str) -> dict | None:
        try:
            with open(path, "rb") as f:
                d = json.loads(f.read())
            return d if isinstance(d, dict) else None
        except (OSError, ValueError):
            return None


def _iter_with_seq(path: str, limit: int):
    """``(offset, kind, seq, frames, end)`` for every record of a segment up to ``limit``."""
    with open(path, "rb", buffering=0) as f:
        pos = fmt.HEADER_LEN
        chunk = fmt.READ_CHUNK
        while pos < limit:
            buf = os.pread(f.fileno(), min(chunk, limit - pos), pos)
            recs, used, status = fmt.parse_records(buf, 0, len(buf), 1 << 62, pos)
            yield from recs
            if isinstance(status, fmt.SegmentError):
                raise status
            if status == "seal" or not buf:
                return
            if used == 0:
                if status == "partial" and len(buf) >= chunk:
                    chunk = fmt.PREFIX_LEN + fmt.PREFIX.unpack_from(buf, 0)[0]
                    continue
                return
            pos += used
