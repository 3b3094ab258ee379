"""A bound on the ZeroMQ peers of each relay socket, enforced at the handshake by ZAP.

libzmq accepts every TCP connection; memory and CPU then grow with the number of peers:
each ROUTER/PULL/samwise peer has its own ``rcv_hwm`` queue, and on an XPUB (PUB, stats,
CMDP) the end of *any* connection makes libzmq walk the whole subscription trie on the
thread that next uses the socket -- the relay's event loop (``SubscriptionGuard``).

* :class:`ZapServer` is the ZAP handler (``inproc://zeromq.zap.01``, bound before any relay
  socket).  Every relay socket gets a ZAP domain that names it (``<base>/<socket>``), so
  libzmq asks the handler at every handshake, NULL mechanism included.  The handler asks
  :meth:`PeerLimit.admit` first, then, for CURVE endpoints, :meth:`Curve.handle`.
* :class:`PeerLimit` counts each socket's connections from a socket monitor (ACCEPTED -
  DISCONNECTED, a queue that never drops; the XPUBs' count comes from their
  ``SubscriptionGuard``, which owns their monitor).  A handshake that would take the
  socket over ``zmq_max_peers`` admitted connections, or, on an XPUB, one that comes while
  earlier connection ends have used up their share of the loop
  (``SubscriptionGuard.admit``), is **held**: its ZAP reply waits until there is room,
  first come first served.  It is never refused: a libzmq client that gets a ZAP refusal
  (ZMTP ERROR) gives that connection up for good and drops what it queued, while one whose
  handshake times out reconnects.  A request held for ``HOLD_SECONDS`` is let go without a
  reply: the relay's handshake timer (libzmq ``HANDSHAKE_IVL``, 30 s) then closes the
  connection and the client reconnects later.  Held handshakes are counted by socket and
  reason, logged rate-limited; the ones let go are counted too.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

import zmq

from ..ratelimit import RateLimitedLog
from .subscriptions import monitor_socket

log = logging.getLogger("logjam_relay.peers")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: ZAP domain of the sockets without CURVE (the handler only counts their peers)
PEERS_DOMAIN = b"logjam-peers"
SOCKETS = ("router", "pull", "samwise", "pub", "stats", "cmdp")
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


def set_domain(sock: zmq.Socket, name: str) -> None:
    """Before bind: make the socket's ZAP domain name it (``<domain>/<name>``; a socket
    without one gets ``logjam-peers/<name>``), so the handler asks about every handshake."""
    base = sock.getsockopt(zmq.ZAP_DOMAIN).partition(b"/")[0] or PEERS_DOMAIN
    sock.setsockopt(zmq.ZAP_DOMAIN, base + b"/" + name.encode())


class _Counted:
    """The connections of a socket without a SubscriptionGuard, from its own monitor.
    With ``on_failed`` (CURVE's handshake-failure counter) the monitor also reports
    failed handshakes: libzmq allows one monitor per socket."""

    def __init__(self, sock: zmq.Socket, on_failed=None):
        self.on_failed = on_failed
        self.monitor = monitor_socket(sock, _EVENTS | (_FAILED if on_failed else 0))
        self.live: set[int] = set()

    @property
    def peers(self) -> int:
        return len(self.live)

    def refresh(self) -> None:
        mon = self.monitor
        while True:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames[0]) < 6:
                continue
            event = int.from_bytes(frames[0][:2], "little")
            value = int.from_bytes(frames[0][2:6], "little", signed=True)
            if event == zmq.EVENT_ACCEPTED:
                self.live.add(value)
            elif event == zmq.EVENT_DISCONNECTED:
                self.live.discard(value)
            elif self.on_failed is not None:
                self.on_failed(event, value, frames[1] if len(frames) > 1 else b"")

    def admit(self) -> str | None:
        return None

    def close(self) -> None:
        self.monitor.close(linger=0)


class _Guarded:
    """An XPUB's connections, as its SubscriptionGuard counts them."""

    def __init__(self, guard):
        self.guard = guard

    @property
    def peers(self) -> int:
        return self.guard.peers

    def refresh(self) -> None:
        self.guard.refresh()

    def admit(self) -> str | None:
        return self.guard.admit()

    def close(self) -> None:
        pass


class PeerLimit:
    """Counts and bounds the peers of each watched socket (see the module docstring)."""

    def __init__(self, max_peers: int = 0):
        self.max_peers = max_peers
        self.sockets: dict[str, _Counted | _Guarded] = {}
        self.held: Counter[tuple[str, str]] = Counter()     # handshakes held, by reason
        self.expired: Counter[str] = Counter()              # held too long, let go
        self.admitted: Counter[str] = Counter()
        self.waiting: Counter[str] = Counter()              # held right now
        self._rlog = RateLimitedLog(log)

    def watch(self, name: str, sock: zmq.Socket, guard=None, on_failed=None) -> None:
        """After bind: count ``sock``'s connections (``guard``: its SubscriptionGuard)."""
        self.forget(name)
        self.sockets[name] = _Guarded(guard) if guard is not None else \
            _Counted(sock, on_failed)

    def forget(self, name: str) -> None:
        """The socket is closing: stop watching it (and close its monitor)."""
        old = self.sockets.pop(name, None)
        if old is not None:
            old.close()

    def close(self) -> None:
        for name in list(self.sockets):
            self.forget(name)

    def peers(self, name: str) -> int:
        """Connections of socket ``name``: admitted, or still in their handshake."""
        entry = self.sockets.get(name)
        if entry is None:
            return 0
        entry.refresh()
        return entry.peers

    def admit(self, name: str, waiting: int = 1) -> str | None:
        """None to admit a handshake of socket ``name`` now, else why it waits
        (``max_peers``, or ``busy`` on an XPUB).  ``waiting``: the socket's handshakes held
        by the ZAP handler, the asking one included (connections, not admitted)."""
        entry = self.sockets.get(name)
        if entry is None:
            return None
        entry.refresh()
        if self.max_peers and entry.peers - waiting >= self.max_peers:
            return "max_peers"
        return entry.admit()

    def on_hold(self, name: str, why: str, address: str) -> None:
        self.held[(name, why)] += 1
        if why == "max_peers":
            self._rlog.warning(f"{name}:{why}", "zmq: a peer of %s from %s waits: %d "
                               "connections, zmq_max_peers=%d", name, address,
                               self.peers(name), self.max_peers)
        else:
            self._rlog.warning(f"{name}:{why}", "zmq: a peer of %s from %s waits: connections "
                               "that ended lately cost the event loop its share (libzmq "
                               "walks the subscription trie)", name, address)

    def on_expired(self, name: str) -> None:
        self.expired[name] += 1
        self._rlog.warning(f"{name}:expired", "zmq: a peer of %s waited %.0f s without room; "
                           "its handshake is left to time out (it reconnects)", name,
                           HOLD_SECONDS)

    def stats(self) -> dict:
        return {"max_peers": self.max_peers,
                "peers": {n: self.peers(n) for n in self.sockets},
                "admitted": dict(self.admitted), "waiting": dict(self.waiting),
                "held": {f"{n}:{r}": v for (n, r), v in sorted(self.held.items())},
                "expired": dict(self.expired)}

    def collect(self, device: str = "0"):
        """Prometheus families (registered in RelayCollector.extra)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        peers = GaugeMetricFamily("logjam_relay_zmq_peers", "ZeroMQ connections of a socket "
                                  "(admitted or in their handshake)", labels=["device", "socket"])
        waiting = GaugeMetricFamily("logjam_relay_zmq_peers_waiting", "ZeroMQ handshakes the "
                                    "ZAP handler holds until there is room",
                                    labels=["device", "socket"])
        for name in self.sockets:
            peers.add_metric([device, name], self.peers(name))
            waiting.add_metric([device, name], self.waiting.get(name, 0))
        cap = GaugeMetricFamily("logjam_relay_zmq_max_peers", "zmq_max_peers: connections a "
                                "socket admits (0 = no bound)", labels=["device"])
        cap.add_metric([device], self.max_peers)
        held = CounterMetricFamily("logjam_relay_zmq_peers_held", "ZeroMQ handshakes held by "
                                   "the ZAP handler: over zmq_max_peers, or busy (an XPUB "
                                   "whose connection ends used up their share of the loop)",
                                   labels=["device", "socket", "reason"])
        expired = CounterMetricFamily("logjam_relay_zmq_peers_expired", "held handshakes let "
                                      "go without a reply after HOLD_SECONDS (the peer "
                                      "reconnects)", labels=["device", "socket"])
        for name in self.sockets:
            for reason in ("max_peers", "busy"):
                held.add_metric([device, name, reason], self.held.get((name, reason), 0))
            expired.add_metric([device, name], self.expired.get(name, 0))
        return [peers, waiting, cap, held, expired]


#: how long the ZAP handler holds a handshake waiting for room (below libzmq's
#: HANDSHAKE_IVL of 30 s, after which the relay's side closes the connection)
HOLD_SECONDS = 20.0
#: ZAP requests taken per wake-up of the handler (bounded work between checkpoints)
ZAP_BATCH = 256


class ZapServer:
    """The ZAP handler of a context: :meth:`PeerLimit.admit`, then CURVE's check."""

    def __init__(self, peers: PeerLimit, curve=None, clock=time.monotonic):
        self.peers = peers
        self.curve = curve
        self.clock = clock
        self.sock: zmq.Socket | None = None
        self.bad_requests = 0
        self.reply_failed = 0
        self._held: dict[str, deque] = {}       # socket -> (frames, since), oldest first

    def open(self, ctx: zmq.Context) -> zmq.Socket:
        """Bind the handler (before any relay socket is bound: libzmq accepts every
        client while no handler is bound)."""
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        self.sock = sock
        return sock

    def reply(self, frames: list[bytes]) -> list[bytes]:
        """The reply to an admitted request: CURVE's check, or OK for the NULL sockets."""
        base = frames[4].partition(b"/")[0]
        if base != PEERS_DOMAIN and self.curve is not None:
            return self.curve.handle([*frames[:4], base, *frames[5:]])
        return [frames[0], b"", b"1.0", frames[3], b"200", b"OK", b"", b""]

    def handle(self, frames: list[bytes]) -> list[bytes] | None:
        """One ZAP request (ROUTER frames) -> the reply frames, or None: held."""
        # [routing id, b"", version, request id, domain, address, identity, mechanism, ...]
        if len(frames) < 8 or frames[2] != b"1.0":
            if self.curve is not None:
                return self.curve.handle(frames)
            self.bad_requests += 1
            rid = frames[3] if len(frames) > 3 else b""
            return [frames[0], b"", b"1.0", rid, b"400", b"bad ZAP request", b"", b""]
        name = frames[4].partition(b"/")[2].decode("ascii", "replace")
        queue = self._held.get(name)
        why = self.peers.admit(name, len(queue) + 1 if queue else 1)
        if why is None and not queue:
            self.peers.admitted[name] += 1
            return self.reply(frames)
        why = why or "max_peers"                # behind others: first come first served
        self._held.setdefault(name, deque()).append((frames, self.clock()))
        self.peers.waiting[name] += 1
        self.peers.on_hold(name, why, frames[5].decode("ascii", "replace"))
        return None

    def retry(self) -> list[list[bytes]]:
        """The replies of held requests that may go now, oldest first per socket; the
        ones held for HOLD_SECONDS are let go."""
        out = []
        now = self.clock()
        for name, queue in list(self._held.items()):
            while queue:
                frames, since = queue[0]
                if now - since >= HOLD_SECONDS:
                    queue.popleft()
                    self.peers.waiting[name] -= 1
                    self.peers.on_expired(name)
                    continue
                if self.peers.admit(name, len(queue)) is not None:
                    break
                queue.popleft()
                self.peers.waiting[name] -= 1
                self.peers.admitted[name] += 1
                out.append(self.reply(frames))
            if not queue:
                del self._held[name]
        return out

    def _send(self, frames: list[bytes]) -> None:
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.reply_failed += 1
            if self.curve is not None:
                self.curve.refused["reply_failed"] += 1

    async def serve(self) -> None:
        import trio

        from . import zmq_trio
        sock = self.sock
        last_refresh = self.clock()
        while True:
            for _ in range(ZAP_BATCH):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                reply = self.handle(frames)
                if reply is not None:
                    self._send(reply)
            for reply in self.retry():
                self._send(reply)
            if self.clock() - last_refresh >= 1.0:
                for name in list(self.peers.sockets):
                    self.peers.peers(name)          # drain the monitors now and then
                last_refresh = self.clock()
            with trio.move_on_after(0.05 if self._held else 1.0):
                await zmq_trio.wait_for(sock, zmq.POLLIN)
            await trio.lowlevel.checkpoint()
