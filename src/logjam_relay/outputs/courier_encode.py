"""The Courier output's event mapping: one logjam record -> one JSON event.

Documented in ``docs/courier.md``; the common case in C (``_courierenc.c``), everything
else (and everything without the C extension) in :func:`record_to_event_py`.  Bodies
are inflated through :func:`logjam_relay.limits.inflate_bounded`: a body that is, or
inflates to, more than the limit raises :class:`~logjam_relay.limits.EventTooLarge`
(the output diverts the record to the dead-letter store).
"""

from __future__ import annotations

import json
import threading
import time

from .. import _native
from ..limits import BadBody, EventTooLarge, inflate_bounded
from ..protocols.logjam import meta_problem, split_app_env, unpack_meta
from ..spool.api import KIND_LOGJAM, Record

DEFAULT_LIMIT = 10 * 1024 * 1024


# ------------------------------------------------------------------ event mapping


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


# NaN/Infinity are accepted by Python's json but are not JSON: reject them
_json_check = json.JSONDecoder(parse_constant=_reject_constant).decode

_courierenc = _native.load("logjam_relay.outputs._courierenc")   # optional C, common case
_tailread = _native.load("logjam_relay.spool._tailread")
#: an output worker's reads (spool/tail.py): records as one buffer, which
#: :func:`record_events` maps from in C; None without the C extensions
RecordBlock = getattr(_tailread, "RecordBlock", None) if getattr(_courierenc, "BLOCKS", False) \
    else None


_ts_cache: dict[int, bytes] = {}


def iso_timestamp(created_ms: int) -> bytes:
    """Milliseconds since the epoch -> ``2024-05-01T12:00:00.123Z`` (UTC)."""
    s, ms = divmod(created_ms, 1000)
    p = _ts_cache.get(s)
    if p is None:
        try:
            p = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(s)).encode()
        except (OverflowError, OSError, ValueError):
            p = b"1970-01-01T00:00:00"
        if len(_ts_cache) > 4096:
            _ts_cache.clear()
        _ts_cache[s] = p
    return b"%s.%03dZ" % (p, ms)


_prefix_cache: dict[tuple[bytes, bytes, str], bytes] = {}


def _prefix(app_env: bytes, topic: bytes, hostname: str) -> bytes:
    key = (app_env, topic, hostname)
    p = _prefix_cache.get(key)
    if p is None:
        app, env = split_app_env(app_env)
        dumps = json.dumps
        p = (f',"app":{dumps(app)},"env":{dumps(env)},'
             f'"topic":{dumps(topic.decode("utf-8", "replace"))},"host":{dumps(hostname)},'
             ).encode()
        if len(_prefix_cache) > 10_000:
            _prefix_cache.clear()
        _prefix_cache[key] = p
    return p


NOT_JSON_TAG = "_logjam_body_not_json"
DECOMPRESS_TAG = "_logjam_decompress_failure"
BAD_META_TAG = "_logjam_bad_meta"


_inflaters: dict[int, object] = {}
_refused = threading.local()   # .too_large: what the C mapping's inflate refused last


def _inflater(limit: int):
    f = _inflaters.get(limit)
    if f is None:
        def f(body: bytes, comp: int) -> bytes:
            try:
                return inflate_bounded(comp, body, limit)
            except EventTooLarge as e:
                _refused.too_large = e       # not inflated a second time by the fallback
                raise
        if len(_inflaters) > 16:
            _inflaters.clear()
        _inflaters[limit] = f
    return f


def record_to_event(record: Record, hostname: str, limit: int = DEFAULT_LIMIT,
                    heartbeats: bool = False) -> bytes | None:
    """One logjam record -> one JSON event (bytes), or None when it is not a logjam record
    (or a heartbeat, unless ``heartbeats``: then it is mapped like any message).

    The common case (good meta, JSON body) is mapped in C (``_courierenc.c``) when it is
    built; everything else, and everything without it, by :func:`record_to_event_py`.
    Raises :class:`EventTooLarge` for a body over ``limit`` bytes (before or after
    inflating it).
    """
    frames = record.frames
    if record.kind != KIND_LOGJAM or len(frames) < 4 or \
            (not heartbeats and frames[0] == b"heartbeat"):
        return None     # heartbeats are spooled for the gapless archive only
    if len(frames[2]) > limit:
        raise EventTooLarge(f"body of {len(frames[2])} bytes is over {limit} bytes")
    if _courierenc is not None:
        ev = _courierenc.event(frames, _prefix(frames[0], frames[1], hostname),
                               _inflater(limit))
        if ev is not None:
            return ev
        e = getattr(_refused, "too_large", None)
        if e is not None:
            _refused.too_large = None
            raise e
    return record_to_event_py(record, hostname, limit, heartbeats)


def record_events(records: list[Record], hostname: str, limit: int = DEFAULT_LIMIT,
                  heartbeats: bool = False):
    """The C mapping of a whole batch, or None without it: ``(events, clean, total,
    longest)``, ``events[i]`` for ``records[i]``: the event bytes (what
    :func:`record_to_event` returns), None (not an event) or False (left to
    :func:`record_to_event`: a body over ``limit``, or anything the C mapping does not
    map); ``clean``: all are bytes; ``total``, ``longest``: their summed and largest
    length."""
    if _courierenc is None:
        return None
    return _courierenc.events(records, KIND_LOGJAM, lambda a, t: _prefix(a, t, hostname),
                              _inflater(limit), limit, heartbeats)


def record_to_event_py(record: Record, hostname: str, limit: int = DEFAULT_LIMIT,
                       heartbeats: bool = False) -> bytes | None:
    """:func:`record_to_event` in Python alone (the reference for the C mapping).

    ``{"@timestamp", "app", "env", "topic", "host", "logjam": {"device", "sequence",
    "created_ms"}, "payload": <decoded JSON body>}``; a body that is not JSON becomes
    ``"message": <text>, "tags": ["_logjam_body_not_json"]`` (see docs/courier.md).
    """
    if record.kind != KIND_LOGJAM or len(record.frames) < 4 or \
            (not heartbeats and record.frames[0] == b"heartbeat"):
        return None     # heartbeats are spooled for the gapless archive only
    app_env, topic, body, meta_b = record.frames[:4]
    tag = None
    if meta_problem(meta_b) is None:
        _t, comp, _v, device, created_ms, seq = unpack_meta(meta_b)
    else:
        tag = BAD_META_TAG
        comp = device = created_ms = seq = 0
    raw = body if type(body) is bytes else bytes(body)
    if comp:
        try:
            raw = inflate_bounded(comp, body, limit)
        except BadBody:
            tag = DECOMPRESS_TAG
    head = b'{"@timestamp":"%s"%s"logjam":{"device":%d,"sequence":%d,"created_ms":%d},' % (
        iso_timestamp(created_ms), _prefix(app_env, topic, hostname), device, seq, created_ms)
    if tag is None:
        try:
            _json_check(raw.decode("utf-8"))
        except (ValueError, RecursionError):   # includes UnicodeDecodeError
            tag = NOT_JSON_TAG
        else:
            return head + b'"payload":' + raw + b"}"
    return b'%s"message":%s,"tags":["%s"]}' % (
        head, json.dumps(raw.decode("utf-8", "replace")).encode(), tag.encode())
