"""Courier upstream writer: forwards the spool to log-courier/log-carver receivers.

One :class:`CourierOutput` reads its :class:`~logjam_relay.spool.api.SpoolReader`, turns
each logjam record into one JSON event (:func:`record_to_event`, documented in
``docs/courier.md``), groups events into payloads of ``payload_size`` events with a
random 16-byte nonce and keeps at most ``max_pending`` payloads unacknowledged per
connection. A payload's last spool position is acknowledged to the reader once the
receiver acknowledged all its events, strictly in order.

Network and protocol errors never escape :meth:`CourierOutput.run`: the connection is
closed, and after an exponential backoff (capped) the next host is tried; every pending
payload is then resent with the same nonce, but only its still unacknowledged events
(sequence restarting at 1). Cancellation closes the socket at once;
:meth:`CourierOutput.request_shutdown` instead finishes the payloads in flight and
half-closes the connection after the last ACKN.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import ssl
import time
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

import trio

from .. import _native
from ..io.net import TLSSettings, connect
from ..protocols.courier import (
    MAX_LENGTH,
    ClientConnection,
    CourierError,
    HandshakeComplete,
    PayloadAck,
)
from ..protocols.logjam import LogjamError, decompress, meta_problem, split_app_env, unpack_meta
from ..ratelimit import RateLimitedLog
from ..spool.api import KIND_LOGJAM, Position, Record, SpoolReader

log = logging.getLogger("logjam_relay.outputs.courier")

_NET_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError,
               trio.TooSlowError, CourierError)


# ------------------------------------------------------------------ configuration


@dataclass(frozen=True, slots=True)
class CourierConfig:
    hosts: tuple[tuple[str, int], ...]
    tls: TLSSettings = field(default_factory=TLSSettings)
    payload_size: int = 1000              # events per payload
    max_pending: int = 10                 # unacknowledged payloads per connection (Go limit)
    network_timeout: float = 15.0         # connect, handshake, ACKN progress, PONG
    idle_ping: float = 10.0               # PING after this long without traffic
    backoff_initial: float = 1.0
    backoff_max: float = 30.0             # the Go client caps at 300 s: too long for a relay
    compress_level: int = 3               # as the Go client (78 5e)
    streaming: bool = True                # use EVNT when the receiver offers it
    max_payload_bytes: int = 4 * 1024 * 1024   # uncompressed; a payload is cut earlier
    max_event_bytes: int = MAX_LENGTH - 1024   # larger events are dropped (receivers refuse)
    hostname: str = field(default_factory=socket.gethostname)   # event field "host"
    shutdown_timeout: float = 15.0
    name: str = "courier"

    def __post_init__(self):
        if not self.hosts:
            raise ValueError("at least one host is required")
        if self.payload_size < 1:
            raise ValueError("payload_size must be >= 1")
        if self.max_pending < 1:
            raise ValueError("max_pending must be >= 1")


_BOOL = {"on": True, "true": True, "yes": True, "1": True,
         "off": False, "false": False, "no": False, "0": False}


def _hostport(s: str) -> tuple[str, int]:
    if s.startswith("["):
        host, _, rest = s[1:].partition("]")
        if not rest.startswith(":"):
            raise ValueError(f"courier URL: host {s!r} needs a port ([v6]:port)")
        port_s = rest[1:]
    else:
        host, sep, port_s = s.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"courier URL: host {s!r} needs a port (host:port)")
    if not host:
        raise ValueError(f"courier URL: empty host name in {s!r}")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"courier URL: port {port_s!r} of {s!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"courier URL: port {port} of {s!r} out of range 1..65535")
    return host, port


def parse_url(url: str) -> CourierConfig:
    """``courier://host:port[,host2:port2...]?payload=1000&tls=off&...`` -> config.

    Parameters: ``payload`` (events per payload), ``pending`` (unacknowledged payloads per
    connection), ``tls`` (on/off, default on), ``ca``, ``cert``, ``key``, ``server_name``,
    ``verify`` (on/off, default on), ``timeout`` (network timeout, s), ``ping`` (idle
    PING, s), ``backoff``, ``backoff_max`` (s), ``level`` (zlib 0-9), ``evnt`` (on/off),
    ``hostname`` (the ``host`` field of events). Raises ValueError naming the bad part.
    """
    try:
        u = urlsplit(url)
    except ValueError as e:
        raise ValueError(f"courier URL: {e}") from None
    if u.scheme != "courier":
        raise ValueError(f"courier URL: scheme must be 'courier', got {u.scheme!r}")
    if "@" in u.netloc:
        raise ValueError("courier URL: user information is not supported")
    if u.path not in ("", "/"):
        raise ValueError(f"courier URL: unexpected path {u.path!r}")
    if u.fragment:
        raise ValueError(f"courier URL: unexpected fragment {u.fragment!r}")
    if not u.netloc:
        raise ValueError("courier URL: no host:port")
    hosts = tuple(_hostport(h) for h in u.netloc.split(","))

    params: dict[str, str] = {}
    for k, v in parse_qsl(u.query, keep_blank_values=True):
        if k in params:
            raise ValueError(f"courier URL: parameter {k!r} given twice")
        params[k] = v

    def num(name, conv, lo, hi=None):
        raw = params.pop(name, None)
        if raw is None:
            return None
        try:
            v = conv(raw)
        except ValueError:
            raise ValueError(f"courier URL: parameter {name}={raw!r} is not a "
                             f"{'number' if conv is float else 'whole number'}") from None
        if v != v or v < lo or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise ValueError(f"courier URL: parameter {name}={raw!r} must be {rng}")
        return v

    def flag(name):
        raw = params.pop(name, None)
        if raw is None:
            return None
        try:
            return _BOOL[raw.lower()]
        except KeyError:
            raise ValueError(f"courier URL: parameter {name}={raw!r} must be on or off") from None

    def path(name):
        raw = params.pop(name, None)
        if raw is None:
            return None
        if not raw:
            raise ValueError(f"courier URL: parameter {name} is empty")
        if not os.path.isfile(raw):
            raise ValueError(f"courier URL: parameter {name}: file {raw!r} not found")
        return raw

    kw: dict = {}
    for key, name, conv, lo, hi in (
        ("payload_size", "payload", int, 1, 1_000_000),
        ("max_pending", "pending", int, 1, 10_000),
        ("network_timeout", "timeout", float, 0.001, None),
        ("idle_ping", "ping", float, 0.001, None),
        ("backoff_initial", "backoff", float, 0.0, None),
        ("backoff_max", "backoff_max", float, 0.0, None),
        ("compress_level", "level", int, 0, 9),
    ):
        v = num(name, conv, lo, hi)
        if v is not None:
            kw[key] = v
    streaming = flag("evnt")
    if streaming is not None:
        kw["streaming"] = streaming
    hostname = params.pop("hostname", None)
    if hostname is not None:
        if not hostname:
            raise ValueError("courier URL: parameter hostname is empty")
        kw["hostname"] = hostname

    tls_on = flag("tls")
    verify = flag("verify")
    ca, cert, key = path("ca"), path("cert"), path("key")
    server_name = params.pop("server_name", None)
    if server_name == "":
        raise ValueError("courier URL: parameter server_name is empty")
    if tls_on is False:
        for name, v in (("ca", ca), ("cert", cert), ("key", key),
                        ("server_name", server_name), ("verify", verify)):
            if v is not None:
                raise ValueError(f"courier URL: parameter {name} given but tls=off")
    if key is not None and cert is None:
        raise ValueError("courier URL: parameter key given without cert")
    kw["tls"] = TLSSettings(enabled=tls_on is not False, ca=ca, cert=cert, key=key,
                            server_name=server_name, verify=verify is not False)

    if params:
        raise ValueError(f"courier URL: unknown parameter {sorted(params)[0]!r}")
    if kw.get("backoff_max", 30.0) < kw.get("backoff_initial", 1.0):
        raise ValueError("courier URL: parameter backoff_max must be >= backoff")
    return CourierConfig(hosts=hosts, **kw)


# ------------------------------------------------------------------ event mapping


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


# NaN/Infinity are accepted by Python's json but are not JSON: reject them
_json_check = json.JSONDecoder(parse_constant=_reject_constant).decode

_courierenc = _native.load("logjam_relay.outputs._courierenc")   # optional C, common case


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


def record_to_event(record: Record, hostname: str) -> bytes | None:
    """One logjam record -> one JSON event (bytes), or None when it is not a logjam record.

    The common case (good meta, JSON body) is mapped in C (``_courierenc.c``) when it is
    built; everything else, and everything without it, by :func:`record_to_event_py`.
    """
    frames = record.frames
    if record.kind != KIND_LOGJAM or len(frames) < 4 or frames[0] == b"heartbeat":
        return None     # heartbeats are spooled for the gapless archive only
    if _courierenc is not None:
        ev = _courierenc.event(frames, _prefix(frames[0], frames[1], hostname), decompress)
        if ev is not None:
            return ev
    return record_to_event_py(record, hostname)


def record_to_event_py(record: Record, hostname: str) -> bytes | None:
    """:func:`record_to_event` in Python alone (the reference for the C mapping).

    ``{"@timestamp", "app", "env", "topic", "host", "logjam": {"device", "sequence",
    "created_ms"}, "payload": <decoded JSON body>}``; a body that is not JSON becomes
    ``"message": <text>, "tags": ["_logjam_body_not_json"]`` (see docs/courier.md).
    """
    if record.kind != KIND_LOGJAM or len(record.frames) < 4 or record.frames[0] == b"heartbeat":
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
            raw = decompress(body, comp)
        except LogjamError:
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


# ------------------------------------------------------------------------- writer


class _Batch:
    __slots__ = ("nonce", "last", "events", "acked", "base", "sent", "sent_at",
                 "transmissions")

    def __init__(self, nonce: bytes, last: Position, events: list[bytes]):
        self.nonce = nonce
        self.last = last          # spool position of the payload's last record
        self.events = events
        self.acked = 0            # events acknowledged by the receiver (absolute)
        self.base = 0             # first event of the current transmission
        self.sent = False         # sent on the current connection
        self.sent_at = 0.0
        self.transmissions = 0

    @property
    def done(self) -> bool:
        return self.acked >= len(self.events)


def _new_nonce() -> bytes:
    return os.urandom(16)


class CourierOutput:
    """The Courier writer on one spool reader. ``await output.run()`` until cancelled."""

    def __init__(self, config: CourierConfig, reader: SpoolReader, *, clock=None):
        self.config = config
        self.reader = reader
        self._clock = clock or trio.current_time
        self._ssl = config.tls.client_context()
        self._batches: deque[_Batch] = deque()
        self._by_nonce: dict[bytes, _Batch] = {}
        self._wake = trio.Event()
        self._shutdown = False
        self._finished = False
        self._progress = False       # the current connection acknowledged something
        self._peer_eof = trio.Event()
        self._rl = RateLimitedLog(log)
        self.connected_to: tuple[str, int] | None = None
        self.streaming = False
        # counters
        self.events_sent = 0
        self.payloads_sent = 0
        self.bytes_sent = 0
        self.events_acked = 0
        self.payloads_acked = 0
        self.events_resent = 0
        self.payloads_resent = 0
        self.reconnects = 0
        self.connections = 0
        self.keepalive_acks = 0
        self.pings_sent = 0
        self.events_skipped = 0
        self.events_dropped = 0
        self.errors: dict[str, int] = {}
        self.rtt_last = 0.0
        self.rtt_max = 0.0
        self.rtt_sum = 0.0
        self.rtt_count = 0

    # ---------------------------------------------------------------- public

    def request_shutdown(self) -> None:
        """Stop taking new records; finish the payloads in flight, half-close, return."""
        self._shutdown = True
        self._wake.set()

    @property
    def unacked_events(self) -> int:
        return sum(len(b.events) - b.acked for b in self._batches)

    def stats(self) -> dict:
        try:
            spool = self.reader.stats()
        except Exception:  # pragma: no cover - a reader without stats
            spool = {}
        return {
            "connected": int(self.connected_to is not None),
            "streaming": int(self.streaming),
            "events_sent": self.events_sent,
            "payloads_sent": self.payloads_sent,
            "bytes_sent": self.bytes_sent,
            "events_acked": self.events_acked,
            "payloads_acked": self.payloads_acked,
            "events_resent": self.events_resent,
            "payloads_resent": self.payloads_resent,
            "reconnects": self.reconnects,
            "connections": self.connections,
            "keepalive_acks": self.keepalive_acks,
            "pings_sent": self.pings_sent,
            "events_skipped": self.events_skipped,
            "events_dropped": self.events_dropped,
            "pending_payloads": len(self._batches),
            "unacked_events": self.unacked_events,
            "backlog_records": spool.get("backlog_records", 0),
            "payload_rtt_last_seconds": self.rtt_last,
            "payload_rtt_max_seconds": self.rtt_max,
            "payload_rtt_sum_seconds": self.rtt_sum,
            "payload_rtt_count": self.rtt_count,
            "errors": dict(self.errors),
        }

    async def run(self) -> None:
        """Forward until cancelled (or until a requested shutdown has finished)."""
        cfg = self.config
        self.reader.rewind()
        backoff = cfg.backoff_initial
        idx = 0
        while True:
            if self._shutdown and not self._batches:
                return
            host, port = cfg.hosts[idx % len(cfg.hosts)]
            self._progress = False
            try:
                await self._connection(host, port)
            except _NET_ERRORS as e:
                reason = _reason(e)
                self.errors[reason] = self.errors.get(reason, 0) + 1
                self._rl.warning(reason, "courier %s:%d: %s: %s", host, port, reason,
                                 e.__cause__ or e or type(e).__name__)
            finally:
                self.connected_to = None
            if self._finished:
                return
            self.reconnects += 1
            if self._progress:
                backoff = cfg.backoff_initial
            else:
                idx += 1
            await trio.sleep(backoff * random.uniform(0.8, 1.0))
            backoff = min(max(backoff * 2, 0.001), cfg.backoff_max)

    # ------------------------------------------------------------ connection

    async def _connection(self, host: str, port: int) -> None:
        """One connection; returns after a graceful shutdown, raises when it fails."""
        cfg = self.config
        with trio.fail_after(cfg.network_timeout):
            stream = await connect(host, port, ssl_context=self._ssl,
                                   server_name=cfg.tls.server_name)
        self.connections += 1
        conn = ClientConnection(max_pending=cfg.max_pending,
                                network_timeout=cfg.network_timeout,
                                idle_ping=cfg.idle_ping, allow_streaming=cfg.streaming,
                                compress_level=cfg.compress_level)
        self._peer_eof = trio.Event()
        for b in self._batches:
            b.sent = False
            b.base = b.acked
        try:
            await stream.send_all(conn.start(self._clock()))
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._receive_loop, stream, conn, (host, port))
                    await self._send_loop(stream, conn)
                    nursery.cancel_scope.cancel()
            except BaseExceptionGroup as eg:
                leaves = _leaves(eg)
                if all(isinstance(x, Exception) for x in leaves):
                    raise leaves[0] from leaves[0].__cause__   # keep the TLS cause
                raise
        finally:
            if self._finished and not isinstance(stream, trio.SocketStream):
                with trio.move_on_after(self.config.shutdown_timeout) as scope:
                    try:
                        await stream.aclose()   # TLS close_notify
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
                if scope.cancelled_caught:
                    await trio.aclose_forcefully(stream)
            else:
                await trio.aclose_forcefully(stream)

    async def _receive_loop(self, stream, conn: ClientConnection, peer) -> None:
        while True:
            data = await stream.receive_some(65536)
            if not data:
                if self._finished:
                    self._peer_eof.set()
                    return
                raise CourierError("eof", "connection closed by the receiver")
            conn.receive_data(data)
            now = self._clock()
            while (ev := conn.next_event(now)) is not None:
                if isinstance(ev, PayloadAck):
                    self._on_ack(ev, now)
                elif isinstance(ev, HandshakeComplete):
                    self.streaming = ev.streaming
                    self.connected_to = peer
                else:   # Pong
                    self._progress = True
            self._wake.set()

    def _on_ack(self, ev: PayloadAck, now: float) -> None:
        if not ev.advanced:
            self.keepalive_acks += 1
            return
        self._progress = True
        b = self._by_nonce.get(ev.nonce)
        if b is None:    # pragma: no cover - the core only reports nonces we registered
            return
        b.acked = b.base + ev.sequence
        self.events_acked += ev.advanced
        if ev.complete:
            b.acked = len(b.events)
            rtt = now - b.sent_at
            self.rtt_last = rtt
            self.rtt_sum += rtt
            self.rtt_count += 1
            if rtt > self.rtt_max:
                self.rtt_max = rtt
        self._pop_done()

    def _pop_done(self) -> None:
        """Acknowledge completed payloads to the spool, strictly in order."""
        batches = self._batches
        while batches and batches[0].done:
            done = batches.popleft()
            del self._by_nonce[done.nonce]
            if done.events:
                self.payloads_acked += 1
            self.reader.ack(done.last)

    def _read_batches(self) -> bool:
        """Turn the next ``payload_size`` spool records into payload(s); False if none."""
        cfg = self.config
        records = self.reader.read(cfg.payload_size)
        if not records:
            return False
        events: list[bytes] = []
        size = 0
        if True:
            for i, rec in enumerate(records):
                ev = record_to_event(rec, cfg.hostname)
                if ev is None:
                    self.events_skipped += 1
                    continue
                if len(ev) > cfg.max_event_bytes:
                    self.events_dropped += 1
                    self._rl.warning("event_too_large", "courier: dropped a %d-byte event",
                                     len(ev))
                    continue
                if events and size + len(ev) > cfg.max_payload_bytes:
                    self._add_batch(records[i - 1].position, events)
                    events, size = [], 0
                events.append(ev)
                size += len(ev) + 4
        self._add_batch(records[-1].position, events)
        self._pop_done()   # a payload of skipped records only is done at once
        return True

    def _add_batch(self, last: Position, events: list[bytes]) -> _Batch:
        b = _Batch(_new_nonce(), last, events)
        while b.nonce in self._by_nonce:   # pragma: no cover - 2**-128
            b.nonce = _new_nonce()
        self._batches.append(b)
        self._by_nonce[b.nonce] = b
        return b

    async def _send_batch(self, stream, conn: ClientConnection, b: _Batch, now: float) -> None:
        events = b.events[b.base:] if b.base else b.events
        data = conn.send_payload(b.nonce, events, now)
        b.sent = True
        b.sent_at = now
        b.transmissions += 1
        if b.transmissions > 1:
            self.payloads_resent += 1
            self.events_resent += len(events)
        self.payloads_sent += 1
        self.events_sent += len(events)
        self.bytes_sent += len(data)
        await stream.send_all(data)

    async def _send_loop(self, stream, conn: ClientConnection) -> None:
        while True:
            self._wake = trio.Event()
            now = self._clock()
            conn.check(now)
            if conn.ready:
                while conn.can_send():
                    # payloads not sent on this connection yet (resends first, in order) ...
                    for b in list(self._batches):
                        if not conn.can_send():
                            break
                        if not b.sent and not b.done:
                            await self._send_batch(stream, conn, b, self._clock())
                    # ... then new ones from the spool
                    if not conn.can_send() or self._shutdown or not self._read_batches():
                        break
                now = self._clock()
                if conn.want_ping(now):
                    self.pings_sent += 1
                    await stream.send_all(conn.ping(now))
                if self._shutdown and not self._batches and conn.idle:
                    await self._graceful_close(stream)
                    return
            want_records = (conn.ready and conn.can_send() and not self._shutdown
                            and all(b.sent or b.done for b in self._batches))
            await self._wait(conn.deadline(), want_records)

    async def _wait(self, deadline: float, want_records: bool) -> None:
        if self._wake.is_set():
            return
        with trio.move_on_at(deadline):
            if not want_records:
                await self._wake.wait()
                return
            async with trio.open_nursery() as n:
                async def waiter(fn):
                    await fn()
                    n.cancel_scope.cancel()
                n.start_soon(waiter, self._wake.wait)
                n.start_soon(waiter, self.reader.wait)

    async def _graceful_close(self, stream) -> None:
        """After the last ACKN: half-close (TCP) or close_notify (TLS), await the peer's close."""
        self._finished = True
        with trio.move_on_after(self.config.shutdown_timeout):
            if isinstance(stream, trio.SocketStream):
                await stream.send_eof()
                await self._peer_eof.wait()
            # TLS has no half-close: close_notify is sent in _connection once the
            # receive task has stopped
        log.info("courier: shut down after the last ACKN")


def _reason(e: BaseException) -> str:
    """Metric label of a connection failure."""
    if isinstance(e, CourierError):
        return e.reason
    if isinstance(e, trio.TooSlowError):
        return "timeout"
    if isinstance(e, ssl.SSLError) or isinstance(e.__cause__, ssl.SSLError):
        return "tls"     # trio wraps handshake failures in BrokenResourceError
    return "io"


def _leaves(eg: BaseExceptionGroup) -> list[BaseException]:
    out = []
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            out.extend(_leaves(e))
        else:
            out.append(e)
    return out
