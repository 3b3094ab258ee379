"""Sans-IO core of CHIRP/1, Constellation's UDP multicast service discovery.

A beacon is exactly 42 bytes::

    "CHIRP" 0x01 | type (1) | group id (16) | host id (16) | service (1) | port (2, big-endian)

Types: 1 REQUEST, 2 OFFER, 3 DEPART.  Services: 1 CONTROL, 2 HEARTBEAT, 3 MONITORING
(CMDP), 4 DATA.  Ids are the raw MD5 digests of the lower-cased group name and of the
lower-cased canonical host name (``Type.Name``).  Beacons go to 239.192.7.123:7123.
The receiver connects to ``tcp://<UDP source address>:<port>``: the address is never in
the payload.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

MULTICAST_ADDRESS = "239.192.7.123"
PORT = 7123
HEADER = b"CHIRP\x01"
BEACON_SIZE = 42


class ChirpError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class MessageType(enum.IntEnum):
    REQUEST = 1
    OFFER = 2
    DEPART = 3


class Service(enum.IntEnum):
    CONTROL = 1
    HEARTBEAT = 2
    MONITORING = 3
    DATA = 4


def name_id(name: str) -> bytes:
    """The 16-byte id of a group or canonical host name: MD5 of the lower-cased name."""
    return hashlib.md5(name.lower().encode("utf-8"), usedforsecurity=False).digest()


@dataclass(frozen=True, slots=True)
class Beacon:
    type: MessageType
    group_id: bytes
    host_id: bytes
    service: Service
    port: int = 0


def encode(b: Beacon) -> bytes:
    if len(b.group_id) != 16 or len(b.host_id) != 16:
        raise ValueError("CHIRP ids are 16 bytes")
    if not 0 <= b.port <= 0xFFFF:
        raise ValueError(f"port {b.port} out of range")
    return (HEADER + bytes((int(b.type),)) + b.group_id + b.host_id
            + bytes((int(b.service),)) + b.port.to_bytes(2, "big"))


def decode(data: bytes) -> Beacon:
    if len(data) != BEACON_SIZE:
        raise ChirpError("bad_length", f"beacon is {len(data)} bytes, not {BEACON_SIZE}")
    if data[:6] != HEADER:
        raise ChirpError("bad_header", f"header {bytes(data[:6])!r} is not {HEADER!r}")
    try:
        mtype = MessageType(data[6])
    except ValueError:
        raise ChirpError("bad_type", f"unknown message type {data[6]}") from None
    try:
        service = Service(data[39])
    except ValueError:
        raise ChirpError("bad_service", f"unknown service id {data[39]}") from None
    return Beacon(mtype, bytes(data[7:23]), bytes(data[23:39]), service,
                  int.from_bytes(data[40:42], "big"))


class Announcer:
    """Beacon logic of a host that offers services (sans-IO).

    ``start()`` gives the OFFERs to multicast, ``receive(datagram)`` the answers to a
    REQUEST (OFFERs for the requested service, if we offer it), ``stop()`` the DEPARTs.
    Beacons from our own host id and from other groups are ignored, malformed ones
    raise :class:`ChirpError`.
    """

    def __init__(self, group: str, host: str, offers: dict[Service, int] | None = None):
        self.group = group
        self.host = host
        self.group_id = name_id(group)
        self.host_id = name_id(host)
        self.offers: dict[Service, int] = dict(offers or {})
        self.requests_answered = 0

    def _beacons(self, mtype: MessageType, only: Service | None = None) -> list[bytes]:
        return [encode(Beacon(mtype, self.group_id, self.host_id, svc, port))
                for svc, port in self.offers.items() if only is None or svc == only]

    def start(self) -> list[bytes]:
        return self._beacons(MessageType.OFFER)

    def stop(self) -> list[bytes]:
        return self._beacons(MessageType.DEPART)

    def receive(self, data: bytes) -> list[bytes]:
        b = decode(data)
        if b.host_id == self.host_id or b.group_id != self.group_id:
            return []
        if b.type is MessageType.REQUEST and b.service in self.offers:
            self.requests_answered += 1
            return self._beacons(MessageType.OFFER, b.service)
        return []
