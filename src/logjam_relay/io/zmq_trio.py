"""A thin trio adapter for pyzmq sockets.

ZeroMQ exposes one file descriptor per socket (``zmq.FD``) that is *edge
triggered*: it becomes readable when the socket's event state changed, not
while messages are pending.  The rules that keep this correct:

* only wait on the FD after an operation on the socket reported ``EAGAIN``
  *and* ``zmq.EVENTS`` says the wanted event is not pending (reading EVENTS
  also processes pending commands and re-arms the edge);
* after waking up, re-check ``zmq.EVENTS`` and loop: a wake-up is a hint;
* exactly one task waits on a socket's FD (trio raises ``BusyResourceError``
  otherwise).  Other tasks may *send* on the socket without waiting, as long
  as each multipart send completes without yielding.

Messages are drained in batches without blocking so that one wake-up of the
event loop handles many messages; callers yield to the scheduler between
batches so other tasks are not starved.

``drain`` and ``PubSocket.publish_batch`` use the optional C loops of
:mod:`logjam_relay.io.zmq_fast` when they are available (same semantics, a fraction of
pyzmq's per-frame cost); ``drain_py`` / ``publish_batch_py`` are the pyzmq versions.
"""

from __future__ import annotations

import errno

import trio
import zmq

from . import zmq_fast
from .subscriptions import MAX_TOPIC_BYTES, SubscriptionGuard, xpub_options  # noqa: F401

RCVMORE = zmq.RCVMORE
NOBLOCK = zmq.NOBLOCK
SNDMORE = zmq.SNDMORE
POLLIN = zmq.POLLIN
POLLOUT = zmq.POLLOUT
_EVENTS = zmq.EVENTS


async def wait_for(sock: zmq.Socket, event: int) -> None:
    """Wait until ``event`` (POLLIN/POLLOUT) is pending on ``sock``.

    Returns at once when it already is.  Cancellable.
    """
    fd = sock.FD
    while not (sock.get(_EVENTS) & event):
        await trio.lowlevel.wait_readable(fd)
    # Always give the scheduler a chance, so a busy socket can't starve others.
    await trio.lowlevel.checkpoint_if_cancelled()


def recv_multipart_nowait(sock: zmq.Socket) -> list[bytes] | None:
    """Receive one whole multipart message or return None (EAGAIN)."""
    recv = sock.recv
    get = sock.get
    try:
        frames = [recv(NOBLOCK)]
    except zmq.Again:
        return None
    # Once the first frame arrived the rest of the message is there too
    # (ZeroMQ delivers multipart messages atomically).
    while get(RCVMORE):
        frames.append(recv())
    return frames


def drain_py(sock: zmq.Socket, limit: int) -> list[list[bytes]]:
    """Receive up to ``limit`` whole messages without blocking (pyzmq)."""
    recv = sock.recv
    get = sock.get
    out: list[list[bytes]] = []
    append = out.append
    try:
        for _ in range(limit):
            frames = [recv(NOBLOCK)]
            while get(RCVMORE):
                frames.append(recv())
            append(frames)
    except zmq.Again:
        pass
    return out


def drain_bytes_py(sock: zmq.Socket, limit: int, max_bytes: int) -> tuple[list, int, int]:
    """Like :func:`drain_py`, bounded in bytes too: stops after the message that brings
    the bytes received to ``max_bytes`` (0 = no byte bound).  Returns ``(messages,
    total_bytes, largest_frame)`` -- the caller checks the largest frame against the
    event limit without walking the batch."""
    recv = sock.recv
    get = sock.get
    out: list[list[bytes]] = []
    append = out.append
    total = biggest = 0
    try:
        for _ in range(limit):
            f = recv(NOBLOCK)
            frames = [f]
            n = len(f)
            total += n
            if n > biggest:
                biggest = n
            while get(RCVMORE):
                f = recv()
                frames.append(f)
                n = len(f)
                total += n
                if n > biggest:
                    biggest = n
            append(frames)
            if max_bytes and total >= max_bytes:
                break
    except zmq.Again:
        pass
    return out, total, biggest


drain = zmq_fast.drain if zmq_fast.AVAILABLE else drain_py
drain_bytes = zmq_fast.drain_bytes if zmq_fast.AVAILABLE else drain_bytes_py


async def recv_batch(sock: zmq.Socket, limit: int = 1000,
                     max_bytes: int = 0) -> list[list[bytes]]:
    """Wait for at least one message, then drain up to ``limit`` of them (and, with
    ``max_bytes``, stop after the message that brings the batch to that many bytes)."""
    while True:
        batch = drain_bytes(sock, limit, max_bytes)[0] if max_bytes else drain(sock, limit)
        if batch:
            await trio.lowlevel.checkpoint()
            return batch
        await wait_for(sock, POLLIN)


async def recv_multipart(sock: zmq.Socket) -> list[bytes]:
    while True:
        msg = recv_multipart_nowait(sock)
        if msg is not None:
            await trio.lowlevel.checkpoint()
            return msg
        await wait_for(sock, POLLIN)


def send_multipart_nowait(sock: zmq.Socket, frames: list[bytes] | tuple[bytes, ...]) -> bool:
    """Send without blocking. Returns False when the socket refused (EAGAIN / HWM)."""
    send = sock.send
    last = len(frames) - 1
    try:
        for i, f in enumerate(frames):
            if i < last:
                send(f, NOBLOCK | SNDMORE)
            else:
                send(f, NOBLOCK)
    except zmq.Again:
        # ZeroMQ only refuses the first frame of a message (it checks the
        # HWM before queueing the first part), so nothing partial is left.
        return False
    return True


async def send_multipart(sock: zmq.Socket, frames: list[bytes] | tuple[bytes, ...]) -> None:
    """Send, waiting (cancellably) while the socket is at its high-water mark."""
    while not send_multipart_nowait(sock, frames):
        await wait_for(sock, POLLOUT)
    await trio.lowlevel.checkpoint()


class PubSocket:
    """A PUB that behaves exactly like logjam-device's PUB and counts its drops.

    Implemented as an XPUB with ``XPUB_NODROP``: a send that would exceed the
    HWM of any matching subscriber fails with EAGAIN, which is counted in
    ``drops``; the message is then sent again in lossy mode so that every
    subscriber with room still receives it (PUB semantics: only the slow
    subscriber misses it).  Subscription messages are drained by
    :meth:`poll_subscriptions`, called from a timer, so nobody waits on the
    FD and any task can publish.

    With ``max_subscriptions`` a :class:`SubscriptionGuard` caps the subscriptions
    (``guard``; the socket needs :func:`xpub_options` set before bind).
    """

    __slots__ = ("sock", "drops", "published", "subscriptions", "guard", "_send")

    def __init__(self, sock: zmq.Socket, max_subscriptions: int | None = None):
        if sock.type != zmq.XPUB:
            raise ValueError("PubSocket needs an XPUB socket")
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        self.sock = sock
        self.drops = 0
        self.published = 0
        self.guard = SubscriptionGuard(sock, max_subscriptions) if max_subscriptions else None
        # Topics with at least one subscriber (XPUB is not verbose, so ZeroMQ
        # reports the first subscribe and the last unsubscribe of a topic; with a guard,
        # its topic -> subscriber count).
        self.subscriptions: set[bytes] | dict[bytes, int] = \
            self.guard.topics if self.guard is not None else set()
        self._send = sock.send

    def publish(self, frames: list[bytes] | tuple[bytes, ...]) -> None:
        send = self._send
        try:
            send(frames[0], NOBLOCK | SNDMORE)
        except zmq.Again:
            self._send_lossy(frames)
            return
        last = len(frames) - 1
        for i in range(1, last):
            send(frames[i], SNDMORE)
        send(frames[last])
        self.published += 1

    def publish_batch_py(self, records) -> None:
        """Publish whole records (sequences of frames) in order (pyzmq)."""
        publish = self.publish
        for rec in records:
            publish(rec)

    def publish_batch(self, records) -> None:
        """Publish whole records in order; a record that meets a subscriber at its HWM
        is counted as a drop and sent lossy, exactly like :meth:`publish`."""
        fast = zmq_fast.publish
        if fast is None:
            self.publish_batch_py(records)
            return
        sock = self.sock
        n = len(records)
        i = 0
        while i < n:
            j, err = fast(sock, records, i)
            self.published += j - i
            if j < n:
                if err != errno.EAGAIN:
                    raise zmq.ZMQError(err)
                self._send_lossy(records[j])
                j += 1
            i = j

    def publish_refused(self, frames) -> None:
        """A record whose first frame the XPUB refused (EAGAIN, the ingest pass): sent
        lossy, counted as a drop."""
        self._send_lossy(frames)

    def _send_lossy(self, frames) -> None:
        self.drops += 1
        sock = self.sock
        sock.setsockopt(zmq.XPUB_NODROP, 0)
        try:
            last = len(frames) - 1
            for i, f in enumerate(frames):
                sock.send(f, SNDMORE if i < last else 0)
        except zmq.ZMQError as e:  # pragma: no cover - lossy PUB sends never fail
            if e.errno != errno.EAGAIN:
                raise
        finally:
            sock.setsockopt(zmq.XPUB_NODROP, 1)
        self.published += 1

    def poll_subscriptions(self) -> list[bytes]:
        """Drain (un)subscription notifications without blocking (with a guard: apply
        the cap and return its notifications)."""
        if self.guard is not None:
            return self.guard.poll(500)
        recv = self.sock.recv
        subs = self.subscriptions
        while True:
            try:
                m = recv(NOBLOCK)
            except zmq.Again:
                return
            if not m:
                continue
            if m[0] == 1:
                subs.add(m[1:])
            elif m[0] == 0:
                subs.discard(m[1:])

    def close(self, linger: int = 0) -> None:
        if self.guard is not None:
            self.guard.close()
        self.sock.close(linger=linger)


def send_replies(sock: zmq.Socket, replies: list) -> int:
    """Send whole replies without blocking; returns how many could not be sent (peer
    gone: EHOSTUNREACH with ROUTER_MANDATORY; its queue full: EAGAIN)."""
    fast = zmq_fast.publish
    dropped = 0
    if fast is not None:
        n = len(replies)
        i = 0
        while i < n:
            i, err = fast(sock, replies, i)
            if i < n:
                dropped += 1
                i += 1
        return dropped
    send = sock.send
    for r in replies:
        try:
            send(r[0], NOBLOCK | SNDMORE)
            for f in r[1:-1]:
                send(f, SNDMORE)
            send(r[-1])
        except zmq.ZMQError:
            dropped += 1
    return dropped


def close_all(sockets: list[zmq.Socket], linger_ms: int) -> None:
    for s in sockets:
        try:
            s.close(linger=linger_ms)
        except zmq.ZMQError:
            pass

