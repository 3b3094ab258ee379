"""ZeroMQ CURVE on the relay's sockets, with a ZAP handler on trio and an allow-list directory.

* The relay's key pair comes from ``curve_secret_key``: a file as ``logjam-relay keygen`` /
  ``zmq.auth.create_certificates`` writes it (``*.key_secret``, ZPL text with
  ``secret-key = "..."``) or a file holding just the 40-character Z85 secret key.
* Clients are allowed when their public key is in a file of ``curve_allow_dir`` (``*.key``
  files as keygen writes them, or files with the bare Z85 public key).  The directory is
  read again when it changes (checked at every handshake, at most once per second when it
  does not), so removing a file refuses that key's next connection; connections already
  open stay until they close (ZAP runs at the handshake only).
* The ZAP handler is io/peers.py's ``ZapServer``, a ROUTER bound to
  ``inproc://zeromq.zap.01`` in the relay's context before any relay socket is bound
  (libzmq accepts every CURVE client while no handler is bound, so the order matters),
  served by a trio task; it bounds the peers of every socket first, then calls
  :meth:`Curve.handle` for the CURVE endpoints.  Refused clients are counted by reason and
  logged rate-limited.
* ``curve_plain_endpoints``: a socket may also listen on a plain endpoint (NULL mechanism,
  no ZAP) for agents that do not speak CURVE: libzmq copies the options into each listener
  at bind time, so the secure endpoint is bound with CURVE on, then CURVE is switched off
  and the plain one bound on the same socket.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from pathlib import Path

import zmq
import zmq.utils.z85

from ..config import ConfigError, Settings
from ..ratelimit import RateLimitedLog

log = logging.getLogger("logjam_relay.curve")
DOMAIN = b"logjam"
PLAIN_DOMAIN = b"logjam-plain"
MIN_MAXMSGSIZE = 1024
SOCKETS = ("router", "pull", "pub", "stats")
_SETTING_TO_NAME = {"router_port": "router", "pull_port": "pull", "pub_port": "pub",
                    "stats_port": "stats"}


class CurveKeyError(ValueError):
    pass


def _read_key(path: str, kind: str) -> bytes:
    """The Z85 ``kind`` ("public" or "secret") key of a ZPL certificate or a bare-key file."""
    try:
        text = Path(path).read_text(encoding="ascii", errors="replace")
    except OSError as e:
        raise CurveKeyError(f"{path}: {e.strerror}") from None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(f"{kind}-key") and "=" in line:
            key = line.split("=", 1)[1].strip().strip('"').strip("'")
            if len(key) == 40:
                return key.encode()
    stripped = text.strip()
    if len(stripped) == 40:            # a bare Z85 key
        return stripped.encode()
    raise CurveKeyError(f"{path}: no Z85 {kind} key (40 characters) found")


def load_secret_key(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from the relay's key file."""
    secret = _read_key(path, "secret")
    try:
        public = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError) as e:
        raise CurveKeyError(f"{path}: not a valid CURVE secret key ({e})") from None
    return public, secret


def parse_plain_endpoints(items: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, ep = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in SOCKETS or not ep.strip().startswith(("tcp://", "ipc://")):
            raise ValueError(f"{item!r}: expected SOCKET=tcp://ADDR:PORT with SOCKET one of "
                             f"{', '.join(SOCKETS)}")
        out.setdefault(name, []).append(ep.strip())
    return out


def check_settings(s: Settings) -> None:
    """The CURVE settings, checked at start: a ConfigError names the setting and its source."""
    if not (s.curve_secret_key or s.curve_allow_dir or s.curve_plain_endpoints):
        return
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
        load_secret_key(s.curve_secret_key)
    except CurveKeyError as e:
        raise ConfigError(f"curve_secret_key ({src('curve_secret_key', 'default')}): {e}") \
            from None
    bad = [x for x in s.curve_sockets if x not in SOCKETS]
    if bad:
        raise ConfigError(f"curve_sockets ({src('curve_sockets', 'default')}): unknown "
                          f"socket(s) {', '.join(bad)}; one of {', '.join(SOCKETS)}")
    try:
        plain = parse_plain_endpoints(s.curve_plain_endpoints)
    except ValueError as e:
        raise ConfigError(f"curve_plain_endpoints ({src('curve_plain_endpoints', 'default')})"
                          f": {e}") from None
    for name in plain:
        if name not in s.curve_sockets:
            raise ConfigError(f"curve_plain_endpoints ({src('curve_plain_endpoints')}): "
                              f"{name} is not in curve_sockets (it is plain already)")


def keygen(directory: str, name: str, *, force: bool = False) -> tuple[str, str]:
    """Write ``name.key`` (public, for the peers' allow-lists) and ``name.key_secret`` (0600).
    An existing pair is kept (``FileExistsError``) unless ``force``: replacing the relay's
    key locks out every client that has its public key."""
    import zmq.auth
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"key name {name!r}: a file name stem, without '/'")
    for suffix in (".key", ".key_secret"):
        path = os.path.join(directory, name + suffix)
        if not force and os.path.lexists(path):
            raise FileExistsError(f"{path} exists (--force replaces the key pair; every "
                                  "peer that has the old public key is then refused)")
    os.makedirs(directory, exist_ok=True)
    old = os.umask(0o077)
    try:
        pub, sec = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(sec, 0o600)
    os.chmod(pub, 0o644)
    return pub, sec


class AllowList:
    """Public keys of the files in a directory, re-read when the directory changes."""

    def __init__(self, directory: str, clock=time.monotonic):
        self.directory = directory
        self._clock = clock
        self._mtime = None
        self._checked = -1e9
        self.keys: set[bytes] = set()
        self.bad_files = 0
        self.reload()

    def reload(self) -> None:
        keys = set()
        bad = 0
        try:
            names = sorted(os.listdir(self.directory))
        except OSError as e:
            log.error("curve_allow_dir %s: %s; no client is allowed", self.directory,
                      e.strerror)
            names = []
        for n in names:
            p = os.path.join(self.directory, n)
            if n.startswith(".") or n.endswith(".key_secret") or not os.path.isfile(p):
                continue
            try:
                keys.add(_read_key(p, "public"))
            except CurveKeyError as e:
                bad += 1
                log.warning("curve_allow_dir: ignoring %s", e)
        self.keys = keys
        self.bad_files = bad

    def check(self) -> None:
        now = self._clock()
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except OSError:
            mtime = None
        if mtime != self._mtime or now - self._checked >= 1.0:
            self._mtime = mtime
            self._checked = now
            self.reload()

    def __contains__(self, key: bytes) -> bool:
        self.check()
        return key in self.keys


class Curve:
    """The relay's CURVE setup: server options per socket, plain endpoints, ZAP handler."""

    def __init__(self, secret_key_file: str, allow_dir: str, sockets: list[str],
                 plain: dict[str, list[str]]):
        self.public, self.secret = load_secret_key(secret_key_file)
        self.allow = AllowList(allow_dir)
        self.sockets = set(sockets)
        self.plain = plain
        self.zap: zmq.Socket | None = None
        self.accepted = 0
        self.plain_accepted = 0             # connections on the plain endpoints
        self.refused: Counter[str] = Counter()
        self.plain_endpoints: dict[str, list[str]] = {}
        self._rlog = RateLimitedLog(log)

    # ---------------------------------------------------------------- sockets
    def secure(self, sock: zmq.Socket, setting: str) -> None:
        """CURVE server options, before the socket's (secure) bind."""
        name = _SETTING_TO_NAME.get(setting)
        if name in self.sockets:
            # libzmq applies MAXMSGSIZE to the handshake commands (INITIATE ~300 bytes) and
            # to the encrypted frames (+33 bytes): the XPUBs' small topic cap must grow
            limit = sock.getsockopt(zmq.MAXMSGSIZE)
            if 0 <= limit < MIN_MAXMSGSIZE:
                sock.setsockopt(zmq.MAXMSGSIZE, MIN_MAXMSGSIZE)
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
            sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)

    def bind_plain(self, sock: zmq.Socket, setting: str) -> None:
        """After the secure bind: the plain endpoints of this socket, CURVE off."""
        name = _SETTING_TO_NAME.get(setting)
        eps = self.plain.get(name or "", [])
        if not eps:
            return
        sock.setsockopt(zmq.CURVE_SERVER, 0)
        # ZAP_DOMAIN cannot be emptied: the plain listeners get their own domain, which the
        # handler accepts for the NULL mechanism (and counts); "/socket" (io/peers.py) kept
        _, slash, name_part = sock.getsockopt(zmq.ZAP_DOMAIN).partition(b"/")
        sock.setsockopt(zmq.ZAP_DOMAIN, PLAIN_DOMAIN + slash + name_part)
        for ep in eps:
            sock.bind(ep)
            self.plain_endpoints.setdefault(name, []).append(
                sock.getsockopt_string(zmq.LAST_ENDPOINT))

    # -------------------------------------------------------------------- ZAP
    def handle(self, frames: list[bytes]) -> list[bytes]:
        """One ZAP request (ROUTER frames) -> the reply frames."""
        # [routing id, b"", version, request id, domain, address, identity, mechanism, creds...]
        if len(frames) < 8 or frames[2] != b"1.0":
            self.refused["bad_request"] += 1
            rid = frames[3] if len(frames) > 3 else b""
            return [frames[0], b"", b"1.0", rid, b"400", b"bad ZAP request", b"", b""]
        rid, domain, address, mechanism = frames[3], frames[4], frames[5], frames[7]
        addr = address.decode("ascii", "replace")
        if domain == PLAIN_DOMAIN and mechanism == b"NULL":
            self.plain_accepted += 1
            return [frames[0], b"", b"1.0", rid, b"200", b"OK", b"", b""]
        if mechanism == b"CURVE" and len(frames) >= 9:
            key = zmq.utils.z85.encode(frames[8]) if len(frames[8]) == 32 else b""
            if key and key in self.allow:
                self.accepted += 1
                return [frames[0], b"", b"1.0", rid, b"200", b"OK", key, b""]
            self.refused["unknown_key"] += 1
            self._rlog.warning("unknown_key", "curve: refused %s: client key %s is not in "
                               "curve_allow_dir", addr, key.decode() or "?")
            return [frames[0], b"", b"1.0", rid, b"400", b"unknown key", b"", b""]
        self.refused["mechanism"] += 1
        self._rlog.warning("mechanism", "curve: refused %s: mechanism %s on a CURVE endpoint",
                           addr, mechanism.decode("ascii", "replace"))
        return [frames[0], b"", b"1.0", rid, b"400", b"CURVE required", b"", b""]

    def handshake_failed(self, name: str, event: int, value: int, endpoint: bytes) -> None:
        """A handshake libzmq failed before asking ZAP (a wrong server key, a client
        without CURVE), as a socket monitor reports it: router's and pull's monitors are
        io/peers.py's (libzmq allows one per socket; the XPUBs' is their
        SubscriptionGuard's, so failures there are not counted)."""
        self.refused["handshake"] += 1
        try:
            ev = zmq.Event(event).name
        except ValueError:
            ev = event
        self._rlog.warning("handshake", "curve: handshake on %s failed from a client of "
                           "%s (wrong server key, or a client without CURVE): event "
                           "%s, errno %s", name, endpoint.decode("ascii", "replace"),
                           ev, value)

    def stats(self) -> dict:
        return {"accepted": self.accepted, "plain_accepted": self.plain_accepted,
                "refused": dict(self.refused),
                "allowed_keys": len(self.allow.keys)}

    def collect(self, device: str = "0"):
        """Prometheus families (registered in RelayCollector.extra)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        acc = CounterMetricFamily("logjam_relay_curve_accepted", "CURVE clients accepted by "
                                  "the ZAP handler", labels=["device"])
        acc.add_metric([device], self.accepted)
        ref = CounterMetricFamily("logjam_relay_curve_refused", "CURVE/ZAP handshakes refused",
                                  labels=["device", "reason"])
        for reason in sorted({"unknown_key", "handshake", "mechanism", "bad_request"} |
                             set(self.refused)):
            ref.add_metric([device, reason], self.refused.get(reason, 0))
        keys = GaugeMetricFamily("logjam_relay_curve_allowed_keys",
                                 "client public keys in curve_allow_dir", labels=["device"])
        keys.add_metric([device], len(self.allow.keys))
        return [acc, ref, keys]
