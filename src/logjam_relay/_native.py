"""The optional C twins of the hot paths, in one place.

Each is built by ``setup.py`` when a compiler is there; each has a Python version that is
used when the extension is missing or when ``LOGJAM_RELAY_PURE_PYTHON=1`` is set (the
benchmarks use that for their baselines).  ``load(name)`` returns the extension module
or None.
"""

from __future__ import annotations

import importlib
import os

PURE_PYTHON = os.environ.get("LOGJAM_RELAY_PURE_PYTHON", "") not in ("", "0")

#: label -> module, for ``logjam-relay --version``
EXTENSIONS = {
    "socket loops": "logjam_relay.io._zmqfast",
    "spool parsing": "logjam_relay.spool._segscan",
    "spool encoding": "logjam_relay.spool._segenc",
    "spool tail reads": "logjam_relay.spool._tailread",
    "spool fdatasync thread": "logjam_relay.spool._syncthread",
    "pipeline field extraction": "logjam_relay.pipeline._extract",
    "pipeline body decoding": "logjam_relay.pipeline._bodies",
    "lumberjack mapping": "logjam_relay.outputs._ljencode",
    "courier mapping": "logjam_relay.outputs._courierenc",
    "recompression": "logjam_relay.relay._recompress",
    "stamping": "logjam_relay.relay._stamp",
}


def load(name: str):
    """The extension module ``name`` (dotted), or None."""
    if PURE_PYTHON:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
