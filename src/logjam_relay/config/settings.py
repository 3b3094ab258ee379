"""The settings table: one field per setting, with default, converter, help and flags."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .convert import (
    boolean,
    choice,
    duration,
    opt_string,
    port,
    size,
    string,
    string_list,
)
from .convert import integer as _int  # short names for the rows of the table below
from .convert import number as _float
from .errors import StartupError

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
    spool_fsync_batch_delay: float = opt(0.0, duration, "spool_fsync=batch: start a sync round "
                                         "at most this often; what arrives meanwhile joins "
                                         "it (less CPU at high rates, a later median 202; "
                                         "0 = back to back, at most 100ms)",
                                         "--spool-fsync-batch-delay", metavar="DURATION")
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
    samwise_rpc_allow: list[str] = opt(["exchange.declare"], string_list, "samwise rpc "
                                       "methods clients may call (comma-separated; empty = "
                                       "none; exchange.delete only if listed)",
                                       "--samwise-rpc-allow", metavar="METHOD,...")
    outputs: list[str] = opt([], string_list, "reliable output URL (repeatable), e.g. "
                             "lumberjack://host:5044?window=1000&tls=off", "--output",
                             action="append", metavar="URL")
    output_isolation: str = opt("process", choice("inline", "process"),
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
                               "larger ones go to the dead-letter store (the default is "
                               "Filebeat's)",
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
                                 "queued dropped; a memory guard, not the event limit; "
                                 "0 = 4 x max_event_bytes",
                                 "--zmq-max-msg-bytes",
                                 metavar="SIZE")
    ingest_max_bytes: int = opt(32 * 1024**2, size, "bytes one drained ingest batch may hold "
                                "(it stops after the message that reaches this), per input "
                                "socket", "--ingest-max-bytes", metavar="SIZE")
    max_subscriptions: int = opt(10_000, _int(1, 10_000_000), "subscriptions a PUB, stats or "
                                 "CMDP socket keeps; the peer that sends one more is "
                                 "disconnected and counted", "--max-subscriptions",
                                 metavar="N")
    pub_thread: bool = opt(True, boolean, "PUB on a thread of its own: libzmq's "
                           "subscription work (a trie walk at every ended connection, a "
                           "flood's intake) stays off the event loop, for about 0.4 us more "
                           "CPU per published message; false: PUB on the event loop, for a "
                           "PUB port that no untrusted peer can reach (docs/operations.md)",
                           "--pub-thread", metavar="BOOL")
    zmq_max_peers: int = opt(0, _int(0, 1_000_000), "ZeroMQ connections each socket (ROUTER, "
                             "PULL, samwise, PUB, stats, CMDP) keeps; a new one over it is "
                             "reset before its handshake ends and counted (libzmq clients "
                             "reconnect later); bounds the memory ceiling's peer terms "
                             "(0 = no bound)", "--zmq-max-peers", metavar="N")
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

    def resolved_samwise_spool_dir(self) -> Path:
        return Path(self.samwise_spool_dir or (self.resolved_state_dir() / "samwise-spool"))

    def effective(self, name: str) -> Any:
        """The value the relay runs with: for a setting of :data:`RESOLVED` what its
        ``resolved_*`` method makes of it (an unset default filled in), else the value."""
        resolve = RESOLVED.get(name)
        return resolve(self) if resolve is not None else getattr(self, name)

    def endpoint(self, port: int) -> str:
        return f"tcp://{self.bind}:{port}"


SETTING_FIELDS = [f for f in fields(Settings) if "conv" in f.metadata]
BY_NAME = {f.name: f for f in SETTING_FIELDS}

#: settings whose unset default stands for a value derived when the relay starts: the
#: method the relay reads it through (``--check-config`` prints what it returns)
RESOLVED: dict[str, Callable[[Settings], Any]] = {
    "fqdn": Settings.resolved_fqdn,
    "state_dir": Settings.resolved_state_dir,
    "spool_dir": Settings.resolved_spool_dir,
    "dead_letter_dir": Settings.resolved_dead_letter_dir,
    "samwise_spool_dir": Settings.resolved_samwise_spool_dir,
    "zmq_max_msg_bytes": Settings.resolved_zmq_max_msg_bytes,
}
