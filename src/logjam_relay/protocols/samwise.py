"""The samwise request/reply protocol (samd's frontend), sans-IO.

Frames in, events out: no sockets, no trio, no clock.  Two request versions:

* **100** — the draft RFC 1.0 layout: ``distribution, [min-ack], exchange,
  routing key, payload``.  Parsed strictly (the RFC says an unexpected frame
  count MUST NOT be accepted).  Success reply ``[b'0']`` as the RFC says.
* **120** — what the real samd speaks (RFC 1.1 layout): ``distribution,
  [min-ack], exchange, routing key, mandatory, immediate, props count (12),
  12 property frames, header count, header frames, payload``.  Extra trailing
  frames are ignored like samd does.  Success reply ``[b'0', b'']``.

Errors are ``[b'-1', reason]`` with samd's exact strings.  Every input that
crashes samd (property count != 12, a count running past the end of the
message) is a :class:`SamwiseError` here.  Integers are decimal ASCII parsed
with C ``atoi`` semantics; string frames are cut at the first NUL like samd's
``strdup``.  See ``docs/samwise.md`` for every deliberate difference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

VERSION_1_0 = 100
VERSION_1_1 = 120
VERSIONS = (VERSION_1_0, VERSION_1_1)

OK = b"0"
ERROR = b"-1"

# samd's exact error strings, and the metric label for each.
MALFORMED_REQUEST = b"malformed request"
WRONG_VERSION = b"wrong protocol version"
NO_PAYLOAD = b"no payload"
UNKNOWN_ACTION = b"unknown action"
MALFORMED_PUBLISH = b"malformed publishing request"
MALFORMED_RPC = b"malformed rpc request"

REASONS = {
    MALFORMED_REQUEST: "malformed_request",
    WRONG_VERSION: "wrong_version",
    NO_PAYLOAD: "no_payload",
    UNKNOWN_ACTION: "unknown_action",
    MALFORMED_PUBLISH: "malformed_publish",
    MALFORMED_RPC: "malformed_rpc",
}

ROUND_ROBIN = "round robin"
REDUNDANT = "redundant"
EXCHANGE_DECLARE = "exchange.declare"
EXCHANGE_DELETE = "exchange.delete"

PROPERTY_NAMES = (
    "content_type", "content_encoding", "delivery_mode", "priority", "correlation_id",
    "reply_to", "expiration", "message_id", "type", "user_id", "app_id", "cluster_id",
)
N_PROPERTIES = len(PROPERTY_NAMES)  # 12

# RabbitMQ refuses other names with a channel error (406), which would turn the
# message into a poison pill in the spool: reject them at the door instead.
_NAME_RE = re.compile(rb"[A-Za-z0-9_.:\-]{1,255}\Z")
_ATOI_RE = re.compile(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_DIGITS_RE = re.compile(rb"[0-9]{1,10}\Z")


class SamwiseError(ValueError):
    """A request that gets ``[b'-1', message]``; ``reason`` is a metric label."""

    def __init__(self, message: bytes, detail: str = ""):
        super().__init__(message.decode() + (f": {detail}" if detail else ""))
        self.message = message
        self.reason = REASONS.get(message, "rejected")
        self.detail = detail


# ----------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Properties:
    """The 12 RFC 1.1 property frames; ``None`` = not set (empty frame)."""

    content_type: str | None = None
    content_encoding: str | None = None
    delivery_mode: int | None = None
    priority: int | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    expiration: str | None = None
    message_id: str | None = None
    type: str | None = None
    user_id: str | None = None
    app_id: str | None = None
    cluster_id: str | None = None

    def as_dict(self) -> dict:
        return {n: getattr(self, n) for n in PROPERTY_NAMES if getattr(self, n) is not None}


NO_PROPERTIES = Properties()


@dataclass(frozen=True, slots=True)
class Publish:
    version: int
    distribution: str          # ROUND_ROBIN or REDUNDANT
    copies: int                # 1 for round robin, min-ack for redundant
    exchange: str
    routing_key: str
    payload: bytes
    mandatory: bool = False
    immediate: bool = False
    properties: Properties = NO_PROPERTIES
    headers: tuple[tuple[str, bytes], ...] = ()
    headers_as_pairs: bool = False   # libsamwise-style header count (pairs, not frames)


@dataclass(frozen=True, slots=True)
class Rpc:
    version: int
    broker: str                # "" = every broker
    method: str                # EXCHANGE_DECLARE or EXCHANGE_DELETE
    exchange: str
    exchange_type: str = ""    # only for declare


@dataclass(frozen=True, slots=True)
class Ping:
    version: int


@dataclass(frozen=True, slots=True)
class Status:
    version: int


@dataclass(frozen=True, slots=True)
class Control:
    """``stop`` / ``restart``: parsed, but the endpoint refuses them (see docs)."""

    version: int
    action: str


Request = Publish | Rpc | Ping | Status | Control

# ---------------------------------------------------------------------- helpers


def atoi(frame: bytes) -> int:
    """C ``atoi``: leading whitespace and a sign, digits, trailing garbage ignored, else 0."""
    if frame.isdigit() and len(frame) < 10:
        return int(frame)
    m = _ATOI_RE.match(frame)
    if m is None:
        return 0
    v = int(m.group(1))
    # atoi on glibc returns (int)strtol: wrap like a 32-bit int would be UB; clamp instead.
    return max(-(2**31), min(2**31 - 1, v))


def cstr(frame: bytes) -> bytes:
    """A string frame as samd's ``zframe_strdup`` sees it: up to the first NUL."""
    i = frame.find(b"\x00")
    return frame if i < 0 else frame[:i]


def _text(frame: bytes, error: bytes, what: str, max_len: int = 255) -> str:
    if not frame:
        return ""
    s = cstr(frame)
    if len(s) > max_len:
        raise SamwiseError(error, f"{what} longer than {max_len} bytes")
    try:
        return s.decode("utf-8")
    except UnicodeDecodeError:
        raise SamwiseError(error, f"{what} is not UTF-8") from None


def _name(frame: bytes, error: bytes, what: str) -> str:
    s = cstr(frame)
    if not s:
        raise SamwiseError(error, f"empty {what}")
    if not _NAME_RE.match(s):
        raise SamwiseError(error, f"invalid {what} {s[:60]!r}")
    return s.decode("ascii")


# ---------------------------------------------------------------------- parsing


def parse_request(frames: list[bytes]) -> Request:
    """Parse one request (frames after the REQ envelope). Raises :class:`SamwiseError`."""
    version = atoi(frames[0]) if frames else 0
    if version == -1:
        raise SamwiseError(MALFORMED_REQUEST)
    if version not in VERSIONS:
        raise SamwiseError(WRONG_VERSION, f"version {version}")
    if len(frames) < 2:
        raise SamwiseError(NO_PAYLOAD)
    action = cstr(frames[1])
    strict = version == VERSION_1_0
    if action == b"publish":
        return _parse_publish(version, frames)
    if action == b"rpc":
        return _parse_rpc(version, frames)
    if action == b"ping":
        if strict and len(frames) != 2:
            raise SamwiseError(MALFORMED_REQUEST, "ping takes no frames")
        return Ping(version)
    if version == VERSION_1_1:
        # status/stop/restart came with RFC 1.2 and samd's 120; not in RFC 1.0.
        if action == b"status":
            return Status(version)
        if action in (b"stop", b"restart"):
            return Control(version, action.decode())
    raise SamwiseError(UNKNOWN_ACTION, repr(action[:40]))


def _parse_publish(version: int, frames: list[bytes]) -> Publish:
    E = MALFORMED_PUBLISH
    n = len(frames)
    i = 2
    if i >= n:
        raise SamwiseError(E, "no distribution")
    dist = cstr(frames[i])
    i += 1
    if dist == b"round robin":
        copies = 1
    elif dist == b"redundant":
        if i >= n or not cstr(frames[i]):
            raise SamwiseError(E, "redundant without min. acknowledged")
        copies = atoi(frames[i])
        i += 1
        if copies <= 0:
            # RFC: x > 0. samd never sends n = 0 and sends n < 0 to all: refuse both.
            raise SamwiseError(E, f"min. acknowledged {copies} is not > 0")
    else:
        raise SamwiseError(E, f"unknown distribution {dist[:40]!r}")

    if version == VERSION_1_0:
        if n - i != 3:
            raise SamwiseError(E, f"RFC 1.0 layout needs 3 frames after distribution, got {n - i}")
        exchange = _name(frames[i], E, "exchange")
        routing_key = _text(frames[i + 1], E, "routing key")
        payload = frames[i + 2]
        if not payload:
            raise SamwiseError(E, "empty payload")
        return Publish(version, dist.decode(), copies, exchange, routing_key, payload)

    # RFC 1.1: exchange, rk, mandatory, immediate, props count + 12, header count + frames, payload
    if n - i < 8:
        raise SamwiseError(E, f"RFC 1.1 layout needs at least 8 frames after distribution, got {n - i}")
    exchange = _name(frames[i], E, "exchange")
    routing_key = _text(frames[i + 1], E, "routing key")
    mandatory = atoi(frames[i + 2]) != 0
    immediate = atoi(frames[i + 3]) != 0
    nprops = atoi(frames[i + 4])
    i += 5
    if nprops != N_PROPERTIES:
        raise SamwiseError(E, f"property count {nprops} != {N_PROPERTIES}")
    if i + N_PROPERTIES + 2 > n:
        raise SamwiseError(E, "property frames run past the end of the message")
    props = _parse_properties(frames[i:i + N_PROPERTIES])
    i += N_PROPERTIES
    nheaders = atoi(frames[i])
    i += 1
    rest = n - i
    if nheaders < 0:
        raise SamwiseError(E, f"header count {nheaders}")
    # The header count is in frames (samd) but libsamwise sends pairs.  Frames
    # when that accounts for the message exactly; pairs when *that* does;
    # otherwise frames with trailing frames ignored (samd), never a short read.
    if nheaders % 2 == 0 and rest == nheaders + 1:
        pairs, nframes = False, nheaders
    elif rest == 2 * nheaders + 1:
        pairs, nframes = True, 2 * nheaders
    elif nheaders % 2 == 0 and rest > nheaders + 1:
        pairs, nframes = False, nheaders
    else:
        raise SamwiseError(E, f"header count {nheaders} does not fit the {rest} remaining frames")
    headers = []
    for k in range(i, i + nframes, 2):
        key = _text(frames[k], E, "header key")
        if not key:
            raise SamwiseError(E, "empty header key")
        headers.append((key, frames[k + 1]))
    i += nframes
    payload = frames[i]
    if not payload:
        raise SamwiseError(E, "empty payload")
    return Publish(version, dist.decode(), copies, exchange, routing_key, payload,
                   mandatory, immediate, props, tuple(headers), pairs)


def _opt_int(frame: bytes, what: str) -> int | None:
    if not cstr(frame):
        return None
    v = atoi(frame)
    if not 0 <= v <= 255:
        raise SamwiseError(MALFORMED_PUBLISH, f"{what} {v} out of range 0..255")
    return v or None


def _parse_properties(fr: list[bytes]) -> Properties:
    E = MALFORMED_PUBLISH
    if not any(fr):
        return NO_PROPERTIES
    if fr[0] and all(f == fr[0] for f in fr):
        # libsamwise's loop sends content_type in all 12 frames: that is what it meant.
        return Properties(content_type=_text(fr[0], E, "content_type"))
    s = [(_text(f, E, PROPERTY_NAMES[k]) or None) for k, f in enumerate(fr)]
    expiration = s[6]
    if expiration is not None and not _DIGITS_RE.match(expiration.encode()):
        # RabbitMQ closes the channel on a non-numeric expiration (406).
        raise SamwiseError(E, f"expiration {expiration[:20]!r} is not a number of ms")
    return Properties(
        content_type=s[0], content_encoding=s[1],
        delivery_mode=_opt_int(fr[2], "delivery_mode"), priority=_opt_int(fr[3], "priority"),
        correlation_id=s[4], reply_to=s[5], expiration=expiration, message_id=s[7],
        type=s[8], user_id=s[9], app_id=s[10], cluster_id=s[11],
    )


def _parse_rpc(version: int, frames: list[bytes]) -> Rpc:
    E = MALFORMED_RPC
    n = len(frames)
    if n < 4:
        raise SamwiseError(E, "missing broker or method frame")
    broker = _text(frames[2], E, "broker")
    method = cstr(frames[3])
    if method == b"exchange.declare":
        need = 6
    elif method == b"exchange.delete":
        need = 5
    else:
        raise SamwiseError(E, f"unknown method {method[:40]!r}")
    if n < need or (version == VERSION_1_0 and n != need):
        raise SamwiseError(E, f"{method.decode()} needs {need - 4} option frame(s)")
    name = _name(frames[4], E, "exchange")
    etype = ""
    if need == 6:
        etype = _name(frames[5], E, "exchange type")
    return Rpc(version, broker, method.decode(), name, etype)


# ---------------------------------------------------------------------- replies


def ok_reply(version: int, message: bytes = b"") -> list[bytes]:
    """``[b'0']`` for RFC 1.0 (unless there is a message), ``[b'0', message]`` for 120."""
    if version == VERSION_1_0 and not message:
        return [OK]
    return [OK, message]


def error_reply(message: bytes) -> list[bytes]:
    return [ERROR, message]


# ------------------------------------------------------------ request building
# (clients, tests and the benchmark use these)


def _i(v: int | bool) -> bytes:
    return str(int(v)).encode()


class PublishMemo:
    """Parse results of publish requests that differ only in their payload.

    A samcli-like client sends the same exchange, routing key, flags, properties and
    headers with every message, so everything but the payload parses to the same result.
    A request whose frames before the last equal those of a remembered publish, and whose
    last frame was that publish's payload, is the same publish with this payload: the
    parser reads the payload only to refuse an empty one, and the frame count (part of the
    key) decides the layout.  ``derive(event)`` (optional) is computed once per entry and
    returned with every hit (the broker outputs keep their encoded AMQP parts there).
    Bounded: ``size`` entries, keys of at most ``max_key_bytes``; full = start over.
    """

    __slots__ = ("_memo", "size", "max_key_bytes", "_derive", "hits")

    def __init__(self, derive=None, size: int = 64, max_key_bytes: int = 4096):
        self._memo: dict[tuple, tuple[Publish, object]] = {}
        self.size = size
        self.max_key_bytes = max_key_bytes
        self._derive = derive
        self.hits = 0

    def lookup(self, frames: list[bytes], start: int = 0) -> tuple[Publish, object] | None:
        """The remembered ``(template, derived)`` of the publish ``frames[start:]`` -- its
        payload is ``frames[-1]``, everything else is the template's -- or None when it
        is not remembered (then :meth:`parse` it).  Builds no event: the broker outputs
        need only the derived AMQP parts and the payload."""
        if len(frames) - start <= 5 or not frames[-1]:
            return None
        hit = self._memo.get(tuple(frames[start:-1]))
        if hit is not None:
            self.hits += 1
        return hit

    def parse(self, frames: list[bytes]) -> tuple[Request, object]:
        """``(event, derived)``; derived is None for anything but a publish.  Raises
        :class:`SamwiseError` like :func:`parse_request`."""
        payload = frames[-1] if len(frames) > 5 else b""
        key = tuple(frames[:-1]) if payload else None
        hit = self._memo.get(key) if payload else None
        if hit is not None:
            self.hits += 1
            ev = hit[0]
            return Publish(ev.version, ev.distribution, ev.copies, ev.exchange, ev.routing_key,
                           payload, ev.mandatory, ev.immediate, ev.properties, ev.headers,
                           ev.headers_as_pairs), hit[1]
        ev = parse_request(frames)
        if not isinstance(ev, Publish):
            return ev, None
        derived = self._derive(ev) if self._derive is not None else None
        if key is not None and ev.payload is payload and sum(map(len, key)) <= self.max_key_bytes:
            if len(self._memo) >= self.size:
                self._memo.clear()
            self._memo[key] = (ev, derived)
        return ev, derived


def build_publish(exchange: str, routing_key: str, payload: bytes, *, version: int = VERSION_1_1,
                  copies: int | None = None, mandatory: bool = False, immediate: bool = False,
                  properties: Properties | dict | None = None,
                  headers: dict[str, bytes | str] | None = None) -> list[bytes]:
    """Frames of a publish request (without REQ envelope). ``copies`` = redundant n."""
    f = [_i(version), b"publish"]
    if copies is None:
        f.append(b"round robin")
    else:
        f += [b"redundant", _i(copies)]
    f += [exchange.encode(), routing_key.encode()]
    if version == VERSION_1_0:
        return f + [payload]
    if isinstance(properties, dict):
        properties = Properties(**properties)
    props = properties or NO_PROPERTIES
    f += [_i(mandatory), _i(immediate), _i(N_PROPERTIES)]
    for name in PROPERTY_NAMES:
        v = getattr(props, name)
        f.append(b"" if v is None else str(v).encode())
    hdr = headers or {}
    f.append(_i(2 * len(hdr)))
    for k, v in hdr.items():
        f += [k.encode(), v.encode() if isinstance(v, str) else v]
    f.append(payload)
    return f


def build_rpc(method: str, exchange: str, exchange_type: str = "", *, broker: str = "",
              version: int = VERSION_1_1) -> list[bytes]:
    f = [_i(version), b"rpc", broker.encode(), method.encode(), exchange.encode()]
    if method == EXCHANGE_DECLARE:
        f.append(exchange_type.encode())
    return f
