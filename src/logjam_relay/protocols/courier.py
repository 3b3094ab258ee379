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

Three layers, this module the API that re-exports the two modules below it:

* :class:`FrameReader` - incremental framing/decoding, yields message events
  (:mod:`.courier_frame`, with the frame types, events and encoders).
* :class:`ClientConnection` - client state machine (handshake, pending payloads by nonce,
  partial ACKNs, PING only when idle, network/PONG timeout).
* :class:`ServerConnection` - receiver state machine (handshake as the Go receiver or the
  Ruby receivers, partial-ACKN timer, pending-payload limit, ``????`` for unknown types)
  (both in :mod:`.courier_conn`, which imports the framing, never this module).

Errors raise :class:`CourierError` with a short ``reason`` usable as a metric label.
"""

from __future__ import annotations

from .courier_conn import (  # noqa: F401
    BEHAVIOURS,
    DEFAULT,
    GO,
    GO_VERS,
    RUBY1,
    RUBY2,
    RUBY_VERS,
    ClientConnection,
    HandshakeComplete,
    Overloaded,
    PayloadAck,
    ReceiverBehaviour,
    ServerConnection,
)
from .courier_frame import (  # noqa: F401
    ACKN,
    EVNT,
    FLAG_EVNT,
    HELO,
    JDAT,
    MAX_HANDSHAKE_GO,
    MAX_LENGTH,
    MAX_UNCOMPRESSED,
    NONCE_SIZE,
    PING,
    PING_FRAME,
    PONG,
    PONG_FRAME,
    STREAM_LENGTH,
    UNKN,
    UNKN_FRAME,
    VERS,
    Ackn,
    CourierError,
    FrameReader,
    Hello,
    Helo,
    Payload,
    Ping,
    Pong,
    UnknownMessage,
    Unsupported,
    Vers,
    decode_events,
    encode_ackn,
    encode_events,
    encode_events_py,
    encode_hello,
    encode_payload,
    frame,
    send,
    zlib_compress,
)
