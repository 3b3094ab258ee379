"""A minimal AMQP 0-9-1 client core for publishing with confirms, sans-IO.

Bytes in, events out (h11 style): no sockets, no trio, no clock.  It speaks exactly
what the samwise broker outputs need, and nothing else:

* the connection handshake (``PLAIN`` login, tune, open), close in both directions,
  heartbeats (the adapter decides *when*: :meth:`AmqpClient.heartbeat`), and
  ``connection.blocked``/``unblocked``;
* channels: open, close in both directions, ``channel.flow`` (answered);
* ``confirm.select``; ``basic.publish`` with the content header and body frames
  (split at the negotiated ``frame_max``); ``basic.ack``/``basic.nack`` and
  ``basic.return`` with its content;
* ``exchange.declare`` (also passive) and ``exchange.delete``.

Why not pika: a single REQ client is bound by latency per request, and pika costs a
thread (every publish hopped trio -> pika thread -> trio, fighting for the GIL) and
~40 Python calls per publish of framing.  Here a publish is one ``bytes.join`` of
pre-packed parts, encoded on the trio thread that already holds the record.

Input errors raise :class:`AmqpError` (``reason`` is a metric label); after one, the
connection must be dropped.  Nothing here asserts on input.  The wire format (constants,
encoders, the bounds-checked payload reader) is in :mod:`.amqp_wire`, re-exported here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .amqp_wire import (  # noqa: F401  (re-exported: the wire helpers are part of this API)
    BASIC,
    BASIC_ACK,
    BASIC_NACK,
    BASIC_PUBLISH,
    BASIC_RETURN,
    CHANNEL,
    CHANNEL_CLOSE,
    CHANNEL_CLOSE_OK,
    CHANNEL_FLOW,
    CHANNEL_FLOW_OK,
    CHANNEL_OPEN,
    CHANNEL_OPEN_OK,
    CONFIRM,
    CONFIRM_SELECT,
    CONFIRM_SELECT_OK,
    CONNECTION,
    CONNECTION_BLOCKED,
    CONNECTION_CLOSE,
    CONNECTION_CLOSE_OK,
    CONNECTION_OPEN,
    CONNECTION_OPEN_OK,
    CONNECTION_SECURE,
    CONNECTION_START,
    CONNECTION_START_OK,
    CONNECTION_TUNE,
    CONNECTION_TUNE_OK,
    CONNECTION_UNBLOCKED,
    DEFAULT_FRAME_MAX,
    EXCHANGE,
    EXCHANGE_DECLARE,
    EXCHANGE_DECLARE_OK,
    EXCHANGE_DELETE,
    EXCHANGE_DELETE_OK,
    FRAME_BODY,
    FRAME_END,
    FRAME_END_B,
    FRAME_HEADER,
    FRAME_HEARTBEAT,
    FRAME_METHOD,
    FRAME_MIN_SIZE,
    HEARTBEAT_FRAME,
    MAX_RETURNED_BODY,
    NO_PROPERTIES,
    NOT_FOUND,
    PROTOCOL_HEADER,
    REPLY_SUCCESS,
    U16,
    U32,
    AmqpError,
    PayloadReader,
    encode_properties,
    encode_publish,
    encode_table,
    frame,
    longstr,
    method_frame,
    shortstr,
    unpack_frame_header,
)

_ACK_HEAD = struct.pack(">HH", *BASIC_ACK)        # a basic.ack method payload starts so
_ACK_ARGS = struct.Struct(">QB").unpack_from       # delivery tag, bits (multiple)

# ------------------------------------------------------------------ events

@dataclass(frozen=True, slots=True)
class ConnectionOpen:
    channel_max: int
    frame_max: int
    heartbeat: int


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """The broker closed the connection (close-ok already queued)."""
    reply_code: int
    reply_text: str
    class_id: int = 0
    method_id: int = 0


@dataclass(frozen=True, slots=True)
class ConnectionCloseOk:
    pass


@dataclass(frozen=True, slots=True)
class ConnectionBlocked:
    reason: str


@dataclass(frozen=True, slots=True)
class ConnectionUnblocked:
    pass


@dataclass(frozen=True, slots=True)
class ChannelOpenOk:
    channel: int


@dataclass(frozen=True, slots=True)
class ChannelClosed:
    """The broker closed a channel (close-ok already queued)."""
    channel: int
    reply_code: int
    reply_text: str
    class_id: int = 0
    method_id: int = 0


@dataclass(frozen=True, slots=True)
class ChannelCloseOk:
    channel: int


@dataclass(frozen=True, slots=True)
class ConfirmSelectOk:
    channel: int


@dataclass(frozen=True, slots=True)
class ExchangeDeclareOk:
    channel: int


@dataclass(frozen=True, slots=True)
class ExchangeDeleteOk:
    channel: int


@dataclass(frozen=True, slots=True)
class Ack:
    channel: int
    delivery_tag: int
    multiple: bool


@dataclass(frozen=True, slots=True)
class Nack:
    channel: int
    delivery_tag: int
    multiple: bool


@dataclass(frozen=True, slots=True)
class Returned:
    channel: int
    reply_code: int
    reply_text: str
    exchange: str
    routing_key: str
    body: bytes


class AmqpClient:
    """The client side of one AMQP connection.

    ``start()``, then feed every received chunk to :meth:`receive_data` (returns the
    events it completed) and send :meth:`data_to_send` after each call.  Commands
    (``open_channel``, ``publish``, ...) only queue bytes.
    """

    def __init__(self, user: str, password: str, vhost: str = "/", *, heartbeat: int = 30,
                 frame_max: int = DEFAULT_FRAME_MAX, channel_max: int = 2047,
                 client_properties: dict | None = None):
        self.user, self.password, self.vhost = user, password, vhost
        self.want_heartbeat = heartbeat
        self.want_frame_max = frame_max
        self.want_channel_max = channel_max
        self.client_properties = {
            "product": "logjam-relay",
            "capabilities": {"publisher_confirms": True, "basic.nack": True,
                             "connection.blocked": True, "authentication_failure_close": True},
            **(client_properties or {}),
        }
        self.state = "idle"          # idle -> handshake -> open -> closing -> closed
        self.frame_max = FRAME_MIN_SIZE * 32   # limit for frames before tune
        self.channel_max = 0
        self.heartbeat_interval = 0
        self.server_properties: dict = {}
        self._in = bytearray()
        self._out: list[bytes] = []
        self._content: dict[int, list] = {}    # channel -> [Returned args, size, chunks, got]
        self._got_start = False

    # ------------------------------------------------------------ commands

    def start(self) -> None:
        self.state = "handshake"
        self._out.append(PROTOCOL_HEADER)

    def data_to_send(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out

    def heartbeat(self) -> None:
        self._out.append(HEARTBEAT_FRAME)

    def open_channel(self, ch: int) -> None:
        self._method(ch, CHANNEL_OPEN, b"\x00")

    def close_channel(self, ch: int, code: int = REPLY_SUCCESS, text: str = "") -> None:
        self._method(ch, CHANNEL_CLOSE, U16.pack(code) + shortstr(text[:255]) + b"\x00" * 4)

    def confirm_select(self, ch: int) -> None:
        self._method(ch, CONFIRM_SELECT, b"\x00")

    def exchange_declare(self, ch: int, name: str, kind: str = "direct", *, passive=False,
                         durable=False, auto_delete=False, internal=False,
                         arguments: dict | None = None) -> None:
        bits = passive | durable << 1 | auto_delete << 2 | internal << 3
        self._method(ch, EXCHANGE_DECLARE, b"\x00\x00" + shortstr(name) + shortstr(kind)
                     + bytes((bits,)) + encode_table(arguments))

    def exchange_delete(self, ch: int, name: str, *, if_unused=False) -> None:
        self._method(ch, EXCHANGE_DELETE, b"\x00\x00" + shortstr(name) + bytes((int(if_unused),)))

    def publish(self, ch: int, exchange: bytes, routing_key: bytes, body: bytes,
                properties: bytes = NO_PROPERTIES, mandatory: bool = False) -> None:
        """``exchange``/``routing_key`` already :func:`shortstr`-encoded."""
        self._out.append(encode_publish(ch, exchange, routing_key, body, properties,
                                        mandatory, self.frame_max))

    def close(self, code: int = REPLY_SUCCESS, text: str = "") -> None:
        if self.state in ("closing", "closed"):
            return
        if self.state == "open":
            self._method(0, CONNECTION_CLOSE, U16.pack(code) + shortstr(text[:255]) + b"\x00" * 4)
            self.state = "closing"
        else:
            self.state = "closed"

    def _method(self, ch: int, m: tuple[int, int], args: bytes = b"") -> None:
        self._out.append(method_frame(ch, m, args))

    # ------------------------------------------------------------ input

    def receive_data(self, data: bytes) -> list:
        """Feed bytes from the broker; returns the events completed by them.

        A ``basic.ack`` on an open connection (most of what a publisher receives) is
        decoded in place; every other frame goes through :meth:`_on_method` & co."""
        if self.state == "closed":
            return []
        buf = self._in
        buf += data
        events: list = []
        pos = 0
        n = len(buf)
        try:
            if not self._got_start and n >= 1 and buf[0:1] == b"A":
                # a broker that does not speak 0-9-1 answers with its own protocol header
                if n < 8:
                    return events
                raise AmqpError("protocol_version",
                                f"broker wants another AMQP version: {bytes(buf[:8])!r}")
            while n - pos >= 7:
                kind, ch, size = unpack_frame_header(buf, pos)
                if size > self.frame_max:
                    raise AmqpError("frame_too_large",
                                    f"AMQP frame of {size} bytes exceeds frame_max {self.frame_max}")
                end = pos + 7 + size
                if n < end + 1:
                    break
                if buf[end] != FRAME_END:
                    raise AmqpError("bad_frame_end", f"AMQP frame end is {buf[end]:#x}, not 0xce")
                if (size == 13 and kind == FRAME_METHOD and buf[pos + 7:pos + 11] == _ACK_HEAD
                        and self.state == "open" and ch not in self._content):
                    tag, bits = _ACK_ARGS(buf, pos + 11)
                    events.append(Ack(ch, tag, bool(bits & 1)))
                    pos = end + 1
                    continue
                payload = bytes(buf[pos + 7:end])
                pos = end + 1
                if kind == FRAME_METHOD:
                    self._on_method(ch, payload, events)
                elif kind == FRAME_HEADER:
                    self._on_header(ch, payload, events)
                elif kind == FRAME_BODY:
                    self._on_body(ch, payload, events)
                elif kind == FRAME_HEARTBEAT:
                    if ch != 0:
                        raise AmqpError("bad_heartbeat", "AMQP heartbeat on a channel other than 0")
                else:
                    raise AmqpError("bad_frame_type", f"unknown AMQP frame type {kind}")
                if self.state == "closed":
                    break
        except AmqpError:
            self.state = "closed"
            del buf[:]
            raise
        del buf[:pos]
        return events

    def _on_method(self, ch: int, payload: bytes, events: list) -> None:
        if ch in self._content:
            raise AmqpError("unexpected_method", "AMQP method frame inside a content body")
        r = PayloadReader(payload)
        m = (r.short(), r.short())
        if self.state == "handshake":
            self._handshake(ch, m, r, events)
            return
        if m == BASIC_ACK or m == BASIC_NACK:
            tag = r.longlong()
            bits = r.octet()
            events.append((Ack if m == BASIC_ACK else Nack)(ch, tag, bool(bits & 1)))
        elif m == BASIC_RETURN:
            code = r.short()
            text, ex, rk = r.shortstr(), r.shortstr(), r.shortstr()
            self._content[ch] = [(ch, code, text, ex, rk), None, [], 0]
        elif m == CHANNEL_OPEN_OK:
            events.append(ChannelOpenOk(ch))
        elif m == CONFIRM_SELECT_OK:
            events.append(ConfirmSelectOk(ch))
        elif m == EXCHANGE_DECLARE_OK:
            events.append(ExchangeDeclareOk(ch))
        elif m == EXCHANGE_DELETE_OK:
            events.append(ExchangeDeleteOk(ch))
        elif m == CHANNEL_CLOSE:
            code, text, cid, mid = r.short(), r.shortstr(), r.short(), r.short()
            self._method(ch, CHANNEL_CLOSE_OK)
            events.append(ChannelClosed(ch, code, text, cid, mid))
        elif m == CHANNEL_CLOSE_OK:
            events.append(ChannelCloseOk(ch))
        elif m == CHANNEL_FLOW:
            active = r.octet() & 1
            self._method(ch, CHANNEL_FLOW_OK, bytes((active,)))
        elif m == CONNECTION_CLOSE:
            code, text, cid, mid = r.short(), r.shortstr(), r.short(), r.short()
            self._method(0, CONNECTION_CLOSE_OK)
            self.state = "closed"
            events.append(ConnectionClosed(code, text, cid, mid))
        elif m == CONNECTION_CLOSE_OK:
            self.state = "closed"
            events.append(ConnectionCloseOk())
        elif m == CONNECTION_BLOCKED:
            events.append(ConnectionBlocked(r.shortstr()))
        elif m == CONNECTION_UNBLOCKED:
            events.append(ConnectionUnblocked())
        else:
            raise AmqpError("unexpected_method", f"unexpected AMQP method {m[0]}.{m[1]}")

    def _handshake(self, ch: int, m, r: PayloadReader, events: list) -> None:
        if ch != 0:
            raise AmqpError("unexpected_method", "AMQP handshake method on a channel")
        if m == CONNECTION_START and not self._got_start:
            self._got_start = True
            major, minor = r.octet(), r.octet()
            self.server_properties = r.table()
            mechanisms = r.longstr().split()
            r.longstr()  # locales
            if (major, minor) != (0, 9):
                raise AmqpError("protocol_version", f"broker speaks AMQP {major}-{minor}")
            if b"PLAIN" not in mechanisms:
                raise AmqpError("auth_mechanism",
                                f"broker offers no PLAIN login: {b' '.join(mechanisms)!r}")
            resp = b"\x00" + self.user.encode() + b"\x00" + self.password.encode()
            self._method(0, CONNECTION_START_OK, encode_table(self.client_properties)
                         + shortstr("PLAIN") + longstr(resp) + shortstr("en_US"))
        elif m == CONNECTION_TUNE and self._got_start:
            cmax, fmax, hb = r.short(), r.long(), r.short()
            cmax = min(cmax or 65535, self.want_channel_max)
            fmax = min(fmax or 2**32 - 1, self.want_frame_max)
            if fmax < FRAME_MIN_SIZE:
                raise AmqpError("bad_tune", f"broker frame_max {fmax} is below {FRAME_MIN_SIZE}")
            hb = min(hb, self.want_heartbeat) if hb and self.want_heartbeat else 0
            self.channel_max, self.frame_max, self.heartbeat_interval = cmax, fmax, hb
            self._method(0, CONNECTION_TUNE_OK, U16.pack(cmax) + U32.pack(fmax) + U16.pack(hb))
            self._method(0, CONNECTION_OPEN, shortstr(self.vhost) + b"\x00\x00")
        elif m == CONNECTION_OPEN_OK and self.channel_max:
            self.state = "open"
            events.append(ConnectionOpen(self.channel_max, self.frame_max, self.heartbeat_interval))
        elif m == CONNECTION_CLOSE:
            code, text, cid, mid = r.short(), r.shortstr(), r.short(), r.short()
            self._method(0, CONNECTION_CLOSE_OK)
            self.state = "closed"
            events.append(ConnectionClosed(code, text, cid, mid))
        elif m == CONNECTION_SECURE and self._got_start:
            raise AmqpError("auth_mechanism", "broker asked for a SASL challenge (not PLAIN)")
        else:
            raise AmqpError("unexpected_method",
                            f"unexpected AMQP method {m[0]}.{m[1]} during the handshake")

    def _on_header(self, ch: int, payload: bytes, events: list) -> None:
        c = self._content.get(ch)
        if c is None or c[1] is not None:
            raise AmqpError("unexpected_content", "AMQP content header without a basic.return")
        r = PayloadReader(payload)
        cls, _weight, size = r.short(), r.short(), r.longlong()
        if cls != BASIC:
            raise AmqpError("unexpected_content", f"AMQP content header of class {cls}")
        if size > MAX_RETURNED_BODY:
            raise AmqpError("frame_too_large", f"AMQP returned body of {size} bytes")
        c[1] = size
        if size == 0:
            self._returned(ch, events)

    def _on_body(self, ch: int, payload: bytes, events: list) -> None:
        c = self._content.get(ch)
        if c is None or c[1] is None:
            raise AmqpError("unexpected_content", "AMQP body frame without a content header")
        c[2].append(payload)
        c[3] = got = c[3] + len(payload)
        if got > c[1]:
            raise AmqpError("unexpected_content", "AMQP body longer than its content header says")
        if got == c[1]:
            self._returned(ch, events)

    def _returned(self, ch: int, events: list) -> None:
        args, _size, chunks, _got = self._content.pop(ch)
        events.append(Returned(*args, b"".join(chunks)))
