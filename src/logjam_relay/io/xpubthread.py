"""An XPUB served by a thread of its own: the relay's PUB, stats and CMDP sockets.

libzmq does the work of a subscriber's connection ending -- it walks the socket's whole
subscription trie, 150 ms with 2,000 random 128-byte topics held, 1.1 s with 10,000 --
inside whichever call next uses the socket.  On the event loop, a flood of connections
that come and go made those walks most of the loop's time and held good ROUTER requests
for seconds (docs/operations.md, "Memory").  So each XPUB is owned by a thread:

* the event loop hands records over on :attr:`ThreadedPub.sock`, which takes the same
  calls as the XPUB itself (``zmq_fast.publish`` and the ingest pass) and holds ``hwm``
  records (0: no bound): with the C extension a :class:`zmq_fast.Ring` (a
  single-producer single-consumer queue of ``zmq_msg_t``: the ingest pass moves the
  frames it received in, the thread sleeps on an eventfd that is written only when it
  sleeps), else an inproc PUSH/PULL pair.  The thread moves the records to the XPUB
  whole and zero-copy, without the GIL (``zmq_fast.ring_pump`` / ``zmq_fast.pump``;
  :func:`pump_py` is the pyzmq twin), with logjam-device's PUB semantics:
  ``XPUB_NODROP``, and a message that meets a subscriber at its HWM is sent again lossy
  (only the slow subscriber misses it) and counted (``forward_drops``);
* the thread runs the :class:`SubscriptionGuard` (cap, cuts, the socket monitor and so the
  peer count, whose admission hook it calls) and, with ``notify``, hands the subscription
  notifications to the loop on an inproc PAIR (:attr:`ThreadedPub.notes`: CMDP answers
  its ``STAT?``/``LOG?`` subscribers from them);
* so the walks run on that thread, beside the loop (libzmq releases nothing it needs);
* a message the hand-over queue cannot take (the thread is behind: a long walk) is
  dropped for every subscriber and counted (``handoff_drops``): the loop never waits
  for the thread.  ``drops`` is both.

Messages are whole records (two or more frames, or one non-empty frame).  The stop
(:meth:`ThreadedPub.close`) goes behind the last record -- ``Ring.stop``, or on the
inproc pair a message of one empty frame -- so everything published before it reaches
the XPUB before the thread ends.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

import zmq

from ..ratelimit import RateLimitedLog
from . import zmq_fast
from .subscriptions import SubscriptionGuard

log = logging.getLogger("logjam_relay.xpub")
NOBLOCK = zmq.NOBLOCK
SNDMORE = zmq.SNDMORE
PUMP_XPUB, PUMP_WATCH, PUMP_TIMEOUT, PUMP_STOP = (
    zmq_fast.PUMP_XPUB, zmq_fast.PUMP_WATCH, zmq_fast.PUMP_TIMEOUT, zmq_fast.PUMP_STOP)
#: messages the thread moves per wake-up before it looks at the subscriptions again
PUMP_BATCH = 1000
#: the thread's longest sleep (ms) while no record comes: then it goes round (counters of
#: the inproc pump, the guard's round).  With the ring, records that keep coming keep it in
#: C (each return to Python waits for the GIL, which the busy loop holds); the
#: watch thread checks the guard's byte budgets every WATCH_SECONDS meanwhile
IDLE_MS = 250
#: how often the watch thread takes the monitor's events and checks the byte budgets (s)
WATCH_SECONDS = 0.02
#: notifications the loop's PAIR may hold (a churn flood beyond is counted, not kept)
NOTES_HWM = 10_000
#: the loop's view is rebuilt after dropped notifications at most this often (s): during a
#: churn flood drops go on, and each rebuild hands the loop a burst of notifications
RESYNC_SECONDS = 1.0


#: ThreadedPubs whose thread did not stop (close): their sockets must never be closed
_ABANDONED: list[ThreadedPub] = []


def abandoned() -> bool:
    """Whether a thread of an XPUB was left inside libzmq at close: the process must then
    end with ``os._exit`` (terminating the context, or closing those sockets at the
    interpreter's exit, would wait for, or race with, that thread)."""
    return bool(_ABANDONED)


def pump_py(src: zmq.Socket, xpub: zmq.Socket, watch, timeout_ms: int,
            batch: int) -> tuple[int, int, int]:
    """pyzmq twin of ``zmq_fast.pump`` (same semantics, see ``_zmqfast.c``)."""
    poller = zmq.Poller()
    for s in (src, xpub, *watch):
        poller.register(s, zmq.POLLIN)
    forwarded = dropped = flags = 0
    deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
    wait = timeout_ms
    while True:
        ready = dict(poller.poll(None if wait < 0 else wait))
        if ready.get(xpub):
            flags |= PUMP_XPUB
        if any(ready.get(w) for w in watch):
            flags |= PUMP_WATCH
        if ready.get(src):
            for _ in range(batch):
                try:
                    frames = src.recv_multipart(NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if len(frames) == 1 and not frames[0].bytes:
                    return forwarded, dropped, flags | PUMP_STOP
                if _send_nodrop(xpub, frames):
                    dropped += 1
                forwarded += 1
        if flags:
            return forwarded, dropped, flags
        if not ready or (deadline is not None and time.monotonic() >= deadline):
            return forwarded, dropped, PUMP_TIMEOUT
        if deadline is not None:
            wait = max(0, int((deadline - time.monotonic()) * 1000))


def _send_nodrop(xpub: zmq.Socket, frames) -> bool:
    """Send on an XPUB_NODROP socket; a message a subscriber at its HWM refuses is sent
    lossy.  True when it was."""
    last = len(frames) - 1
    try:
        xpub.send(frames[0], NOBLOCK | (SNDMORE if last else 0), copy=False)
    except zmq.Again:
        xpub.setsockopt(zmq.XPUB_NODROP, 0)
        try:
            for i, f in enumerate(frames):
                xpub.send(f, NOBLOCK | (SNDMORE if i < last else 0), copy=False)
        finally:
            xpub.setsockopt(zmq.XPUB_NODROP, 1)
        return True
    for i in range(1, last + 1):
        xpub.send(frames[i], NOBLOCK | (SNDMORE if i < last else 0), copy=False)
    return False


class ThreadedPub:
    """An XPUB owned by a thread (module docstring).  The loop's side: :meth:`publish`,
    :meth:`publish_batch`, :attr:`sock` (the PUSH, for the C ingest pass),
    :meth:`publish_refused`, :meth:`poll_subscriptions` (with ``notify``), the counters,
    ``guard`` (read its counters only: the thread owns it).  :meth:`start` after the
    socket's set-up (peer limit watching), :meth:`close` at the end."""

    def __init__(self, xpub: zmq.Socket, max_subscriptions: int | None, *, name: str,
                 hwm: int, notify: bool = False, ring: bool | None = None):
        if xpub.type != zmq.XPUB:
            raise ValueError("ThreadedPub needs an XPUB socket")
        xpub.setsockopt(zmq.XPUB_NODROP, 1)
        self.xpub = xpub
        self.name = name
        self.endpoint = xpub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.guard = SubscriptionGuard(xpub, max_subscriptions) if max_subscriptions else None
        # topics with at least one subscriber (the guard's topic -> subscriber count; a
        # plain XPUB reports the first subscription and the last unsubscription of a topic)
        self.subscriptions: set[bytes] | dict[bytes, int] = \
            self.guard.topics if self.guard is not None else set()
        ctx = xpub.context
        addr = f"inproc://logjam-relay.xpub.{name}.{id(self):x}.{time.monotonic_ns():x}"
        self.notes: zmq.Socket | None = None
        self._notes_out: zmq.Socket | None = None
        self._pull = self.sock = self._ring = None
        if ring is None:
            ring = zmq_fast.Ring is not None
        elif ring and zmq_fast.Ring is None:
            raise RuntimeError(f"no hand-over ring: {zmq_fast.WHY_NOT}")
        try:
            if ring:
                self.sock = self._ring = zmq_fast.Ring(hwm)   # 0: no bound, as on PUB
            else:
                self._pull = ctx.socket(zmq.PULL)
                self._pull.setsockopt(zmq.LINGER, 0)
                self._pull.setsockopt(zmq.RCVHWM, 1)     # the queue's bound is the PUSH's
                self._pull.bind(addr)
                self.sock = ctx.socket(zmq.PUSH)
                self.sock.setsockopt(zmq.LINGER, 0)
                self.sock.setsockopt(zmq.SNDHWM, hwm)   # 0: no bound, as snd_hwm 0 on PUB
                self.sock.connect(addr)
            if notify:
                self.notes = ctx.socket(zmq.PAIR)
                self.notes.setsockopt(zmq.LINGER, 0)
                self.notes.setsockopt(zmq.RCVHWM, NOTES_HWM)
                self.notes.bind(addr + ".notes")
                self._notes_out = ctx.socket(zmq.PAIR)
                self._notes_out.setsockopt(zmq.LINGER, 0)
                self._notes_out.setsockopt(zmq.SNDHWM, NOTES_HWM)
                self._notes_out.connect(addr + ".notes")
        except BaseException:
            for sk in (self._pull, self.sock, self.notes, self._notes_out):
                if sk is not None:
                    sk.close(linger=0)
            if self.guard is not None:
                self.guard.close()
            raise
        self.published = 0           # records handed over (the loop's count)
        self.handoff_drops = 0       # records the hand-over queue could not take
        self._forward_drops = 0      # (inproc pump) records a subscriber at its HWM missed
        self._forwarded = 0          # (inproc pump) records the thread put on the XPUB
        self.notes_dropped = 0       # notifications the loop's PAIR could not take
        self.notes_resyncs = 0       # times the loop's view was rebuilt after such drops
        self._resync = False         # a notification was dropped: rebuild the loop's view
        self.resynced_at = float("-inf")   # when it was last rebuilt (monotonic)
        self._view: set[bytes] = set()   # topics as the loop's notifications say
        self._plain_lock = threading.Lock()   # the plain XPUB's topic set (no guard)
        self.thread_errors = 0
        self._stopping = False
        self._sentinel_queued = False
        self._rlog = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._run, name=f"xpub-{name}", daemon=True)
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"xpub-{name}-watch",
                                         daemon=True) if self.guard is not None else None

    @property
    def forwarded(self) -> int:
        """Records the thread put on the XPUB (with the ring: counted in C as they go)."""
        return self._ring.counts()[0] if self._ring is not None else self._forwarded

    @property
    def forward_drops(self) -> int:
        """Records a subscriber at its HWM missed (sent lossy by the thread)."""
        return self._ring.counts()[1] if self._ring is not None else self._forward_drops

    @property
    def drops(self) -> int:
        return self.handoff_drops + self.forward_drops

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()
        if self._watcher is not None:
            self._watcher.start()

    # -- the loop's side
    def publish(self, frames) -> None:
        if self._ring is not None:
            self.publish_batch((frames,))
            return
        send = self.sock.send
        try:
            send(frames[0], NOBLOCK | SNDMORE if len(frames) > 1 else NOBLOCK)
        except zmq.Again:
            self.handoff_drops += 1
            return
        last = len(frames) - 1
        for i in range(1, last + 1):
            send(frames[i], SNDMORE if i < last else 0)
        self.published += 1

    def publish_batch(self, records) -> None:
        """Publish whole records in order; a record the queue cannot take is dropped."""
        fast = zmq_fast.publish
        if fast is None:
            for rec in records:
                self.publish(rec)
            return
        n = len(records)
        i = 0
        while i < n:
            j, err = fast(self.sock, records, i)
            self.published += j - i
            if j < n:
                if err != errno.EAGAIN:
                    raise zmq.ZMQError(err)
                self.handoff_drops += 1
                j += 1
            i = j

    def publish_refused(self, frames) -> None:
        """The queue refused this record's first frame (the ingest pass): it is dropped
        for every subscriber, counted."""
        self.handoff_drops += 1

    def poll_subscriptions(self, limit: int = 1000) -> list[bytes]:
        """The notifications the thread handed over (``b"\\x01" + topic`` for a new
        subscription, ``b"\\x00" + topic`` when a topic's last subscriber left).  When the
        thread had to drop some (a churn flood over ``NOTES_HWM``), the loop's view is
        rebuilt once the pipe is empty: the difference between the topics held now and
        those the notifications said comes out as notifications too (counted in
        ``notes_resyncs``), so the loop never keeps a stale view."""
        out: list[bytes] = []
        if self.notes is None:
            return out
        recv = self.notes.recv
        view = self._view
        for _ in range(limit):
            try:
                m = recv(NOBLOCK)
            except zmq.Again:
                if self._resync and time.monotonic() - self.resynced_at >= RESYNC_SECONDS:
                    self._resync = False          # before the snapshot: a later drop sets it
                    self.resynced_at = time.monotonic()
                    out += self._rebuild_view()
                break
            out.append(m)
            if m[:1] == b"\x01":
                view.add(m[1:])
            elif m[:1] == b"\x00":
                view.discard(m[1:])
        return out

    def _rebuild_view(self) -> list[bytes]:
        g = self.guard
        if g is not None:
            with g.lock:
                now = set(g.topics)
        else:
            with self._plain_lock:
                now = set(self.subscriptions)
        view = self._view
        notes = [b"\x01" + t for t in sorted(now - view)] + \
            [b"\x00" + t for t in sorted(view - now)]
        self._view = now
        self.notes_resyncs += 1
        self._rlog.warning("resync", "xpub %s: %d subscription notifications dropped so far "
                           "(a churn flood over %d); the view was rebuilt from the %d topics "
                           "held", self.name, self.notes_dropped, NOTES_HWM, len(now))
        return notes

    def request_stop(self) -> None:
        """Ask the thread to stop once it has forwarded what was published (the
        sentinel goes behind it); :meth:`close` waits for it."""
        if self._thread.is_alive() and not self._stopping:
            self._stopping = True
            if self._ring is not None:
                self._ring.stop()
                self._sentinel_queued = True
                self._done.set()
                return
            try:
                self.sock.send(b"", NOBLOCK)
                self._sentinel_queued = True
            except zmq.ZMQError:
                pass                 # queue full: the thread sees _stopping within IDLE_MS
        self._done.set()

    def close(self, linger: int = 0, timeout: float = 5.0) -> bool:
        """Stop the threads (:meth:`request_stop`), then close every socket (the XPUB
        with ``linger`` ms).  False when a thread did not stop within ``timeout`` s (it
        is inside libzmq: a trie walk): its sockets are left open -- they cannot be
        closed under it -- and the object is kept (:func:`abandoned`), so the process
        must end without terminating the context (cli.py)."""
        deadline = time.monotonic() + timeout
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._watcher is not None and self._watcher.is_alive():
            self._watcher.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive() or (self._watcher is not None and
                                       self._watcher.is_alive()):
            # libzmq sockets cannot be closed under a thread that uses them
            log.error("xpub %s: its thread did not stop within %.1f s (inside libzmq); "
                      "its sockets are left to the end of the process", self.name, timeout)
            _ABANDONED.append(self)
            return False
        if self.guard is not None:
            self.guard.close()
        for s in (self.sock, self._pull, self.notes, self._notes_out):
            if s is not None:
                s.close(linger=0)
        self.xpub.close(linger=linger)
        return True

    # -- the threads
    def _watch(self) -> None:
        """The guard's watch (monitor, byte budgets) every ``WATCH_SECONDS``: it bounds a
        flood even while the owner thread is inside libzmq, whose command processing
        takes subscriptions in for as long as connections keep delivering them."""
        g = self.guard
        while not self._done.wait(WATCH_SECONDS):
            try:
                if g.watch() and self._ring is not None:
                    # notifications for the owner's round: the ring's pump stays in C
                    # while records flow, so it is told
                    self._ring.kick()
            except Exception as e:            # never let the watch die silently
                self.thread_errors += 1
                self._rlog.error("watch", "xpub %s: %s", self.name, e)

    def _run(self) -> None:
        if self._ring is not None:
            pump, src = zmq_fast.ring_pump, self._ring
        else:
            pump, src = zmq_fast.pump or pump_py, self._pull
        timeout = IDLE_MS
        while True:
            try:
                fwd, dropped, flags = pump(src, self.xpub, (), timeout, PUMP_BATCH)
            except zmq.ZMQError as e:
                if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                self.thread_errors += 1
                self._rlog.error("pump", "xpub %s: %s", self.name, e)
                time.sleep(0.01)
                continue
            if self._ring is None:           # the ring counts in C (ring_counts)
                self._forwarded += fwd
                self._forward_drops += dropped
            if flags & PUMP_STOP:
                return
            busy = False
            try:
                busy = self._subscriptions()
            except zmq.ZMQError as e:
                if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                self.thread_errors += 1
                self._rlog.error("subscriptions", "xpub %s: %s", self.name, e)
            except Exception as e:            # the thread must outlive any bug in a hook
                self.thread_errors += 1
                self._rlog.error("subscriptions", "xpub %s: %r", self.name, e)
                time.sleep(0.01)
            if self._stopping and not self._sentinel_queued and not fwd:
                return               # the sentinel could not be queued: nothing is left
            timeout = 0 if busy else IDLE_MS

    def _subscriptions(self) -> bool:
        """The guard's round (or a plain XPUB's notifications); True while more is
        pending."""
        g = self.guard
        if g is None:
            notes = []
            recv = self.xpub.recv
            subs = self.subscriptions
            for _ in range(500):
                try:
                    m = recv(NOBLOCK)
                except zmq.Again:
                    break
                if m and m[0] == 1:
                    with self._plain_lock:
                        subs.add(m[1:])
                    notes.append(m)
                elif m and m[0] == 0:
                    with self._plain_lock:
                        subs.discard(m[1:])
                    notes.append(m)
            busy = len(notes) == 500
        else:
            refused, cut = g.refused, g.disconnected
            notes = g.poll(500)       # small rounds: the pump forwards in between
            busy = g.busy
            if g.disconnected > cut:
                self._rlog.warning("cap", "subscriptions over max_subscriptions=%d on %s: "
                                   "%d refused, peer disconnected", g.max_subscriptions,
                                   self.endpoint, g.refused - refused)
        out = self._notes_out
        if out is not None:
            for m in notes:
                try:
                    out.send(m, NOBLOCK)
                except zmq.Again:
                    self.notes_dropped += 1
                    self._resync = True
        return busy
