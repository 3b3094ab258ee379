"""Group commit for ``spool_fsync = batch``: a 202 leaves only once its record is on disk,
one fdatasync answers everything that arrived while the previous one ran, and nothing is
written to the segment while an fdatasync runs.

The ingest hands each batch -- its records (or the C pass's encoded records) and its
replies -- to :meth:`GroupCommit.submit` and reads the next batch at once.
:meth:`GroupCommit.run` (a task in the relay's nursery) works in rounds, back to back
while anything waits: it appends everything handed in since the last round to the spool
(``write()``, on the event loop), then runs the spool's
:meth:`~logjam_relay.spool.spool.Spool.sync_async` (fdatasync in the spool's sync thread,
``spool/syncthread.py``; the event loop goes on and the ingest keeps handing batches in) and, when it returns, sends
the replies of everything it covered, all together, in the order they were handed in.  So
a 202 costs the rest of the round in flight and one more, whatever the rate, and the disk
does one fdatasync per round, not one per batch.  When more was handed in while the sync
ran, the next round's write and sync start first (:meth:`Spool.sync_begin
<logjam_relay.spool.spool.Spool.sync_begin>`: the fdatasync begins in the sync thread at
once) and the replies leave while it runs: their sends are off the rounds' critical path
(measured at 100k msg/s on a 2-core machine, ``bench/stall_trace.py --fsync batch``, three
interleaved pairs: 11,216/11,421/8,533 rounds in 8 s against 9,566/7,259/6,613, replies
held p50 0.90-1.34 ms against 1.07-1.40 ms); a reply waits for that write and the hand-off
(some 20-60 µs) instead.  And the ingest, between two passes, lets a round whose sync is
done go first (:meth:`round_ready`, :meth:`yield_to_round`): trio runs ready tasks in a
random order, so the round could otherwise wait for one more ingest pass while the disk
idles (three more interleaved pairs: rounds 14,566/9,671/11,481 against
12,186/8,321/10,762, replies held p50 0.74/1.02/1.01 ms against 0.96/1.31/1.02 ms, p99
1.73/6.50/2.91 ms against 2.62/6.95/3.24 ms).

``spool_fsync_batch_delay`` (default 0: back to back) spaces the rounds: one starts at most
once per that delay, and what arrives meanwhile joins it.  On a fast disk the rounds come
thousands of times a second, and each costs the event loop some 75 µs (the thread hand-off
of the sync, the wake-ups, the replies' send): measured at 100k msg/s on a 2-core machine
(fdatasync 0.1 ms), the relay's main thread used 53-55 % of a core back to back, 43 % with
1 ms and 38 % with 2 ms, and the load generator, starved of CPU, shows it in the tail
(docs/spool-format.md, after "With `batch`, the relay commits in groups").

Why the appends wait for the round: on ext4 (data=ordered) an append to a file whose
fdatasync is running blocks until that sync's journal commit is through, and the sync
itself grows long tails (measured here on a busy disk, 6 s of 1 ms appends with
fdatasync back to back beside them: write() up to 509 ms, fdatasync up to 519 ms; the
same appends each followed by its own fdatasync: write() under 3 ms, fdatasync up to
140 ms).  An append that blocks blocks the whole event loop.

The inputs (Lumberjack, Courier) spool through :meth:`commit` and ACK once it returns
True: they share the rounds.  Heartbeats are handed in too (no replies), so the records
keep the order of their sequence numbers and the C pass can number its records ahead
(:attr:`next_seq`).

A batch that appended nothing (400s, pongs) needs no sync: its replies are sent at once
unless replies handed in before them still wait (a peer's replies keep their order).
Back-pressure: while ``max_pending`` replies or records, or ``max_bytes`` of records,
wait, or while the spool fails (a write or a sync; retried with a backoff),
:meth:`would_block` is true and the ingest stops reading (ZeroMQ's high-water marks push
back to the clients).  When the relay stops (:meth:`close`), :meth:`drain` runs the last
rounds; a write or sync that fails then withholds the 202s it should have released (the
clients resend), as before group commit.

The order "fdatasync returned, then the 202 is sent" rests on one property of
``sync_async``: everything appended before the call started is durable when it returns.
``tests/test_groupcommit.py`` checks it against that contract, and ``test_powerloss.py``
against a file system that drops what was not synced.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import trio

from ..spool.errors import SpoolWriteError
from ..spool.writer import SyncTimes

log = logging.getLogger("logjam_relay.relay")

_ACCEPTED = b"202"
#: what one waiting reply may hold: its list, the routing id (libzmq: at most 255 bytes) and
#: the app-env frame of a message that passed validation -- generous
REPLY_BYTES = 1024


def max_pending(batch_size: int) -> int:
    """Replies (and records) that may wait for the round before the ingest stops reading:
    two drained batches, at least 8192 (at 200k msg/s, 40 ms of a slow disk)."""
    return max(2 * batch_size, 8192)


class _Entry:
    """One batch handed in: records to append (or the C pass's encoded ones, or nothing),
    the replies to send once they are on disk, an input waiting for them."""
    __slots__ = ("records", "encoded", "n", "nbytes", "sock", "replies", "done", "mark", "t",
                 "heartbeat")

    def __init__(self, records, encoded, n, nbytes, sock, replies, done):
        self.records = records
        self.encoded = encoded
        self.n = n
        self.nbytes = nbytes
        self.sock = sock
        self.replies = replies
        self.done = done            # [trio.Event, result] of commit()/durable(), or None
        self.mark = -1              # spool.bytes_appended once appended (-1: not yet)
        self.t = 0.0                # handed in (time.perf_counter()), for the wait histogram
        self.heartbeat = False      # the records are the relay's heartbeats (no events)


class GroupCommit:
    """Appends, fdatasyncs and replies in rounds (see the module text).

    ``send(sock, replies)`` sends replies without blocking (the relay's
    ``zmq_trio.send_replies`` and its drop count); ``on_error(err)`` is told of every
    failed write or sync (counted and logged by the relay); ``on_written()`` after each
    round's write that appended something (the relay checks whether the spool is full
    now); ``min_round
    (``spool_fsync_batch_delay``): a round starts at most once per that many seconds
    (0: back to back).
    """

    def __init__(self, spool, send: Callable[[object, list], None], *,
                 max_pending: int = 100_000, max_bytes: int = 32 << 20,
                 on_error: Callable[[SpoolWriteError], None] | None = None,
                 on_written: Callable[[], None] | None = None,
                 min_round: float = 0.0):
        self.spool = spool
        self.min_round = max(0.0, min_round)      # spool_fsync_batch_delay
        self._send = send
        self._on_error = on_error
        self._on_written = on_written
        self.max_pending = max(1, max_pending)
        self.max_bytes = max(1, max_bytes)
        self._entries: deque[_Entry] = deque()    # handed in, in order
        self._unwritten = 0                       # entries at the front not yet appended
        self._unwritten_records = 0
        self._durable = spool.bytes_appended      # everything appended up to here is synced
        self._wake = trio.Event()
        self._room = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self._closed = trio.Event()
        self.pending = 0                          # replies waiting
        self.pending_records = 0                  # records handed in, not yet on disk
        self.pending_bytes = 0
        self.failing = False
        self.closing = False
        self.ended = False                        # run() returned: no more rounds
        # counters
        self.rounds = 0                           # syncs that released something
        self.released = 0                         # replies sent after a sync
        self.largest_group = 0
        self.sync_failures = 0                    # failed writes and syncs
        self.withheld = 0                         # 202s never sent (stopping, spool failed)
        # how long the batches' replies waited here, handed in -> sent (what the group
        # commit adds to a 202; /metrics: logjam_relay_group_commit_wait_seconds)
        self.waits = SyncTimes()
        self._in_flight = None                    # the round's SyncJob while it runs
        self._picked = trio.Event()               # set when a round took its sync's result

    # ---------------------------------------------------------------- the ingest side
    @property
    def next_seq(self) -> int:
        """The spool sequence number the next record handed in will get."""
        return self.spool.next_seq + self._unwritten_records

    def submit(self, sock, replies: list | None, records: list | None = None,
               encoded: tuple | None = None, done: list | None = None, *,
               heartbeat: bool = False) -> None:
        """A batch: ``records`` (4-frame logjam messages, for ``append_batch``) or
        ``encoded`` (``(data, n, first_seq, last_meta)`` for ``append_encoded``) or neither,
        and its ``replies`` on ``sock``, sent once the records are on disk.  ``heartbeat``:
        ``records`` are the relay's heartbeats (``Spool.append_batch``)."""
        n = nbytes = 0
        if records:
            n = len(records)
            nbytes = sum(len(r[2]) for r in records) + 64 * n
        elif encoded is not None and encoded[1]:
            n = encoded[1]
            nbytes = len(encoded[0])
        else:
            records = encoded = None
        if not n and not self._entries and done is None:
            if replies:
                if self.ended or self.spool.bytes_appended > self._durable:
                    e = _Entry(None, None, 0, 0, sock, replies, None)
                    e.t = time.perf_counter()
                    self._entries.append(e)
                    self.pending += len(replies)
                    self._unwritten += 1
                    self._kick()
                else:
                    self._send(sock, replies)       # nothing to wait for
            return
        e = _Entry(records, encoded, n, nbytes, sock, replies, done)
        e.heartbeat = heartbeat
        if replies:
            e.t = time.perf_counter()
        self._entries.append(e)
        self._unwritten += 1
        self._unwritten_records += n
        self.pending += len(replies) if replies else 0
        self.pending_records += n
        self.pending_bytes += nbytes
        self._kick()

    def answer(self, sock, replies: list) -> None:
        """Replies of a batch that appended nothing: after those handed in before."""
        if replies:
            self.submit(sock, replies)

    async def commit(self, records: list) -> bool:
        """Spool ``records`` (an input's batch) and wait until they are on disk.  True once
        they are; False when the relay stops and they could not be (nothing may be
        acknowledged)."""
        done = [trio.Event(), False]
        self.submit(None, None, records=records, done=done)
        await done[0].wait()
        return done[1]

    async def durable(self) -> bool:
        """Wait until everything handed in so far is on disk (True), or could not be."""
        if not self._entries and self.spool.bytes_appended <= self._durable:
            return True
        done = [trio.Event(), False]
        self.submit(None, None, done=done)
        await done[0].wait()
        return done[1]

    def _kick(self) -> None:
        if self.ended:
            self._give_up()
            return
        if self._idle.is_set():
            self._idle = trio.Event()
        self._wake.set()

    def would_block(self) -> bool:
        """True while the ingest should stop reading: too much waits, or the spool fails."""
        return (self.pending >= self.max_pending or self.pending_records >= self.max_pending
                or self.pending_bytes >= self.max_bytes or self.failing)

    def round_ready(self) -> bool:
        """A round's fdatasync is done and the round has not taken it up yet."""
        job = self._in_flight
        return job is not None and self.spool.sync_ready(job)

    async def yield_to_round(self) -> None:
        """The ingest's turn ends while a finished sync waits for its round: the round
        (its replies, the next write and sync) goes first.  Without this the loop's
        scheduler may run another ingest pass before it (trio picks the order of ready
        tasks at random), and the disk idles meanwhile.  Never waits longer than 2 ms."""
        with trio.move_on_after(0.002):
            await self._picked.wait()

    async def wait_room(self) -> None:
        while self.would_block():
            if self._room.is_set():
                self._room = trio.Event()
            await self._room.wait()

    # ---------------------------------------------------------------- the rounds
    async def run(self) -> None:
        """Append, sync and release, back to back while anything waits (the relay's
        nursery)."""
        try:
            await self._rounds()
        finally:
            # cancelled (the relay's nursery ends): nobody may wait for a round that never
            # comes (an input waits in commit() under a shield)
            self.ended = True
            if self._entries:
                self._give_up()

    async def _rounds(self) -> None:
        spool = self.spool
        delay = 0.05
        last = -self.min_round                    # when the last round started
        owed = False                              # a round's sync returned, its release waits
        while True:
            if not self._entries:
                self._idle.set()
                self._room.set()
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            if self.min_round > 0:
                # at most one round per min_round: what arrives meanwhile joins it
                wait = last + self.min_round - trio.current_time()
                if wait > 0 and not self.closing:
                    with trio.move_on_after(wait):
                        await self._closed.wait()   # close() cuts the wait short
                last = trio.current_time()
            try:
                try:
                    before = spool.bytes_appended
                    self._write()                 # no sync runs now
                    upto = spool.bytes_appended
                    if upto != before and self._on_written is not None:
                        self._on_written()
                    job = spool.sync_begin()      # the fdatasync starts (None: not yet)
                finally:
                    if owed:
                        # the previous round's replies, while this round's sync runs
                        owed = False
                        self._release(self._durable)
                if job is None:
                    await spool.sync_async()
                else:
                    self._in_flight = job
                    try:
                        await spool.sync_end(job)
                    finally:
                        self._in_flight = None
                        self._picked.set()
                        self._picked = trio.Event()
            except SpoolWriteError as e:
                self.sync_failures += 1
                self.failing = True
                if self._on_error is not None:
                    self._on_error(e)
                if self.closing:
                    self._give_up()
                    continue
                with trio.move_on_after(delay):
                    if spool.would_block():       # a full disk: retried once space is freed
                        await spool.wait_writable()
                    else:
                        await self._closed.wait()  # close() cuts the backoff short
                delay = min(delay * 2, 2.0)
                continue
            delay = 0.05
            self.failing = False
            if upto > self._durable:
                self._durable = upto
            if self._unwritten and not self.min_round and not self.closing:
                # more was handed in meanwhile: the next round's sync starts first, and
                # these replies leave while it runs (its write and the hand-off come first:
                # some 20-60 us; the round is shorter by the sends)
                owed = True
            else:
                self._release(self._durable)

    def _write(self) -> None:
        """Append what was handed in since the last round, in order (raises
        SpoolWriteError; what was appended before the failure counts as appended)."""
        spool = self.spool
        entries = self._entries
        i = len(entries) - self._unwritten
        while self._unwritten:
            e = entries[i]
            if e.records is not None:
                spool.append_batch(e.records, heartbeat=e.heartbeat)
            elif e.encoded is not None:
                spool.append_encoded(*e.encoded)
            e.records = e.encoded = None
            e.mark = spool.bytes_appended
            self._unwritten -= 1
            self._unwritten_records -= e.n
            i += 1

    def _release(self, upto: int) -> None:
        entries = self._entries
        n = 0
        now = 0.0
        while entries and 0 <= entries[0].mark <= upto:
            e = entries.popleft()
            self.pending_records -= e.n
            self.pending_bytes -= e.nbytes
            if e.replies:
                n += len(e.replies)
                self._send(e.sock, e.replies)
                if not now:
                    now = time.perf_counter()
                self.waits.add(now - e.t)
            if e.done is not None:
                e.done[1] = True
                e.done[0].set()
        if n:
            self.pending -= n
            self.released += n
            self.rounds += 1
            if n > self.largest_group:
                self.largest_group = n
        if not self.would_block():
            self._room.set()

    def _give_up(self) -> None:
        """Stopping with the spool failing, or the rounds ended: what is on disk is
        released; for the rest, send what needs no disk, withhold the 202s, tell the
        inputs waiting in :meth:`commit` (False)."""
        self._release(self._durable)
        withheld = 0
        while self._entries:
            e = self._entries.popleft()
            if e.replies:
                keep = [r for r in e.replies if not r[-1].startswith(_ACCEPTED)]
                withheld += len(e.replies) - len(keep)
                if keep:
                    self._send(e.sock, keep)
            if e.done is not None:
                e.done[0].set()                   # result stays False
        self._unwritten = self._unwritten_records = 0
        self.pending = self.pending_records = self.pending_bytes = 0
        if withheld:
            self.withheld += withheld
            log.warning("shutdown: %d replies 202 withheld, their records are not on disk "
                        "(the clients resend)", withheld)
        self.failing = False
        self._room.set()

    # ---------------------------------------------------------------- stopping
    def close(self) -> None:
        """The relay stops: a failing write or sync is not retried any more."""
        self.closing = True
        self._closed.set()
        self._wake.set()

    async def drain(self) -> None:
        """Wait until everything handed in was released (or withheld)."""
        while self._entries:
            self._wake.set()
            await self._idle.wait()

    def stats(self) -> dict:
        return {"rounds": self.rounds, "released": self.released, "pending": self.pending,
                "pending_records": self.pending_records, "largest_group": self.largest_group,
                "sync_failures": self.sync_failures, "withheld": self.withheld,
                "wait_seconds": self.waits.stats()}
