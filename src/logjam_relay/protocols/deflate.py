"""``zlib.compress`` byte for byte, with a faster Adler-32 (shared by the Courier and
Lumberjack writers).

zlib's own scalar Adler-32 was 5-8 % of an output worker's CPU (perf, bench_durable.py);
``outputs/_courierenc.c`` ``adler32`` uses SSSE3 when the CPU has it.  The stream is raw
deflate with zlib's defaults between zlib's header (RFC 1950) and that checksum, which is
exactly what ``zlib.compress(data, level)`` (and ``compressobj(level)`` + ``flush()``)
writes for levels -1 and 1..9 (tests/test_courier_batch.py compares them).
"""

from __future__ import annotations

import zlib

from .. import _native

_adler32 = getattr(_native.load("logjam_relay.outputs._courierenc"), "adler32", None)
# the zlib header zlib writes: CMF 0x78 (deflate, 32 KiB window), FLEVEL by level (level 0
# is left to zlib: its stored blocks are cut by where its header ends)
_ZLIB_HEAD = {lvl: b"\x78" + bytes((0x01 if lvl < 2 else 0x5E if lvl < 6 else
                                    0x9C if lvl == 6 else 0xDA,)) for lvl in range(1, 10)}
_ZLIB_HEAD[-1] = _ZLIB_HEAD[6]


def zlib_compress(data: bytes, level: int) -> bytes:
    """``zlib.compress(data, level)``, byte for byte."""
    if _adler32 is None or level not in _ZLIB_HEAD:
        return zlib.compress(data, level)
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    body = c.compress(data)
    return b"".join((_ZLIB_HEAD[level], body, c.flush(), _adler32(data).to_bytes(4, "big")))
