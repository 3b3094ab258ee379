"""An in-repo Lumberjack v1 reader (server) that behaves like go-lumber server/v1.

Behaviour (``shared/specs/reference/lumberjack-v1.md`` §2, §3):

* one ``1A <count>`` per window, written only after the whole window was read and the
  application accepted it (the ``on_window`` callback returned); never partial, no
  keep-alives (unless ``keepalive_interval`` is set to imitate Logstash's Java input);
* per connection everything is serialized: the next window is handed over only after
  the previous ACK was written;
* ``W`` must start each window; ``W 0`` is ignored; ``W > max_window`` closes;
* between windows there is no read deadline; once the ``W`` arrived the whole window
  must arrive within ``timeout`` (30 s default), else the connection is closed;
* on any protocol error the connection is closed (no error frame), the partial window
  is not delivered.

Test knobs (all off by default): ``ack_delay``, ``ack_mode`` (``"count"`` like go-lumber
or ``"last_seq"`` like jls-lumberjack), ``keepalive_interval`` (send ``2A 0`` while the
ack is delayed), ``close_after_windows`` (close a connection right after handing its
N-th window to the application, before acking it: the go-lumber duplicate caveat),
``ack_value`` (callable ``(WindowComplete) -> int`` that overrides the ACK value),
``no_ack``, and for poison events ``refuse`` (a predicate on a :class:`lj.Data`) and
``max_event_bytes`` (on the ``line`` field): the connection is closed before the ACK
of a window holding such an event, as a reader with a size limit, or one that cannot
parse an event, does.
"""

from __future__ import annotations

import inspect
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import trio

from logjam_relay.protocols import lumberjack as lj
from logjam_relay.ratelimit import RateLimitedLog

log = logging.getLogger("logjam_relay.peers.lumberjack_reader")


@dataclass(frozen=True, slots=True)
class ReceivedWindow:
    """A complete window as handed to the application."""

    events: list[lj.Data]
    peer: str
    connection: int   # connection number (1, 2, ...) on this reader


class LumberjackReader:
    def __init__(self, *, host: str = "127.0.0.1", port: int = 0,
                 ssl_context: ssl.SSLContext | None = None, timeout: float = 30.0,
                 max_window: int = lj.MAX_WINDOW,
                 on_window: Callable[[ReceivedWindow], object] | None = None,
                 keep_windows: bool = True,
                 ack_delay: float = 0.0, ack_mode: str = "count",
                 keepalive_interval: float | None = None,
                 close_after_windows: int | None = None,
                 ack_value: Callable[[lj.WindowComplete], int] | None = None,
                 no_ack: bool = False,
                 refuse: Callable[[lj.Data], bool] | None = None,
                 max_event_bytes: int | None = None):
        self.refuse = refuse
        self.max_event_bytes = max_event_bytes
        self.refused = 0
        if ack_mode not in ("count", "last_seq"):
            raise ValueError(f"ack_mode must be 'count' or 'last_seq', not {ack_mode!r}")
        self.host = host
        self.port = port
        self.ssl_context = ssl_context
        self.timeout = timeout
        self.max_window = max_window
        self.on_window = on_window
        self.keep_windows = keep_windows
        self.ack_delay = ack_delay
        self.ack_mode = ack_mode
        self.keepalive_interval = keepalive_interval
        self.close_after_windows = close_after_windows
        self.ack_value = ack_value
        self.no_ack = no_ack
        #: every delivered window (when ``keep_windows``), in delivery order
        self.windows: list[ReceivedWindow] = []
        # plain counters
        self.connections = 0
        self.events_received = 0
        self.windows_received = 0
        self.acks_sent = 0
        self.timeouts = 0
        self.dropped_events = 0
        self.errors: dict[str, int] = {}
        self._rlog = RateLimitedLog(log)

    # -- serving ------------------------------------------------------------

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; ``task_status.started(port)`` once bound.

        May be called again after cancellation (e.g. to restart on the same port);
        cancelling closes every connection of this run.
        """
        listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        self.port = listeners[0].socket.getsockname()[1]
        if self.ssl_context is not None:
            listeners = [trio.SSLListener(lst, self.ssl_context, https_compatible=False)
                         for lst in listeners]
        async with trio.open_nursery() as nursery:
            try:
                task_status.started(self.port)
                await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)
            finally:
                for lst in listeners:
                    await trio.aclose_forcefully(lst)

    @property
    def events(self) -> list[lj.Data]:
        return [ev for w in self.windows for ev in w.events]

    def stats(self) -> dict:
        return {
            "connections": self.connections,
            "events_received": self.events_received,
            "windows_received": self.windows_received,
            "acks_sent": self.acks_sent,
            "timeouts": self.timeouts,
            "dropped_events": self.dropped_events,
            "refused": self.refused,
            "errors": dict(self.errors),
        }

    # -- one connection -----------------------------------------------------

    async def _handle(self, stream: trio.abc.Stream) -> None:
        self.connections += 1
        conn_no = self.connections
        peer = _peer_name(stream)
        conn = lj.Connection(lj.Role.READER, max_window=self.max_window)
        events: list[lj.Data] = []
        delivered = 0
        deadline = float("inf")
        try:
            while True:
                ev = conn.next_event()
                if ev is lj.NEED_DATA:
                    with trio.move_on_at(deadline if conn.in_window else float("inf")) as cs:
                        data = await stream.receive_some(262144)
                    if cs.cancelled_caught:
                        self.timeouts += 1
                        self._rlog.warning("timeout", "lumberjack reader: %s: window not "
                                           "complete within %.1fs, closing", peer, self.timeout)
                        return
                    conn.receive_data(data)
                elif type(ev) is lj.Data:
                    if (self.refuse is not None and self.refuse(ev)) or (
                            self.max_event_bytes is not None
                            and len(ev.fields.get("line", "")) > self.max_event_bytes):
                        self.refused += 1
                        log.info("lumberjack reader: %s: refusing event %d, closing", peer,
                                 ev.seq)
                        return
                    events.append(ev)
                elif type(ev) is lj.Window:
                    deadline = trio.current_time() + self.timeout
                    events = []
                elif type(ev) is lj.WindowComplete:
                    window = ReceivedWindow(events, peer, conn_no)
                    events = []
                    self.windows_received += 1
                    self.events_received += len(window.events)
                    self.dropped_events += ev.dropped
                    if self.keep_windows:
                        self.windows.append(window)
                    if self.on_window is not None:
                        r = self.on_window(window)
                        if inspect.isawaitable(r):
                            await r
                    delivered += 1
                    if self.close_after_windows is not None and \
                            delivered >= self.close_after_windows:
                        return
                    await self._ack(stream, ev)
                elif type(ev) is lj.ConnectionClosed:
                    return
        except lj.LumberjackError as e:
            self.errors[e.reason] = self.errors.get(e.reason, 0) + 1
            self._rlog.warning(e.reason, "lumberjack reader: %s: %s; closing", peer, e)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            self.errors["io"] = self.errors.get("io", 0) + 1
            log.debug("lumberjack reader: %s: %r", peer, e)
        finally:
            await trio.aclose_forcefully(stream)

    async def _ack(self, stream: trio.abc.Stream, wc: lj.WindowComplete) -> None:
        if self.ack_delay > 0:
            if self.keepalive_interval:
                end = trio.current_time() + self.ack_delay
                while (left := end - trio.current_time()) > 0:
                    await trio.sleep(min(left, self.keepalive_interval))
                    if trio.current_time() < end:
                        await stream.send_all(lj.encode_ack(0, version=2))
            else:
                await trio.sleep(self.ack_delay)
        if self.no_ack:
            return
        if self.ack_value is not None:
            value = self.ack_value(wc)
        else:
            value = wc.count if self.ack_mode == "count" else wc.last_seq
        await stream.send_all(lj.encode_ack(value))
        self.acks_sent += 1


def _peer_name(stream) -> str:
    s = stream
    while isinstance(s, trio.SSLStream):
        s = s.transport_stream
    try:
        host, port = s.socket.getpeername()[:2]
        return f"{host}:{port}"
    except (AttributeError, OSError):
        return "?"
