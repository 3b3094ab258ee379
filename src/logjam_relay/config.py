"""One configuration: defaults < TOML file < environment < command line.

Every setting has one canonical flat name (``spool_max_bytes``).  It is written

* in TOML either flat (``spool_max_bytes = "10GiB"``) or in a table
  (``[spool]`` / ``max_bytes = "10GiB"``),
* in the environment as ``LOGJAM_RELAY_SPOOL_MAX_BYTES`` (logjam-device's
  ``LOGJAM_RCV_HWM`` and ``LOGJAM_SND_HWM`` are honoured too),
* on the command line as ``--spool-max-bytes`` (plus logjam-device's short
  flags, e.g. ``-d 7``).

Values are validated at start; an error names the setting and where it came
from, e.g. ``spool_policy (LOGJAM_RELAY_SPOOL_POLICY): must be one of block,
drop_oldest, got 'keep'``.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A setting is invalid; the message names it and where it came from."""


class StartupError(Exception):
    """Something start-up needs cannot be had (a port, a directory, a file, a lock).

    Its text is the one line the command prints before it exits with status 2:
    ``pull_port 9605 (default): address already in use (is logjam-device still running?)``
    -- the setting, its value, where the value came from and the likely cause.
    """

    def __init__(self, setting: str, value: Any, source: str, cause: str):
        self.setting, self.value, self.source, self.cause = setting, value, source, cause
        super().__init__(f"{setting} {value} ({source}): {cause}")


def find_exception(exc: BaseException, kinds) -> BaseException | None:
    """The first exception of ``kinds`` in ``exc`` or inside its (nested) exception groups
    (trio wraps what a task raised in an ExceptionGroup)."""
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = find_exception(sub, kinds)
            if found is not None:
                return found
        return None
    return exc if isinstance(exc, kinds) else None


# ----------------------------------------------------------------- converters

def _int(lo: int | None = None, hi: int | None = None) -> Callable[[Any], int]:
    def conv(v: Any) -> int:
        if isinstance(v, bool):
            raise ValueError(f"expected an integer, got {v!r}")
        try:
            n = int(v, 0) if isinstance(v, str) else int(v)
        except (TypeError, ValueError):
            raise ValueError(f"expected an integer, got {v!r}") from None
        if isinstance(v, float) and v != n:
            raise ValueError(f"expected an integer, got {v!r}")
        if lo is not None and n < lo:
            raise ValueError(f"must be >= {lo}, got {n}")
        if hi is not None and n > hi:
            raise ValueError(f"must be <= {hi}, got {n}")
        return n
    return conv


def port(v: Any) -> int:
    return _int(0, 65535)(v)


def _float(lo: float = 0.0) -> Callable[[Any], float]:
    def conv(v: Any) -> float:
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {v!r}") from None
        if x < lo:
            raise ValueError(f"must be >= {lo}, got {x}")
        return x
    return conv


def boolean(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true/false, got {v!r}")


def choice(*options: str | None) -> Callable[[Any], str | None]:
    def conv(v: Any) -> str | None:
        if v is None or (isinstance(v, str) and v.lower() in ("", "none", "off")
                         and None in options):
            return None
        s = str(v).lower()
        if s not in options:
            names = ", ".join(o for o in options if o is not None)
            raise ValueError(f"must be one of {names}, got {v!r}")
        return s
    return conv


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.I)
_SIZE_MULT = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
              "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
              "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
              "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4}


def size(v: Any) -> int:
    """Bytes: 1048576, "64MiB", "10GB"."""
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    m = _SIZE.match(str(v))
    if not m:
        raise ValueError(f"expected a size like 512MiB or 10GB, got {v!r}")
    return int(float(m.group(1)) * _SIZE_MULT[(m.group(2) or "").lower()])


_DUR = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.I)
_DUR_MULT = {"ms": 0.001, "s": 1, "": 1, "m": 60, "h": 3600, "d": 86400}


def duration(v: Any) -> float:
    """Seconds: 5, 2.5, "250ms", "10m", "7d"."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
        return float(v)
    m = _DUR.match(str(v))
    if not m:
        raise ValueError(f"expected a duration like 250ms, 10s, 10m or 7d, got {v!r}")
    return float(m.group(1)) * _DUR_MULT[(m.group(2) or "").lower()]


def string(v: Any) -> str:
    if not isinstance(v, (str, int, float)) or isinstance(v, bool):
        raise ValueError(f"expected a string, got {v!r}")
    return str(v)


def opt_string(v: Any) -> str | None:
    return None if v is None or v == "" else string(v)


def string_list(v: Any) -> list[str]:
    if isinstance(v, str):
        return [s for s in (x.strip() for x in v.split(",")) if s] if "://" not in v else [v]
    if isinstance(v, (list, tuple)):
        return [string(x) for x in v]
    raise ValueError(f"expected a list of strings, got {v!r}")


def rpc_methods(v: Any) -> list[str]:
    """samwise rpc method names (``exchange.declare``, ``exchange.delete``)."""
    from .samwise.config import RPC_METHODS
    items = [] if v in ("", None) else string_list(v)
    for m in items:
        if m not in RPC_METHODS:
            raise ValueError(f"unknown rpc method {m!r} (known: {', '.join(RPC_METHODS)})")
    return items


# ------------------------------------------------------------------- settings

def _default_state_dir() -> str:
    # systemd's StateDirectory= sets STATE_DIRECTORY; otherwise XDG.
    if os.environ.get("STATE_DIRECTORY"):
        return os.environ["STATE_DIRECTORY"].split(":")[0]
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                             "state")
    return os.path.join(base, "logjam-relay")


def default_fqdn() -> str:
    """What logjam-device uses: getaddrinfo(gethostname(), AI_CANONNAME)."""
    host = socket.gethostname()
    try:
        info = socket.getaddrinfo(host, None, flags=socket.AI_CANONNAME)
        if info and info[0][3]:
            return info[0][3]
    except OSError:
        pass
    return host


def opt(default: Any, conv: Callable[[Any], Any], help: str, *flags: str,
        env: tuple[str, ...] = (), action: str | None = None, metavar: str | None = None):
    return field(default_factory=(lambda: list(default)) if isinstance(default, list)
                 else (lambda: default),
                 metadata={"conv": conv, "help": help, "flags": flags, "env": env,
                           "action": action, "metavar": metavar})


@dataclass
class Settings:
    # --- logjam-device compatible -------------------------------------------------
    device_id: int = opt(0, _int(0, 2**32 - 1), "device number stamped into every message",
                         "-d", "--device-id", metavar="N")
    io_threads: int = opt(1, _int(1, 64), "ZeroMQ I/O threads", "-i", "--io-threads",
                          metavar="N")
    pull_port: int = opt(9605, port, "PULL port for PUSH clients (0 = off)", "-p",
                         "--input-port", "--pull-port", metavar="N")
    router_port: int = opt(9604, port, "ROUTER port for DEALER clients (0 = off)", "-t",
                           "--router-port", metavar="N")
    pub_port: int = opt(9606, port, "PUB port the stamped stream is published on", "-P",
                        "--output-port", "--pub-port", metavar="N")
    stats_port: int = opt(9621, port, "PUB port for [stats, device, seq] every second (0 = off)",
                          "-s", "--stats-port", metavar="N")
    compress: str | None = opt(None, choice(None, "zlib", "snappy", "lz4"),
                               "compress uncompressed bodies with zlib|snappy|lz4", "-x",
                               "--compress", metavar="METHOD")
    compressors: int = opt(4, _int(1, 64), "compressor worker threads", "-C", "--compressors",
                           metavar="N")
    rcv_hwm: int = opt(100_000, _int(0), "receive high-water mark of the input sockets", "-R",
                       "--rcv-hwm", env=("LOGJAM_RCV_HWM",), metavar="N")
    snd_hwm: int = opt(1_000_000, _int(0), "send high-water mark of the PUB socket", "-S",
                       "--snd-hwm", env=("LOGJAM_SND_HWM",), metavar="N")
    metrics_port: int = opt(8082, port, "HTTP port for /metrics, /healthz, /readyz (0 = off)",
                            "-m", "--metrics-port", metavar="N")
    metrics_ip: str = opt("0.0.0.0", string, "address the metrics endpoint binds to", "-M",
                          "--metrics-ip", metavar="IP")
    metrics_max_connections: int = opt(64, _int(1, 100_000),
                                       "open connections the metrics endpoint keeps; at the "
                                       "cap the oldest one still sending its request is closed",
                                       "--metrics-max-connections", metavar="N")
    metrics_header_timeout: float = opt(5.0, duration, "time a client has to send its whole "
                                        "request to the metrics endpoint",
                                        "--metrics-header-timeout", metavar="DURATION")
    web_config_file: str | None = opt(None, opt_string, "TLS and basic auth for the metrics "
                                      "endpoint, Prometheus exporter-toolkit format "
                                      "(docs/security.md)", "--web.config.file",
                                      "--web-config-file", metavar="FILE")
    allow_invalid_meta: bool = opt(False, boolean,
                                   "accept messages whose meta frame is broken (fresh meta)",
                                   "-A", "--allow-invalid-meta", action="store_true")
    quiet: bool = opt(False, boolean, "log warnings and errors only", "-q", "--quiet",
                      action="store_true")
    verbose: int = opt(0, _int(0, 2), "log more (-vv for debug)", "-v", "--verbose",
                       action="count")
    trim_frequency: int = opt(0, _int(0), "accepted for logjam-device compatibility; no effect",
                              "-T", "--trim-frequency", metavar="N")
    # --- relay ---------------------------------------------------------------------
    bind: str = opt("*", string, "interface the ZeroMQ sockets bind to (* = all)", "--bind",
                    metavar="ADDR")
    fqdn: str | None = opt(None, opt_string,
                           "host name announced in heartbeats and pongs (default: canonical "
                           "name of this host, as logjam-device)", "--fqdn", metavar="NAME")
    state_dir: str = opt(None, opt_string, "directory for the sequence state file "
                         "(default: $STATE_DIRECTORY or ~/.local/state/logjam-relay)",
                         "--state-dir", metavar="DIR")
    heartbeat_interval: float = opt(5.0, _float(0.01), "seconds between heartbeats",
                                    "--heartbeat-interval", metavar="SECONDS")
    stats_interval: float = opt(1.0, _float(0.01), "seconds between stats messages",
                                "--stats-interval", metavar="SECONDS")
    batch_size: int = opt(1024, _int(1, 100_000), "messages drained per wake-up",
                          "--batch-size", metavar="N")
    shutdown_timeout: float = opt(1.5, _float(0.0), "seconds to flush on SIGTERM",
                                  "--shutdown-timeout", metavar="SECONDS")
    ready_output_down_after: float = opt(60.0, duration,
                                         "/readyz fails while an output has not been "
                                         "connected for this long (0 = outputs never make "
                                         "the relay unready)", "--ready-output-down-after",
                                         metavar="DURATION")
    log_format: str = opt("text", choice("text", "json"), "log line format", "--log-format",
                          metavar="text|json")
    # --- spool and outputs ---------------------------------------------------------------
    spool_dir: str | None = opt(None, opt_string,
                                "spool directory (default: <state_dir>/spool when an output "
                                "is configured)", "--spool-dir", metavar="DIR")
    spool_max_bytes: int = opt(10 * 1024**3, size, "disk budget of the spool", "--spool-max-bytes",
                               metavar="SIZE")
    spool_policy: str = opt("block", choice("block", "drop_oldest"),
                            "what to do when the spool is full", "--spool-policy",
                            metavar="block|drop_oldest")
    spool_fsync: str = opt("interval", choice("batch", "interval", "never"),
                           "when the spool calls fsync", "--spool-fsync",
                           metavar="batch|interval|never")
    spool_fsync_interval: float = opt(1.0, duration, "fsync interval for spool_fsync=interval",
                                      "--spool-fsync-interval", metavar="DURATION")
    spool_segment_bytes: int = opt(64 * 1024**2, size, "segment size before it is sealed",
                                   "--spool-segment-bytes", metavar="SIZE")
    archive_dir: str | None = opt(None, opt_string,
                                  "hand sealed spool segments to this directory (for Spark)",
                                  "--archive-dir", metavar="DIR")
    archive_retention: float = opt(7 * 86400.0, duration,
                                   "delete archived segments older than this",
                                   "--archive-retention", metavar="DURATION")
    archive_seal_after: float = opt(300.0, duration,
                                    "seal (and archive) an open segment older than this",
                                    "--archive-seal-after", metavar="DURATION")
    cmdp_port: int = opt(0, port, "CMDP XPUB port for STAT/LOG topics (0 = off; CHIRP "
                         "discovery runs whenever CMDP is on)", "--cmdp-port", metavar="N")
    cmdp_name: str | None = opt(None, opt_string, "CMDP sender name (default "
                                "LogjamRelay.<short hostname>)", "--cmdp-name", metavar="NAME")
    chirp_group: str = opt("logjam", string, "CHIRP group", "--chirp-group", metavar="GROUP")
    chirp_interface: str | None = opt(None, opt_string, "interface address for CHIRP multicast "
                                      "(default: all)", "--chirp-interface", metavar="IFACE")
    samwise: list[str] = opt([], string_list, "samwise (samd-compatible) endpoint, repeatable, "
                             "e.g. tcp://*:9610 or ipc:///run/samwise.sock", "--samwise",
                             action="append", metavar="ENDPOINT")
    amqp_brokers: list[str] = opt([], string_list, "RabbitMQ broker for samwise, repeatable: "
                                  "NAME=amqp://user:pass@host:5672/vhost", "--amqp-broker",
                                  action="append", metavar="NAME=URL")
    amqp_brokers_file: str | None = opt(None, opt_string, "file with more amqp_brokers, one "
                                        "NAME=URL a line (# comments); keeps passwords off the "
                                        "command line", "--amqp-brokers-file", metavar="FILE")
    samwise_spool_dir: str | None = opt(None, opt_string, "spool of accepted samwise requests "
                                        "(default <state_dir>/samwise-spool)",
                                        "--samwise-spool-dir", metavar="DIR")
    samwise_handoff_after: float = opt(10.0, duration, "a broker down this long hands the "
                                       "messages waiting for it to brokers that are up "
                                       "(0 = wait for it)", "--samwise-handoff-after",
                                       metavar="DURATION")
    samwise_publish_delay: float = opt(0.003, duration, "an idle samwise broker output waits "
                                       "this long after new requests arrive, to publish them "
                                       "as one batch (0 = publish each at once)",
                                       "--samwise-publish-delay", metavar="DURATION")
    samwise_rpc_max_concurrent: int = opt(8, _int(1, 1024), "samwise rpc: AMQP connections "
                                          "open at once for rpc calls (all brokers)",
                                          "--samwise-rpc-max-concurrent", metavar="N")
    samwise_rpc_max_queued: int = opt(64, _int(0, 100_000), "samwise rpc: requests waiting "
                                      "for a connection; more are answered 'too many rpc "
                                      "requests'", "--samwise-rpc-max-queued", metavar="N")
    samwise_rpc_allow: list[str] = opt(["exchange.declare"], rpc_methods, "samwise rpc "
                                       "methods clients may call (comma-separated; empty = "
                                       "none; exchange.delete only if listed)",
                                       "--samwise-rpc-allow", metavar="METHOD,...")
    outputs: list[str] = opt([], string_list, "reliable output URL (repeatable), e.g. "
                             "lumberjack://host:5044?window=1000&tls=off", "--output",
                             action="append", metavar="URL")
    output_isolation: str = opt("inline", choice("inline", "process"),
                                "where outputs run: inline (in the relay's event loop) or "
                                "process (each in a worker process fed from the spool, off "
                                "the ingest thread)", "--output-isolation",
                                metavar="inline|process")
    inputs: list[str] = opt([], string_list, "Lumberjack/Courier input URL (repeatable), e.g. "
                            "lumberjack://0.0.0.0:5044?cert=...&key=... or "
                            "courier://0.0.0.0:5043?tls=off (docs/inputs.md)", "--input",
                            action="append", metavar="URL")
    curve_secret_key: str | None = opt(None, opt_string, "ZeroMQ CURVE: the relay's secret "
                                       "key file (logjam-relay keygen); turns CURVE on for "
                                       "curve_sockets (docs/security.md)", "--curve-secret-key",
                                       metavar="FILE")
    curve_allow_dir: str | None = opt(None, opt_string, "directory of the client public keys "
                                      "allowed to connect (re-read when it changes)",
                                      "--curve-allow-dir", metavar="DIR")
    curve_sockets: list[str] = opt(["router", "pull", "pub", "stats"], string_list,
                                   "sockets that require CURVE when curve_secret_key is set",
                                   "--curve-sockets", metavar="router,pull,pub,stats")
    curve_plain_endpoints: list[str] = opt([], string_list, "plain (non-CURVE) endpoint beside "
                                           "a secure socket for agents without CURVE, "
                                           "repeatable: SOCKET=tcp://ADDR:PORT",
                                           "--curve-plain-endpoint", action="append",
                                           metavar="SOCKET=ENDPOINT")
    max_event_bytes: int = opt(10 * 1024**2, size,
                               "largest event (decompressed body) an output inflates or sends; "
                               "larger ones go to the dead-letter store (Filebeat's default)",
                               "--max-event-bytes", metavar="SIZE")
    dead_letter_dir: str | None = opt(None, opt_string,
                                      "dead-letter store of undeliverable events (default "
                                      "<state_dir>/dead-letters)", "--dead-letter-dir",
                                      metavar="DIR")
    dead_letter_max_bytes: int = opt(1024**3, size, "disk budget of the dead-letter store "
                                     "(oldest dropped, and counted, when full)",
                                     "--dead-letter-max-bytes", metavar="SIZE")
    # --- ingress memory bounds (docs/operations.md, "Memory") ----------------------------
    zmq_max_msg_bytes: int = opt(0, size, "ZeroMQ MAXMSGSIZE of the input sockets: a peer "
                                 "sending a larger frame is disconnected and what it had "
                                 "queued dropped; a memory guard, not the event limit "
                                 "(0 = 4 x max_event_bytes)", "--zmq-max-msg-bytes",
                                 metavar="SIZE")
    ingest_max_bytes: int = opt(32 * 1024**2, size, "bytes one drained ingest batch may hold "
                                "(it stops after the message that reaches this), per input "
                                "socket", "--ingest-max-bytes", metavar="SIZE")
    max_subscriptions: int = opt(10_000, _int(1, 10_000_000), "subscriptions a PUB, stats or "
                                 "CMDP socket keeps; the peer that sends one more is "
                                 "disconnected and counted", "--max-subscriptions",
                                 metavar="N")
    # --- bookkeeping (not settings) -------------------------------------------------------
    sources: dict[str, str] = field(default_factory=dict, repr=False)

    # ----------------------------------------------------------------------- derived
    def source_label(self, name: str) -> str:
        """Where a setting's value came from: default, file PATH, env NAME or flag --NAME."""
        src = self.sources.get(name)
        if src is None:
            return "default"
        if src.startswith("-"):
            return f"flag {src}"
        if src.startswith("LOGJAM_"):
            return f"env {src}"
        return f"file {src}"

    def startup_error(self, name: str, cause: str, value: Any = None) -> StartupError:
        """A :class:`StartupError` for setting ``name`` (its value unless ``value`` is given)."""
        if value is None:
            value = getattr(self, name)
            if name == "state_dir":
                value = self.resolved_state_dir()
            elif name == "spool_dir":
                value = self.resolved_spool_dir()
        return StartupError(name, value, self.source_label(name), cause)

    def resolved_fqdn(self) -> str:
        return self.fqdn or default_fqdn()

    def resolved_state_dir(self) -> Path:
        return Path(self.state_dir or _default_state_dir())

    def resolved_spool_dir(self) -> Path | None:
        if self.spool_dir:
            return Path(self.spool_dir)
        if self.outputs or self.archive_dir or self.inputs:
            return self.resolved_state_dir() / "spool"
        return None

    def resolved_zmq_max_msg_bytes(self) -> int:
        """MAXMSGSIZE of the ZeroMQ inputs: the setting, or 4 x max_event_bytes."""
        return self.zmq_max_msg_bytes or 4 * self.max_event_bytes

    def resolved_dead_letter_dir(self) -> Path:
        return Path(self.dead_letter_dir or (self.resolved_state_dir() / "dead-letters"))

    def endpoint(self, port: int) -> str:
        return f"tcp://{self.bind}:{port}"


SETTING_FIELDS = [f for f in fields(Settings) if "conv" in f.metadata]
_BY_NAME = {f.name: f for f in SETTING_FIELDS}

# LOGJAM_RELAY_* variables that are legitimately not settings (read elsewhere); any other
# LOGJAM_RELAY_* name is a misspelt setting and stops start-up like an unknown TOML key.
NON_SETTING_ENV = frozenset({"LOGJAM_RELAY_CONFIG", "LOGJAM_RELAY_PURE_PYTHON"})
NON_SETTING_ENV_PREFIX = "LOGJAM_RELAY_TEST_"   # the test suite's own knobs


def _did_you_mean(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _check_unknown_env(environ: Mapping[str, str]) -> None:
    known = {e for f in SETTING_FIELDS for e in _env_names(f)} | NON_SETTING_ENV
    for name in sorted(environ):
        if (name.startswith("LOGJAM_RELAY_") and name not in known
                and not name.startswith(NON_SETTING_ENV_PREFIX)):
            # compare what follows the prefix, which every candidate shares
            tails = {k[13:]: k for k in known if k.startswith("LOGJAM_RELAY_")}
            close = difflib.get_close_matches(name[13:], list(tails), n=1, cutoff=0.6)
            hint = f" (did you mean {tails[close[0]]}?)" if close else ""
            raise ConfigError(f"{name} (environment): unknown setting{hint}")


def _env_names(f) -> tuple[str, ...]:
    return ("LOGJAM_RELAY_" + f.name.upper(),) + f.metadata["env"]


def _flatten_toml(data: Mapping[str, Any], path: str, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        name = f"{prefix}{k}".replace("-", "_")
        if isinstance(v, dict):
            out.update(_flatten_toml(v, path, name + "_"))
        else:
            out[name] = v
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every setting's flags to ``parser`` (defaults suppressed: only given flags count)."""
    parser.add_argument("-c", "--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="TOML configuration file (also LOGJAM_RELAY_CONFIG)")
    from .helptext import display_value
    for f in SETTING_FIELDS:
        md = f.metadata
        text = md["help"]
        if "default" not in text:       # some texts already say what the default resolves to
            text += f" (default: {display_value(f.name, f.default_factory())})"
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS,
                              "help": text.replace("%", "%%")}
        if md["action"]:
            kw["action"] = md["action"]
        if md["metavar"]:
            kw["metavar"] = md["metavar"]
        parser.add_argument(*md["flags"], **kw)


def load(args: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
         config_file: str | os.PathLike | None = None) -> Settings:
    """Build validated :class:`Settings` from command-line values, environment and TOML."""
    environ = os.environ if environ is None else environ
    args = dict(args or {})
    raw: dict[str, tuple[Any, str]] = {}

    path = args.pop("config", None) or config_file or environ.get("LOGJAM_RELAY_CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: {e}") from None
        for name, v in _flatten_toml(data, str(path)).items():
            if name not in _BY_NAME:
                raise ConfigError(f"{name} ({path}): unknown setting"
                                  f"{_did_you_mean(name, _BY_NAME)}")
            raw[name] = (v, str(path))

    for f in SETTING_FIELDS:
        for env in _env_names(f):
            if env in environ:
                raw[f.name] = (environ[env], env)
                break
    _check_unknown_env(environ)

    for name, v in args.items():
        if name in _BY_NAME and v is not None:
            flag = _BY_NAME[name].metadata["flags"][-1]
            raw[name] = (v, flag)

    s = Settings()
    for name, (v, src) in raw.items():
        conv = _BY_NAME[name].metadata["conv"]
        try:
            value = conv(v)
        except ValueError as e:
            raise ConfigError(f"{name} ({src}): {e}") from None
        setattr(s, name, value)
        s.sources[name] = src
    _read_brokers_file(s)
    _check(s)
    return s


def _check_curve(s: Settings) -> None:
    from .io import curve
    src = s.sources.get
    if not s.curve_secret_key:
        name = "curve_allow_dir" if s.curve_allow_dir else "curve_plain_endpoints"
        raise ConfigError(f"{name} ({src(name, 'default')}): needs curve_secret_key")
    if not s.curve_allow_dir:
        raise ConfigError("curve_allow_dir (default): required with curve_secret_key (the "
                          "client public keys allowed to connect)")
    if not os.path.isdir(s.curve_allow_dir):
        raise ConfigError(f"curve_allow_dir ({src('curve_allow_dir', 'default')}): "
                          f"{s.curve_allow_dir} is not a directory")
    try:
        curve.load_secret_key(s.curve_secret_key)
    except curve.CurveKeyError as e:
        raise ConfigError(f"curve_secret_key ({src('curve_secret_key', 'default')}): {e}") \
            from None
    bad = [x for x in s.curve_sockets if x not in curve.SOCKETS]
    if bad:
        raise ConfigError(f"curve_sockets ({src('curve_sockets', 'default')}): unknown "
                          f"socket(s) {', '.join(bad)}; one of {', '.join(curve.SOCKETS)}")
    try:
        plain = curve.parse_plain_endpoints(s.curve_plain_endpoints)
    except ValueError as e:
        raise ConfigError(f"curve_plain_endpoints ({src('curve_plain_endpoints', 'default')})"
                          f": {e}") from None
    for name in plain:
        if name not in s.curve_sockets:
            raise ConfigError(f"curve_plain_endpoints ({src('curve_plain_endpoints')}): "
                              f"{name} is not in curve_sockets (it is plain already)")


def _read_brokers_file(s: Settings) -> None:
    """Append the brokers of ``amqp_brokers_file`` (one NAME=URL a line) to amqp_brokers."""
    if not s.amqp_brokers_file:
        return
    src = s.sources.get("amqp_brokers_file", "default")
    try:
        with open(s.amqp_brokers_file, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as e:
        raise ConfigError(f"amqp_brokers_file ({src}): {s.amqp_brokers_file}: "
                          f"{e.strerror}") from None
    s.amqp_brokers = list(s.amqp_brokers) + [ln.strip() for ln in lines
                                              if ln.strip() and not ln.lstrip().startswith("#")]
    if "amqp_brokers" not in s.sources:     # all of them from the file: name it as the source
        s.sources["amqp_brokers"] = s.amqp_brokers_file


def _check(s: Settings) -> None:
    ports = {n: getattr(s, n) for n in ("pull_port", "router_port", "pub_port", "stats_port",
                                        "metrics_port", "cmdp_port")}
    seen: dict[int, str] = {}
    for name, p in ports.items():
        if p and p in seen:
            raise ConfigError(f"{name} ({s.sources.get(name, 'default')}): port {p} is already "
                              f"used by {seen[p]}")
        if p:
            seen[p] = name
    if not s.pub_port:
        raise ConfigError("pub_port: the PUB port cannot be off")
    if s.spool_max_bytes < 4 * 4096:        # the spool needs room for 4 segments
        raise ConfigError(f"spool_max_bytes ({s.sources.get('spool_max_bytes', 'default')}): "
                          f"must be >= 16KiB, got {s.spool_max_bytes}")
    if not 1024 <= s.max_event_bytes <= 1024**3:
        raise ConfigError(f"max_event_bytes ({s.sources.get('max_event_bytes', 'default')}): "
                          f"must be between 1KiB and 1GiB, got {s.max_event_bytes}")
    if s.dead_letter_max_bytes < s.max_event_bytes:
        src = s.sources.get("dead_letter_max_bytes", "default")
        raise ConfigError(f"dead_letter_max_bytes ({src}): "
                          f"must be >= max_event_bytes ({s.max_event_bytes}), "
                          f"got {s.dead_letter_max_bytes}")
    if s.zmq_max_msg_bytes and s.zmq_max_msg_bytes <= s.max_event_bytes:
        raise ConfigError(f"zmq_max_msg_bytes ({s.source_label('zmq_max_msg_bytes')}): must be "
                          f"> max_event_bytes ({s.max_event_bytes}) -- it disconnects the "
                          f"peer, so it is a memory guard above the event limit, got "
                          f"{s.zmq_max_msg_bytes}")
    if s.ingest_max_bytes < 64 * 1024:
        raise ConfigError(f"ingest_max_bytes ({s.source_label('ingest_max_bytes')}): must be "
                          f">= 64KiB, got {s.ingest_max_bytes}")
    if not s.pull_port and not s.router_port:
        raise ConfigError("pull_port/router_port: at least one input port must be on")
    if s.samwise or s.amqp_brokers:
        from .samwise.config import SamwiseConfig
        try:
            SamwiseConfig.from_args(s.samwise, s.amqp_brokers)
        except ValueError as e:
            name = "samwise" if str(e).startswith("--samwise") else "amqp_brokers"
            raise ConfigError(f"samwise/amqp_brokers: {name} ({s.source_label(name)}): "
                              f"{e}") from None
    if s.outputs:
        from .outputs.supervisor import parse_outputs
        try:
            parse_outputs(s.outputs)
        except ValueError as e:
            raise ConfigError(f"outputs ({s.sources.get('outputs', 'default')}): {e}") from None
    if s.curve_secret_key or s.curve_allow_dir or s.curve_plain_endpoints:
        _check_curve(s)
    if s.web_config_file:
        from .health.webconfig import WebConfigError
        from .health.webconfig import load as load_web_config
        try:
            load_web_config(s.web_config_file)
        except WebConfigError as e:
            raise ConfigError(f"web_config_file ({s.sources.get('web_config_file', 'default')})"
                              f": {e}") from None
    if s.inputs:
        from .inputs import parse_inputs
        try:
            parse_inputs(s.inputs, max_event_bytes=s.max_event_bytes)
        except ValueError as e:
            raise ConfigError(f"inputs ({s.sources.get('inputs', 'default')}): {e}") from None
