"""Input events -> logjam messages (pure functions, no I/O). See ``docs/inputs.md``.

Every function returns the pipeline's accepted-message tuple
``(app_env, topic, body, compression, created_ms_8_bytes)``; the relay then stamps it with
its own device and sequence, publishes it on PUB and spools it, like a ZeroMQ message.

* **From a logjam-relay output** (Lumberjack ``type=logjam`` events, Courier events with a
  ``logjam`` object): the original message comes back: the same app-env, topic, body and
  creation time.  The origin is kept in the body, which is a JSON object, as its first key::

      {"logjam_origin":{"device":7,"sequence":42,"host":"edge-1","input":"lj"}, ...body...}

  A body that already starts with ``{"logjam_origin":`` (a longer chain) keeps the first
  origin.  A body that is not a JSON object is republished unchanged.
* **Any other event** is wrapped: app and env come from the fields named by ``app_field`` /
  ``env_field`` (dotted paths into JSON events, e.g. ``fields.app``; defaults
  ``default_app`` / ``default_env``), the stream is ``<app>-<env>``, the topic
  ``<topic_prefix>.<app>.<env>`` and the body the event as a JSON object (a v1 event's
  key/value pairs; a JSON event verbatim) with a ``logjam_origin`` of
  ``{"host": <peer address>, "input": <input name>}``.  The creation time is the time the
  relay stamps it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_ZERO8 = b"\0" * 8
_ORIGIN_HEAD = b'{"logjam_origin":'
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]+")
_MAX_NAME = 80


@dataclass(frozen=True, slots=True)
class MappingOptions:
    """How events that did not come from a logjam-relay are wrapped (URL parameters)."""

    app_field: str = "app"
    env_field: str = "env"
    default_app: str = "unknown"
    default_env: str = "unknown"
    topic_prefix: str = "logs"


def _name(s, default: str, env: bool = False) -> str:
    if not isinstance(s, str) or not s:
        s = default
    s = _SAFE.sub("_", s)[:_MAX_NAME]
    if env:
        s = s.replace("-", "_")     # the stream is split at the LAST "-"
    return s or default


_tails: dict[tuple[str, str], bytes] = {}


def _origin(device: bytes, sequence: bytes, created: bytes, host: str, input_name: str) -> bytes:
    key = (host, input_name)
    tail = _tails.get(key)
    if tail is None:
        tail = b'"host":%s,"input":%s}' % (
            json.dumps(host, ensure_ascii=False).encode("utf-8", "replace"),
            json.dumps(input_name).encode())
        if len(_tails) > 10_000:
            _tails.clear()
        _tails[key] = tail
    return b'{"logjam_origin":{"device":%s,"sequence":%s,"created_ms":%s,%s' % (
        device, sequence, created, tail)


def splice_origin(body: bytes, origin_head: bytes) -> bytes:
    """``origin_head`` (``{"logjam_origin":{...}``) + the rest of the JSON object ``body``.

    Bodies that are not JSON objects, or already carry an origin, are returned unchanged.
    """
    stripped = body.lstrip()
    if not stripped.startswith(b"{") or stripped.startswith(_ORIGIN_HEAD):
        return body
    rest = stripped[1:]
    if rest.lstrip().startswith(b"}"):
        return origin_head + b"}"
    return origin_head + b"," + rest


def _digits(s) -> bool:
    return isinstance(s, str) and s.isascii() and s.isdigit()


def _stream(app: str, env: str) -> bytes:
    return (app + "-" + env if env else app).encode("utf-8", "replace")


def _created8(v: str | bytes | int) -> bytes:
    try:
        n = int(v)
    except (TypeError, ValueError):
        return _ZERO8
    return n.to_bytes(8, "big") if 0 < n < 2**63 else _ZERO8


# ------------------------------------------------------------ Lumberjack v1 events

_RELAY_KEYS = ("line", "app", "env", "topic", "device", "sequence", "created_ms")


def lumberjack_v1(fields: dict, input_name: str, peer: str, opts: MappingOptions) -> tuple:
    """One v1 event (``dict`` of str) -> the accepted-message tuple."""
    if fields.get("type") == "logjam":
        try:
            line, app, env, topic, device, sequence, created = [fields[k] for k in _RELAY_KEYS]
        except KeyError:
            pass
        else:
            if _digits(device) and _digits(sequence):
                body = line.encode("utf-8", "surrogateescape")
                body = splice_origin(body, _origin(device.encode(), sequence.encode(),
                                                   (created if _digits(created) else "0")
                                                   .encode(), fields.get("host", ""),
                                                   input_name))
                return (_stream(app, env), topic.encode("utf-8", "surrogateescape"), body, 0,
                        _created8(created))
    body = json.dumps(fields, ensure_ascii=False).encode("utf-8", "replace")
    return _wrap(body, fields.get(opts.app_field), fields.get(opts.env_field), input_name,
                 peer, opts)


def _wrap(body: bytes, app, env, input_name: str, peer: str, opts: MappingOptions) -> tuple:
    app = _name(app, opts.default_app)
    env = _name(env, opts.default_env, env=True)
    head = b'{"logjam_origin":{"host":%s,"input":%s}' % (json.dumps(peer).encode(),
                                                         json.dumps(input_name).encode())
    return (_stream(app, env), f"{opts.topic_prefix}.{app}.{env}".encode(),
            splice_origin(body, head), 0, _ZERO8)


def _path(doc, path: str):
    for part in path.split("."):
        if not isinstance(doc, dict):
            return None
        doc = doc.get(part)
    return doc


# ------------------------------------------------------- JSON events (v2, Courier)

_S = rb'("[^"\\]*(?:\\.[^"\\]*)*")'
# the exact head the relay's Courier output writes (outputs/courier.py, _courierenc.c)
_COURIER_HEAD = re.compile(
    rb'\{"@timestamp":"[^"\\]*","app":' + _S + rb',"env":' + _S + rb',"topic":' + _S +
    rb',"host":' + _S + rb',"logjam":\{"device":(\d+),"sequence":(\d+),"created_ms":(\d+)\},'
    rb'"payload":')


def _jstr(b: bytes) -> str:
    if b"\\" in b:
        try:
            return json.loads(b)
        except ValueError:          # a bad escape: the text as it is
            pass
    return b[1:-1].decode("utf-8", "replace")


def _utf8(s: str) -> bytes:
    """Text that came from JSON may hold lone surrogates (``"\\ud800"``): never raise."""
    return s.encode("utf-8", "replace")


def json_event(raw: bytes, input_name: str, peer: str, opts: MappingOptions) -> tuple:
    """One JSON event (Lumberjack v2 ``J`` frame or a Courier event) -> the tuple."""
    m = _COURIER_HEAD.match(raw)
    if m is not None and raw.endswith(b"}"):
        app, env, topic, host = (_jstr(m.group(i)) for i in (1, 2, 3, 4))
        device, sequence, created = m.group(5), m.group(6), m.group(7)
        body = splice_origin(raw[m.end():-1], _origin(device, sequence, created, host,
                                                      input_name))
        return (_stream(app, env), _utf8(topic), body, 0, _created8(created))
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        body = json.dumps({"message": raw.decode("utf-8", "replace")},
                          ensure_ascii=False).encode()
        return _wrap(body, None, None, input_name, peer, opts)
    lj = doc.get("logjam")
    if isinstance(lj, dict) and isinstance(lj.get("device"), int) and \
            isinstance(lj.get("sequence"), int) and isinstance(doc.get("app"), str):
        # a logjam-relay Courier event in another layout, or one whose body was not JSON
        created = lj.get("created_ms") if isinstance(lj.get("created_ms"), int) else 0
        origin = _origin(b"%d" % lj["device"], b"%d" % lj["sequence"], b"%d" % created,
                         str(doc.get("host", "")), input_name)
        if "payload" in doc:
            try:
                payload = _utf8(json.dumps(doc["payload"], ensure_ascii=False,
                                           separators=(",", ":"), allow_nan=False))
            except (ValueError, RecursionError):      # NaN/Infinity, too deep
                payload = raw
            body = splice_origin(payload, origin)
        else:
            body = str(doc.get("message", "")).encode("utf-8", "replace")
        env = doc.get("env") if isinstance(doc.get("env"), str) else ""
        return (_stream(doc["app"], env), _utf8(str(doc.get("topic", ""))), body, 0,
                _created8(created))
    return _wrap(raw, _path(doc, opts.app_field), _path(doc, opts.env_field), input_name,
                 peer, opts)
