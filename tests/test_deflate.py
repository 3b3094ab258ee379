"""protocols.deflate.zlib_compress (the fast Adler-32) against zlib, and the Lumberjack
window built with it against the window built with zlib.compressobj (the old code)."""

from __future__ import annotations

import os
import random
import struct
import zlib

import pytest

from logjam_relay.protocols import deflate
from logjam_relay.protocols import lumberjack as lj


def _samples():
    rnd = random.Random(7)
    yield b""
    yield b"\xff" * 5553
    yield os.urandom(70_000)
    for n in (1, 31, 32, 33, 5551, 5552, 5553, 100_000):
        yield bytes(rnd.choice(b'{"action":"a#b","n":1} ') for _ in range(n))


@pytest.mark.parametrize("level", [-1, 0, 1, 2, 3, 5, 6, 9])
def test_zlib_compress_equals_zlib(level):
    for data in _samples():
        assert deflate.zlib_compress(data, level) == zlib.compress(data, level)


def test_the_fast_checksum_is_in_use_when_built():
    from logjam_relay import _native
    built = _native.load("logjam_relay.outputs._courierenc") is not None
    assert (deflate._adler32 is not None) == built


@pytest.mark.parametrize("level", [1, 3, 9])
def test_lumberjack_window_bytes_unchanged(level):
    events = [{"line": f"event {i} " + "x" * (i % 50)} for i in range(300)]
    frames = lj.encode_data_frames(events)
    c = zlib.compressobj(level)
    payload = c.compress(frames) + c.flush()
    want = b"1W" + struct.pack(">I", 300) + b"1C" + struct.pack(">I", len(payload)) + payload
    assert lj.encode_window(frames, 300, level) == want
    assert lj.encode_compressed_frame(frames, level) == want[6:]
