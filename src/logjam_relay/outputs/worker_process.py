"""The worker process of an output (``output_isolation = "process"``; the relay side
and the design are in ``outputs/worker.py``, the messages in ``outputs/worker_wire.py``).

``python -m logjam_relay.outputs.worker FD NAME`` runs :func:`main`: the output, on a
:class:`RemoteSource` (ship mode) or a :class:`~logjam_relay.spool.tail.SegmentTail`
(tail mode) behind a :class:`~logjam_relay.outputs.ackgate.ConfirmedReader`, acks,
stats and dead letters sent back over the socket pair ``FD``.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import sys
import threading

import trio

from ..config import logformat
from ..spool.api import Position, Record
from .ackgate import ConfirmedReader
from .worker_wire import (
    ACK,
    ACK_KNOWN,
    COUNT,
    SKIP,
    STATS_EVERY,
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


class RemoteSource:
    """The worker's spool reader: records given by the relay, kept until acknowledged."""

    def __init__(self, name: str, send_ack):
        self.name = name
        self._records: list[Record] = []    # [_head:] unacknowledged, in order
        self._head = 0
        self._read = 0                      # index into _records of the next read
        self._event = trio.Event()
        self._send_ack = send_ack
        self.records_received = 0
        self.acks = 0

    def add(self, batch_no: int, kinds: list[int], frames: list) -> None:
        """Records of one batch; positions ``(batch_no, index)`` (see the module doc)."""
        tnew = tuple.__new__
        self._records.extend([tnew(Record, (tnew(Position, (batch_no, i)), k, f))
                              for i, (k, f) in enumerate(zip(kinds, frames, strict=True))])
        self.records_received += len(frames)
        self._event.set()

    def read(self, max_records: int) -> list[Record]:
        start = self._read
        out = self._records[start:start + max_records]
        self._read = start + len(out)
        return out

    async def wait(self) -> None:
        while self._read >= len(self._records):
            self._event = trio.Event()
            await self._event.wait()

    def ack(self, upto: Position) -> None:
        recs = self._records
        head = old = self._head
        n = len(recs)
        while head < n and recs[head][0] <= upto:
            head += 1
        if head == old:
            return
        if self._read < head:
            self._read = head
        if head >= 4096 and head * 2 >= n:       # drop the acknowledged front now and then
            del recs[:head]
            self._read -= head
            head = 0
        self._head = head
        self.acks += 1
        self._send_ack(upto)

    def rewind(self) -> None:
        self._read = self._head

    def stats(self) -> dict:
        return {"worker_buffered": len(self._records) - self._head, "worker_acks": self.acks}


class DeadLetterProxy:
    """The store interface the output's DeadLetterSink calls (from a worker thread):
    each letter goes to the relay, which writes it to its store."""

    def __init__(self, send):
        self._send = send
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, str], int] = {}

    def put(self, output, reason, frames, *, kind=0, detail="", position=None):
        with self._lock:
            self.counts[(output, reason)] = self.counts.get((output, reason), 0) + 1
        self._send(T_DEAD, pickle.dumps((output, reason, [bytes(f) for f in frames], kind,
                                         detail, position)))
        return None

    def count_for(self, output: str) -> dict[str, int]:
        with self._lock:
            return {r: n for (o, r), n in self.counts.items() if o == output}


async def worker_main(fd: int) -> int:
    from .supervisor import OutputSpec, make_output
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    # acks, stats and dead letters are written synchronously (small, in order, callable
    # from the output's worker threads too); the socket stays non-blocking for trio's
    # reads, so a full buffer is waited out with poll()
    out_lock = threading.Lock()
    poller = select.poll()
    poller.register(fd, select.POLLOUT)

    def send(kind: int, payload: bytes) -> None:
        send_raw(frame(kind, payload))

    def send_raw(data: bytes) -> None:
        data = memoryview(data)
        with out_lock:
            while data:
                try:
                    data = data[sock.send(data):]
                except BlockingIOError:
                    poller.poll(1000)
                except (BrokenPipeError, ConnectionResetError):
                    # the relay is gone (SIGKILL): no one to ack for; its successor
                    # starts from the durable cursor.  Also from the output's threads.
                    os._exit(0)

    messages = read_messages(stream)
    try:
        kind, payload = await messages.__anext__()
    except StopAsyncIteration:
        # the relay went away (SIGKILL) before it sent the configuration: nothing to do
        return 0
    if kind != T_CONFIG:
        raise RuntimeError("output worker: no configuration received")
    name, scheme, url, relay_host, max_event_bytes, with_dead, level, start, log_format = \
        pickle.loads(payload)
    logformat.setup(level, log_format, worker=name)     # the relay's format (json: "worker")
    ack = ACK.pack
    output = None

    def stats_frame() -> bytes:
        st = dict(output.stats())
        st.update(reader.stats())
        return frame(T_STATS, pickle.dumps(st))

    ack_known = ACK_KNOWN.pack

    reader = ConfirmedReader()          # what the output reads from (the source, gated)

    def send_ack(pos, known=None) -> None:
        # the stats go with the ack (one write): once the relay's cursor has moved, its
        # metrics show what moved it (outputs count before they ack); acks come per
        # window or payload, so this costs little.  ``known`` (tail mode): the record's
        # end and seq, so the relay moves its cursor without reading the disk
        data = frame(T_ACK, ack(pos[0], pos[1]) if known is None else
                      ack_known(pos[0], pos[1], known[0], known[1]))
        reader.sent += 1
        send_raw(data + stats_frame() if output is not None else data)

    if start is not None:               # tail mode: read the segment files here
        from ..spool.tail import SegmentTail
        source = SegmentTail(name, Position(*start[0]), start[1], send_ack,
                             lambda *damage: send(T_DAMAGE, pickle.dumps(damage)),
                             lambda lo, hi: send(T_SKIP, SKIP.pack(
                                 -1 if lo is None else lo, hi)))
    else:
        source = RemoteSource(name, send_ack)
    reader.source = source
    dead = DeadLetterProxy(send) if with_dead else None
    output = make_output(OutputSpec(name, scheme, url), reader, relay_host, dead_letters=dead,
                         max_event_bytes=max_event_bytes)
    if hasattr(output, "thread_compress_min"):
        # nothing else runs on this loop: a Lumberjack window is compressed on it, not in
        # a thread of its own (which cost a thread start and two wake-ups per window, and
        # the worker sat idle meanwhile; bench_durable.py: less CPU per event, more ev/s)
        output.thread_compress_min = float("inf")
    from ..gc_tuning import tune_gc
    tune_gc()

    async def receive(cancel_scope):
        async for kind, payload in messages:
            if kind == T_SEGS:
                source.update(pickle.loads(payload))
            elif kind == T_ACKED:
                reader.confirm(COUNT.unpack(payload)[0])
            elif kind == T_RECORDS:
                source.add(*pickle.loads(payload))
            elif kind == T_STOP:
                if hasattr(output, "request_shutdown"):
                    output.request_shutdown()
                else:
                    cancel_scope.cancel()
        cancel_scope.cancel()               # the relay went away: stop

    async def report():
        while True:
            send_raw(stats_frame())
            await trio.sleep(STATS_EVERY)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive, nursery.cancel_scope)
        nursery.start_soon(report)
        await output.run()
        nursery.cancel_scope.cancel()
    send_raw(stats_frame())
    return 0


def keep_freed_memory() -> bool:
    """glibc: serve allocations up to 32 MiB from the heap and keep up to 64 MiB freed
    there, instead of mmap()/munmap() or trimming per allocation.  A worker allocates and
    frees the same large blocks over and over (a zlib compressor's ~270 KiB state and a
    window's frames per window or payload); each round trip through the kernel cost ~90
    page faults per Lumberjack window (~7 % of the worker's CPU: exc_page_fault and
    clear_page in ``perf``).  The price: a worker's RSS stays at its peak (a few MiB more).
    False where ``mallopt`` is not there (not glibc)."""
    try:
        import ctypes
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and \
        bool(mallopt(M_TRIM_THRESHOLD, 64 << 20))


def main() -> None:
    keep_freed_memory()
    # The relay decides when a worker stops (T_STOP, or EOF when the relay is gone), also
    # when a service manager signals the whole process group/cgroup: the relay then
    # stops its outputs gracefully and the workers' last acks still reach the cursor.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(trio.run(worker_main, int(sys.argv[1])))
