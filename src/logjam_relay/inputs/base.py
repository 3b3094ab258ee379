"""The listener every input shares: TCP/TLS, connection cap, handshake timeout, counters."""

from __future__ import annotations

import logging
import socket
from collections import Counter
from collections.abc import Callable

import trio

from ..gc_tuning import malloc_trim
from ..io.net import RefusingListener, server_context
from ..ratelimit import RateLimitedLog
from .spec import InputSpec

log = logging.getLogger("logjam_relay.inputs")

#: what a connection reads ahead while its batch waits for the spool (enough to see the
#: sender close the connection; a sender that sends more is simply not read meanwhile)
READ_AHEAD = 65536


class HeldBytes:
    """What the connections of one input hold together, against ``max_held_bytes``
    (docs/inputs.md, "Memory"): bytes received and not yet parsed, and the events of the
    windows/payloads being received or waiting for the spool, each as
    :func:`~logjam_relay.protocols.lumberjack_server.event_cost` charges it.  A connection
    that would take the input over it is closed (``input_memory``); what it held is given
    back at once.

    Memory given back is returned to the OS: glibc keeps freed heap pages (the events are
    many small objects, an inflated 16 MiB frame comes from the heap once glibc's mmap
    threshold has risen to its size), so every :data:`TRIM_AFTER` bytes given back, and
    when a connection ends after 1 MiB, :meth:`trim` calls ``malloc_trim(0)`` (measured: 166 MiB RSS left after 40 stalled
    10 MiB windows were cut, 38 MiB idle)."""

    TRIM_AFTER = 32 * 1024 * 1024

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.refused = 0
        self.freed = 0                  # given back since the last trim

    @property
    def available(self) -> int:
        return self.limit - self.used

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            self.refused += 1
            return False
        self.used += n
        if self.used > self.peak:
            self.peak = self.used
        return True

    def give(self, n: int) -> None:
        self.used -= n
        self.freed += n

    def trim(self, after: int = TRIM_AFTER) -> None:
        """Where what was given back is no longer referenced: between batches, and when a
        connection ends (there after 1 MiB: the last of a burst is given back too)."""
        if self.freed >= after and malloc_trim is not None:
            self.freed = 0
            malloc_trim(0)


class BaseInput:
    """Subclasses implement ``async _connection(stream, peer)`` (raise on protocol errors
    with a ``reason`` attribute; return on a clean close)."""

    error_types: tuple = ()

    def __init__(self, spec: InputSpec, relay):
        self.spec = spec
        self.name = spec.name
        self.relay = relay
        self.ssl_context = server_context(spec.cert, spec.key, spec.ca,
                                          require_client_cert=bool(spec.ca)) \
            if spec.tls else None
        self.port: int | None = None
        self.held = HeldBytes(spec.max_held_bytes)
        self.rlog = RateLimitedLog(logging.getLogger(f"logjam_relay.inputs.{spec.scheme}"))
        # counters (exported by InputsCollector)
        self.connections = 0
        self.active = 0
        self.refused = 0                    # over max_connections
        self.batches = 0                    # windows / payloads spooled and acknowledged
        self.events = 0
        self.bytes = 0                      # bytes read from the network
        self.acks = 0
        self.unacked_at_close = 0           # batches complete but not acked (shutdown/close)
        self.out_of_fds = 0                 # closed at accept: out of file descriptors
        self.errors: Counter[str] = Counter()

    # ------------------------------------------------------------------ serving
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        spec = self.spec
        try:
            listeners = await trio.open_tcp_listeners(spec.port, host=spec.host)
        except OSError as e:         # the errno kept: start-up names the likely cause
            raise OSError(e.errno, f"input {spec.name}: cannot listen on "
                          f"{spec.host}:{spec.port}: {e.strerror or e}") from None
        self.port = listeners[0].socket.getsockname()[1]
        log.info("input %s listening on %s:%d (%s)", spec.name, spec.host, self.port,
                 "TLS" + (" with client certificates" if spec.ca else "") if spec.tls
                 else "plain TCP")
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(self.port)
                await trio.serve_listeners(self._handle, [RefusingListener(ln, self._no_fds)
                                                          for ln in listeners],
                                           handler_nursery=nursery)
        finally:
            for ln in listeners:
                await trio.aclose_forcefully(ln)

    def _no_fds(self) -> None:
        """A connection closed at accept: the relay was out of file descriptors."""
        self.out_of_fds += 1
        self.rlog.warning("out_of_fds", "input %s: out of file descriptors: closed a new "
                          "connection at once", self.name)

    async def _handle(self, stream: trio.SocketStream) -> None:
        peer = _peer(stream)
        if self.active >= self.spec.max_connections:
            self.refused += 1
            self.errors["too_many_connections"] += 1
            self.rlog.warning("too_many_connections", "input %s: %s refused: %d connections "
                              "open (max_connections)", self.name, peer, self.active)
            await trio.aclose_forcefully(stream)
            return
        self.connections += 1
        self.active += 1
        try:
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        s: trio.abc.Stream = stream
        try:
            if self.ssl_context is not None:
                s = trio.SSLStream(stream, self.ssl_context, server_side=True,
                                   https_compatible=False)
                with trio.move_on_after(self.spec.handshake_timeout) as cs:
                    try:
                        await s.do_handshake()
                    except (trio.BrokenResourceError, OSError) as e:
                        cause = e.__cause__ or e
                        raise _Closed("tls_handshake", f"TLS handshake failed: {cause}") \
                            from None
                if cs.cancelled_caught:
                    raise _Closed("handshake_timeout", "TLS handshake not done in time")
            await self._connection(s, peer)
        except _Closed as e:
            self._error(e.reason, peer, str(e))
        except self.error_types as e:
            self._error(getattr(e, "reason", "protocol"), peer, str(e))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            self._error("io", peer, repr(e), level=logging.DEBUG)
        except Exception as e:      # never take the listener down for one connection
            self._error("internal", peer, repr(e), level=logging.ERROR)
        finally:
            self.active -= 1
            await trio.aclose_forcefully(s)
            self.held.trim(1 << 20)

    def _error(self, reason: str, peer: str, msg: str, level: int = logging.WARNING) -> None:
        self.errors[reason] += 1
        if level == logging.DEBUG:
            self.rlog.logger.debug("input %s: %s: %s", self.name, peer, msg)
            return
        self.rlog.log(level, reason, "input %s: %s: %s (%s); connection closed", self.name,
                      peer, msg, reason)

    async def receive(self, stream, deadline: float, reason: str) -> bytes:
        """One read; raises _Closed(reason) when ``deadline`` (trio clock) passes first
        (``reason``: "timeout" for a started window/payload, "idle" otherwise)."""
        with trio.move_on_at(deadline) as cs:
            data = await stream.receive_some(65536)
        if cs.cancelled_caught:
            raise _Closed(reason, "nothing received in time" if reason == "idle" else
                          f"batch not complete within {self.spec.timeout:g}s")
        self.bytes += len(data)
        return data

    async def read_more(self, stream, busy: bool, started: float | None
                        ) -> tuple[bytes, float | None]:
        """The next bytes of a connection, and the new ``started``: while a batch is
        partly received (``busy``) it must be complete ``timeout`` seconds after its
        first byte (slowloris); between batches the connection may idle for
        ``idle_timeout``."""
        self.held.trim()
        now = trio.current_time()
        if busy:
            if started is None:
                started = now
            return await self.receive(stream, started + self.spec.timeout, "timeout"), started
        return await self.receive(stream, now + self.spec.idle_timeout, "idle"), None

    async def spool_and_ack(self, acc: list[tuple], stream, conn, keepalive: bytes | None,
                            ack: Callable[[], bytes], count: int, what: str) -> bool:
        """Spool a whole window/payload, then send its ACK (``ack()``) and count it.

        A relay shutting down first leaves it unacknowledged (the sender resends); so does
        a sender that closes the connection while it waits for a full spool (it was not
        spooled: withdrawn, the sender resends it on its next connection).  False when
        the sender had closed its side by the time it was spooled (ACK sent, nothing
        more to read)."""
        spooled, closed = await self.spool(acc, stream, conn, keepalive)
        if spooled is None:
            raise _Closed("withdrawn", f"the sender closed the connection while its {what} "
                          "waited for the spool: not spooled, not acknowledged")
        if not spooled:
            self.unacked_at_close += 1
            raise _Closed("shutdown", f"relay shutting down; {what} not acknowledged")
        await stream.send_all(ack())
        self.acks += 1
        self.batches += 1
        self.events += count
        return not closed

    async def spool(self, acc: list[tuple], stream, conn, keepalive: bytes | None
                    ) -> tuple[bool | None, bool]:
        """Stamp, publish and spool ``acc``: ``(spooled, closed)``.

        ``spooled`` is True once it is in the spool (then ACK), False when the relay is
        shutting down, None when the sender closed the connection while the batch still
        waited for the spool (policy block, spool full): the wait is given up and the batch
        is not spooled (withdrawn), so a sender that times out and resends on a new
        connection does not get it spooled once per attempt.  Once the write has started
        it completes (the relay shields it); ``closed`` then says the sender had gone.

        Meanwhile the connection is watched: what the sender sends is read into ``conn``
        (its ``receive_data``), but only while ``conn.buffered`` is under
        :data:`READ_AHEAD`; and ``keepalive``, when the protocol version has one (v2
        ``2A 0``, Courier ``ACKN``; never Lumberjack v1, whose senders take any 6 bytes
        for the ACK), is sent every ``ack_interval`` seconds.
        """
        relay = self.relay
        if relay.stopping:
            return False, False
        spooled = None
        closed = False
        failed = None       # a protocol error in what was read ahead (else it would come
        async with trio.open_nursery() as nursery:      # out of the nursery as a group)
            async def ingest():
                nonlocal spooled
                spooled = await relay.ingest_external(acc)
                nursery.cancel_scope.cancel()

            async def watch():
                nonlocal closed, failed
                while conn.buffered < READ_AHEAD:
                    try:
                        data = await stream.receive_some(65536)
                    except (trio.BrokenResourceError, OSError):
                        data = b""
                    if not data:
                        closed = True
                        nursery.cancel_scope.cancel()       # withdraw unless spooling
                        return
                    self.bytes += len(data)
                    try:
                        conn.receive_data(data)
                    except self.error_types as e:
                        failed = e
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(ingest)
            nursery.start_soon(watch)
            if keepalive is not None:
                try:
                    while True:
                        await trio.sleep(self.spec.ack_interval)
                        await stream.send_all(keepalive)
                except (trio.BrokenResourceError, OSError):
                    closed = True                           # the sender is gone
                    nursery.cancel_scope.cancel()
        if failed is not None:
            try:
                raise failed
            finally:
                failed = None       # no cycle through this frame
        return spooled, closed

    def stats(self) -> dict:
        return {"connections": self.connections, "active_connections": self.active,
                "refused_connections": self.refused, "batches": self.batches,
                "events": self.events, "bytes": self.bytes, "acks": self.acks,
                "errors": dict(self.errors), "port": self.port, "held_bytes": self.held.used,
                "held_bytes_peak": self.held.peak}


class _Closed(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _peer(stream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except (AttributeError, OSError):
        return "?"


class InputsCollector:
    """Prometheus families for the inputs (registered in RelayCollector.extra)."""

    def __init__(self, relay, inputs: list[BaseInput]):
        self.relay = relay
        self.inputs = inputs

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        d = str(self.relay.settings.device_id)
        lb = ["device", "input"]
        fams = {
            "connections": CounterMetricFamily("logjam_relay_input_connections",
                                               "connections accepted", labels=lb),
            "refused": CounterMetricFamily("logjam_relay_input_refused_connections",
                                           "connections refused (max_connections)", labels=lb),
            "active": GaugeMetricFamily("logjam_relay_input_active_connections",
                                        "open connections", labels=lb),
            "batches": CounterMetricFamily("logjam_relay_input_batches",
                                           "windows/payloads spooled and acknowledged",
                                           labels=lb),
            "events": CounterMetricFamily("logjam_relay_input_events",
                                          "events spooled and acknowledged", labels=lb),
            "bytes": CounterMetricFamily("logjam_relay_input_bytes", "bytes received",
                                         labels=lb),
            "held": GaugeMetricFamily("logjam_relay_input_held_bytes",
                                      "memory the connections hold (max_held_bytes)",
                                      labels=lb),
        }
        errors = CounterMetricFamily("logjam_relay_input_errors",
                                     "connections closed for bad input or I/O errors",
                                     labels=lb + ["reason"])
        for inp in self.inputs:
            lbl = [d, inp.name]
            fams["connections"].add_metric(lbl, inp.connections)
            fams["refused"].add_metric(lbl, inp.refused)
            fams["active"].add_metric(lbl, inp.active)
            fams["batches"].add_metric(lbl, inp.batches)
            fams["events"].add_metric(lbl, inp.events)
            fams["bytes"].add_metric(lbl, inp.bytes)
            fams["held"].add_metric(lbl, inp.held.used)
            for reason, n in sorted(inp.errors.items()):
                errors.add_metric(lbl + [reason], n)
        yield from fams.values()
        yield errors
