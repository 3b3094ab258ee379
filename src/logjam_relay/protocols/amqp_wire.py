"""AMQP 0-9-1 wire format for :mod:`.amqp`: constants, frame and field encoding, and a
bounds-checked payload reader.  Pure functions, no state."""

from __future__ import annotations

import struct

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT = 1, 2, 3, 8
FRAME_END = 0xCE
FRAME_END_B = b"\xce"
FRAME_MIN_SIZE = 4096          # the spec's minimum frame_max
DEFAULT_FRAME_MAX = 131072
MAX_RETURNED_BODY = 128 * 1024 * 1024   # RabbitMQ's own largest message (max_message_size)

# class ids and (class, method) ids
CONNECTION, CHANNEL, EXCHANGE, BASIC, CONFIRM = 10, 20, 40, 60, 85
CONNECTION_START = (10, 10)
CONNECTION_START_OK = (10, 11)
CONNECTION_SECURE = (10, 20)
CONNECTION_TUNE = (10, 30)
CONNECTION_TUNE_OK = (10, 31)
CONNECTION_OPEN = (10, 40)
CONNECTION_OPEN_OK = (10, 41)
CONNECTION_CLOSE = (10, 50)
CONNECTION_CLOSE_OK = (10, 51)
CONNECTION_BLOCKED = (10, 60)
CONNECTION_UNBLOCKED = (10, 61)
CHANNEL_OPEN = (20, 10)
CHANNEL_OPEN_OK = (20, 11)
CHANNEL_FLOW = (20, 20)
CHANNEL_FLOW_OK = (20, 21)
CHANNEL_CLOSE = (20, 40)
CHANNEL_CLOSE_OK = (20, 41)
EXCHANGE_DECLARE = (40, 10)
EXCHANGE_DECLARE_OK = (40, 11)
EXCHANGE_DELETE = (40, 20)
EXCHANGE_DELETE_OK = (40, 21)
BASIC_PUBLISH = (60, 40)
BASIC_RETURN = (60, 50)
BASIC_ACK = (60, 80)
BASIC_NACK = (60, 120)
CONFIRM_SELECT = (85, 10)
CONFIRM_SELECT_OK = (85, 11)

REPLY_SUCCESS = 200
NOT_FOUND = 404


class AmqpError(Exception):
    """Malformed or unexpected input from the broker; the connection is unusable."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


# ------------------------------------------------------------------ encoding

_pack_frame_hdr = struct.Struct(">BHI").pack
unpack_frame_header = struct.Struct(">BHI").unpack_from
_HH = struct.Struct(">HH")
U16 = struct.Struct(">H")
U32 = struct.Struct(">I")
_Q = struct.Struct(">Q")
_PUBLISH_PREFIX = _HH.pack(*BASIC_PUBLISH) + b"\x00\x00"   # reserved-1 (ticket)
_CONTENT_PREFIX = _HH.pack(BASIC, 0)                       # class, weight
HEARTBEAT_FRAME = bytes([FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, FRAME_END])


def shortstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    if len(b) > 255:
        raise ValueError(f"AMQP short string longer than 255 bytes: {b[:40]!r}...")
    return bytes((len(b),)) + b


def longstr(b: str | bytes) -> bytes:
    if isinstance(b, str):
        b = b.encode()
    return U32.pack(len(b)) + b


def _field_value(v) -> bytes:
    if isinstance(v, bool):
        return b"t" + (b"\x01" if v else b"\x00")
    if isinstance(v, int):
        if -2**31 <= v < 2**31:
            return b"I" + struct.pack(">i", v)
        return b"l" + struct.pack(">q", v)
    if isinstance(v, str):
        return b"S" + longstr(v)
    if isinstance(v, bytes | bytearray):
        return b"x" + longstr(bytes(v))
    if isinstance(v, dict):
        return b"F" + encode_table(v)
    if v is None:
        return b"V"
    raise ValueError(f"AMQP field value of unsupported type {type(v).__name__}")


def encode_table(t: dict | None) -> bytes:
    if not t:
        return b"\x00\x00\x00\x00"
    body = b"".join(shortstr(k) + _field_value(v) for k, v in t.items())
    return U32.pack(len(body)) + body


# basic properties: (flag bit, name, kind)
_PROPS = (
    (15, "content_type", "s"), (14, "content_encoding", "s"), (13, "headers", "F"),
    (12, "delivery_mode", "o"), (11, "priority", "o"), (10, "correlation_id", "s"),
    (9, "reply_to", "s"), (8, "expiration", "s"), (7, "message_id", "s"),
    (6, "timestamp", "Q"), (5, "type", "s"), (4, "user_id", "s"), (3, "app_id", "s"),
    (2, "cluster_id", "s"),
)
NO_PROPERTIES = b"\x00\x00"


def encode_properties(**props) -> bytes:
    """The property part of a basic content header (flags + values); ``None`` = absent."""
    flags = 0
    out = []
    for bit, name, kind in _PROPS:
        v = props.pop(name, None)
        if v is None:
            continue
        flags |= 1 << bit
        if kind == "s":
            out.append(shortstr(v))
        elif kind == "F":
            out.append(encode_table(v))
        elif kind == "o":
            if not 0 <= int(v) <= 255:
                raise ValueError(f"AMQP property {name} must be 0..255")
            out.append(bytes((int(v),)))
        else:
            out.append(_Q.pack(int(v)))
    if props:
        raise ValueError(f"unknown AMQP basic properties: {', '.join(sorted(props))}")
    return U16.pack(flags) + b"".join(out)


def frame(kind: int, channel: int, payload: bytes) -> bytes:
    return _pack_frame_hdr(kind, channel, len(payload)) + payload + FRAME_END_B


def method_frame(channel: int, method: tuple[int, int], args: bytes = b"") -> bytes:
    return frame(FRAME_METHOD, channel, _HH.pack(*method) + args)


def encode_publish(channel: int, exchange: bytes, routing_key: bytes, body: bytes,
                   properties: bytes = NO_PROPERTIES, mandatory: bool = False,
                   frame_max: int = DEFAULT_FRAME_MAX) -> bytes:
    """basic.publish + content header + body frame(s).  ``exchange``/``routing_key`` are
    the already short-string-encoded names (:func:`shortstr`)."""
    margs = _PUBLISH_PREFIX + exchange + routing_key + (b"\x01" if mandatory else b"\x00")
    hdr = _CONTENT_PREFIX + _Q.pack(len(body)) + properties
    parts = [_pack_frame_hdr(FRAME_METHOD, channel, len(margs)), margs, FRAME_END_B,
             _pack_frame_hdr(FRAME_HEADER, channel, len(hdr)), hdr, FRAME_END_B]
    n = len(body)
    if n:
        room = frame_max - 8
        if n <= room:
            parts += (_pack_frame_hdr(FRAME_BODY, channel, n), body, FRAME_END_B)
        else:
            mv = memoryview(body)
            for i in range(0, n, room):
                chunk = mv[i:i + room]
                parts += (_pack_frame_hdr(FRAME_BODY, channel, len(chunk)), chunk, FRAME_END_B)
    return b"".join(parts)


# ------------------------------------------------------------------ decoding

class PayloadReader:
    """Cursor over one method/header payload; every read checks the bounds."""

    __slots__ = ("b", "i")

    def __init__(self, b: bytes, i: int = 0):
        self.b, self.i = b, i

    def take(self, n: int) -> bytes:
        j = self.i + n
        if n < 0 or j > len(self.b):
            raise AmqpError("truncated", "AMQP frame payload is truncated")
        v = self.b[self.i:j]
        self.i = j
        return v

    def octet(self) -> int:
        return self.take(1)[0]

    def short(self) -> int:
        return U16.unpack(self.take(2))[0]

    def long(self) -> int:
        return U32.unpack(self.take(4))[0]

    def longlong(self) -> int:
        return _Q.unpack(self.take(8))[0]

    def shortstr(self) -> str:
        return self.take(self.octet()).decode("utf-8", "replace")

    def longstr(self) -> bytes:
        return self.take(self.long())

    def table(self, depth: int = 0) -> dict:
        raw = self.longstr()
        r = PayloadReader(raw)
        out = {}
        while r.i < len(raw):
            k = r.shortstr()
            out[k] = r.value(depth)
        return out

    def value(self, depth: int):
        if depth > 16:
            raise AmqpError("bad_table", "AMQP field table nested too deeply")
        t = self.take(1)
        fmt = _SCALARS.get(t)
        if fmt is not None:
            return struct.unpack(fmt[0], self.take(fmt[1]))[0]
        if t == b"t":
            return self.octet() != 0
        if t in (b"S", b"x"):
            v = self.longstr()
            return v.decode("utf-8", "replace") if t == b"S" else v
        if t == b"F":
            return self.table(depth + 1)
        if t == b"A":
            raw = self.longstr()
            r = PayloadReader(raw)
            items = []
            while r.i < len(raw):
                items.append(r.value(depth + 1))
            return items
        if t == b"D":
            scale = self.octet()
            return (scale, struct.unpack(">i", self.take(4))[0])
        if t == b"V":
            return None
        raise AmqpError("bad_table", f"AMQP field table: unknown value type {t!r}")


_SCALARS = {b"b": (">b", 1), b"B": (">B", 1), b"s": (">h", 2), b"u": (">H", 2),
            b"I": (">i", 4), b"i": (">I", 4), b"l": (">q", 8), b"L": (">Q", 8),
            b"f": (">f", 4), b"d": (">d", 8), b"T": (">Q", 8)}
