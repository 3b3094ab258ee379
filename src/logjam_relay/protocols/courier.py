"""The Courier protocol (log-courier / log-carver), sans-IO.

Bytes in, events out: no sockets, no trio, no clock reads (``now`` is passed in).
Behaviour follows what the real receivers were *measured* to do
(``shared/specs/reference/courier.md``), not only the draft protocol text:

* frame = 4-byte type + 4-byte big-endian length + body; every length is limited to
  10 MiB (:data:`MAX_LENGTH`); HELO/VERS bodies are NNNNA4 (flags, major, minor, patch,
  4-byte identifier) optionally followed by 12 reserved bytes; shorter bodies are padded
  with zeros, extra bytes ignored.
* ``EVNT`` is streamed: length ``0xFFFFFFFF``, 16-byte nonce, then a zlib stream whose end
  is the end of the message (the reader finds it by inflating).
* JDAT/EVNT payload = zlib(``[len][json]`` ...).

Three layers:

* :class:`FrameReader` - incremental framing/decoding, yields message events.
* :class:`ClientConnection` - client state machine (handshake, pending payloads by nonce,
  partial ACKNs, PING only when idle, network/PONG timeout).
* :class:`ServerConnection` - receiver state machine (handshake as the Go receiver or the
  Ruby receivers, partial-ACKN timer, pending-payload limit, ``????`` for unknown types).

Errors raise :class:`CourierError` with a short ``reason`` usable as a metric label.
"""

from __future__ import annotations

import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass

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


def encode_events(events) -> bytes:
    """The uncompressed payload body: ``[len][json]`` back to back."""
    pack = _U32.pack
    return b"".join([pack(len(e)) + e for e in events])


def encode_payload(nonce: bytes, events, *, streamed: bool = False, level: int = 3) -> bytes:
    """A JDAT (or streamed EVNT) message for ``events`` (iterable of JSON bytes)."""
    if len(nonce) != NONCE_SIZE:
        raise ValueError("nonce must be 16 bytes")
    data = zlib.compress(encode_events(events), level)
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


# ------------------------------------------------------------------- client state


@dataclass(frozen=True, slots=True)
class HandshakeComplete:
    """The connection can carry payloads. ``streaming``: EVNT will be used."""

    streaming: bool
    server: Vers | None     # None when the server answered ``????`` (no handshake)


@dataclass(frozen=True, slots=True)
class PayloadAck:
    """An ACKN for a payload we sent on this connection.

    ``sequence`` is the acknowledged count (clamped to the payload size), ``advanced`` how
    many events it newly acknowledged (0 = keep-alive / repeat), ``complete`` whether the
    whole payload is now acknowledged (it is then forgotten).
    """

    nonce: bytes
    sequence: int
    advanced: int
    complete: bool


@dataclass(slots=True)
class _Pending:
    count: int
    acked: int = 0


class _Connection:
    """Shared by both ends: bytes go to a :class:`FrameReader`, its frames to ``_handle``."""

    reader: FrameReader

    def receive_data(self, data: bytes) -> None:
        self.reader.receive_data(data)

    def next_event(self, now: float):
        """The next connection-level event, or None when more bytes are needed."""
        while True:
            ev = self.reader.next_event()
            if ev is None:
                return None
            out = self._handle(ev, now)
            if out is not None:
                return out

    def _handle(self, ev, now: float):  # pragma: no cover - overridden
        raise NotImplementedError


class ClientConnection(_Connection):
    """Client side of one connection.

    Usage: ``out = conn.start(now)`` (HELO), send it; feed received bytes with
    :meth:`receive_data` and drain :meth:`next_event`; once :attr:`ready`, send
    payloads with :meth:`send_payload` while :meth:`can_send`; call :meth:`check` with the
    current time (raises ``CourierError('timeout')``) and send :meth:`ping` when
    :meth:`want_ping`. :meth:`deadline` tells when to call :meth:`check` next.
    """

    def __init__(self, *, max_pending: int = 10, network_timeout: float = 15.0,
                 idle_ping: float = 10.0, allow_streaming: bool = True,
                 compress_level: int = 3, hello: Helo | None = None,
                 max_frame: int = 1024 * 1024):
        self.max_pending = max_pending
        self.network_timeout = network_timeout
        self.idle_ping = idle_ping
        self.allow_streaming = allow_streaming
        self.compress_level = compress_level
        self.hello = hello or Helo()
        self.reader = FrameReader("client", max_length=max_frame, max_handshake=max_frame)
        self.state = "new"          # new -> handshake -> ready
        self.streaming = False
        self.pending: OrderedDict[bytes, _Pending] = OrderedDict()
        self._timeout_at: float | None = None
        self._ping_at: float | None = None      # PING outstanding since
        self._last_activity = 0.0
        self.keepalive_acks = 0
        self.ignored_acks = 0

    # -- sending

    def start(self, now: float) -> bytes:
        if self.state != "new":
            raise RuntimeError("start() called twice")
        self.state = "handshake"
        self._timeout_at = now + self.network_timeout
        self._last_activity = now
        return encode_hello(self.hello)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def can_send(self) -> bool:
        return self.state == "ready" and self._ping_at is None \
            and len(self.pending) < self.max_pending

    def send_payload(self, nonce: bytes, events, now: float) -> bytes:
        """Encode and register a payload; ``events`` must not be empty."""
        if not self.can_send():
            raise RuntimeError("cannot send a payload now (handshake, PING or window full)")
        if not events:
            raise ValueError("never send an empty payload")
        if nonce in self.pending:
            raise ValueError("nonce already pending on this connection")
        data = encode_payload(nonce, events, streamed=self.streaming, level=self.compress_level)
        if not self.pending:
            self._timeout_at = now + self.network_timeout
        self.pending[nonce] = _Pending(len(events))
        self._last_activity = now
        return data

    def want_ping(self, now: float) -> bool:
        return (self.state == "ready" and not self.pending and self._ping_at is None
                and now >= self._last_activity + self.idle_ping)

    def ping(self, now: float) -> bytes:
        if self.pending or self.state != "ready" or self._ping_at is not None:
            raise RuntimeError("PING only on an idle connection")
        self._ping_at = now
        self._timeout_at = now + self.network_timeout
        self._last_activity = now
        return PING_FRAME

    @property
    def idle(self) -> bool:
        """Nothing outstanding: no payload, no PING, handshake done."""
        return self.state == "ready" and not self.pending and self._ping_at is None

    # -- time

    def deadline(self) -> float:
        """When :meth:`check` / :meth:`want_ping` next need attention."""
        if self._timeout_at is not None:
            return self._timeout_at
        if self.state == "ready":
            return self._last_activity + self.idle_ping
        return float("inf")

    def check(self, now: float) -> None:
        if self._timeout_at is not None and now >= self._timeout_at:
            what = ("handshake" if self.state == "handshake" else
                    "PONG" if self._ping_at is not None else "ACKN")
            raise CourierError("timeout", f"no {what} within {self.network_timeout:g} s")

    # -- receiving

    def _handle(self, ev, now: float):
        if self.state == "handshake":
            if isinstance(ev, Vers):
                self.state = "ready"
                self.streaming = self.allow_streaming and ev.supports_evnt
                self._ready(now)
                return HandshakeComplete(self.streaming, ev)
            if isinstance(ev, Unsupported):
                self.state = "ready"
                self.streaming = False
                self._ready(now)
                return HandshakeComplete(False, None)
            raise CourierError("handshake", f"expected VERS or ????, got {_name(ev)}")
        if self.state != "ready":
            raise CourierError("unexpected", f"{_name(ev)} before HELO was sent")
        if isinstance(ev, Ackn):
            return self._ackn(ev, now)
        if isinstance(ev, Pong):
            if self._ping_at is None:
                raise CourierError("unexpected_pong", "PONG without PING")
            self._ping_at = None
            self._timeout_at = None
            self._last_activity = now
            return ev
        raise CourierError("unexpected", f"unexpected {_name(ev)} from the server")

    def _ready(self, now: float) -> None:
        self._timeout_at = None
        self._last_activity = now

    def _ackn(self, ev: Ackn, now: float):
        p = self.pending.get(ev.nonce)
        if p is None:
            self.ignored_acks += 1
            return None
        # every ACKN for a known nonce resets the network timeout (keep-alive ACKNs)
        self._timeout_at = now + self.network_timeout
        self._last_activity = now
        seq = min(ev.sequence, p.count)
        if seq <= p.acked:
            self.keepalive_acks += 1
            return PayloadAck(ev.nonce, p.acked, 0, False)
        advanced = seq - p.acked
        p.acked = seq
        complete = seq >= p.count
        if complete:
            del self.pending[ev.nonce]
            if not self.pending:
                self._timeout_at = None
        return PayloadAck(ev.nonce, seq, advanced, complete)


def _name(ev) -> str:
    return type(ev).__name__.upper() if not isinstance(ev, UnknownMessage) \
        else ev.type.decode("latin-1")


# ------------------------------------------------------------------- server state


@dataclass(frozen=True, slots=True)
class ReceiverBehaviour:
    """How a receiver answers: presets for the three measured real receivers."""

    name: str
    vers: Vers | None                  # None: no handshake (HELO is an unknown type)
    max_handshake: int = MAX_HANDSHAKE_GO
    unknown_reply: bool = True         # True: ``????`` and continue; False: close
    second_helo: str = "unknown"       # "unknown" (treated as unknown type) or "close"
    accept_streaming: bool = True      # EVNT with length 0xFFFFFFFF
    ping_when_pending: str = "close"   # "close" (Go) or "queue" (Ruby: PONG after the ACKNs)
    max_pending: int | None = 10       # Go: 10; Ruby: no limit (TCP backpressure)


GO_VERS = Vers(FLAG_EVNT, 2, 12, 0, b"LCVR", True)
RUBY_VERS = Vers(0, 2, 12, 0, b"RYLC", False)

#: log-carver / lc-lib Go receiver
GO = ReceiverBehaviour("go", GO_VERS, MAX_HANDSHAKE_GO, unknown_reply=False,
                       second_helo="close", ping_when_pending="close", max_pending=10)
#: Ruby log-courier 2.x gem
RUBY2 = ReceiverBehaviour("ruby2", RUBY_VERS, MAX_LENGTH, unknown_reply=True,
                          second_helo="unknown", accept_streaming=False,
                          ping_when_pending="queue", max_pending=None)
#: legacy ruby-log-courier 1.x gem (no handshake: HELO -> ????)
RUBY1 = ReceiverBehaviour("ruby1", None, MAX_LENGTH, unknown_reply=True,
                          second_helo="unknown", accept_streaming=False,
                          ping_when_pending="queue", max_pending=None)
#: the in-repo receiver's default: Go handshake and limits, ``????`` for unknown types
DEFAULT = ReceiverBehaviour("default", GO_VERS, MAX_HANDSHAKE_GO, unknown_reply=True,
                            second_helo="close", ping_when_pending="close", max_pending=10)

BEHAVIOURS = {b.name: b for b in (GO, RUBY2, RUBY1, DEFAULT)}


@dataclass(frozen=True, slots=True)
class Overloaded:
    """More than ``max_pending`` unacknowledged payloads: this one was dropped.

    Like the Go receiver, stop reading, acknowledge what is pending, then close.
    """

    nonce: bytes


class ServerConnection(_Connection):
    """Receiver side of one connection.

    Feed bytes with :meth:`receive_data`; :meth:`next_event` returns what the application
    must handle (:class:`Payload`, :class:`Ping` for queued PINGs, :class:`Overloaded`);
    replies the protocol generates itself (VERS, ``????``, PONG on an idle connection) are
    collected and returned by :meth:`data_to_send`. When a payload has been processed
    (partly or fully) call :meth:`ack`; call :meth:`on_timer` at :meth:`deadline` for the
    keep-alive/partial ACKN of the oldest pending payload (Go: every ``ack_timeout``
    seconds after the last ACKN while anything is pending).
    """

    def __init__(self, behaviour: ReceiverBehaviour = DEFAULT, *, ack_timeout: float = 5.0,
                 max_uncompressed: int = MAX_UNCOMPRESSED):
        self.behaviour = behaviour
        self.ack_timeout = ack_timeout
        self.reader = FrameReader("server", max_handshake=behaviour.max_handshake,
                                  allow_stream=behaviour.accept_streaming,
                                  max_uncompressed=max_uncompressed)
        self.state = "first"
        self.pending: OrderedDict[bytes, _Pending] = OrderedDict()
        self._out = bytearray()
        self._timer_at: float | None = None
        self.overloaded = False
        self.payloads = 0
        self.events = 0

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def _handle(self, ev, now: float):
        b = self.behaviour
        first = self.state == "first"
        self.state = "ready"
        if isinstance(ev, Helo):
            if first and b.vers is not None:
                self._out += encode_hello(b.vers)
                return None
            if not first and b.second_helo == "close":
                raise CourierError("unexpected_helo", "HELO after the handshake")
            return self._unknown(UnknownMessage(HELO, 0))
        if isinstance(ev, Payload):
            if self.overloaded:
                return None      # silently dropped, as the Go receiver
            if b.max_pending is not None and len(self.pending) >= b.max_pending:
                self.overloaded = True
                return Overloaded(ev.nonce)
            if ev.nonce in self.pending:
                raise CourierError("duplicate_nonce", "nonce already pending")
            if not self.pending:
                self._timer_at = now + self.ack_timeout
            self.pending[ev.nonce] = _Pending(len(ev.events))
            self.payloads += 1
            self.events += len(ev.events)
            return ev
        if first:
            raise CourierError("unexpected", f"unexpected {_name(ev)} message")
        if isinstance(ev, Ping):
            if self.pending:
                if b.ping_when_pending == "close":
                    raise CourierError("ping_not_idle",
                                       "received ping message on non-idle connection")
                return ev        # queued: the application answers after the ACKNs
            self._out += PONG_FRAME
            return None
        if isinstance(ev, UnknownMessage):
            return self._unknown(ev)
        raise CourierError("unexpected", f"unexpected {_name(ev)} message")

    def _unknown(self, ev: UnknownMessage):
        if not self.behaviour.unknown_reply:
            raise CourierError("unknown_message", f"unknown message type {ev.type!r}")
        self._out += UNKN_FRAME
        return None

    def pong(self) -> bytes:
        """Answer a queued PING (Ruby behaviour)."""
        return PONG_FRAME

    def ack(self, nonce: bytes, sequence: int, now: float) -> bytes:
        """ACKN for ``sequence`` events of ``nonce`` processed; re-arms the timer."""
        p = self.pending.get(nonce)
        if p is None:
            raise KeyError("unknown nonce")
        p.acked = max(p.acked, min(sequence, p.count))
        if p.acked >= p.count:
            del self.pending[nonce]
        self._timer_at = now + self.ack_timeout if self.pending else None
        return encode_ackn(nonce, sequence)

    def deadline(self) -> float:
        return self._timer_at if self._timer_at is not None else float("inf")

    def on_timer(self, now: float) -> bytes:
        """Keep-alive ACKN for the oldest pending payload with its last sequence, if due."""
        if self._timer_at is None or now < self._timer_at or not self.pending:
            return b""
        nonce, p = next(iter(self.pending.items()))
        self._timer_at = now + self.ack_timeout
        return encode_ackn(nonce, p.acked)
