"""``--web-config-file``: TLS and basic auth for /metrics in the Prometheus exporter-toolkit
format (the file node_exporter & co. take with ``--web.config.file``)::

    tls_server_config:
      cert_file: server.crt          # relative paths: relative to this file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # optional (default with a client CA)
      client_ca_file: clients-ca.crt                 # optional
      min_version: TLS12                             # TLS10..TLS13, default TLS12
      max_version: TLS13
    basic_auth_users:
      prometheus: $2y$10$...          # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':\\n')

Either section may be left out.  Unknown keys are an error (as in exporter-toolkit), so a
typo cannot silently turn authentication off.  ``http_server_config`` is accepted (``http2``
has no effect: the endpoint speaks HTTP/1.1); ``headers`` and ``cipher_suites`` /
``curve_preferences`` / ``prefer_server_cipher_suites`` are refused with an explanation.

Basic auth is checked with bcrypt in the HTTP server's own thread (never on the relay's
event loop); a verified (user, password, hash) is cached by its SHA-256, so a scrape every
15 s costs one bcrypt check in total, and an unknown user still costs one bcrypt check (no
user enumeration by timing).  The file is read at start; change it and restart.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import ssl
import threading
from dataclasses import dataclass, field

from ..config import ConfigError, Settings

_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version",
             "max_version", "cert", "key", "client_allowed_sans"}
_REFUSED_TLS = {"cipher_suites", "curve_preferences", "prefer_server_cipher_suites"}
_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
             "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
_CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "RequestClientCert": ssl.CERT_OPTIONAL,
                "RequireAnyClientCert": ssl.CERT_REQUIRED,
                "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
                "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
_dummy: list[bytes] = []     # a bcrypt hash checked for unknown users (same cost)


def _dummy_hash() -> bytes:
    if not _dummy:
        import bcrypt
        _dummy.append(bcrypt.hashpw(b"unknown user", bcrypt.gensalt(10)))
    return _dummy[0]


class WebConfigError(ValueError):
    """The message names the file and the key."""


@dataclass
class WebConfig:
    path: str
    ssl_context: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)
    _ok: set[bytes] = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    refused: int = 0

    def authorize(self, method: str, path: str, headers: dict[str, str]) -> bool:
        """HTTPServer's ``authorize`` hook: True when no users are configured or the Basic
        credentials match a user's bcrypt hash."""
        if not self.users:
            return True
        ok = self._check(headers.get("authorization", ""))
        if not ok:
            self.refused += 1
        return ok

    def authorize_cached(self, method: str, path: str, headers: dict[str, str]) -> bool:
        """True without a bcrypt check: no users, or these credentials were verified
        before (HTTPServer answers such requests at once; the others wait for the slow
        check in a worker thread, so wrong passwords cannot hold up a known scraper)."""
        if not self.users:
            return True
        parsed = _basic(headers.get("authorization", ""))
        if parsed is None:
            return False
        hashed = self.users.get(parsed[0])
        if hashed is None:
            return False
        with self._lock:
            return _cache_key(*parsed, hashed) in self._ok

    def _check(self, header: str) -> bool:
        import bcrypt
        parsed = _basic(header)
        if parsed is None:
            return False
        user, password = parsed
        hashed = self.users.get(user)
        key = _cache_key(user, password, hashed or b"")
        with self._lock:
            if hashed is not None and key in self._ok:
                return True
        try:
            good = bcrypt.checkpw(password.encode(), hashed or _dummy_hash())
        except ValueError:
            good = False
        if good and hashed is not None:
            with self._lock:
                if len(self._ok) > 1000:
                    self._ok.clear()
                self._ok.add(key)
            return True
        return False


def _basic(header: str) -> tuple[str, str] | None:
    """(user, password) of a ``Basic`` Authorization header, or None."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, sep, password = base64.b64decode(token.strip(), validate=True) \
            .decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return (user, password) if sep else None


def _cache_key(user: str, password: str, hashed: bytes) -> bytes:
    return hashlib.sha256(b"\0".join((user.encode(), password.encode(), hashed))).digest()


def _path(base: str, p) -> str:
    if not isinstance(p, str) or not p:
        raise ValueError("expected a file name")
    p = p if os.path.isabs(p) else os.path.join(base, p)
    if not os.path.isfile(p):
        raise ValueError(f"{p}: no such file")
    return p


def load(path: str) -> WebConfig:
    """Read and validate a web-config file; :class:`WebConfigError` names the bad key."""
    import yaml
    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except OSError as e:
        raise WebConfigError(f"{path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise WebConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    doc = doc or {}
    if not isinstance(doc, dict):
        raise WebConfigError(f"{path}: expected a mapping at the top level")
    unknown = set(doc) - {"tls_server_config", "basic_auth_users", "http_server_config"}
    if unknown:
        raise WebConfigError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    cfg = WebConfig(path)
    base = os.path.dirname(os.path.abspath(path))
    tls = doc.get("tls_server_config")
    if tls is not None:
        cfg.ssl_context = _tls(path, base, tls)
    users = doc.get("basic_auth_users") or {}
    if not isinstance(users, dict):
        raise WebConfigError(f"{path}: basic_auth_users: expected user: bcrypt-hash pairs")
    for user, h in users.items():
        if not isinstance(h, str) or not h.startswith(("$2a$", "$2b$", "$2y$")):
            raise WebConfigError(f"{path}: basic_auth_users.{user}: expected a bcrypt hash "
                                 "($2y$..., e.g. from htpasswd -nBC 10)")
        if ":" in str(user):
            raise WebConfigError(f"{path}: basic_auth_users: user name {user!r} contains ':'")
        cfg.users[str(user)] = h.encode()
    http = doc.get("http_server_config") or {}
    if not isinstance(http, dict) or set(http) - {"http2"}:
        raise WebConfigError(f"{path}: http_server_config: only http2 is supported "
                             "(headers are not)")
    return cfg


def _tls(path: str, base: str, tls) -> ssl.SSLContext:
    if not isinstance(tls, dict):
        raise WebConfigError(f"{path}: tls_server_config: expected a mapping")
    bad = set(tls) & _REFUSED_TLS
    if bad:
        raise WebConfigError(f"{path}: tls_server_config.{sorted(bad)[0]}: not supported "
                             "(OpenSSL's defaults are used)")
    unknown = set(tls) - _TLS_KEYS - _REFUSED_TLS
    if unknown:
        raise WebConfigError(f"{path}: tls_server_config: unknown key(s) "
                             f"{', '.join(sorted(unknown))}")
    if tls.get("cert") or tls.get("key") or tls.get("client_allowed_sans"):
        raise WebConfigError(f"{path}: tls_server_config: inline cert/key and "
                             "client_allowed_sans are not supported; use cert_file/key_file")
    key = "?"
    try:
        key = "cert_file"
        cert = _path(base, tls.get("cert_file"))
        key = "key_file"
        keyf = _path(base, tls.get("key_file"))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, keyf)
        key = "min_version"
        ctx.minimum_version = _VERSIONS[tls.get("min_version", "TLS12")]
        key = "max_version"
        if "max_version" in tls:
            ctx.maximum_version = _VERSIONS[tls["max_version"]]
        ca = tls.get("client_ca_file")
        key = "client_auth_type"
        auth = tls.get("client_auth_type") or ("RequireAndVerifyClientCert" if ca
                                               else "NoClientCert")
        mode = _CLIENT_AUTH[auth]
        if mode != ssl.CERT_NONE:
            key = "client_ca_file"
            if not ca:
                raise ValueError(f"client_auth_type {auth} needs client_ca_file")
            ctx.load_verify_locations(_path(base, ca))
            ctx.verify_mode = mode
    except KeyError as e:
        raise WebConfigError(f"{path}: tls_server_config.{key}: unknown value {e}") from None
    except (ValueError, ssl.SSLError, OSError) as e:
        raise WebConfigError(f"{path}: tls_server_config.{key}: {e}") from None
    return ctx


def check_settings(s: Settings) -> None:
    """``web_config_file``, loaded once at start: a ConfigError names the setting."""
    if not s.web_config_file:
        return
    try:
        load(s.web_config_file)
    except WebConfigError as e:
        raise ConfigError(f"web_config_file ({s.sources.get('web_config_file', 'default')})"
                          f": {e}") from None
