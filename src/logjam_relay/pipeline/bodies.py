"""Record bodies: decompression within :data:`MAX_DECOMPRESSED` and the body string column.

:func:`decompress_body` is the definition (zlib / snappy raw / lz4 block through the
Python libraries; raises on anything undecodable); :func:`string_array` builds a batch's
UTF-8 body column from bytes objects (invalid UTF-8 -> null, error ``utf8``).
:func:`batch_bodies` does both for one batch of the C segment walk's rows in C
(``pipeline/_bodies.c``: no Python loop per row, straight into the Arrow buffers); rows the
C decoders leave undecided go through :func:`decompress_body`.
``tests/test_pipeline_bodies.py`` compares the two on ordinary and malformed bodies.
"""

from __future__ import annotations

import struct
import zlib

import lz4.block
import numpy as np
import pyarrow as pa
import snappy

from .. import _native
from ..protocols.logjam import MAX_DECOMPRESSED

_bodies_c = _native.load("logjam_relay.pipeline._bodies")
#: :func:`batch_bodies` can run (the C twin ``_bodies.c`` is built)
BATCH_BODIES_IN_C = _bodies_c is not None
try:
    import cramjam  # what python-snappy calls; skips a Python wrapper
    _snappy_raw = cramjam.snappy.decompress_raw
except (ImportError, AttributeError):  # pragma: no cover
    _snappy_raw = snappy.uncompress

_LEN_BE = struct.Struct(">I")
_SMALL_ZLIB = MAX_DECOMPRESSED // 1100          # zlib expands at most ~1032x
_SMALL_SNAPPY = MAX_DECOMPRESSED // 64
#: _bodies.c status codes -> the error names of the rows
_STATUS = {1: "meta", 2: "frames", 3: "decompress", 4: "utf8"}
_UNDECIDED = 5


def decompress_body(buf: bytes, mv: memoryview, r: int, s: int, comp: int) -> bytes:
    """The body ``buf[r:s]`` compressed with ``comp`` (1 zlib, 2 snappy, 3 lz4), inflated
    within :data:`MAX_DECOMPRESSED`; raises on anything undecodable."""
    lb = s - r
    if comp == 1:
        return zlib.decompress(mv[r:s]) if lb < _SMALL_ZLIB else _zlib_bounded(mv[r:s])
    if comp == 2:
        if lb > _SMALL_SNAPPY:
            _snappy_check(buf[r:r + 5])
        return _snappy_raw(mv[r:s])
    if comp == 3:
        (m,) = _LEN_BE.unpack_from(buf, r)
        if m > MAX_DECOMPRESSED:
            raise ValueError("lz4 length too large")
        b = lz4.block.decompress(mv[r + 4:s], uncompressed_size=m)
        if len(b) != m:
            raise ValueError("lz4 length mismatch")
        return b
    raise ValueError(f"unknown compression {comp}")


def _snappy_check(b: bytes) -> None:
    n = shift = 0
    for i in range(min(len(b), 5)):         # the varint length prefix of a raw block
        c = b[i]
        n |= (c & 0x7F) << shift
        if not c & 0x80:
            break
        shift += 7
    if n > MAX_DECOMPRESSED:
        raise ValueError("snappy length too large")


def _zlib_bounded(b: bytes) -> bytes:
    d = zlib.decompressobj()
    out = d.decompress(b, MAX_DECOMPRESSED)
    if d.unconsumed_tail or not d.eof:
        raise ValueError("zlib body truncated or too large")
    return out


def string_array(bodies: list[bytes | None], errors: dict[int, str]) -> pa.Array:
    """A UTF-8 string array from bytes objects via one joined buffer; invalid UTF-8
    becomes null with ``errors[i] = "utf8"``."""
    n = len(bodies)
    if errors:
        valid = np.ones(n, dtype=bool)
        for i in errors:
            if bodies[i] is None:
                valid[i] = False
        filled = [b if b is not None else b"" for b in bodies]
    else:
        valid = None
        filled = bodies
    lens = np.fromiter(map(len, filled), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    data = b"".join(filled)
    if offsets[-1] < (1 << 31) - 1:
        offs_buf = pa.py_buffer(offsets.astype(np.int32))
    else:  # > 2 GiB of text in one batch: cannot happen with batch_rows * 64 MiB bound
        raise ValueError("batch too large for a string column")
    validity = None if valid is None else pa.array(valid).buffers()[1]
    arr = pa.Array.from_buffers(pa.string(), n, [validity, offs_buf, pa.py_buffer(data)],
                                null_count=-1 if valid is not None else 0)
    try:
        arr.validate(full=True)
        return arr
    except pa.ArrowInvalid:
        pass
    out: list[str | None] = []
    for i, b in enumerate(bodies):
        if b is None:
            out.append(None)
            continue
        try:
            out.append(bytes(b).decode("utf-8"))
        except UnicodeDecodeError:
            out.append(None)
            errors[i] = "utf8"
    return pa.array(out, pa.string())


def batch_bodies(buf: bytes, rows_b: bytes, first: int, n: int,
                 errors: dict[int, str]) -> pa.Array:
    """The body column of rows ``first .. first+n-1`` of ``spool._segscan.scan``'s rows
    (``rows_b``) over the segment file ``buf``, decompressed and UTF-8 checked in C;
    ``errors`` gets the reason of every row without a body (meta, frames, decompress,
    utf8), as the Python loop gives them."""
    offs_b, data_b, status_b = _bodies_c.bodies(buf, rows_b, first, n, MAX_DECOMPRESSED)
    status = np.frombuffer(status_b, dtype=np.uint8)
    bad = np.flatnonzero(status)
    if not len(bad):
        return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offs_b),
                                                      pa.py_buffer(data_b)], null_count=0)
    undecided = []
    for i, st in zip(bad.tolist(), status[bad].tolist(), strict=True):
        if st == _UNDECIDED:
            undecided.append(i)
        else:
            errors[i] = _STATUS[st]
    if undecided:
        return _with_python_rows(buf, rows_b, first, offs_b, data_b, status, undecided,
                                 errors)
    validity = pa.py_buffer(np.packbits(status == 0, bitorder="little"))
    return pa.Array.from_buffers(pa.string(), n, [validity, pa.py_buffer(offs_b),
                                                  pa.py_buffer(data_b)], null_count=len(bad))


def _with_python_rows(buf, rows_b, first, offs_b, data_b, status, undecided,
                      errors) -> pa.Array:
    """Rare: blocks the C decoders leave to the libraries (see ``_bodies.c``)."""
    offs = np.frombuffer(offs_b, dtype=np.int32)
    rows = np.frombuffer(rows_b, dtype=np.int64).reshape(-1, 5)
    bodies: list = [data_b[offs[i]:offs[i + 1]] if st == 0 else None
                    for i, st in enumerate(status.tolist())]
    mv = memoryview(buf)
    try:
        for i in undecided:
            _pair, comp, _m, r, lb = rows[first + i].tolist()
            try:
                bodies[i] = decompress_body(buf, mv, r, r + lb, comp)
            except Exception:
                errors[i] = "decompress"
    finally:
        mv.release()
    return string_array(bodies, errors)
