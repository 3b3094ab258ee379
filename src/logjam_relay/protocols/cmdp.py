"""Sans-IO core of CMDP/1, the Constellation Monitoring Distribution Protocol.

Wire format (what ConstellationDAQ 1.0.2 sends and accepts, see
``/work/shared/specs/reference/cmdp.md`` and ``docs/cmdp.md``):

* three ZeroMQ frames: topic, header, payload;
* topic: raw upper-case ASCII: ``STAT/<NAME>``, ``LOG/<LEVEL>[/<COMPONENT>]``,
  ``STAT?`` or ``LOG?`` (notifications);
* header: **four msgpack objects back to back** (not an array): str ``"CMDP\\x01"``,
  str sender, msgpack timestamp extension (type -1, smallest form), str-keyed map;
* STAT payload: three msgpack objects back to back: value, a small int, unit (str).
  The draft spec calls the middle object the *metric type* (1 LAST_VALUE,
  2 ACCUMULATE, 3 AVERAGE, 4 RATE); ConstellationDAQ 1.0.2 always writes 0 there
  ("reserved flags") and its decoders accept any small int.  We keep the type in the
  API and put it on the wire only when asked to (``wire_metric_type=True``);
* LOG payload: raw UTF-8 text (not msgpack);
* notification payload: one msgpack map ``{bare upper-case name: description}``.

No sockets, no clock reads: timestamps are passed in as nanoseconds since the epoch.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_ID = "CMDP\x01"
_PROTOCOL_ID_PACKED = b"\xa5CMDP\x01"


class CMDPError(Exception):
    """A malformed CMDP message.  ``reason`` is short and machine-readable (a metric label)."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class MetricType(enum.IntEnum):
    """The draft spec's metric types (informational in ConstellationDAQ >= 0.7)."""

    LAST_VALUE = 1
    ACCUMULATE = 2
    AVERAGE = 3
    RATE = 4


_METRIC_TYPES = {m.value: m for m in MetricType}


class LogLevel(enum.IntEnum):
    """CMDP log levels, valued like ConstellationDAQ's (Python logging numbers)."""

    TRACE = 5
    DEBUG = 10
    INFO = 20
    WARNING = 30
    STATUS = 35
    CRITICAL = 50


def level_from_levelno(levelno: int) -> LogLevel:
    """Map a Python ``logging`` level number to a CMDP level (ERROR -> CRITICAL)."""
    if levelno >= 40:
        return LogLevel.CRITICAL
    if levelno >= 35:
        return LogLevel.STATUS
    if levelno >= 30:
        return LogLevel.WARNING
    if levelno >= 20:
        return LogLevel.INFO
    if levelno >= 10:
        return LogLevel.DEBUG
    return LogLevel.TRACE


# Topic names: the spec says upper-case letters, digits and slashes; everybody also
# uses underscores.  We only *produce* names matching this; we accept what upstream does.
_NAME_OK = re.compile(r"[A-Z0-9_]+(?:/[A-Z0-9_]+)*\Z")
_NAME_BAD_CHARS = re.compile(r"[^A-Z0-9_/]+")


def sanitize_name(name: str) -> str:
    """Upper-case ``name`` and replace anything outside ``[A-Z0-9_/]`` by ``_``."""
    out = _NAME_BAD_CHARS.sub("_", name.upper()).strip("_/")
    return out or "_"


def check_name(name: str) -> str:
    if not _NAME_OK.match(name):
        raise ValueError(f"invalid CMDP topic name {name!r} (want [A-Z0-9_] parts separated by /)")
    return name


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class StatMessage:
    sender: str
    time_ns: int
    name: str
    value: Any
    unit: str
    metric_type: MetricType | None = None  # None: 0 on the wire (ConstellationDAQ >= 0.7)
    tags: Mapping[str, Any] = field(default_factory=dict)

    @property
    def topic(self) -> str:
        return "STAT/" + self.name


@dataclass(frozen=True, slots=True)
class LogMessage:
    sender: str
    time_ns: int
    level: LogLevel
    component: str  # "" for no component
    text: str
    tags: Mapping[str, Any] = field(default_factory=dict)

    @property
    def topic(self) -> str:
        t = "LOG/" + self.level.name
        return t + "/" + self.component if self.component else t


@dataclass(frozen=True, slots=True)
class Notification:
    """Answer to a ``STAT?`` / ``LOG?`` subscription: the topics on offer."""

    sender: str
    time_ns: int
    kind: str  # "STAT" or "LOG"
    topics: Mapping[str, str]
    tags: Mapping[str, Any] = field(default_factory=dict)

    @property
    def topic(self) -> str:
        return self.kind + "?"


CMDPMessage = StatMessage | LogMessage | Notification

# --------------------------------------------------------------------------- encoding


def _pack(obj: Any) -> bytes:
    # use_bin_type: bytes -> bin, str -> str (never the old raw type)
    return msgpack.packb(obj, use_bin_type=True, datetime=False)


def encode_header(sender: str, time_ns: int, tags: Mapping[str, Any] | None = None) -> bytes:
    # Timestamp.to_bytes() picks the smallest of timestamp32/64/96, as upstream does.
    ts = msgpack.Timestamp.from_unix_nano(time_ns)
    if tags:
        for k in tags:
            if not isinstance(k, str):
                raise TypeError(f"CMDP tag keys must be str, got {k!r}")
        tags_b = _pack(dict(tags))
    else:
        tags_b = b"\x80"
    return _PROTOCOL_ID_PACKED + _pack(sender) + _pack(ts) + tags_b


def encode_stat_payload(value: Any, unit: str, metric_type: MetricType | None = None,
                        wire_metric_type: bool = False) -> bytes:
    flag = int(metric_type) if (wire_metric_type and metric_type is not None) else 0
    return _pack(value) + _pack(flag) + _pack(unit)


def encode(msg: CMDPMessage, *, wire_metric_type: bool = False) -> list[bytes]:
    """The three frames of ``msg``."""
    header = encode_header(msg.sender, msg.time_ns, msg.tags)
    if isinstance(msg, StatMessage):
        payload = encode_stat_payload(msg.value, msg.unit, msg.metric_type, wire_metric_type)
    elif isinstance(msg, LogMessage):
        payload = msg.text.encode("utf-8", "replace")
    elif isinstance(msg, Notification):
        payload = _pack(dict(msg.topics))
    else:  # pragma: no cover - typing guards this
        raise TypeError(f"not a CMDP message: {msg!r}")
    return [msg.topic.encode("ascii"), header, payload]


# --------------------------------------------------------------------------- decoding


def _unpacker(data: bytes) -> msgpack.Unpacker:
    # timestamp=0: keep msgpack.Timestamp (full ns); raw=False: str -> str, bin -> bytes;
    # strict_map_key=False so we can report non-str keys ourselves.
    u = msgpack.Unpacker(raw=False, timestamp=0, strict_map_key=False,
                         max_buffer_size=max(len(data), 1))
    u.feed(data)
    return u


def _next(u: msgpack.Unpacker, what: str) -> Any:
    try:
        return u.unpack()
    except msgpack.OutOfData:
        raise CMDPError("truncated", f"{what} missing") from None
    except UnicodeDecodeError:
        raise CMDPError("bad_utf8", f"{what}: str is not valid UTF-8") from None
    except (ValueError, msgpack.UnpackException) as e:
        raise CMDPError("bad_msgpack", f"{what}: {e}") from None


def _check_str_keys(m: dict, what: str) -> None:
    for k in m:
        if not isinstance(k, str):
            raise CMDPError("bad_map_key", f"{what} key {k!r} is not a str")


_LEVELS = {lv.name: lv for lv in LogLevel}


def decode_topic(topic: bytes) -> tuple[str, str]:
    """Split a topic into (kind, rest): ("STAT", name), ("LOG", "LEVEL[/COMP]"), ("STAT?", "")."""
    try:
        t = topic.decode("utf-8")  # we only send ASCII; upstream accepts any UTF-8
    except UnicodeDecodeError:
        raise CMDPError("bad_topic", f"topic {topic!r} is not UTF-8") from None
    for kind in ("STAT/", "LOG/"):
        if t.startswith(kind):
            return kind[:-1], t[len(kind):]
    if t.startswith("STAT?"):
        return "STAT?", ""
    if t.startswith("LOG?"):
        return "LOG?", ""
    raise CMDPError("bad_topic", f"topic {t!r} is neither STAT/, LOG/, STAT? nor LOG?")


def decode_header(data: bytes) -> tuple[str, int, dict[str, Any]]:
    u = _unpacker(data)
    proto = _next(u, "protocol id")
    if not isinstance(proto, str):
        raise CMDPError("bad_protocol", f"protocol id must be a msgpack str, got {type(proto).__name__}")
    if proto != PROTOCOL_ID:
        if proto.startswith("CMDP"):
            raise CMDPError("bad_version", f"unsupported protocol version {proto!r}")
        raise CMDPError("bad_protocol", f"protocol id {proto!r} is not 'CMDP\\x01'")
    sender = _next(u, "sender")
    if not isinstance(sender, str):
        raise CMDPError("bad_sender", f"sender must be a msgpack str, got {type(sender).__name__}")
    ts = _next(u, "timestamp")
    if not isinstance(ts, msgpack.Timestamp):
        raise CMDPError("bad_timestamp",
                        f"timestamp must be a msgpack timestamp extension, got {type(ts).__name__}")
    tags = _next(u, "tags")
    if not isinstance(tags, dict):
        raise CMDPError("bad_tags", f"tags must be a msgpack map, got {type(tags).__name__}")
    _check_str_keys(tags, "tag")
    # Trailing bytes after the four objects are not checked (ConstellationDAQ does not either).
    return sender, ts.to_unix_nano(), tags


def decode_stat_payload(data: bytes) -> tuple[Any, int, str]:
    u = _unpacker(data)
    value = _next(u, "STAT value")
    flag = _next(u, "STAT metric type/flags")
    unit = _next(u, "STAT unit")
    if type(flag) is not int or not 0 <= flag <= 255:
        raise CMDPError("bad_metric_type", f"metric type/flags must be a small int, got {flag!r}")
    if not isinstance(unit, str):
        raise CMDPError("bad_unit", f"unit must be a msgpack str, got {type(unit).__name__}")
    return value, flag, unit


def decode(frames: list[bytes] | tuple[bytes, ...]) -> CMDPMessage:
    """Decode one CMDP message; raise :class:`CMDPError` on anything malformed."""
    if len(frames) != 3:
        raise CMDPError("frame_count", f"expected 3 frames, got {len(frames)}")
    topic_b, header_b, payload = frames
    kind, rest = decode_topic(bytes(topic_b))
    sender, time_ns, tags = decode_header(bytes(header_b))
    payload = bytes(payload)
    if kind == "STAT":
        value, flag, unit = decode_stat_payload(payload)
        mtype = _METRIC_TYPES.get(flag)
        return StatMessage(sender, time_ns, rest, value, unit, mtype, tags)
    if kind == "LOG":
        level_s, _, component = rest.partition("/")
        level = _LEVELS.get(level_s.upper())  # upstream matches the level case-insensitively
        if level is None:
            raise CMDPError("bad_level", f"{level_s!r} is not a CMDP log level")
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            raise CMDPError("bad_utf8", "LOG payload is not valid UTF-8 text") from None
        return LogMessage(sender, time_ns, level, component, text, tags)
    # notification
    u = _unpacker(payload)
    topics = _next(u, "notification topics")
    if not isinstance(topics, dict):
        raise CMDPError("bad_notification",
                        f"notification payload must be a msgpack map, got {type(topics).__name__}")
    _check_str_keys(topics, "notification")
    return Notification(sender, time_ns, kind[:-1], topics, tags)


# --------------------------------------------------------------------------- subscriptions


def parse_subscription(frame: bytes) -> tuple[bool, bytes] | None:
    """An XPUB subscription frame -> (subscribe?, topic prefix), None if not one."""
    if not frame or frame[0] not in (0, 1):
        return None
    return frame[0] == 1, bytes(frame[1:])


class Publisher:
    """Subscription bookkeeping and message building for a CMDP sender (sans-IO).

    Feed it the frames an XPUB socket receives (:meth:`receive_subscription`, which
    returns the notification messages to send), ask :meth:`wants` before building a
    message, and build frames with :meth:`stat` / :meth:`log`.  ZeroMQ itself filters
    by prefix at the publisher; the point of the bookkeeping is not to build messages
    nobody wants (e.g. log records when only ``STAT/`` is subscribed).

    ``subscriptions`` is replaced (never mutated) on change, so other threads may read
    it without a lock.
    """

    def __init__(self, sender: str, *, wire_metric_type: bool = False):
        self.sender = sender
        self.wire_metric_type = wire_metric_type
        self.subscriptions: frozenset[bytes] = frozenset()
        self.stat_topics: dict[str, str] = {}
        self.log_topics: dict[str, str] = {}

    # -- subscriptions
    def receive_subscription(self, frame: bytes, now_ns: int) -> list[list[bytes]]:
        parsed = parse_subscription(frame)
        if parsed is None:
            return []
        subscribe, prefix = parsed
        if subscribe:
            self.subscriptions = self.subscriptions | {prefix}
        else:
            self.subscriptions = self.subscriptions - {prefix}
        if not subscribe:
            return []
        out = []
        # "STAT?" also matches a subscription to "" or "S"...: answer what the peer will get.
        if b"STAT?".startswith(prefix):
            out.append(self.notification("STAT", now_ns))
        if b"LOG?".startswith(prefix):
            out.append(self.notification("LOG", now_ns))
        return out

    def wants(self, topic: bytes) -> bool:
        for p in self.subscriptions:
            if topic.startswith(p):
                return True
        return False

    def wants_log(self, level: LogLevel, component: str) -> bool:
        if not self.subscriptions:
            return False
        t = ("LOG/" + level.name + ("/" + component if component else "")).encode("ascii")
        return self.wants(t)

    # -- topic registry (for the notifications)
    def register_stat(self, name: str, description: str) -> bool:
        """Register a STAT topic; True if it is new (send a fresh notification)."""
        if self.stat_topics.get(name) == description:
            return False
        self.stat_topics[name] = description
        return True

    def register_log(self, component: str, description: str = "") -> bool:
        if component in self.log_topics:
            return False
        self.log_topics[component] = description
        return True

    def notification(self, kind: str, now_ns: int) -> list[bytes]:
        topics = self.stat_topics if kind == "STAT" else self.log_topics
        return encode(Notification(self.sender, now_ns, kind, dict(topics)))

    # -- messages
    def stat(self, name: str, value: Any, unit: str, metric_type: MetricType | None,
             now_ns: int) -> list[bytes]:
        return [b"STAT/" + name.encode("ascii"),
                encode_header(self.sender, now_ns),
                encode_stat_payload(value, unit, metric_type, self.wire_metric_type)]

    def log(self, level: LogLevel, component: str, text: str, time_ns: int,
            tags: Mapping[str, Any] | None = None) -> list[bytes]:
        return encode(LogMessage(self.sender, time_ns, level, component, text, tags or {}))

