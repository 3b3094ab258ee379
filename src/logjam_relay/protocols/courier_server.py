"""Courier receiver side for the relay's inputs, sans-IO.

Built on :class:`logjam_relay.protocols.courier.ServerConnection` (handshake as the Go
receiver, ``????`` for unknown types, ACKN encoding, the keep-alive ACKN timer) with the
input's bounds added:

* a payload inflates to at most ``max_payload_bytes`` (a decompression bomb ends with
  ``too_large`` once that much was produced);
* an event larger than ``max_event_bytes`` ends the connection (``event_too_large``);
* :attr:`InputConnection.busy` says a frame is partly received, so the I/O layer can
  run its deadline against slow senders (slowloris).

The application handles one :class:`~logjam_relay.protocols.courier.Payload` at a time and
acknowledges it with :meth:`InputConnection.ack` once its events are durable; it reads
no further bytes meanwhile, so a PING is always parsed on an idle connection and the
pending-payload limit is never reached by a well-behaved client.
"""

from __future__ import annotations

from .courier import (
    DEFAULT,
    CourierError,
    Payload,
    ReceiverBehaviour,
    ServerConnection,
    encode_ackn,
)

__all__ = ["InputConnection", "CourierError", "Payload"]


class InputConnection(ServerConnection):
    def __init__(self, behaviour: ReceiverBehaviour = DEFAULT, *, ack_timeout: float = 5.0,
                 max_payload_bytes: int = 64 * 1024 * 1024,
                 max_event_bytes: int = 10 * 1024 * 1024):
        super().__init__(behaviour, ack_timeout=ack_timeout,
                         max_uncompressed=max_payload_bytes)
        self.max_event_bytes = max_event_bytes

    @property
    def busy(self) -> bool:
        """A message is partly received (its deadline should run)."""
        return self.reader.mid_message

    @property
    def held_bytes(self) -> int:
        """Bytes received and not yet handed out as a payload: the read buffer, and what
        a streamed EVNT has inflated so far."""
        r = self.reader
        return r.buffered + r.inflated

    def next_event(self, now: float):
        ev = super().next_event(now)
        if type(ev) is Payload:
            limit = self.max_event_bytes
            for e in ev.events:
                if len(e) > limit:
                    raise CourierError("event_too_large",
                                       f"event of {len(e)} bytes > {limit}")
        return ev

    def keepalive(self, nonce: bytes) -> bytes:
        """ACKN repeating what is acknowledged of ``nonce`` (a keep-alive for the client)."""
        p = self.pending.get(nonce)
        return encode_ackn(nonce, p.acked if p else 0)
