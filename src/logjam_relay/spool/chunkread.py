"""A reader's chunks of a segment file: how much to read, and what a record the chunk holds
only in part means.  The one copy for both readers that read segment files in chunks: the
relay's :class:`reader.SpoolReader` and an output worker's :class:`tail.SegmentTail`.

A reader reads a segment from a record's offset ``off`` in chunks of ``chunk`` bytes, never
past the segment's committed end ``limit`` (what the writer says is whole on disk), and
parses them (``segment.parse_records`` or the C twins).  The parse ends at a record that
does not fit the chunk with the status ``"partial"``; then :func:`after_partial` decides:

* the chunk was read from ``off`` and holds all the committed end allows of that record:
  the record crosses the committed end, ``torn``;
* the chunk was read from ``off`` and the file gave fewer bytes than were asked for: the
  file is shorter than its committed end (cut while the reader runs), ``short_file``;
* otherwise read again from ``off``, at least ``need`` bytes: the whole record, or its
  8-byte prefix when the chunk does not even hold that.

Both errors are :class:`segment.SegmentTruncated`; the reader hands them to the damage
handling (the relay's) or reports them to the relay (a worker's).
"""

from __future__ import annotations

from .segment import PREFIX, PREFIX_LEN, SegmentTruncated


def read_size(chunk: int, need: int, off: int, limit: int) -> int:
    """Bytes to read from ``off``: a chunk, or ``need`` where more, never past ``limit``."""
    return min(max(chunk, need), limit - off)


def after_partial(buf, base: int, off: int, stop: int, limit: int,
                  short: bool) -> tuple[SegmentTruncated | None, int]:
    """The parse of ``buf`` (the file's bytes from offset ``base``; parsed up to the
    buffer offset ``stop``) ended at a partial record at file offset ``off`` of a segment
    committed up to ``limit``; ``short``: the read that filled ``buf`` gave fewer bytes
    than :func:`read_size` asked for.  Returns ``(error, need)``: the error that ends the
    read at ``off`` (``torn``, ``short_file``), or None: read ``need`` bytes from ``off``
    and parse again."""
    at = off - base
    need = PREFIX_LEN + (PREFIX.unpack_from(buf, at)[0] if stop - at >= PREFIX_LEN else 0)
    if base == off:
        if len(buf) >= min(need, limit - off):
            return SegmentTruncated("torn", "record crosses the committed end", off), need
        if short:
            return SegmentTruncated("short_file", "segment file shorter than expected",
                                    off), need
    return None, need
