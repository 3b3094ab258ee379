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

import logging
import os
import random
import ssl
from collections import deque

import trio

from ..io.net import connect
from ..limits import EventTooLarge
from ..protocols.courier import (
    ClientConnection,
    CourierError,
    HandshakeComplete,
    PayloadAck,
)
from ..ratelimit import RateLimitedLog
from ..spool.api import Position, Record, SpoolReader
from .courier_config import CourierConfig, parse_url  # noqa: F401  (re-exported)
from .courier_encode import (  # noqa: F401  (re-exported)
    BAD_META_TAG,
    DECOMPRESS_TAG,
    NOT_JSON_TAG,
    RecordBlock,
    iso_timestamp,
    record_events,
    record_to_event,
    record_to_event_py,
)
from .poison import (
    BISECT,
    HOLD,
    UNHOLD,
    DeadLetterSink,
    clear_suspicion,
    describe_error,
    is_dns_error,
    needs_worker,
    refusal_action,
    skip_non_events,
)
from .sendstats import SendStats

log = logging.getLogger("logjam_relay.outputs.courier")

_NET_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError,
               trio.TooSlowError, CourierError)


# ------------------------------------------------------------------------- writer


class _Batch:
    __slots__ = ("nonce", "last", "events", "records", "acked", "base", "sent", "sent_at",
                 "transmissions", "refusals", "suspect")

    def __init__(self, nonce: bytes, last: Position, events: list[bytes],
                 records: list[Record]):
        self.nonce = nonce
        self.last = last          # spool position of the payload's last record
        self.events = events
        self.records = records    # the record of each event (partial ACKs, bisection)
        self.acked = 0            # events acknowledged by the receiver (absolute)
        self.base = 0             # first event of the current transmission
        self.sent = False         # sent on the current connection
        self.sent_at = 0.0
        self.transmissions = 0
        self.refusals = 0         # connections closed before it advanced, in a row
        self.suspect = False      # a half of a refused payload

    @property
    def done(self) -> bool:
        return self.acked >= len(self.events)


def _new_nonce() -> bytes:
    return os.urandom(16)


class CourierOutput(SendStats):
    """The Courier writer on one spool reader. ``await output.run()`` until cancelled."""

    UNIT = "payload"

    def __init__(self, config: CourierConfig, reader: SpoolReader, *, clock=None,
                 dead_letters=None):
        super().__init__()
        self.config = config
        self.reader = reader
        self.dead_letters = DeadLetterSink(config.name, dead_letters)
        self._held: _Batch | None = None      # an isolated refused event (see _refused)
        self._event_at_head = False           # skip_non_events found an event: until an ack
        self._evidence = False                # something after the held event was acked
        self._acked_upto: Position | None = None
        self._limiter = trio.CapacityLimiter(1)
        self.partial_acks = 0
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
        # counters (the shared ones: SendStats)
        self.reconnects = 0
        self.keepalive_acks = 0
        self.pings_sent = 0
        self.events_skipped = 0
        self.events_dropped = 0
        self.errors: dict[str, int] = {}

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
            **self.send_stats(),
            "reconnects": self.reconnects,
            "keepalive_acks": self.keepalive_acks,
            "pings_sent": self.pings_sent,
            "events_skipped": self.events_skipped,
            "events_dropped": self.events_dropped,
            "partial_acks": self.partial_acks,
            "dead_letters": self.dead_letters.counts(),
            "pending_payloads": len(self._batches),
            "unacked_events": self.unacked_events,
            "backlog_records": spool.get("backlog_records", 0),
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
            bisecting = False
            connections = self.connections
            try:
                await self._connection(host, port)
            except _NET_ERRORS as e:
                reason = _reason(e)
                self.errors[reason] = self.errors.get(reason, 0) + 1
                self._rl.warning(reason, "courier %s %s:%d: %s: %s", cfg.name, host, port,
                                 reason, describe_error(e))
                # only a receiver that took the connection (and then closed it before the
                # head payload advanced) refuses a payload; one that is down refuses the
                # connect, which backs off like any other connect failure
                if reason in ("eof", "io") and self.connections > connections:
                    bisecting = await self._refused()
            finally:
                self.connected_to = None
                for b in self._batches:     # "sent on the current connection": none now
                    b.sent = False
            if self._finished:
                return
            self.reconnects += 1
            if not self._batches and self._held is None and not self._event_at_head:
                # heartbeats are not this output's backlog (see poison.skip_non_events),
                # unless heartbeats=on
                self._event_at_head = skip_non_events(self.reader, cfg.heartbeats)
            if self._progress or bisecting:
                backoff = cfg.backoff_initial
            else:
                idx += 1
            await trio.sleep(backoff * random.uniform(0.8, 1.0))
            if not bisecting:
                backoff = min(max(backoff * 2, 0.001), cfg.backoff_max)

    # ------------------------------------------------------------ poison events

    async def _refused(self) -> bool:
        """The receiver closed the connection before the head payload advanced: count it,
        bisect the payload or hold its one event (diverted once a later payload is
        acknowledged: a receiver that refuses everything never fills the dead-letter
        store).  True while a bisection is going on."""
        head = next((b for b in self._batches if not b.done), None)
        if head is None:
            return self._held is not None
        if not head.sent or head.acked > head.base:
            return head.suspect or self._held is not None
        self.refusals += 1
        action = refusal_action(head, len(head.events) - head.acked, self._held is not None)
        if action == UNHOLD:
            held, self._held = self._held, None
            self._batches.appendleft(held)
            self._by_nonce[held.nonce] = held
            clear_suspicion(self._batches)
            log.warning("courier %s: the receiver refuses the payloads after the suspected "
                        "event too: not diverting it, retrying", self.config.name)
            return False
        if action == HOLD:
            self._hold(head)
        elif action == BISECT:
            self._bisect(head)
        first = next((b for b in self._batches if not b.done), None)
        return self._held is not None or (first is not None and first.suspect)

    def _hold(self, b: _Batch) -> None:
        self._batches.remove(b)
        del self._by_nonce[b.nonce]
        self._held = b
        self._evidence = False
        log.warning("courier %s: event at %s refused %d times in a row; sending what follows "
                    "it, to divert it once the receiver acknowledged that", self.config.name,
                    b.records[b.acked].position, b.refusals)

    def _bisect(self, b: _Batch) -> None:
        i = self._batches.index(b)
        events, records = b.events[b.acked:], b.records[b.acked:]
        mid = len(events) // 2
        first = _Batch(_new_nonce(), records[mid - 1].position, events[:mid], records[:mid])
        second = _Batch(_new_nonce(), b.last, events[mid:], records[mid:])
        first.suspect = second.suspect = True
        self.bisections += 1
        log.warning("courier %s: the receiver closed the connection before acknowledging a "
                    "payload of %d events %d times in a row: splitting it to find the event "
                    "it refuses", self.config.name, len(events), b.refusals)
        del self._batches[i]
        del self._by_nonce[b.nonce]
        for nb in (second, first):
            while nb.nonce in self._by_nonce:   # pragma: no cover - 2**-128
                nb.nonce = _new_nonce()
            self._batches.insert(i, nb)
            self._by_nonce[nb.nonce] = nb

    async def _release_held(self) -> None:
        held, self._held = self._held, None
        recs = held.records[held.acked:]
        await self.dead_letters.divert(
            [(r, "refused", f"connection closed before the ACKN {held.refusals} times in a "
                            f"row; later payloads acknowledged") for r in recs])
        for b in self._batches:
            b.suspect = False
        self._pop_done()

    # ------------------------------------------------------------ connection

    async def _connection(self, host: str, port: int) -> None:
        """One connection; returns after a graceful shutdown, raises when it fails."""
        cfg = self.config
        try:
            with trio.fail_after(cfg.network_timeout):
                stream = await connect(host, port, ssl_context=self._ssl,
                                       server_name=cfg.tls.server_name)
        except BaseException as e:
            if isinstance(e, Exception):
                self.connect_failures += 1     # DNS, refused, TLS handshake, timeout
            raise
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
                    if self._held is not None and self._evidence:
                        await self._release_held()
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
        if self._held is not None:
            self._evidence = True
        if ev.complete:
            b.acked = len(b.events)
        self.count_acked(ev.advanced, rtt=now - b.sent_at if ev.complete else None)
        self._pop_done()

    def _pop_done(self) -> None:
        """Acknowledge completed payloads to the spool, strictly in order, and the record
        of the last acknowledged event of a partly acknowledged first payload (so a
        restart resumes inside it)."""
        if self._held is not None:
            return      # nothing past the held event is acknowledged before it is diverted
        batches = self._batches
        while batches and batches[0].done:
            done = batches.popleft()
            del self._by_nonce[done.nonce]
            if done.events:
                self.count_acked(units=1)
            self._ack(done.last)
        if batches and batches[0].acked:
            head = batches[0]
            if self._ack(head.records[head.acked - 1].position):
                self.partial_acks += 1

    def _ack(self, pos: Position) -> bool:
        if self._acked_upto is not None and pos <= self._acked_upto:
            return False
        self._acked_upto = pos
        self._event_at_head = False
        self.reader.ack(pos)
        return True

    async def _read_batches(self) -> bool:
        """Turn the next ``payload_size`` spool records into payload(s); False if none.

        The mapping inflates bodies (each bounded by ``max_event_bytes``): when a record is
        compressed or large it runs in a worker thread, never on the event loop; records
        over the limit are diverted to the dead-letter store.
        """
        records = self.reader.read(self.config.payload_size)
        if not records:
            return False
        # shielded: records taken from the reader must end up in a payload
        with trio.CancelScope(shield=True):
            if needs_worker(records):
                groups, rejected, skipped = await trio.to_thread.run_sync(
                    self._map_records, records, limiter=self._limiter)
            else:
                groups, rejected, skipped = self._map_records(records)
            self.events_skipped += skipped
            if rejected:
                self.events_dropped += len(rejected)
                await self.dead_letters.divert([(r, "too_large", why) for r, why in rejected])
        for last, events, recs in groups:
            self._add_batch(last, events, recs)
        self._pop_done()   # a payload of skipped records only is done at once
        return True

    def _map_records(self, records: list[Record]):
        """(payload groups [(last position, events, records)], rejected, skipped) -- in a
        worker thread.  The C mapping does a whole batch in one call
        (:func:`record_events`); a batch of events that all fit one payload is then done."""
        cfg = self.config
        limit = cfg.max_event_bytes
        hostname = cfg.hostname
        mapped = record_events(records, hostname, limit, cfg.heartbeats)
        if mapped is not None:
            evs, clean, total, longest = mapped
            if clean and longest <= limit and total + 4 * (len(evs) - 1) <= cfg.max_payload_bytes:
                # a list is copied (a reader may reuse it); a RecordBlock is read-only
                return [(records[-1].position, evs,
                         records if type(records) is RecordBlock else list(records))], [], 0
        else:
            evs = None
        groups = []
        rejected: list[tuple[Record, str]] = []
        events: list[bytes] = []
        recs: list[Record] = []
        size = skipped = 0
        for i, rec in enumerate(records):
            ev = evs[i] if evs is not None else False
            if ev is False:
                try:
                    ev = record_to_event(rec, hostname, limit, cfg.heartbeats)
                except EventTooLarge as e:
                    rejected.append((rec, e.reason))
                    continue
            if ev is None:
                skipped += 1
                continue
            if len(ev) > limit:
                rejected.append((rec, f"event of {len(ev)} bytes is over {limit} bytes"))
                continue
            if events and size + len(ev) > cfg.max_payload_bytes:
                groups.append((records[i - 1].position, events, recs))
                events, recs, size = [], [], 0
            events.append(ev)
            recs.append(rec)
            size += len(ev) + 4
        groups.append((records[-1].position, events, recs))
        return groups, rejected, skipped

    def _add_batch(self, last: Position, events: list[bytes], records: list[Record]) -> _Batch:
        b = _Batch(_new_nonce(), last, events, records)
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
        self.count_sent(len(events), len(data), b.transmissions > 1)
        await stream.send_all(data)

    async def _send_loop(self, stream, conn: ClientConnection) -> None:
        while True:
            self._wake = trio.Event()
            now = self._clock()
            conn.check(now)
            if conn.ready:
                while conn.can_send():
                    # payloads not sent on this connection yet (resends first, in order) ...
                    suspect = False
                    for b in list(self._batches):
                        if not conn.can_send():
                            break
                        if b.done:
                            continue
                        if not b.sent:
                            await self._send_batch(stream, conn, b, self._clock())
                        if b.suspect:      # bisecting: this payload alone in flight
                            suspect = True
                            break
                    # ... then new ones from the spool
                    if suspect or not conn.can_send() or self._shutdown \
                            or not await self._read_batches():
                        break
                now = self._clock()
                if conn.want_ping(now):
                    self.pings_sent += 1
                    await stream.send_all(conn.ping(now))
                if self._shutdown and not self._batches and conn.idle:
                    await self._graceful_close(stream)
                    return
            want_records = (conn.ready and conn.can_send() and not self._shutdown
                            and all((b.sent and not b.suspect) or b.done
                                    for b in self._batches))
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
    if is_dns_error(e):
        return "dns"
    return "io"


def _leaves(eg: BaseExceptionGroup) -> list[BaseException]:
    out = []
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            out.extend(_leaves(e))
        else:
            out.append(e)
    return out
