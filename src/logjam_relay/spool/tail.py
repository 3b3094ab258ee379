"""Read-only tailing of the spool's segment files, for an output in another process.

With ``output_isolation = "process"`` (``outputs/worker.py``) the worker process reads
the segment files itself: the relay only tells it which segments exist and how far
each is committed (a *snapshot*, see :func:`snapshot`), and applies the worker's
acknowledgements (spool positions) to the output's real
:class:`~logjam_relay.spool.reader.SpoolReader`, which keeps the cursor log and the
loss accounting.  Segments are append-only and a sealed one is immutable, so a reader
that stops at the committed end the relay announced never sees a torn record.

:class:`SegmentTail` implements the reader protocol of ``spool/api.py`` (``read``,
``wait``, ``ack``, ``rewind``, ``stats``) on such snapshots.  It never decides a loss:

* a segment the snapshot no longer lists was deleted (``drop_oldest``, or acknowledged
  by every reader): reading jumps to the next listed one and the seqs jumped over are
  reported (``skipped(lo, hi)``): the relay's reader counts those of a dropped segment
  as lost.  What was read from a segment before it was dropped is not lost unless it is
  never acknowledged: every ack carries the seq of the acknowledged record (the relay
  can no longer look it up once the segment is gone), so the relay knows it was
  delivered;
* a segment file that cannot be opened, or a damaged record, is reported through
  ``report(segno, offset, seq, reason, message)``; the relay runs its damage handling
  (:meth:`Spool.on_corrupt`: resync, gap, hole or ``bad_offset``) and sends a new
  snapshot, with which reading goes on.  Until then this segment is not read.

Pure apart from ``os.open``/``os.pread`` on the segment files and one ``trio.Event``.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections import deque

import trio

from .. import _native
from . import segment as fmt
from .api import Position, Record
from .chunkread import after_partial, read_size
from .ledger import Ledger

MiB = 1 << 20
_SERVED_MAX = 4096

_tailread = _native.load("logjam_relay.spool._tailread")     # the optional C reads


def read_block_py(buf, pos: int, end: int, max_records: int, base: int, segno: int,
                  skip: bool, parse=None):
    """The records of ``buf[pos:end]`` as ``Record(Position(segno, offset), kind, frames)``
    (``_tailread.read`` in Python, the reference): ``(records, pos, next_seq, status,
    parsed)``.  Parsed and checked by :func:`segment.parse_records` (``status`` as there);
    ``skip`` passes over the first parsed record; ``pos`` is the buffer offset after the
    last parsed record, ``next_seq`` its sequence + 1 (-1 if none), ``parsed`` how many
    were parsed (returned or skipped)."""
    recs, _, status = (parse or fmt.parse_records)(buf, pos, end, max_records, base)
    if not recs:
        return [], pos, -1, status, 0
    last = recs[-1]
    tnew = tuple.__new__
    out = [tnew(Record, (tnew(Position, (segno, r[0])), r[1], r[3]))
           for r in (recs[1:] if skip else recs)]
    return out, last[4] - base, last[2] + 1, status, len(recs)


def _read_block_c(buf, pos: int, end: int, max_records: int, base: int, segno: int,
                  skip: bool):
    """:func:`read_block_py` in C (``_tailread.c``): same records, same statuses."""
    res = _tailread.read(buf, pos, end, max_records, base, segno, skip, Record, Position)
    if type(res[3]) is tuple:
        res = (*res[:3], fmt.SegmentCorrupt(*res[3]), res[4])
    return res


read_block = read_block_py if _tailread is None else _read_block_c

#: the records of a read as one buffer (spool/_recblock.h), or None (lists of Records)
RecordBlock = getattr(_tailread, "RecordBlock", None)


def _read_into_c(block, buf, pos: int, end: int, max_records: int, base: int, segno: int,
                 skip: bool):
    """:func:`read_block_py`, the records appended to ``block`` (``_tailread.read_into``):
    ``(added, pos, next_seq, status, parsed)``."""
    res = _tailread.read_into(block, buf, pos, end, max_records, base, segno, skip)
    if type(res[3]) is tuple:
        res = (*res[:3], fmt.SegmentCorrupt(*res[3]), res[4])
    return res

# snapshot entry: (segno, path, limit, sealed, first_seq, holes)
#   limit: where readers stop (committed end of the active segment, data end of a
#   sealed one, or the first unreadable offset); holes: ((offset, resume, seq), ...);
#   sealed: no record is appended any more (also a segment closed by a roll whose seal
#   still runs: a worker reads on in the next one, and a path .open may be .seg by now)


def snapshot(ledger: Ledger, from_segment: int) -> tuple:
    """The segments from ``from_segment`` on (of a spool's ``ledger``), as the relay
    announces them to a worker."""
    return tuple((s.segno, s.path, s.limit, s.sealed or s.closed, s.first_seq,
                  tuple(sorted((o, h[0], h[1]) for o, h in s.holes.items())) if s.holes
                  else ())
                 for s in ledger.segs.values() if s.segno >= from_segment)


def handle_damage(reader, segno: int, off: int, seq: int, reason: str, message: str) -> None:
    """The relay's half of a damage report: run the spool's damage handling for the
    output's reader (resync and hole, or ``bad_offset``; a gap that every reader counts
    as lost), as if the reader itself had found it.  A stale report (already handled,
    or its segment deleted meanwhile) changes nothing; the worker gets a new snapshot
    either way."""
    seg = reader.ledger.segs.get(segno)
    if seg is None or off >= seg.limit or off in seg.holes:
        return
    if reason in ("torn", "short_file"):
        err = fmt.SegmentTruncated(reason, message, off)
    elif reason == "unreadable":
        err = fmt.SegmentError(reason, message, off)
    else:
        err = fmt.SegmentCorrupt(reason, message, off)
    reader.damage_found_elsewhere(seg, Position(segno, off), seq, err)


class SegmentTail:
    """An output's reader in a worker process, on the relay's segment snapshots."""

    CHUNK = 1 * MiB

    def __init__(self, name: str, start: Position, start_seq: int, send_ack, report,
                 skipped=None):
        """``send_ack(position, known)``: ``known`` is ``(end offset, seq)`` of the
        acknowledged record (None only for a position this reader did not read).
        ``skipped(lo, hi)``: reading jumped from seq ``lo`` to the next segment, which
        starts at ``hi`` (``lo`` None: from the first unacknowledged record, nothing
        read since a rewind)."""
        self.name = name
        self._send_ack = send_ack
        self._report = report
        self._segs: dict[int, tuple] = {}         # segno -> snapshot entry
        self._pos = Position(*start)            # next record read() returns
        self._seq: int | None = start_seq      # seq of the record at _pos (None: unknown)
        self._skipped = skipped
        self._first = Position(*start)          # first record not acknowledged (if _acked None)
        self._first_seq = start_seq
        self._acked: Position | None = None     # last acknowledged record
        self._acked_seq = -1
        self._skip = False                      # read(): pass over the record at _pos
        # last record of every block read and not yet acknowledged: Position -> (end, seq)
        self._served: dict[Position, tuple[int, int]] = {}
        # every parse read and not yet acknowledged, in read order, to find the end and
        # seq of any acknowledged record: (first position, last position, records,
        # index of the first, count, seq of the first, end of the last)
        self._runs: deque = deque()
        self._stuck: tuple | None = None        # (segno, offset) reported, not yet resolved
        self._event = trio.Event()
        self._fd: int | None = None
        self._fd_seg = -1
        self._buf = b""                         # bytes, or a view of _chunk (C reads)
        self._chunk = bytearray()
        self._blocks = RecordBlock is not None      # read() gives RecordBlocks
        self._buf_seg = -1
        self._buf_base = 0
        self._short = False                     # the last _load got less than it asked for
        self.records_read = 0
        self.acks = 0
        self.reports = 0
        self.snapshots = 0

    # -- from the relay -----------------------------------------------------------
    def update(self, snap) -> None:
        old = self._segs
        segs = {e[0]: e for e in snap}
        for segno in old:
            if segno not in segs:
                self._forget(segno)
        self._segs = segs
        self._stuck = None                      # the relay answered: try again
        self.snapshots += 1
        self._advance()
        self._event.set()

    def _advance(self) -> None:
        """Move over segments that are gone, and from a sealed segment's end to the next,
        at once: the relay learns what was skipped now, not at the next read (an output
        that cannot connect reads rarely)."""
        while True:
            entry = self._segs.get(self._pos.segment)
            if entry is None:
                nxt = self._next_segment(self._pos.segment)
            elif entry[3] and self._pos.offset >= entry[2]:
                nxt = self._next_segment(entry[0])
            else:
                return
            if nxt is None:
                return
            self._enter(nxt)

    # -- files ----------------------------------------------------------------------
    def _forget(self, segno: int) -> None:
        if self._fd_seg == segno and self._fd is not None:
            os.close(self._fd)
            self._fd, self._fd_seg = None, -1
        if self._buf_seg == segno:
            self._buf, self._buf_seg = b"", -1

    def _fd_for(self, entry) -> int:
        segno, path = entry[0], entry[1]
        if self._fd_seg != segno:
            if self._fd is not None:
                os.close(self._fd)
                self._fd, self._fd_seg = None, -1
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                # sealed (renamed .open -> .seg) since the snapshot was taken?
                root, ext = os.path.splitext(path)
                if ext != ".open":
                    raise
                fd = os.open(root + ".seg", os.O_RDONLY | os.O_CLOEXEC)
            self._fd, self._fd_seg = fd, segno
        return self._fd

    def _load(self, entry, off: int, need: int) -> None:
        size = read_size(self.CHUNK, need, off, entry[2])
        fd = self._fd_for(entry)
        if _tailread is None or self._blocks:
            # RecordBlocks keep the chunk they were read from, so its records are never
            # copied: a new bytes object per chunk (allocations this size are served from
            # the heap in a worker, outputs/worker.py keep_freed_memory: no page faults)
            self._buf = os.pread(fd, size, off)
        else:
            # The C reads copy every frame out of the chunk: one buffer serves them all.
            # (A new 1 MiB bytes object per chunk cost its page faults, and freeing the
            # last one ~7 % of a Courier worker's CPU.)
            self._buf = b""                     # the old view, before the buffer is reused
            if len(self._chunk) < size:
                self._chunk = bytearray(max(size, self.CHUNK))
            n = os.preadv(fd, [memoryview(self._chunk)[:size]], off)
            self._buf = memoryview(self._chunk)[:n]
        self._buf_seg, self._buf_base = entry[0], off
        self._short = len(self._buf) < size

    def _next_segment(self, after: int):
        best = None
        for segno in self._segs:
            if segno > after and (best is None or segno < best):
                best = segno
        return None if best is None else self._segs[best]

    def _stop_at(self, segno: int, off: int, reason: str, message: str) -> None:
        if self._stuck != (segno, off):
            self._stuck = (segno, off)
            self.reports += 1
            self._report(segno, off, -1 if self._seq is None else self._seq, reason, message)

    def _enter(self, entry) -> None:
        """Go on at the start of the snapshot's segment ``entry``; seqs before its first
        that were not read (a segment deleted under us, or never on disk) are reported."""
        first, seq = entry[4], self._seq
        if seq is None or first > seq:
            if self._skipped is not None:
                self._skipped(seq, first)
            self._seq = first
        self._pos = Position(entry[0], fmt.HEADER_LEN)
        self._skip = False                      # the acked record went with its segment

    # -- reader protocol ------------------------------------------------------------
    def read(self, max_records: int) -> list[Record]:
        """Up to ``max_records`` records: a list, or with the C reads a
        :data:`RecordBlock` (a read-only sequence of the same records, which the C
        mappings of the outputs read without a Python object per record)."""
        if self._stuck is not None:
            return []
        block = RecordBlock(Record, Position) if self._blocks else None
        out = self._read(max_records, block)
        n = len(out)
        if block is not None and n == 0:
            out = []
        self.records_read += n
        return out

    def _read(self, max_records: int, block):
        out = block if block is not None else []
        segs = self._segs
        while len(out) < max_records:
            pos = self._pos
            entry = segs.get(pos.segment)
            if entry is None:
                nxt = self._next_segment(pos.segment)
                if nxt is None:
                    break                               # nothing announced past here yet
                self._enter(nxt)
                continue
            segno, _path, limit, sealed, _first, holes = entry
            off = pos.offset
            resume = None
            next_hole = None
            for h in holes:
                if h[0] == off:
                    resume = h
                    break
                if h[0] > off and (next_hole is None or h[0] < next_hole):
                    next_hole = h[0]
            if resume is not None:
                self._pos = Position(segno, resume[1])
                self._seq = resume[2] if self._seq is None else max(self._seq, resume[2])
                self._skip = False
                continue
            if off >= limit:
                if not sealed:
                    break                               # at the committed end
                nxt = self._next_segment(segno)
                if nxt is None:
                    break
                self._enter(nxt)
                continue
            try:
                if not (self._buf_seg == segno
                        and self._buf_base <= off < self._buf_base + len(self._buf)):
                    self._load(entry, off, 0)
                    if not self._buf:
                        self._stop_at(segno, off, "short_file",
                                      "segment file shorter than expected")
                        break
            except OSError as e:
                self._stop_at(segno, off, "unreadable", f"cannot read segment: {e}")
                break
            buf, base = self._buf, self._buf_base
            stop = min(len(buf), limit - base)
            if next_hole is not None and next_hole - base < stop:
                stop = next_hole - base
            want = max_records - len(out) + (1 if self._skip else 0)
            if block is not None:
                added, bpos, next_seq, status, parsed = _read_into_c(
                    block, buf, off - base, stop, want, base, segno, self._skip)
                recs, start = block, len(block) - added
            else:
                recs, bpos, next_seq, status, parsed = read_block(
                    buf, off - base, stop, want, base, segno, self._skip)
                added, start = len(recs), 0
                out.extend(recs)
            if parsed:
                self._skip = False
                if added:
                    # the end and seq of the block's last record go with its ack: the
                    # relay then needs no disk read to move the cursor past it
                    served = self._served
                    if len(served) >= _SERVED_MAX:
                        del served[next(iter(served))]
                    last = out[-1][0]
                    served[last] = (base + bpos, next_seq - 1)
                    runs = self._runs
                    if len(runs) >= _SERVED_MAX:
                        runs.popleft()
                    runs.append((recs[start][0], last, recs, start, added,
                                 next_seq - added, base + bpos))
                self._pos = Position(segno, base + bpos)
                self._seq = next_seq
                continue
            if status is None:
                continue
            if status == "partial":
                err, need = after_partial(buf, base, off, stop, limit, self._short)
                if err is not None:
                    self._stop_at(segno, off, err.reason, str(err))
                    break
                try:
                    self._load(entry, off, need)
                except OSError as e:
                    self._stop_at(segno, off, "unreadable", f"cannot read segment: {e}")
                    break
                continue
            if status == "seal":
                self._stop_at(segno, off, "unexpected_seal", "seal record inside data")
                break
            self._stop_at(segno, off, status.reason, str(status))
            break
        return out

    async def wait(self) -> None:
        while True:
            if self._stuck is None and self._has_more():
                await trio.lowlevel.checkpoint()
                return
            self._event = trio.Event()
            await self._event.wait()

    def _has_more(self) -> bool:
        entry = self._segs.get(self._pos.segment)
        if entry is None:
            return self._next_segment(self._pos.segment) is not None
        if self._pos.offset < entry[2]:
            return True
        return entry[3] and self._next_segment(entry[0]) is not None

    def ack(self, upto: Position) -> None:
        acked = self._acked
        if acked is not None and upto <= acked:
            return
        if acked is None and upto < self._first:
            return
        self._acked = upto
        self.acks += 1
        served = self._served
        known = served.get(upto)
        if known is None:
            known = self._find(upto)
        while served:                           # forget what is acknowledged (read order)
            k = next(iter(served))
            if k > upto:
                break
            del served[k]
        runs = self._runs
        while runs and runs[0][1] <= upto:
            runs.popleft()
        self._acked_seq = -1 if known is None else known[1]
        self._send_ack(upto, known)

    def _find(self, upto: Position) -> tuple[int, int] | None:
        """``(end, seq)`` of the record at ``upto``, from the parse that read it."""
        for first, last, recs, start, n, seq, end in self._runs:
            if upto > last:
                continue
            if upto < first:
                return None
            i = bisect_left(range(start, start + n), upto, key=lambda j: recs[j][0])
            if recs[start + i][0] != upto:
                return None
            return (recs[start + i + 1][0][1] if i + 1 < n else end), seq + i
        return None

    def rewind(self) -> None:
        """Back to the first unacknowledged record: the last acknowledged one is
        re-parsed and passed over (its end is not kept)."""
        self._buf, self._buf_seg = b"", -1
        self._served.clear()
        self._runs.clear()
        if self._acked is None:
            self._pos, self._seq, self._skip = self._first, self._first_seq, False
        else:
            self._pos, self._skip = self._acked, True
            self._seq = self._acked_seq + 1 if self._acked_seq >= 0 else None
        self._stuck = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd, self._fd_seg = None, -1

    def stats(self) -> dict:
        return {"worker_records_read": self.records_read, "worker_acks": self.acks,
                "worker_damage_reports": self.reports, "worker_snapshots": self.snapshots,
                "worker_segment": self._pos.segment, "worker_offset": self._pos.offset}

