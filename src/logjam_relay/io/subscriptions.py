"""A cap on the subscriptions an XPUB keeps (PUB, stats and CMDP sockets).

See :class:`SubscriptionGuard` and docs/operations.md, "Memory".  Split out of
:mod:`logjam_relay.io.zmq_trio`, which re-exports these names.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import zmq

from ..gc_tuning import malloc_trim
from .net import tcp_abort

NOBLOCK = zmq.NOBLOCK

#: Longest subscription topic an XPUB accepts: its MAXMSGSIZE is ``MAX_TOPIC_BYTES + 10``
#: (a subscription is one frame: ``\x01`` + topic, or with ZMTP 3.1 the command
#: ``\x09SUBSCRIBE`` + topic), so libzmq disconnects a peer that sends a longer one before
#: it is stored.  libzmq keeps a subscription in a trie with a
#: node per byte, so the length bounds what one subscription can cost.
MAX_TOPIC_BYTES = 128


def xpub_options() -> dict[int, int]:
    """Socket options every capped XPUB needs before bind (see :class:`SubscriptionGuard`)."""
    # RCVHWM: libzmq moves at most this many of a peer's subscriptions into its trie per
    # look at the socket, so a flood is taken in no faster than the guard reads it
    return {zmq.MAXMSGSIZE: MAX_TOPIC_BYTES + 10, zmq.RCVHWM: 32}


def monitor_socket(sock: zmq.Socket, events: int) -> zmq.Socket:
    """``sock.get_monitor_socket(events)`` whose queue never drops an event: libzmq's
    monitor pipe is bounded by the sum of both ends' HWMs unless one end's is 0, and the
    peer counts (accepted - ended) must not lose a DISCONNECTED.  An event is ~40 bytes
    and at most two come per connection."""
    addr = f"inproc://logjam-relay.monitor.{id(sock):x}.{time.monotonic_ns():x}"
    sock.monitor(addr, events)
    mon = sock.context.socket(zmq.PAIR)
    mon.setsockopt(zmq.RCVHWM, 0)
    mon.setsockopt(zmq.LINGER, 0)
    mon.connect(addr)
    return mon


class SubscriptionGuard:
    """Caps the subscriptions an XPUB keeps and gives their memory back when peers leave.

    libzmq stores every subscription a peer sends in a trie (a node per topic byte), with
    no bound: 300k random subscriptions cost GBs, and glibc keeps the freed nodes after the
    peer leaves.  The guard puts the socket in ``XPUB_MANUAL`` mode, where libzmq hands
    every (un)subscription to us, tagged with the sending connection's fd (``SRCFD``), and
    only the ones we forward (``setsockopt(SUBSCRIBE)``) take part in matching.

    * ``entries`` mirrors what libzmq holds: +1 for each new (connection, topic), -1 for
      each explicit unsubscription; when the monitor reports a connection ended, all its
      pairs at once (libzmq drops them; the unsubscriptions it then reports without an
      fd, and subscriptions of that connection still queued, are matched against
      ``_ending``, not counted again); ``peak`` is the most held at once;
    * a subscription is forwarded while ``entries`` is within ``max_subscriptions``; the
      one over the cap is refused (``refused``) and its peer disconnected (TCP abort,
      after checking that the fd is a connection of this socket's port): libzmq then
      drops all that peer subscribed;
    * the socket's connections together may send the cap's worth of bytes (``TCP_INFO``):
      over it, the one that sent most is cut, so many flooders hold no more than one;
    * the end of any connection costs a walk of the trie (``WALK_SECONDS_PER_BYTE``):
      :meth:`admit` says ``busy`` until those walks are paid back at ``WALK_SHARE`` of the
      loop, and ``accept_hook`` (io/peers.py) resets new connections meanwhile;
    * the socket's RCVHWM (:func:`xpub_options`) is small, so libzmq takes a peer's
      subscriptions in only as fast as the guard looks at them;
    * after many entries were freed ``malloc_trim`` gives the memory back to the OS.

    :meth:`poll` drains without blocking (at most ``max_messages`` per call) and returns
    the notifications a plain XPUB with ``XPUB_VERBOSE`` would give: ``b"\\x01" + topic``
    for every forwarded subscription, ``b"\\x00" + topic`` when the last subscriber of a
    topic left.  ``topics`` maps each forwarded topic to its number of subscribers (a
    connection's topics are released when the socket monitor reports it disconnected).
    Create it right after ``bind``, with the options of :func:`xpub_options` set before.
    libzmq ignores a forward for a connection that has already ended (it checks the pipe).
    """

    TRIM_AFTER = 1000      # entries freed since the last malloc_trim
    PEER_BYTES_PER_SECOND = 1024   # what a connection's byte budget grows by
    #: what libzmq 4.3's end of a connection costs the thread that next uses the socket,
    #: per topic byte held: ``mtrie rm(pipe)`` walks the whole trie (a ``std::list`` node
    #: allocated per trie node), once for the received and once for the forwarded
    #: subscriptions (measured: 150 ms with 2,000 random 128-byte topics held, 1.1 s with
    #: 10,000; a third more on a loaded 2-core machine)
    WALK_SECONDS_PER_BYTE = 0.4e-6
    #: the same for taking a subscription byte in (a trie node allocated per byte)
    INSERT_SECONDS_PER_BYTE = 0.1e-6
    #: the share of the socket's thread that libzmq's work on ended connections may take:
    #: after one that cost ``t`` s, no new connection is admitted (:meth:`admit`) for
    #: ``t / WALK_SHARE`` s
    WALK_SHARE = 0.2
    #: a call to recv that took longer was libzmq's work (walks, a flood's commands):
    #: measured, it is charged as such
    STALL_SECONDS = 0.005
    #: the longest the admission stays closed after the last charge (s)
    MAX_ADMIT_WAIT = 2.0

    def __init__(self, sock: zmq.Socket, max_subscriptions: int = 10_000):
        if sock.type != zmq.XPUB:
            raise ValueError("SubscriptionGuard needs an XPUB socket")
        sock.setsockopt(zmq.XPUB_MANUAL, 1)
        self.sock = sock
        self.max_subscriptions = max_subscriptions
        self.entries = 0                         # (connection, topic) pairs libzmq holds
        self.peak = 0                            # the most entries held at once
        self.topics: dict[bytes, int] = {}
        self.refused = 0
        self.disconnected = 0                    # peers cut for going over the cap
        self.trims = 0
        self.busy = False                        # the last poll stopped at max_messages
        self.held_bytes = 0                      # topic bytes of the pairs libzmq holds
        self.walk_seconds = 0.0                  # estimated cost of connection ends so far
        self._admit_after = 0.0                  # monotonic time: admit() says "busy" before
        self._live: set[int] = set()             # connections accepted and not yet ended
        self._sent: dict[int, int] = {}          # fd -> bytes received from it (last check)
        self._backlog: list[bytes] = []          # notifications of a refresh(), for poll()
        #: ``hook(fd) -> bool`` asked at each new connection (io/peers.py): False aborts it
        #: before its handshake can end (the ZAP handler answers only after a refresh)
        self.accept_hook = None
        # fd -> {topic: forwarded?} of the connections we know
        self._by_fd: dict[int, dict[bytes, bool]] = {}
        self._cut: set[int] = set()              # disconnected by us, not yet gone
        self._dead: set[int] = set()             # gone, not accepted again yet
        # pairs of ended connections whose unsubscriptions libzmq has still to report
        self._ending = 0
        self._freed = 0
        self._ports: set[int] = set()
        ep = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if ep.startswith("tcp://"):
            self._ports.add(int(ep.rsplit(":", 1)[1]))
        # a connection may send at most this many bytes (every subscription it could
        # hold at the longest topic): libzmq takes subscriptions into its trie faster
        # than anyone can read them, so the byte count (TCP_INFO) cuts a flood early
        self.max_peer_bytes = max_subscriptions * (MAX_TOPIC_BYTES + 12) + 4096
        # fd -> (our dup (TCP_INFO, abort), when it was accepted)
        self._conns: dict[int, tuple[socket.socket, float]] = {}
        self._monitor = monitor_socket(sock, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        #: guards every field and the monitor, not the XPUB: the socket's owner (the
        #: thread that calls :meth:`poll`) takes it between its calls to libzmq, so that
        #: :meth:`watch` and :meth:`refresh` may run on another thread while the owner is
        #: inside libzmq (a trie walk, or commands that keep coming: io/xpubthread.py)
        self.lock = threading.RLock()

    @property
    def monitor(self) -> zmq.Socket:
        """The socket monitor's PAIR (ACCEPTED and DISCONNECTED, never dropped)."""
        return self._monitor

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        for c, _ in self._conns.values():
            c.close()
        self._conns.clear()

    def _check_bytes(self) -> None:
        """Cut every connection that sent more than ``max_peer_bytes``, and, while all
        connections together sent more than that, the one that sent most; let go of our
        dup of a connection libzmq closed (its fd is gone or another file now), in case
        the monitor's DISCONNECTED event was lost (the monitor queue drops when full).
        The budget grows by ``PEER_BYTES_PER_SECOND`` with a connection's age, so ZMTP
        heartbeats and subscription churn of a long-lived subscriber never add up to a
        cut.  The budget is the socket's, not each connection's: many connections
        flooding at once hold no more than one would (libzmq's trie, and the time every
        connection's end costs, grow with what all of them sent)."""
        now = time.monotonic()
        charged: list[tuple[int, int]] = []
        total = 0
        for fd, (c, since) in list(self._conns.items()):
            try:
                same = os.fstat(fd).st_ino == os.fstat(c.fileno()).st_ino
            except OSError:
                same = False
            if not same:
                del self._conns[fd]
                c.close()
                if fd in self._live:              # its DISCONNECTED event was lost
                    self._live.discard(fd)
                    self._charge_end(fd)
                continue
            if fd in self._cut:
                # cut, ending within moments: cutting others would not free its bytes
                continue
            try:
                info = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            except OSError:
                continue
            # struct tcp_info: tcpi_bytes_received (u64) at offset 128 (Linux >= 4.1)
            if len(info) < 136:
                continue
            got = int.from_bytes(info[128:136], sys.byteorder)
            self._sent[fd] = got
            over = got - (now - since) * self.PEER_BYTES_PER_SECOND
            if over > self.max_peer_bytes:
                if self._disconnect(fd):
                    self._cut.add(fd)
                continue
            if over > 0:
                charged.append((int(over), fd))
                total += int(over)
        if total > self.max_peer_bytes:
            charged.sort(reverse=True)
            for over, fd in charged:
                if total <= self.max_peer_bytes:
                    break
                if self._disconnect(fd):
                    self._cut.add(fd)
                    total -= over

    def admit(self) -> str | None:
        """Whether a new connection may be admitted now (io/peers.py asks): None, or
        ``"busy"`` while the ends of earlier connections have used up the loop's share
        (``WALK_SHARE``)."""
        return "busy" if time.monotonic() < self._admit_after else None

    @property
    def peers(self) -> int:
        """Connections accepted and not yet ended (the monitor's count)."""
        return len(self._live)

    def _charge_end(self, fd: int) -> None:
        """A connection ended: libzmq walks both tries on the socket's thread."""
        cost = (2 * self.held_bytes * self.WALK_SECONDS_PER_BYTE
                + self._sent.pop(fd, 0) * self.INSERT_SECONDS_PER_BYTE)
        self._charge(cost)

    def _charge(self, seconds: float) -> None:
        """libzmq's work on the socket took ``seconds`` (estimated at a connection's end,
        or measured: a call to recv that took longer than ``STALL_SECONDS``): no new
        connection is admitted for ``seconds / WALK_SHARE``."""
        self.walk_seconds += seconds
        now = time.monotonic()
        # at most MAX_ADMIT_WAIT ahead: once a flood is over, a subscriber gets back in
        # within that (its reconnects are reset meanwhile)
        self._admit_after = min(max(self._admit_after, now) + seconds / self.WALK_SHARE,
                                now + self.MAX_ADMIT_WAIT)

    def stats(self) -> dict:
        return {"subscriptions": self.entries, "topics": len(self.topics),
                "refused": self.refused, "peers_disconnected": self.disconnected,
                "held_bytes": self.held_bytes, "peers": self.peers, "peak": self.peak,
                "ending": self._ending,
                "walk_seconds": self.walk_seconds}

    def poll(self, max_messages: int = 5000) -> list[bytes]:
        """Handle up to ``max_messages`` pending (un)subscriptions (the caller polls
        again soon: a flood never holds the event loop)."""
        lock = self.lock
        with lock:
            out, self._backlog = self._backlog, []
            self._poll_monitor(out)
            self._check_bytes()
        recv = self.sock.recv
        # this thread's CPU time: libzmq's work in the call, not a wait for the GIL after it
        clock = time.thread_time
        for i in range(max_messages):
            if i % 100 == 99:
                with lock:
                    self._check_bytes()
            t = clock()
            try:
                # not under the lock: libzmq's own work (trie walks) happens in this call
                msg = recv(NOBLOCK, copy=False)
            except zmq.Again:
                break
            finally:
                took = clock() - t
                if took > self.STALL_SECONDS:
                    with lock:
                        self._charge(took)
            with lock:
                self._take(msg, out)
        else:
            with lock:
                self.busy = True          # more may be pending: poll again soon
                self._poll_monitor(out)
            return out
        with lock:
            self.busy = False
            self._poll_monitor(out)
            trim = self._freed >= self.TRIM_AFTER and malloc_trim is not None
            if trim:
                self.trims += 1
                self._freed = 0
        if trim:
            # the trie nodes libzmq freed go back to the OS (glibc keeps them otherwise);
            # outside the lock: it can take long on a big heap
            malloc_trim(0)
        return out

    def _take(self, msg: zmq.Frame, out: list[bytes]) -> None:
        """One (un)subscription libzmq handed over (the caller holds the lock)."""
        setsockopt = self.sock.setsockopt
        by_fd = self._by_fd
        topics = self.topics
        cut = self._cut
        m = msg.bytes
        if not m or m[0] > 1:
            return
        topic = m[1:]
        try:
            fd = msg.get(zmq.SRCFD)
        except zmq.ZMQError:
            fd = -1
        if fd < 0:
            # libzmq's unsubscription for a subscription of a connection that ended:
            # it dropped the entry.  The monitor's DISCONNECTED (emitted before libzmq
            # ends the pipe) moved that connection's pairs to _ending; look at it now
            # if this one came first
            if m[0] == 0:
                if not self._ending:
                    self._poll_monitor(out)
                if self._ending:
                    self._ending -= 1
                elif self.entries > 0:          # the event was lost
                    self.entries -= 1
                    self.held_bytes = max(0, self.held_bytes - len(topic))
                self._freed += 1
            return
        if fd in self._dead:
            # a new connection may have the number of one that ended: the monitor's
            # ACCEPTED (sent before libzmq reads the connection) is then queued but not
            # taken yet -- look before dropping a good subscriber's subscription
            self._poll_monitor(out)
        if fd in self._dead:
            # still queued from a connection that is gone: libzmq reports its
            # unsubscription too; nothing to forward, nothing held for long
            if m[0] == 1:
                self._ending += 1
            return
        if fd in cut and m[0] == 1:
            # a cut connection: libzmq drops its pairs once the I/O thread has seen the
            # abort, which the monitor reports -- look (an inproc recv) before counting
            self._poll_monitor(out)
            if fd in self._dead:
                self._ending += 1
                return
        mine = by_fd.get(fd)
        if m[0] == 1:
            if mine is not None and topic in mine:
                if mine[topic]:
                    setsockopt(zmq.SUBSCRIBE, topic)    # a repeat: nothing new held
                    out.append(m)
                return
            if mine is None:
                mine = by_fd[fd] = {}
            self.entries += 1
            self.held_bytes += len(topic)
            if self.entries > self.peak:
                self.peak = self.entries
            if self.entries > self.max_subscriptions or fd in cut:
                mine[topic] = False                      # libzmq holds it till the cut
                self.refused += 1
                if fd not in cut and self._disconnect(fd):
                    cut.add(fd)
                return
            mine[topic] = True
            setsockopt(zmq.SUBSCRIBE, topic)
            topics[topic] = topics.get(topic, 0) + 1
            out.append(m)
        elif mine is not None and topic in mine:
            forwarded = mine.pop(topic)
            self.entries -= 1
            self.held_bytes = max(0, self.held_bytes - len(topic))
            self._freed += 1
            if forwarded:
                setsockopt(zmq.UNSUBSCRIBE, topic)
                if self._release(topic):
                    out.append(m)

    def refresh(self) -> None:
        """Take the monitor's events now (the peer count is then current); what they
        release is returned by the next :meth:`poll`.  Any thread."""
        with self.lock:
            self._poll_monitor(self._backlog)

    def watch(self) -> bool:
        """From any thread: take the monitor's events (new connections are admitted or
        reset) and cut the connections over their byte budget -- what bounds a flood
        while the socket's owner is inside libzmq, which takes subscriptions in as fast
        as the connections deliver them.  True when notifications wait for the next
        :meth:`poll` (the owner should come round)."""
        with self.lock:
            self._poll_monitor(self._backlog)
            self._check_bytes()
            return bool(self._backlog)

    def _release(self, topic: bytes) -> bool:
        n = self.topics.get(topic, 0) - 1
        if n > 0:
            self.topics[topic] = n
            return False
        self.topics.pop(topic, None)
        return True

    def _poll_monitor(self, out: list[bytes]) -> None:
        mon = self._monitor
        while True:
            try:
                frames = mon.recv_multipart(NOBLOCK)
            except zmq.Again:
                return
            if len(frames[0]) < 6:
                continue
            event = int.from_bytes(frames[0][:2], "little")
            fd = int.from_bytes(frames[0][2:6], "little", signed=True)
            if event == zmq.EVENT_ACCEPTED:
                self._dead.discard(fd)
                hook = self.accept_hook
                if hook is not None and not hook(fd):
                    abort_connection(fd, self._ports)
                    continue
                self._live.add(fd)
                self._track(fd)
            elif event == zmq.EVENT_DISCONNECTED:
                if fd in self._live:
                    self._live.discard(fd)
                    self._charge_end(fd)
                c = self._conns.pop(fd, None)
                if c is not None:
                    c[0].close()
                self._cut.discard(fd)
                self._dead.add(fd)
                gone = self._by_fd.pop(fd, None)
                if gone:
                    # libzmq drops the connection's pairs and reports an unsubscription
                    # for each (fd -1): they are no longer held
                    self.entries = max(0, self.entries - len(gone))
                    self.held_bytes = max(0, self.held_bytes - sum(map(len, gone)))
                    self._ending += len(gone)
                    for topic, forwarded in gone.items():
                        if forwarded and self._release(topic):
                            out.append(b"\x00" + topic)

    def _track(self, fd: int) -> None:
        if not hasattr(socket, "TCP_INFO") or fd in self._conns:
            return
        try:
            c = socket.socket(fileno=os.dup(fd))
        except OSError:
            return
        try:
            if c.type == socket.SOCK_STREAM and c.getsockname()[1] in self._ports:
                self._conns[fd] = (c, time.monotonic())
                return
        except (OSError, IndexError, TypeError):
            pass
        c.close()

    def _disconnect(self, fd: int) -> bool:
        """Abort the TCP connection behind ``fd`` if it is one of this socket's."""
        if abort_connection(fd, self._ports):
            self.disconnected += 1
            return True
        return False


def abort_connection(fd: int, ports: set[int]) -> bool:
    """Abort the TCP connection behind libzmq's ``fd`` if it is one of ``ports``' (the fd
    may have been closed and reused meanwhile).

    ``shutdown`` alone is not enough: Linux keeps accepting (and libzmq keeps reading)
    what a hostile peer goes on sending.  ``connect(AF_UNSPEC)`` on a TCP socket is a
    disconnect: the kernel drops what is queued, sends a RST and reports the socket hung
    up, so libzmq ends the connection at once (a libzmq client reconnects later).
    """
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        if s.type != socket.SOCK_STREAM or s.getsockname()[1] not in ports:
            return False
        s.shutdown(socket.SHUT_RDWR)
        if tcp_abort is not None:
            tcp_abort(s.fileno())
        return True
    except (OSError, IndexError, TypeError):
        return False
    finally:
        s.close()
