"""logjam-relay: a logjam-device drop-in that spools, fans out and reports its health."""

__version__ = "0.1.0"
