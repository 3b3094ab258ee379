"""Batch recompression in C (relay/_recompress.c): zlib gives exactly
protocols.logjam.compress's bytes; LZ4 gives LZ4_compress_default's blocks, which
python-lz4's compress() (LZ4's streaming call) matches only for bodies that do not compress
or are over 64 KiB -- both decompress to the body (docs/architecture.md; the ingest pass's
equality with this compressor is tests/test_ingestpass.py's)."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import require_native
from logjam_relay.protocols import logjam as L
from logjam_relay.relay import stamping as P


@pytest.fixture
def rc():
    return require_native(P._recompress, "logjam_relay.relay._recompress")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=2000), max_size=20))
def test_same_bytes_as_logjam_compress(bodies):
    if P._recompress is None:
        pytest.skip("not built")
    assert P._recompress.compress_batch(bodies, L.ZLIB_COMPRESSION) == \
        [L.compress(b, L.ZLIB_COMPRESSION) for b in bodies]
    outs = P._recompress.compress_batch(bodies, L.LZ4_COMPRESSION)
    assert [L.decompress(o, L.LZ4_COMPRESSION) for o in outs] == bodies


def test_lz4_blocks_are_lz4_compress_defaults(rc):
    """Text under 64 KiB, where python-lz4's streaming call picks other matches: the C
    compressor's blocks are LZ4_compress_default's (called here through ctypes from the
    same library) and decompress to the bodies."""
    import ctypes
    import random

    import lz4.block._block as ext
    lib = ctypes.CDLL(ext.__file__)
    rnd = random.Random(5)
    words = [rnd.randbytes(rnd.randint(2, 9)).hex().encode() for _ in range(200)]
    bodies = [b" ".join(rnd.choice(words) for _ in range(n)) for n in (3, 50, 400, 3000)]

    def default(b: bytes) -> bytes:
        cap = lib.LZ4_compressBound(len(b))
        dst = ctypes.create_string_buffer(cap)
        n = lib.LZ4_compress_default(b, dst, len(b), cap)
        return len(b).to_bytes(4, "big") + dst.raw[:n]

    outs = rc.compress_batch(bodies, L.LZ4_COMPRESSION)
    assert outs == [default(b) for b in bodies]
    assert [L.decompress(o, L.LZ4_COMPRESSION) for o in outs] == bodies


def test_large_and_odd_bodies_round_trip(rc):
    bodies = [b"", os.urandom(3 << 20), b"{}" * 100_000, memoryview(b"abc" * 10), bytearray(b"q")]
    for method in (L.ZLIB_COMPRESSION, L.LZ4_COMPRESSION):
        outs = rc.compress_batch(bodies, method)
        assert [L.decompress(o, method) for o in outs] == [bytes(b) for b in bodies]
    with pytest.raises(ValueError):
        rc.compress_batch([b"x"], L.SNAPPY_COMPRESSION)
    with pytest.raises(TypeError):
        rc.compress_batch([5], L.LZ4_COMPRESSION)


@pytest.mark.parametrize("method", [L.ZLIB_COMPRESSION, L.SNAPPY_COMPRESSION, L.LZ4_COMPRESSION])
def test_compress_in_place_same_records_with_and_without_c(rc, monkeypatch, method):
    p = P.Pipeline(1, 1, lambda recs: None, fqdn=b"h", compress_method=method)
    acc = [(b"a-b", b"logs", os.urandom(50) + b"x" * i, 0, b"\0" * 8) for i in range(300)]
    idx = list(range(0, 300, 2))
    fast = list(acc)
    p.compress_in_place(fast, idx, 10, 120)
    monkeypatch.setattr(P, "_recompress", None)
    slow = list(acc)
    p.compress_in_place(slow, idx, 10, 120)
    assert fast == slow
    assert fast[idx[10]][3] == method and fast[idx[9]] == acc[idx[9]]
