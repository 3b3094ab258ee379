"""Sealing segments (mixed into :class:`~logjam_relay.spool.spool.Spool`).

A segment is sealed by appending its seal record, fsyncing it and renaming ``.open`` to
``.seg``; the seal listeners (the archive output) are then told.  On a full disk the
``RESERVE`` ballast is given back first; if even that does not make room the segment is
closed in memory without its seal record (*deferred seal*: readers treat it as sealed,
it can be deleted once acknowledged) and :meth:`tick` writes the record once there is
space again.  A crash meanwhile is harmless: an ``.open`` segment that is not the newest
is sealed by the recovery.  See docs/spool-format.md, "Full disk".

Writes go through ``Spool._write_all`` (``spool.py``), so that tests can inject write
failures in one place.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from ..fdreserve import RESERVE as _FDS
from . import segment as fmt
from .errors import SpoolWriteError, is_disk_full
from .errors import write_error as _write_error
from .recovery import _unlink_quiet

log = logging.getLogger("logjam_relay.spool")


class SealMixin:
    def seal(self) -> None:
        """Seal the active segment now (no-op if there is none)."""
        if self._active is not None:
            self._seal_active()
            self._maybe_delete()

    def add_seal_listener(self, cb: Callable[[int, str], None]) -> None:
        """``cb(segno, path)`` is called right after a segment was sealed (before it can
        be deleted): e.g. the archive output hard-links ``path``."""
        self._seal_listeners.append(cb)

    def _seal_active(self, notify: bool = True) -> None:
        seg, fd = self._active, self._fd
        if seg.count == 0:
            _FDS.close(fd)
            self._active, self._fd = None, None
            del self._segs[seg.segno]
            self._bytes -= seg.size
            _unlink_quiet(seg.path)
            return
        if self._dirty_tail:
            self._cut_tail()
        rec = fmt.encode_seal(seg.end_seq, seg.count, seg.data_end, self._now_ms())
        try:
            try:
                self._write_all(fd, rec, "seal record")
            except OSError as e:
                if not is_disk_full(e):
                    raise
                # a segment can always be sealed: the reserve file gives the space back
                os.ftruncate(fd, seg.data_end)
                if not self._release_reserve():
                    raise
                self._write_all(fd, rec, "seal record")
            os.fsync(fd)                       # always: sealed segments are published
        except OSError as e:
            if is_disk_full(e) and self._seal_later(seg, fd, e):
                return
            self._dirty_tail = True
            raise self._count_error(_write_error("sealing", seg.path, e)) from None
        self.fsyncs += 1
        _FDS.close(fd)
        self._active, self._fd = None, None
        self._unsynced = False
        seg.sealed = True
        try:
            self._sealed_on_disk(seg, len(rec), save_state=True)
        except OSError as e:
            # the seal record is on disk; recovery renames it.  Readers keep using the
            # old name.
            self._count_error(_write_error("renaming sealed segment", seg.path, e))
            return
        if notify:
            self._notify_sealed(seg)

    def _sealed_on_disk(self, seg, rec_len: int, *, save_state: bool) -> bool:
        """The seal record of ``seg`` is written and synced: account for it and rename
        the file to its sealed name.  An ``OSError`` of the rename is raised; False when
        the directory sync or the state save failed (counted and logged by them)."""
        seg.size = seg.data_end + rec_len
        self._bytes += rec_len
        self.sealed_segments += 1
        new = os.path.join(self.directory, fmt.segment_name(seg.segno, True))
        os.replace(seg.path, new)
        seg.path = new
        try:
            self._fsync_dir()
            if save_state:
                self._save_state()
        except SpoolWriteError:
            return False
        return True

    def _notify_sealed(self, seg) -> None:
        for cb in self._seal_listeners:
            try:
                cb(seg.segno, seg.path)
            except Exception:
                log.exception("spool: seal listener %r failed", cb)

    def _seal_later(self, seg, fd: int, err: OSError) -> bool:
        """The disk is full and the reserve is gone: close the segment in memory and owe
        its seal record (written by :meth:`_retry_pending_seals` from :meth:`tick`)."""
        try:
            os.ftruncate(fd, seg.data_end)
        except OSError:
            return False
        self._count_error(_write_error("sealing", seg.path, err))
        _FDS.close(fd)
        self._active, self._fd = None, None
        self._unsynced = False
        self._dirty_tail = False
        seg.sealed = True
        self.deferred_seals += 1
        self._pending_seals.append(seg)
        log.warning("spool: disk full; segment %d closed without its seal record (written "
                    "once there is space)", seg.segno)
        return True

    def _retry_pending_seals(self) -> None:
        for seg in list(self._pending_seals):
            if self._segs.get(seg.segno) is not seg:
                self._pending_seals.remove(seg)       # acknowledged and deleted meanwhile
                if self._seal_listeners:
                    log.warning("spool: segment %d was deleted before its seal record could "
                                "be written: it was not archived", seg.segno)
                continue
            rec = fmt.encode_seal(seg.end_seq, seg.count, seg.data_end, self._now_ms())
            try:
                fd = _FDS.open(seg.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                self._write_all(fd, rec, "seal record")
                os.fsync(fd)
            except OSError:
                try:
                    os.ftruncate(fd, seg.data_end)
                except OSError:
                    pass
                continue
            finally:
                _FDS.close(fd)
            self._pending_seals.remove(seg)
            try:
                if not self._sealed_on_disk(seg, len(rec), save_state=False):
                    continue
            except OSError:
                continue
            self._notify_sealed(seg)
