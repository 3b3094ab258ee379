"""The one path a stamped batch takes from the ingest to its replies, chosen once.

The relay's ingest (the C pass, the Python fallback, the inputs) hands every stamped and
published batch to its :class:`BatchPath`; which one it is follows from the relay's parts
when the relay is built (:func:`choose`), and nothing asks again on the hot path:

* :class:`NoSpool`: no spool; the replies leave at once.
* :class:`Spooled`: a spool whose fsync policy needs no owner (``interval``, ``never``):
  the records are appended, then the replies leave (a 202 means "in the spool").
* :class:`GroupCommitted`: ``spool_fsync = batch``: the group commit
  (relay/groupcommit.py) appends, fdatasyncs and then sends the replies, in rounds.

All three have the same interface: :meth:`next_seq` (the spool sequence number the C pass
encodes its records from: the part that numbers the spool's records is the spool itself,
or the group commit in front of it, never the relay), :meth:`take` (a batch and its
replies), :meth:`commit` (an input's batch: True once it is in the spool), the ingest's
back-pressure (:meth:`would_block`, :meth:`pause`), its wait on a socket
(:meth:`wait_in`), its turn between two passes (:meth:`between_passes`), the heartbeats
(:attr:`spool_heartbeats`), the tasks (:meth:`start`) and the shutdown (:meth:`drain`).

``take`` reaches no checkpoint on the common path, so the ingest awaits it without a
cancel scope of its own; what waits (a write retried after an error) is shielded inside:
a batch published on PUB is spooled and answered to the end, or its 202s withheld.
"""

from __future__ import annotations

import logging

import trio
import zmq

from ..io import zmq_trio
from ..ratelimit import RateLimitedLog
from ..spool.errors import SpoolWriteError
from .groupcommit import GroupCommit, max_pending
from .spoolwrite import SpoolWrites

log = logging.getLogger("logjam_relay.relay")
rlog = RateLimitedLog(log)
_ACCEPTED = b"202"
#: (Spooled) a batch waits for its retry: the next one goes after it
HELD = object()


class Replies:
    """Sends a batch's replies without blocking.  A peer gone (EHOSTUNREACH) or its
    queue full (EAGAIN): the reply is lost, as with logjam-device, but counted."""
    __slots__ = ("drops",)

    def __init__(self) -> None:
        self.drops = 0

    def send(self, sock: zmq.Socket, replies: list[list[bytes]]) -> None:
        self.drops += zmq_trio.send_replies(sock, replies)


def _withheld(n: int, replies: list | None) -> list | None:
    """Shutting down with the batch not in the spool: no 202 for it (a 202 means "in
    the spool"); the client's timeout makes it resend."""
    log.warning("shutdown: %d messages published but not spooled; their replies are "
                "withheld", n)
    return [r for r in replies if not r[-1].startswith(_ACCEPTED)] if replies else None


async def _spool_room(spool, writes: SpoolWrites) -> None:
    if spool.would_block():
        # policy "block": stop reading; ZeroMQ's HWM pushes back to the clients
        rlog.warning("spool_full", "spool is full (%d bytes): ingress paused until "
                     "outputs catch up", spool.max_bytes)
        await writes.paused(spool.wait_writable)


class NoSpool:
    """No spool: the replies leave with the batch; nothing is numbered (-1)."""
    spool = None
    commits = None
    spool_heartbeats = None             # the ticker spools nothing
    between_passes = staticmethod(trio.lowlevel.checkpoint)

    def __init__(self, replies: Replies):
        self._replies = replies

    def next_seq(self) -> int:
        return -1

    async def take(self, sock, replies, records=None, encoded=None) -> None:
        if replies:
            self._replies.send(sock, replies)

    async def commit(self, records: list) -> bool:
        return True

    def would_block(self) -> bool:
        return False

    async def pause(self) -> None:
        pass

    async def wait_in(self, sock: zmq.Socket) -> None:
        await zmq_trio.wait_for(sock, zmq.POLLIN)

    def start(self, nursery) -> None:
        pass

    async def drain(self, seconds: float) -> None:
        pass


class Spooled:
    """A spool that syncs by itself (``interval``, ``never``): appended, then answered.

    The spool numbers its records: the C pass encodes from :attr:`Spool.next_seq` and
    appends before anything else can (no checkpoint between the two).  A write that
    fails is retried (:class:`SpoolWrites`); while it waits, the batch is *held*: the
    ingest pauses (:meth:`would_block`), an input's batch and the heartbeats go after it,
    so nothing takes the numbers it was encoded with."""
    commits = None
    between_passes = staticmethod(trio.lowlevel.checkpoint)

    def __init__(self, spool, writes: SpoolWrites, replies: Replies):
        self.spool = spool
        self._writes = writes
        self._replies = replies
        self._held: trio.Event | None = None    # set while a failed write is retried
        self._later: list[list[bytes]] = []     # heartbeats that came meanwhile

    def next_seq(self) -> int:
        return self.spool.next_seq

    async def take(self, sock, replies, records=None, encoded=None) -> None:
        if records or encoded is not None:
            why = self._append(records, encoded)
            if why is not None:
                with trio.CancelScope(shield=True):
                    ok = await self._retry(records, encoded, why)
                if not ok:
                    replies = _withheld(len(records) if records else encoded[1], replies)
        if replies:
            self._replies.send(sock, replies)

    def _append(self, records, encoded) -> SpoolWriteError | object | None:
        """None once appended; else why not: the write's error, or :data:`HELD`."""
        if self._held is not None:
            return HELD
        try:
            if encoded is not None:
                self.spool.append_encoded(*encoded)
            else:
                self.spool.append_batch(records)
        except SpoolWriteError as e:
            return e
        return None

    async def _retry(self, records, encoded, why=HELD) -> bool:
        """Append after the batch held before this one, retried until it is in (True) or
        the relay stops (False); held meanwhile."""
        while self._held is not None:
            await self._held.wait()
        self._held = held = trio.Event()
        try:
            return await self._writes.write(
                self.spool, records, encoded,
                failed=why if isinstance(why, SpoolWriteError) else None)
        finally:
            self._held = None
            held.set()
            later, self._later = self._later, []
            for frames in later:
                try:
                    self.spool.append_batch([frames], heartbeat=True)
                except SpoolWriteError as e:        # (logged as the ticker logs it)
                    rlog.error("spool_write", "spooling a heartbeat failed: %s", e)

    async def commit(self, records: list) -> bool:
        with trio.CancelScope(shield=True):
            return await self._retry(records, None)

    def spool_heartbeats(self, frames: list[bytes]) -> None:
        if self._held is not None:
            self._later.append(frames)          # after the held batch: its numbers stay
        else:
            self.spool.append_batch([frames], heartbeat=True)

    def would_block(self) -> bool:
        return self._held is not None or self.spool.would_block()

    async def pause(self) -> None:
        await _spool_room(self.spool, self._writes)
        while self._held is not None:
            await self._writes.paused(self._held.wait)

    async def wait_in(self, sock: zmq.Socket) -> None:
        await zmq_trio.wait_for(sock, zmq.POLLIN)

    def start(self, nursery) -> None:
        nursery.start_soon(self.spool.run)

    async def drain(self, seconds: float) -> None:
        pass


class GroupCommitted:
    """``spool_fsync = batch``: the group commit appends, fdatasyncs and answers in rounds
    (relay/groupcommit.py).  It numbers the records handed to it ahead of the spool
    (:attr:`GroupCommit.next_seq`: the spool's next seq plus what it holds unwritten)."""
    def __init__(self, spool, writes: SpoolWrites, replies: Replies, *, batch_size: int,
                 max_bytes: int, min_round: float):
        self.spool = spool
        self._writes = writes
        self._replies = replies
        self._in_wait: dict[zmq.Socket, trio.CancelScope] = {}   # ingest tasks at rest
        self._running = False
        self.commits = GroupCommit(spool, self._send_released,
                                   max_pending=max_pending(batch_size), max_bytes=max_bytes,
                                   on_error=self._failed, on_written=self._wake_if_blocked,
                                   min_round=min_round)

    def next_seq(self) -> int:
        return self.commits.next_seq

    async def take(self, sock, replies, records=None, encoded=None) -> None:
        if encoded is not None:
            self.commits.submit(sock, replies, encoded=encoded)
        elif records or replies:
            self.commits.submit(sock, replies, records=records)

    async def commit(self, records: list) -> bool:
        """In the group commit's next round; False when the relay stops before it is on
        disk."""
        with trio.CancelScope(shield=True):
            return await self.commits.commit(records)

    def spool_heartbeats(self, frames: list[bytes]) -> None:
        if self._running:               # in sequence order with the ingest's
            self.commits.submit(None, None, records=[frames], heartbeat=True)
        else:                           # not yet (the restart marker at start-up)
            self.spool.append_batch([frames], heartbeat=True)

    def would_block(self) -> bool:
        return self.spool.would_block() or self.commits.would_block()

    async def pause(self) -> None:
        await _spool_room(self.spool, self._writes)
        if self.commits.would_block():
            # too many replies wait for the fdatasync (a slow disk), or it fails
            # (retried): stop reading, as for a full spool
            await self._writes.paused(self.commits.wait_room)

    async def between_passes(self) -> None:
        """A round whose sync is done goes first (GroupCommit.yield_to_round)."""
        if self.commits.round_ready():
            await self.commits.yield_to_round()
        else:
            await trio.lowlevel.checkpoint()

    async def wait_in(self, sock: zmq.Socket) -> None:
        """Wait until the socket has a message; the group commit may cut it short."""
        with trio.CancelScope() as scope:
            self._in_wait[sock] = scope
            try:
                await zmq_trio.wait_for(sock, zmq.POLLIN)
            finally:
                del self._in_wait[sock]

    def _send_released(self, sock: zmq.Socket, replies: list[list[bytes]]) -> None:
        """The group commit's send, from its own task: a send processes the socket's
        pending commands, so it may consume the edge of its (edge-triggered) ZMQ_FD that
        announced new requests; the ingest task resting on that FD would then sleep on
        a socket that has messages.  Wake it when that happened."""
        self._replies.send(sock, replies)
        scope = self._in_wait.get(sock)
        if scope is not None and sock.get(zmq.EVENTS) & zmq.POLLIN:
            scope.cancel()

    def _wake_if_blocked(self) -> None:
        """The group commit appended a round (or failed): if that filled the spool
        (``block``) or the disk, or the group commit now holds ingress back, the ingest
        tasks resting on their sockets go round and pause now (logged, counted in
        ``spool_blocked_seconds``), as they do when they append themselves, instead of
        only when the next message comes."""
        if self._in_wait and (self.spool.would_block() or self.commits.would_block()):
            for scope in self._in_wait.values():
                scope.cancel()

    def _failed(self, err) -> None:
        self._writes.failed(err)
        self._wake_if_blocked()

    def start(self, nursery) -> None:
        nursery.start_soon(self.spool.run)
        self._running = True
        nursery.start_soon(self.commits.run)

    async def drain(self, seconds: float) -> None:
        """Shutdown: the group commit's last rounds (a failing write or sync is not retried
        any more: the 202s it owed are withheld)."""
        self.commits.close()
        with trio.move_on_after(seconds) as scope:
            scope.shield = True
            await self.commits.drain()


BatchPath = NoSpool | Spooled | GroupCommitted


def choose(spool, writes: SpoolWrites, replies: Replies, settings) -> BatchPath:
    """The relay's batch path, from its spool (or none) and the spool's fsync policy."""
    if spool is None:
        return NoSpool(replies)
    if spool.fsync.owner_syncs_batches:
        # group commit: the 202s leave after the fdatasync that covers them
        return GroupCommitted(spool, writes, replies, batch_size=settings.batch_size,
                              max_bytes=settings.ingest_max_bytes,
                              min_round=settings.spool_fsync_batch_delay)
    return Spooled(spool, writes, replies)
