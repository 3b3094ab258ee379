"""The durable spool (:class:`Spool`): an append-only log of segment files with per-output
cursors, composed of parts that own their state (see the package docstring, ``__init__.py``,
for the parts and the invariants; ``docs/spool-format.md`` for the on-disk format).

Everything here is synchronous file I/O except :meth:`SpoolReader.wait`,
:meth:`Spool.run`, :meth:`Spool.sync_async` and :meth:`Spool.wait_writable`, which use
trio.  A :class:`Spool` must be used from one thread (the trio thread).
"""

from __future__ import annotations

import logging
import os
import re
import struct
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence

import trio

from . import segment as fmt
from .api import KIND_LOGJAM, Position, Record  # noqa: F401  (re-exported)
from .damage import Damage
from .errors import HINTS as _HINTS  # noqa: F401
from .errors import (  # noqa: F401  (re-exported)
    SpoolError,
    SpoolLockedError,
    SpoolWriteError,
    WriteErrors,
    is_disk_full,
)
from .errors import reason_of as _reason  # noqa: F401
from .errors import write_error as _write_error
from .fs import OS, Filesystem
from .fsyncpolicy import FsyncPolicy  # noqa: F401  (re-exported)
from .ledger import Ledger, Seg
from .reader import SpoolReader
from .recovery import (  # noqa: F401  (re-exported)
    CURSOR_DIR,
    LOCK_FILE,
    STATE_FILE,
    load_cursors,
    lock_directory,
    place_cursor,
    recover,
)
from .space import RESERVE_BYTES, RESERVE_FILE, SpaceBudget  # noqa: F401
from .writer import SegmentWriter, SyncJob

log = logging.getLogger("logjam_relay.spool")

MiB = 1 << 20
_META = struct.Struct(">HBBIQQ")
_NAME_OK = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


class Spool:
    """Append-only segment log in ``directory`` read by the named ``readers``.

    * ``policy="block"``: :meth:`would_block` is true while the records no reader
      has acknowledged yet take ``max_bytes`` or more (or the disk is full); the
      caller stops reading ingress.  It clears as soon as an acknowledgement frees
      space, so disk use may exceed ``max_bytes`` by the acknowledged part of the
      oldest segment plus one batch.
    * ``policy="drop_oldest"``: appending deletes the oldest sealed segments to
      stay under ``max_bytes``; unacknowledged records in them are counted as
      ``lost`` per reader.
    * ``fsync``: the :class:`~.fsyncpolicy.FsyncPolicy` (when fdatasync is called, and
      whether the owner does it off the loop), fixed for the spool's life.  A mode
      string (``"batch"``, ``"interval"``, ``"never"``) is short for
      ``FsyncPolicy(mode, fsync_interval_s)`` (inline).
    * ``fs``: the file system (:data:`fs.OS`; tests pass a model).
    """

    def __init__(self, directory, *, readers: Sequence[str], segment_bytes: int = 64 * MiB,
                 segment_age_s: float = 300.0, max_bytes: int = 8 << 30,
                 policy: str = "block", fsync: FsyncPolicy | str = "interval",
                 fsync_interval_s: float = 1.0, cursor_flush_s: float = 0.0,
                 on_seal: Callable[[int, str], None] | None = None,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 fs: Filesystem = OS):
        if policy not in ("block", "drop_oldest"):
            raise ValueError(f"spool policy must be 'block' or 'drop_oldest', not {policy!r}")
        if not isinstance(fsync, FsyncPolicy):
            fsync = FsyncPolicy(fsync, fsync_interval_s)
        for name in readers:
            if not _NAME_OK.match(name):
                raise ValueError(f"bad spool reader name {name!r} (use [A-Za-z0-9_.-])")
        if len(set(readers)) != len(readers):
            raise ValueError("duplicate spool reader names")
        if max_bytes < 4 * 4096:
            raise ValueError("spool max_bytes is too small")
        self.directory = os.fspath(directory)
        self.fs = fs
        # at least 4 segments fit in max_bytes, so drop_oldest always has sealed ones to drop
        self.segment_bytes = max(4096, min(segment_bytes, max_bytes // 4))
        self.segment_age_s = segment_age_s
        self.max_bytes = max_bytes
        self.policy = policy
        self.fsync: FsyncPolicy = fsync
        self.cursor_flush_s = cursor_flush_s
        self.clock = clock
        self.monotonic = monotonic
        self.errors = WriteErrors(log)
        self.readers: dict[str, SpoolReader] = {}
        self._closed = False
        self._last_cursor_sync = 0.0
        self.dropped_segments = 0
        self.deleted_segments = 0
        #: the seqs of the relay's heartbeat records appended since the spool was opened
        #: and not yet deleted, in order (:meth:`append_batch` ``heartbeat``): a dropped
        #: segment's gap names them, so that the loss counters count events only
        self._heartbeat_seqs: list[int] = []
        #: heartbeat records deleted with a dropped segment (counted apart from the loss)
        self.dropped_heartbeats = 0
        self.writer: SegmentWriter | None = None

        self._lock_fd: int | None = lock_directory(self.directory, fs)
        try:
            raw_cursors = load_cursors(self.cursor_dir)
            found = recover(self.directory, raw_cursors, fs)
            self.corrupt_tails_cut = found.corrupt_tails_cut
            self.corrupt_bytes_cut = found.corrupt_bytes_cut
            self.ledger: Ledger = found.ledger()
            self.damage = Damage(self.ledger, found.gaps, self.errors.rlog)
            self.budget = SpaceBudget(self.directory, fs, self.ledger, max_bytes=max_bytes,
                                      policy=policy, segment_bytes=self.segment_bytes,
                                      monotonic=monotonic, live_bytes=self._live_bytes)
            self.writer = SegmentWriter(self.directory, fs, self.ledger, self.errors,
                                        self.budget, fsync=fsync,
                                        segment_age_s=segment_age_s, clock=clock,
                                        monotonic=monotonic)
            if on_seal:
                self.writer.seal_listeners.append(on_seal)
            self.writer.recover(found.active, found.to_seal)
            self.writer.save_state()
            for name in readers:
                pos, seq = place_cursor(self.ledger, self.writer.active, name,
                                        raw_cursors.get(name), fs)
                self.readers[name] = SpoolReader(self, name, pos,
                                                 min(seq, self.ledger.next_seq))
            for r in self.readers.values():
                if r.lost:
                    log.error("spool: output %s lost %d records that are not on disk (%s)",
                              r.name, r.lost, ", ".join(f"{k} {v}" for k, v in
                                                        sorted(r.lost_by_reason.items())))
                try:
                    r.persist(force=True)       # every reader has a durable cursor from now on
                except SpoolError:
                    pass
            self.budget.make_reserve()
            if not self.writer.seal_listeners:
                self.delete_acknowledged()
            # else: segments sealed by the recovery (or sealed before a crash that came
            # between the rename and the listener) were never announced; deleting them
            # now (at once when no output reads the spool) would lose them from the
            # archive too. The owner announces them (Archive.catch_up) and they are
            # deleted on the next seal or acknowledgement.
        except BaseException:
            if self.writer is not None:
                self.writer.close()
            self._release_lock()
            raise

    @property
    def cursor_dir(self) -> str:
        return os.path.join(self.directory, CURSOR_DIR)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            self.fs.close(self._lock_fd)
            self._lock_fd = None

    def _save_state(self) -> None:
        self.writer.save_state()

    # -- writing ----------------------------------------------------------------
    def append_batch(self, batch: Sequence[Sequence[bytes]], *,
                     heartbeat: bool = False) -> Position | None:
        """Append logjam messages (each exactly 4 frames: app_env, topic, body, meta)
        with one write.  Returns the position of the first record.  Raises
        :class:`SpoolWriteError` if it could not be handed to the OS.  ``heartbeat``: the
        records are the relay's heartbeats, no events: if their segment is dropped, the
        readers do not count them as lost (:attr:`dropped_heartbeats` does)."""
        if not batch:
            return None
        first = self.ledger.next_seq
        data = fmt.encode_logjam_batch(batch, first)
        pos = self._append_bytes(data, len(batch))
        self.ledger.note_meta(batch[-1][3])
        if heartbeat:
            self._heartbeat_seqs.extend(range(first, first + len(batch)))
        return pos

    def append_encoded(self, data: bytes, n: int, first_seq: int,
                       last_meta: bytes) -> Position | None:
        """Append ``n`` logjam records already encoded (the relay's C pass) as
        :func:`segment.encode_logjam_batch` encodes them from spool sequence ``first_seq``.
        One part numbers them, the one in front of the spool (relay/batchpath.py: the
        spool's :attr:`next_seq` with nothing appended between, or the group commit's):
        ``first_seq`` other than :attr:`next_seq` is that part's bug, refused with
        ValueError (nothing appended), never numbered again here."""
        if not n:
            return None
        if first_seq != self.ledger.next_seq:
            raise ValueError(f"append_encoded: {n} records numbered from {first_seq}, the "
                             f"spool's next is {self.ledger.next_seq}")
        pos = self._append_bytes(data, n)
        self.ledger.note_meta(last_meta)
        return pos

    def append_records(self, records: Sequence[tuple[int, Sequence[bytes]]]) -> Position | None:
        """Append ``(kind, frames)`` records of any kind / frame count with one write."""
        if not records:
            return None
        data = fmt.encode_records(records, self.ledger.next_seq)
        pos = self._append_bytes(data, len(records))
        for kind, frames in reversed(records):
            if kind == KIND_LOGJAM and len(frames) == 4:
                self.ledger.note_meta(frames[3])
                break
        return pos

    def append(self, frames: Sequence[bytes], kind: int = KIND_LOGJAM) -> Position:
        return self.append_records([(kind, frames)])

    def _append_bytes(self, data: bytes, n: int) -> Position:
        if self._closed:
            raise SpoolError("closed", "spool is closed")
        try:
            pos = self._append_once(data, n)
        except SpoolWriteError as e:
            if not is_disk_full(e):
                raise
            pos = self._append_on_full_disk(data, n, e)
        if self.budget.disk_full is not None:
            self.budget.freed()
        return pos

    def _append_once(self, data: bytes, n: int) -> Position:
        w = self.writer
        now_ms = w.now_ms()
        if w.roll_due(len(data), now_ms):
            w.roll()                          # with defer_seals: the seal runs off the loop
        if self.policy == "drop_oldest":
            self._make_room(len(data) + (fmt.HEADER_LEN if w.active is None else 0))
        return w.append(data, n, now_ms)

    def _append_on_full_disk(self, data: bytes, n: int, err: SpoolWriteError) -> Position:
        """ENOSPC: seal the active segment (so that it can be deleted once acknowledged;
        the seal's space comes from the reserve file), then with ``drop_oldest`` drop
        the oldest segments as the budget would; with ``block`` pause ingress."""
        budget, w = self.budget, self.writer
        budget.under_pressure()
        act = w.active
        if act is not None and act.count:
            try:
                w.seal_active()
                budget.enospc_seals += 1
            except SpoolWriteError:
                pass
        if self.policy == "drop_oldest":
            while True:
                oldest = next((s for s in self.ledger.segs.values() if s is not w.active), None)
                if oldest is None:
                    break
                self._drop_segments([oldest], "disk_full")
                budget.enospc_drops += 1
                try:
                    return self._append_once(data, n)
                except SpoolWriteError as e:
                    if not is_disk_full(e):
                        raise
                    err = e
        budget.mark_full()
        raise err

    def sync(self) -> None:
        """fdatasync the active segment now (if anything is unsynced)."""
        self.writer.sync()

    async def sync_async(self) -> None:
        """fdatasync what was appended so far, in a worker thread (the event loop runs on):
        everything appended before the call is durable when it returns
        (:meth:`SegmentWriter.sync_async`); raises :class:`SpoolWriteError` otherwise."""
        await self.writer.sync_async()

    def sync_begin(self) -> SyncJob | None:
        """:meth:`sync_async` started without waiting, or None where it must be awaited
        (:meth:`SegmentWriter.sync_begin <logjam_relay.spool.writer.SegmentWriter.sync_begin>`);
        ``await sync_end(job)`` then returns as ``sync_async`` does."""
        return self.writer.sync_begin()

    async def sync_end(self, job: SyncJob) -> None:
        await self.writer.sync_end(job)

    def sync_ready(self, job: SyncJob) -> bool:
        """``sync_end(job)`` would return without waiting."""
        return self.writer.sync_ready(job)

    # -- sealing ----------------------------------------------------------------
    def seal(self) -> None:
        """Seal the active segment now (no-op if there is none)."""
        if self.writer.active is not None:
            self.writer.seal_active()
            self.delete_acknowledged()

    def add_seal_listener(self, cb: Callable[[int, str], None]) -> None:
        """``cb(segno, path)`` is called right after a segment was sealed (before it can
        be deleted): e.g. the archive output hard-links ``path``."""
        self.writer.seal_listeners.append(cb)

    # -- space ------------------------------------------------------------------
    def would_block(self) -> bool:
        """True if ingress should pause (see :class:`SpaceBudget`)."""
        return self.budget.would_block()

    def paused_reason(self) -> str | None:
        """Why ingress is paused (for ``/readyz``), or None."""
        return self.budget.paused_reason()

    @property
    def full(self) -> bool:
        return self.budget.full

    async def wait_writable(self) -> None:
        """Return once :meth:`would_block` is false.  After a full disk it returns at
        least once a second so that the caller retries (space may be freed outside)."""
        await self.budget.wait_writable()

    def blocked_in_progress(self) -> float:
        """Seconds the current pause (in :meth:`wait_writable`) has lasted so far; the
        caller adds the whole pause to its own total when it ends."""
        return self.budget.blocked_in_progress()

    def _live_bytes(self) -> int:
        """Bytes from the slowest reader's cursor on (what ``block`` bounds)."""
        readers = self.readers.values()
        if not readers:
            act = self.writer.active
            return act.size if act is not None else 0
        low = min(r.acknowledged for r in readers)
        live = 0
        for seg in self.ledger.segs.values():
            if seg.segno > low.segment:
                live += seg.size
            elif seg.segno == low.segment:
                live += max(0, seg.size - max(0, low.offset - fmt.HEADER_LEN))
        return live

    def _make_room(self, need: int) -> None:
        drop = self.budget.to_drop(need, self.writer.active)
        if drop:
            self._drop_segments(drop, "dropped")

    def _drop_segments(self, segs: list[Seg], reason: str) -> None:
        """Delete segments no matter whether they were read (budget or full disk):
        what a reader had not acknowledged is counted as lost (served records when the
        reader rewinds without acknowledging them)."""
        before = {r: r.drop_marks() for r in self.readers.values()}
        for seg in segs:
            hb = self._heartbeats_in(seg.first_seq, seg.end_seq)
            self.dropped_heartbeats += len(hb)
            self.damage.add_gap(seg.first_seq, seg.end_seq, reason, not_events=hb)
            unacked = {r.name: max(0, seg.end_seq - max(r.acknowledged_seq, seg.first_seq))
                       for r in self.readers.values()}
            self._delete(seg)
            self.dropped_segments += 1
            self.errors.rlog.warning(
                "drop_" + reason, "spool: %s, dropped oldest segment %d (records %d..%d; not "
                "yet acknowledged: %s)", "disk full" if reason == "disk_full" else
                f"full ({self.ledger.bytes} bytes)", seg.segno, seg.first_seq,
                seg.end_seq - 1, ", ".join(f"{k} {v}" for k, v in unacked.items()) or "-")
        for r, (ack_seq, read_seq) in before.items():
            r.note_drop(ack_seq, read_seq)
        self._prune_gaps()

    def delete_acknowledged(self) -> None:
        """Delete the oldest sealed segments every reader has acknowledged."""
        readers = self.readers.values()
        for r in readers:
            r.normalize_ack()
        durable = False
        while self.ledger.segs:
            oldest = self.ledger.oldest()
            if not oldest.sealed or any(r.acknowledged.segment <= oldest.segno
                                        for r in readers):
                break
            if not durable:
                if not self._cursors_durable():
                    break                       # counted; deleted after a sync that worked
                durable = True
            self._delete(oldest)
            self.deleted_segments += 1
        self._prune_gaps()

    def _cursors_durable(self) -> bool:
        """Before an acknowledged segment is deleted, the cursors that allow it are made
        durable (written and fdatasynced; once per deleted segment, whatever ``fsync``
        says).  Otherwise a power loss could keep the deletion and lose the cursor: the
        restarted reader's cursor would point into the deleted segment, and records that
        were delivered would be reported lost."""
        ok = True
        for r in self.readers.values():
            r.persist_quiet()
            ok = r.sync_cursor() and ok
        return ok

    def _prune_gaps(self) -> None:
        """Forget gaps every reader's cursor (and pending drop) is past."""
        if self.damage.gaps:
            readers = self.readers.values()
            low = min((r.acknowledged_seq for r in readers), default=self.ledger.next_seq)
            low = min([low] + [r.pending_from() for r in readers if r.pending()])
            self.damage.prune(low)

    def _heartbeats_in(self, lo: int, hi: int) -> list[int]:
        """The heartbeat seqs in ``lo..hi-1`` (those appended since the spool was opened)."""
        hb = self._heartbeat_seqs
        return hb[bisect_left(hb, lo):bisect_left(hb, hi)]

    def _delete(self, seg: Seg) -> None:
        for r in self.readers.values():
            r.forget(seg.segno)
        try:
            self.fs.unlink(seg.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self.errors.count(_write_error("deleting", seg.path, e)) from None
        self.ledger.remove(seg)
        hb = self._heartbeat_seqs
        if hb and hb[0] < self.ledger.first_seq():
            del hb[:bisect_left(hb, self.ledger.first_seq())]   # live segments' only
        self.budget.freed()                   # space was freed: let ingress retry

    # -- damage -----------------------------------------------------------------
    def on_corrupt(self, reader: SpoolReader, seg: Seg, err: fmt.SegmentError) -> None:
        """A reader found a damaged record in ``seg``: the damage part skips the damaged
        stretch (or the rest of the segment) and registers it as a gap."""
        off, expect = reader.damaged_at(err)
        if seg is self.writer.active:
            try:
                self.writer.seal_active()
            except SpoolWriteError:
                pass
        self.damage.found(seg, off, expect, err,
                          lambda size, at: self.fs.pread(reader.fd_for(seg), size, at))
        reader.normalize_ack()
        reader.normalize_read()

    # -- periodic ---------------------------------------------------------------
    def tick(self) -> None:
        """Periodic work: interval fsync, roll by age, persist cursors, delete consumed."""
        if self._closed:
            return
        w = self.writer
        fsync = self.fsync
        if fsync.tick_syncs_interval() and w.interval_sync_due():
            w.sync()
        act = w.active
        if act is not None and act.count and \
                w.now_ms() - act.created_ms >= self.segment_age_s * 1000:
            if w.defer_seals:
                w.roll()
            else:
                self.seal()
        now = self.monotonic()
        for r in self.readers.values():
            if now - r.last_persist >= self.cursor_flush_s:
                r.persist_quiet()
        # cursor logs: write() on every ack; fdatasync per the fsync policy (interval off
        # the loop: run() does it, in a worker thread)
        if fsync.tick_syncs_cursors(now - self._last_cursor_sync):
            self._last_cursor_sync = now
            for r in self.readers.values():
                r.sync_cursor()
        if w.pending_seals:
            w.retry_pending_seals()
        if self.budget.reserve_due():
            self.budget.make_reserve()

    async def run(self, period: float = 0.25) -> None:
        """Call :meth:`tick` every ``period`` seconds (run it in the spool owner's nursery);
        with ``"interval"`` off the loop, the interval fdatasync too, in a worker thread.
        Where the syncs are off the loop (``fsync.seals_off_loop``), segment seals run
        off the loop too while it runs (:meth:`SegmentWriter.run_seals`)."""
        w = self.writer
        async with trio.open_nursery() as nursery:
            if not w.defer_seals and w.can_defer_seals():
                w.defer_seals = True            # one sealer (run() may run twice)
                nursery.start_soon(self._run_seals)
            await self._periodic(period)

    async def _run_seals(self) -> None:
        w = self.writer
        try:
            await w.run_seals(self._after_seal)
        finally:
            w.defer_seals = False
            if not self._closed:
                try:
                    w.finish_seals()
                except SpoolError:
                    pass                        # counted; close() leaves it to the recovery

    async def _after_seal(self) -> None:
        """A background seal is done: delete the sealed segments every reader has
        acknowledged, as :meth:`delete_acknowledged` does, with the cursor syncs and the
        unlinks (tens of ms for a big file on a busy disk) in worker threads."""
        readers = list(self.readers.values())
        if not readers:
            # as before background seals: a spool without readers deletes at an explicit
            # (or age) seal and at start, not at every roll (the unlink of a 64 MiB
            # segment, even in a thread, held ext4's journal under the appends: one-way
            # p99.9 at 100k msg/s 22-148 ms against 6 ms, bench_latency --targets batch)
            return
        for r in readers:
            r.normalize_ack()

        def deletable():
            oldest = self.ledger.oldest()
            if oldest is None or not oldest.sealed or oldest is self.writer.active or \
                    any(r.acknowledged.segment <= oldest.segno for r in readers):
                return None
            return oldest
        if deletable() is None:
            return
        durable = True
        for r in readers:                       # durable before the deletion (invariant 4)
            r.persist_quiet()
            durable = await r.sync_cursor_async() and durable
        if not durable:
            return                              # counted; deleted after a sync that worked
        while not self._closed and (seg := deletable()) is not None:
            for r in readers:
                r.forget(seg.segno)
            self.ledger.remove(seg)
            self.deleted_segments += 1
            try:
                await trio.to_thread.run_sync(self.fs.unlink, seg.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                self.errors.count(_write_error("deleting", seg.path, e))
            self.budget.freed()
        self._prune_gaps()

    async def _periodic(self, period: float) -> None:
        w = self.writer
        while True:
            try:
                fsync = self.fsync
                if fsync.run_syncs_interval and not self._closed and w.interval_sync_due():
                    await w.sync_async()
                if not self._closed and \
                        fsync.run_syncs_cursors(self.monotonic() - self._last_cursor_sync):
                    self._last_cursor_sync = self.monotonic()
                    for r in list(self.readers.values()):
                        await r.sync_cursor_async()
                self.tick()
            except SpoolWriteError:
                pass                            # counted and logged (rate-limited)
            except OSError as e:                # never the end of the relay: retried
                self.errors.count(_write_error("running periodic work in", self.directory, e))
            await trio.sleep(period)

    # -- info -------------------------------------------------------------------
    def reader(self, name: str) -> SpoolReader:
        try:
            return self.readers[name]
        except KeyError:
            raise KeyError(f"no spool reader {name!r} configured "
                           f"(have {sorted(self.readers)})") from None

    @property
    def next_seq(self) -> int:
        """The spool sequence number the next appended record gets."""
        return self.ledger.next_seq

    def last_meta(self) -> tuple[int, int, int, int, int, int] | None:
        """``(tag, compression, version, device, created_ms, sequence)`` of the last
        logjam record in the spool, or None."""
        m = self.ledger.last_meta
        if m is None or len(m) != _META.size:
            return None
        return _META.unpack(m)

    def last_sequence(self) -> int | None:
        m = self.last_meta()
        return None if m is None else m[5]

    def stats(self) -> dict:
        readers = {n: r.stats() for n, r in self.readers.items()}
        lost: dict[str, int] = {}
        for r in readers.values():
            for k, v in r["lost_by_reason"].items():
                lost[k] = lost.get(k, 0) + v
        w, budget = self.writer, self.budget
        return {
            "bytes": self.ledger.bytes,
            "max_bytes": self.max_bytes,
            "full": int(self.full),
            "segments": len(self.ledger.segs),
            "sealed_segments": w.sealed_segments,
            "deleted_segments": self.deleted_segments,
            "dropped_segments": self.dropped_segments,
            "dropped_heartbeats": self.dropped_heartbeats,
            "appends": w.appends,
            "append_batches": w.append_batches,
            "bytes_appended": w.bytes_appended,
            "fsyncs": w.fsyncs,
            "sync_seconds": w.sync_times.stats(),
            "corrupt_tails_cut": self.corrupt_tails_cut,
            "corrupt_bytes_cut": self.corrupt_bytes_cut,
            "corrupt_records": self.damage.corrupt_records,
            "write_errors": self.errors.total,
            "write_errors_by_reason": dict(self.errors.by_reason),
            "next_seq": self.ledger.next_seq,
            "readers": readers,
            "lost": sum(r["lost"] for r in readers.values()),
            "lost_by_reason": lost,
            "paused": int(self.would_block()),
            "disk_full": int(budget.disk_full is not None),
            "enospc_seals": budget.enospc_seals,
            "enospc_drops": budget.enospc_drops,
            "reserve_releases": budget.reserve_releases,
            "deferred_seals": w.deferred_seals,
            "cursor_writes": sum(r["cursor_writes"] for r in readers.values()),
        }

    # counters of the parts, as attributes of the spool (tests, tools)
    appends = property(lambda self: self.writer.appends)
    append_batches = property(lambda self: self.writer.append_batches)
    bytes_appended = property(lambda self: self.writer.bytes_appended)
    fsyncs = property(lambda self: self.writer.fsyncs)
    sealed_segments = property(lambda self: self.writer.sealed_segments)
    deferred_seals = property(lambda self: self.writer.deferred_seals)
    enospc_seals = property(lambda self: self.budget.enospc_seals)
    enospc_drops = property(lambda self: self.budget.enospc_drops)
    reserve_releases = property(lambda self: self.budget.reserve_releases)
    corrupt_records = property(lambda self: self.damage.corrupt_records)
    write_errors = property(lambda self: self.errors.total)
    write_errors_by_reason = property(lambda self: self.errors.by_reason)
    last_error = property(lambda self: self.errors.last)
    # the positions, under their old names (tests)
    _segs = property(lambda self: self.ledger.segs)
    _next_seq = property(lambda self: self.ledger.next_seq)
    _next_segno = property(lambda self: self.ledger.next_segno)
    _last_meta = property(lambda self: self.ledger.last_meta)
    _active = property(lambda self: self.writer.active)
    _unsynced = property(lambda self: self.writer.unsynced)

    # -- closing ----------------------------------------------------------------
    def close(self, seal: bool = False) -> None:
        """Sync, persist all cursors and release the directory.  The active segment stays
        open (``.open``) and is continued after the next start unless ``seal``."""
        if self._closed:
            return
        w = self.writer
        try:
            w.finish_seals(final=True)
            steps = [self.seal if seal else w.sync_on_close, w.retry_pending_seals,
                     *(r.persist for r in self.readers.values()), w.save_state]
            for step in steps:
                try:
                    step()
                except SpoolError:
                    pass                    # counted and logged; close releases everything
            if self.fsync.syncs:
                for r in self.readers.values():
                    r.sync_cursor()
        finally:
            self._closed = True
            for r in self.readers.values():
                r.close()
            w.close()
            self._release_lock()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
