"""One output's view of the spool (:class:`SpoolReader`): read, ack, rewind, cursor.

Loss accounting lives here: the *acknowledged* cursor only moves forward, and every
time it moves over records that were never served (a dropped, missing, truncated or
damaged stretch) their number is added to ``lost`` (by reason, see
``Damage.lost_reasons``).  The read position skips the same stretches without counting,
so a rewind never counts twice.  See docs/spool-format.md, "Recovery".

Records of a dropped segment that the output may hold (served, or with
``reads_elsewhere`` read by a worker process, which the relay cannot see) are *pending*:
not lost while their acknowledgement may still come.  An ack resolves the pending
records up to it (delivered); a worker's skip report (:meth:`skipped`: it never read
them) and :meth:`rewind` (the output gave up on what it held) count the rest as lost.
So each record is counted once: delivered, or lost.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import trio

from ..fdreserve import RESERVE as _FDS
from . import segment as fmt
from .api import Position, Record
from .chunkread import after_partial, read_size
from .cursors import CursorLog
from .damage import Damage
from .errors import SpoolError, WriteErrors, write_error
from .fs import Filesystem
from .fsyncpolicy import FsyncPolicy
from .ledger import Ledger, Seg

MiB = 1 << 20
_fdatasync = getattr(os, "fdatasync", os.fsync)
_SERVED_MAX = 4096


class _Space(Protocol):
    space: trio.Event


class Owner(Protocol):
    """What a reader needs of the spool that owns it (:class:`spool.Spool`)."""

    ledger: Ledger
    damage: Damage
    fs: Filesystem
    errors: WriteErrors
    budget: _Space
    cursor_dir: str
    fsync: FsyncPolicy
    cursor_flush_s: float
    clock: Callable[[], float]
    monotonic: Callable[[], float]

    def on_corrupt(self, reader: SpoolReader, seg: Seg, err: fmt.SegmentError) -> None:
        """Handle damage the reader found (skip it, register the gap)."""

    def delete_acknowledged(self) -> None:
        """The reader's acknowledged cursor moved to another segment."""


class SpoolReader:
    """One output's view of the spool; implements :class:`spool.api.SpoolReader`."""

    CHUNK = 1 * MiB

    def __init__(self, spool: Owner, name: str, pos: Position, seq: int):
        self.name = name
        self._spool = spool
        self._ledger = spool.ledger
        self._damage = spool.damage
        self._fs = spool.fs
        self._ack_pos = pos          # first unacknowledged record
        self._ack_seq = seq
        self._read_pos = pos         # next record read() returns
        self._read_seq = seq
        self._persisted: tuple | None = None
        self._last_persist = -1e18
        # last record of every parsed chunk served and not yet acknowledged:
        # Position -> (end offset, seq); outputs ack those, so ack() needs no disk read
        self._served: dict[Position, tuple[int, int]] = {}
        # seq ranges [lo, hi), sorted, disjoint, below the acknowledged cursor: records of
        # dropped segments the output may still acknowledge (see the module doc)
        self._pending: list[list[int]] = []
        # the output reads the segment files in a worker process (outputs/worker.py tail
        # mode): the relay does not know how far, so a drop makes everything it took
        # from the unacknowledged part pending, and the worker reports what it skipped
        self.reads_elsewhere = False
        self._fd: int | None = None
        self._fd_seg = -1
        self._buf = b""
        self._buf_seg = -1
        self._buf_base = 0
        self._short = False
        self._log = CursorLog(spool.cursor_dir, name, spool.fsync.syncs)
        self.lost = 0
        self.lost_by_reason: dict[str, int] = {}
        self.acks = 0
        self.records_read = 0
        self.cursor_writes = 0
        self.cursor_errors = 0
        self.corrupt_skips = 0
        self._normalize_ack()

    # -- positions --------------------------------------------------------------
    def _normalize(self, pos: Position, seq: int) -> tuple[Position, int]:
        """Move ``pos`` over the end of sealed segments, over holes and over segments
        that are not on disk, to the next record that exists (or to where the next
        appended record will be).  ``seq`` follows."""
        led = self._ledger
        segs = led.segs
        while True:
            seg = segs.get(pos.segment)
            if seg is None:
                nxt = led.next_existing(pos.segment)
                if nxt is not None:
                    pos, seq = Position(nxt.segno, fmt.HEADER_LEN), max(seq, nxt.first_seq)
                    continue
                if pos.segment < led.next_segno or seq < led.next_seq:
                    pos, seq = Position(led.next_segno, fmt.HEADER_LEN), max(seq, led.next_seq)
                return pos, seq
            if seg.holes:
                hole = seg.holes.get(pos.offset)
                if hole is not None:
                    pos, seq = Position(seg.segno, hole[0]), max(seq, hole[1])
                    continue
            if (seg.sealed or seg.closed) and pos.offset >= seg.limit:
                pos, seq = Position(seg.segno + 1, fmt.HEADER_LEN), max(seq, seg.end_seq)
                continue
            return pos, seq

    def _normalize_read(self) -> None:
        self._read_pos, self._read_seq = self._normalize(self._read_pos, self._read_seq)

    def _normalize_ack(self) -> None:
        old = self._ack_seq
        pos, seq = self._normalize(self._ack_pos, old)
        if seq > old:
            self._count_lost(old, seq)
        self._ack_pos, self._ack_seq = pos, seq
        if self._read_seq < seq or self._read_pos < pos:
            self._read_pos, self._read_seq = pos, seq

    def _count_lost(self, lo: int, hi: int, remainder: bool = True) -> None:
        """Records ``lo..hi-1`` were passed over by the acknowledged cursor: lost, but
        for the pending ones (not lost unless never acknowledged).  With
        ``remainder=False`` only the registered gaps in the range count (an ack
        covering served records and a hole between them)."""
        damage = self._damage
        for a, b in _outside(self._pending, lo, hi):
            for reason, n in damage.lost_reasons(a, b, remainder):
                self._add_lost(reason, n)

    def _count_range(self, lo: int, hi: int) -> None:
        for reason, n in self._damage.lost_reasons(lo, hi):
            self._add_lost(reason, n)

    def _resolve(self, seq: int) -> None:
        """Acknowledged up to ``seq``: pending records up to it were delivered."""
        if self._pending:
            _cut(self._pending, 0, seq + 1)

    def skipped(self, lo: int | None, hi: int) -> None:
        """The output's worker passed over seqs ``lo..hi-1`` without reading them (their
        segment was gone when it got there); ``lo=None``: from its first unacknowledged
        record on (it held nothing then).  Those of them still pending are lost."""
        if self._pending:
            for a, b in _cut(self._pending, 0 if lo is None else lo, hi):
                self._count_range(a, b)

    def pending(self) -> int:
        """Records of dropped segments not yet known to be delivered or lost."""
        return sum(b - a for a, b in self._pending)

    def _add_lost(self, reason: str, n: int) -> None:
        if n > 0:
            self.lost += n
            self.lost_by_reason[reason] = self.lost_by_reason.get(reason, 0) + n

    def forget(self, segno: int) -> None:
        """Segment ``segno`` is being deleted: let go of its descriptor and data."""
        if self._fd_seg == segno and self._fd is not None:
            self._fs.close(self._fd)
            self._fd, self._fd_seg = None, -1
        if self._buf_seg == segno:
            self._buf, self._buf_seg = b"", -1

    def fd_for(self, seg: Seg) -> int:
        """A read descriptor of ``seg`` (kept until the reader moves to another one)."""
        if self._fd_seg != seg.segno:
            if self._fd is not None:
                self._fs.close(self._fd)
                self._fd, self._fd_seg = None, -1
            self._fd = self._fs.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
            self._fd_seg = seg.segno
        return self._fd

    def _load(self, seg: Seg, off: int, need: int) -> None:
        """Cache file data from ``off``.  A file shorter than expected (cut while we run)
        is not an error here: the records before the cut are served, the parser then
        reports the record the cut tore (``_short``, chunkread.after_partial)."""
        size = read_size(self.CHUNK, need, off, seg.limit)
        buf = self._fs.pread(self.fd_for(seg), size, off)
        self._buf, self._buf_seg, self._buf_base = buf, seg.segno, off
        self._short = len(buf) < size

    # -- protocol ---------------------------------------------------------------
    def read(self, max_records: int) -> list[Record]:
        sp = self._spool
        led = self._ledger
        out: list[Record] = []
        served = self._served
        while len(out) < max_records:
            self._normalize_read()
            if self._read_seq >= led.next_seq:
                break
            seg = led.segs.get(self._read_pos.segment)
            if seg is None:
                break
            off = self._read_pos.offset
            if off >= seg.limit:
                break                              # end of the active segment
            try:
                if not (self._buf_seg == seg.segno
                        and self._buf_base <= off < self._buf_base + len(self._buf)):
                    self._load(seg, off, 0)
                    if not self._buf:
                        raise fmt.SegmentTruncated("short_file", "segment file shorter than "
                                                   "expected", off)
                buf, base = self._buf, self._buf_base
                stop = min(len(buf), seg.limit - base)
                hole_at = min((h for h in seg.holes if h >= off), default=None) \
                    if seg.holes else None
                if hole_at is not None and hole_at - base < stop:
                    stop = hole_at - base
                    if stop <= off - base:
                        continue                   # at a hole: _normalize_read jumps it
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
                    if len(served) >= _SERVED_MAX:
                        del served[next(iter(served))]
                    served[Position(segno, last[0])] = (last[4], last[2])
                    continue
                if status is None:
                    continue
                if status == "partial":
                    err, need = after_partial(buf, base, off, stop, seg.limit, self._short)
                    if err is not None:
                        raise err
                    self._load(seg, off, need)
                    continue
                if status == "seal":
                    raise fmt.SegmentCorrupt("unexpected_seal", "seal record inside data", off)
                raise status
            except fmt.SegmentError as e:
                sp.on_corrupt(self, seg, e)
            except OSError as e:
                sp.on_corrupt(self, seg, fmt.SegmentError(
                    "unreadable", f"cannot read segment: {e}", off))
        self.records_read += len(out)
        return out

    async def wait(self) -> None:
        led = self._ledger
        while True:
            self._normalize_read()
            if self._read_seq < led.next_seq:
                await trio.lowlevel.checkpoint()
                return
            await led.appended.wait()

    def ack(self, upto: Position, known: tuple[int, int] | None = None) -> None:
        """Acknowledge every record up to and including the one at ``upto``.
        ``known``: ``(end offset, seq)`` of that record as an output's worker process
        parsed it (tail mode, ``outputs/worker.py``), so no disk read is needed here; it
        is checked against the segment's bounds, else the record header is read."""
        served = self._served
        hit = served.get(upto)
        if served:
            # forget everything served up to here (dict order = read order)
            while served:
                k = next(iter(served))
                if k > upto:
                    break
                del served[k]
        if self._pending:
            # acknowledgements are cumulative: what the output held up to here was
            # delivered (also from a dropped segment, whose position the cursor passed)
            if hit is not None:
                self._resolve(hit[1])
            elif known is not None:
                self._resolve(known[1])
        if upto < self._ack_pos:
            return
        sp = self._spool
        seg = self._ledger.segs.get(upto.segment)
        if seg is None:
            return
        if hit is not None:
            end, seq = hit
        elif known is not None and upto.offset + fmt.MIN_RECORD <= known[0] <= seg.limit \
                and seg.first_seq <= known[1]:
            end, seq = known
        else:
            head = self._fs.pread(self.fd_for(seg), fmt.MIN_RECORD, upto.offset)
            if len(head) < fmt.MIN_RECORD:
                raise ValueError(f"ack: no record at {upto}")
            body_len, _, _, _, _, seq = fmt.FULL_HEAD.unpack_from(head)
            end = upto.offset + fmt.PREFIX_LEN + body_len
            if end > seg.limit:
                raise ValueError(f"ack: no record at {upto}")
            self._resolve(seq)
        old_segment = self._ack_pos.segment
        if seq > self._ack_seq and self._damage.gaps:
            self._count_lost(self._ack_seq, seq, remainder=False)   # holes in the acked range
        self._ack_pos, self._ack_seq = Position(upto.segment, end), max(self._ack_seq, seq + 1)
        self._normalize_ack()
        self.acks += 1
        space = sp.budget.space
        if not space.is_set():
            space.set()                           # block policy: acked bytes free space
        if sp.monotonic() - self._last_persist >= sp.cursor_flush_s:
            self.persist_quiet()
        if self._ack_pos.segment != old_segment:
            sp.delete_acknowledged()

    def rewind(self) -> None:
        """Back to the acknowledged cursor.  Records of dropped segments the output held
        and did not acknowledge are lost now (an output's worker is restarted from the
        cursor with the same call)."""
        self._normalize_ack()
        self._count_pending()
        self._served.clear()
        self._read_pos, self._read_seq = self._ack_pos, self._ack_seq

    def _count_pending(self) -> None:
        pend, self._pending = self._pending, []
        for a, b in pend:
            self._count_range(a, b)

    def drop_marks(self) -> tuple[int, int]:
        """``(acknowledged seq, read seq)``, taken before segments are dropped."""
        return self._ack_seq, self._read_seq

    def note_drop(self, ack_seq_before: int, read_seq_before: int) -> None:
        """Segments were dropped under this reader: records it had been served (or, read
        elsewhere, may have been) keep their chance to be acknowledged (counted lost on
        rewind or skip, not now); the rest it passes over is lost."""
        hi = self._ledger.first_seq()
        if not self.reads_elsewhere:
            hi = min(read_seq_before, hi)
        if hi > ack_seq_before:
            _add(self._pending, ack_seq_before, hi)
        self._normalize_ack()

    def pending_from(self) -> int:
        """The lowest pending seq (only if :meth:`pending`)."""
        return self._pending[0][0]

    @property
    def ledger(self) -> Ledger:
        """The spool's shared positions (read them; they change through the writer)."""
        return self._ledger

    def damage_found_elsewhere(self, seg: Seg, at: Position, seq: int,
                               err: fmt.SegmentError) -> None:
        """A worker process reading for this reader found damage at ``at`` (record
        ``seq``) of ``seg``: the spool handles it as if this reader had found it.  The
        handling starts at the read position; this reader does not read in that mode
        (its read position is its acknowledged cursor), so it is put there for the
        handling and back after."""
        self._read_pos, self._read_seq = at, max(seq, self._ack_seq)
        try:
            self._spool.on_corrupt(self, seg, err)
        finally:
            self._read_pos, self._read_seq = self._ack_pos, self._ack_seq

    def compact_cursor_log(self) -> None:
        """Rewrite the cursor log as the acknowledged cursor alone (fsck)."""
        self._log.compact(self._ack_pos.segment, self._ack_pos.offset, self._ack_seq)

    @property
    def acknowledged(self) -> Position:
        """The position of the first unacknowledged record."""
        return self._ack_pos

    @property
    def acknowledged_seq(self) -> int:
        return self._ack_seq

    @property
    def last_persist(self) -> float:
        return self._last_persist

    def normalize_ack(self) -> None:
        """Move the acknowledged cursor over what is gone (counting it as lost)."""
        self._normalize_ack()

    def normalize_read(self) -> None:
        self._normalize_read()

    def damaged_at(self, err: fmt.SegmentError) -> tuple[int, int]:
        """This reader found damage (``err``): ``(offset, expected seq)`` where it is,
        counted, with the cached data dropped."""
        off = err.offset if err.offset >= 0 else self._read_pos.offset
        off = max(off, self._read_pos.offset)
        self.corrupt_skips += 1
        self._buf, self._buf_seg = b"", -1
        return off, self._read_seq

    # -- cursor -----------------------------------------------------------------
    def persist(self, force: bool = False) -> None:
        """Append the cursor to the reader's cursor log if it changed."""
        state = (self._ack_pos.segment, self._ack_pos.offset, self._ack_seq)
        self._last_persist = self._spool.monotonic()
        if state == self._persisted and not force:
            return
        try:
            self._log.append(*state)
        except OSError as e:
            self.cursor_errors += 1
            raise self._spool.errors.count(write_error("writing cursor", self._log.path, e)) \
                from None
        self._persisted = state
        self.cursor_writes += 1

    def persist_quiet(self) -> None:
        try:
            self.persist()
        except SpoolError:
            pass                # counted and logged; a stale cursor only causes duplicates

    def sync_cursor(self) -> bool:
        """True once the cursor log is durable (False: the error is counted)."""
        try:
            self._log.sync()
            return True
        except OSError as e:
            self.cursor_errors += 1
            self._spool.errors.count(write_error("syncing cursor", self._log.path, e))
            return False

    async def sync_cursor_async(self) -> bool:
        """:meth:`sync_cursor` in a worker thread (``fsync = "interval"`` with
        off the loop, ``FsyncPolicy.run_syncs_cursors``): an fdatasync no longer stalls the event loop.  True once
        the cursor log is durable, a sync that was still running included."""
        log = self._log
        try:
            fd = log.take_sync()
        except OSError as e:
            self.cursor_errors += 1
            self._spool.errors.count(write_error("syncing cursor", log.path, e))
            return False
        if fd is None:
            return True
        ok = False
        try:
            await trio.to_thread.run_sync(_fdatasync, fd)
            ok = True
        except OSError as e:
            self.cursor_errors += 1
            self._spool.errors.count(write_error("syncing cursor", log.path, e))
        finally:
            _FDS.close(fd)
            log.sync_finished(ok)
        return ok

    def close(self) -> None:
        if self._pending:
            n = self.pending()
            self._count_pending()       # never acknowledged, and their segments are gone
            self._spool.errors.rlog.warning(
                "pending_lost", "spool: output %s stopped without acknowledging %d records "
                "of dropped segments it had been sending: counted as lost", self.name, n)
        if self._fd is not None:
            self._fs.close(self._fd)
            self._fd, self._fd_seg = None, -1
        self._buf, self._buf_seg = b"", -1
        self._log.close()

    def stats(self) -> dict:
        sp = self._spool
        led = self._ledger
        self._normalize_ack()
        backlog = max(0, led.next_seq - self._ack_seq)
        nbytes = 0
        age = 0.0
        if backlog:
            for seg in led.segs.values():
                if seg.segno >= self._ack_pos.segment:
                    nbytes += seg.limit - fmt.HEADER_LEN
            nbytes -= max(0, self._ack_pos.offset - fmt.HEADER_LEN)
            seg = led.segs.get(self._ack_pos.segment)
            if seg is not None:
                age = max(0.0, sp.clock() - seg.created_ms / 1000.0)
        return {
            "backlog_records": backlog,
            "backlog_bytes": max(0, nbytes),
            "oldest_unacked_age_s": age,
            "lost": self.lost,
            "lost_by_reason": dict(self.lost_by_reason),
            "lost_pending": self.pending(),
            "acks": self.acks,
            "records_read": self.records_read,
            "cursor_writes": self.cursor_writes,
            "cursor_errors": self.cursor_errors,
            "corrupt_skips": self.corrupt_skips,
            "cursor_segment": self._ack_pos.segment,
            "cursor_offset": self._ack_pos.offset,
        }


# -- seq ranges: sorted lists of disjoint [lo, hi) ---------------------------------

def _add(ranges: list[list[int]], lo: int, hi: int) -> None:
    """Add ``[lo, hi)`` to ``ranges`` (merged with what it touches)."""
    keep = [r for r in ranges if r[1] < lo or r[0] > hi]
    for r in ranges:
        if not (r[1] < lo or r[0] > hi):
            lo, hi = min(lo, r[0]), max(hi, r[1])
    keep.append([lo, hi])
    keep.sort()
    ranges[:] = keep


def _cut(ranges: list[list[int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Remove ``[lo, hi)`` from ``ranges``; return the parts removed."""
    out: list[tuple[int, int]] = []
    keep: list[list[int]] = []
    for a, b in ranges:
        x, y = max(a, lo), min(b, hi)
        if x >= y:
            keep.append([a, b])
            continue
        out.append((x, y))
        if a < x:
            keep.append([a, x])
        if y < b:
            keep.append([y, b])
    ranges[:] = keep
    return out


def _outside(ranges: list[list[int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of ``[lo, hi)`` in none of ``ranges``."""
    out: list[tuple[int, int]] = []
    cur = lo
    for a, b in ranges:
        if b <= cur:
            continue
        if a >= hi:
            break
        if a > cur:
            out.append((cur, a))
        cur = max(cur, b)
    if cur < hi:
        out.append((cur, hi))
    return out
