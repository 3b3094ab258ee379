"""A tiny HTTP/1.1 server for /metrics, /healthz and /readyz that a slowloris cannot stop.

* **Its own thread.**  The server runs its own trio loop in a worker thread started
  (and stopped) by the relay's nursery, so accepting and parsing never compete with
  the ZeroMQ hot path.  Handlers still run on the relay's event loop (they read
  its counters): the server hands each one over with ``TrioToken.run_sync_soon``
  and waits at most ``loop_timeout`` seconds.  A relay loop that does not answer
  in time gets ``503 event loop not responding`` on /healthz and /readyz, while
  /metrics serves the last rendering it has (header ``X-Stale-Seconds``).
* **Bounded connections.**  At most ``max_connections`` are open.  When a new one
  arrives at the cap, the oldest connection still reading its request is closed
  (a slowloris holds many such; a scrape sends its request at once and is gone
  within milliseconds), so a scrape gets through however many idle connections
  are open.  Each request has ``header_timeout`` seconds to arrive in full.
* **Pluggable TLS and auth** (the exporter web-config): ``ssl_context`` wraps each
  connection (server side, handshake inside the header timeout), and
  ``authorize(method, path, headers) -> bool`` may refuse a request with 401.  With
  ``authorize_cached`` (credentials verified before: no bcrypt) a request it accepts is
  served at once; the others get the full check in a worker thread, one at a time, and
  stay evictable at the connection cap meanwhile, so a flood of wrong passwords neither
  blocks this loop nor holds the slots a known scraper needs.

Requests are small GETs; every response closes the connection.  The request head is
parsed by the sans-IO core ``protocols/http.py`` (malformed requests get 400, a head over
8 KiB 431, counted in ``bad_requests`` by reason).

Scrapes of ``/metrics`` are counted as prometheus-cpp's exposer counts them (the
``exposer_*`` families logjam-device serves, :class:`ScrapeStats`).
"""

from __future__ import annotations

import logging
import math
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ..fdreserve import RESERVE, out_of_fds
from ..protocols.http import (
    CLOSED,
    MAX_REQUEST,
    NEED_DATA,
    HTTPError,
    RequestReader,
    encode_response,
)
from ..ratelimit import RateLimitedLog

log = logging.getLogger("logjam_relay.http")
rlog = RateLimitedLog(log)

Handler = Callable[[], tuple[int, str, bytes]]   # -> (status, content type, body)
Authorize = Callable[[str, str, dict[str, str]], bool]

STALE_OK = frozenset({"/metrics"})      # may be answered from the last rendering
SCRAPES = frozenset({"/metrics"})       # counted in ScrapeStats (exposer_*)
#: connections served on descriptors of the fd reserve while the relay is out of them
RESERVE_CONNECTIONS = 2


class ScrapeStats:
    """prometheus-cpp's exposer figures for the scrapes served (``handler.cc``): after
    each 200 answer to ``GET /metrics``, the body's bytes, one scrape, and the time from
    the request read to the answer written, in whole microseconds.  Its latency summary
    has the quantiles 0.5, 0.9 and 0.99 of the last ``window`` seconds (prometheus-cpp:
    60 s, in five rotating buckets; here exact, over at most ``max_samples`` of them;
    NaN when there was none), and a count and sum since start.  Written by the server's
    thread, read by the collector's: under a lock."""

    QUANTILES = (0.5, 0.9, 0.99)

    def __init__(self, window: float = 60.0, max_samples: int = 4096, clock=time.monotonic):
        self.window = window
        self.clock = clock
        self._lock = threading.Lock()
        self.scrapes = 0
        self.bytes = 0
        self.latency_count = 0
        self.latency_sum = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=max_samples)

    def observe(self, nbytes: int, micros: int) -> None:
        with self._lock:
            self.scrapes += 1
            self.bytes += nbytes
            self.latency_count += 1
            self.latency_sum += micros
            self._recent.append((self.clock(), micros))

    def snapshot(self) -> dict:
        with self._lock:
            horizon = self.clock() - self.window
            while self._recent and self._recent[0][0] < horizon:
                self._recent.popleft()
            values = sorted(v for _, v in self._recent)
            snap = {"scrapes": self.scrapes, "bytes": self.bytes,
                    "latency_count": self.latency_count, "latency_sum": self.latency_sum}
        n = len(values)
        snap["quantiles"] = {q: float(values[min(n - 1, max(0, math.ceil(q * n) - 1))])
                             if n else math.nan for q in self.QUANTILES}
        return snap


@dataclass(eq=False)
class _Conn:
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    reading: bool = True                 # still waiting for its request
    reserved: bool = False               # on a descriptor of the fd reserve


class HTTPServer:
    def __init__(self, routes: dict[str, Handler], host: str, port: int, *,
                 max_connections: int = 64, header_timeout: float = 5.0,
                 loop_timeout: float = 5.0, threaded: bool = True,
                 ssl_context: ssl.SSLContext | None = None,
                 authorize: Authorize | None = None, realm: str = "logjam-relay",
                 authorize_cached: Authorize | None = None):
        self.routes = routes
        self.host = "" if host in ("0.0.0.0", "*") else host
        self.port = port
        self.max_connections = max(1, max_connections)
        self.header_timeout = header_timeout
        self.loop_timeout = loop_timeout
        self.threaded = threaded
        self.ssl_context = ssl_context
        self.authorize = authorize
        self.authorize_cached = authorize_cached
        self._auth_limiter: trio.CapacityLimiter | None = None
        self.realm = realm
        self.bound_port: int | None = None
        self._conns: dict[int, _Conn] = {}
        self._next_id = 0
        self._relay_token: trio.lowlevel.TrioToken | None = None
        self._last: dict[str, tuple[float, tuple[int, str, bytes]]] = {}
        # metrics (read by the health layer)
        self.requests = 0
        self.connections = 0
        self.evicted = 0            # closed at the cap while still reading their request
        self.rejected = 0           # closed at once: the cap was full of busy connections
        self.timeouts = 0           # request not complete within header_timeout
        self.bad_requests = 0
        self.bad_requests_by_reason: dict[str, int] = {}
        self.unauthorized = 0
        self.loop_timeouts = 0      # the relay's loop did not run a handler in time
        self.out_of_fds = 0         # closed at accept: the relay was out of descriptors
        self.reserve_served = 0     # served on a descriptor of the fd reserve instead
        self._on_reserve = 0        # such connections open now
        self.scrape_stats = ScrapeStats()
        self.thread_id: int | None = None   # the server's native thread id (threaded)

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def stats(self) -> dict:
        return {"requests": self.requests, "connections": self.connections,
                "open_connections": self.open_connections, "evicted": self.evicted,
                "rejected": self.rejected, "timeouts": self.timeouts,
                "bad_requests": self.bad_requests,
                "bad_requests_by_reason": dict(self.bad_requests_by_reason),
                "unauthorized": self.unauthorized,
                "loop_timeouts": self.loop_timeouts, "out_of_fds": self.out_of_fds,
                "reserve_served": self.reserve_served}

    # ------------------------------------------------------------------ running
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self._relay_token = trio.lowlevel.current_trio_token()
        if not self.threaded:
            listeners = await trio.open_tcp_listeners(self.port, host=self.host or None)
            self.bound_port = listeners[0].socket.getsockname()[1]
            task_status.started(self.bound_port)
            await self._serve(listeners)
            return
        started = trio.Event()
        box: dict = {}
        relay_token = self._relay_token

        def report(key, value):
            box[key] = value
            try:
                relay_token.run_sync_soon(started.set)
            except trio.RunFinishedError:
                pass

        async def thread_main():
            self.thread_id = threading.get_native_id()
            try:
                listeners = await trio.open_tcp_listeners(self.port, host=self.host or None)
            except BaseException as e:  # noqa: BLE001 -- handed to the relay's loop
                report("error", e)
                return
            self.bound_port = listeners[0].socket.getsockname()[1]
            with trio.CancelScope() as scope:
                box["token"] = trio.lowlevel.current_trio_token()
                box["scope"] = scope
                report("port", self.bound_port)
                await self._serve(listeners)

        def stop_thread():
            token, scope = box.get("token"), box.get("scope")
            if token is not None:
                try:
                    token.run_sync_soon(scope.cancel)
                except trio.RunFinishedError:
                    pass

        async with trio.open_nursery() as nursery:
            # its own limiter: the server's thread never takes a slot of the shared pool
            # named for the OS too ("metrics-http": top -H, the per-thread CPU metric)
            nursery.start_soon(lambda: trio.to_thread.run_sync(
                trio.run, thread_main, abandon_on_cancel=False,
                limiter=trio.CapacityLimiter(1), thread_name="metrics-http"))
            try:
                await started.wait()
                if "error" in box:
                    raise box["error"]
                task_status.started(self.bound_port)
                await trio.sleep_forever()
            finally:
                stop_thread()

    async def _serve(self, listeners) -> None:
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener, nursery)

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        try:
            while True:
                reserved = False
                try:
                    stream = await listener.accept()
                except OSError as e:        # EMFILE and friends: back off, keep serving
                    if not out_of_fds(e):
                        rlog.error("http_accept", "metrics endpoint: accept failed: %s", e)
                        await trio.sleep(0.1)
                        continue
                    stream = self._accept_out_of_fds(listener)
                    if stream is None:
                        await trio.sleep(0.1)
                        continue
                    reserved = True
                self.connections += 1
                if len(self._conns) >= self.max_connections and not self._evict_one():
                    self.rejected += 1
                    await trio.aclose_forcefully(stream)
                    continue
                cid = self._next_id
                self._next_id += 1
                conn = self._conns[cid] = _Conn(reserved=reserved)
                nursery.start_soon(self._handle, stream, cid, conn, reserved)
        finally:
            await trio.aclose_forcefully(listener)

    def _accept_out_of_fds(self, listener: trio.SocketListener) -> trio.SocketStream | None:
        """``accept`` failed for want of descriptors: serve the connection on one of the fd
        reserve's (at most :data:`RESERVE_CONNECTIONS` at a time, so a scrape still gets
        through), or close it at once (counted in ``out_of_fds``).  None: nothing to take."""
        fd = listener.socket.fileno()
        try:
            keep = RESERVE.keep(0.25)           # the spool's files come first
            if self._on_reserve < RESERVE_CONNECTIONS:
                sock = RESERVE.accept(fd, keep)
                if sock is not None:
                    self._on_reserve += 1
                    self.reserve_served += 1
                    return trio.SocketStream(trio.socket.from_stdlib_socket(sock))
            elif self._evict_one(reserved=True):
                return None             # its descriptor is back soon: the next try takes it
            elif RESERVE.refuse(fd, keep):
                self.out_of_fds += 1
                rlog.warning("http_out_of_fds", "metrics endpoint: out of file descriptors: "
                             "closed a new connection at once (%d so far)", self.out_of_fds)
                return None
        except OSError as e:
            rlog.error("http_accept", "metrics endpoint: accept failed: %s", e)
            return None
        if not RESERVE.held:
            rlog.error("http_accept", "metrics endpoint: accept failed: out of file "
                       "descriptors and the fd reserve is empty")
        return None

    def _evict_one(self, reserved: bool = False) -> bool:
        """Close the oldest connection that has not sent its request yet (of those on the
        fd reserve's descriptors, with ``reserved``)."""
        for cid, conn in self._conns.items():
            if conn.reading and (conn.reserved or not reserved):
                conn.scope.cancel()
                del self._conns[cid]
                self.evicted += 1
                return True
        return False

    # --------------------------------------------------------------- requests
    async def _handle(self, stream: trio.SocketStream, cid: int, conn: _Conn,
                      reserved: bool = False) -> None:
        try:
            with conn.scope:
                await self._request(stream, conn)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ssl.SSLError):
            pass
        finally:
            self._conns.pop(cid, None)
            if reserved:            # its descriptor goes back to the fd reserve
                self._on_reserve -= 1
                RESERVE.close_socket(stream.socket)
            await trio.aclose_forcefully(stream)

    async def _request(self, stream, conn: _Conn) -> None:
        reader = RequestReader(MAX_REQUEST)
        req = None
        with trio.move_on_after(self.header_timeout) as read_scope:
            if self.ssl_context is not None:
                stream = trio.SSLStream(stream, self.ssl_context, server_side=True)
                await stream.do_handshake()
            try:
                while (req := reader.next_event()) is NEED_DATA:
                    reader.receive_data(await stream.receive_some(4096))
            except HTTPError as e:
                self.bad_requests += 1
                self.bad_requests_by_reason[e.reason] = \
                    self.bad_requests_by_reason.get(e.reason, 0) + 1
                rlog.warning("http_" + e.reason, "metrics endpoint: bad request (%s): %s; "
                             "answered %d", e.reason, e, e.status)
                await self._respond(stream, e.status, "text/plain", f"{e}\n".encode())
                return
        if read_scope.cancelled_caught:
            self.timeouts += 1
            return
        if req is CLOSED:
            return
        conn.reading = False
        method, path = req.method, req.path
        self.requests += 1
        if self.authorize is not None:
            ok = self._authorized(self.authorize_cached, method, path, req.headers) \
                if self.authorize_cached is not None else False
            if not ok:
                if self.authorize_cached is None:
                    ok = self._authorized(self.authorize, method, path, req.headers)
                else:
                    # the slow check (bcrypt) in a worker thread, one at a time; meanwhile
                    # the connection counts as not yet served, so that at the cap it is
                    # closed before a scrape whose credentials are known is refused
                    if self._auth_limiter is None:
                        self._auth_limiter = trio.CapacityLimiter(1)
                    conn.reading = True
                    ok = await trio.to_thread.run_sync(
                        self._authorized, self.authorize, method, path, req.headers,
                        limiter=self._auth_limiter)
                    conn.reading = False
            if not ok:
                self.unauthorized += 1
                await self._respond(stream, 401, "text/plain", b"unauthorized\n",
                                    extra=f'WWW-Authenticate: Basic realm="{self.realm}"\r\n')
                return
        handler = self.routes.get(path)
        if handler is None:
            await self._respond(stream, 404, "text/plain", b"not found\n")
            return
        if method not in ("GET", "HEAD"):
            await self._respond(stream, 405, "text/plain", b"GET only\n")
            return
        t0 = time.monotonic()
        status, ctype, body, extra = await self._call(path, handler)
        with trio.move_on_after(self.header_timeout):
            await self._respond(stream, status, ctype, b"" if method == "HEAD" else body,
                                length=len(body), extra=extra)
            if status == 200 and method == "GET" and path in SCRAPES:
                self.scrape_stats.observe(len(body), int((time.monotonic() - t0) * 1e6))

    async def _call(self, path: str, handler: Handler) -> tuple[int, str, bytes, str]:
        """Run ``handler`` on the relay's event loop (or here when not threaded)."""
        if not self.threaded or self._relay_token is None:
            return (*self._run_handler(path, handler), "")
        done = trio.Event()
        here = trio.lowlevel.current_trio_token()
        box: list = []

        def job():
            box.append(self._run_handler(path, handler))
            try:
                here.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        try:
            self._relay_token.run_sync_soon(job)
        except trio.RunFinishedError:
            return 503, "text/plain", b"shutting down\n", ""
        with trio.move_on_after(self.loop_timeout):
            await done.wait()
        if box:
            result = box[0]
            if path in STALE_OK and result[0] == 200:
                self._last[path] = (time.monotonic(), result)
            return (*result, "")
        self.loop_timeouts += 1
        rlog.error("http_loop", "metrics endpoint: the relay's event loop did not answer "
                   "%s within %.1f s", path, self.loop_timeout)
        last = self._last.get(path)
        if last is not None:
            age = time.monotonic() - last[0]
            return (*last[1], f"X-Stale-Seconds: {age:.1f}\r\n")
        return (503, "text/plain", b"event loop not responding\n", "")

    @staticmethod
    def _authorized(check: Authorize, method: str, path: str, headers: dict) -> bool:
        try:
            return bool(check(method, path, headers))
        except Exception:
            log.exception("metrics endpoint: authorization check failed")
            return False

    @staticmethod
    def _run_handler(path: str, handler: Handler) -> tuple[int, str, bytes]:
        try:
            return handler()
        except Exception:
            log.exception("handler for %s failed", path)
            return 500, "text/plain", b"internal error\n"

    @staticmethod
    async def _respond(stream, status: int, ctype: str, body: bytes,
                       length: int | None = None, extra: str = "") -> None:
        await stream.send_all(encode_response(status, ctype, body, length=length, extra=extra))
