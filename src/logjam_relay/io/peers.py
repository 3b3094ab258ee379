"""A bound on the ZeroMQ peers of each relay socket (``zmq_max_peers``).

libzmq accepts every TCP connection; memory and CPU then grow with the number of peers:
each ROUTER/PULL/samwise peer has its own ``rcv_hwm`` queue, and on an XPUB (PUB, stats,
CMDP) the end of *any* connection makes libzmq walk the whole subscription trie on the
thread that next uses the socket -- the XPUB's own thread (io/xpubthread.py,
``SubscriptionGuard``).

* :class:`PeerLimit` watches each socket's connections through a socket monitor (ACCEPTED
  and DISCONNECTED with the connection's fd, on a queue that never drops; an XPUB's monitor
  is its ``SubscriptionGuard``'s, which asks :meth:`PeerLimit.keep` through its
  ``accept_hook``).  A connection accepted while the socket already keeps
  ``zmq_max_peers`` -- or, on an XPUB, while the ends of earlier connections have used up
  their share of the socket's thread (``SubscriptionGuard.admit``) -- is aborted at once (a TCP reset,
  as the guard cuts a flooder), counted by socket and reason, logged rate-limited.  A
  libzmq client then reconnects after its ``reconnect_ivl`` and keeps what it queued: a
  ZAP refusal would instead make it give that connection up for good.
* :class:`ZapServer` is the ZAP handler (``inproc://zeromq.zap.01``, bound before any relay
  socket).  Every relay socket gets a ZAP domain that names it (``<base>/<socket>``), so
  libzmq asks the handler at every handshake, NULL mechanism included, and no handshake
  completes before the handler has read the monitors: an excess connection is aborted
  before it gets a pipe (no queue, nothing for an XPUB to walk).  Then, for CURVE
  endpoints, :meth:`Curve.handle` decides; the others get 200.
"""

from __future__ import annotations

import logging
from collections import Counter

import zmq

from ..ratelimit import RateLimitedLog
from .subscriptions import abort_connection, monitor_socket

log = logging.getLogger("logjam_relay.peers")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: ZAP domain of the sockets without CURVE (the handler only counts their peers)
PEERS_DOMAIN = b"logjam-peers"
SOCKETS = ("router", "pull", "samwise", "pub", "stats", "cmdp")
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
#: ZAP requests taken per wake-up of the handler (bounded work between checkpoints)
ZAP_BATCH = 256


def set_domain(sock: zmq.Socket, name: str) -> None:
    """Before bind: make the socket's ZAP domain name it (``<domain>/<name>``; a socket
    without one gets ``logjam-peers/<name>``), so the handler asks about every handshake."""
    base = sock.getsockopt(zmq.ZAP_DOMAIN).partition(b"/")[0] or PEERS_DOMAIN
    sock.setsockopt(zmq.ZAP_DOMAIN, base + b"/" + name.encode())


def tcp_ports(sock: zmq.Socket, endpoints=()) -> set[int]:
    """The TCP ports ``sock`` listens on (its last endpoint and ``endpoints``)."""
    ports = set()
    for ep in [sock.getsockopt_string(zmq.LAST_ENDPOINT), *endpoints]:
        if ep.startswith("tcp://"):
            try:
                ports.add(int(ep.rsplit(":", 1)[1]))
            except ValueError:
                pass
    return ports


class _Counted:
    """The connections of a socket without a SubscriptionGuard, from its own monitor.
    With ``on_failed`` (CURVE's handshake-failure counter) the monitor also reports
    failed handshakes: libzmq allows one monitor per socket."""

    def __init__(self, sock: zmq.Socket, keep, ports: set[int], on_failed=None):
        self.keep = keep
        self.ports = ports
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
                if self.keep(value):
                    self.live.add(value)
                else:
                    abort_connection(value, self.ports)
            elif event == zmq.EVENT_DISCONNECTED:
                self.live.discard(value)
            elif self.on_failed is not None:
                self.on_failed(event, value, frames[1] if len(frames) > 1 else b"")
        # (an fd whose DISCONNECTED was lost would stay counted: the queue never drops)

    def admit(self) -> str | None:
        return None

    def close(self) -> None:
        self.monitor.close(linger=0)


class _Guarded:
    """An XPUB's connections, as its SubscriptionGuard counts them."""

    def __init__(self, guard, keep):
        self.guard = guard
        guard.accept_hook = keep

    @property
    def peers(self) -> int:
        return self.guard.peers

    def refresh(self) -> None:
        self.guard.refresh()

    def admit(self) -> str | None:
        return self.guard.admit()

    def close(self) -> None:
        with self.guard.lock:            # the XPUB's threads may be admitting
            self.guard.accept_hook = None


class PeerLimit:
    """Counts and bounds the peers of each watched socket (see the module docstring)."""

    def __init__(self, max_peers: int = 0):
        self.max_peers = max_peers
        self.sockets: dict[str, _Counted | _Guarded] = {}
        self.refused: Counter[tuple[str, str]] = Counter()   # connections aborted, by reason
        self.accepted: Counter[str] = Counter()
        self._rlog = RateLimitedLog(log)

    def watch(self, name: str, sock: zmq.Socket, guard=None, on_failed=None,
              endpoints=()) -> None:
        """After bind: count ``sock``'s connections (``guard``: its SubscriptionGuard);
        ``endpoints``: more TCP endpoints it listens on (the last one is known)."""
        self.forget(name)

        def keep(fd: int, name=name) -> bool:
            return self._keep(name, fd)
        if guard is not None:
            self.sockets[name] = _Guarded(guard, keep)
        else:
            self.sockets[name] = _Counted(sock, keep, tcp_ports(sock, endpoints), on_failed)

    def forget(self, name: str) -> None:
        """The socket is closing: stop watching it (and close its monitor)."""
        old = self.sockets.pop(name, None)
        if old is not None:
            old.close()

    def close(self) -> None:
        for name in list(self.sockets):
            self.forget(name)

    def peers(self, name: str) -> int:
        """Connections socket ``name`` keeps (in their handshake or admitted)."""
        entry = self.sockets.get(name)
        if entry is None:
            return 0
        entry.refresh()
        return entry.peers

    def refresh(self, name: str) -> None:
        """Take the socket's monitor events now: a new connection over the bound is
        aborted before the ZAP handler lets its handshake end."""
        entry = self.sockets.get(name)
        if entry is not None:
            entry.refresh()

    def _keep(self, name: str, fd: int) -> bool:
        entry = self.sockets.get(name)
        if entry is None:
            return True
        if self.max_peers and entry.peers >= self.max_peers:
            why = "max_peers"
        else:
            why = entry.admit()
        if why is None:
            self.accepted[name] += 1
            return True
        self.refused[(name, why)] += 1
        if why == "max_peers":
            self._rlog.warning(f"{name}:{why}", "zmq: reset a new connection of %s (fd %d): "
                               "it keeps %d, zmq_max_peers=%d; the peer reconnects later",
                               name, fd, entry.peers, self.max_peers)
        else:
            self._rlog.warning(f"{name}:{why}", "zmq: reset a new connection of %s (fd %d): "
                               "connections that ended lately cost the socket's thread "
                               "its share (libzmq walks the subscription trie); the peer "
                               "reconnects later", name, fd)
        return False

    def stats(self) -> dict:
        return {"max_peers": self.max_peers,
                "peers": {n: self.peers(n) for n in self.sockets},
                "accepted": dict(self.accepted),
                "refused": {f"{n}:{r}": v for (n, r), v in sorted(self.refused.items())}}

    def collect(self, device: str = "0"):
        """Prometheus families (registered in RelayCollector.extra)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        peers = GaugeMetricFamily("logjam_relay_zmq_peers", "ZeroMQ connections a socket "
                                  "keeps (in their handshake or admitted)",
                                  labels=["device", "socket"])
        for name in self.sockets:
            peers.add_metric([device, name], self.peers(name))
        cap = GaugeMetricFamily("logjam_relay_zmq_max_peers", "zmq_max_peers: connections a "
                                "socket keeps (0 = no bound)", labels=["device"])
        cap.add_metric([device], self.max_peers)
        ref = CounterMetricFamily("logjam_relay_zmq_peers_refused", "new ZeroMQ connections "
                                  "reset at once: over zmq_max_peers, or busy (an XPUB whose "
                                  "connection ends used up their share of its thread)",
                                  labels=["device", "socket", "reason"])
        for name in self.sockets:
            for reason in ("max_peers", "busy"):
                ref.add_metric([device, name, reason], self.refused.get((name, reason), 0))
        return [peers, cap, ref]


class ZapServer:
    """The ZAP handler of a context: reads the socket's monitor (PeerLimit), then CURVE's
    check or OK."""

    def __init__(self, peers: PeerLimit, curve=None):
        self.peers = peers
        self.curve = curve
        self.sock: zmq.Socket | None = None
        self.bad_requests = 0
        self.reply_failed = 0

    def open(self, ctx: zmq.Context) -> zmq.Socket:
        """Bind the handler (before any relay socket is bound: libzmq accepts every
        client while no handler is bound)."""
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        self.sock = sock
        return sock

    def handle(self, frames: list[bytes]) -> list[bytes]:
        """One ZAP request (ROUTER frames) -> the reply frames."""
        # [routing id, b"", version, request id, domain, address, identity, mechanism, ...]
        if len(frames) < 8 or frames[2] != b"1.0":
            if self.curve is not None:
                return self.curve.handle(frames)
            self.bad_requests += 1
            rid = frames[3] if len(frames) > 3 else b""
            return [frames[0], b"", b"1.0", rid, b"400", b"bad ZAP request", b"", b""]
        base, _, name = frames[4].partition(b"/")
        # the monitor first: a connection over the bound is reset before its handshake ends
        # (its request may be this one: the reply then goes nowhere)
        self.peers.refresh(name.decode("ascii", "replace"))
        if base != PEERS_DOMAIN and self.curve is not None:
            return self.curve.handle([*frames[:4], base, *frames[5:]])
        return [frames[0], b"", b"1.0", frames[3], b"200", b"OK", b"", b""]

    async def serve(self) -> None:
        import trio

        from . import zmq_trio
        sock = self.sock
        while True:
            for _ in range(ZAP_BATCH):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    sock.send_multipart(self.handle(frames), zmq.NOBLOCK)
                except zmq.ZMQError:
                    self.reply_failed += 1
            with trio.move_on_after(1.0):
                await zmq_trio.wait_for(sock, zmq.POLLIN)
            for name in list(self.peers.sockets):
                self.peers.refresh(name)             # drain the monitors now and then
            await trio.lowlevel.checkpoint()

