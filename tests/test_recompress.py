"""Batch recompression in C (relay/_recompress.c) gives exactly protocols.logjam.compress's
bytes, and the pipeline's compress_in_place gives the same records either way."""

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
    for method in (L.ZLIB_COMPRESSION, L.LZ4_COMPRESSION):
        assert P._recompress.compress_batch(bodies, method) == [L.compress(b, method)
                                                                for b in bodies]


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
