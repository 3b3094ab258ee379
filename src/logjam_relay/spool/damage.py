"""Damage found while reading, and the gaps readers count as lost (mixed into :class:`Spool`).

See docs/spool-format.md, "Damage found while reading" and "Loss accounting".
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from . import segment as fmt
from .errors import SpoolWriteError

if TYPE_CHECKING:
    from .reader import SpoolReader
    from .spool import _Seg

MiB = 1 << 20


class DamageMixin:
    # -- loss accounting --------------------------------------------------------
    def _add_gap(self, lo: int, hi: int, reason: str) -> None:
        if hi > lo:
            self._gaps.append([lo, hi, reason])

    def _lost_reasons(self, lo: int, hi: int, remainder: bool = True) -> list[tuple[str, int]]:
        """Split records ``lo..hi-1`` (passed over by a cursor) by the gap they are in;
        records in no registered gap are ``missing`` (if ``remainder``)."""
        if hi <= lo:
            return []
        parts = sorted((max(lo, g[0]), min(hi, g[1]), g[2]) for g in self._gaps
                       if max(lo, g[0]) < min(hi, g[1]))
        out: dict[str, int] = {}
        cur = lo
        covered = 0
        for a, b, reason in parts:
            a = max(a, cur)
            if a < b:
                out[reason] = out.get(reason, 0) + b - a
                covered += b - a
                cur = b
        if remainder and hi - lo > covered:
            out["missing"] = out.get("missing", 0) + hi - lo - covered
        return list(out.items())

    def _next_existing(self, segno: int) -> _Seg | None:
        for seg in self._segs.values():
            if seg.segno > segno:
                return seg
        return None

    def _first_seq(self) -> int:
        first = next(iter(self._segs.values()), None)
        return first.first_seq if first is not None else self._next_seq

    def _on_corrupt(self, reader: SpoolReader, seg: _Seg, err: fmt.SegmentError) -> None:
        """A reader found a damaged record: find the next intact record of the segment
        (by its seq and CRC) and skip only the damaged stretch; if there is none, the
        rest of the segment is unreadable.  Either way the stretch is registered as a
        gap, so every reader counts exactly those records as lost."""
        off = err.offset if err.offset >= 0 else reader._read_pos.offset
        off = max(off, reader._read_pos.offset)
        expect = reader._read_seq
        self.corrupt_records += 1
        reader.corrupt_skips += 1
        reader._buf, reader._buf_seg = b"", -1
        if not seg.sealed:
            try:
                self._seal_active()
            except SpoolWriteError:
                pass
        found = None
        if err.reason != "unreadable":
            try:
                size = min(seg.limit - off, 8 * MiB)
                buf = os.pread(reader._fd_for(seg), size, off)
                found = fmt.resync(buf, off, off, expect, seg.end_seq)
            except OSError:
                found = None
        if found is not None and found[0] > off:
            seg.holes[off] = found
            self._add_gap(expect, found[1], "corrupt")
            self._rlog.error("corrupt_record", "spool: %s in segment %d (%s) at offset %d (%s): "
                             "records %d..%d lost, reading goes on at offset %d", err,
                             seg.segno, seg.path, off, err.reason, expect, found[1] - 1,
                             found[0])
        else:
            if seg.bad_offset is None or off < seg.bad_offset:
                seg.bad_offset = off
            self._add_gap(expect, seg.end_seq, "corrupt")
            self._rlog.error("corrupt_record", "spool: %s in segment %d (%s) at offset %d (%s): "
                             "the rest of the segment (records %d..%d) is lost", err,
                             seg.segno, seg.path, off, err.reason, expect, seg.end_seq - 1)
        reader._normalize_ack()
        reader._normalize_read()

