"""CHIRP beacon task (trio, UDP multicast): OFFER on start, answer REQUESTs, DEPART on exit.

Multicast on loopback (measured in the dev container, Linux): ``lo`` has no MULTICAST
flag, yet multicast works on it when the *sender* sets ``IP_MULTICAST_IF`` to
127.0.0.1 with ``IP_MULTICAST_LOOP=1`` and the *receiver* joins 239.192.7.123 on
127.0.0.1.  Without ``IP_MULTICAST_IF`` the datagram follows the default route
(eth0) and a loopback-only member never sees it.  ConstellationDAQ does exactly this
and always adds 127.0.0.1, so we do too: one send socket per interface address
(loop on for 127.0.0.1 only, so a beacon is not delivered twice locally), one receive
socket bound to 0.0.0.0:7123 with ``SO_REUSEADDR`` (several CHIRP hosts on one machine
each get a copy of every beacon) joined on every interface address.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import random
import socket
import struct

import trio

from ..protocols import chirp as proto
from ..ratelimit import RateLimitedLog

log = logging.getLogger("logjam_relay.health.chirp")

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_IFF_MULTICAST = 0x1000
MULTICAST_TTL = 8


def _ifreq(name: str, req: int) -> bytes:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        return fcntl.ioctl(s.fileno(), req, struct.pack("256s", name.encode()[:15]))


def interface_address(name: str) -> str | None:
    """IPv4 address of interface ``name`` (Linux ioctl), None if it has none."""
    try:
        return socket.inet_ntoa(_ifreq(name, _SIOCGIFADDR)[20:24])
    except OSError:
        return None


def _interface_flags(name: str) -> int:
    try:
        return struct.unpack("H", _ifreq(name, _SIOCGIFFLAGS)[16:18])[0]
    except OSError:
        return 0


def resolve_interfaces(interface: str | None) -> list[str]:
    """Addresses to send/join on: always 127.0.0.1, plus

    * ``interface`` given: that interface (a name such as ``eth0`` or an IPv4 address);
    * ``None``: every interface that is up, multicast-capable and has an IPv4 address.
    """
    addrs = ["127.0.0.1"]
    if interface:
        try:
            addrs.append(str(ipaddress.IPv4Address(interface)))
        except ValueError:
            a = interface_address(interface)
            if a is None:
                raise ValueError(f"CHIRP interface {interface!r} has no IPv4 address") from None
            addrs.append(a)
    else:
        for _, name in socket.if_nameindex():
            flags = _interface_flags(name)
            if flags & _IFF_UP and flags & _IFF_MULTICAST and not flags & _IFF_LOOPBACK:
                a = interface_address(name)
                if a is not None:
                    addrs.append(a)
    return list(dict.fromkeys(addrs))


class ChirpBeacon:
    """Announce ``offers`` (service -> TCP port) in CHIRP group ``group`` as host ``host``."""

    def __init__(self, group: str, host: str, offers: dict[proto.Service, int],
                 interface_addresses: list[str] | None = None, *,
                 multicast_address: str = proto.MULTICAST_ADDRESS, port: int = proto.PORT,
                 max_reply_delay: float = 0.2):
        self.announcer = proto.Announcer(group, host, offers)
        self.addresses = interface_addresses or resolve_interfaces(None)
        self.endpoint = (multicast_address, port)
        self.port = port
        self.max_reply_delay = max_reply_delay
        self.sent = 0
        self.send_errors = 0
        self.received = 0
        self.bad_beacons: dict[str, int] = {}
        self.running = False
        self._send_socks: list[socket.socket] = []
        self._bad_log = RateLimitedLog(log)

    def stats(self) -> dict:
        return {"beacons_sent": self.sent, "send_errors": self.send_errors,
                "beacons_received": self.received,
                "requests_answered": self.announcer.requests_answered,
                "bad_beacons": dict(self.bad_beacons)}

    def _open(self) -> socket.socket:
        mcast = self.endpoint[0]
        for addr in self.addresses:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, MULTICAST_TTL)
            s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP,
                         1 if addr == "127.0.0.1" else 0)
            s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(addr))
            self._send_socks.append(s)
        r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        try:
            r.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            r.bind(("0.0.0.0", self.port))
            for addr in self.addresses:
                try:
                    r.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                                 socket.inet_aton(mcast) + socket.inet_aton(addr))
                except OSError as e:
                    log.warning("CHIRP: cannot join %s on %s: %s", mcast, addr, e)
        except BaseException:
            r.close()
            raise
        return r

    def _send(self, datagrams: list[bytes]) -> None:
        # Non-blocking sendto: a beacon that does not fit right now is lost (UDP anyway).
        for d in datagrams:
            for s in self._send_socks:
                try:
                    s.sendto(d, self.endpoint)
                    self.sent += 1
                except OSError as e:
                    self.send_errors += 1
                    self._bad_log.warning("send", "CHIRP send via %s failed: %s",
                                          s.getsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF), e)

    async def _reply_later(self, datagrams: list[bytes]) -> None:
        # Spread the answers of many hosts, like upstream (0-200 ms).
        await trio.sleep(random.random() * self.max_reply_delay)
        self._send(datagrams)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        raw = self._open()
        sock = trio.socket.from_stdlib_socket(raw)
        try:
            self.running = True
            self._send(self.announcer.start())
            log.info("CHIRP: offering %s in group %r as %r on %s",
                     {s.name: p for s, p in self.announcer.offers.items()},
                     self.announcer.group, self.announcer.host, self.addresses)
            task_status.started()
            async with trio.open_nursery() as nursery:
                while True:
                    data, _src = await sock.recvfrom(2048)
                    self.received += 1
                    try:
                        replies = self.announcer.receive(data)
                    except proto.ChirpError as e:
                        self.bad_beacons[e.reason] = self.bad_beacons.get(e.reason, 0) + 1
                        self._bad_log.warning(e.reason, "CHIRP: bad beacon from %s: %s",
                                              _src[0], e.message)
                        continue
                    if replies:
                        nursery.start_soon(self._reply_later, replies)
        finally:
            self.running = False
            try:
                self._send(self.announcer.stop())
            finally:
                sock.close()
                for s in self._send_socks:
                    s.close()
                self._send_socks.clear()
