"""Lumberjack server (reader) side for the relay's inputs, sans-IO: v1 and v2 (Beats).

Bytes in, whole windows out; no sockets, no trio, no clock reads.

* v1 (``shared/specs/lumberjack-v1.md``): ``1W n``, then n events as ``1D`` frames
  (key/value string pairs) and/or ``1C`` frames (zlib of a frame stream).
* v2 (what Filebeat/Beats send through go-lumber's client v2): ``2W n``, then n events as
  ``2J <u32 seq> <u32 len> <JSON>`` frames, usually all inside one ``2C`` frame.

A window is handed over as one :class:`WindowReceived` only when all its events are in
(all-or-nothing, as go-lumber); the application acknowledges it with :meth:`ack` *after*
it has made the events durable.  The ACK value is the event count, which equals the last
sequence number for every known writer (they restart at 1 per window) and is what
go-lumber sends.  :meth:`keepalive` gives ``2A 0`` for a v2 window whose processing takes
long, and nothing for a v1 window (as go-lumber's v1 server; Logstash's Java input sends
``2A 0`` on v1 connections too, which logstash-forwarder takes for the ACK of its window).

Bounds (bad input never costs more than these):

* ``max_window`` events per window (go-lumber's 10000);
* ``max_event_bytes`` per event (a D/J frame; Filebeat's 10 MiB default);
* ``max_window_bytes`` per window: the frames of one window, compressed and inflated
  (a ``C`` frame is inflated at most up to what is left of this budget, so a
  decompression bomb ends with ``inflate_too_large`` after ``max_window_bytes``).

and, with a ``budget`` shared by the connections of an input, what they hold together: the
bytes received and not yet parsed, and the events of their windows, each costed as
:func:`event_cost` (twice its frame bytes plus :data:`EVENT_COST` plus :data:`PAIR_COST`
per v1 key/value pair: the decoded event and the message the input maps it to, both alive
until the window is spooled, measured with tracemalloc).  A ``C`` frame is inflated at most
to what is left of the budget; a connection that would take the input over it ends with
``input_memory`` (the sender resends the window later).  The events of a complete window
stay charged (:attr:`WindowReceived.charged`) until the application gives them back with
``budget.give`` once the window is acknowledged or dropped; :meth:`ServerConnection.release`
gives back the rest when the connection ends (a protocol error does it at once).

Every protocol error raises :class:`~logjam_relay.protocols.lumberjack.LumberjackError`
with a short ``reason`` (a metric label); the connection is then dead and the I/O layer
closes it without a reply (as go-lumber). The parsing primitives (frame layout, the
error class, ACK encoding) are the ones of :mod:`logjam_relay.protocols.lumberjack`.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from ..limits import BadBody, EventTooLarge, inflate_bounded
from .lumberjack import MAX_WINDOW, NEED_DATA, ConnectionClosed, LumberjackError, encode_ack

__all__ = ["ServerConnection", "WindowReceived", "NEED_DATA", "ConnectionClosed",
           "LumberjackError", "MAX_WINDOW", "DEFAULT_MAX_EVENT_BYTES",
           "DEFAULT_MAX_WINDOW_BYTES", "EVENT_COST", "PAIR_COST", "event_cost",
           "encode_json_frame", "encode_window_v2"]

DEFAULT_MAX_EVENT_BYTES = 10 * 1024 * 1024
DEFAULT_MAX_WINDOW_BYTES = 64 * 1024 * 1024

_U32 = struct.Struct(">I")
_U32x2 = struct.Struct(">II")
_u32 = _U32.unpack_from
_u32x2 = _U32x2.unpack_from

V1, V2 = 0x31, 0x32
T_WINDOW, T_DATA, T_JSON, T_COMPRESSED = 0x57, 0x44, 0x4A, 0x43
_MAX_NESTING = 3
_MAX_KEYS = 256            # distinct v1 key names a connection shares among its events

#: what an event costs in memory beyond twice its frame bytes (the decoded event and the
#: message it is mapped to), and per v1 key/value pair (a str and a dict slot; the key's
#: str is shared when the name was seen before, see _MAX_KEYS): tracemalloc of windows of
#: 10,000 events: 1 tiny pair 474 bytes an event (charged 630), 300 tiny pairs with
#: names never seen before 28,277 (charged 35,162), 200-byte forwarder lines 1,103
#: (charged 1,392), 2-byte JSON documents 316 (charged 536)
EVENT_COST = 512
PAIR_COST = 80


def event_cost(frame_bytes: int, pairs: int = 0) -> int:
    """The memory charged for one event of ``frame_bytes`` (with ``pairs`` v1 pairs)."""
    return 2 * frame_bytes + EVENT_COST + PAIR_COST * pairs


class _Unbounded:
    """The budget of a connection that shares none."""

    available = 1 << 62

    @staticmethod
    def take(n: int) -> bool:
        return True

    @staticmethod
    def give(n: int) -> None:
        pass


@dataclass(frozen=True, slots=True)
class WindowReceived:
    """A complete window. ``events``: dicts (v1 ``D``) or raw JSON bytes (v2 ``J``)."""

    version: int
    events: list
    count: int
    nbytes: int          # frame bytes of the window (inflated)
    dropped: int = 0     # events of a C frame beyond the announced window (discarded)
    charged: int = 0     # what its events hold of the budget (give it back when done)


class ServerConnection:
    """One Lumberjack connection seen from the server (reader) side, v1 or v2."""

    def __init__(self, *, max_window: int = MAX_WINDOW,
                 max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
                 max_window_bytes: int = DEFAULT_MAX_WINDOW_BYTES, budget=None):
        """``budget``: shared by the connections of an input (``available``,
        ``take(n) -> bool``, ``give(n)``); None: unbounded."""
        self.max_window = max_window
        self.budget = budget if budget is not None else _Unbounded()
        self._charged_buf = 0     # len(_buf) as charged
        self._charged = 0         # the events of the current window
        self._keys: dict[bytes, str] = {}   # v1 keys decoded once: one str per name
        self.max_event_bytes = max_event_bytes
        self.max_window_bytes = max_window_bytes
        self._buf = bytearray()
        self._pos = 0
        self._eof = False
        self._closed = False
        self._error: tuple[str, str] | None = None     # (reason, message), no traceback
        self.version = 0          # of the current window
        self._want = 0            # events announced by the current W (0 = between windows)
        self._events: list = []
        self._wbytes = 0
        self._dropped = 0
        self.windows = 0
        self.events_total = 0

    # -- state ------------------------------------------------------------------

    @property
    def in_window(self) -> bool:
        return self._want > 0

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    # -- input ------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Bytes from the peer; ``b""`` = end of stream."""
        if not data:
            self._eof = True
            return
        if self._eof:
            raise RuntimeError("receive_data after end of stream")
        if self._pos:
            if self._pos == len(self._buf):
                self._buf.clear()
                self._pos = 0
            elif self._pos > 65536:
                del self._buf[:self._pos]
                self._pos = 0
        self._buf += data
        try:
            self._charge_buffer()
        except LumberjackError as e:
            self._fail(e.reason, str(e))
            raise LumberjackError(*self._error) from None

    def next_event(self):
        """:class:`WindowReceived`, :data:`NEED_DATA` or :class:`ConnectionClosed`."""
        if self._error is not None:
            raise LumberjackError(*self._error)
        err = None
        try:
            ev = self._parse()
        except LumberjackError as e:
            err = (e.reason, str(e))
        if err is not None:
            # raised here, outside the except block, a fresh error holds no traceback of
            # the parse (whose frames hold the inflated data and this connection): a
            # stored exception with one made a reference cycle that kept every failed
            # connection's buffers until a full garbage collection (the relay runs those
            # rarely: stamping.tune_gc), 60 MiB a decompression bomb
            self._fail(*err)
            raise LumberjackError(*err)
        if ev is NEED_DATA and self._eof:
            if self.buffered or self._want:
                self._fail("truncated", "end of stream inside a frame or window "
                           f"({len(self._events)} of {self._want} events, {self.buffered} "
                           "bytes)")
                raise LumberjackError(*self._error)
            if not self._closed:
                self._closed = True
                return ConnectionClosed()
        return ev

    def release(self) -> None:
        """Give back what this connection holds of the budget and drop its buffers (the
        connection is over; a window already handed out keeps its own ``charged``)."""
        self.budget.give(self._charged_buf + self._charged)
        self._charged_buf = self._charged = 0
        self._buf = bytearray()
        self._pos = 0
        self._events = []

    def _fail(self, reason: str, message: str) -> None:
        self._error = (reason, message)
        self.release()

    def _charge_buffer(self) -> None:
        n = len(self._buf) - self._charged_buf
        if n > 0 and not self.budget.take(n):
            raise LumberjackError("input_memory", "the input's connections hold max_held_bytes")
        if n < 0:
            self.budget.give(-n)
        self._charged_buf += n

    def _charge(self, n: int) -> None:
        if not self.budget.take(n):
            raise LumberjackError("input_memory", "the input's connections hold max_held_bytes")
        self._charged += n

    # -- output -----------------------------------------------------------------

    def ack(self, count: int) -> bytes:
        """The ACK for a window of ``count`` events, in the window's protocol version."""
        return encode_ack(count, 2 if self.version == 2 else 1)

    def keepalive(self) -> bytes | None:
        """The keep-alive for the current window while it waits: ``2A 0`` on v2, None on v1.

        v1 has none (go-lumber's v1 server sends nothing while it waits): logstash-forwarder
        takes any 6 bytes for the ACK of its whole window, so a ``2A 0`` would make it
        forget events that are not durable yet."""
        return encode_ack(0, 2) if self.version == 2 else None

    # -- parsing ----------------------------------------------------------------

    def _parse(self):
        buf = self._buf
        while True:
            pos = self._pos
            avail = len(buf) - pos
            if avail < 2:
                return NEED_DATA
            ver, typ = buf[pos], buf[pos + 1]
            if ver != V1 and ver != V2:
                raise LumberjackError("bad_version", f"protocol version byte {ver:#x}")
            if not self._want:
                if typ == T_COMPRESSED:
                    # a C frame between windows holding W + events (jls-lumberjack accepts
                    # it, timbersnake's client sends it): inflate it in place
                    if avail < 6:
                        return NEED_DATA
                    (n,) = _u32(buf, pos + 2)
                    if n > self.max_window_bytes:
                        raise LumberjackError("window_bytes_exceeded",
                                              f"compressed frame of {n} bytes")
                    if avail < 6 + n:
                        return NEED_DATA
                    buf[pos:pos + 6 + n] = self._inflate_raw(buf, pos + 6, n,
                                                             self.max_window_bytes)
                    self._charge_buffer()
                    continue
                if typ != T_WINDOW:
                    raise LumberjackError("expected_window",
                                          f"expected window frame, received {[ver, typ]}")
                if avail < 6:
                    return NEED_DATA
                (n,) = _u32(buf, pos + 2)
                self._pos = pos + 6
                if n > self.max_window:
                    raise LumberjackError("window_too_large",
                                          f"window size {n} exceeds maximum {self.max_window}")
                if n == 0:
                    continue                    # go-lumber: ignored, no ACK
                self.version = 1 if ver == V1 else 2
                self._want = n
                self._events = []
                self._wbytes = 6
                self._dropped = 0
                continue
            if typ == T_COMPRESSED:
                if avail < 6:
                    return NEED_DATA
                (n,) = _u32(buf, pos + 2)
                if self._wbytes + 6 + n > self.max_window_bytes:
                    self._add_bytes(6 + n)          # raises window_bytes_exceeded
                if avail < 6 + n:
                    return NEED_DATA
                self._wbytes += 6 + n
                self._inflate(buf, pos + 6, n, 1)
                self._pos = pos + 6 + n
            elif typ == T_DATA or typ == T_JSON:
                r = self._frame(buf, pos, len(buf), ver, typ)
                if r is None:
                    return NEED_DATA
                ev, end = r
                self._add_bytes(end - pos)
                self._charge(event_cost(end - pos, len(ev) if typ == T_DATA else 0))
                self._pos = end
                self._events.append(ev)
            elif typ == T_WINDOW:
                raise LumberjackError("unexpected_window",
                                      f"window frame in mid-window ({len(self._events)} of "
                                      f"{self._want} events)")
            else:
                raise LumberjackError("unknown_frame_type", f"unknown frame type: {typ}")
            if len(self._events) >= self._want:
                return self._complete()

    def _complete(self) -> WindowReceived:
        events = self._events
        if len(events) > self._want:
            self._dropped += len(events) - self._want
            del events[self._want:]
        w = WindowReceived(self.version, events, len(events), self._wbytes, self._dropped,
                           self._charged)
        self._charged = 0
        self._want = 0
        self._events = []
        self.windows += 1
        self.events_total += w.count
        return w

    def _add_bytes(self, n: int) -> None:
        self._wbytes += n
        if self._wbytes > self.max_window_bytes:
            raise LumberjackError("window_bytes_exceeded",
                                  f"window larger than {self.max_window_bytes} bytes")

    def _frame(self, buf, pos: int, end: int, ver: int, typ: int):
        """One D (v1) or J (v2) frame at ``pos``: (event, end) or None if incomplete."""
        if typ == T_JSON:
            if ver != V2 or self.version != 2:
                raise LumberjackError("unexpected_json", "JSON frame in a v1 window")
            if end - pos < 10:
                return None
            _seq, n = _u32x2(buf, pos + 2)
            if n > self.max_event_bytes:
                raise LumberjackError("event_too_large",
                                      f"JSON frame of {n} bytes > {self.max_event_bytes}")
            if end - pos - 10 < n:
                return None
            return bytes(buf[pos + 10:pos + 10 + n]), pos + 10 + n
        if ver != V1 or self.version != 1:
            raise LumberjackError("unexpected_data", "data frame in a v2 window")
        if end - pos < 10:
            return None
        _seq, npairs = _u32x2(buf, pos + 2)
        p = pos + 10
        limit = self.max_event_bytes
        keys = self._keys
        fields: dict[str, str] = {}
        for _ in range(npairs):
            if end - p < 4:
                return self._incomplete(p - pos)
            (klen,) = _u32(buf, p)
            if p - pos + klen > limit:
                raise LumberjackError("event_too_large", f"data frame > {limit} bytes")
            p += 4
            if end - p < klen + 4:
                return self._incomplete(p - pos + klen)
            kb = bytes(buf[p:p + klen])
            k = keys.get(kb)
            if k is None:
                k = kb.decode("utf-8", "surrogateescape")
                if len(keys) < _MAX_KEYS:
                    keys[kb] = k
            p += klen
            (vlen,) = _u32(buf, p)
            p += 4
            if p - pos + vlen > limit:
                raise LumberjackError("event_too_large", f"data frame > {limit} bytes")
            if end - p < vlen:
                return None
            fields[k] = buf[p:p + vlen].decode("utf-8", "surrogateescape")
            p += vlen
        return fields, p

    def _incomplete(self, needed: int):
        if needed > self.max_event_bytes:
            raise LumberjackError("event_too_large", f"data frame > {self.max_event_bytes} bytes")
        return None

    def _inflate_raw(self, buf, start: int, n: int, limit: int) -> bytes:
        """Inflate ``buf[start:start + n]`` with :func:`logjam_relay.limits.inflate_bounded`:
        never past ``limit`` nor past what is left of the budget (``input_memory``)."""
        if not n:
            raise LumberjackError("zlib_error", "empty compressed frame")
        room = self.budget.available
        err = None
        with memoryview(buf) as mv, mv[start:start + n] as payload:
            try:
                return inflate_bounded("zlib", payload, min(limit, max(room, 0)))
            except EventTooLarge:
                err = (("input_memory", "the input's connections hold max_held_bytes")
                       if room < limit else
                       ("inflate_too_large", "compressed frame inflates beyond the window "
                        f"budget ({self.max_window_bytes} bytes)"))
            except BadBody as e:
                err = ("zlib_error", str(e))
        raise LumberjackError(*err)     # outside the except: no reference to the output

    def _inflate(self, src, start: int, n: int, depth: int) -> None:
        if depth > _MAX_NESTING:
            raise LumberjackError("nesting", "compressed frames nested too deeply")
        data = self._inflate_raw(src, start, n, self.max_window_bytes - self._wbytes)
        self._add_bytes(len(data))
        self._charge(len(data))         # while it is parsed
        try:
            self._parse_inflated(data, depth)
        finally:
            self._charged -= len(data)
            self.budget.give(len(data))

    def _parse_inflated(self, data: bytes, depth: int) -> None:
        pos, end = 0, len(data)
        while pos < end:
            if end - pos < 2:
                raise LumberjackError("truncated", "partial frame inside compressed frame")
            ver, typ = data[pos], data[pos + 1]
            if ver != V1 and ver != V2:
                raise LumberjackError("bad_version", f"version byte {ver:#x} in a C frame")
            if typ == T_COMPRESSED:
                if end - pos < 6:
                    raise LumberjackError("truncated", "partial frame inside compressed frame")
                (n,) = _u32(data, pos + 2)
                if end - pos - 6 < n:
                    raise LumberjackError("truncated", "partial frame inside compressed frame")
                self._inflate(data, pos + 6, n, depth + 1)
                pos += 6 + n
                continue
            if typ != T_DATA and typ != T_JSON:
                raise LumberjackError("unexpected_window" if typ == T_WINDOW
                                      else "unknown_frame_type",
                                      f"frame type {typ} inside a compressed frame")
            r = self._frame(data, pos, end, ver, typ)
            if r is None:
                raise LumberjackError("truncated", "partial frame inside compressed frame")
            ev, nxt = r
            self._charge(event_cost(nxt - pos, len(ev) if typ == T_DATA else 0))
            pos = nxt
            self._events.append(ev)


# ------------------------------------------------------------------- v2 encoding
# (the writer side of v2, as Beats sends it; used by tests and the benchmark)

def encode_json_frame(seq: int, doc: bytes) -> bytes:
    return b"2J" + _U32x2.pack(seq & 0xFFFFFFFF, len(doc)) + doc


def encode_window_v2(docs: list[bytes], level: int = 3) -> bytes:
    """``2W n`` + the n JSON frames (seq 1..n), in one ``2C`` frame unless ``level`` is 0."""
    frames = b"".join(encode_json_frame(i + 1, d) for i, d in enumerate(docs))
    head = b"2W" + _U32.pack(len(docs))
    if level <= 0:
        return head + frames
    c = zlib.compressobj(level)
    payload = c.compress(frames) + c.flush()
    return head + b"2C" + _U32.pack(len(payload)) + payload
