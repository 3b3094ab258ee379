"""The Courier protocol's connection state machines, sans-IO (see ``courier.py``).

* :class:`ClientConnection` - client state machine (handshake, pending payloads by nonce,
  partial ACKNs, PING only when idle, network/PONG timeout).
* :class:`ServerConnection` - receiver state machine (handshake as the Go receiver or the
  Ruby receivers, partial-ACKN timer, pending-payload limit, ``????`` for unknown types).

Everything here is re-exported by :mod:`logjam_relay.protocols.courier`; the framing it
builds on is :mod:`.courier_frame`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .courier_frame import (  # the framing layer
    FLAG_EVNT,
    HELO,
    MAX_HANDSHAKE_GO,
    MAX_LENGTH,
    MAX_UNCOMPRESSED,
    PING_FRAME,
    PONG_FRAME,
    UNKN_FRAME,
    Ackn,
    CourierError,
    FrameReader,
    Helo,
    Payload,
    Ping,
    Pong,
    UnknownMessage,
    Unsupported,
    Vers,
    encode_ackn,
    encode_hello,
    encode_payload,
)

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
