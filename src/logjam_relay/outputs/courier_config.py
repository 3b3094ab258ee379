"""Courier output configuration: :class:`CourierConfig` and its URL form.

``courier://host:port[,host2:port2...]?payload=1000&tls=off&...`` (every parameter is
listed in :func:`parse_url` and in the README's output table).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from ..io.net import TLSSettings
from ..protocols.courier import MAX_LENGTH
from .url_params import flag, query_params, split_url, tls_settings

# ------------------------------------------------------------------ configuration


@dataclass(frozen=True, slots=True)
class CourierConfig:
    hosts: tuple[tuple[str, int], ...]
    tls: TLSSettings = field(default_factory=TLSSettings)
    payload_size: int = 1000              # events per payload
    max_pending: int = 10                 # unacknowledged payloads per connection (Go limit)
    network_timeout: float = 15.0         # connect, handshake, ACKN progress, PONG
    idle_ping: float = 10.0               # PING after this long without traffic
    backoff_initial: float = 1.0
    backoff_max: float = 30.0             # the Go client caps at 300 s: too long for a relay
    compress_level: int = 3               # as the Go client (78 5e)
    streaming: bool = True                # use EVNT when the receiver offers it
    # forward heartbeats (and restart markers) as events: an edge relay feeding a central
    # one, so that every sequence number of the edge reaches the central archive
    heartbeats: bool = False
    max_payload_bytes: int = 4 * 1024 * 1024   # uncompressed; a payload is cut earlier
    max_event_bytes: int = MAX_LENGTH - 1024   # larger events are dropped (receivers refuse)
    hostname: str = field(default_factory=socket.gethostname)   # event field "host"
    shutdown_timeout: float = 15.0
    name: str = "courier"

    def __post_init__(self):
        if not self.hosts:
            raise ValueError("at least one host is required")
        if self.payload_size < 1:
            raise ValueError("payload_size must be >= 1")
        if self.max_pending < 1:
            raise ValueError("max_pending must be >= 1")


def _hostport(s: str) -> tuple[str, int]:
    if s.startswith("["):
        host, _, rest = s[1:].partition("]")
        if not rest.startswith(":"):
            raise ValueError(f"courier URL: host {s!r} needs a port ([v6]:port)")
        port_s = rest[1:]
    else:
        host, sep, port_s = s.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"courier URL: host {s!r} needs a port (host:port)")
    if not host:
        raise ValueError(f"courier URL: empty host name in {s!r}")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"courier URL: port {port_s!r} of {s!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"courier URL: port {port} of {s!r} out of range 1..65535")
    return host, port


def parse_url(url: str) -> CourierConfig:
    """``courier://host:port[,host2:port2...]?payload=1000&tls=off&...`` -> config.

    Parameters: ``payload`` (events per payload), ``pending`` (unacknowledged payloads per
    connection), ``tls`` (on/off, default on), ``ca``, ``cert``, ``key``, ``server_name``,
    ``verify`` (on/off, default on), ``timeout`` (network timeout, s), ``ping`` (idle
    PING, s), ``backoff``, ``backoff_max`` (s), ``level`` (zlib 0-9), ``evnt`` (on/off),
    ``heartbeats`` (on/off, default off: forward heartbeats as events),
    ``hostname`` (the ``host`` field of events), ``name`` (the output's name: metrics,
    spool cursor, dead letters). Raises ValueError naming the bad part.
    """
    try:
        u = split_url(url)
    except ValueError as e:
        raise ValueError(f"courier URL: {e}") from None
    if u.scheme != "courier":
        raise ValueError(f"courier URL: scheme must be 'courier', got {u.scheme!r}")
    if "@" in u.netloc:
        raise ValueError("courier URL: user information is not supported")
    if u.path not in ("", "/"):
        raise ValueError(f"courier URL: unexpected path {u.path!r}")
    if u.fragment:
        raise ValueError(f"courier URL: unexpected fragment {u.fragment!r}")
    if not u.netloc:
        raise ValueError("courier URL: no host:port")
    hosts = tuple(_hostport(h) for h in u.netloc.split(","))

    params = query_params("courier", u.query)
    tls = tls_settings("courier", params, check_files=True)

    def num(name, conv, lo, hi=None):
        raw = params.pop(name, None)
        if raw is None:
            return None
        try:
            v = conv(raw)
        except ValueError:
            raise ValueError(f"courier URL: parameter {name}={raw!r} is not a "
                             f"{'number' if conv is float else 'whole number'}") from None
        if v != v or v < lo or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise ValueError(f"courier URL: parameter {name}={raw!r} must be {rng}")
        return v

    kw: dict = {}
    for key, name, conv, lo, hi in (
        ("payload_size", "payload", int, 1, 1_000_000),
        ("max_pending", "pending", int, 1, 10_000),
        ("network_timeout", "timeout", float, 0.001, None),
        ("idle_ping", "ping", float, 0.001, None),
        ("backoff_initial", "backoff", float, 0.0, None),
        ("backoff_max", "backoff_max", float, 0.0, None),
        ("compress_level", "level", int, 0, 9),
    ):
        v = num(name, conv, lo, hi)
        if v is not None:
            kw[key] = v
    if "evnt" in params:
        kw["streaming"] = flag("courier", "evnt", params.pop("evnt"))
    if "heartbeats" in params:
        kw["heartbeats"] = flag("courier", "heartbeats", params.pop("heartbeats"))
    for key in ("hostname", "name"):
        value = params.pop(key, None)
        if value is not None:
            if not value:
                raise ValueError(f"courier URL: parameter {key} is empty")
            kw[key] = value

    kw["tls"] = tls

    if params:
        raise ValueError(f"courier URL: unknown parameter {sorted(params)[0]!r}")
    if kw.get("backoff_max", 30.0) < kw.get("backoff_initial", 1.0):
        raise ValueError("courier URL: parameter backoff_max must be >= backoff")
    return CourierConfig(hosts=hosts, **kw)
