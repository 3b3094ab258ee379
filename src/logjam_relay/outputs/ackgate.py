"""Flow control on unconfirmed acks, for an output in a worker process (``worker.py``).

The relay applies a worker's acks to the output's spool reader (the cursor log) when its
event loop reads them.  On a loaded machine that can be late: acks pile up in the socket,
and a SIGKILL of the relay then loses all of them -- the output resends those windows
after the restart, as many as the loop was behind.  So the relay confirms the acks it
applied (``T_ACKED``), and the output takes new records only while at most
:data:`UNCONFIRMED_ACKS` of its acks are unconfirmed: the bound holds by construction,
however late the relay's loop reads the acks (even while it is stopped).  The cursor stays the relay's
(loss accounting, space and damage handling depend on it); the worker only waits for it.
"""

from __future__ import annotations

import trio

from ..spool.api import Position

# An output in a worker reads new records only while at most this many of its acks are
# not yet confirmed by the relay: after a crash of the relay it resends at most what it
# had in flight plus this many windows/payloads (one ack covers at most one).  An output
# can deliver at most (in flight + this) windows per confirmation round trip, which is
# the relay's event-loop latency: at full rate on a loaded 2-core machine
# (bench_durable.py, load 9: ingest 400k msg/s, windows/payloads of 1000) it was 4-9 ms
# (median) and 23 ms (90th percentile), i.e. up to 9 windows.  With 8 both outputs kept
# up with ingest; with 4 the Lumberjack output (pipeline 4) fell to 0.86 of it, with 1 to
# 0.60.
UNCONFIRMED_ACKS = 8


class ConfirmedReader:
    """The reader an output in a worker sees: its source (:class:`SegmentTail` or
    :class:`RemoteSource`), serving new records only while at most ``limit`` of the acks
    sent to the relay are not confirmed (``T_ACKED``: applied to the relay's reader, so
    in its cursor log).

    Why this bounds the duplicates after a crash of the relay: the records past the
    durable cursor are those the output read and did not ack (its windows/payloads in
    flight) plus those covered by unconfirmed acks.  That sum only grows when the output
    reads, and a read is served only while at most ``limit`` acks are unconfirmed, each
    covering at most one window/payload; acks received and confirmations only move
    records from the first part to the second and out.  So it never exceeds what the
    output keeps in flight plus ``limit`` windows/payloads, however late the relay's loop
    reads the acks.  The output's acks are never held back (only its reads)."""

    def __init__(self, source=None, limit: int = UNCONFIRMED_ACKS):
        self.source = source
        self.limit = limit
        self.sent = 0                   # T_ACK messages sent to the relay
        self.confirmed = 0              # of which the relay confirmed this many
        self.reads_held = 0             # reads refused while acks were unconfirmed
        self._open = trio.Event()

    def __getattr__(self, name):        # anything else is the source's
        return getattr(self.__dict__["source"], name)

    def read(self, max_records: int):
        if self.sent - self.confirmed > self.limit:
            self.reads_held += 1
            return []
        return self.source.read(max_records)

    async def wait(self) -> None:
        while True:
            while self.sent - self.confirmed > self.limit:
                self._open = trio.Event()
                await self._open.wait()
            await self.source.wait()
            if self.sent - self.confirmed <= self.limit:
                return

    def ack(self, upto: Position) -> None:
        self.source.ack(upto)           # sends T_ACK (counted in ``sent``) if it moved

    def rewind(self) -> None:
        self.source.rewind()

    def stats(self) -> dict:
        d = self.source.stats()
        d["worker_acks_unconfirmed"] = self.sent - self.confirmed
        d["worker_reads_held"] = self.reads_held
        return d

    # -- the worker's side ----------------------------------------------------------
    def confirm(self, count: int) -> None:
        if count > self.confirmed:
            self.confirmed = count
            self._open.set()
