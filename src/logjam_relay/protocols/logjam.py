"""The logjam producer protocol, sans-IO.

Frames in, decisions out: no sockets, no trio, no clock reads.  Everything
here follows what the real logjam-device was *measured* to do
(``shared/specs/reference/logjam-device.md``); where that is plainly a bug the
difference is named in the docstring and in ``docs/logjam-protocol.md``.

The relay's hot path uses :class:`Validator` (cached stream/topic checks) and
the module-level ``META``/``pack_meta`` helpers directly; :func:`classify_router`
and :func:`classify_pull` are the complete, event-returning classification
used for everything off the fast path and by the tests.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import lz4.block
import snappy

from ..limits import BadBody, EventTooLarge, inflate_bounded

# --------------------------------------------------------------------------- meta

META_SIZE = 24
META_TAG = 0xCABD
META_TAG_SWAPPED = 0xBDCA
META_VERSION = 1
_META = struct.Struct(">HBBIQQ")
pack_meta = _META.pack
unpack_meta = _META.unpack
_TAG_OK = (b"\xca\xbd", b"\xbd\xca")

NO_COMPRESSION = 0
ZLIB_COMPRESSION = 1
SNAPPY_COMPRESSION = 2
LZ4_COMPRESSION = 3
COMPRESSION_NAMES = {0: "none", 1: "zlib", 2: "snappy", 3: "lz4"}
COMPRESSION_BY_NAME = {"none": 0, "zlib": 1, "snappy": 2, "lz4": 3}

ACCEPTED = b"202 Accepted"
BAD_REQUEST = b"400 Bad Request"
PONG = b"200 OK"
PING = b"ping"
UNKNOWN_APP_ENV = b"unknown-unknown"
HEARTBEAT = b"heartbeat"
STATS = b"stats"
EMPTY_JSON = b"{}"


class Meta(NamedTuple):
    compression: int
    version: int
    device: int
    created_ms: int
    sequence: int


class LogjamError(ValueError):
    """A message that does not follow the protocol. ``reason`` is a metric label."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(message or reason)
        self.reason = reason


def meta_problem(frame: bytes) -> str | None:
    """Why a meta frame is not acceptable, or None when it is.

    Accepted iff 24 bytes, tag CABD or byte-swapped BDCA, version 1; the
    compression byte is not checked (as logjam-device).
    """
    if len(frame) != META_SIZE:
        return "meta_size"
    if frame[:2] not in _TAG_OK:
        return "meta_tag"
    if frame[3] != META_VERSION:
        return "meta_version"
    return None


def decode_meta(frame: bytes) -> Meta:
    """Decode a meta frame; raises :class:`LogjamError` when it is not acceptable.

    A byte-swapped tag means the *tag* was written little-endian by a buggy
    client; the remaining fields are still read big-endian, as the device does.
    """
    problem = meta_problem(frame)
    if problem:
        raise LogjamError(problem, f"broken meta frame ({problem})")
    _tag, comp, ver, dev, created, seq = unpack_meta(frame)
    return Meta(comp, ver, dev, created, seq)


def encode_meta(compression: int, device: int, created_ms: int, sequence: int) -> bytes:
    return pack_meta(META_TAG, compression, META_VERSION, device, created_ms, sequence)


# ---------------------------------------------------------------- stream/topic

_TOPIC_PREFIXES = (b"logs", b"javascript", b"events", b"frontend.page", b"frontend.ajax",
                   b"mobile")
_CTRL = bytes(range(32))


def valid_stream_name(app_env: bytes) -> bool:
    """As measured: every byte in 32..127 and at least one ``-``."""
    return (b"-" in app_env and app_env.isascii()
            and len(app_env.translate(None, _CTRL)) == len(app_env))


def valid_topic(topic: bytes) -> bool:
    """As measured: prefix-only check (``logsfoo`` passes, ``foo.bar`` does not)."""
    return topic.startswith(_TOPIC_PREFIXES)


def split_app_env(app_env: bytes | str) -> tuple[str, str]:
    """``my-app-production`` -> (``my-app``, ``production``): split at the last ``-``."""
    s = app_env.decode("utf-8", "replace") if isinstance(app_env, bytes) else app_env
    app, sep, env = s.rpartition("-")
    if not sep:
        return s, ""
    return app, env


class Validator:
    """Stream-name and topic validation with bounded caches.

    A deployment sees a few hundred distinct streams and topics; caching the
    verdict keeps the per-message cost at one set lookup each.
    """

    __slots__ = ("good_streams", "good_topics", "max_entries")

    def __init__(self, max_entries: int = 100_000):
        self.good_streams: set[bytes] = set()
        self.good_topics: set[bytes] = set()
        self.max_entries = max_entries

    def data_problem(self, app_env: bytes, topic: bytes) -> str | None:
        if app_env not in self.good_streams:
            if not valid_stream_name(app_env):
                return "stream_name"
            if len(self.good_streams) >= self.max_entries:
                self.good_streams.clear()
            self.good_streams.add(app_env)
        if topic not in self.good_topics:
            if not valid_topic(topic):
                return "topic"
            if len(self.good_topics) >= self.max_entries:
                self.good_topics.clear()
            self.good_topics.add(topic)
        return None


# -------------------------------------------------------------- classification

@dataclass(frozen=True, slots=True)
class Data:
    """A valid data message to stamp and publish.

    ``meta`` is None for legacy 3-frame messages (and for broken meta accepted
    with ``--allow-invalid-meta``): the device then creates a fresh meta with
    compression 0 and its own clock.
    """

    app_env: bytes
    topic: bytes
    body: bytes
    meta: Meta | None
    reply: list[bytes] | None = None   # reply frames (without routing id) or None


@dataclass(frozen=True, slots=True)
class Ping:
    valid: bool
    app_env: bytes | None               # the stream named in the ping, for counting
    reply: list[bytes] | None


@dataclass(frozen=True, slots=True)
class Invalid:
    reason: str
    app_env: bytes | None
    reply: list[bytes] | None


Event = Data | Ping | Invalid


def accepted_reply(app_env: bytes) -> list[bytes]:
    return [app_env, ACCEPTED]


def bad_request_reply(first: bytes | None) -> list[bytes]:
    return [first if first is not None else UNKNOWN_APP_ENV, BAD_REQUEST]


def pong_reply(fqdn: bytes) -> list[bytes]:
    return [PING, PONG, fqdn]


def _check_data(frames: list[bytes], validator: Validator | None,
                allow_invalid_meta: bool) -> tuple[str | None, Meta | None]:
    app_env, topic, _body = frames[0], frames[1], frames[2]
    v = validator or Validator()
    problem = v.data_problem(app_env, topic)
    if problem:
        return problem, None
    if len(frames) == 3:
        return None, None
    mp = meta_problem(frames[3])
    if mp:
        return (None, None) if allow_invalid_meta else (mp, None)
    _t, comp, ver, dev, created, seq = unpack_meta(frames[3])
    return None, Meta(comp, ver, dev, created, seq)


def classify_router(frames: list[bytes], fqdn: bytes, *, validator: Validator | None = None,
                    allow_invalid_meta: bool = False) -> Event:
    """Classify the frames a ROUTER received *after* the routing id.

    Reproduces the reference table: a reply is due iff the first frame is
    empty; the reply's frame 0 echoes the first frame after the empty one
    (``ping`` for pings, ``unknown-unknown`` when absent).  One deliberate
    difference: a request with an invalid topic is answered ``400 Bad
    Request`` (logjam-device answers 202 and then drops it).
    """
    if not frames:
        return Invalid("frame_count", None, None)
    wants_reply = frames[0] == b""
    body = frames[1:] if wants_reply else frames
    first = body[0] if body else None

    if first == PING:
        app_env = body[1] if len(body) > 1 else None
        ok = len(body) == 4 and meta_problem(body[3]) is None
        reply = None
        if wants_reply:
            reply = pong_reply(fqdn) if ok else bad_request_reply(PING)
        return Ping(ok, app_env, reply)

    n = len(body)
    if n != 4:
        # ROUTER requests must carry exactly four frames (no legacy 3-frame form).
        return Invalid("frame_count", first,
                       bad_request_reply(first) if wants_reply else None)
    problem, meta = _check_data(body, validator, allow_invalid_meta)
    if problem:
        return Invalid(problem, first, bad_request_reply(first) if wants_reply else None)
    return Data(body[0], body[1], body[2], meta, accepted_reply(body[0]) if wants_reply else None)


def classify_pull(frames: list[bytes], *, validator: Validator | None = None,
                  allow_invalid_meta: bool = False) -> Event:
    """Classify a PULL message: 4 frames, or the legacy 3 frames without meta."""
    n = len(frames)
    if n not in (3, 4):
        return Invalid("frame_count", frames[0] if frames else None, None)
    problem, meta = _check_data(frames, validator, allow_invalid_meta)
    if problem:
        return Invalid(problem, frames[0], None)
    return Data(frames[0], frames[1], frames[2], meta, None)


# --------------------------------------------------------- device-side frames

def heartbeat_frames(fqdn: str, pub_port: int, device: int, now_ms: int,
                     sequence: int) -> list[bytes]:
    return [HEARTBEAT, f"tcp://{fqdn}:{pub_port}".encode(), EMPTY_JSON,
            encode_meta(NO_COMPRESSION, device, now_ms, sequence)]


def restart_marker_frames(fqdn: str, pub_port: int, device: int, now_ms: int, sequence: int,
                          skipped_from: int, skipped_to: int) -> list[bytes]:
    """A heartbeat-shaped record that says the numbers ``skipped_from..skipped_to`` were
    reserved before a crash and never spooled (spooled, never published:
    docs/spool-format.md, "Restart marker")."""
    body = b'{"restart":{"skipped_from":%d,"skipped_to":%d}}' % (skipped_from, skipped_to)
    return [HEARTBEAT, f"tcp://{fqdn}:{pub_port}".encode(), body,
            encode_meta(NO_COMPRESSION, device, now_ms, sequence)]


def stats_frames(device: int, last_sequence: int) -> list[bytes]:
    return [STATS, str(device).encode(), str(last_sequence).encode()]


# ------------------------------------------------------------------ body codecs

_LEN = struct.Struct(">I")


def compress(body: bytes, method: int) -> bytes:
    """Compress a body in the exact logjam format of ``method``."""
    if method == ZLIB_COMPRESSION:
        return zlib.compress(body)
    if method == SNAPPY_COMPRESSION:
        return snappy.compress(body)
    if method == LZ4_COMPRESSION:
        return _LEN.pack(len(body)) + lz4.block.compress(body, store_size=False)
    if method == NO_COMPRESSION:
        return body
    raise LogjamError("compression", f"unknown compression method {method}")


#: Refuse to inflate a body past this size (a hostile length prefix or a zip bomb).
MAX_DECOMPRESSED = 64 * 1024 * 1024


def decompress(body: bytes, method: int, max_size: int = MAX_DECOMPRESSED) -> bytes:
    """Decompress a body; raises :class:`LogjamError` ('decompress') on any failure.

    The relay has one bounded decompressor, :func:`logjam_relay.limits.inflate_bounded`
    (nothing past ``max_size`` is ever inflated); this is its logjam-protocol face.
    """
    if method == NO_COMPRESSION:
        return body
    if method not in COMPRESSION_NAMES:
        raise LogjamError("compression", f"unknown compression method {method}")
    try:
        return inflate_bounded(method, body, max_size)
    except (EventTooLarge, BadBody) as e:
        raise LogjamError("decompress", f"{COMPRESSION_NAMES[method]}: {e}") from None
