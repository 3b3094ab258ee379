"""Damage found while reading, and the gaps readers count as lost (:class:`Damage`).

A *gap* is a stretch of seqs known to be gone, with the reason: ``dropped`` or
``disk_full`` (the space budget dropped the segment), ``corrupt``, ``truncated`` or
``missing`` (found by the recovery or while reading).  A reader whose acknowledged cursor
passes over records asks :meth:`Damage.lost_reasons` how many of them were lost and why.
See docs/spool-format.md, "Damage found while reading" and "Loss accounting".
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence

from . import segment as fmt
from .ledger import Ledger, Seg

log = logging.getLogger("logjam_relay.spool")

MiB = 1 << 20


class Damage:
    """The gaps (``[lo, hi, reason]`` seq ranges known to be gone) and the damaged
    records found while reading."""

    def __init__(self, ledger: Ledger, gaps: Iterable[tuple[int, int, str]], rlog) -> None:
        self._ledger = ledger
        self._rlog = rlog
        self.gaps: list[list] = []
        for lo, hi, reason in gaps:
            self.add_gap(lo, hi, reason)
        self.corrupt_records = 0

    # -- loss accounting --------------------------------------------------------
    def add_gap(self, lo: int, hi: int, reason: str, not_events: Sequence[int] = ()) -> None:
        """Seqs ``lo..hi-1`` are gone for ``reason``; ``not_events``: the sorted seqs among
        them that were no events (the relay's heartbeat records): a reader that passes over
        the gap counts the others as lost, not these."""
        if hi > lo:
            self.gaps.append([lo, hi, reason, tuple(not_events)])

    def lost_reasons(self, lo: int, hi: int, remainder: bool = True) -> list[tuple[str, int]]:
        """Split records ``lo..hi-1`` (passed over by a cursor) by the gap they are in;
        records in no registered gap are ``missing`` (if ``remainder``).  The records a
        gap names as no events are in no count."""
        if hi <= lo:
            return []
        parts = sorted((max(lo, g[0]), min(hi, g[1]), g[2], g[3]) for g in self.gaps
                       if max(lo, g[0]) < min(hi, g[1]))
        out: dict[str, int] = {}
        cur = lo
        covered = 0
        for a, b, reason, skip in parts:
            a = max(a, cur)
            if a < b:
                n = b - a - (bisect_left(skip, b) - bisect_left(skip, a) if skip else 0)
                if n:
                    out[reason] = out.get(reason, 0) + n
                covered += b - a
                cur = b
        if remainder and hi - lo > covered:
            out["missing"] = out.get("missing", 0) + hi - lo - covered
        return list(out.items())

    def prune(self, low: int) -> None:
        """Forget the gaps that end at or below seq ``low`` (every reader is past them)."""
        if self.gaps:
            self.gaps = [g for g in self.gaps if g[1] > low]

    # -- damage found while reading ---------------------------------------------
    def found(self, seg: Seg, off: int, expect: int, err: fmt.SegmentError,
              pread: Callable[[int, int], bytes]) -> None:
        """A reader found a damaged record at ``off`` of ``seg``, where it expected seq
        ``expect``: find the next intact record of the segment (by its seq and CRC,
        reading with ``pread(size, offset)``) and skip only the damaged stretch (a
        *hole*); if there is none, the rest of the segment is unreadable
        (``bad_offset``).  Either way the stretch is registered as a gap, so every
        reader counts exactly those records as lost."""
        self.corrupt_records += 1
        found = None
        if err.reason != "unreadable":
            try:
                size = min(seg.limit - off, 8 * MiB)
                buf = pread(size, off)
                found = fmt.resync(buf, off, off, expect, seg.end_seq)
            except OSError:
                found = None
        if found is not None and found[0] > off:
            seg.holes[off] = found
            self.add_gap(expect, found[1], "corrupt")
            self._rlog.error("corrupt_record", "spool: %s in segment %d (%s) at offset %d (%s): "
                             "records %d..%d lost, reading goes on at offset %d", err,
                             seg.segno, seg.path, off, err.reason, expect, found[1] - 1,
                             found[0])
        else:
            if seg.bad_offset is None or off < seg.bad_offset:
                seg.bad_offset = off
            self.add_gap(expect, seg.end_seq, "corrupt")
            self._rlog.error("corrupt_record", "spool: %s in segment %d (%s) at offset %d (%s): "
                             "the rest of the segment (records %d..%d) is lost", err,
                             seg.segno, seg.path, off, err.reason, expect, seg.end_seq - 1)
