"""What the Lumberjack and Courier output URLs share: the query string (each parameter
once), on/off flags and the TLS parameters (``tls``, ``verify``, ``ca``, ``cert``, ``key``,
``server_name``), with one set of rules and error texts for both schemes.

The rules: TLS is on unless ``tls=off``; ``ca``/``cert``/``key``/``server_name``/``verify``
given with ``tls=off`` is an error (it would be silently ignored); ``key`` needs ``cert``;
no parameter may be empty.  Whether the files exist is checked here when ``check_files``
(Courier) and in any case when the relay starts (``--check-config``, start-up: the TLS
context is built then).
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple
from urllib.parse import parse_qsl

from ..io.net import TLSSettings


class SplitURL(NamedTuple):
    scheme: str
    netloc: str
    path: str
    query: str
    fragment: str


TRUE = frozenset(("on", "true", "yes", "1"))
FALSE = frozenset(("off", "false", "no", "0"))
TLS_KEYS = ("tls", "verify", "ca", "cert", "key", "server_name")


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://([^/?#]*)([^?#]*)(?:\?([^#]*))?(?:#(.*))?$")


def split_url(url: str) -> SplitURL:
    """``scheme://netloc/path?query#fragment`` without ``urlsplit``'s netloc checks.

    A multi-host netloc such as ``a:1,[::1]:2`` is not one RFC 3986 authority, and
    CPython's security releases (and Debian's 3.11.2) reject it in ``urlsplit`` with
    "Invalid IPv6 URL" whenever a bracketed host is not the first; the hosts are split
    and checked one by one by the callers instead.
    """
    m = _URL.match(url.strip())
    if not m:
        raise ValueError("expected scheme://host:port[,host:port...][?parameters]")
    scheme, netloc, path, query, fragment = m.groups()
    return SplitURL(scheme.lower(), netloc, path, query or "", fragment or "")


def query_params(scheme: str, query: str) -> dict[str, str]:
    """The parameters of a query string, in order; a parameter given twice is an error."""
    params: dict[str, str] = {}
    for k, v in parse_qsl(query, keep_blank_values=True):
        if k in params:
            raise ValueError(f"{scheme} URL: parameter {k!r} given twice")
        params[k] = v
    return params


def flag(scheme: str, name: str, raw: str) -> bool:
    lv = raw.lower()
    if lv in TRUE:
        return True
    if lv in FALSE:
        return False
    raise ValueError(f"{scheme} URL: parameter {name!r}: expected on/off, got {raw!r}")


def tls_settings(scheme: str, params: dict[str, str], *, check_files: bool) -> TLSSettings:
    """Take the TLS parameters out of ``params`` and make the settings."""
    got = {k: params.pop(k) for k in TLS_KEYS if k in params}
    for k in ("ca", "cert", "key", "server_name"):
        if k in got and not got[k]:
            raise ValueError(f"{scheme} URL: parameter {k!r} is empty")
        if check_files and k != "server_name" and k in got and not os.path.isfile(got[k]):
            raise ValueError(f"{scheme} URL: parameter {k!r}: file {got[k]!r} not found")
    enabled = flag(scheme, "tls", got["tls"]) if "tls" in got else True
    verify = flag(scheme, "verify", got["verify"]) if "verify" in got else True
    if not enabled:
        for k in TLS_KEYS[1:]:
            if k in got:
                raise ValueError(f"{scheme} URL: parameter {k!r} given but tls=off")
    if "key" in got and "cert" not in got:
        raise ValueError(f"{scheme} URL: parameter 'key' given without 'cert'")
    return TLSSettings(enabled=enabled, ca=got.get("ca"), cert=got.get("cert"),
                       key=got.get("key"), server_name=got.get("server_name"), verify=verify)
