"""The spool's shared positions (:class:`Ledger`): which segments are on disk, the next
segment number and sequence, the bytes they take, the last logjam meta.

The writer moves the positions forward (append, seal); the space budget and the
acknowledgements take segments out (delete, drop); the readers and the space budget read
them.  Nothing here does I/O: :meth:`Ledger.state` is what ``spool.state`` holds, written
by the writer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio


@dataclass(slots=True)
class Seg:
    segno: int
    path: str
    created_ms: int
    first_seq: int
    count: int          # data records
    data_end: int       # end of the data records (committed size of the active segment)
    size: int           # bytes on disk
    sealed: bool
    # closed by a roll, its seal still running off the loop (writer.SealJob): no record is
    # appended any more, readers may go on with the next segment; not deletable until sealed
    closed: bool = False
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


class Ledger:
    """The positions every part of the spool shares.  ``segs`` is in ascending segment
    number (insertion order); ``bytes`` is what they take on disk.

    The other parts read the slots; they change only through the methods below (as
    Vector's disk_v2 ledger), so that ``bytes`` always sums the segments' sizes and
    ``next_segno``/``next_seq`` only move forward."""

    __slots__ = ("segs", "next_segno", "next_seq", "bytes", "last_meta", "appended")

    def __init__(self, segs: dict[int, Seg] | None = None, next_segno: int = 0,
                 next_seq: int = 0, last_meta: bytes | None = None) -> None:
        self.segs: dict[int, Seg] = dict(segs or {})
        self.next_segno = next_segno
        self.next_seq = next_seq
        self.bytes = sum(s.size for s in self.segs.values())
        self.last_meta = last_meta
        # set (and replaced) on every append: readers wait on it
        self.appended = trio.Event()

    def add(self, seg: Seg) -> None:
        self.segs[seg.segno] = seg
        self.bytes += seg.size

    def remove(self, seg: Seg) -> None:
        del self.segs[seg.segno]
        self.bytes -= seg.size

    def open_segment(self, seg: Seg) -> None:
        """``seg`` is the new active segment: added, and its number taken."""
        self.add(seg)
        self.next_segno = seg.segno + 1

    def count_appended(self, n: int, nbytes: int) -> None:
        """``n`` records of ``nbytes`` were appended to the active segment (its ``count``
        and ``data_end`` moved by the writer): the next seq and the bytes follow."""
        self.next_seq += n
        self.bytes += nbytes

    def count_bytes(self, nbytes: int) -> None:
        """A segment on disk grew by ``nbytes`` that are not records (its seal record)."""
        self.bytes += nbytes

    def note_meta(self, meta: bytes) -> None:
        """The logjam meta of the last logjam record appended."""
        self.last_meta = meta

    def oldest(self) -> Seg | None:
        return next(iter(self.segs.values()), None)

    def first_seq(self) -> int:
        """Seq of the oldest record on disk (the next seq if there is none)."""
        first = self.oldest()
        return first.first_seq if first is not None else self.next_seq

    def next_existing(self, segno: int) -> Seg | None:
        for seg in self.segs.values():
            if seg.segno > segno:
                return seg
        return None

    def announce_append(self) -> None:
        ev = self.appended
        self.appended = trio.Event()
        ev.set()

    def state(self) -> dict:
        """What ``spool.state`` records (the numbering survives a spool without segments)."""
        return {"next_segno": self.next_segno, "next_seq": self.next_seq,
                "last_logjam_meta": (self.last_meta.hex()
                                     if self.last_meta is not None else None)}
