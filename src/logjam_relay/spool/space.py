"""The disk bound and the full disk (mixed into :class:`Spool`).

``block``: ingress pauses while the records the slowest reader has not acknowledged
fill ``max_bytes`` and resumes on the acknowledgement that frees space.  ``drop_oldest``:
the oldest segments are dropped (budget, or ENOSPC).  A full disk never deadlocks: the
``RESERVE`` ballast file is given back so that a segment can always be sealed, the
active segment is sealed at once (so that acknowledging it frees it) and segments are
small for a while.  See docs/spool-format.md, "Disk bound".
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import trio

from ..fdreserve import RESERVE as _FDS
from . import segment as fmt
from .errors import SpoolWriteError, is_disk_full
from .errors import write_error as _write_error
from .recovery import _unlink_quiet

if TYPE_CHECKING:
    from .api import Position
    from .spool import _Seg

log = logging.getLogger("logjam_relay.spool")

MiB = 1 << 20
RESERVE_FILE = "RESERVE"
RESERVE_BYTES = 256 * 1024   # ballast freed when sealing hits a full disk


class SpaceMixin:
    def _append_on_full_disk(self, data: bytes, n: int, err: SpoolWriteError) -> Position:
        """ENOSPC: seal the active segment (so that it can be deleted once acknowledged;
        the seal's space comes from the reserve file), then with ``drop_oldest`` drop
        the oldest segments as the budget would; with ``block`` pause ingress."""
        self._pressure_at = self._mono()
        try:
            st = os.statvfs(self.directory)
            disk = st.f_blocks * st.f_frsize
        except OSError:
            disk = 0
        # segments under pressure: 1/16 of the configured size and of the file system
        self._pressure_bytes = max(64 * 1024, min(self.segment_bytes // 16,
                                                  disk // 16 if disk else self.segment_bytes))
        act = self._active
        if act is not None and act.count:
            try:
                self._seal_active()
                self.enospc_seals += 1
            except SpoolWriteError:
                pass
        if self.policy == "drop_oldest":
            while True:
                oldest = next((s for s in self._segs.values() if s is not self._active), None)
                if oldest is None:
                    break
                self._drop_segments([oldest], "disk_full")
                self.enospc_drops += 1
                try:
                    return self._append_once(data, n)
                except SpoolWriteError as e:
                    if not is_disk_full(e):
                        raise
                    err = e
        self._disk_full = f"disk full (ENOSPC) on {self.directory}"
        self._disk_full_at = self._mono()
        raise err

    def _segment_limit(self) -> int:
        """Segment size; smaller for a minute after the disk ran full, so that space is
        freed (and ``block`` resumes) in small steps."""
        if self._pressure_at is not None and self._mono() - self._pressure_at < 60.0:
            return min(self.segment_bytes, self._pressure_bytes)
        return self.segment_bytes

    # -- reserve ----------------------------------------------------------------
    def _make_reserve(self) -> None:
        """Keep :data:`RESERVE_BYTES` allocated in ``RESERVE`` (not counted in ``bytes``):
        freed when a seal finds the disk full, re-created once there is space again."""
        self._reserve_tried = self._mono()
        path = os.path.join(self.directory, RESERVE_FILE)
        try:
            if os.path.getsize(path) >= RESERVE_BYTES:
                self._reserve_ok = True
                return
        except OSError:
            pass
        try:
            fd = _FDS.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            finally:
                _FDS.close(fd)
            self._reserve_ok = True
        except OSError:
            _unlink_quiet(path)
            self._reserve_ok = False

    def _release_reserve(self) -> bool:
        if not self._reserve_ok:
            return False
        _unlink_quiet(os.path.join(self.directory, RESERVE_FILE))
        self._reserve_ok = False
        self.reserve_releases += 1
        log.warning("spool: disk full on %s; released the %d-byte reserve to seal a segment",
                    self.directory, RESERVE_BYTES)
        return True

    # -- space ------------------------------------------------------------------
    def _live_bytes(self) -> int:
        """Bytes from the slowest reader's cursor on (what ``block`` bounds)."""
        readers = self.readers.values()
        if not readers:
            act = self._active
            return act.size if act is not None else 0
        low = min(r._ack_pos for r in readers)
        live = 0
        for seg in self._segs.values():
            if seg.segno > low.segment:
                live += seg.size
            elif seg.segno == low.segment:
                live += max(0, seg.size - max(0, low.offset - fmt.HEADER_LEN))
        return live

    def would_block(self) -> bool:
        """True if ingress should pause: the disk is full, or with the ``block`` policy
        the unacknowledged records take ``max_bytes``."""
        if self._disk_full is not None:
            return True
        return self.policy == "block" and self._bytes >= self.max_bytes and \
            self._live_bytes() >= self.max_bytes

    def paused_reason(self) -> str | None:
        """Why ingress is paused (for ``/readyz``), or None."""
        if self._disk_full is not None:
            return self._disk_full
        if self.policy == "block" and self._bytes >= self.max_bytes:
            live = self._live_bytes()
            if live >= self.max_bytes:
                return f"spool full ({_size(live)} of {_size(self.max_bytes)}) on " \
                       f"{self.directory}: ingress paused until outputs catch up"
        return None

    @property
    def full(self) -> bool:
        return self._bytes >= self.max_bytes

    async def wait_writable(self) -> None:
        """Return once :meth:`would_block` is false.  After a full disk it returns at
        least once a second so that the caller retries (space may be freed outside)."""
        if self.would_block() and self._blocked_since is None:
            self._blocked_since = self._mono()
        try:
            while self.would_block():
                self._space = trio.Event() if self._space.is_set() else self._space
                if self._disk_full is not None:
                    with trio.move_on_after(1.0):
                        await self._space.wait()
                    break
                await self._space.wait()
        finally:
            self._blocked_since = None
        await trio.lowlevel.checkpoint()

    def blocked_in_progress(self) -> float:
        """Seconds the current pause (in :meth:`wait_writable`) has lasted so far; the
        caller adds the whole pause to its own total when it ends."""
        since = self._blocked_since
        return 0.0 if since is None else max(0.0, self._mono() - since)

    def _make_room(self, need: int) -> None:
        drop = []
        total = self._bytes
        for seg in self._segs.values():
            if total + need <= self.max_bytes or seg is self._active:
                break
            drop.append(seg)
            total -= seg.size
        if drop:
            self._drop_segments(drop, "dropped")

    def _drop_segments(self, segs: list[_Seg], reason: str) -> None:
        """Delete segments no matter whether they were read (budget or full disk):
        what a reader had not acknowledged is counted as lost (served records when the
        reader rewinds without acknowledging them)."""
        before = {r: (r._ack_seq, r._read_seq) for r in self.readers.values()}
        for seg in segs:
            self._add_gap(seg.first_seq, seg.end_seq, reason)
            unacked = {r.name: max(0, seg.end_seq - max(r._ack_seq, seg.first_seq))
                       for r in self.readers.values()}
            self._delete(seg)
            self.dropped_segments += 1
            self._rlog.warning("drop_" + reason, "spool: %s, dropped oldest segment %d "
                               "(records %d..%d; not yet acknowledged: %s)",
                               "disk full" if reason == "disk_full" else
                               f"full ({self._bytes} bytes)", seg.segno, seg.first_seq,
                               seg.end_seq - 1, ", ".join(f"{k} {v}" for k, v in unacked.items())
                               or "-")
        for r, (ack_seq, read_seq) in before.items():
            r._note_drop(ack_seq, read_seq)
            r._normalize_ack()
        self._prune_gaps()

    def _maybe_delete(self) -> None:
        readers = self.readers.values()
        for r in readers:
            r._normalize_ack()
        durable = False
        while self._segs:
            oldest = next(iter(self._segs.values()))
            if not oldest.sealed or any(r._ack_pos.segment <= oldest.segno for r in readers):
                break
            if not durable:
                self._cursors_durable()
                durable = True
            self._delete(oldest)
            self.deleted_segments += 1
        self._prune_gaps()

    def _cursors_durable(self) -> None:
        """Before an acknowledged segment is deleted, the cursors that allow it are made
        durable (written and fdatasynced; once per deleted segment, whatever ``fsync``
        says).  Otherwise a power loss could keep the deletion and lose the cursor: the
        restarted reader's cursor would point into the deleted segment, and records that
        were delivered would be reported lost."""
        for r in self.readers.values():
            r._persist_quiet()
            r.sync_cursor()

    def _prune_gaps(self) -> None:
        """Forget gaps every reader's cursor (and pending drop) is past."""
        if self._gaps:
            readers = self.readers.values()
            low = min((r._ack_seq for r in readers), default=self._next_seq)
            low = min([low] + [r._pending[0][0] for r in readers if r._pending])
            self._gaps = [g for g in self._gaps if g[1] > low]

    def _delete(self, seg: _Seg) -> None:
        for r in self.readers.values():
            r._forget(seg.segno)
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._count_error(_write_error("deleting", seg.path, e)) from None
        del self._segs[seg.segno]
        self._bytes -= seg.size
        if self._disk_full is not None:
            self._disk_full = None          # space was freed: let ingress retry
        self._space.set()



def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)
