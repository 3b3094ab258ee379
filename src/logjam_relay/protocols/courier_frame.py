"""The Courier protocol's framing, sans-IO: frame types, message events, the encoders and
the incremental :class:`FrameReader` (bytes in, events out).  The connection state
machines built on it are in :mod:`.courier_conn`; :mod:`.courier` is the protocol's API
and re-exports both (see its docstring for the measured behaviour)."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from .. import _native

# ----------------------------------------------------------------------- constants

HELO = b"HELO"
VERS = b"VERS"
PING = b"PING"
PONG = b"PONG"
JDAT = b"JDAT"
EVNT = b"EVNT"
ACKN = b"ACKN"
UNKN = b"????"

MAX_LENGTH = 10 * 1024 * 1024          # 10485760: larger lengths are rejected after the header
STREAM_LENGTH = 0xFFFFFFFF             # EVNT: length unknown, ends at the end of the zlib stream
MAX_HANDSHAKE_GO = 32                  # Go receiver closes on HELO/VERS bodies > 32 bytes
MAX_UNCOMPRESSED = 128 * 1024 * 1024   # inflate limit per payload (Go: 128 MiB receive queue)
NONCE_SIZE = 16
FLAG_EVNT = 0x01000000                 # flags byte 0, bit 0 (wire: 01 00 00 00)

_HDR = struct.Struct(">4sI")
_U32 = struct.Struct(">I")
_VERS = struct.Struct(">IIII4s")
_ACKN = struct.Struct(">16sI")


class CourierError(Exception):
    """A protocol violation or timeout. ``reason`` is a short metric label."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(message or reason)
        self.reason = reason


# -------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Hello:
    """HELO (client -> server) or VERS (server -> client): identical body layout."""

    flags: int = 0
    major: int = 0
    minor: int = 1
    patch: int = 0
    ident: bytes = b"LJRL"
    long: bool = True   # 32-byte form (12 reserved zero bytes) as the Go peers; False = 20 bytes

    @property
    def supports_evnt(self) -> bool:
        return bool(self.flags & FLAG_EVNT)


@dataclass(frozen=True, slots=True)
class Helo(Hello):
    pass


@dataclass(frozen=True, slots=True)
class Vers(Hello):
    pass


@dataclass(frozen=True, slots=True)
class Ping:
    pass


@dataclass(frozen=True, slots=True)
class Pong:
    pass


@dataclass(frozen=True, slots=True)
class Unsupported:
    """``????``: the peer does not know the message we sent."""


@dataclass(frozen=True, slots=True)
class UnknownMessage:
    """A message type this side does not know (its body was skipped)."""

    type: bytes
    length: int


@dataclass(frozen=True, slots=True)
class Payload:
    """JDAT or EVNT: a nonce and the raw JSON bytes of each event."""

    nonce: bytes
    events: tuple[bytes, ...]
    streamed: bool = False   # True = EVNT


@dataclass(frozen=True, slots=True)
class Ackn:
    nonce: bytes
    sequence: int


# ------------------------------------------------------------------------ encoding


def frame(type_: bytes, body: bytes = b"") -> bytes:
    return _HDR.pack(type_, len(body)) + body


def encode_hello(ev: Hello) -> bytes:
    body = _VERS.pack(ev.flags, ev.major, ev.minor, ev.patch, ev.ident[:4].ljust(4, b"\0"))
    if ev.long:
        body += bytes(12)
    return frame(VERS if isinstance(ev, Vers) else HELO, body)


def encode_events_py(events) -> bytes:
    """The uncompressed payload body: ``[len][json]`` back to back (the reference)."""
    pack = _U32.pack
    return b"".join([pack(len(e)) + e for e in events])


# the framing in C (``outputs/_courierenc.c`` ``frame_events``): one allocation instead of
# two objects per event (bench_durable.py: ~9 % of a Courier worker's CPU in Python)
_cenc = _native.load("logjam_relay.outputs._courierenc")
_frame_events = getattr(_cenc, "frame_events", None)
# zlib.compress with the fast Adler-32 (shared with the Lumberjack writer)
from .deflate import zlib_compress  # noqa: E402,F401


def encode_events(events) -> bytes:
    """The uncompressed payload body: ``[len][json]`` back to back."""
    if _frame_events is not None:
        if type(events) is not list and type(events) is not tuple:
            events = list(events)
        data = _frame_events(events)
        if data is not None:
            return data
    return encode_events_py(events)


def encode_payload(nonce: bytes, events, *, streamed: bool = False, level: int = 3) -> bytes:
    """A JDAT (or streamed EVNT) message for ``events`` (iterable of JSON bytes)."""
    if len(nonce) != NONCE_SIZE:
        raise ValueError("nonce must be 16 bytes")
    data = zlib_compress(encode_events(events), level)
    if streamed:
        return _HDR.pack(EVNT, STREAM_LENGTH) + nonce + data
    n = NONCE_SIZE + len(data)
    if n > MAX_LENGTH:
        raise CourierError("payload_too_large",
                           f"compressed payload of {n} bytes exceeds {MAX_LENGTH}")
    return _HDR.pack(JDAT, n) + nonce + data


def encode_ackn(nonce: bytes, sequence: int) -> bytes:
    return _HDR.pack(ACKN, 20) + _ACKN.pack(nonce, sequence)


PING_FRAME = frame(PING)
PONG_FRAME = frame(PONG)
UNKN_FRAME = frame(UNKN)


def send(event) -> bytes:
    """Encode any message event to bytes."""
    if isinstance(event, Hello):
        return encode_hello(event)
    if isinstance(event, Ping):
        return PING_FRAME
    if isinstance(event, Pong):
        return PONG_FRAME
    if isinstance(event, Unsupported):
        return UNKN_FRAME
    if isinstance(event, Ackn):
        return encode_ackn(event.nonce, event.sequence)
    if isinstance(event, Payload):
        return encode_payload(event.nonce, event.events, streamed=event.streamed)
    raise TypeError(f"cannot encode {event!r}")


def decode_events(data: bytes) -> tuple[bytes, ...]:
    """Split an uncompressed payload into its events; the whole payload is checked first."""
    out = []
    pos, end = 0, len(data)
    unpack = _U32.unpack_from
    mv = memoryview(data)
    while pos < end:
        if end - pos < 4:
            raise CourierError("bad_event_length", "truncated event length")
        (n,) = unpack(data, pos)
        pos += 4
        if n > end - pos:
            raise CourierError("bad_event_length",
                               f"event length {n} exceeds the {end - pos} bytes left")
        out.append(bytes(mv[pos:pos + n]))
        pos += n
    return tuple(out)


def _parse_hello(cls, body: bytes):
    long = len(body) >= 32
    b = body[:20].ljust(20, b"\0")
    flags, major, minor, patch, ident = _VERS.unpack(b)
    return cls(flags, major, minor, patch, ident, long)


# -------------------------------------------------------------------------- reader


class FrameReader:
    """Incremental decoder for one direction of a connection.

    ``role="server"`` decodes client requests (HELO, PING, JDAT, EVNT);
    ``role="client"`` decodes server responses (VERS, PONG, ACKN, ``????``).
    Unknown types are skipped (body discarded) and reported as :class:`UnknownMessage`;
    the state machine above decides whether that closes the connection.
    """

    def __init__(self, role: str, *, max_length: int = MAX_LENGTH,
                 max_handshake: int = MAX_LENGTH, allow_stream: bool = True,
                 max_uncompressed: int = MAX_UNCOMPRESSED):
        if role not in ("client", "server"):
            raise ValueError("role must be 'client' or 'server'")
        self.role = role
        self.max_length = max_length
        self.max_handshake = max_handshake
        self.allow_stream = allow_stream
        self.max_uncompressed = max_uncompressed
        self._buf = bytearray()
        self._skip = 0            # bytes of an unknown message body still to discard
        self._stream = None       # (nonce, inflater, [chunks], produced, consumed) in an EVNT
        self.bytes_received = 0

    def receive_data(self, data: bytes) -> None:
        self.bytes_received += len(data)
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def mid_message(self) -> bool:
        """A message is partly received: bytes buffered, an unknown body still being
        skipped, or a streamed EVNT being inflated."""
        return bool(self._buf or self._skip or self._stream is not None)

    @property
    def inflated(self) -> int:
        """What a streamed EVNT has inflated so far (0 outside one)."""
        return self._stream[3] if self._stream is not None else 0

    def next_event(self):
        """The next complete message event, or None when more data is needed."""
        buf = self._buf
        if self._skip:
            n = min(self._skip, len(buf))
            del buf[:n]
            self._skip -= n
            if self._skip:
                return None
        if self._stream is not None:
            return self._continue_stream()
        if len(buf) < 8:
            return None
        type_, length = _HDR.unpack_from(buf)
        if self.role == "server":
            return self._server_message(type_, length)
        return self._client_message(type_, length)

    # -- helpers

    def _body(self, length: int) -> bytes | None:
        if len(self._buf) < 8 + length:
            return None
        body = bytes(self._buf[8:8 + length])
        del self._buf[:8 + length]
        return body

    def _check_length(self, type_: bytes, length: int) -> None:
        if length > self.max_length:
            raise CourierError("too_large",
                               f"{type_!r} message length {length} > {self.max_length}")

    def _empty(self, type_: bytes, length: int, event):
        if length != 0:
            raise CourierError("bad_length", f"{type_.decode('latin-1')} with a {length}-byte body")
        del self._buf[:8]
        return event

    def _unknown(self, type_: bytes, length: int):
        self._check_length(type_, length)
        del self._buf[:8]
        self._skip = length
        n = min(self._skip, len(self._buf))
        del self._buf[:n]
        self._skip -= n
        return UnknownMessage(type_, length)

    def _server_message(self, type_: bytes, length: int):
        if type_ == JDAT:
            self._check_length(type_, length)
            if length < NONCE_SIZE + 1:
                raise CourierError("too_small", f"JDAT message too small ({length})")
            body = self._body(length)
            if body is None:
                return None
            return Payload(body[:16], self._inflate_all(body[16:]), False)
        if type_ == EVNT:
            if length == STREAM_LENGTH:
                if not self.allow_stream:
                    raise CourierError("too_large",
                                       f"packet too large ({length} > {self.max_length})")
                if len(self._buf) < 8 + NONCE_SIZE:
                    return None
                nonce = bytes(self._buf[8:24])
                del self._buf[:24]
                self._stream = (nonce, zlib.decompressobj(), [], 0, 0)
                return self._continue_stream()
            # a non-streamed EVNT: same as JDAT
            self._check_length(type_, length)
            if length < NONCE_SIZE + 1:
                raise CourierError("too_small", f"EVNT message too small ({length})")
            body = self._body(length)
            if body is None:
                return None
            return Payload(body[:16], self._inflate_all(body[16:]), True)
        if type_ == HELO:
            if length > self.max_handshake:
                raise CourierError("too_large", f"HELO length {length} > {self.max_handshake}")
            body = self._body(length)
            return None if body is None else _parse_hello(Helo, body)
        if type_ == PING:
            return self._empty(type_, length, Ping())
        return self._unknown(type_, length)

    def _client_message(self, type_: bytes, length: int):
        if type_ == ACKN:
            if length != 20:
                raise CourierError("bad_length", f"ACKN length {length} != 20")
            body = self._body(20)
            if body is None:
                return None
            nonce, seq = _ACKN.unpack(body)
            return Ackn(nonce, seq)
        if type_ == PONG:
            return self._empty(type_, length, Pong())
        if type_ == UNKN:
            return self._empty(type_, length, Unsupported())
        if type_ == VERS:
            if length > self.max_handshake:
                raise CourierError("too_large", f"VERS length {length} > {self.max_handshake}")
            body = self._body(length)
            return None if body is None else _parse_hello(Vers, body)
        return self._unknown(type_, length)

    def _inflate_all(self, data: bytes) -> tuple[bytes, ...]:
        d = zlib.decompressobj()
        try:
            out = d.decompress(data, self.max_uncompressed)
        except zlib.error as e:
            raise CourierError("zlib", f"zlib: {e}") from e
        if d.unconsumed_tail:
            raise CourierError("too_large", f"payload inflates beyond {self.max_uncompressed}")
        if not d.eof:
            raise CourierError("zlib_truncated", "truncated zlib stream")
        if d.unused_data:
            raise CourierError("zlib_trailing", f"{len(d.unused_data)} bytes after the zlib stream")
        return decode_events(out)

    def _continue_stream(self):
        nonce, d, chunks, produced, consumed = self._stream
        if self._buf:
            data = bytes(self._buf)
            self._buf.clear()
            consumed += len(data)
            try:
                out = d.decompress(data, self.max_uncompressed - produced + 1)
            except zlib.error as e:
                raise CourierError("zlib", f"zlib: {e}") from e
            produced += len(out)
            if produced > self.max_uncompressed:
                raise CourierError("too_large",
                                   f"EVNT inflates beyond {self.max_uncompressed}")
            chunks.append(out)
            if d.eof:
                self._buf += d.unused_data
                self._stream = None
                return Payload(nonce, decode_events(b"".join(chunks)), True)
            if consumed > self.max_length:
                raise CourierError("too_large", f"EVNT stream longer than {self.max_length}")
            self._stream = (nonce, d, chunks, produced, consumed)
        return None
