"""The relay's timed work, apart from the ingest: heartbeats, the stats tick and the
sequence reservation (:class:`Ticker`), and, with ``pub_thread = false``, PUB's
subscription cap (:func:`poll_subscriptions`; otherwise PUB's own thread applies it,
io/xpubthread.py).

Each owns its own state; the relay starts them in its nursery once its sockets are bound.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio
import zmq

from ..io.subscriptions import SubscriptionGuard
from ..protocols import logjam as L
from ..ratelimit import RateLimitedLog
from .sequence import SequenceState
from .stamping import Pipeline

log = logging.getLogger("logjam_relay.relay")
rlog = RateLimitedLog(log)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Ticker:
    """Heartbeats on PUB (spooled in sequence order, so the archive holds every sequence
    number), the stats tick (logjam-device's timer: ``msgs_received_max_bytes`` rolls, a
    stats message on the stats socket) and, every second, the sequence reservation ahead
    of the ingest (in a thread, off the loop)."""

    def __init__(self, *, pipeline: Pipeline, publish: Callable[[list], None], fqdn: str,
                 device_id: int, pub_port: int, heartbeat_interval: float,
                 stats_interval: float, publish_stats: Callable[[list], None] | None,
                 sequence_state: SequenceState, spool_frames: Callable[[list], None] | None):
        self.pipeline = pipeline
        self.publish = publish
        self.fqdn = fqdn
        self.device_id = device_id
        self.pub_port = pub_port
        self.heartbeat_interval = heartbeat_interval
        self.stats_interval = stats_interval
        self.publish_stats = publish_stats
        self.sequence_state = sequence_state
        #: hands a heartbeat to the spool (the group commit or the spool's append), or None
        self.spool_frames = spool_frames
        self.heartbeats = 0

    def heartbeat(self) -> None:
        p = self.pipeline
        frames = L.heartbeat_frames(self.fqdn, self.pub_port, self.device_id, now_ms(),
                                    p.next_sequence())
        self.publish(frames)
        self.heartbeats += 1
        if self.spool_frames is not None:
            try:
                self.spool_frames(frames)
            except Exception as e:
                rlog.error("spool_write", "spooling a heartbeat failed: %s", e)

    def restart_marker(self, skipped_from: int, skipped_to: int) -> int | None:
        """After a crash, before any ingest: spool (never publish: PUB's subscribers see
        the gap, as before) a heartbeat-shaped record whose body names the sequence
        numbers the restart skipped, ``{"restart":{"skipped_from":A,"skipped_to":B}}``;
        it takes the next number (the first of this run).  Returns that number, or None
        without a spool (nothing is taken then) or when it could not be spooled (logged,
        as a heartbeat's failure is: the relay goes on)."""
        if self.spool_frames is None:
            return None
        seq = self.pipeline.next_sequence()
        frames = L.restart_marker_frames(self.fqdn, self.pub_port, self.device_id, now_ms(),
                                         seq, skipped_from, skipped_to)
        try:
            self.spool_frames(frames)
        except Exception as e:
            log.error("spooling the restart marker (sequence numbers %d..%d skipped) failed: "
                      "%s", skipped_from, skipped_to, e)
            return None
        log.info("restart after a crash: sequence numbers %d..%d were reserved and never "
                 "spooled; restart marker spooled with number %d", skipped_from, skipped_to,
                 seq)
        return seq

    def stats_tick(self) -> None:
        p = self.pipeline
        # logjam-device's timer: msgs_received_max_bytes is the largest body of the tick
        # that ends (stats_interval, 1 s by default: 0 when idle)
        p.counters.roll_max()
        if self.publish_stats is not None:
            self.publish_stats(L.stats_frames(self.device_id, p.seq))

    async def run(self) -> None:
        p = self.pipeline
        hb_every = self.heartbeat_interval
        st_every = self.stats_interval
        clock = trio.current_time
        next_hb = clock() + hb_every
        next_st = clock() + st_every
        next_ckpt = clock() + 1.0
        last_seq_ckpt = p.seq
        while True:
            await trio.sleep_until(min(next_hb, next_st, next_ckpt))
            t = clock()
            if t >= next_hb:
                next_hb += hb_every
                if next_hb < t:
                    next_hb = t + hb_every
                self.heartbeat()
            if t >= next_st:
                next_st += st_every
                if next_st < t:
                    next_st = t + st_every
                self.stats_tick()
            if t >= next_ckpt:
                next_ckpt = t + 1.0
                rate = p.seq - last_seq_ckpt
                last_seq_ckpt = p.seq
                if p.seq + 2 * rate >= self.sequence_state.reserved:
                    # ahead of the ingest, off the loop (the ingest's own reserve() on the
                    # loop is the fallback when it reaches the bound first)
                    await self.sequence_state.reserve_async(p.seq, rate)


async def poll_subscriptions(guard: SubscriptionGuard) -> None:
    """Apply PUB's subscription cap on the event loop (``pub_thread = false``) often
    enough that a flood is cut within a poll (nobody waits on the FD, so any task may
    publish)."""
    while True:
        refused, cut = guard.refused, guard.disconnected
        guard.poll(500)           # small rounds: a flood never holds the event loop
        if guard.disconnected > cut:
            rlog.warning("subscriptions", "subscriptions over max_subscriptions=%d on %s: "
                         "%d refused, peer disconnected", guard.max_subscriptions,
                         guard.sock.getsockopt_string(zmq.LAST_ENDPOINT),
                         guard.refused - refused)
        await trio.sleep(0 if guard.busy else 0.05)
