"""Input URLs: :class:`InputSpec` and the parser of ``--input`` (``parse_input``).

``scheme://host:port?param=value&...``; each ValueError names the bad parameter.
The parameters are listed in ``docs/inputs.md``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from ..config import ConfigError, Settings
from ..io.net import parse_hostport
from .mapping import MappingOptions

DEFAULT_PORTS = {"lumberjack": 5044, "courier": 5043}
#: default max_held_bytes: this, or 4 x max_batch_bytes if that is larger
DEFAULT_MAX_HELD_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class InputSpec:
    scheme: str
    name: str
    host: str
    port: int
    tls: bool = True
    cert: str | None = None
    key: str | None = None
    ca: str | None = None                  # client CA: clients must present a certificate
    timeout: float = 30.0                  # a started window/payload must complete in this
    idle_timeout: float = 900.0            # a connection with nothing in flight is closed
    handshake_timeout: float = 10.0        # TLS handshake
    max_connections: int = 256
    max_window: int = 10_000               # Lumberjack: events per window
    max_event_bytes: int = 10 * 1024 * 1024
    max_batch_bytes: int = 64 * 1024 * 1024   # a window / payload, inflated
    # what all connections of the input hold at once (docs/inputs.md, "Memory")
    max_held_bytes: int = DEFAULT_MAX_HELD_BYTES
    ack_interval: float = 5.0              # keep-alive while a batch waits for the spool
    mapping: MappingOptions = field(default_factory=MappingOptions)

    @property
    def url_display(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port} ({'tls' if self.tls else 'plain'})"


_BOOL = {"on": True, "true": True, "yes": True, "1": True,
         "off": False, "false": False, "no": False, "0": False}


def parse_input(url: str, *, max_event_bytes: int | None = None) -> InputSpec:
    """``scheme://host:port?param=value&...`` -> :class:`InputSpec`; ValueError names the
    bad parameter."""
    from ..units import duration, size
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in DEFAULT_PORTS:
        raise ValueError(f"input {url!r}: scheme must be lumberjack:// or courier://")
    netloc, _, query = rest.partition("?")
    netloc = netloc.rstrip("/")
    try:
        host, port = parse_hostport(netloc, DEFAULT_PORTS[scheme])
    except ValueError:
        raise ValueError(f"input {url!r}: bad host:port {netloc!r}") from None
    if not host or not 0 <= port < 65536:
        raise ValueError(f"input {url!r}: bad host:port {netloc!r}")
    kw: dict = {}
    mkw: dict = {}
    seen = set()
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(f"input {url!r}: malformed query string") from None
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"input {url!r}: parameter {k!r} given twice")
        seen.add(k)
        try:
            if k == "tls":
                if v.lower() not in _BOOL:
                    raise ValueError(f"expected on/off, got {v!r}")
                kw["tls"] = _BOOL[v.lower()]
            elif k in ("cert", "key", "ca"):
                if not os.path.isfile(v):
                    raise ValueError(f"file not found: {v!r}")
                kw[k] = v
            elif k in ("timeout", "idle_timeout", "handshake_timeout", "ack_interval"):
                x = duration(v)
                if not 0 < x < math.inf:
                    raise ValueError(f"must be > 0, got {v!r}")
                kw[k] = x
            elif k in ("max_connections", "max_window"):
                n = int(v)
                hi = 10_000 if k == "max_window" else 100_000
                if not 1 <= n <= hi:
                    raise ValueError(f"must be in 1..{hi}, got {v!r}")
                kw[k] = n
            elif k in ("max_event_bytes", "max_batch_bytes"):
                n = size(v)
                if not 1024 <= n <= 1024**3:
                    raise ValueError(f"must be between 1KiB and 1GiB, got {v!r}")
                kw[k] = n
            elif k == "max_held_bytes":
                n = size(v)
                if not 1024**2 <= n <= 1024**4:
                    raise ValueError(f"must be between 1MiB and 1TiB, got {v!r}")
                kw[k] = n
            elif k in ("app_field", "env_field", "default_app", "default_env", "topic_prefix"):
                if not v:
                    raise ValueError("must not be empty")
                mkw[k] = v
            elif k == "name":
                if not v or not all(c.isalnum() or c in "_.-" for c in v):
                    raise ValueError(f"may only use A-Z a-z 0-9 _ . -, got {v!r}")
                kw["name"] = v
            else:
                raise ValueError("unknown parameter")
        except ValueError as e:
            raise ValueError(f"input {url!r}: parameter {k!r}: {e}") from None
    if "max_event_bytes" not in kw:
        # the relay-wide max_event_bytes, capped by this input's batch budget
        kw["max_event_bytes"] = min(max_event_bytes or InputSpec.max_event_bytes,
                                    kw.get("max_batch_bytes", InputSpec.max_batch_bytes))
    kw.setdefault("name", f"{scheme}-{port}")
    kw.setdefault("max_held_bytes", max(DEFAULT_MAX_HELD_BYTES,
                                        4 * kw.get("max_batch_bytes", InputSpec.max_batch_bytes)))
    spec = InputSpec(scheme, host=host, port=port, mapping=MappingOptions(**mkw), **kw)
    if spec.tls and not spec.cert:
        raise ValueError(f"input {url!r}: tls is on (the default) but no cert=...; give "
                         "cert=/path/server.pem&key=/path/server.key, or tls=off")
    if not spec.tls and (spec.cert or spec.key or spec.ca):
        raise ValueError(f"input {url!r}: cert/key/ca given with tls=off")
    if spec.max_batch_bytes < spec.max_event_bytes:
        raise ValueError(f"input {url!r}: max_batch_bytes must be >= max_event_bytes")
    need = min_held_bytes(spec)
    if spec.max_held_bytes < need:
        raise ValueError(f"input {url!r}: max_held_bytes must be >= {need} bytes "
                         f"({need / 2**20:.0f} MiB: a window of max_batch_bytes and max_window "
                         "events holds about 2 x max_batch_bytes + max_window x 512 bytes), "
                         f"got {spec.max_held_bytes}")
    return spec


def min_held_bytes(spec: InputSpec) -> int:
    """The smallest ``max_held_bytes`` that holds one window of ``max_batch_bytes``
    (as :func:`logjam_relay.protocols.lumberjack_server.event_cost` charges it)."""
    from ..protocols.lumberjack_server import event_cost
    return event_cost(spec.max_batch_bytes) + spec.max_window * event_cost(0)


def parse_inputs(urls: list[str], *, max_event_bytes: int | None = None) -> list[InputSpec]:
    specs = [parse_input(u, max_event_bytes=max_event_bytes) for u in urls]
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"two inputs are named {', '.join(dup)}; add name=... to one")
    return specs


def check_settings(s: Settings) -> None:
    """The input URLs, parsed at start: a ConfigError names the setting and its source."""
    if s.inputs:
        try:
            parse_inputs(s.inputs, max_event_bytes=s.max_event_bytes)
        except ValueError as e:
            raise ConfigError(f"inputs ({s.sources.get('inputs', 'default')}): {e}") from None
