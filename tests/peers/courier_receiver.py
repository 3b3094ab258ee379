"""An in-repo Courier receiver on the sans-IO core (``protocols.courier.ServerConnection``).

Used by the tests and the benchmarks (``tests/peers/``: not part of the installed package;
the relay's own Courier input is ``logjam_relay.inputs.courier``). Per connection:

* a reader task feeds bytes to the core, answers HELO/PING/unknown types as the chosen
  :class:`~logjam_relay.protocols.courier.ReceiverBehaviour` (default: Go handshake,
  pending-payload limit 10, ``????`` for unknown types) and queues payloads;
* a processor task hands each payload's events to the ``sink`` (in chunks of
  ``ack_chunk`` events when set) and sends an ACKN after each chunk;
* a timer task sends the keep-alive/partial ACKN for the oldest pending payload every
  ``ack_timeout`` seconds after the last ACKN (Go receiver semantics).

Protocol errors close the connection without any reply (as all real receivers).

Test knobs for poison events: ``refuse`` (a predicate on an event's bytes) and
``max_event_bytes``: a payload holding such an event is delivered and acknowledged up to
the event before it, then the connection is closed without acknowledging the rest (as
a receiver that cannot parse an event, or that has a size limit, does).
"""

from __future__ import annotations

import logging
import math
import ssl
from collections.abc import Awaitable, Callable

import trio

from logjam_relay.protocols.courier import (
    DEFAULT,
    CourierError,
    Overloaded,
    Payload,
    Ping,
    ReceiverBehaviour,
    ServerConnection,
)
from logjam_relay.ratelimit import RateLimitedLog

log = logging.getLogger("logjam_relay.peers.courier_receiver")

Sink = Callable[[bytes, tuple], Awaitable[None]]

_EOF = object()


class CourierReceiver:
    """A Courier server. ``await nursery.start(receiver.serve)`` returns the bound port."""

    def __init__(self, behaviour: ReceiverBehaviour = DEFAULT, *,
                 ssl_context: ssl.SSLContext | None = None, ack_timeout: float = 5.0,
                 ack_chunk: int | None = None, sink: Sink | None = None, store: bool = True,
                 idle_timeout: float = 1000.0,
                 refuse: Callable[[bytes], bool] | None = None,
                 max_event_bytes: int | None = None):
        self.refuse = refuse
        self.max_event_bytes = max_event_bytes
        self.refused = 0
        self.behaviour = behaviour
        self.ssl_context = ssl_context
        self.ack_timeout = ack_timeout
        self.ack_chunk = ack_chunk
        self.sink = sink
        self.store = store
        self.idle_timeout = idle_timeout
        self.port: int | None = None
        self.events: list[bytes] = []          # delivered events (when store=True)
        self.payload_log: list[tuple[bytes, int]] = []   # (nonce, events) of every payload
        self._scope: trio.CancelScope | None = None
        self._rl = RateLimitedLog(log)
        # counters
        self.connections = 0
        self.active_connections = 0
        self.payloads = 0
        self.events_delivered = 0
        self.acks_sent = 0
        self.timer_acks_sent = 0
        self.pongs_sent = 0
        self.overloaded = 0
        self.errors: dict[str, int] = {}

    # ------------------------------------------------------------------ serving

    async def serve(self, port: int = 0, host: str = "127.0.0.1", *,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        if self.ssl_context is not None:
            listeners = [trio.SSLListener(ln, self.ssl_context, https_compatible=False)
                         for ln in listeners]
        with trio.CancelScope() as scope:
            self._scope = scope
            try:
                async with trio.open_nursery() as nursery:
                    task_status.started(self.port)
                    await trio.serve_listeners(self.handle_stream, listeners,
                                               handler_nursery=nursery)
            finally:
                self._scope = None
                with trio.CancelScope(shield=True):
                    for ln in listeners:
                        await ln.aclose()

    def kill(self) -> None:
        """Stop listening and drop every connection at once (like killing the process)."""
        if self._scope is not None:
            self._scope.cancel()

    @property
    def serving(self) -> bool:
        return self._scope is not None

    # --------------------------------------------------------------- connection

    async def handle_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection; never raises (except Cancelled)."""
        self.connections += 1
        self.active_connections += 1
        conn = ServerConnection(self.behaviour, ack_timeout=self.ack_timeout)
        lock = trio.Lock()
        send_q, recv_q = trio.open_memory_channel(math.inf)
        armed = trio.Event()
        graceful = False

        async def send(data: bytes) -> None:
            if data:
                async with lock:
                    await stream.send_all(data)

        async def processor(nursery: trio.Nursery) -> None:
            async for item in recv_q:
                if item is _EOF:
                    break
                if isinstance(item, Ping):
                    await send(conn.pong())
                    self.pongs_sent += 1
                    continue
                await self._process(conn, item, send)
            nursery.cancel_scope.cancel()

        async def timer() -> None:
            nonlocal armed
            while True:
                dl = conn.deadline()
                if dl == math.inf:
                    armed = trio.Event()
                    await armed.wait()
                    continue
                await trio.sleep_until(dl)
                out = conn.on_timer(trio.current_time())
                if out:
                    self.timer_acks_sent += 1
                    await send(out)

        async def reader(nursery: trio.Nursery) -> None:
            nonlocal graceful
            stop = False
            while not stop:
                with trio.move_on_after(self.idle_timeout) as idle:
                    data = await stream.receive_some(65536)
                if idle.cancelled_caught:
                    raise CourierError("idle_timeout", "connection idle too long")
                if not data:
                    graceful = True
                    break
                conn.receive_data(data)
                now = trio.current_time()
                try:
                    while (ev := conn.next_event(now)) is not None:
                        if isinstance(ev, Overloaded):
                            # as Go: stop reading, ACK what is pending, close
                            self.overloaded += 1
                            graceful = True
                            stop = True
                            break
                        if isinstance(ev, Payload):
                            self.payloads += 1
                            self.payload_log.append((ev.nonce, len(ev.events)))
                            armed.set()
                        send_q.send_nowait(ev)
                finally:
                    # replies to the frames before an error still go out (VERS, ????)
                    await send(conn.data_to_send())
            send_q.send_nowait(_EOF)

        try:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(processor, nursery)
                    nursery.start_soon(timer)
                    await reader(nursery)
            except BaseExceptionGroup as eg:
                raise _collapse(eg) from None
        except CourierError as e:
            graceful = False
            self._error(e.reason, "courier receiver: %s", e)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            graceful = False
            self._error("io", "courier receiver: connection lost: %r", e)
        except Exception as e:  # never take the server down for one connection
            graceful = False
            self._error("internal", "courier receiver: unexpected %r", e)
        except BaseException:   # Cancelled
            graceful = False
            raise
        finally:
            self.active_connections -= 1
            if graceful:
                with trio.move_on_after(1):
                    try:
                        await stream.aclose()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
            await trio.aclose_forcefully(stream)

    def _refused_at(self, events) -> int | None:
        if self.refuse is None and self.max_event_bytes is None:
            return None
        for i, ev in enumerate(events):
            if (self.max_event_bytes is not None and len(ev) > self.max_event_bytes) or \
                    (self.refuse is not None and self.refuse(ev)):
                return i
        return None

    async def _process(self, conn: ServerConnection, p: Payload, send) -> None:
        n = len(p.events)
        step = self.ack_chunk or n or 1
        done = 0
        while True:
            part = p.events[done:done + step]
            bad = self._refused_at(part)
            if bad is not None:
                part = part[:bad]
                if part:
                    if self.store:
                        self.events.extend(part)
                    self.events_delivered += len(part)
                    done += len(part)
                    await send(conn.ack(p.nonce, done, trio.current_time()))
                    self.acks_sent += 1
                self.refused += 1
                raise CourierError("refused", f"refusing event {done + 1} of a payload")
            if part:
                if self.sink is not None:
                    await self.sink(p.nonce, part)
                if self.store:
                    self.events.extend(part)
                self.events_delivered += len(part)
                done += len(part)
            await send(conn.ack(p.nonce, done, trio.current_time()))
            self.acks_sent += 1
            if done >= n:
                return

    def _error(self, reason: str, msg: str, *args) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1
        self._rl.warning(reason, msg, *args)

    def stats(self) -> dict:
        return {
            "connections": self.connections,
            "active_connections": self.active_connections,
            "payloads": self.payloads,
            "events_delivered": self.events_delivered,
            "acks_sent": self.acks_sent,
            "timer_acks_sent": self.timer_acks_sent,
            "pongs_sent": self.pongs_sent,
            "overloaded": self.overloaded,
            "refused": self.refused,
            "errors": dict(self.errors),
        }


def _collapse(eg: BaseExceptionGroup) -> BaseException:
    """The single interesting exception of a nursery's group (Cancelled stays grouped)."""
    leaves = []

    def walk(g):
        for e in g.exceptions:
            walk(e) if isinstance(e, BaseExceptionGroup) else leaves.append(e)

    walk(eg)
    if all(isinstance(e, Exception) for e in leaves):
        return leaves[0]
    return eg
