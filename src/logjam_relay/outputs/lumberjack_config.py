"""Lumberjack output configuration: :class:`LumberjackConfig` and its URL form.

``lumberjack://h1:5044,h2:5044?window=1000&...`` (every parameter is listed in
:func:`parse_url` and in the README's output table).
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, field

from ..io.net import TLSSettings, parse_hostport
from ..protocols import lumberjack as lj
from .url_params import flag, query_params, tls_settings

DEFAULT_PORT = 5044
MIN_WINDOW_BYTES = 64 * 1024


# ------------------------------------------------------------------------ config


@dataclass(frozen=True, slots=True)
class LumberjackConfig:
    hosts: tuple[tuple[str, int], ...]
    window: int = 1000
    compression: int = 3                  # zlib level; 0 = plain D frames
    timeout: float = 30.0                 # connect+handshake, and per window until its ACK
    tls: TLSSettings = field(default_factory=TLSSettings)
    backoff_min: float = 0.5
    backoff_max: float = 30.0
    pipeline: int = 4                     # windows in flight; 1 = stop-and-wait
    # a window ends after the record that takes its spooled bytes to this (0: 4 x the
    # relay's max_event_bytes), so window x pipeline is bounded in bytes, not only events
    window_bytes: int = 0
    loadbalance: bool = False             # pick a random host per connection
    # forward heartbeats (and restart markers) as events: an edge relay feeding a central
    # one, so that every sequence number of the edge reaches the central archive
    heartbeats: bool = False
    relay_host: str = field(default_factory=socket.gethostname)
    name: str = "lumberjack"

    def __post_init__(self):
        if not self.hosts:
            raise ValueError("hosts: at least one host is needed")
        if not 1 <= self.window <= lj.MAX_WINDOW:
            raise ValueError(f"window: {self.window} not in 1..{lj.MAX_WINDOW}")
        if not 0 <= self.compression <= 9:
            raise ValueError(f"compression: {self.compression} not in 0..9")
        if not self.timeout > 0:
            raise ValueError(f"timeout: {self.timeout} must be > 0")
        if not 1 <= self.pipeline <= 64:
            raise ValueError(f"pipeline: {self.pipeline} not in 1..64")
        if self.window_bytes and not MIN_WINDOW_BYTES <= self.window_bytes <= 2**40:
            raise ValueError(f"window_bytes: {self.window_bytes} not in "
                             f"{MIN_WINDOW_BYTES}..{2**40} (or 0: 4 x max_event_bytes)")
        if not 0 < self.backoff_min <= self.backoff_max:
            raise ValueError("backoff_min/backoff_max: need 0 < backoff_min <= backoff_max")


def _num(name: str, v: str, conv):
    try:
        x = conv(v)
    except ValueError:
        raise ValueError(f"lumberjack URL: parameter {name!r}: "
                         f"expected {'an integer' if conv is int else 'a number'}, "
                         f"got {v!r}") from None
    if conv is float and not math.isfinite(x):
        raise ValueError(f"lumberjack URL: parameter {name!r}: expected a finite number, got {v!r}")
    return x


def parse_url(url: str, **overrides) -> LumberjackConfig:
    """``lumberjack://h1:5044,h2:5044?window=1000&compression=3&tls=on&ca=...&cert=...
    &key=...&server_name=...&verify=on&timeout=30&pipeline=4&window_bytes=40MiB
    &loadbalance=off&heartbeats=off&backoff_min=0.5&backoff_max=30&relay_host=...&name=...``
    -> :class:`LumberjackConfig`.

    TLS is on unless ``tls=off``; the port defaults to 5044.  Raises ValueError naming
    the offending parameter.  ``overrides`` are passed to the config as keyword arguments.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "lumberjack":
        raise ValueError(f"lumberjack URL: scheme must be 'lumberjack://', got {url!r}")
    netloc, _, query = rest.partition("?")
    netloc = netloc.rstrip("/")
    if not netloc:
        raise ValueError("lumberjack URL: no host given")
    hosts = []
    for part in netloc.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"lumberjack URL: empty host in {netloc!r}")
        try:
            h, p = parse_hostport(part, DEFAULT_PORT)
        except ValueError:
            raise ValueError(f"lumberjack URL: bad host:port {part!r}") from None
        if not h or not 0 < p < 65536:
            raise ValueError(f"lumberjack URL: bad host:port {part!r}")
        hosts.append((h, p))
    kw: dict = {}
    params = query_params("lumberjack", query)
    tls = tls_settings("lumberjack", params, check_files=False)
    for k, v in params.items():
        if k in ("window", "compression", "pipeline"):
            kw[k] = _num(k, v, int)
        elif k == "window_bytes":
            from ..units import size
            try:
                kw[k] = size(v)
            except ValueError as e:
                raise ValueError(f"lumberjack URL: parameter {k!r}: {e}") from None
        elif k in ("timeout", "backoff_min", "backoff_max"):
            kw[k] = _num(k, v, float)
        elif k in ("loadbalance", "heartbeats"):
            kw[k] = flag("lumberjack", k, v)
        elif k in ("relay_host", "name"):
            if not v:
                raise ValueError(f"lumberjack URL: parameter {k!r} is empty")
            kw[k] = v
        else:
            raise ValueError(f"lumberjack URL: unknown parameter {k!r}")
    kw.update(overrides)
    kw.setdefault("tls", tls)
    try:
        return LumberjackConfig(hosts=tuple(hosts), **kw)
    except ValueError as e:
        raise ValueError(f"lumberjack URL: parameter {e}") from None
