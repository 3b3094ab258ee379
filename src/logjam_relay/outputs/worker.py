"""An output in its own process (``output_isolation = "process"``).

Ingest and the outputs used to share one event-loop thread (and one GIL): with a
Lumberjack and a Courier output attached, the outputs' mapping, zlib and socket work
took most of that thread and ingest fell to a fraction of its bare rate (bench/RESULTS.md,
bench_durable.py).
Here each output runs in a worker process of its own; the relay keeps everything that
must stay in one place:

* the spool and the output's :class:`~logjam_relay.spool.reader.SpoolReader` (cursor,
  loss accounting, space management, damage handling) stay in the relay;
* **tail mode** (the relay's outputs): the worker reads the segment files itself
  (:class:`~logjam_relay.spool.tail.SegmentTail`, C record parser).  The relay only
  sends *snapshots* -- which segments exist, how far each is committed, sealed or not,
  the holes its damage handling registered -- after appends (at most one per
  ``NOTIFY_EVERY``) and every ``IDLE_CHECK`` (seals, deletions); the worker acks real
  spool positions, which the relay applies to the reader (``reader.ack``: cursor log,
  loss accounting).  A damaged record or a segment file that cannot be read is reported
  (``T_DAMAGE``); the relay runs the spool's damage handling as if its reader had found
  it (:func:`~logjam_relay.spool.tail.handle_damage`) and sends a new snapshot.  A
  segment deleted under the worker (``drop_oldest``) leaves the snapshot: the worker
  reads on from the next one and reports the seqs it jumped over (``T_SKIP``: lost);
  what it had read from the segment is lost only if it is never acknowledged.
  The relay's cost per record is then nothing but applying an ack per window;
* **ship mode** (any other reader, e.g. tests' in-memory sources): the relay side reads
  records and ships them to the worker in batches over the socket pair; the worker runs
  the output on a :class:`RemoteSource`, an in-memory reader (like ``MemorySource``)
  that keeps what it was given until it is acknowledged (so the output's own
  ``rewind()`` after a reconnect works locally) and sends every ``ack(position)`` back;
* either way the worker runs the unchanged output class (:func:`supervisor.make_output`);
* dead letters are sent back too and written by the relay's store, before any later ack
  (one ordered channel), so "acknowledged" still implies "delivered or dead-lettered";
* **acks are confirmed**: the relay answers the acks it applied (cursor log written)
  with their count (``T_ACKED``, one message for all the acks of one read from the
  socket), and the output takes new records from its reader only while at most
  ``UNCONFIRMED_ACKS`` of its acks are unconfirmed (:class:`ConfirmedReader`).  The
  acks on their way to the cursor log are then bounded by construction, not by how fast
  the relay's loop reads them: after a SIGKILL of the relay an output resends at most
  what it had in flight plus ``UNCONFIRMED_ACKS`` windows/payloads.  The cursor stays
  the relay's alone (loss accounting, space and damage handling depend on it); a worker
  only waits for it;
* the worker sends its ``stats()`` every 0.5 s; metrics and readiness read the last one.

Flow control (ship mode): at most ``MAX_INFLIGHT`` records are in the worker,
unacknowledged; in tail mode the worker holds what its output holds (a window or two).  A
worker that dies (crash, SIGKILL) makes :meth:`ProcessOutput.run` raise; the
supervisor restarts it from the acknowledged cursor (``reader.rewind()``), exactly as
for a crashed inline output.  ``request_shutdown()`` is passed on: the worker lets its
output finish what is in flight, sends the last acks and exits.

The wire and its messages: ``outputs/worker_wire.py``; the worker process:
``outputs/worker_process.py`` (``python -m logjam_relay.outputs.worker`` runs it, so the
process list names the module).
"""

from __future__ import annotations

import functools
import logging
import pickle
import socket
import sys
from collections import deque

import trio

from ..config import logformat
from ..fdreserve import RESERVE as _FDS
from ..spool.api import Position
from ..spool.errors import SpoolError
from .worker_wire import (
    ACK,
    ACK_KNOWN,
    BATCH,
    COUNT,
    IDLE_CHECK,
    MAX_INFLIGHT,
    NOTIFY_EVERY,
    SKIP,
    T_ACK,
    T_ACKED,
    T_CONFIG,
    T_DAMAGE,
    T_DEAD,
    T_RECORDS,
    T_SEGS,
    T_SKIP,
    T_STATS,
    T_STOP,
    frame,
    read_messages,
)

log = logging.getLogger("logjam_relay.outputs.worker")


class WorkerDied(RuntimeError):
    """The worker process ended without being asked to (the supervisor restarts it)."""


# ======================================================================= relay side


class ProcessOutput:
    """Stands for one output in the relay: the same ``run/request_shutdown/stats``
    surface as the output classes, the work done by a worker process."""

    def __init__(self, spec, reader, relay_host: str, *, dead_letters=None,
                 max_event_bytes: int | None = None, log_level: int | None = None):
        self.spec = spec
        self.name = spec.name
        self.reader = reader
        self.relay_host = relay_host
        self.dead_letters = dead_letters
        self.max_event_bytes = max_event_bytes
        self.log_level = log_level if log_level is not None else \
            logging.getLogger("logjam_relay").getEffectiveLevel()
        self.log_format = logformat.current_format()      # the relay's, for the worker
        self._stats: dict = {}
        self._stats_raw: bytes | None = None    # the worker's last stats, unpickled on demand
        self._inflight = 0
        # batches in the worker, unacknowledged: (batch_no, records) in order
        self._batches: deque[tuple[int, list]] = deque()
        self._batch_no = 0
        self._credit = trio.Event()
        self._stop_requested = False
        self._stream: trio.SocketStream | None = None
        self._send_lock = trio.Lock()
        self.pid: int | None = None
        self.records_shipped = 0
        self.acks_applied = 0
        # tail mode: the worker reads the segment files itself (spool/tail.py); the relay
        # sends segment snapshots and applies acks (real positions) to the reader
        self.tail = hasattr(reader, "_spool")
        if self.tail:
            reader.reads_elsewhere = True   # drops: what the worker read stays pending
        self._snap_sent = None
        self.snapshots_sent = 0
        self.damage_reports = 0
        self.bad_acks = 0
        # acks confirmed to the worker (in the cursor log): T_ACK messages applied so far
        self._acks_in = 0
        self._acks_applied = trio.Event()
        self.acks_confirmed = 0

    # -- the output surface ------------------------------------------------------
    def stats(self) -> dict:
        if self._stats_raw is not None:
            # the worker sends its stats with every ack: unpickled only when read
            self._stats, self._stats_raw = pickle.loads(self._stats_raw), None
        d = dict(self._stats)
        d["isolation"] = "process"
        d["worker_pid"] = self.pid or 0
        d["worker_inflight"] = self._inflight
        d["worker_mode"] = "tail" if self.tail else "ship"
        d["worker_snapshots_sent"] = self.snapshots_sent
        d["worker_bad_acks"] = self.bad_acks
        d["worker_acks_confirmed"] = self.acks_confirmed
        return d

    def request_shutdown(self) -> None:
        self._stop_requested = True
        stream = self._stream
        if stream is not None:
            try:
                trio.lowlevel.spawn_system_task(self._send_stop, stream)
            except RuntimeError:       # pragma: no cover - not inside trio
                pass

    async def _send_stop(self, stream) -> None:
        try:
            async with self._send_lock:
                await stream.send_all(frame(T_STOP, b""))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    async def run(self) -> None:
        # a socket pair and a child process: room from the fd reserve when the relay is out
        # of descriptors (the pair's two, the exec pipe's two, a pidfd)
        with _FDS.room(5):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            for s in (ours, theirs):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            fd = theirs.fileno()
            # the output's name on the command line: ps/top show which worker is which
            argv = [sys.executable, "-m", "logjam_relay.outputs.worker", str(fd), self.name]
            try:
                proc = await trio.lowlevel.open_process(argv, pass_fds=(fd,),
                                                        start_new_session=True)
            except BaseException:
                ours.close()
                raise
            finally:
                _FDS.close_socket(theirs)
        self.pid = proc.pid
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
        self._stream = stream
        self._inflight = 0
        self._batches.clear()
        self._acks_in = self.acks_confirmed = 0       # counted per worker process
        self._acks_applied = trio.Event()
        clean = False
        try:
            start = None
            if self.tail:
                r = self.reader
                # from the acknowledged cursor; what a previous worker held of dropped
                # segments is lost now (this one starts after it)
                r.rewind()
                start = (tuple(r.acknowledged), r.acknowledged_seq)
            cfg = (self.spec.name, self.spec.scheme, self.spec.url, self.relay_host,
                   self.max_event_bytes, self.dead_letters is not None, self.log_level,
                   start, self.log_format)
            await stream.send_all(frame(T_CONFIG, pickle.dumps(cfg)))
            self._snap_sent = None
            if self.tail:
                await self._send_snapshot(stream)
            if self._stop_requested:
                await self._send_stop(stream)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._notify if self.tail else self._feed, stream)
                nursery.start_soon(self._confirm_acks, stream)
                await self._receive(stream)           # until the worker closes
                nursery.cancel_scope.cancel()
            code = await proc.wait()
            clean = code == 0 and self._stop_requested
            if not clean:
                raise WorkerDied(f"output worker {self.name} (pid {proc.pid}) exited with "
                                 f"status {code}")
        finally:
            self._stream = None
            with trio.CancelScope(shield=True):
                await stream.aclose()          # the worker sees EOF and stops
                if proc.returncode is None:
                    with trio.move_on_after(2):
                        await proc.wait()
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()

    # -- pumps ---------------------------------------------------------------------
    async def _feed(self, stream) -> None:
        reader = self.reader
        dumps = pickle.dumps
        while not self._stop_requested:
            room = MAX_INFLIGHT - self._inflight
            if room <= 0:
                self._credit = trio.Event()
                await self._credit.wait()
                continue
            recs = reader.read(min(room, BATCH))
            if not recs:
                await reader.wait()
                continue
            self._batch_no += 1
            payload = dumps((self._batch_no, [r[1] for r in recs], [r[2] for r in recs]), 5)
            self._batches.append((self._batch_no, recs))
            self._inflight += len(recs)
            self.records_shipped += len(recs)
            try:
                async with self._send_lock:
                    await stream.send_all(frame(T_RECORDS, payload))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return                  # the worker died: _receive sees the end

    async def _send_snapshot(self, stream, force: bool = False) -> None:
        from ..spool.tail import snapshot
        r = self.reader
        snap = snapshot(r.ledger, r.acknowledged.segment)
        if snap == self._snap_sent and not force:
            return
        self._snap_sent = snap
        self.snapshots_sent += 1
        async with self._send_lock:
            await stream.send_all(frame(T_SEGS, pickle.dumps(snap, 5)))

    async def _notify(self, stream) -> None:
        """Tail mode: tell the worker which segments exist and how far each is
        committed, after appends (coalesced) and now and then (seals, deletions)."""
        ledger = self.reader.ledger
        try:
            while not self._stop_requested:
                with trio.move_on_after(IDLE_CHECK):
                    await ledger.appended.wait()
                await trio.sleep(NOTIFY_EVERY)
                await self._send_snapshot(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return                      # the worker died: _receive sees the end

    async def _confirm_acks(self, stream) -> None:
        """Tell the worker how many of its acks are applied, so that its output may read
        on (:class:`ConfirmedReader`).  Every ack of one read from the socket is confirmed
        by one message, sent by ``_receive`` or by this task.  Applied means in the cursor log
        (``reader.ack`` appends it; ``persist()`` makes sure of it when a reader
        rate-limits its cursor writes).  A cursor write that fails is counted and logged
        by the reader and confirmed all the same: the outputs go on draining (a stalled
        output would keep the disk full), the duplicates after a crash may then exceed
        the bound -- ``logjam_relay_spool_write_errors_total`` and the log say so."""
        try:
            while True:
                await self._acks_applied.wait()
                self._acks_applied = trio.Event()
                await self._send_confirm(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return                      # the worker died: _receive sees the end

    async def _send_confirm(self, stream) -> None:
        n = self._acks_in
        if n == self.acks_confirmed:
            return
        if self.tail:
            try:
                self.reader.persist()       # a no-op unless cursor writes are rate-limited
            except SpoolError:
                pass                        # counted and logged by the reader
        self.acks_confirmed = n
        async with self._send_lock:
            await stream.send_all(frame(T_ACKED, COUNT.pack(n)))

    async def _on_damage(self, stream, payload: bytes) -> None:
        """Tail mode: the worker found a damaged record or cannot open a segment:
        the relay's damage handling registers the gap (loss accounting), then the
        worker gets a fresh snapshot (with the hole, or without the segment)."""
        from ..spool.tail import handle_damage
        self.damage_reports += 1
        handle_damage(self.reader, *pickle.loads(payload))
        await self._send_snapshot(stream, force=True)

    async def _receive(self, stream) -> None:
        reader = self.reader
        unpack = ACK.unpack
        async for kind, payload in read_messages(stream, marks=True):
            if kind is None:
                # the end of one read: its acks are applied, confirm them now.  Tail mode:
                # the relay sends the worker only small messages, so this send does not
                # wait (one scheduler round sooner than _confirm_acks, which does it in
                # ship mode, where a send may wait behind records, and while a snapshot
                # is being sent)
                if self._acks_in != self.acks_confirmed:
                    if self.tail and not self._send_lock.locked():
                        try:
                            await self._send_confirm(stream)
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            return          # the worker died
                    else:
                        self._acks_applied.set()
                continue
            if kind == T_ACK:
                self._acks_in += 1          # confirmed at the end of this read
            if kind == T_ACK and self.tail:
                if len(payload) == ACK_KNOWN.size:        # with the record's end and seq
                    segno, off, end, seq = ACK_KNOWN.unpack(payload)
                    pos, known = Position(segno, off), (end, seq)
                else:
                    pos, known = Position(*unpack(payload)), None
                try:
                    reader.ack(pos, known)
                except ValueError as e:          # not a record: a worker bug, never fatal
                    self.bad_acks += 1
                    log.error("output %s: worker ack ignored: %s", self.name, e)
                    continue
                self.acks_applied += 1
            elif kind == T_DAMAGE:
                await self._on_damage(stream, payload)
            elif kind == T_SKIP and self.tail:
                lo, hi = SKIP.unpack(payload)
                reader.skipped(None if lo < 0 else lo, hi)
            elif kind == T_ACK:
                bno, idx = unpack(payload)
                real = self._position(bno, idx)
                if real is None:
                    continue                # not ours (an earlier worker's): ignore
                reader.ack(real)
                self.acks_applied += 1
                freed = 0
                batches = self._batches
                while batches and (batches[0][0] < bno or
                                   (batches[0][0] == bno and idx == len(batches[0][1]) - 1)):
                    freed += len(batches.popleft()[1])
                if freed:
                    self._inflight -= freed
                    self._credit.set()
            elif kind == T_STATS:
                self._stats_raw = payload
            elif kind == T_DEAD:
                output, reason, frames, rkind, detail, position = pickle.loads(payload)
                if position is not None and not self.tail:
                    real = self._position(*position)
                    position = tuple(real) if real is not None else None
                store = self.dead_letters
                if store is not None:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(functools.partial(
                            store.put, output, reason, frames, kind=rkind, detail=detail,
                            position=position))


    def _position(self, bno: int, idx: int):
        """The spool position of record ``idx`` of batch ``bno`` (None if unknown)."""
        for b, recs in self._batches:
            if b == bno:
                return recs[idx][0] if 0 <= idx < len(recs) else None
            if b > bno:
                break
        return None


def isolated_factory(spec, reader, relay_host: str, *, dead_letters=None,
                     max_event_bytes: int | None = None):
    """A factory for :class:`~logjam_relay.outputs.supervisor.OutputSupervisor`."""
    return lambda: ProcessOutput(spec, reader, relay_host, dead_letters=dead_letters,
                                 max_event_bytes=max_event_bytes)


if __name__ == "__main__":
    from .worker_process import main
    main()
