"""The Lumberjack v1 output: forwards spooled logjam messages to Logstash / go-lumber readers.

One :class:`LumberjackOutput` per configured output.  It reads records from its
:class:`~logjam_relay.spool.api.SpoolReader`, maps each logjam message to one event
(see ``docs/lumberjack.md``), and writes windows:

* ``1W n`` then the n events as ``1D`` frames (``compression=0``) or as ONE ``1C`` frame;
  each window is written with a single ``send_all`` on a TCP_NODELAY socket;
* sequence numbers restart at 1 in every window, so go-lumber's ACK (the count),
  jls-lumberjack's (the last seq) and the Java beats input's (the highest seq) are all n;
  an ACK equal to the count or to the last sequence completes the window, smaller ACKs
  (partial) are ignored, ``A 0`` keep-alives extend the window's deadline;
* up to ``pipeline`` windows are in flight (ACKs arrive in window order); when a
  connection with several windows in flight times out before its first ACK, or a partial
  ACK arrives, the output falls back to stop-and-wait (``pipeline=1``) for that host for
  ``PIPELINE_RETRY_AFTER`` (10 min), then tries pipelining again;
* a window is all-or-nothing: on close, timeout or any error the connection is dropped,
  and after a reconnect (exponential backoff with jitter, failover over the hosts) every
  unacknowledged window is resent (duplicates are possible, losses are not);
* the spool position of a window's last record is acknowledged to the source once the
  reader acknowledged the window.

Network errors never escape :meth:`LumberjackOutput.run`; a bug does, and the
supervisor restarts the task (which then rewinds its source to the first unacked record).
"""

from __future__ import annotations

import logging
import math
import random
import socket
import ssl
import struct
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

import trio

from .. import _native
from ..io.net import TLSSettings, connect, parse_hostport
from ..protocols import lumberjack as lj
from ..protocols.logjam import HEARTBEAT, LogjamError, decompress, split_app_env, unpack_meta
from ..ratelimit import RateLimitedLog
from ..spool.api import KIND_LOGJAM, Position, Record, SpoolReader

log = logging.getLogger("logjam_relay.outputs.lumberjack")

DEFAULT_PORT = 5044

#: Compress a window in a worker thread (zlib releases the GIL) when it is larger than this.
THREAD_COMPRESS_MIN = 256 * 1024
# after a fallback to stop-and-wait, a host gets pipelined windows again after this long
PIPELINE_RETRY_AFTER = 600.0


# ------------------------------------------------------------------------ config


@dataclass(frozen=True, slots=True)
class LumberjackConfig:
    hosts: tuple[tuple[str, int], ...]
    window: int = 1000
    compression: int = 3                  # zlib level; 0 = plain D frames
    timeout: float = 30.0                 # connect+handshake, and per window until its ACK
    tls: TLSSettings = field(default_factory=TLSSettings)
    backoff_min: float = 0.5
    backoff_max: float = 30.0
    pipeline: int = 4                     # windows in flight; 1 = stop-and-wait
    loadbalance: bool = False             # pick a random host per connection
    relay_host: str = field(default_factory=socket.gethostname)
    name: str = "lumberjack"

    def __post_init__(self):
        if not self.hosts:
            raise ValueError("hosts: at least one host is needed")
        if not 1 <= self.window <= lj.MAX_WINDOW:
            raise ValueError(f"window: {self.window} not in 1..{lj.MAX_WINDOW}")
        if not 0 <= self.compression <= 9:
            raise ValueError(f"compression: {self.compression} not in 0..9")
        if not self.timeout > 0:
            raise ValueError(f"timeout: {self.timeout} must be > 0")
        if not 1 <= self.pipeline <= 64:
            raise ValueError(f"pipeline: {self.pipeline} not in 1..64")
        if not 0 < self.backoff_min <= self.backoff_max:
            raise ValueError("backoff_min/backoff_max: need 0 < backoff_min <= backoff_max")


_TRUE = {"on", "true", "yes", "1"}
_FALSE = {"off", "false", "no", "0"}


def _bool(name: str, v: str) -> bool:
    lv = v.lower()
    if lv in _TRUE:
        return True
    if lv in _FALSE:
        return False
    raise ValueError(f"lumberjack URL: parameter {name!r}: expected on/off, got {v!r}")


def _num(name: str, v: str, conv):
    try:
        x = conv(v)
    except ValueError:
        raise ValueError(f"lumberjack URL: parameter {name!r}: "
                         f"expected {'an integer' if conv is int else 'a number'}, "
                         f"got {v!r}") from None
    if conv is float and not math.isfinite(x):
        raise ValueError(f"lumberjack URL: parameter {name!r}: expected a finite number, got {v!r}")
    return x


def parse_url(url: str, **overrides) -> LumberjackConfig:
    """``lumberjack://h1:5044,h2:5044?window=1000&compression=3&tls=on&ca=...&cert=...
    &key=...&server_name=...&verify=on&timeout=30&pipeline=4&loadbalance=off
    &backoff_min=0.5&backoff_max=30&relay_host=...&name=...`` -> :class:`LumberjackConfig`.

    TLS is on unless ``tls=off``; the port defaults to 5044.  Raises ValueError naming
    the offending parameter.  ``overrides`` are passed to the config as keyword arguments.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "lumberjack":
        raise ValueError(f"lumberjack URL: scheme must be 'lumberjack://', got {url!r}")
    netloc, _, query = rest.partition("?")
    netloc = netloc.rstrip("/")
    if not netloc:
        raise ValueError("lumberjack URL: no host given")
    hosts = []
    for part in netloc.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"lumberjack URL: empty host in {netloc!r}")
        try:
            h, p = parse_hostport(part, DEFAULT_PORT)
        except ValueError:
            raise ValueError(f"lumberjack URL: bad host:port {part!r}") from None
        if not h or not 0 < p < 65536:
            raise ValueError(f"lumberjack URL: bad host:port {part!r}")
        hosts.append((h, p))
    kw: dict = {}
    tls: dict = {}
    seen = set()
    for k, v in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if k in seen:
            raise ValueError(f"lumberjack URL: parameter {k!r} given twice")
        seen.add(k)
        if k in ("window", "compression", "pipeline"):
            kw[k] = _num(k, v, int)
        elif k in ("timeout", "backoff_min", "backoff_max"):
            kw[k] = _num(k, v, float)
        elif k == "loadbalance":
            kw[k] = _bool(k, v)
        elif k in ("relay_host", "name"):
            if not v:
                raise ValueError(f"lumberjack URL: parameter {k!r} is empty")
            kw[k] = v
        elif k == "tls":
            tls["enabled"] = _bool(k, v)
        elif k == "verify":
            tls["verify"] = _bool(k, v)
        elif k in ("ca", "cert", "key", "server_name"):
            if not v:
                raise ValueError(f"lumberjack URL: parameter {k!r} is empty")
            tls[k] = v
        else:
            raise ValueError(f"lumberjack URL: unknown parameter {k!r}")
    kw.update(overrides)
    kw.setdefault("tls", TLSSettings(**tls))
    try:
        return LumberjackConfig(hosts=tuple(hosts), **kw)
    except ValueError as e:
        raise ValueError(f"lumberjack URL: parameter {e}") from None


# ----------------------------------------------------------------- event mapping

_u32 = struct.Struct(">I").pack
_ljencode = _native.load("logjam_relay.outputs._ljencode")   # the optional C event mapping
_hdr_d = struct.Struct(">2sII").pack


def _k(key: bytes) -> bytes:
    return _u32(len(key)) + key


def _kv(key: bytes, value: bytes) -> bytes:
    return _k(key) + _u32(len(value)) + value


_K_LINE = _k(b"line")
_K_DEVICE = _k(b"device")
_K_SEQUENCE = _k(b"sequence")
_K_CREATED = _k(b"created_ms")
_TAG_DECODE_ERROR = _kv(b"tags", b"logjam_decode_error")
_PAIRS_OK = 9
_PAIRS_ERROR = 10


class EventEncoder:
    """Maps logjam records to ``1D`` frames (the documented, stable event mapping).

    Fields: ``line`` (decompressed JSON body), ``app``, ``env`` (app-env split at the
    last ``-``), ``topic``, ``device``, ``sequence``, ``created_ms``, ``host`` (relay host),
    ``type`` = ``logjam``; plus ``tags`` = ``logjam_decode_error`` when the body or the
    meta frame cannot be decoded (``line`` is then the raw body as text).
    """

    def __init__(self, relay_host: str):
        self._tail = _kv(b"host", relay_host.encode()) + _kv(b"type", b"logjam")
        self._stream_cache: dict[tuple[bytes, bytes], bytes] = {}
        self.decode_errors = 0

    def _stream_pairs(self, app_env: bytes, topic: bytes) -> bytes:
        key = (app_env, topic)
        r = self._stream_cache.get(key)
        if r is None:
            app, env = split_app_env(app_env)
            r = (_kv(b"app", app.encode()) + _kv(b"env", env.encode())
                 + _kv(b"topic", topic.decode("utf-8", "replace").encode()))
            if len(self._stream_cache) >= 10_000:
                self._stream_cache.clear()
            self._stream_cache[key] = r
        return r

    def encode(self, records: list[Record]) -> tuple[bytes, int]:
        """``1D`` frames (seq 1..n) for the logjam records; (bytes, n).

        Records of other kinds are skipped (not forwarded).  Uses the C mapping
        (``_ljencode.c``) when it is built; :meth:`encode_py` otherwise (same bytes).
        """
        if _ljencode is None:
            return self.encode_py(records)
        return _ljencode.encode(records, KIND_LOGJAM, self._tail, self._stream_cache,
                                self._stream_pairs, decompress, self._encode_one)

    def encode_py(self, records: list[Record]) -> tuple[bytes, int]:
        """:meth:`encode` in Python alone (the reference for the C mapping)."""
        parts: list[bytes] = []
        append = parts.append
        seq = 0
        encode_one = self._encode_one
        for rec in records:
            frames = rec.frames
            if rec.kind != KIND_LOGJAM or (frames and frames[0] == HEARTBEAT):
                continue            # heartbeats are spooled for the gapless archive only
            seq += 1
            append(encode_one(frames, seq))
        return b"".join(parts), seq

    def _encode_one(self, frames, seq: int) -> bytes:
        """The ``1D`` frame of one logjam message (any frames, decodable or not)."""
        ok = True
        try:
            app_env, topic, body, meta = frames
            _tag, comp, _ver, device, created_ms, sequence = unpack_meta(meta)
        except (ValueError, struct.error):
            ok = False
            app_env = frames[0] if frames else b""
            topic = frames[1] if len(frames) > 1 else b""
            body = frames[2] if len(frames) > 2 else b""
            d = s = c = b""
        else:
            d = b"%d" % device
            s = b"%d" % sequence
            c = b"%d" % created_ms
            if comp:
                try:
                    body = decompress(body, comp)
                except LogjamError:
                    ok = False
        if not ok:
            self.decode_errors += 1
            body = bytes(body).decode("utf-8", "replace").encode()
        return b"".join((
            _hdr_d(b"1D", seq, _PAIRS_OK if ok else _PAIRS_ERROR), _K_LINE, _u32(len(body)),
            body, self._stream_pairs(app_env, topic),
            _K_DEVICE, _u32(len(d)), d, _K_SEQUENCE, _u32(len(s)), s,
            _K_CREATED, _u32(len(c)), c, self._tail,
            b"" if ok else _TAG_DECODE_ERROR))


# ------------------------------------------------------------------------ output


class _Window:
    __slots__ = ("data", "count", "last_pos", "sent_at", "resends")

    def __init__(self, data: bytes, count: int, last_pos: Position):
        self.data = data
        self.count = count
        self.last_pos = last_pos
        self.sent_at: float | None = None     # None = never sent
        self.resends = 0


class _SessionEnd(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


_NET_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError,
               trio.TooSlowError, ssl.SSLError, lj.LumberjackError, _SessionEnd)


class LumberjackOutput:
    """One Lumberjack output task: ``await LumberjackOutput(source, config).run()``."""

    def __init__(self, source: SpoolReader, config: LumberjackConfig, *,
                 rng: random.Random | None = None):
        self.source = source
        self.config = config
        self._rng = rng or random.Random()
        self._encoder = EventEncoder(config.relay_host)
        self._ssl_context = config.tls.client_context()
        self._pending: deque[_Window] = deque()   # unacked windows, oldest first
        self._sent = 0                  # how many of _pending were sent on this connection
        self._host_index = 0
        # hosts on stop-and-wait after a fallback -> trio time when pipelining is tried again
        self._stop_and_wait_until: dict[tuple[str, int], float] = {}
        self._space = trio.Event()
        self._recv_scope: trio.CancelScope | None = None
        self._head_since = 0.0
        self._acks_this_conn = 0
        self._failures = 0              # consecutive failed attempts (for the backoff)
        self._rlog = RateLimitedLog(log)
        self.connected_to: tuple[str, int] | None = None
        # plain counters
        self.events_sent = 0
        self.events_acked = 0
        self.events_resent = 0
        self.windows_sent = 0
        self.windows_acked = 0
        self.windows_resent = 0
        self.bytes_sent = 0
        self.connect_attempts = 0
        self.connect_failures = 0
        self.connections = 0
        self.disconnects: dict[str, int] = {}
        self.partial_acks = 0
        self.keepalives = 0
        self.skipped_records = 0
        self.pipeline_fallbacks = 0
        self.rtt_last = 0.0
        self.rtt_sum = 0.0
        self.rtt_max = 0.0
        self.rtt_count = 0

    # -- metrics ------------------------------------------------------------

    def stats(self) -> dict:
        c = self.config
        return {
            "events_sent": self.events_sent,
            "events_acked": self.events_acked,
            "events_resent": self.events_resent,
            "windows_sent": self.windows_sent,
            "windows_acked": self.windows_acked,
            "windows_resent": self.windows_resent,
            "windows_in_flight": len(self._pending),
            "bytes_sent": self.bytes_sent,
            "connect_attempts": self.connect_attempts,
            "connect_failures": self.connect_failures,
            "connections": self.connections,
            "connected": 1 if self.connected_to else 0,
            "disconnects": dict(self.disconnects),
            "partial_acks": self.partial_acks,
            "keepalives": self.keepalives,
            "decode_errors": self._encoder.decode_errors,
            "skipped_records": self.skipped_records,
            "pipeline_fallbacks": self.pipeline_fallbacks,
            "window_rtt_last_seconds": self.rtt_last,
            "window_rtt_sum_seconds": self.rtt_sum,
            "window_rtt_max_seconds": self.rtt_max,
            "window_rtt_count": self.rtt_count,
            "config": {"window": c.window, "compression": c.compression,
                       "pipeline": c.pipeline, "hosts": len(c.hosts)},
        }

    # -- main loop ----------------------------------------------------------

    async def run(self) -> None:
        """Forward until cancelled. Never returns; network errors are handled here."""
        self.source.rewind()      # after a supervisor restart: resend what was unacked
        cfg = self.config
        while True:
            host = self._next_host()
            self.connect_attempts += 1
            try:
                with trio.fail_after(cfg.timeout):
                    stream = await connect(host[0], host[1], ssl_context=self._ssl_context,
                                           server_name=cfg.tls.server_name)
            except (*_NET_ERRORS, ValueError) as e:
                self.connect_failures += 1
                self._failures += 1
                self._rlog.warning("connect", "lumberjack %s: connect to %s:%d failed: %r",
                                   cfg.name, host[0], host[1], e)
                self._host_index += 1      # failover to the next host
                await self._backoff()
                continue
            self.connections += 1
            self.connected_to = host
            reason = "closed"
            try:
                reason = await self._session(stream, host)
            finally:
                self.connected_to = None
                self._recv_scope = None
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(stream)
            self.disconnects[reason] = self.disconnects.get(reason, 0) + 1
            if self._acks_this_conn:
                self._failures = 0
            else:
                self._host_index += 1
            self._failures += 1
            await self._backoff()

    def _next_host(self) -> tuple[str, int]:
        hosts = self.config.hosts
        if self.config.loadbalance and len(hosts) > 1:
            return hosts[self._rng.randrange(len(hosts))]
        return hosts[self._host_index % len(hosts)]

    async def _backoff(self) -> None:
        c = self.config
        n = max(self._failures - 1, 0)
        delay = min(c.backoff_max, c.backoff_min * (2 ** min(n, 30)))
        await trio.sleep(delay * (0.5 + 0.5 * self._rng.random()))

    async def _session(self, stream: trio.abc.Stream, host: tuple[str, int]) -> str:
        """Run one connection until it fails; returns the reason (a metric label)."""
        self._sent = 0
        self._acks_this_conn = 0
        self._head_since = trio.current_time()
        failure: list[BaseException] = []

        async def guard(fn, *args):
            try:
                await fn(*args)
            except _NET_ERRORS as e:
                if not failure:
                    failure.append(e)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(guard, self._recv_loop, stream, host)
            nursery.start_soon(guard, self._send_loop, stream, host)
        e = failure[0] if failure else None
        reason = getattr(e, "reason", None) or (
            "timeout" if isinstance(e, trio.TooSlowError) else "io_error")
        self._rlog.warning(reason, "lumberjack %s: connection to %s:%d lost (%s), %d window(s) "
                           "unacknowledged: %s", self.config.name, host[0], host[1], reason,
                           len(self._pending), e)
        return reason

    async def _send_loop(self, stream: trio.abc.Stream, host) -> None:
        cfg = self.config
        source = self.source
        while True:
            depth = self._depth(host)
            if self._sent < len(self._pending):
                if self._sent < depth:
                    win = self._pending[self._sent]
                    if win.sent_at is not None:
                        win.resends += 1
                        self.windows_resent += 1
                        self.events_resent += win.count
                    await self._send_window(stream, win)
                    continue
                await self._wait_space()
                continue
            if len(self._pending) >= depth:
                await self._wait_space()
                continue
            records = source.read(cfg.window)
            if not records:
                await source.wait()
                continue
            win = await self._make_window(records)
            if win is None:
                continue
            self._pending.append(win)
            if len(self._pending) == 1:
                self._head_since = trio.current_time()
                self._update_deadline()
            await self._send_window(stream, win)

    async def _send_window(self, stream, win: _Window) -> None:
        self._sent += 1
        win.sent_at = trio.current_time()
        await stream.send_all(win.data)
        self.windows_sent += 1
        self.events_sent += win.count
        self.bytes_sent += len(win.data)

    async def _make_window(self, records: list[Record]) -> _Window | None:
        frames, n = self._encoder.encode(records)
        last = records[-1].position
        self.skipped_records += len(records) - n
        if n == 0:
            # nothing to forward: the positions are done once everything before them is
            if self._pending:
                self._pending[-1].last_pos = last
            else:
                self.source.ack(last)
            return None
        level = self.config.compression
        if level and len(frames) >= THREAD_COMPRESS_MIN:
            # shielded: a cancelled session must not lose records already read
            with trio.CancelScope(shield=True):
                data = await trio.to_thread.run_sync(lj.encode_window, frames, n, level)
        else:
            data = lj.encode_window(frames, n, level)
        return _Window(data, n, last)

    async def _wait_space(self) -> None:
        self._space = trio.Event()
        await self._space.wait()

    def _update_deadline(self) -> None:
        scope = self._recv_scope
        if scope is not None:
            scope.deadline = (self._head_since + self.config.timeout) if self._pending \
                else math.inf

    async def _recv_loop(self, stream: trio.abc.Stream, host) -> None:
        conn = lj.Connection(lj.Role.WRITER)
        while True:
            with trio.CancelScope() as scope:
                self._recv_scope = scope
                self._update_deadline()
                data = await stream.receive_some(4096)
            self._recv_scope = None
            if scope.cancelled_caught:
                if self._acks_this_conn == 0 and self._sent > 1:
                    self._fallback(host, f"no ACK with {self._sent} windows in flight")
                raise _SessionEnd("timeout", f"no ACK within {self.config.timeout}s")
            conn.receive_data(data)
            while True:
                ev = conn.next_event()
                if ev is lj.NEED_DATA:
                    break
                if type(ev) is lj.Ack:
                    self._on_ack(ev.seq, host)
                elif type(ev) is lj.KeepAlive:
                    self.keepalives += 1
                    self._head_since = trio.current_time()
                elif type(ev) is lj.ConnectionClosed:
                    raise _SessionEnd("closed_by_peer", "connection closed by the reader")

    def _depth(self, host) -> int:
        """Windows allowed in flight to ``host``: ``pipeline``, or 1 for a while after a
        fallback (a reader restarted or replaced may well pipeline again)."""
        until = self._stop_and_wait_until.get(host)
        if until is None:
            return self.config.pipeline
        if trio.current_time() < until:
            return 1
        del self._stop_and_wait_until[host]
        log.info("lumberjack %s: trying %d windows in flight to %s:%d again",
                 self.config.name, self.config.pipeline, host[0], host[1])
        return self.config.pipeline

    def _fallback(self, host, why: str) -> None:
        if self._depth(host) > 1:
            self._stop_and_wait_until[host] = trio.current_time() + PIPELINE_RETRY_AFTER
            self.pipeline_fallbacks += 1
            log.warning("lumberjack %s: %s from %s:%d; stop-and-wait for the next %.0f s",
                        self.config.name, why, host[0], host[1], PIPELINE_RETRY_AFTER)

    def _on_ack(self, value: int, host) -> None:
        if not self._pending or self._sent == 0:
            raise _SessionEnd("unexpected_ack", f"ACK {value} with no window in flight")
        win = self._pending[0]
        if not lj.ack_completes(value, 1, win.count):
            if value > win.count:
                raise _SessionEnd("unexpected_ack", f"ACK {value} for a window of {win.count}")
            # A partial ACK.  No known v1 reader sends one for a window it understood
            # (go-lumber does for a C frame with more events than W).  As every window
            # restarts at seq 1, ACKs of pipelined windows would become ambiguous: go
            # stop-and-wait for this host; with one window in flight wait for the rest
            # (or the timeout), with more reconnect and resend.
            self.partial_acks += 1
            self._fallback(host, f"partial ACK {value} for a window of {win.count}")
            if self._sent > 1:
                raise _SessionEnd("partial_ack", f"partial ACK {value} with "
                                  f"{self._sent} windows in flight")
            return
        self._pending.popleft()
        self._sent -= 1
        self._acks_this_conn += 1
        now = trio.current_time()
        rtt = now - win.sent_at
        self.rtt_last = rtt
        self.rtt_sum += rtt
        self.rtt_count += 1
        if rtt > self.rtt_max:
            self.rtt_max = rtt
        self.windows_acked += 1
        self.events_acked += win.count
        self._head_since = now
        self.source.ack(win.last_pos)
        self._space.set()


async def run(source: SpoolReader, config: LumberjackConfig) -> None:
    """Run one Lumberjack output until cancelled (see :class:`LumberjackOutput`)."""
    await LumberjackOutput(source, config).run()

