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
  reader acknowledged the window;
* poison events never block the output (``outputs/poison.py``): an event over
  ``max_event_bytes`` goes to the dead-letter store instead of a window; a window the
  reader keeps refusing (connection closed before its ACK, ``REFUSE_LIMIT`` times in a
  row) is bisected until the refused event is found and diverted there too.

Configuration and URL: ``lumberjack_config.py``; the event mapping: ``lumberjack_encode.py``.

Network errors never escape :meth:`LumberjackOutput.run`; a bug does, and the
supervisor restarts the task (which then rewinds its source to the first unacked record).
"""

from __future__ import annotations

import logging
import math
import random
import ssl
from collections import deque

import trio

from ..io.net import connect
from ..protocols import lumberjack as lj
from ..protocols import lumberjack_acks as lja
from ..ratelimit import RateLimitedLog
from ..spool.api import Position, Record, SpoolReader
from .lumberjack_config import DEFAULT_PORT, LumberjackConfig, parse_url  # noqa: F401
from .lumberjack_encode import (  # noqa: F401  (re-exported)
    DEFAULT_MAX_EVENT_BYTES,
    EventEncoder,
    compress_window,
)
from .poison import (
    BISECT,
    HOLD,
    UNHOLD,
    DeadLetterSink,
    clear_suspicion,
    describe_error,
    is_event,
    needs_worker,
    refusal_action,
    scan,
    skip_non_events,
)
from .sendstats import SendStats

log = logging.getLogger("logjam_relay.outputs.lumberjack")

#: Compress a window in a worker thread (zlib releases the GIL) when it is larger than this.
THREAD_COMPRESS_MIN = 256 * 1024
PIPELINE_RETRY_AFTER = lja.PIPELINE_RETRY_AFTER       # (re-exported)


# ------------------------------------------------------------------------ output


class _Window:
    __slots__ = ("data", "count", "last_pos", "sent_at", "resends", "records", "refusals",
                 "suspect")

    def __init__(self, data: bytes, count: int, last_pos: Position, records: list[Record]):
        self.data = data
        self.count = count
        self.last_pos = last_pos
        self.sent_at: float | None = None     # None = never sent
        self.resends = 0
        self.records = records                # what the window was encoded from (bisection)
        self.refusals = 0                     # consecutive closes before its ACK
        self.suspect = False                  # a half of a refused window


_is_event = is_event


class _SessionEnd(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


_NET_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError,
               trio.TooSlowError, ssl.SSLError, lj.LumberjackError, _SessionEnd)


class LumberjackOutput(SendStats):
    """One Lumberjack output task: ``await LumberjackOutput(source, config).run()``."""

    UNIT = "window"

    def __init__(self, source: SpoolReader, config: LumberjackConfig, *,
                 rng: random.Random | None = None, dead_letters=None,
                 max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES):
        super().__init__()
        self.source = source
        self.config = config
        self._rng = rng or random.Random()
        self._encoder = EventEncoder(config.relay_host, max_event_bytes, config.heartbeats)
        #: windows from this size on are compressed off the event loop (a worker process,
        #: where nothing else runs on the loop, compresses every window on it: no thread
        #: start, no wake-up per window -- outputs/worker.py)
        self.thread_compress_min = THREAD_COMPRESS_MIN
        #: a window ends after the record that takes its spooled bytes to this
        self.window_bytes = config.window_bytes or 4 * max_event_bytes
        self._carry: list[Record] = []          # read, cut off a window by window_bytes
        self.windows_cut = 0
        self.dead_letters = DeadLetterSink(config.name, dead_letters)
        self._session_start = 0.0
        self._held: _Window | None = None       # an isolated refused event (see _refused)
        self._event_at_head = False             # _skip_idle found an event: until an ack
        self._release_upto: Position | None = None
        self._ssl_context = config.tls.client_context()
        self._pending: deque[_Window] = deque()   # unacked windows, oldest first
        # the ACK state (sans-IO): which of _pending are in flight on this connection (the
        # first acks.in_flight), what an ACK does, the hosts on stop-and-wait
        self.acks = lja.WriterAcks(config.pipeline)
        self._host_index = 0
        self._space = trio.Event()
        self._recv_scope: trio.CancelScope | None = None
        self._head_since = 0.0
        self._failures = 0              # consecutive failed attempts (for the backoff)
        self._rlog = RateLimitedLog(log)
        self.connected_to: tuple[str, int] | None = None
        # plain counters (the shared ones: SendStats; the ACK state's: self.acks)
        self.connect_attempts = 0
        self.disconnects: dict[str, int] = {}
        self.keepalives = 0
        self.skipped_records = 0

    # -- metrics ------------------------------------------------------------

    def stats(self) -> dict:
        c = self.config
        return {
            **self.send_stats(),
            "windows_in_flight": len(self._pending),
            "connect_attempts": self.connect_attempts,
            "connected": 1 if self.connected_to else 0,
            "disconnects": dict(self.disconnects),
            "partial_acks": self.acks.partial_acks,
            "keepalives": self.keepalives,
            "decode_errors": self._encoder.decode_errors,
            "skipped_records": self.skipped_records,
            "pipeline_fallbacks": self.acks.fallbacks,
            "windows_cut": self.windows_cut,
            "dead_letters": self.dead_letters.counts(),
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
                self._rlog.warning("connect", "lumberjack %s: connect to %s:%d failed: %s",
                                   cfg.name, host[0], host[1], describe_error(e))
                self._host_index += 1      # failover to the next host
                self._skip_idle()
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
            if self.acks.acked_on_connection:
                self._failures = 0
            else:
                self._host_index += 1
            self._failures += 1
            if reason in ("closed_by_peer", "io_error") and await self._refused():
                self._failures = 1      # bisecting: reconnect after backoff_min
            self._skip_idle()
            await self._backoff()

    def _skip_idle(self) -> None:
        """Disconnected with nothing in flight: heartbeats are not this output's backlog
        (unless ``heartbeats=on``)."""
        if not self._pending and self._held is None and not self._event_at_head \
                and not self._carry:
            self._event_at_head = skip_non_events(self.source, self.config.heartbeats)

    async def _refused(self) -> bool:
        """The reader closed the connection before the head window's ACK: count it, and
        bisect the window or hold its one event.  True while a bisection is going on.

        A held event is diverted to the dead letters only once the reader acknowledged a
        later window (:meth:`_release_held`): a reader that refuses everything (a proxy
        without a backend) never fills the dead-letter store, it just gets retried.
        """
        if not self._pending:
            return self._held is not None
        head = self._pending[0]
        if head.sent_at is None or head.sent_at < self._session_start:
            return head.suspect or self._held is not None
        self.refusals += 1
        action = refusal_action(head, head.count, self._held is not None)
        if action == UNHOLD:
            held, self._held = self._held, None
            self._pending.appendleft(held)
            clear_suspicion(self._pending)
            log.warning("lumberjack %s: the reader refuses the windows after the suspected "
                        "event too: not diverting it, retrying", self.config.name)
            return False
        if action == HOLD:
            self._held = self._pending.popleft()
            self._space.set()
            log.warning("lumberjack %s: event %s refused %d times in a row; sending what "
                        "follows it, to divert it once the reader acknowledged that",
                        self.config.name, head.records[-1].position, head.refusals)
        elif action == BISECT:
            await self._bisect_head()
        return self._held is not None or bool(self._pending and self._pending[0].suspect)

    async def _release_held(self, upto: Position) -> None:
        """An ACK after a held event: divert it, then acknowledge the source to ``upto``."""
        held, self._held = self._held, None
        events = [r for r in held.records if _is_event(r, self.config.heartbeats)]
        await self.dead_letters.divert(
            [(r, "refused", f"connection closed before the ACK {held.refusals} times in a "
                            f"row; later windows acknowledged") for r in events])
        for w in self._pending:
            w.suspect = False
        self.source.ack(upto)

    async def _bisect_head(self) -> None:
        head = self._pending[0]
        recs = head.records
        idx = [i for i, r in enumerate(recs) if _is_event(r, self.config.heartbeats)]
        cut = idx[len(idx) // 2]           # the second half starts with this event
        first, second = recs[:cut], recs[cut:]
        self.bisections += 1
        log.warning("lumberjack %s: the reader closed the connection before acknowledging "
                    "a window of %d events %d times in a row: splitting it to find the "
                    "event it refuses", self.config.name, head.count, head.refusals)
        a = await self._encode_window(first)
        b = await self._encode_window(second)
        b.last_pos = head.last_pos
        a.suspect = b.suspect = True
        self._pending.popleft()
        self._pending.appendleft(b)
        self._pending.appendleft(a)

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
        self.acks.connected()
        self._head_since = self._session_start = trio.current_time()
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
                           len(self._pending), describe_error(e) if e else "")
        return reason

    async def _send_loop(self, stream: trio.abc.Stream, host) -> None:
        source = self.source
        while True:
            depth = self._depth(host)
            sent = self.acks.in_flight
            if sent < len(self._pending):
                if sent < depth:
                    win = self._pending[sent]
                    if win.sent_at is not None:
                        win.resends += 1
                    await self._send_window(stream, win)
                    continue
                await self._wait_space()
                continue
            if len(self._pending) >= depth:
                await self._wait_space()
                continue
            records = self._read_window()
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

    def _read_window(self) -> list[Record]:
        """Up to ``window`` records; the window ends after the record that takes its
        spooled bytes (the bodies) to ``window_bytes``, the rest is kept for the next."""
        n = self.config.window
        records, self._carry = self._carry, []
        if len(records) < n:
            more = self.source.read(n - len(records))
            # a worker's read may be a RecordBlock (spool/tail.py): kept as it is
            records = records + list(more) if records else more
        cap = self.window_bytes
        if scan(records)[0] < cap:
            return records
        total = 0
        for i, r in enumerate(records):
            total += sum(map(len, r.frames))
            if total >= cap:
                if i + 1 < len(records):
                    self._carry = records[i + 1:]
                    self.windows_cut += 1
                return records[:i + 1]
        return records

    async def _send_window(self, stream, win: _Window) -> None:
        self.acks.sent(win.count)
        resent = win.sent_at is not None
        win.sent_at = trio.current_time()
        await stream.send_all(win.data)
        self.count_sent(win.count, len(win.data), resent)

    async def _make_window(self, records: list[Record]) -> _Window | None:
        last = records[-1].position
        win = await self._encode_window(records)
        win.last_pos = last
        self.skipped_records += len(records) - win.count
        if win.count == 0:
            # nothing to forward: the positions are done once everything before them is
            if self._pending:
                self._pending[-1].last_pos = last
            elif self._held is None:
                self.source.ack(last)
            # else: acknowledged with the next window the reader accepts
            return None
        return win

    async def _encode_window(self, records: list[Record]) -> _Window:
        """Map and frame ``records`` (bodies are inflated, each bounded by
        ``max_event_bytes``): in a worker thread when a body is compressed or large, or
        the window is big enough to compress there (zlib releases the GIL); events over the
        limit go to the dead letters."""
        # shielded: a cancelled session must not lose records already read
        with trio.CancelScope(shield=True):
            if needs_worker(records):
                data, n, kept, rejected = await trio.to_thread.run_sync(
                    self._encode_sync, records)
            else:
                frames, n, kept, rejected = self._encoder.encode_checked(records)
                level = self.config.compression
                if n and level and len(frames) >= self.thread_compress_min:
                    data = await compress_window(frames, n, level)     # no GIL taken
                else:
                    data = lj.encode_window(frames, n, level) if n else b""
            if rejected:
                await self.dead_letters.divert([(r, "too_large", why) for r, why in rejected])
        return _Window(data, n, records[-1].position, kept)

    def _encode_sync(self, records: list[Record]):
        frames, n, kept, rejected = self._encoder.encode_checked(records, prescan=True)
        data = lj.encode_window(frames, n, self.config.compression) if n else b""
        return data, n, kept, rejected

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
                n = self.acks.in_flight
                if self.acks.timed_out(host, trio.current_time()):
                    self._fell_back(host, f"no ACK with {n} windows in flight")
                raise _SessionEnd("timeout", f"no ACK within {self.config.timeout}s")
            conn.receive_data(data)
            while True:
                ev = conn.next_event()
                if ev is lj.NEED_DATA:
                    break
                if type(ev) is lj.Ack:
                    self._on_ack(ev.seq, host)
                    if self._release_upto is not None:
                        upto, self._release_upto = self._release_upto, None
                        await self._release_held(upto)
                elif type(ev) is lj.KeepAlive:
                    self.keepalives += 1
                    self._head_since = trio.current_time()
                elif type(ev) is lj.ConnectionClosed:
                    raise _SessionEnd("closed_by_peer", "connection closed by the reader")

    def _depth(self, host) -> int:
        """Windows allowed in flight to ``host``: what the ACK state allows
        (:meth:`WriterAcks.depth`), or 1 while a refused window is bisected."""
        if self._pending and self._pending[0].suspect:
            return 1
        depth, resumed = self.acks.depth(host, trio.current_time())
        if resumed:
            log.info("lumberjack %s: trying %d windows in flight to %s:%d again",
                     self.config.name, depth, host[0], host[1])
        return depth

    def _fell_back(self, host, why: str) -> None:
        log.warning("lumberjack %s: %s from %s:%d; stop-and-wait for the next %.0f s",
                    self.config.name, why, host[0], host[1], self.acks.retry_after)

    def _on_ack(self, value: int, host) -> None:
        now = trio.current_time()
        suspect = bool(self._pending) and self._pending[0].suspect
        ev = self.acks.receive_ack(value, host, now, pipelining=not suspect)
        if type(ev) is lja.PartialAck:
            if ev.fell_back:
                self._fell_back(host, f"partial ACK {value} for a window of {ev.count}")
            if ev.end:
                raise _SessionEnd("partial_ack", f"partial ACK {value} with "
                                  f"{self.acks.in_flight} windows in flight")
            return
        win = self._pending.popleft()
        self.count_acked(win.count, 1, now - win.sent_at)
        self._head_since = now
        self._event_at_head = False
        if self._held is not None:
            self._release_upto = win.last_pos      # after the held event is diverted
        else:
            self.source.ack(win.last_pos)
        self._space.set()


async def run(source: SpoolReader, config: LumberjackConfig) -> None:
    """Run one Lumberjack output until cancelled (see :class:`LumberjackOutput`)."""
    await LumberjackOutput(source, config).run()

