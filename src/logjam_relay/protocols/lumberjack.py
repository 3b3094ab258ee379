"""Lumberjack protocol v1, sans-IO.

Bytes in, events out; events in, bytes out.  No sockets, no trio, no clock reads.

Wire format (``shared/specs/lumberjack-v1.md``): every frame starts with a version
byte ``'1'`` and a type byte:

* ``1W <u32 n>``                 window size (writer -> reader)
* ``1D <u32 seq> <u32 pairs> (<u32 len> key <u32 len> value)*``   data (writer -> reader)
* ``1C <u32 len> <zlib stream of frames>``                      compressed (writer -> reader)
* ``1A <u32 seq>``               ack (reader -> writer)

What the real peers do (``shared/specs/reference/lumberjack-v1.md``) and what this
module therefore does:

* The **reader** role behaves like go-lumber: a window must start with an uncompressed
  ``1W``; then exactly ``n`` events follow as ``1D`` frames and/or ``1C`` frames (the
  inflated payload of a ``1C`` is a frame stream again; nested ``1C`` are allowed, ``1W``
  inside a window is not).  A ``1C`` that ends before the window is full is an error
  ("window split over two C frames"); events in a ``1C`` beyond the window are silently
  dropped (and counted).  ``W 0`` is ignored, ``W > max_window`` (10000) is an error.
  Sequence numbers are not checked.  The ACK a reader should send is the event count
  (:attr:`WindowComplete.count`).  Any error raises :class:`LumberjackError`; the I/O
  layer closes the connection (go-lumber never sends an error frame).
* The **writer** role decodes ``A`` frames.  An ``A`` with value 0 (Logstash's Java input
  sends ``2A 0`` keep-alives, with protocol byte ``2`` even on v1 connections) becomes
  :class:`KeepAlive`; other ``1A``/``2A`` become :class:`Ack`.

Encoding helpers build whole windows efficiently (:func:`encode_window`); a window
restarts its sequence at 1 so that every known reader's ACK (go-lumber: count,
jls-lumberjack: last seq, Java beats: highest seq) equals the window size.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .deflate import zlib_compress

__all__ = [
    "LumberjackError", "Role", "Connection", "NEED_DATA",
    "Window", "Data", "WindowComplete", "Ack", "KeepAlive", "ConnectionClosed",
    "encode_window_frame", "encode_data_frame", "encode_data_frames", "encode_ack",
    "encode_compressed_frame", "encode_window", "ack_completes",
    "MAX_WINDOW", "MAX_FRAME",
]

#: go-lumber v0.2.0 MaxWindowSize default.
MAX_WINDOW = 10_000
#: Refuse frames (a D frame, a C payload, or the inflated C payload) larger than this.
MAX_FRAME = 64 * 1024 * 1024

_U32 = struct.Struct(">I")
_HDR_W = struct.Struct(">2sI")        # b"1W", n
_HDR_D = struct.Struct(">2sII")       # b"1D", seq, pairs
_U32x2 = struct.Struct(">II")
_u32_pack = _U32.pack
_u32_unpack_from = _U32.unpack_from

V1 = 0x31  # '1'
V2 = 0x32  # '2'
T_WINDOW = 0x57      # 'W'
T_DATA = 0x44        # 'D'
T_COMPRESSED = 0x43  # 'C'
T_ACK = 0x41         # 'A'


class LumberjackError(Exception):
    """A protocol violation. ``reason`` is a short metric label, the message is for humans."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(message or reason)
        self.reason = reason


# ------------------------------------------------------------------------ events


@dataclass(frozen=True, slots=True)
class Window:
    """``1W n``: the writer announces a window of ``size`` events."""

    size: int


@dataclass(frozen=True, slots=True)
class Data:
    """One event: ``fields`` maps key to value (UTF-8, undecodable bytes kept as surrogates)."""

    seq: int
    fields: dict[str, str]


@dataclass(frozen=True, slots=True)
class WindowComplete:
    """All ``count`` events of the current window arrived (reader role).

    ``count`` is what go-lumber acknowledges; ``last_seq`` is what jls-lumberjack would;
    ``dropped`` counts events of a trailing ``C`` frame beyond the window (discarded).
    """

    count: int
    last_seq: int
    dropped: int = 0


@dataclass(frozen=True, slots=True)
class Ack:
    """``1A seq`` (or ``2A seq``): everything of the window up to ``seq`` is acknowledged."""

    seq: int
    version: int = 1


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """An ``A`` frame with value 0 (Logstash beats input keep-alive, ``2A 0``)."""

    version: int = 2


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """The peer closed the stream cleanly at a frame/window boundary."""


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


#: Returned by :meth:`Connection.next_event` when more bytes are needed.
NEED_DATA = _NeedData()


class Role(enum.Enum):
    READER = "reader"   # server side: receives W/D/C, sends A
    WRITER = "writer"   # client side: sends W/D/C, receives A


# ---------------------------------------------------------------------- encoding


def _pair(key: bytes, value: bytes) -> bytes:
    return _u32_pack(len(key)) + key + _u32_pack(len(value)) + value


def _as_bytes(s: str | bytes) -> bytes:
    return s.encode("utf-8", "surrogateescape") if isinstance(s, str) else s


def encode_window_frame(size: int) -> bytes:
    if not 0 <= size <= 0xFFFFFFFF:
        raise ValueError(f"window size {size} out of range")
    return _HDR_W.pack(b"1W", size)


def encode_ack(seq: int, version: int = 1) -> bytes:
    return bytes((V1 if version == 1 else V2, T_ACK)) + _u32_pack(seq)


def encode_data_frame(seq: int, pairs: Iterable[tuple[str | bytes, str | bytes]]) -> bytes:
    """One ``1D`` frame; ``pairs`` is a mapping's ``items()`` or a list of (key, value)."""
    body = []
    n = 0
    for k, v in pairs:
        body.append(_pair(_as_bytes(k), _as_bytes(v)))
        n += 1
    return _HDR_D.pack(b"1D", seq & 0xFFFFFFFF, n) + b"".join(body)


def encode_data_frames(events: Sequence[dict | Sequence[tuple]], first_seq: int = 1) -> bytes:
    """Consecutive ``1D`` frames with sequence numbers ``first_seq, first_seq+1, ...``."""
    return b"".join(
        encode_data_frame(first_seq + i, ev.items() if isinstance(ev, dict) else ev)
        for i, ev in enumerate(events))


def encode_compressed_frame(frames: bytes, level: int = 3) -> bytes:
    """One ``1C`` frame holding ``frames`` (already-encoded frames), zlib at ``level``."""
    payload = zlib_compress(frames, level)
    return b"1C" + _u32_pack(len(payload)) + payload


def encode_window(data_frames: bytes, count: int, level: int = 0) -> bytes:
    """A whole window: ``1W count`` then the frames plain (level 0) or as ONE ``1C`` frame.

    ``data_frames`` must hold exactly ``count`` ``1D`` frames (sequence 1..count).
    """
    if not 1 <= count <= 0xFFFFFFFF:
        raise ValueError(f"window of {count} events")
    if level <= 0:
        return _HDR_W.pack(b"1W", count) + data_frames
    payload = zlib_compress(data_frames, level)
    return b"".join((_HDR_W.pack(b"1W", count), b"1C", _u32_pack(len(payload)), payload))


def ack_completes(ack: int, first_seq: int, count: int) -> bool:
    """Does ACK value ``ack`` acknowledge the whole window ``first_seq .. first_seq+count-1``?

    go-lumber acks the count, jls-lumberjack and the Java beats input the last sequence.
    """
    return ack == count or ack == ((first_seq + count - 1) & 0xFFFFFFFF)


# ---------------------------------------------------------------------- decoding


class Connection:
    """State machine of one Lumberjack v1 connection, seen from ``role``.

    Feed received bytes with :meth:`receive_data` (``b""`` = end of stream) and pull
    events with :meth:`next_event` until it returns :data:`NEED_DATA`.  Build outgoing
    bytes with :meth:`send` (or the module-level ``encode_*`` helpers).

    Reader role events: :class:`Window`, :class:`Data`..., :class:`WindowComplete`,
    :class:`ConnectionClosed`.  Writer role events: :class:`Ack`, :class:`KeepAlive`,
    :class:`ConnectionClosed`.  After a :class:`LumberjackError` the connection is dead.
    """

    def __init__(self, role: Role, *, max_window: int = MAX_WINDOW, max_frame: int = MAX_FRAME):
        self.role = role
        self.max_window = max_window
        self.max_frame = max_frame
        self._buf = bytearray()
        self._pos = 0
        self._eof = False
        self._closed_emitted = False
        self._error: LumberjackError | None = None
        self._pending: deque = deque()
        # reader window state
        self._remaining = 0       # events still expected in the current window
        self._count = 0           # size of the current window (0 = between windows)
        self._last_seq = 0
        #: bytes consumed from the stream so far (frame boundaries; for proxies and stats)
        self.consumed = 0
        self.dropped_events = 0

    # -- state --------------------------------------------------------------

    @property
    def in_window(self) -> bool:
        """True between a window's ``W`` and its last event (go-lumber's deadline runs)."""
        return self._count > 0

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    # -- input --------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        if self._eof:
            if data:
                raise RuntimeError("receive_data after end of stream")
            return
        if not data:
            self._eof = True
            return
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif self._pos > 65536 and self._pos * 2 > len(self._buf):
            del self._buf[:self._pos]
            self._pos = 0
        self._buf += data

    def next_event(self):
        if self._error is not None:
            raise self._error
        try:
            return self._next_event()
        except LumberjackError as e:
            self._error = e
            raise

    def _next_event(self):
        if self._pending:
            return self._pending.popleft()
        ev = self._parse_reader() if self.role is Role.READER else self._parse_writer()
        if ev is not NEED_DATA:
            return ev
        if self._eof:
            if self.buffered:
                raise LumberjackError("truncated", f"end of stream inside a frame "
                                      f"({self.buffered} bytes left)")
            if self._count:
                raise LumberjackError("truncated", f"end of stream inside a window "
                                      f"({self._remaining} of {self._count} events missing)")
            if self._closed_emitted:
                return NEED_DATA
            self._closed_emitted = True
            return ConnectionClosed()
        return NEED_DATA

    # -- writer role: ACK frames ----------------------------------------------

    def _parse_writer(self):
        buf, pos = self._buf, self._pos
        if len(buf) - pos < 2:
            return NEED_DATA
        ver, typ = buf[pos], buf[pos + 1]
        if ver not in (V1, V2):
            raise LumberjackError("bad_version", f"unsupported protocol version byte {ver:#x}")
        if typ != T_ACK:
            raise LumberjackError("unknown_frame_type", f"unexpected frame type {typ} from reader")
        if len(buf) - pos < 6:
            return NEED_DATA
        (seq,) = _u32_unpack_from(buf, pos + 2)
        self._pos = pos + 6
        self.consumed += 6
        version = 1 if ver == V1 else 2
        if seq == 0:
            return KeepAlive(version)
        return Ack(seq, version)

    # -- reader role: W / D / C ------------------------------------------------

    def _parse_reader(self):
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if avail < 2:
            return NEED_DATA
        ver, typ = buf[pos], buf[pos + 1]
        if ver != V1:
            raise LumberjackError("bad_version", f"protocol version byte {ver:#x}, expected '1'")
        if self._count == 0:
            if typ != T_WINDOW:
                raise LumberjackError("expected_window",
                                      f"expected window frame, received {[ver, typ]}")
            if avail < 6:
                return NEED_DATA
            (n,) = _u32_unpack_from(buf, pos + 2)
            self._pos = pos + 6
            self.consumed += 6
            if n > self.max_window:
                raise LumberjackError("window_too_large",
                                      f"window size {n} exceeds maximum {self.max_window}")
            if n == 0:          # go-lumber: accepted and ignored, no ACK
                return self._parse_reader()
            self._count = self._remaining = n
            self._last_seq = 0
            return Window(n)
        if typ == T_DATA:
            r = _parse_data(buf, pos, len(buf), self.max_frame)
            if r is None:
                return NEED_DATA
            ev, end = r
            self.consumed += end - pos
            self._pos = end
            self._last_seq = ev.seq
            self._remaining -= 1
            if self._remaining == 0:
                self._pending.append(self._complete(0))
            return ev
        if typ == T_COMPRESSED:
            if avail < 6:
                return NEED_DATA
            (n,) = _u32_unpack_from(buf, pos + 2)
            if n > self.max_frame:
                raise LumberjackError("frame_too_large", f"compressed frame of {n} bytes")
            if avail < 6 + n:
                return NEED_DATA
            payload = bytes(buf[pos + 6:pos + 6 + n])
            self._pos = pos + 6 + n
            self.consumed += 6 + n
            events, dropped = self._read_compressed(payload, self._remaining)
            self._remaining = 0
            self._pending.extend(events[1:])
            self._pending.append(self._complete(dropped))
            return events[0]
        if typ == T_WINDOW:
            raise LumberjackError("unexpected_window",
                                  f"window frame in mid-window ({self._remaining} of "
                                  f"{self._count} events missing); unknown frame type: 87")
        raise LumberjackError("unknown_frame_type", f"unknown frame type: {typ}")

    def _complete(self, dropped: int) -> WindowComplete:
        wc = WindowComplete(self._count, self._last_seq, dropped)
        self._count = self._remaining = 0
        self.dropped_events += dropped
        return wc

    def _read_compressed(self, payload: bytes, want: int,
                         partial_ok: bool = False) -> tuple[list[Data], int]:
        """Events of one C payload; up to ``want`` are returned, extras are counted.

        Fewer than ``want`` is an error unless ``partial_ok`` (a C nested in a C).
        """
        if not payload:
            raise LumberjackError("zlib_error", "zlib: empty compressed frame (unexpected EOF)")
        d = zlib.decompressobj()
        try:
            data = d.decompress(payload, self.max_frame)
        except zlib.error as e:
            raise LumberjackError("zlib_error", f"zlib: {e}") from None
        if d.unconsumed_tail:
            raise LumberjackError("frame_too_large", "inflated compressed frame too large")
        if not d.eof:
            raise LumberjackError("zlib_error", "zlib: unexpected EOF (truncated stream)")
        events: list[Data] = []
        dropped = self._parse_inner(data, want, events, partial_ok)
        if events:
            self._last_seq = events[-1].seq
        return events, dropped

    def _parse_inner(self, data: bytes, want: int, events: list, partial_ok: bool) -> int:
        """Parse an inflated frame stream into ``events`` until ``want`` are there."""
        pos, end = 0, len(data)
        dropped = 0
        while pos < end:
            if end - pos < 2:
                raise LumberjackError("truncated", "partial frame inside compressed frame")
            ver, typ = data[pos], data[pos + 1]
            if ver != V1:
                raise LumberjackError("bad_version",
                                      f"protocol version byte {ver:#x} inside compressed frame")
            if typ == T_DATA:
                r = _parse_data(data, pos, end, self.max_frame)
                if r is None:
                    raise LumberjackError("truncated", "partial data frame inside compressed frame")
                ev, pos = r
                if len(events) < want:
                    events.append(ev)
                else:
                    dropped += 1
            elif typ == T_COMPRESSED:
                if end - pos < 6:
                    raise LumberjackError("truncated", "partial frame inside compressed frame")
                (n,) = _u32_unpack_from(data, pos + 2)
                if end - pos - 6 < n:
                    raise LumberjackError("truncated", "partial frame inside compressed frame")
                inner, extra = self._read_compressed(bytes(data[pos + 6:pos + 6 + n]),
                                                     want - len(events), partial_ok=True)
                events.extend(inner)
                dropped += extra
                pos += 6 + n
            elif typ == T_WINDOW:
                raise LumberjackError("unexpected_window",
                                      "window frame inside compressed frame; "
                                      "unknown frame type: 87")
            else:
                raise LumberjackError("unknown_frame_type", f"unknown frame type: {typ}")
        if len(events) < want and not partial_ok:
            raise LumberjackError("window_split",
                                  f"compressed frame ended after {len(events)} of {want} "
                                  "remaining events (window split over several C frames?)")
        return dropped

    # -- output -------------------------------------------------------------

    def send(self, event) -> bytes:
        if self.role is Role.READER:
            if isinstance(event, Ack):
                return encode_ack(event.seq, event.version)
            if isinstance(event, KeepAlive):
                return encode_ack(0, event.version)
        else:
            if isinstance(event, Window):
                return encode_window_frame(event.size)
            if isinstance(event, Data):
                return encode_data_frame(event.seq, event.fields.items())
        raise TypeError(f"a {self.role.value} cannot send {event!r}")


def _parse_data(buf, pos: int, end: int, max_frame: int):
    """Parse one ``1D`` frame at ``pos``; (Data, new_pos) or None when incomplete."""
    if end - pos < 10:
        return None
    seq, npairs = _U32x2.unpack_from(buf, pos + 2)
    p = pos + 10
    fields: dict[str, str] = {}
    unpack = _u32_unpack_from
    for _ in range(npairs):
        if end - p < 4:
            return _incomplete(p - pos, max_frame)
        (klen,) = unpack(buf, p)
        p += 4
        if end - p < klen + 4:
            return _incomplete(p - pos + klen, max_frame)
        k = buf[p:p + klen].decode("utf-8", "surrogateescape")
        p += klen
        (vlen,) = unpack(buf, p)
        p += 4
        if end - p < vlen:
            return _incomplete(p - pos + vlen, max_frame)
        fields[k] = buf[p:p + vlen].decode("utf-8", "surrogateescape")
        p += vlen
    return Data(seq, fields), p


def _incomplete(needed: int, max_frame: int):
    if needed > max_frame:
        raise LumberjackError("frame_too_large", f"data frame larger than {max_frame} bytes")
    return None
