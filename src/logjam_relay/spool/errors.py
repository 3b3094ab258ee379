"""Spool exceptions and the mapping of ``OSError`` to short reasons (metric labels)."""

from __future__ import annotations

import errno as _errno

from ..ratelimit import RateLimitedLog


class SpoolError(Exception):
    """Spool misuse or an unusable spool directory.  ``reason`` is a metric label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class SpoolWriteError(SpoolError):
    """Writing to the spool failed (disk full, permissions, I/O error).

    Nothing of the failed batch is readable from the spool (a partial write is
    cut off again); the caller must not acknowledge the batch to its clients and
    should stop reading ingress and retry later."""

    def __init__(self, reason: str, message: str, errno: int | None = None,
                 path: str | None = None):
        super().__init__(reason, message)
        self.errno = errno
        self.path = path


class SpoolLockedError(SpoolError):
    pass


def reason_of(e: OSError) -> str:
    return {
        _errno.ENOSPC: "enospc", _errno.EDQUOT: "edquot", _errno.EACCES: "eacces",
        _errno.EPERM: "eperm", _errno.EROFS: "erofs", _errno.ENOTDIR: "enotdir",
        _errno.ENOENT: "enoent", _errno.EIO: "eio", _errno.EEXIST: "eexist",
        _errno.EMFILE: "emfile", _errno.ENFILE: "enfile",
    }.get(e.errno, "oserror")


HINTS = {
    "enospc": "the disk is full; free space or lower spool max_bytes",
    "edquot": "the disk quota is exhausted",
    "eacces": "permission denied; check owner/mode of the spool directory",
    "eperm": "operation not permitted; check owner/mode of the spool directory",
    "erofs": "the file system is read-only",
    "enotdir": "a path component of the spool directory is not a directory",
    "enoent": "the spool directory disappeared",
    "eio": "I/O error from the storage device",
    "emfile": "the relay is out of file descriptors and its reserve is used up (RLIMIT_NOFILE; "
              "docs/operations.md, \"Open files\")",
    "enfile": "the system is out of file descriptors (fs.file-max)",
}


def write_error(what: str, path: str, e: OSError) -> SpoolWriteError:
    reason = reason_of(e)
    hint = HINTS.get(reason, "")
    msg = f"spool: {what} {path!r} failed: {e.strerror or e} (errno {e.errno})"
    if hint:
        msg += f" -- {hint}"
    return SpoolWriteError(reason, msg, e.errno, path)


def is_disk_full(e: BaseException) -> bool:
    return getattr(e, "errno", None) in (_errno.ENOSPC, _errno.EDQUOT)


class WriteErrors:
    """The write errors of one spool, shared by its parts: counted by reason, the last one
    kept (``stats``), logged rate-limited (a full disk fails every append)."""

    def __init__(self, log) -> None:
        self.total = 0
        self.by_reason: dict[str, int] = {}
        self.last: str | None = None
        self.rlog = RateLimitedLog(log)

    def count(self, err: SpoolWriteError) -> SpoolWriteError:
        """Count and log ``err``; returns it (``raise errors.count(e)``)."""
        self.total += 1
        self.by_reason[err.reason] = self.by_reason.get(err.reason, 0) + 1
        self.last = str(err)
        self.rlog.error("write_" + err.reason, "%s", err)
        return err
