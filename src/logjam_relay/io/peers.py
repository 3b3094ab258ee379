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
  ``SubscriptionGuard``, which owns their monitor) and refuses a handshake
  while the socket has more than ``zmq_max_peers`` connections (the new one included), and
  on an XPUB while earlier connection ends have used up their share of the loop
  (``SubscriptionGuard.admit``).  Refusals are counted by socket and reason and logged
  rate-limited.  A refused peer gets ZMTP's ERROR and reconnects later (libzmq clients do,
  after ``reconnect_ivl``); nothing it queued is lost.
"""

from __future__ import annotations

import logging
from collections import Counter

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
        self.refused: Counter[tuple[str, str]] = Counter()
        self.admitted: Counter[str] = Counter()
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
        entry = self.sockets.get(name)
        if entry is None:
            return 0
        entry.refresh()
        return entry.peers

    def admit(self, name: str, address: str = "?") -> str | None:
        """None to admit a new connection of socket ``name``, else the reason to refuse it
        (``max_peers``, or ``busy`` on an XPUB)."""
        entry = self.sockets.get(name)
        if entry is None:
            return None
        entry.refresh()
        why = None
        if self.max_peers and entry.peers > self.max_peers:
            why = "max_peers"
        else:
            why = entry.admit()
        if why is None:
            self.admitted[name] += 1
            return None
        self.refused[(name, why)] += 1
        if why == "max_peers":
            self._rlog.warning(f"{name}:{why}", "zmq: refused a peer of %s from %s: %d "
                               "connections, zmq_max_peers=%d", name, address, entry.peers,
                               self.max_peers)
        else:
            self._rlog.warning(f"{name}:{why}", "zmq: refused a peer of %s from %s for now: "
                               "connections that ended lately cost the event loop its share "
                               "(a subscription trie to walk); the peer reconnects", name,
                               address)
        return why

    def stats(self) -> dict:
        return {"max_peers": self.max_peers,
                "peers": {n: self.peers(n) for n in self.sockets},
                "admitted": dict(self.admitted),
                "refused": {f"{n}:{r}": v for (n, r), v in sorted(self.refused.items())}}

    def collect(self, device: str = "0"):
        """Prometheus families (registered in RelayCollector.extra)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        peers = GaugeMetricFamily("logjam_relay_zmq_peers", "ZeroMQ connections of a socket "
                                  "(accepted, not yet ended)", labels=["device", "socket"])
        for name in self.sockets:
            peers.add_metric([device, name], self.peers(name))
        cap = GaugeMetricFamily("logjam_relay_zmq_max_peers", "zmq_max_peers: connections a "
                                "socket keeps (0 = no bound)", labels=["device"])
        cap.add_metric([device], self.max_peers)
        ref = CounterMetricFamily("logjam_relay_zmq_peers_refused", "ZeroMQ handshakes refused "
                                  "by the ZAP handler: over zmq_max_peers, or busy (an XPUB "
                                  "whose connection ends used up their share of the loop)",
                                  labels=["device", "socket", "reason"])
        for name in self.sockets:
            for reason in ("max_peers", "busy"):
                ref.add_metric([device, name, reason], self.refused.get((name, reason), 0))
        return [peers, cap, ref]


class ZapServer:
    """The ZAP handler of a context: :meth:`PeerLimit.admit`, then CURVE's check."""

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
        why = self.peers.admit(name.decode("ascii", "replace"),
                               frames[5].decode("ascii", "replace"))
        if why is not None:
            text = b"too many peers" if why == "max_peers" else b"busy, try again"
            return [frames[0], b"", b"1.0", frames[3], b"400", text, b"", b""]
        if base != PEERS_DOMAIN and self.curve is not None:
            return self.curve.handle([*frames[:4], base, *frames[5:]])
        return [frames[0], b"", b"1.0", frames[3], b"200", b"OK", b"", b""]

    async def serve(self) -> None:
        import trio

        from . import zmq_trio
        sock = self.sock
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                with trio.move_on_after(1.0):
                    await zmq_trio.wait_for(sock, zmq.POLLIN)
                for name in list(self.peers.sockets):
                    self.peers.peers(name)          # drain the monitors now and then
                continue
            try:
                sock.send_multipart(self.handle(frames), zmq.NOBLOCK)
            except zmq.ZMQError:
                self.reply_failed += 1
                if self.curve is not None:
                    self.curve.refused["reply_failed"] += 1
