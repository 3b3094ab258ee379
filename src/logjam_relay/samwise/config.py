"""Configuration of the samwise endpoint and its RabbitMQ brokers.

CLI wiring::

    --samwise ENDPOINT                                     (repeatable)
    --amqp-broker NAME=amqp://user:pass@host:port/vhost    (repeatable)

    cfg = SamwiseConfig.from_args(args.samwise, args.amqp_broker)

Every parser raises ``ValueError`` with a message naming the bad argument.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlsplit

from ..config import ConfigError, Settings

RPC_METHODS = ("exchange.declare", "exchange.delete")
_BROKER_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}\Z")


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    name: str
    host: str
    port: int = 5672
    user: str = "guest"
    password: str = field(default="guest", repr=False)
    vhost: str = "/"
    tls: bool = False
    heartbeat: int = 30                # seconds, negotiated with the broker
    connect_timeout: float = 5.0
    backoff_min: float = 0.1           # reconnect backoff, doubling up to backoff_max
    backoff_max: float = 5.0

    @property
    def display(self) -> str:
        """URL without the password (for logs and status)."""
        scheme = "amqps" if self.tls else "amqp"
        return f"{scheme}://{quote(self.user, safe='')}@{self.host}:{self.port}/{quote(self.vhost, safe='')}"


@dataclass(frozen=True, slots=True)
class SamwiseConfig:
    endpoints: tuple[str, ...]
    brokers: tuple[BrokerConfig, ...]
    max_inflight: int = 2000           # unconfirmed publishes per broker
    read_batch: int = 500              # spool records read at once per broker
    recv_batch: int = 500              # requests handled per wake-up of the endpoint
    rpc_timeout: float = 5.0
    publish_delay: float = 0.003       # an idle output gathers this long before publishing
    rpc_max_concurrent: int = 8        # rpc AMQP connections open at once (all brokers)
    rpc_max_queued: int = 64           # rpc requests waiting for one; more are refused
    rpc_allow: tuple[str, ...] = ("exchange.declare",)   # rpc methods clients may call
    handoff_after: float = 10.0        # a broker down this long hands its waiting messages
                                       # to brokers that are up (0 = wait for it forever)
    reader_prefix: str = "samwise."    # spool reader name = prefix + broker name

    def __post_init__(self):
        if not self.endpoints:
            raise ValueError("samwise: at least one --samwise ENDPOINT is required")
        if not self.brokers:
            raise ValueError("samwise: at least one --amqp-broker NAME=URL is required")
        names = [b.name for b in self.brokers]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"samwise: duplicate broker name(s): {', '.join(sorted(dup))}")
        if not 0 <= self.publish_delay <= 1.0:
            raise ValueError(f"samwise_publish_delay {self.publish_delay}: must be 0..1 s")
        if self.handoff_after < 0:
            raise ValueError("samwise: handoff_after must be >= 0 seconds")
        if self.max_inflight < 1 or self.read_batch < 1 or self.recv_batch < 1:
            raise ValueError("samwise: max_inflight, read_batch and recv_batch must be >= 1")
        if not 1 <= self.rpc_max_concurrent <= 1024:
            raise ValueError(f"samwise_rpc_max_concurrent {self.rpc_max_concurrent}: "
                             "must be 1..1024")
        if not 0 <= self.rpc_max_queued <= 100000:
            raise ValueError(f"samwise_rpc_max_queued {self.rpc_max_queued}: must be 0..100000")
        bad = [m for m in self.rpc_allow if m not in RPC_METHODS]
        if bad:
            raise ValueError(f"samwise_rpc_allow {', '.join(bad)}: unknown rpc method "
                             f"(known: {', '.join(RPC_METHODS)}; empty list = no rpc)")

    @classmethod
    def from_args(cls, endpoints: list[str] | None, brokers: list[str] | None,
                  **kw) -> SamwiseConfig:
        return cls(tuple(parse_endpoint(e) for e in endpoints or ()),
                   tuple(parse_broker(b) for b in brokers or ()), **kw)

    def reader_name(self, broker: str) -> str:
        return self.reader_prefix + broker

    def reader_names(self) -> list[str]:
        """The spool readers to declare: ``Spool(dir, readers=[..., *cfg.reader_names()])``."""
        return [self.reader_name(b.name) for b in self.brokers]


def parse_endpoint(arg: str) -> str:
    """``tcp://host:port`` (``*`` = all interfaces, port 0 = ephemeral) or ``ipc://path``."""
    arg = arg.strip()
    if arg.startswith("ipc://"):
        if len(arg) == len("ipc://"):
            raise ValueError(f"--samwise {arg!r}: ipc:// needs a path")
        return arg
    if arg.startswith("inproc://"):
        return arg
    if arg.startswith("tcp://"):
        hostport = arg[len("tcp://"):]
        host, sep, port = hostport.rpartition(":")
        if not sep or not host:
            raise ValueError(f"--samwise {arg!r}: expected tcp://HOST:PORT")
        if not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"--samwise {arg!r}: port must be a number 0..65535")
        return arg
    raise ValueError(f"--samwise {arg!r}: expected tcp://HOST:PORT or ipc://PATH")


def parse_broker(arg: str) -> BrokerConfig:
    """``NAME=amqp://user:pass@host:port/vhost`` (amqps:// for TLS).

    ``?password_file=PATH`` reads the password from a file (first line) instead.
    Error messages never show the password.
    """
    try:
        return _parse_broker(arg)
    except ValueError as e:
        from ..redact import redact_text
        raise ValueError(redact_text(str(e))) from None


def _parse_broker(arg: str) -> BrokerConfig:
    name, sep, url = arg.partition("=")
    name = name.strip()
    if not sep or not url:
        raise ValueError(f"--amqp-broker {arg!r}: expected NAME=amqp://user:pass@host:port/vhost")
    if not _BROKER_NAME_RE.match(name):
        raise ValueError(f"--amqp-broker {arg!r}: broker name must be 1-64 of [A-Za-z0-9_.-]")
    try:
        u = urlsplit(url.strip())
        port = u.port
    except ValueError as e:
        raise ValueError(f"--amqp-broker {name}: bad URL: {e}") from None
    if u.scheme not in ("amqp", "amqps"):
        raise ValueError(f"--amqp-broker {name}: scheme must be amqp:// or amqps://, got {u.scheme!r}")
    if not u.hostname:
        raise ValueError(f"--amqp-broker {name}: URL has no host")
    password_file = None
    if u.query:
        from urllib.parse import parse_qsl
        try:
            q = parse_qsl(u.query, keep_blank_values=True, strict_parsing=True)
        except ValueError:
            q = [("?", "")]
        if len(q) != 1 or q[0][0] != "password_file" or not q[0][1]:
            raise ValueError(f"--amqp-broker {name}: the only query parameter supported is "
                             "password_file=PATH")
        password_file = q[0][1]
    if u.fragment:
        raise ValueError(f"--amqp-broker {name}: query parameters are not supported")
    tls = u.scheme == "amqps"
    path = u.path
    vhost = "/" if path in ("", "/") else unquote(path[1:])
    if "/" in path[1:]:
        raise ValueError(f"--amqp-broker {name}: vhost must be one path segment (use %2F for '/')")
    password = unquote(u.password) if u.password is not None else "guest"
    if password_file is not None:
        if u.password is not None:
            raise ValueError(f"--amqp-broker {name}: give the password in the URL or in "
                             "password_file, not both")
        try:
            with open(password_file, encoding="utf-8") as fh:
                password = fh.readline().rstrip("\r\n")
        except OSError as e:
            raise ValueError(f"--amqp-broker {name}: password_file {password_file}: "
                             f"{e.strerror}") from None
    return BrokerConfig(
        name=name, host=u.hostname, port=port or (5671 if tls else 5672),
        user=unquote(u.username) if u.username is not None else "guest",
        password=password,
        vhost=vhost, tls=tls,
    )


def check_settings(s: Settings) -> None:
    """The samwise settings, checked at start: the rpc methods clients may call (checked
    whether samwise is on or not), the endpoints and the brokers.  A ConfigError names the
    setting and its source."""
    for m in s.samwise_rpc_allow:
        if m not in RPC_METHODS:
            src = s.sources.get("samwise_rpc_allow", "default")
            raise ConfigError(f"samwise_rpc_allow ({src}): unknown rpc method {m!r} "
                              f"(known: {', '.join(RPC_METHODS)})")
    if s.samwise or s.amqp_brokers:
        try:
            SamwiseConfig.from_args(s.samwise, s.amqp_brokers)
        except ValueError as e:
            name = "samwise" if str(e).startswith("--samwise") else "amqp_brokers"
            raise ConfigError(f"samwise/amqp_brokers: {name} ({s.source_label(name)}): "
                              f"{e}") from None
