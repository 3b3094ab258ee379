"""The one-line cause of a failed bind (the relay's sockets, CMDP, samwise, metrics)."""

from __future__ import annotations

import errno

_BIND_CAUSES = {
    errno.EADDRINUSE: "address already in use (is logjam-device or another relay still "
                      "running?)",
    errno.EACCES: "permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)",
    errno.EADDRNOTAVAIL: "address not available on this host (check bind / metrics_ip)",
    errno.ENODEV: "no such interface (check bind)",
    errno.EINVAL: "invalid address (check bind)",
}


def bind_cause(endpoint: str, e: OSError) -> str:
    """The one-line cause of a failed bind, with what usually explains it."""
    what = _BIND_CAUSES.get(getattr(e, "errno", None))
    if what is None:
        what = (getattr(e, "strerror", None) or str(e)).lower()
    return f"cannot bind {endpoint}: {what}"
