"""Opening a spool directory: :func:`recover` reads it and returns what is on disk
(:class:`Recovered`) and the loss it found; :func:`place_cursor` places a reader.

Rules (docs/spool-format.md, "Recovery"): damage costs only the damaged records.
A segment whose header is damaged is read all the same (records carry their own CRC
and seq); one with no readable record at all is moved aside (``*.corrupt``); a torn
``.open`` tail is cut; a ``.seg`` is never modified.  Every stretch of seqs that is
gone is returned as a *gap* with a reason, so the readers count exactly those
records as lost when their cursor passes it.  An ``.open`` segment that must not be
continued (not the newest, or a reader may have seen data that is gone) is returned in
``to_seal``: the writer seals it (:meth:`SegmentWriter.recover`).  A cursor that does
not point at a record (past the end, not on a record boundary) is relocated by its seq.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from . import cursors as curlog
from . import segment as fmt
from .api import Position
from .errors import SpoolLockedError, write_error
from .fs import OS, Filesystem, truncate_file, unlink_quiet
from .ledger import Ledger, Seg
from .writer import STATE_FILE

log = logging.getLogger("logjam_relay.spool")

LOCK_FILE = "LOCK"
CURSOR_DIR = "cursors"

__all__ = ["CURSOR_DIR", "LOCK_FILE", "STATE_FILE", "Recovered", "iter_with_seq",
           "load_cursors", "lock_directory", "place_cursor", "recover"]


@dataclass
class Recovered:
    """What :func:`recover` found in a spool directory."""

    segs: dict[int, Seg]                 # ascending segment number
    next_segno: int
    next_seq: int
    last_meta: bytes | None
    active: Seg | None                   # the newest ``.open`` segment, to be continued
    to_seal: list[Seg]                   # ``.open`` segments the writer must seal
    gaps: list[tuple[int, int, str]] = field(default_factory=list)   # the loss found
    corrupt_tails_cut: int = 0
    corrupt_bytes_cut: int = 0

    def ledger(self) -> Ledger:
        return Ledger(self.segs, self.next_segno, self.next_seq, self.last_meta)


# -- directory -------------------------------------------------------------------------

def lock_directory(directory: str, fs: Filesystem = OS) -> int:
    """Create the spool directory (and its cursor directory) and lock it: the
    descriptor of the held ``LOCK`` file (closed through ``fs`` to release it)."""
    try:
        fs.makedirs(os.path.join(directory, CURSOR_DIR))
        fd = fs.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                     0o644)
    except OSError as e:
        raise write_error("opening spool directory", directory, e) from None
    try:
        fs.lock(fd)
    except OSError:
        fs.close(fd)
        raise SpoolLockedError("locked", f"spool directory {directory!r} is in use by another "
                                         f"process") from None
    return fd


def load_cursors(cdir: str) -> dict[str, tuple[int, int, int]]:
    """Every reader's persisted cursor ``(segment, offset, seq)`` in ``cdir``."""
    out = {}
    for fn in os.listdir(cdir):
        if fn.endswith(".tmp"):
            unlink_quiet(os.path.join(cdir, fn))
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


def read_state(directory: str, fs: Filesystem = OS) -> dict | None:
    try:
        d = json.loads(fs.read_file(os.path.join(directory, STATE_FILE)))
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


# -- segments --------------------------------------------------------------------------

def recover(directory: str, cursors: dict[str, tuple[int, int, int]],
            fs: Filesystem = OS) -> Recovered:
    """Read the segments of ``directory`` (repairing what the rules above say) and return
    the state they hold and the seq ranges that are gone.  ``cursors``: the readers'
    persisted cursors (a segment a reader read past the end of is not continued)."""
    d = directory
    found: dict[int, tuple[str, bool]] = {}
    for fn in fs.listdir(d):
        parsed = fmt.parse_segment_name(fn)
        if parsed is None:
            if fn.endswith(".tmp"):
                unlink_quiet(os.path.join(d, fn), fs)
            continue
        segno, sealed = parsed
        if segno in found and found[segno][1]:
            continue                       # prefer the sealed name
        found[segno] = (os.path.join(d, fn), sealed)
    state = read_state(d, fs)
    out = Recovered({}, 0, 0, None, None, [])
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
        seg = _recover_one(out, fs, d, segno, path, sealed, is_last, cursors, damaged)
        if seg is not None:
            out.segs[segno] = seg
            next_segno = max(next_segno, segno + 1)
            next_seq = max(next_seq, seg.end_seq)
    out.next_segno = next_segno
    out.next_seq = next_seq
    out.gaps = _recovery_gaps(out, damaged)
    if out.last_meta is None:
        last = next(reversed(out.segs.values()), None)
        if last is None or state.get("next_seq") == last.end_seq:
            # the state file is written at every seal and close, after the rename:
            # it is current unless we crashed in between
            try:
                out.last_meta = bytes.fromhex(state.get("last_logjam_meta") or "")
            except (TypeError, ValueError):
                pass
            out.last_meta = out.last_meta or None
        else:
            for seg in reversed(list(out.segs.values())):
                with fs.open_file(seg.path) as f:
                    res = fmt.scan_segment(f)
                if res.last_logjam_meta is not None:
                    out.last_meta = res.last_logjam_meta
                    break
    return out


def _recovery_gaps(out: Recovered, damaged: dict[int, str]) -> list[tuple[int, int, str]]:
    """Seq ranges that are not on disk, with why, for the loss counters and a log line."""
    gaps: list[tuple[int, int, str]] = []
    prev_seg = None
    prev_end, prev_no = None, -1
    segs = list(out.segs.values())
    for seg in segs + [None]:
        lo = prev_end
        hi = seg.first_seq if seg is not None else out.next_seq
        upto = seg.segno if seg is not None else out.next_segno
        reasons = [r for no, r in damaged.items() if prev_no < no < upto]
        if prev_seg is not None and prev_seg.segno in damaged:
            reasons.insert(0, damaged[prev_seg.segno])
        if lo is None:
            if reasons and hi > 0:
                gaps.append((0, hi, reasons[0]))
        elif hi > lo:
            reason = reasons[0] if reasons else "missing"
            gaps.append((lo, hi, reason))
            log.error("spool: records %d..%d are not on disk (%s, between segment %s and "
                      "%s); they are counted as lost", lo, hi - 1, reason,
                      prev_seg.segno if prev_seg else "-",
                      seg.segno if seg is not None else "the next one")
        if seg is None:
            break
        prev_seg, prev_end, prev_no = seg, seg.end_seq, seg.segno
    return gaps


def _recover_one(out: Recovered, fs: Filesystem, d: str, segno: int, path: str, sealed: bool,
                 is_last: bool, cursors, damaged: dict[int, str]) -> Seg | None:
    if sealed:
        with fs.open_file(path) as f:
            seal = fmt.read_seal(f)
            try:
                header = fmt.read_header(f)
            except (fmt.SegmentError, OSError):
                header = None
        if seal is not None and header is not None and header.segno == segno:
            count, data_end, _ = seal
            return Seg(segno, path, header.created_ms, header.first_seq, count, data_end,
                       data_end + fmt.SEAL_RECORD_LEN, True)
    with fs.open_file(path) as f:
        res = fmt.salvage_segment(f, segno)
    if res.header is None:
        out.corrupt_tails_cut += 1
        out.corrupt_bytes_cut += res.file_size
        damaged[segno] = "corrupt"
        if res.file_size < fmt.HEADER_LEN and not sealed:
            log.warning("spool: removing segment %s with a torn header (%d bytes)",
                        path, res.file_size)
            unlink_quiet(path, fs)
        else:
            log.error("spool: segment %s holds no readable record (%s); moved aside as "
                      "%s.corrupt", path, res.error, path)
            fs.replace(path, path + ".corrupt")
        return None
    h = res.header
    if res.error == "header":
        log.error("spool: segment %s has a damaged header; its %d records are read all "
                  "the same (seq %d..%d)", path, res.records, h.first_seq,
                  h.first_seq + res.records - 1)
    if is_last and res.last_logjam_meta is not None:
        out.last_meta = res.last_logjam_meta
    if res.sealed:
        if not sealed:                      # sealed, but the rename did not happen
            new = os.path.join(d, fmt.segment_name(segno, True))
            fs.replace(path, new)
            path = new
        return Seg(segno, path, h.created_ms, h.first_seq, res.records, res.valid_end,
                   res.file_size, True)
    if sealed:
        # a .seg without a valid seal: never rewritten (it may be hard-linked into the
        # archive); readers stop at the last valid record
        out.corrupt_tails_cut += 1
        out.corrupt_bytes_cut += res.cut_bytes
        damaged[segno] = "truncated" if res.error in ("torn", None) else "corrupt"
        log.error("spool: sealed segment %s is damaged (%s at offset %d); %d records "
                  "readable, %d bytes unreadable", path, res.error, res.error_offset,
                  res.records, res.cut_bytes)
        return Seg(segno, path, h.created_ms, h.first_seq, res.records, res.valid_end,
                   res.file_size, True)
    # an open segment: cut a torn/corrupt tail
    if res.cut_bytes and res.error != "header":
        out.corrupt_tails_cut += 1
        out.corrupt_bytes_cut += res.cut_bytes
        log.warning("spool: cut %d bytes of torn/corrupt tail (%s at offset %d) from %s; "
                    "%d records kept", res.cut_bytes, res.error or "torn", res.valid_end,
                    path, res.records)
        truncate_file(fs, path, res.valid_end, sync=True)
    seg = Seg(segno, path, h.created_ms, h.first_seq, res.records, res.valid_end,
              res.valid_end, False)
    if res.records == 0:
        unlink_quiet(path, fs)
        return None
    beyond = any(c[0] == segno and c[1] > res.valid_end for c in cursors.values())
    if is_last and not res.cut_bytes and not beyond and res.error != "header":
        out.active = seg
        return seg
    # not the last one, or a reader may have seen data that is gone: sealed (by the
    # writer) so that new records never reuse its offsets
    if res.error == "header" and res.cut_bytes:
        truncate_file(fs, path, res.valid_end, sync=False)
    out.to_seal.append(seg)
    return seg


# -- cursors ---------------------------------------------------------------------------

def place_cursor(ledger: Ledger, active: Seg | None, name: str,
                 cur: tuple[int, int, int] | None,
                 fs: Filesystem = OS) -> tuple[Position, int]:
    """Where reader ``name`` starts: its cursor if that points at a record (or at a
    segment that is gone, whose records are then counted as lost); otherwise the
    record with the cursor's seq; otherwise the oldest record (duplicates only)."""
    segs = ledger.segs
    first = ledger.oldest()
    oldest = (Position(first.segno, fmt.HEADER_LEN), first.first_seq) if first else \
        (Position(ledger.next_segno, fmt.HEADER_LEN), ledger.next_seq)
    if cur is None:
        return oldest
    segno, off, seq = cur
    seg = segs.get(segno)
    why = None
    if seg is None:
        before = [s for s in segs.values() if s.segno < segno]
        floor = before[-1].end_seq if before else 0
        if (segno < ledger.next_segno and floor <= seq <= ledger.next_seq) or \
                (segno == ledger.next_segno and seq == ledger.next_seq):
            return Position(segno, fmt.HEADER_LEN if segno == ledger.next_segno else off), \
                seq                                 # a segment that is gone (or next)
        why = "points past the end of the spool"
    elif off == fmt.HEADER_LEN and seq == seg.first_seq:
        return Position(segno, off), seq
    elif off == seg.data_end and seq == seg.end_seq:
        return Position(segno, off), seq
    elif fmt.HEADER_LEN < off < seg.data_end:
        try:
            fd = fs.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                head = fs.pread(fd, fmt.MIN_RECORD, off)
            finally:
                fs.close(fd)
        except OSError:
            head = b""
        if len(head) == fmt.MIN_RECORD and \
                fmt.FULL_HEAD.unpack_from(head)[5] == seq:
            return Position(segno, off), seq
        why = "is not at the record it names"
    else:
        why = "points past the end of its segment"
    pos = _find_seq(ledger, active, seq, fs)
    if pos is not None:
        log.error("spool: cursor of %s (segment %d, offset %d, seq %d) %s; resuming at "
                  "the record with that seq (segment %d, offset %d)", name, segno, off,
                  seq, why, pos.segment, pos.offset)
        return pos, seq
    log.error("spool: cursor of %s (segment %d, offset %d, seq %d) %s and no record has "
              "that seq; resuming at the oldest record (duplicates, no loss)", name, segno,
              off, seq, why)
    return oldest


def _find_seq(ledger: Ledger, active: Seg | None, seq: int, fs: Filesystem) -> Position | None:
    for seg in ledger.segs.values():
        if seg.first_seq <= seq < seg.end_seq:
            try:
                for off, _kind, s, _fr, _end in iter_with_seq(seg.path, seg.limit, fs):
                    if s == seq:
                        return Position(seg.segno, off)
            except (fmt.SegmentError, OSError):
                return None
            return None
        if seq == seg.end_seq and seg is active:
            return Position(seg.segno, seg.data_end)
    if seq == ledger.next_seq:
        return Position(ledger.next_segno, fmt.HEADER_LEN)
    return None


def _open(path_or_file, fs: Filesystem):
    if hasattr(path_or_file, "read"):
        return path_or_file, False
    return fs.open_file(path_or_file), True


def iter_with_seq(path_or_file, limit: int, fs: Filesystem = OS):
    """``(offset, kind, seq, frames, end)`` for every record of a segment up to ``limit``."""
    f, own = _open(path_or_file, fs)
    try:
        pos = fmt.HEADER_LEN
        chunk = fmt.READ_CHUNK
        while pos < limit:
            buf = fmt.read_at(f, pos, min(chunk, limit - pos))
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
    finally:
        if own:
            f.close()
