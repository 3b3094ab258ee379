"""CMDP sender: the relay's metrics (STAT topics) and log records (LOG topics) on an XPUB.

* :class:`CMDPConfig` - the configuration (``--cmdp-port`` etc.); CMDP is **off** by default.
* :class:`CMDPSender` - trio task owning the XPUB socket (and the CHIRP beacon).  Publishes
  only subscribed topics, answers ``STAT?`` / ``LOG?`` subscriptions with the topic list,
  sends the stats provider's metrics every ``interval`` seconds.
* :class:`CMDPLogHandler` - ``logging.Handler`` that feeds LOG topics through a bounded
  queue; never blocks, drops (and counts) when full, ignores records of the sender itself.
* :class:`ProcessStats`, :class:`LoopLag` - CPU/RSS and trio loop lag.
* :class:`RelayStatsProvider` - turns component ``stats()`` dicts into CMDP metrics.

A stats provider is any ``Callable[[], Mapping[str, Stat | tuple]]`` returning metric
name -> ``Stat(value, type, unit, description)`` (a 3- or 4-tuple works too).  Names are
upper-cased and sanitized to ``[A-Z0-9_/]``.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import resource
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import trio
import zmq

from ..io import zmq_trio
from ..io.peers import set_domain as set_zap_domain
from ..io.xpubthread import ThreadedPub
from ..protocols import chirp as chirp_proto
from ..protocols.cmdp import LogLevel, MetricType, Publisher, level_from_levelno, sanitize_name
from ..ratelimit import RateLimitedLog
from .chirp import ChirpBeacon, resolve_interfaces

LOGGER_NAME = "logjam_relay.health.cmdp"
log = logging.getLogger(LOGGER_NAME)

TYPE_NAME = "LogjamRelay"
_WORD = re.compile(r"\w+\Z", re.ASCII)


# --------------------------------------------------------------------------- config


def default_name() -> str:
    host = re.sub(r"\W", "_", socket.gethostname().split(".")[0], flags=re.ASCII)
    return host or "relay"


def canonical_name(name: str | None) -> str:
    """``Type.Name`` as Constellation wants it: ``NAME`` -> ``LogjamRelay.NAME``."""
    name = name or default_name()
    parts = name.split(".")
    if len(parts) == 1:
        parts = [TYPE_NAME, parts[0]]
    if len(parts) != 2 or not all(_WORD.match(p) for p in parts):
        raise ValueError(f"CMDP name {name!r}: want NAME or TYPE.NAME, word characters only")
    return ".".join(parts)


@dataclass(frozen=True, slots=True)
class CMDPConfig:
    """CMDP/CHIRP settings.  CLI: ``--cmdp-port N`` (0 = off), ``--cmdp-name NAME``,
    ``--chirp-group GROUP``, ``--chirp-interface IFACE``."""

    cmdp_port: int = 0  # 0 = CMDP (and CHIRP) off - the default, see docs/cmdp.md
    cmdp_name: str | None = None  # None: LogjamRelay.<short hostname>
    chirp_group: str = "logjam"
    chirp_interface: str | None = None  # None: all multicast interfaces (+127.0.0.1)
    chirp_enabled: bool = True  # advertise via CHIRP whenever CMDP is on
    cmdp_bind: str = "*"  # address the XPUB binds to
    stat_interval: float = 1.0  # seconds between STAT rounds
    log_level: int = logging.INFO  # minimum level of records put on LOG topics
    log_queue_size: int = 10000
    snd_hwm: int = 10000
    max_subscriptions: int = 10000  # subscriptions the XPUB keeps (zmq_trio.SubscriptionGuard)
    wire_metric_type: bool = False  # True: draft-spec metric type 1..4 instead of 0 on the wire

    @property
    def enabled(self) -> bool:
        return self.cmdp_port != 0

    @property
    def canonical_name(self) -> str:
        return canonical_name(self.cmdp_name)

    def validate(self) -> None:
        if not 0 <= self.cmdp_port <= 65535:
            raise ValueError(f"cmdp_port {self.cmdp_port} out of range")
        if self.stat_interval <= 0:
            raise ValueError("stat_interval must be > 0")
        canonical_name(self.cmdp_name)
        if not self.chirp_group:
            raise ValueError("the CHIRP group name must not be empty")


class Stat(NamedTuple):
    value: Any
    type: MetricType = MetricType.LAST_VALUE
    unit: str = ""
    description: str = ""


StatsProvider = Callable[[], Mapping[str, Any]]


# --------------------------------------------------------------------------- process / loop


class ProcessStats:
    """CPU (from ``resource.getrusage``) and RSS (from ``/proc/self/statm``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._last = (clock(), self.cpu_seconds())

    @staticmethod
    def cpu_seconds() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def rss_bytes(self) -> int:
        try:
            with open("/proc/self/statm", "rb") as f:
                return int(f.read().split()[1]) * self._page
        except (OSError, ValueError, IndexError):  # not Linux: peak RSS (KiB on Linux/BSD)
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def cpu_percent(self) -> float:
        """Average CPU use (100 = one core) since the previous call."""
        now, cpu = self._clock(), self.cpu_seconds()
        t0, c0 = self._last
        self._last = (now, cpu)
        dt = now - t0
        return 100.0 * (cpu - c0) / dt if dt > 0 else 0.0

    def stats(self) -> dict[str, float]:
        return {"cpu_seconds": self.cpu_seconds(), "cpu_percent": self.cpu_percent(),
                "rss_bytes": self.rss_bytes()}


class LoopLag:
    """How late a ``trio.sleep(period)`` wakes up: a measure of event-loop saturation."""

    def __init__(self, period: float = 0.1):
        self.period = period
        self.last = 0.0
        self._max = 0.0
        self.max_ever = 0.0
        self.samples = 0

    def take_max(self) -> float:
        """The worst lag (s) since the previous call (the last sample if none since)."""
        m, self._max = self._max, 0.0
        return m if self.samples else 0.0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            t0 = trio.current_time()
            await trio.sleep(self.period)
            lag = max(0.0, trio.current_time() - t0 - self.period)
            self.last = lag
            self.samples += 1
            if lag > self._max:
                self._max = lag
                if lag > self.max_ever:
                    self.max_ever = lag

    def stats(self) -> dict[str, float]:
        return {"loop_lag_seconds": self.last}


# --------------------------------------------------------------------------- stats provider


def _num(d: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        v = d.get(k)
        if v is not None:
            return v
    return None


class RelayStatsProvider:
    """Build the relay's CMDP metrics from component stats (see docs/cmdp.md for keys).

    ``relay()`` -> {msgs_received, bytes_received, invalid: {reason: n}, pings,
    pub_drops, sequence}; ``outputs()`` -> {name: {backlog, acked, resends, reconnects,
    ack_rtt}}.  Missing keys are skipped.  Rates are computed here from counter deltas
    (per second, over the time between two calls).
    """

    def __init__(self, relay: Callable[[], Mapping[str, Any]] | None = None,
                 outputs: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
                 process: ProcessStats | None = None, loop_lag: LoopLag | None = None,
                 extra: StatsProvider | None = None, clock: Callable[[], float] = time.monotonic):
        self.relay = relay
        self.outputs = outputs
        self.process = process
        self.loop_lag = loop_lag
        self.extra = extra
        self._clock = clock
        self._prev: dict[str, tuple[float, float]] = {}

    def _rate(self, key: str, counter: float, now: float) -> float:
        prev = self._prev.get(key)
        self._prev[key] = (now, counter)
        if prev is None or now <= prev[0] or counter < prev[1]:
            return 0.0
        return (counter - prev[1]) / (now - prev[0])

    def __call__(self) -> dict[str, Stat]:
        now = self._clock()
        out: dict[str, Stat] = {}
        LV, RATE, AVG = MetricType.LAST_VALUE, MetricType.RATE, MetricType.AVERAGE
        if self.relay is not None:
            r = self.relay()
            n = _num(r, "msgs_received")
            if n is not None:
                out["INGEST_MSGS"] = Stat(n, LV, "", "messages received since start")
                out["INGEST_RATE"] = Stat(self._rate("msgs", n, now), RATE, "1/s",
                                          "messages received per second")
            b = _num(r, "bytes_received", "msgs_received_bytes")
            if b is not None:
                out["INGEST_BYTES"] = Stat(b, LV, "B", "bytes received since start")
                out["INGEST_BYTE_RATE"] = Stat(self._rate("bytes", b, now), RATE, "B/s",
                                               "bytes received per second")
            inv = r.get("invalid")
            if isinstance(inv, Mapping):
                out["INVALID_TOTAL"] = Stat(sum(inv.values()), LV, "",
                                            "invalid messages since start")
                for reason, cnt in inv.items():
                    out["INVALID_" + sanitize_name(str(reason))] = Stat(
                        cnt, LV, "", f"invalid messages ({reason})")
            for key, name, unit, desc in (("pings", "PINGS", "", "pings answered"),
                                          ("pub_drops", "PUB_DROPS", "", "PUB messages dropped at HWM"),
                                          ("sequence", "SEQUENCE", "", "current sequence number")):
                v = r.get(key)
                if v is not None:
                    out[name] = Stat(v, LV, unit, desc)
        if self.outputs is not None:
            for oname, o in self.outputs().items():
                p = "OUTPUT_" + sanitize_name(str(oname)) + "_"
                if (v := o.get("backlog")) is not None:
                    out[p + "BACKLOG"] = Stat(v, LV, "", f"{oname}: events not yet acknowledged")
                if (v := o.get("acked")) is not None:
                    out[p + "ACK_RATE"] = Stat(self._rate(p + "acked", v, now), RATE, "1/s",
                                               f"{oname}: events acknowledged per second")
                if (v := o.get("resends")) is not None:
                    out[p + "RESENDS"] = Stat(v, LV, "", f"{oname}: events resent")
                if (v := o.get("lost")) is not None:
                    out[p + "LOST"] = Stat(v, LV, "", f"{oname}: spooled records lost "
                                                      "(dropped, damaged or missing)")
                if (v := o.get("reconnects")) is not None:
                    out[p + "RECONNECTS"] = Stat(v, LV, "", f"{oname}: reconnects")
                if (v := o.get("dead_letters")) is not None:
                    out[p + "DEAD_LETTERS"] = Stat(v, LV, "", f"{oname}: events diverted to "
                                                   "the dead-letter store")
                if (v := o.get("ack_rtt")) is not None:
                    out[p + "ACK_RTT"] = Stat(round(v * 1000.0, 3), AVG, "ms",
                                              f"{oname}: acknowledgement round trip")
        if self.loop_lag is not None:
            out["LOOP_LAG"] = Stat(round(self.loop_lag.take_max() * 1000.0, 3), LV, "ms",
                                   "worst event-loop lag in the interval")
        if self.process is not None:
            out["CPU"] = Stat(round(self.process.cpu_percent(), 2), AVG, "%",
                              "CPU use of the relay process (100 = one core)")
            out["RSS"] = Stat(self.process.rss_bytes(), LV, "B", "resident set size")
        if self.extra is not None:
            out.update(self.extra())
        return out


# --------------------------------------------------------------------------- log handler


def component_of(logger_name: str) -> str:
    """``logjam_relay.outputs.courier`` -> ``OUTPUTS_COURIER``; ``root`` -> ``ROOT``."""
    if logger_name.startswith("logjam_relay."):
        logger_name = logger_name[len("logjam_relay."):]
    return sanitize_name(logger_name.replace(".", "_"))


# DEBUG/TRACE/CRITICAL records carry the source location (like the C++ CMDPSink);
# both spellings of the function name key: the spec says "funcname", every
# implementation sends "funcName".
_LOCATION_LEVELS = (LogLevel.TRACE, LogLevel.DEBUG, LogLevel.CRITICAL)

# A LOG message's size is bounded, so that the log queue and the XPUB's queue are (the RSS
# ceiling counts both, relay/memory.py): the text keeps its first MAX_LOG_TEXT bytes, a
# traceback its last MAX_LOG_TRACEBACK (where the error is), UTF-8; the rest of a message
# (header, component, location tags) stays under LOG_MESSAGE_OVERHEAD.
MAX_LOG_TEXT = 2048
MAX_LOG_TRACEBACK = 4096
LOG_MESSAGE_OVERHEAD = 1024
MAX_LOG_MESSAGE_BYTES = MAX_LOG_TEXT + MAX_LOG_TRACEBACK + 64 + LOG_MESSAGE_OVERHEAD
LOG_QUEUE_MAX_BYTES = 4 << 20        # the log queue: this many bytes, or maxsize records


def clip(text: str, limit: int, *, keep_end: bool = False) -> tuple[str, int]:
    """``text`` cut to ``limit`` UTF-8 bytes (its head, or its tail with ``keep_end``) with
    a note of what was cut; and the UTF-8 size of the result (at most ``limit`` + 64)."""
    if len(text) <= limit // 4:            # short: no need to encode to know
        return text, 4 * len(text)
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text, len(raw)
    if keep_end:
        kept = raw[-limit:].decode("utf-8", "ignore")
        out = f"[{len(raw) - limit} bytes cut] " + kept
    else:
        kept = raw[:limit].decode("utf-8", "ignore")
        out = kept + f" [{len(raw) - limit} bytes cut]"
    return out, limit + 64


class CMDPLogHandler(logging.Handler):
    """Feeds log records to a :class:`CMDPSender` through a bounded queue.

    ``emit`` never blocks and never logs: it checks the subscriptions (a frozenset read),
    formats the record (text and traceback clipped, :func:`clip`) and appends a tuple to a
    deque; when the queue holds ``maxsize`` records or ``maxbytes`` bytes the record is
    counted in ``dropped`` and discarded.  Records of ``logjam_relay.health.cmdp`` (the
    sender itself) and records logged while a handler call is running in the same thread
    are ignored, so the sender can never feed itself.  Safe to call from any thread.
    """

    def __init__(self, maxsize: int = 10000, level: int = logging.NOTSET, *,
                 maxbytes: int = LOG_QUEUE_MAX_BYTES):
        super().__init__(level)
        self.maxsize = maxsize
        self.maxbytes = maxbytes
        self.queue: collections.deque = collections.deque()   # (record, bytes); pop()
        self.bytes = 0              # UTF-8 bytes of text and traceback queued (under lock)
        self.enqueued = 0
        self.dropped = 0
        self.unsubscribed = 0
        self.components: set[str] = set()
        self._publisher: Publisher | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._wake: Callable[[], None] | None = None
        self._local = threading.local()

    def attach(self, publisher: Publisher, token: trio.lowlevel.TrioToken,
               wake: Callable[[], None]) -> None:
        self._publisher, self._token, self._wake = publisher, token, wake

    def detach(self) -> None:
        self._publisher = self._token = self._wake = None
        with self.lock:
            self.queue.clear()
            self.bytes = 0

    def pop(self) -> tuple:
        """The oldest queued record: (level, component, text, t_ns, tags)."""
        with self.lock:                 # emit() runs under it (logging.Handler.handle)
            record, size = self.queue.popleft()
            self.bytes -= size
        return record

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(self._local, "busy", False) or record.name.startswith(LOGGER_NAME):
            return
        self._local.busy = True
        try:
            comp = component_of(record.name)
            self.components.add(comp)
            pub = self._publisher
            if pub is None:
                return
            level = level_from_levelno(record.levelno)
            if not pub.wants_log(level, comp):
                self.unsubscribed += 1
                return
            q = self.queue
            if len(q) >= self.maxsize:
                self.dropped += 1
                return
            tags: dict[str, Any] = {}
            if level in _LOCATION_LEVELS:
                tags = {"thread": record.thread or 0, "filename": record.filename,
                        "lineno": record.lineno, "funcname": record.funcName,
                        "funcName": record.funcName}
            size = 0
            if record.exc_info and record.exc_info[0] is not None:
                tags["traceback"], size = clip(
                    "".join(traceback.format_exception(*record.exc_info)),
                    MAX_LOG_TRACEBACK, keep_end=True)
            try:
                text = record.getMessage()
            except Exception as e:  # a bad %-format must not kill the caller
                text = f"{record.msg!r} (bad log arguments: {e!r})"
            text, n = clip(text, MAX_LOG_TEXT)
            size += n
            if self.bytes + size > self.maxbytes:
                self.dropped += 1
                return
            was_empty = not q
            q.append(((level, comp, text, int(record.created * 1e9), tags), size))
            self.bytes += size
            self.enqueued += 1
            if was_empty and self._token is not None:
                try:
                    self._token.run_sync_soon(self._wake)
                except trio.RunFinishedError:
                    pass
        except Exception:
            self.dropped += 1
        finally:
            self._local.busy = False

    def stats(self) -> dict[str, int]:
        return {"log_enqueued": self.enqueued, "log_dropped": self.dropped,
                "log_queue": len(self.queue), "log_queue_bytes": self.bytes}


# --------------------------------------------------------------------------- sender


class CMDPSender:
    """Owns the XPUB socket; ``await sender.run()`` in the health nursery.

    ``endpoint`` overrides the bind address derived from the config (tests bind
    ``tcp://127.0.0.1:*``); the bound port is in ``self.port`` once started.
    Attach ``self.handler`` to the ``logjam_relay`` logger (``install_log_handler``).
    """

    def __init__(self, config: CMDPConfig, stats_provider: StatsProvider | None = None, *,
                 context: zmq.Context | None = None, endpoint: str | None = None,
                 chirp_interfaces: list[str] | None = None,
                 clock_ns: Callable[[], int] = time.time_ns):
        config.validate()
        self.config = config
        self.name = config.canonical_name
        self.stats_provider = stats_provider
        self.context = context or zmq.Context.instance()
        self.endpoint = endpoint or f"tcp://{config.cmdp_bind}:{config.cmdp_port}"
        self._chirp_interfaces = chirp_interfaces
        self.clock_ns = clock_ns
        self.publisher = Publisher(self.name, wire_metric_type=config.wire_metric_type)
        self.handler = CMDPLogHandler(config.log_queue_size, config.log_level)
        self.port: int | None = None
        self.chirp = None
        self.chirp_error: str | None = None
        self.pub: ThreadedPub | None = None
        self.sent = {"stat": 0, "log": 0, "notification": 0}
        self.provider_errors = 0
        self.subscription_messages = 0
        self._wake_event = trio.Event()
        self._log_components_notified = 0
        self._errlog = RateLimitedLog(log)
        self.peer_limit = None      # io.peers.PeerLimit: zmq_max_peers through ZAP

    # -- public helpers
    def install_log_handler(self, logger: logging.Logger | str = "logjam_relay") -> None:
        lg = logging.getLogger(logger) if isinstance(logger, str) else logger
        if self.handler not in lg.handlers:
            lg.addHandler(self.handler)

    def remove_log_handler(self, logger: logging.Logger | str = "logjam_relay") -> None:
        lg = logging.getLogger(logger) if isinstance(logger, str) else logger
        lg.removeHandler(self.handler)

    def stats(self) -> dict[str, Any]:
        d: dict[str, Any] = {f"{k}_sent": v for k, v in self.sent.items()}
        d["drops"] = self.pub.drops if self.pub else 0
        d["subscriptions"] = len(self.publisher.subscriptions)
        if self.pub is not None and self.pub.guard is not None:
            d["subscriptions_refused"] = self.pub.guard.refused
        d["provider_errors"] = self.provider_errors
        d.update(self.handler.stats())
        if self.chirp is not None:
            d["chirp"] = self.chirp.stats()
        return d

    # -- internals
    def _publish(self, frames: list[bytes], kind: str) -> None:
        assert self.pub is not None
        self.pub.publish(frames)
        self.sent[kind] += 1

    def _notify(self, kind: str) -> None:
        self._publish(self.publisher.notification(kind, self.clock_ns()), "notification")

    async def _subscriptions(self) -> None:
        assert self.pub is not None and self.pub.notes is not None
        notes = self.pub.notes
        while True:
            with trio.move_on_after(0.25):     # a safety net for the edge-triggered FD
                await zmq_trio.wait_for(notes, zmq_trio.POLLIN)
            # the XPUB's thread runs the guard (the cap), and hands over the notifications
            # XPUB_VERBOSE would give
            batch = self.pub.poll_subscriptions()
            for frame in batch:
                self.subscription_messages += 1
                for out in self.publisher.receive_subscription(frame, self.clock_ns()):
                    self._publish(out, "notification")
            # always: a flood the guard refuses returns empty batches while more is
            # pending, and wait_for does not yield when POLLIN is already set
            await trio.lowlevel.checkpoint()

    def stat_round(self) -> int:
        """Send one round of metrics (to subscribed topics only). Returns messages sent."""
        self._check_log_topics()
        if self.stats_provider is None:
            return 0
        try:
            values = self.stats_provider()
        except Exception as e:
            self.provider_errors += 1
            self._errlog.error("provider", "CMDP stats provider failed: %r", e)
            return 0
        pub = self.publisher
        now = self.clock_ns()
        new_topics = False
        sent = 0
        for raw_name, st in values.items():
            try:
                if not isinstance(st, Stat):
                    st = Stat(*st)
                mtype = MetricType(st.type) if st.type else None
                name = sanitize_name(str(raw_name))
                if name not in pub.stat_topics:
                    desc = st.description or name.lower().replace("_", " ")
                    if st.unit:
                        desc = f"{desc} [{st.unit}]"
                    if mtype is not None:
                        desc = f"{desc} ({mtype.name})"
                    new_topics |= pub.register_stat(name, desc)
                topic = b"STAT/" + name.encode("ascii")
                if not pub.wants(topic):
                    continue
                frames = pub.stat(name, st.value, str(st.unit), mtype, now)
            except (TypeError, ValueError) as e:  # bad tuple, type or a value msgpack can't encode
                self.provider_errors += 1
                self._errlog.error("value", "CMDP: bad metric %r=%r: %r", raw_name, st, e)
                continue
            self._publish(frames, "stat")
            sent += 1
        if new_topics and pub.wants(b"STAT?"):
            self._notify("STAT")
        return sent

    def _check_log_topics(self) -> None:
        comps = self.handler.components
        if len(comps) != self._log_components_notified:
            new = False
            for c in list(comps):
                new |= self.publisher.register_log(c, f"logjam_relay.{c.lower()}")
            self._log_components_notified = len(comps)
            if new and self.publisher.wants(b"LOG?"):
                self._notify("LOG")

    async def _stats_loop(self) -> None:
        interval = self.config.stat_interval
        deadline = trio.current_time()
        while True:
            deadline += interval
            await trio.sleep_until(deadline)
            if trio.current_time() - deadline > interval:  # fell behind: don't burst
                deadline = trio.current_time()
            self.stat_round()

    def drain_log_queue(self, limit: int | None = None) -> int:
        """Publish queued log records (those still subscribed). Returns messages sent."""
        h = self.handler
        pub = self.publisher
        n = 0
        budget = len(h.queue) if limit is None else min(limit, len(h.queue))
        for _ in range(budget):
            level, comp, text, t_ns, tags = h.pop()
            if pub.wants_log(level, comp):  # may have unsubscribed meanwhile
                self._publish(pub.log(level, comp, text, t_ns, tags), "log")
                n += 1
        return n

    def _wake(self) -> None:
        self._wake_event.set()

    async def _log_loop(self) -> None:
        while True:
            with trio.move_on_after(0.5):  # safety net; normally woken by the handler
                await self._wake_event.wait()
            self._wake_event = trio.Event()
            # Batches of at most 1000, yielding in between, so a log storm can't starve others.
            while self.handler.queue:
                self.drain_log_queue(1000)
                await trio.lowlevel.checkpoint()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        sock = self.context.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.SNDHWM, self.config.snd_hwm)
            sock.setsockopt(zmq.LINGER, 0)
            for opt, value in zmq_trio.xpub_options().items():
                sock.setsockopt(opt, value)
            if self.peer_limit is not None:
                set_zap_domain(sock, "cmdp")        # every handshake asks the ZAP handler
            sock.bind(self.endpoint)
            self.port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            # XPUB_MANUAL with a cap; every STAT?/LOG? subscriber still gets its answer.
            # Owned by a thread: libzmq's trie walks at the end of a subscriber's
            # connection run there, not on the loop (io/xpubthread.py)
            self.pub = ThreadedPub(sock, self.config.max_subscriptions, name="cmdp",
                                   hwm=self.config.snd_hwm, notify=True)
            if self.peer_limit is not None:
                self.peer_limit.watch("cmdp", sock, guard=self.pub.guard)
            self.pub.start()
            self.handler.attach(self.publisher, trio.lowlevel.current_trio_token(), self._wake)
            log.info("CMDP: %s publishing on port %d", self.name, self.port)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._subscriptions)
                nursery.start_soon(self._stats_loop)
                nursery.start_soon(self._log_loop)
                if self.config.chirp_enabled:
                    addrs = self._chirp_interfaces or resolve_interfaces(self.config.chirp_interface)
                    self.chirp = ChirpBeacon(self.config.chirp_group, self.name,
                                             {chirp_proto.Service.MONITORING: self.port}, addrs)
                    try:
                        await nursery.start(self.chirp.run)
                    except OSError as e:  # no multicast here: CMDP still works by address
                        self.chirp_error = repr(e)
                        log.error("CHIRP disabled, cannot open multicast socket: %r", e)
                task_status.started(self.port)
        finally:
            self.handler.detach()
            if self.peer_limit is not None:
                self.peer_limit.forget("cmdp")
            if self.pub is not None:
                self.pub.close(linger=200, timeout=2.0)
            else:
                zmq_trio.close_all([sock], 200)
