"""The trio side of one broker: read the spool, publish, acknowledge in order.

:class:`BrokerOutput` reads its spool reader (``samwise.<broker>``), publishes the
records addressed to its broker through its :class:`~.link.Link` (publisher confirms,
pipelined up to ``max_inflight``) and acknowledges the reader in order once the
broker confirmed.  On a lost connection or a ``basic.nack`` the reader is rewound to
the first unconfirmed record: at-least-once, duplicates only after a broker failure.
"""

from __future__ import annotations

import collections
import logging
import math
import time

import trio

from ..protocols import amqp as A
from ..protocols import samwise as proto
from ..ratelimit import RateLimitedLog
from ..spool.api import KIND_SAMWISE, SpoolReader
from .config import BrokerConfig
from .link import ACK, NACK, NO_EXCHANGE, RETURNED, Link, Out

log = logging.getLogger("logjam_relay.samwise.amqp")
_rl = RateLimitedLog(log)


def _amqp_parts(ev: proto.Publish) -> tuple:
    """What an ``Out`` needs besides the payload (the same for every payload)."""
    return (ev.exchange, A.shortstr(ev.exchange), A.shortstr(ev.routing_key),
            encode_properties(ev), ev.mandatory, ev.routing_key)


def encode_properties(ev: proto.Publish) -> bytes:
    """The AMQP properties and headers that samd parses but never sends."""
    p = ev.properties
    if p is proto.NO_PROPERTIES and not ev.headers:
        return A.NO_PROPERTIES
    headers = None
    if ev.headers:
        headers = {}
        for k, v in ev.headers:
            try:
                headers[k] = v.decode("utf-8")
            except UnicodeDecodeError:
                headers[k] = v        # sent as an AMQP byte array ('x')
    return A.encode_properties(
        content_type=p.content_type, content_encoding=p.content_encoding, headers=headers,
        delivery_mode=p.delivery_mode, priority=p.priority, correlation_id=p.correlation_id,
        reply_to=p.reply_to, expiration=p.expiration, message_id=p.message_id, type=p.type,
        user_id=p.user_id, app_id=p.app_id, cluster_id=p.cluster_id,
    )


def split_record(frames: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """A samwise spool record: [comma-separated target brokers] + the request as received."""
    return frames[0].split(b","), frames[1:]


def make_record(targets: list[str], request: list[bytes]) -> list[bytes]:
    return [",".join(targets).encode()] + request


class BrokerOutput:
    """Publishes the spool records addressed to one broker; acks the spool in order."""

    def __init__(self, cfg: BrokerConfig, reader: SpoolReader, *, max_inflight: int = 2000,
                 read_batch: int = 500, on_delivered=None, handoff=None,
                 handoff_after: float = 10.0, publish_delay: float = 0.0,
                 watch_spool: bool = True):
        self.cfg = cfg
        # watch_spool=False: whoever appends records for this broker calls notify()
        # (the endpoint does, after each append): no watcher task woken per append
        self.watch_spool = watch_spool
        self.publish_delay = publish_delay
        self.name = cfg.name
        self._bname = cfg.name.encode()
        self.reader = reader
        self.max_inflight = max_inflight
        self.read_batch = read_batch
        self._on_delivered = on_delivered   # callback(position) when this broker confirmed
        # async callback(broker, [(position, targets, request)]) -> how many of them were
        # re-addressed to other brokers (in order); used while this broker is down
        self._handoff = handoff
        self.handoff_after = handoff_after
        self._down_since = time.monotonic()
        self.handed_off = 0
        self.link: Link | None = None
        self.connected = False
        self.gen = 0
        self._seq = 0
        self._pending: dict[int, tuple[list, float]] = {}   # seq -> (window entry, t_sent)
        self._window: collections.deque[list] = collections.deque()  # [position, done]
        self._wake = trio.Event()
        self._data_read = trio.Event()
        self._window_full = False     # the feeder waits for confirms (max_inflight)
        self._memo = proto.PublishMemo(_amqp_parts)   # parse + encode once per header set
        # metrics
        self.results: collections.Counter[str] = collections.Counter()
        self.sent = 0
        self.disconnects = 0
        self.bad_records = 0
        self.confirm_latency_sum = 0.0
        self.confirm_latency_max = 0.0
        self.confirm_count = 0
        self.last_error = ""

    # ------------------------------------------------------------------ run

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.link = Link(self.cfg, self._on_events)
        try:
            async with trio.open_nursery() as n:
                n.start_soon(self.link.run)
                if self.watch_spool:
                    n.start_soon(self._watch_spool)
                task_status.started()
                await self._feed()
        finally:
            self.connected = False

    async def _watch_spool(self) -> None:
        """Pokes the feeder when the reader has unread records (one task for the
        output's life, not a nursery per idle wait)."""
        reader = self.reader
        while True:
            await reader.wait()
            self._poke()
            await self._data_read.wait()
            self._data_read = trio.Event()

    def _poke(self) -> None:
        self._wake.set()

    def notify(self) -> None:
        """New records for this broker are in the spool (``watch_spool=False``)."""
        self._wake.set()

    async def _sleep_until_poked(self) -> None:
        if self._wake.is_set():
            self._wake = trio.Event()
            await trio.lowlevel.checkpoint()
            return
        await self._wake.wait()
        self._wake = trio.Event()

    async def _feed(self) -> None:
        reader = self.reader
        while True:
            if not self.connected:
                if (self._handoff is not None
                        and time.monotonic() - self._down_since >= self.handoff_after
                        and await self._hand_off_backlog()):
                    continue
                # handoff_after 0 = no hand-off: sleep until poked (it used to spin here)
                wait = min(1.0, self.handoff_after) if self._handoff is not None else math.inf
                with trio.move_on_after(wait):
                    await self._sleep_until_poked()
                continue
            if len(self._pending) >= self.max_inflight:
                self._window_full = True
                await self._sleep_until_poked()
                continue
            want = min(self.read_batch, self.max_inflight - len(self._pending))
            # a notification from here on means "read again"; one from before is answered
            # by this read (no empty read per batch just to find out)
            self._wake = trio.Event()
            recs = reader.read(want)
            self._data_read.set()
            if recs:
                self._send(recs)
                if len(recs) >= want or self._wake.is_set():
                    await trio.lowlevel.checkpoint()     # there may be more: read on
                    continue
            await self._wake.wait()
            self._wake = trio.Event()
            if self.publish_delay > 0 and self.connected:
                # gather what arrives meanwhile into one batch: one broker write and
                # (mostly) one multiple-ack for many requests instead of a round trip
                # each, which on a busy machine costs two context switches apiece
                await trio.sleep(self.publish_delay)

    async def _hand_off_backlog(self) -> bool:
        """This broker has been down for ``handoff_after``: re-address the records waiting
        for it to brokers that are up (the endpoint appends them to the spool again, then
        this reader acknowledges the originals).  Order is kept: it stops at the first
        record no other broker can take (``redundant n`` already on every other broker).
        True if it made progress."""
        reader = self.reader
        recs = reader.read(self.read_batch)
        if not recs:
            return False
        items = []
        for rec in recs:
            if rec.kind == KIND_SAMWISE and rec.frames:
                targets, req = split_record(rec.frames)
                if self._bname in targets:
                    items.append((rec, targets, req))
        try:
            taken = await self._handoff(self.name, [(r.position, t, q) for r, t, q in items])
        except Exception:
            log.exception("samwise broker %s: hand-off failed", self.name)
            taken = 0
        if taken >= len(items):
            last = recs[-1].position
        else:
            # acknowledge up to the record before the first one nobody else took
            blocked = items[taken][0].position
            before = [r.position for r in recs if r.position < blocked]
            last = before[-1] if before else None
        if last is not None:
            reader.ack(last)
        reader.rewind()
        self.handed_off += taken
        if taken:
            _rl.warning("handoff", "samwise broker %s: down for %.0f s, handed %d waiting "
                        "message(s) to other brokers", self.name,
                        time.monotonic() - self._down_since, taken)
        return last is not None

    def _send(self, recs) -> None:
        items = []
        now = time.monotonic()
        window = self._window
        lookup = self._memo.lookup
        for rec in recs:
            entry = [rec.position, True]
            window.append(entry)
            if rec.kind != KIND_SAMWISE or not rec.frames:
                continue
            frames = rec.frames
            if self._bname not in frames[0].split(b","):
                continue                    # another broker's record
            try:
                hit = lookup(frames, 1)     # headers seen before: no parse, no event
                if hit is not None:
                    parts = hit[1]
                    payload = frames[-1]
                else:
                    ev, parts = self._memo.parse(frames[1:])
                    if not isinstance(ev, proto.Publish):
                        raise proto.SamwiseError(proto.MALFORMED_PUBLISH, "not a publish")
                    payload = ev.payload
                out = Out(self._seq + 1, parts[0], parts[1], parts[2], payload, parts[3],
                          parts[4], parts[5])
            except (proto.SamwiseError, ValueError) as e:
                # ValueError: not encodable in AMQP (the endpoint refuses those; a spool
                # written by an older version might still hold one)
                self.bad_records += 1
                _rl.error("bad-record", "samwise broker %s: dropping bad spool record %s: %s",
                          self.name, rec.position, e)
                continue
            entry[1] = False
            self._seq += 1
            self._pending[self._seq] = (entry, now)
            items.append(out)
        if items:
            self.sent += len(items)
            self.link.publish(self.gen, items)
        self._advance()

    def _advance(self) -> None:
        window = self._window
        last = None
        while window and window[0][1]:
            last = window.popleft()[0]
        if last is not None:
            self.reader.ack(last)

    # ------------------------------------------------------------- events (trio thread)

    def _on_events(self, evs) -> None:
        for ev in evs:
            kind = ev[0]
            if kind == "confirms":
                if ev[1] == self.gen and self.connected:
                    self._on_confirms(ev[2])
            elif kind == "up":
                self.gen = ev[1]
                self.connected = True
                self._poke()
            elif kind == "down":
                if ev[1] == self.gen:
                    self.last_error = ev[2]
                    if self.connected:
                        self.disconnects += 1
                    self._lost()
        self._advance()

    def _lost(self) -> None:
        """Connection gone: everything unconfirmed is re-sent from the spool later."""
        if self.connected:
            self._down_since = time.monotonic()
        self.connected = False
        self._pending.clear()
        self._window.clear()
        self.reader.rewind()
        self._poke()

    def _on_confirms(self, confirms) -> None:
        now = time.monotonic()
        pending = self._pending
        delivered = self._on_delivered
        nack = False
        acks = 0
        lat_sum = 0.0
        lat_max = self.confirm_latency_max
        for seq, result in confirms:
            p = pending.pop(seq, None)
            if p is None:
                continue
            if result == NACK:
                nack = True
                continue
            entry, t0 = p
            entry[1] = True
            if result == ACK:
                acks += 1
                dt = now - t0
                lat_sum += dt
                if dt > lat_max:
                    lat_max = dt
                if delivered is not None:
                    delivered(entry[0], self.name)
                continue
            self.results[result] += 1
            if result == RETURNED:
                _rl.warning("returned", "samwise broker %s: mandatory message returned "
                            "(unroutable)", self.name)
            elif result == NO_EXCHANGE:
                _rl.error("no-exchange", "samwise broker %s: exchange does not exist, "
                          "message dropped", self.name)
        if acks:
            self.results[ACK] += acks
            self.confirm_count += acks
            self.confirm_latency_sum += lat_sum
            self.confirm_latency_max = lat_max
        if nack:
            self.results[NACK] += 1
            self.link.reconnect(self.gen, "basic.nack")
            self._lost()
        elif self._window_full:
            self._window_full = False
            self._poke()

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        r = {
            "connected": int(self.connected),
            "inflight": len(self._pending),
            "sent": self.sent,
            "results": dict(self.results),
            "disconnects": self.disconnects,
            "handed_off": self.handed_off,
            "bad_records": self.bad_records,
            "amqp_errors": dict(self.link.amqp_errors) if self.link is not None else {},
            "blocked": int(self.link.blocked) if self.link is not None else 0,
            "confirm_latency_seconds_sum": self.confirm_latency_sum,
            "confirm_latency_seconds_count": self.confirm_count,
            "confirm_latency_seconds_max": self.confirm_latency_max,
        }
        try:
            r["reader"] = self.reader.stats()
        except Exception:
            pass
        return r
