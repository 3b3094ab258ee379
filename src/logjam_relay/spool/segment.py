"""On-disk segment format of the spool (see ``docs/spool-format.md``).

A segment file is a 40-byte header followed by records.  All integers are
little-endian.  Every record carries a CRC32 (``zlib.crc32``) over everything
after its 8-byte prefix, so a torn or corrupt record is detected.  A sealed
segment ends with a *seal record* (kind 255) and is renamed from ``.open`` to
``.seg``; after that it is never written again.

Header (40 bytes)::

    0   8  magic  b"LJSPOOL\\0"
    8   2  format version (1)
    10  2  header length (40)
    12  8  segment number
    20  8  created, ms since the Unix epoch
    28  8  first_seq: spool sequence number of the first record in this segment
    36  4  CRC32 of bytes 0..36

Record::

    0   4  body_len: bytes following this 8-byte prefix
    4   4  CRC32 of those body_len bytes
    8   1  kind (0 logjam, 1 samwise, 255 seal)
    9   1  flags (0)
    10  2  frame count n
    12  8  seq: spool sequence number of this record
    20  4n frame lengths
    ..     frame bytes, concatenated

This module is pure: bytes in, bytes/records out, plus file reading helpers.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from .. import _native

MAGIC = b"LJSPOOL\x00"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHHQQQ")          # without the trailing CRC
HEADER_LEN = HEADER.size + 4                 # 40
PREFIX = struct.Struct("<II")                # body_len, crc32
PREFIX_LEN = PREFIX.size                     # 8
RECHEAD = struct.Struct("<BBHQ")             # kind, flags, nframes, seq
RECHEAD_LEN = RECHEAD.size                   # 12
_FULL4 = struct.Struct("<IIBBHQIIII")        # prefix + head + 4 frame lengths (reader fast path)
_HEAD4 = struct.Struct("<BBHQIIII")          # head + 4 frame lengths (writer fast path)
FULL_HEAD = _FULL_HEAD = struct.Struct("<IIBBHQ")        # prefix + head
MIN_RECORD = PREFIX_LEN + RECHEAD_LEN        # 20: a record with no frames
MAX_BODY = 1 << 30                           # sanity bound on body_len (1 GiB)
MAX_FRAMES = 0xFFFF

KIND_LOGJAM = 0
KIND_SAMWISE = 1
KIND_SEAL = 255
SEAL_PAYLOAD = struct.Struct("<QQQ")         # record_count, data_end, sealed_ms
SEAL_RECORD_LEN = PREFIX_LEN + RECHEAD_LEN + 4 + SEAL_PAYLOAD.size   # 48

OPEN_SUFFIX = ".open"
SEALED_SUFFIX = ".seg"
# ASCII digits only, whole name (no Unicode digits, no trailing newline)
_NAME_RE = re.compile(r"([0-9]{20})(\.open|\.seg)")

crc32 = zlib.crc32


class SegmentError(Exception):
    """Invalid segment data.  ``reason`` is a short machine-readable label."""

    def __init__(self, reason: str, message: str, offset: int = -1):
        super().__init__(message)
        self.reason = reason
        self.offset = offset


class SegmentCorrupt(SegmentError):
    """A complete record (or header) whose CRC or structure is wrong."""


class SegmentTruncated(SegmentError):
    """The data ends inside a record (a torn write)."""


# --------------------------------------------------------------------------- names

def segment_name(segno: int, sealed: bool) -> str:
    return f"{segno:020d}{SEALED_SUFFIX if sealed else OPEN_SUFFIX}"


def parse_segment_name(name: str) -> tuple[int, bool] | None:
    """``(segno, sealed)`` for a segment file name, ``None`` for anything else."""
    m = _NAME_RE.fullmatch(name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2) == SEALED_SUFFIX


# --------------------------------------------------------------------------- header

@dataclass(frozen=True, slots=True)
class SegmentHeader:
    segno: int
    created_ms: int
    first_seq: int
    version: int = FORMAT_VERSION


def encode_header(segno: int, created_ms: int, first_seq: int) -> bytes:
    head = HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_LEN, segno, created_ms, first_seq)
    return head + crc32(head).to_bytes(4, "little")


def decode_header(data: bytes) -> SegmentHeader:
    if len(data) < HEADER_LEN:
        raise SegmentTruncated("short_header", f"segment header truncated ({len(data)} bytes)", 0)
    magic, version, hlen, segno, created_ms, first_seq = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise SegmentCorrupt("bad_magic", f"not a spool segment (magic {magic!r})", 0)
    if int.from_bytes(data[HEADER.size:HEADER_LEN], "little") != crc32(data[:HEADER.size]):
        raise SegmentCorrupt("header_crc", "segment header CRC mismatch", 0)
    if version != FORMAT_VERSION or hlen != HEADER_LEN:
        raise SegmentCorrupt("bad_version",
                             f"unsupported segment format version {version} (header {hlen})", 0)
    return SegmentHeader(segno, created_ms, first_seq, version)


# --------------------------------------------------------------------------- encoding

def encode_logjam_batch_py(batch: Iterable[Sequence[bytes]], first_seq: int) -> bytes:
    """Encode 4-frame logjam messages as consecutive records in one bytes object
    (:func:`encode_logjam_batch` in Python: the reference and the fallback)."""
    out: list[bytes] = []
    ap = out.append
    pack_head = _HEAD4.pack
    pack_prefix = PREFIX.pack
    join = b"".join
    seq = first_seq
    for a, t, b, m in batch:
        body = join((pack_head(KIND_LOGJAM, 0, 4, seq, len(a), len(t), len(b), len(m)), a, t, b, m))
        seq += 1
        ap(pack_prefix(len(body), crc32(body)))
        ap(body)
    return join(out)


_segenc = _native.load("logjam_relay.spool._segenc")
_encode_c = _segenc.encode_logjam_batch if _segenc is not None else None


def _encode_logjam_batch(batch: Iterable[Sequence[bytes]], first_seq: int) -> bytes:
    """:func:`encode_logjam_batch_py` in C (``_segenc.c``, the GIL released while it
    copies and checksums); same bytes.  A batch the C encoder does not take as it is (not
    a list of 4-tuples/lists of bytes, a sequence number out of range...) goes through
    the Python encoder, so its result or its exception is the Python one."""
    data = _encode_c(batch, first_seq)
    return encode_logjam_batch_py(batch, first_seq) if data is None else data


encode_logjam_batch = encode_logjam_batch_py if _encode_c is None else _encode_logjam_batch


def encode_records(records: Iterable[tuple[int, Sequence[bytes]]], first_seq: int) -> bytes:
    """Encode ``(kind, frames)`` pairs (any kind 0..254, any frame count) as one bytes object."""
    out: list[bytes] = []
    ap = out.append
    seq = first_seq
    for kind, frames in records:
        if not 0 <= kind < KIND_SEAL:
            raise ValueError(f"record kind {kind} out of range 0..254")
        n = len(frames)
        if n > MAX_FRAMES:
            raise ValueError(f"too many frames ({n})")
        parts = [RECHEAD.pack(kind, 0, n, seq), struct.pack(f"<{n}I", *map(len, frames)), *frames]
        body = b"".join(parts)
        if len(body) > MAX_BODY:
            raise ValueError(f"record too large ({len(body)} bytes)")
        seq += 1
        ap(PREFIX.pack(len(body), crc32(body)))
        ap(body)
    return b"".join(out)


def encode_seal(seq: int, record_count: int, data_end: int, sealed_ms: int) -> bytes:
    """The seal record written at ``data_end`` (``seq`` = next unused spool sequence)."""
    body = b"".join((RECHEAD.pack(KIND_SEAL, 0, 1, seq), struct.pack("<I", SEAL_PAYLOAD.size),
                     SEAL_PAYLOAD.pack(record_count, data_end, sealed_ms)))
    return PREFIX.pack(len(body), crc32(body)) + body


# --------------------------------------------------------------------------- decoding

_LEN_STRUCTS: dict[int, struct.Struct] = {}


def _lens(n: int) -> struct.Struct:
    s = _LEN_STRUCTS.get(n)
    if s is None:
        s = _LEN_STRUCTS[n] = struct.Struct(f"<{n}I")
    return s


def parse_records_py(buf: bytes, pos: int, end: int, max_records: int, base: int = 0):
    """Parse complete records in ``buf[pos:end]`` (:func:`parse_records` in Python).

    Returns ``(records, pos, status)`` where records are
    ``(file_offset, kind, seq, frames, record_end_file_offset)`` tuples (file
    offsets are ``base + buffer offset``), ``pos`` is where parsing stopped and
    ``status`` is ``None`` (stopped at ``end`` or ``max_records``), ``"partial"``
    (an incomplete record starts at ``pos``; read more), ``"seal"`` (a valid seal
    record starts at ``pos``) or a :class:`SegmentCorrupt` for the record at ``pos``.
    The CRC of every returned record has been verified.
    """
    out: list = []
    ap = out.append
    mv = memoryview(buf)
    unpack4 = _FULL4.unpack_from
    unpack_head = _FULL_HEAD.unpack_from
    status = None
    try:
        while pos < end and len(out) < max_records:
            if end - pos < MIN_RECORD:
                status = "partial"
                break
            if end - pos >= 36:
                body_len, crc, kind, _flags, n, seq, la, lt, lb, lm = unpack4(buf, pos)
            else:
                body_len, crc, kind, _flags, n, seq = unpack_head(buf, pos)
            rend = pos + PREFIX_LEN + body_len
            if body_len < RECHEAD_LEN + 4 * n or body_len > MAX_BODY:
                status = SegmentCorrupt("bad_length", f"bad record length {body_len}", base + pos)
                break
            if rend > end:
                status = "partial"
                break
            if crc32(mv[pos + PREFIX_LEN:rend]) != crc:
                status = SegmentCorrupt("crc", "record CRC mismatch", base + pos)
                break
            if n == 4:                        # rend - pos >= 36 here: la.. are valid
                p = pos + 36
                if p + la + lt + lb + lm != rend:
                    status = SegmentCorrupt("frame_lengths", "frame lengths do not add up",
                                            base + pos)
                    break
                q = p + la
                r = q + lt
                s = r + lb
                frames = [buf[p:q], buf[q:r], buf[r:s], buf[s:rend]]
            else:
                p = pos + PREFIX_LEN + RECHEAD_LEN + 4 * n
                lens = _lens(n).unpack_from(buf, pos + PREFIX_LEN + RECHEAD_LEN)
                if p + sum(lens) != rend:
                    status = SegmentCorrupt("frame_lengths", "frame lengths do not add up",
                                            base + pos)
                    break
                frames = []
                for ln in lens:
                    frames.append(buf[p:p + ln])
                    p += ln
            if kind == KIND_SEAL:
                status = "seal"
                break
            ap((base + pos, kind, seq, frames, base + rend))
            pos = rend
    finally:
        mv.release()
    return out, pos, status


_segscan = _native.load("logjam_relay.spool._segscan")
_parse_records_c = _segscan.parse_records if _segscan is not None else None


def _parse_records(buf: bytes, pos: int, end: int, max_records: int, base: int = 0):
    """:func:`parse_records_py` in C (``_segscan.c``): same records, same statuses."""
    out, pos, status = _parse_records_c(buf, pos, end, max_records, base)
    if type(status) is tuple:
        status = SegmentCorrupt(*status)
    return out, pos, status


parse_records = parse_records_py if _parse_records_c is None else _parse_records


def decode_seal(frames: list[bytes]) -> tuple[int, int, int]:
    """``(record_count, data_end, sealed_ms)`` from a seal record's frames."""
    if len(frames) != 1 or len(frames[0]) != SEAL_PAYLOAD.size:
        raise SegmentCorrupt("bad_seal", "malformed seal record")
    return SEAL_PAYLOAD.unpack(frames[0])


def parse_seal_at(buf: bytes, pos: int) -> tuple[int, int, int]:
    """Decode the (already CRC-checked by :func:`parse_records`) seal record at ``pos``."""
    _, _, kind, _, n, _ = _FULL_HEAD.unpack_from(buf, pos)
    frames = [bytes(buf[pos + 24:pos + SEAL_RECORD_LEN])] if n == 1 else []
    return decode_seal(frames)


# --------------------------------------------------------------------------- files

READ_CHUNK = 8 << 20


def _open(path_or_file) -> tuple[BinaryIO, bool]:
    if hasattr(path_or_file, "read"):
        return path_or_file, False
    return open(path_or_file, "rb", buffering=0), True


def _size_of(f: BinaryIO) -> int:
    try:
        return os.fstat(f.fileno()).st_size
    except (OSError, ValueError, AttributeError):
        return f.seek(0, os.SEEK_END)


def _mtime_ms(f: BinaryIO) -> int:
    try:
        return int(os.fstat(f.fileno()).st_mtime * 1000)
    except (OSError, ValueError, AttributeError):
        return 0


def read_at(f: BinaryIO, offset: int, size: int) -> bytes:
    fileno = getattr(f, "fileno", None)
    if fileno is not None:
        try:
            return os.pread(fileno(), size, offset)
        except (OSError, ValueError):
            pass
    f.seek(offset)
    return f.read(size)


def read_header(path_or_file) -> SegmentHeader:
    f, own = _open(path_or_file)
    try:
        return decode_header(read_at(f, 0, HEADER_LEN))
    finally:
        if own:
            f.close()


def iter_records(path_or_file, start_offset: int = 0, *, allow_torn_tail: bool = False,
                 chunk: int = READ_CHUNK) -> Iterator[tuple[int, int, list[bytes]]]:
    """Yield ``(offset, kind, frames)`` for every data record of a segment file.

    ``start_offset`` 0 means the first record; otherwise it must be a record
    offset.  Stops at the seal record.  A CRC/structure error raises
    :class:`SegmentCorrupt`; data ending inside a record raises
    :class:`SegmentTruncated` unless ``allow_torn_tail`` (for reading an open
    segment a writer may be appending to).  Nothing is ever skipped silently.
    Memory use is bounded by ``chunk`` (or one record, if larger).
    """
    f, own = _open(path_or_file)
    try:
        decode_header(read_at(f, 0, HEADER_LEN))
        pos = max(start_offset, HEADER_LEN)
        while True:
            buf = read_at(f, pos, chunk)
            if not buf:
                return
            recs, used, status = parse_records(buf, 0, len(buf), 1 << 62, pos)
            for off, kind, _seq, frames, _end in recs:
                yield off, kind, frames
            if status == "seal":
                return
            if isinstance(status, SegmentError):
                raise status
            if status == "partial":
                if len(buf) < chunk:          # EOF inside a record
                    if allow_torn_tail:
                        return
                    raise SegmentTruncated("torn", f"segment ends inside a record at offset "
                                                   f"{pos + used}", pos + used)
                if used == 0:                 # one record larger than the chunk
                    body_len = PREFIX.unpack_from(buf, 0)[0]
                    chunk = PREFIX_LEN + body_len
            pos += used
    finally:
        if own:
            f.close()


@dataclass(slots=True)
class ScanResult:
    """What :func:`scan_segment` found.  ``valid_end`` is where the valid data ends
    (start of the seal record for a sealed segment)."""

    header: SegmentHeader | None
    file_size: int
    valid_end: int
    records: int
    next_seq: int                      # seq after the last valid record
    sealed: bool
    cut_bytes: int                     # bytes after valid_end that are not valid data/seal
    error: str | None                  # reason the scan stopped early, if any
    error_offset: int = -1
    last_logjam_meta: bytes | None = None


def scan_segment(path_or_file, *, chunk: int = READ_CHUNK) -> ScanResult:
    """Validate a whole segment and find the end of its valid data.  Never raises
    on bad data (only ``OSError``): a torn tail or CRC mismatch stops the scan and
    is reported as ``cut_bytes`` / ``error``."""
    f, own = _open(path_or_file)
    try:
        return _scan(f, chunk)
    finally:
        if own:
            f.close()


def _scan(f: BinaryIO, chunk: int) -> ScanResult:
    size = _size_of(f)
    try:
        header = decode_header(read_at(f, 0, HEADER_LEN))
    except SegmentError as e:
        return ScanResult(None, size, 0, 0, 0, False, size, e.reason, 0)
    pos = HEADER_LEN
    records = 0
    seq = header.first_seq
    last_meta = None
    while True:
        buf = read_at(f, pos, chunk)
        recs, used, status = parse_records(buf, 0, len(buf), 1 << 62, pos)
        if recs:
            records += len(recs)
            seq = recs[-1][2] + 1
            for r in reversed(recs):
                if r[1] == KIND_LOGJAM and len(r[3]) == 4:
                    last_meta = r[3][3]
                    break
        if status == "seal":
            try:
                count, data_end, _ = parse_seal_at(buf, used)
            except SegmentError as e:
                status = e
            else:
                end = pos + used
                if count == records and data_end == end and end + SEAL_RECORD_LEN == size:
                    return ScanResult(header, size, end, records, seq, True, 0, None, -1,
                                      last_meta)
                status = SegmentCorrupt("bad_seal", "seal record does not match data", end)
        if isinstance(status, SegmentError):
            end = pos + used
            return ScanResult(header, size, end, records, seq, False, size - end,
                              status.reason, end, last_meta)
        if status == "partial" and len(buf) >= chunk and used == 0:
            chunk = PREFIX_LEN + PREFIX.unpack_from(buf, 0)[0]
            continue
        pos += used
        if len(buf) < chunk:               # this read reached the end of the file
            reason = "torn" if pos < size else None
            return ScanResult(header, size, pos, records, seq, False, size - pos, reason,
                              pos if reason else -1, last_meta)


def read_seal(path_or_file) -> tuple[int, int, int] | None:
    """Cheap check whether a segment is sealed: validates only the seal record at
    the end of the file.  ``(record_count, data_end, sealed_ms)`` or ``None``."""
    f, own = _open(path_or_file)
    try:
        size = _size_of(f)
        if size < HEADER_LEN + SEAL_RECORD_LEN:
            return None
        start = size - SEAL_RECORD_LEN
        buf = read_at(f, start, SEAL_RECORD_LEN)
        _, _, status = parse_records(buf, 0, len(buf), 1, start)
        if status != "seal":
            return None
        try:
            count, data_end, sealed_ms = parse_seal_at(buf, 0)
        except SegmentError:
            return None
        if data_end != start:
            return None
        return count, data_end, sealed_ms
    finally:
        if own:
            f.close()


def sealed_segments(directory) -> list[tuple[int, str]]:
    """``(segno, path)`` of every sealed segment file in ``directory``, ascending."""
    out = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        parsed = parse_segment_name(name)
        if parsed is not None and parsed[1]:
            out.append((parsed[0], os.path.join(directory, name)))
    out.sort()
    return out


def salvage_segment(path_or_file, segno: int, *, chunk: int = READ_CHUNK) -> ScanResult:
    """:func:`scan_segment` for a file whose header is damaged: the records are parsed
    from offset 40 all the same (each carries its CRC and seq), and a header is made up
    from the first record (``created`` from the file's mtime).  ``header`` stays None if
    not a single valid record follows."""
    f, own = _open(path_or_file)
    try:
        res = _scan(f, chunk)
        if res.header is not None:
            return res
        return _salvage(f, segno, chunk, res)
    finally:
        if own:
            f.close()


def _salvage(f: BinaryIO, segno: int, chunk: int, res: ScanResult) -> ScanResult:
    size = _size_of(f)
    mtime_ms = _mtime_ms(f)
    pos = HEADER_LEN
    records = 0
    first_seq = seq = None
    last_meta = None
    status = None
    while True:
        buf = read_at(f, pos, chunk)
        recs, used, status = parse_records(buf, 0, len(buf), 1 << 62, pos)
        if recs:
            if first_seq is None:
                first_seq = recs[0][2]
            for r in recs:
                if r[2] != first_seq + records:      # seqs must be consecutive
                    status = SegmentCorrupt("seq", "record seq out of order", r[0])
                    break
                records += 1
                if r[1] == KIND_LOGJAM and len(r[3]) == 4:
                    last_meta = r[3][3]
            seq = first_seq + records
            if isinstance(status, SegmentError) and status.reason == "seq":
                end = status.offset
                break
        if status == "seal":
            end = pos + used
            try:
                count, data_end, _ = parse_seal_at(buf, used)
            except SegmentError:
                break
            if count == records and data_end == end and end + SEAL_RECORD_LEN == size \
                    and first_seq is not None:
                return ScanResult(SegmentHeader(segno, mtime_ms, first_seq), size, end,
                                  records, seq, True, 0, "header", 0, last_meta)
            break
        if isinstance(status, SegmentError):
            end = pos + used
            break
        if status == "partial" and len(buf) >= chunk and used == 0:
            chunk = PREFIX_LEN + PREFIX.unpack_from(buf, 0)[0]
            continue
        pos += used
        end = pos
        if len(buf) < chunk:
            break
    if first_seq is None:
        return res
    return ScanResult(SegmentHeader(segno, mtime_ms, first_seq), size, end, records, seq,
                      False, size - end, "header", 0, last_meta)


def resync(buf: bytes, base: int, start: int, expect_seq: int, end_seq: int,
           tries: int = 64) -> tuple[int, int] | None:
    """Find the first intact record after a damaged one.

    ``buf`` holds file bytes from offset ``base``; the damaged record (seq
    ``expect_seq``) starts at file offset ``start``.  Looks for the record of seq
    ``expect_seq + 1`` (then +2, ... up to ``tries``) by its seq field and accepts it
    only if its CRC and frame lengths check out.  Returns ``(offset, seq)`` or None.
    """
    lo = start - base + 1
    for s in range(expect_seq + 1, min(end_seq, expect_seq + 1 + tries)):
        needle = s.to_bytes(8, "little")
        i = buf.find(needle, lo + 12)
        while i >= 0:
            cand = i - 12
            recs, _, status = parse_records(buf, cand, len(buf), 1, base)
            if recs and recs[0][2] == s:
                return base + cand, s
            i = buf.find(needle, i + 1)
    return None
