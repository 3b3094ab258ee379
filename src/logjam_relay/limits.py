"""Bounded decompression: never inflate more than ``limit`` bytes into memory.

``max_event_bytes`` (config/settings.py) bounds the decompressed size of one event.  Every
place that inflates a body for an output goes through :func:`inflate_bounded`:

* zlib / gzip: ``decompressobj().decompress(data, limit + 1)`` -- at most
  ``limit + 1`` bytes are ever produced, so a 61 KB bomb that would inflate to
  60 MiB costs ``limit + 1`` bytes, not 60 MiB;
* lz4 (logjam's block format: a 4-byte big-endian length, then a raw block):
  the declared length is checked before anything is allocated;
* lz4frame: the content size from the frame header is checked first; a frame
  without one is inflated with ``max_length = limit + 1``;
* snappy (raw): the uncompressed length is the varint at the head of the block,
  checked before anything is allocated.

Two errors, both :class:`ValueError`: :class:`EventTooLarge` (the body is, or
declares itself, larger than the limit -- a dead letter with reason
``too_large``) and :class:`BadBody` (it cannot be decoded -- reason
``decompress``).
"""

from __future__ import annotations

import struct
import zlib

import lz4.block
import lz4.frame
import snappy

__all__ = ["EventTooLarge", "BadBody", "inflate_bounded", "CODECS", "declared_size"]

_LEN = struct.Struct(">I")

#: logjam meta compression numbers -> codec names
CODECS = {0: "none", 1: "zlib", 2: "snappy", 3: "lz4"}


class EventTooLarge(ValueError):
    """The (decompressed) event is larger than the limit."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class BadBody(ValueError):
    """The body cannot be decompressed (corrupt, truncated, unknown codec)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _snappy_length(data: bytes) -> int:
    n = shift = 0
    for i in range(min(len(data), 5)):
        b = data[i]
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n
        shift += 7
    raise BadBody("snappy: body without a valid length prefix")


def declared_size(codec: str | int, data: bytes) -> int | None:
    """The decompressed size a body announces (lz4, snappy, plain), or None (zlib/gzip)."""
    codec = CODECS.get(codec, codec) if isinstance(codec, int) else codec
    if codec == "none":
        return len(data)
    if codec == "lz4":
        return _LEN.unpack_from(data)[0] if len(data) >= 4 else None
    if codec == "snappy":
        try:
            return _snappy_length(data)
        except BadBody:
            return None
    return None


def _zlib(data: bytes, limit: int, wbits: int, name: str) -> bytes:
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as e:
        raise BadBody(f"{name}: {e}") from None
    if len(out) > limit:
        raise EventTooLarge(f"{name} body inflates past {limit} bytes "
                            f"({len(data)} bytes compressed)")
    if not d.eof:
        raise BadBody(f"{name}: body truncated")
    return out


def inflate_bounded(codec: str | int, data: bytes, limit: int) -> bytes:
    """Decompress ``data`` with ``codec``; never more than ``limit`` bytes in memory.

    ``codec`` is a name (none, zlib, gzip, lz4, lz4frame, snappy) or a logjam
    meta compression number.  Raises :class:`EventTooLarge` or :class:`BadBody`.
    """
    if isinstance(codec, int):
        name = CODECS.get(codec)
        if name is None:
            raise BadBody(f"unknown compression method {codec}")
        codec = name
    if codec == "none":
        if len(data) > limit:
            raise EventTooLarge(f"body of {len(data)} bytes is over {limit} bytes")
        return data
    if codec == "zlib":
        return _zlib(data, limit, zlib.MAX_WBITS, "zlib")
    if codec == "gzip":
        return _zlib(data, limit, zlib.MAX_WBITS | 16, "gzip")
    if codec == "lz4":
        if len(data) < 4:
            raise BadBody("lz4: body shorter than its length prefix")
        (n,) = _LEN.unpack_from(data)
        if n > limit:
            raise EventTooLarge(f"lz4 body declares {n} bytes, over {limit} bytes")
        try:
            out = lz4.block.decompress(memoryview(data)[4:], uncompressed_size=n)
        except Exception as e:  # lz4.block.LZ4BlockError
            raise BadBody(f"lz4: {e}") from None
        if len(out) != n:
            raise BadBody(f"lz4: block gave {len(out)} bytes, prefix says {n}")
        return out
    if codec == "lz4frame":
        try:
            info = lz4.frame.get_frame_info(data)
        except Exception as e:
            raise BadBody(f"lz4frame: {e}") from None
        declared = info.get("content_size") or 0
        if declared > limit:
            raise EventTooLarge(f"lz4 frame declares {declared} bytes, over {limit} bytes")
        dec = lz4.frame.LZ4FrameDecompressor()
        try:
            out = dec.decompress(data, max_length=limit + 1)
        except Exception as e:
            raise BadBody(f"lz4frame: {e}") from None
        if len(out) > limit:
            raise EventTooLarge(f"lz4 frame inflates past {limit} bytes")
        if not dec.eof:
            raise BadBody("lz4frame: frame truncated")
        return out
    if codec == "snappy":
        n = _snappy_length(data)
        if n > limit:
            raise EventTooLarge(f"snappy body declares {n} bytes, over {limit} bytes")
        try:
            out = snappy.uncompress(data)
        except Exception as e:
            raise BadBody(f"snappy: {e}") from None
        if len(out) != n:  # pragma: no cover - the decoder checks this itself
            raise BadBody(f"snappy: block gave {len(out)} bytes, prefix says {n}")
        return out
    raise BadBody(f"unknown compression {codec!r}")
