"""zlib streams for the tests of the fast zlib path (``_fastinflate.h``:
test_pipeline_bodies.py for the Python decoder, test_pipeline_jvm.py for the JVM reader):
intact, and damaged in the ways that matter to its guard."""

from __future__ import annotations

import random


def damaged_stream(rng: random.Random, stream: bytes, op: int) -> bytes:
    """``stream`` after ``op``: 1 a bit flipped after the block header (the guard admits
    it, libdeflate refuses, zlib decides), 2 cut short, 3 extended by 1-5 bytes (ignored,
    as by zlib), 4 the Adler-32 wrong; any other op: intact."""
    b = bytearray(stream)
    if op == 1:
        b[rng.randrange(40, len(b))] ^= 1 << rng.randrange(8)
    elif op == 2:
        del b[rng.randrange(20, len(b)):]
    elif op == 3:
        b += rng.randbytes(rng.randint(1, 5))
    elif op == 4:
        b[-1] ^= 0x40
    return bytes(b)
