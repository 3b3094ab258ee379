"""Group commit for ``spool_fsync = batch``: a 202 leaves only once its record is on disk,
and one fdatasync answers everything that arrived while the previous one ran.

The ingest appends a batch to the spool (a ``write()``, on the event loop) and hands the
batch's replies to :meth:`GroupCommit.answer`; it does not wait, it reads the next batch.
:meth:`GroupCommit.run` (a task in the relay's nursery) runs the spool's
:meth:`~logjam_relay.spool.spool.Spool.sync_async` (fdatasync in a worker thread, the
event loop goes on) back to back while replies wait: every reply whose records were
appended before a sync started is sent right after that sync returns, all of them
together, in the order they were handed in.  What arrives during a sync waits for the
next one, which starts at once.  So a 202 costs at most two fdatasyncs, whatever the
rate, and the disk does one fdatasync per round, not one per batch.

The inputs (Lumberjack, Courier) ACK once :meth:`durable` returns: they share the rounds.

``answer`` needs no sync for a batch that appended nothing (400s, pongs): its replies are
sent at once unless replies queued before them still wait (a peer's replies keep their
order).  Back-pressure: while ``max_pending`` replies wait, or while the sync fails (it
is retried with a backoff), :meth:`would_block` is true and the ingest stops reading
(ZeroMQ's high-water marks push back to the clients).  When the relay stops
(:meth:`close`), :meth:`drain` ends the rounds; a sync that fails then withholds the 202s
it should have released (the clients resend), as before group commit.

The order "fdatasync returned, then the 202 is sent" rests on one property of
``sync_async``: everything appended before the call started is durable when it returns.
``tests/test_groupcommit.py`` checks it against that contract, and ``test_powerloss.py``
against a file system that drops what was not synced.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import trio

from ..spool.errors import SpoolWriteError

log = logging.getLogger("logjam_relay.relay")

_ACCEPTED = b"202"
#: what one waiting reply may hold: its list, the routing id (libzmq: at most 255 bytes) and
#: the app-env frame of a message that passed validation -- generous
REPLY_BYTES = 1024


def max_pending(batch_size: int) -> int:
    """Replies that may wait for an fdatasync before the ingest stops reading: two drained
    batches, at least 8192 (at 200k msg/s, 40 ms of a slow disk)."""
    return max(2 * batch_size, 8192)


class GroupCommit:
    """Replies released in groups after the spool's fdatasync (see the module text).

    ``send(sock, replies)`` sends replies without blocking (the relay's
    ``zmq_trio.send_replies`` and its drop count); ``on_error(err)`` is told of every
    failed sync (counted and logged by the relay).
    """

    def __init__(self, spool, send: Callable[[object, list], None], *,
                 max_pending: int = 100_000,
                 on_error: Callable[[SpoolWriteError], None] | None = None):
        self.spool = spool
        self._send = send
        self._on_error = on_error
        self.max_pending = max(1, max_pending)
        # (mark, sock, replies): sent once spool.bytes_appended >= mark is on disk
        self._queue: deque[tuple[int, object, list]] = deque()
        # [mark, event, result] of durable() callers
        self._waiters: deque[list] = deque()
        self._durable = spool.bytes_appended      # everything appended up to here is synced
        self._wake = trio.Event()
        self._room = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self._closed = trio.Event()
        self.pending = 0                          # replies waiting for a sync
        self.failing = False
        self.closing = False
        self.ended = False                        # run() returned: no more rounds
        # counters
        self.rounds = 0                           # syncs that released something
        self.released = 0                         # replies sent after a sync
        self.largest_group = 0
        self.sync_failures = 0
        self.withheld = 0                         # 202s never sent (sync failed at shutdown)

    # ---------------------------------------------------------------- the ingest side
    def answer(self, sock, replies: list) -> None:
        """The replies of a batch whose records were appended to the spool (or which
        appended nothing): sent after the next fdatasync that covers them."""
        if not replies:
            return
        mark = self.spool.bytes_appended
        if not self._queue and mark <= self._durable:
            self._send(sock, replies)            # nothing to wait for
            return
        if self.ended:                           # no round will come: withheld
            self._queue.append((mark, sock, replies))
            self.pending += len(replies)
            self._give_up()
            return
        self._queue.append((mark, sock, replies))
        self.pending += len(replies)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._wake.set()

    async def durable(self) -> bool:
        """Wait until everything appended so far is on disk.  True once it is; False when
        the relay stops and the sync failed (nothing may be acknowledged)."""
        mark = self.spool.bytes_appended
        if not self._queue and not self._waiters and mark <= self._durable:
            return True
        if self.ended:
            return False
        entry = [mark, trio.Event(), False]
        self._waiters.append(entry)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._wake.set()
        await entry[1].wait()
        return entry[2]

    def would_block(self) -> bool:
        """True while the ingest should stop reading: too many replies wait, or the
        sync fails."""
        return self.pending >= self.max_pending or self.failing

    async def wait_room(self) -> None:
        while self.would_block():
            if self._room.is_set():
                self._room = trio.Event()
            await self._room.wait()

    # ---------------------------------------------------------------- the rounds
    async def run(self) -> None:
        """Sync and release, back to back while anything waits (the relay's nursery)."""
        try:
            await self._rounds()
        finally:
            # cancelled (the relay's nursery ends): nobody may wait for a round that never
            # comes (an input waits in durable() under a shield)
            self.ended = True
            if self._queue or self._waiters:
                self._give_up()

    async def _rounds(self) -> None:
        spool = self.spool
        delay = 0.05
        while True:
            if not self._queue and not self._waiters:
                self._idle.set()
                self._room.set()
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            upto = spool.bytes_appended
            try:
                await spool.sync_async()
            except SpoolWriteError as e:
                self.sync_failures += 1
                self.failing = True
                if self._on_error is not None:
                    self._on_error(e)
                if self.closing:
                    self._give_up()
                    continue
                with trio.move_on_after(delay):
                    await self._closed.wait()     # close() cuts the backoff short
                delay = min(delay * 2, 2.0)
                continue
            delay = 0.05
            if self.failing:
                self.failing = False
            if upto > self._durable:
                self._durable = upto
            self._release(self._durable)

    def _release(self, upto: int) -> None:
        queue = self._queue
        n = 0
        while queue and queue[0][0] <= upto:
            _, sock, replies = queue.popleft()
            n += len(replies)
            self._send(sock, replies)
        if n:
            self.pending -= n
            self.released += n
            self.rounds += 1
            if n > self.largest_group:
                self.largest_group = n
        waiters = self._waiters
        while waiters and waiters[0][0] <= upto:
            entry = waiters.popleft()
            entry[2] = True
            entry[1].set()
        if not self.would_block():
            self._room.set()

    def _give_up(self) -> None:
        """Stopping, and the sync failed (or the rounds end): send what needs no disk,
        withhold the 202s, tell the inputs waiting in :meth:`durable` (False)."""
        while self._queue:
            _, sock, replies = self._queue.popleft()
            self.pending -= len(replies)
            keep = [r for r in replies if not r[-1].startswith(_ACCEPTED)]
            self.withheld += len(replies) - len(keep)
            if keep:
                self._send(sock, keep)
        while self._waiters:
            self._waiters.popleft()[1].set()      # result stays False
        if self.withheld:
            log.warning("shutdown: %d replies 202 withheld, their records were not synced "
                        "(the clients resend)", self.withheld)
        self.failing = False
        self._room.set()

    # ---------------------------------------------------------------- stopping
    def close(self) -> None:
        """The relay stops: a failing sync is not retried any more (see :meth:`drain`)."""
        self.closing = True
        self._closed.set()
        self._wake.set()

    async def drain(self) -> None:
        """Wait until every reply handed in was released (or withheld)."""
        while self._queue or self._waiters:
            self._wake.set()
            await self._idle.wait()

    def stats(self) -> dict:
        return {"rounds": self.rounds, "released": self.released, "pending": self.pending,
                "largest_group": self.largest_group, "sync_failures": self.sync_failures,
                "withheld": self.withheld}
