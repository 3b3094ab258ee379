"""Archive output: sealed spool segments become immutable files in an archive directory.

The spool calls :meth:`Archive.on_seal` right after a segment was sealed (``.open`` renamed
to ``.seg``, file and directory fsynced), before it can be deleted.  The archive then

* hard-links the sealed file into ``directory`` under a temporary name and renames it to
  its final name ``NNNNNNNNNNNNNNNNNNNN.seg`` (atomic: a reader sees the whole file or
  nothing), or, when a hard link is impossible (another file system, no permission),
* copies it to the temporary name, fsyncs it, renames it and fsyncs the directory.

Sealed segments are never written again (``docs/spool-format.md``), so a hard link is as
good as a copy and costs no space while the spool still holds the segment.  The spool's
own deletion (after every reader acknowledged a segment) only removes the spool's name;
the archive's name keeps the data until :meth:`Archive.prune` removes it after
``retention_s`` seconds (measured from the segment's seal time = the file's mtime).

Spark (``logjam_relay.pipeline.datasource``) reads only ``*.seg`` names from the archive,
so it never sees a partial file and never races the spool.

A failed link/copy (disk full, permissions) is counted, logged (rate-limited) and retried
by :meth:`run` while the spool still has the file.  :meth:`catch_up` links sealed segments
found in a spool directory that are missing from the archive (call it once at start:
segments sealed during spool recovery are not announced to seal listeners).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections.abc import Callable

import trio

from ..fdreserve import RESERVE as _FDS
from ..ratelimit import RateLimitedLog
from ..spool import segment as fmt

log = logging.getLogger("logjam_relay.outputs.archive")

TMP_PREFIX = "."
TMP_SUFFIX = ".tmp"
_STALE_TMP_S = 3600.0
_LINK_FALLBACK = {errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP,
                  errno.EOPNOTSUPP, errno.ENOSYS}


def _fsync_dir(path: str) -> None:
    fd = _FDS.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        _FDS.close(fd)


archived_segments = fmt.sealed_segments


class Archive:
    """Hand sealed segments into ``directory``; keep them ``retention_s`` seconds
    (``None`` or 0: forever)."""

    def __init__(self, directory, retention_s: float | None = None, *,
                 prune_interval_s: float = 60.0, clock: Callable[[], float] = time.time,
                 fsync: bool = True):
        self.directory = os.fspath(directory)
        self.retention_s = retention_s or None
        self.prune_interval_s = prune_interval_s
        self.fsync = fsync
        self._clock = clock
        self._rlog = RateLimitedLog(log)
        self._pending: dict[int, str] = {}        # failed hand-overs to retry: segno -> path
        os.makedirs(self.directory, exist_ok=True)
        # counters
        self.archived = 0
        self.linked = 0
        self.copied = 0
        self.already_present = 0
        self.errors = 0
        self.pruned = 0
        self.pruned_bytes = 0
        self.prune_errors = 0
        self.last_error: str | None = None
        self._remove_stale_tmp(force=True)

    # ------------------------------------------------------------------ hand-over
    def target_path(self, segno: int) -> str:
        return os.path.join(self.directory, fmt.segment_name(segno, True))

    def on_seal(self, segno: int, path) -> bool:
        """Seal listener for :class:`~logjam_relay.spool.spool.Spool`: link or copy the
        sealed segment ``path`` into the archive.  Never raises on I/O errors (they are
        counted, logged and the segment is retried by :meth:`run`).  Returns success."""
        path = os.fspath(path)
        try:
            self._archive(segno, path)
        except OSError as e:
            self.errors += 1
            self.last_error = f"archiving segment {segno} from {path!r}: {e}"
            self._rlog.error("archive_error", "archive: %s", self.last_error)
            self._pending[segno] = path
            return False
        self._pending.pop(segno, None)
        return True

    def _archive(self, segno: int, path: str) -> None:
        target = self.target_path(segno)
        if os.path.exists(target):
            try:
                if os.path.samefile(path, target) or \
                        os.path.getsize(path) == os.path.getsize(target):
                    self.already_present += 1
                    return
            except FileNotFoundError:
                pass
        tmp = os.path.join(self.directory, f"{TMP_PREFIX}{segno:020d}.seg{TMP_SUFFIX}")
        _unlink_quiet(tmp)
        try:
            os.link(path, tmp)
            how = "link"
        except OSError as e:
            if e.errno not in _LINK_FALLBACK:
                raise
            how = "copy"
            try:
                self._copy(path, tmp)
            except BaseException:
                _unlink_quiet(tmp)
                raise
        try:
            os.replace(tmp, target)
        except BaseException:
            _unlink_quiet(tmp)
            raise
        if self.fsync:
            _fsync_dir(self.directory)
        self.archived += 1
        if how == "link":
            self.linked += 1
        else:
            self.copied += 1
        log.debug("archive: %s segment %d -> %s", how, segno, target)

    def _copy(self, src: str, dst: str) -> None:
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
            fo.flush()
            if self.fsync:
                os.fsync(fo.fileno())
            st = os.fstat(fi.fileno())
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))   # retention counts from seal

    def catch_up(self, spool_dir) -> int:
        """Archive every sealed segment of ``spool_dir`` that the archive lacks and that is
        younger than the retention.  Returns how many were archived."""
        now = self._clock()
        have = {segno for segno, _ in archived_segments(self.directory)}
        n = 0
        for segno, path in archived_segments(spool_dir):
            if segno in have:
                continue
            try:
                if self.retention_s and now - os.stat(path).st_mtime > self.retention_s:
                    continue
            except FileNotFoundError:
                continue
            if fmt.read_seal(path) is None:
                self._rlog.error("unsealed", "archive: %s has no valid seal record; "
                                 "not archived", path)
                continue
            if self.on_seal(segno, path):
                n += 1
        return n

    def retry_pending(self) -> None:
        for segno, path in sorted(self._pending.items()):
            if not os.path.exists(path):
                self._pending.pop(segno, None)
                self._rlog.error("archive_gone", "archive: segment %d vanished from the spool "
                                 "before it could be archived", segno)
                continue
            self.on_seal(segno, path)

    # ------------------------------------------------------------------ retention
    def prune(self, now: float | None = None) -> int:
        """Delete archived segments sealed more than ``retention_s`` before ``now``
        (oldest first; stops at the first one that is young enough).  Returns the count."""
        if now is None:
            now = self._clock()
        self._remove_stale_tmp()
        if not self.retention_s:
            return 0
        limit = now - self.retention_s
        n = 0
        for segno, path in archived_segments(self.directory):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if st.st_mtime > limit:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                self.prune_errors += 1
                self.last_error = f"pruning {path!r}: {e}"
                self._rlog.error("prune_error", "archive: %s", self.last_error)
                continue
            n += 1
            self.pruned_bytes += st.st_size
            log.debug("archive: pruned segment %d", segno)
        self.pruned += n
        return n

    def _remove_stale_tmp(self, force: bool = False) -> None:
        now = self._clock()
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX):
                p = os.path.join(self.directory, name)
                try:
                    if force or now - os.stat(p).st_mtime > _STALE_TMP_S:
                        os.unlink(p)
                except OSError:
                    pass

    async def run(self, period: float | None = None) -> None:
        """Prune and retry failed hand-overs every ``period`` seconds (default
        ``prune_interval_s``); run it in the owner's nursery."""
        period = self.prune_interval_s if period is None else period
        while True:
            try:
                self.retry_pending()
                self.prune()
            except OSError as e:          # listing the directory failed; try again later
                self._rlog.error("archive_run", "archive: %s", e)
            await trio.sleep(period)

    # ------------------------------------------------------------------ info
    def stats(self) -> dict:
        segs = archived_segments(self.directory)
        size = 0
        for _, p in segs:
            try:
                size += os.path.getsize(p)
            except OSError:
                pass
        return {
            "segments": len(segs),
            "bytes": size,
            "archived": self.archived,
            "linked": self.linked,
            "copied": self.copied,
            "already_present": self.already_present,
            "errors": self.errors,
            "pending": len(self._pending),
            "pruned": self.pruned,
            "pruned_bytes": self.pruned_bytes,
            "prune_errors": self.prune_errors,
        }


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
