"""The wire between the relay and an output's worker process (``outputs/worker.py``).

Wire format (both directions): ``<u32 length><u8 type><payload>``.  Both modes: the
relay's ``T_ACKED`` is ``>Q``, the number of the worker's ``T_ACK`` messages applied so
far.  Tail mode: a snapshot is
``pickle(((segno, path, limit, sealed, first_seq, holes), ...))``, an ack
``>QQ`` (segment, offset) or ``>QQQQ`` (segment, offset, record end, seq: the record
as the worker read it, so the relay's reader needs no disk read to move its cursor,
nor the segment, which may be gone), a damage report ``pickle((segno, offset, seq,
reason, msg))``, a skip report ``>qQ`` (the seq reading jumped from, -1 for the first
unacknowledged record; the seq it jumped to).
Ship mode: a batch of records
goes as ``pickle((batch_no, kinds, frames))``: the spool positions stay in the relay
(with the batch, until it is acknowledged) and the worker's records carry the position
``(batch_no, index)``, which orders like the real one; an ack ``(batch_no, index)`` is
mapped back to the record's spool position.  So no per-record tuple is built for the
wire: two list comprehensions and one pickle per batch (the relay's cost of feeding a
worker, measured with bench_durable.py).
"""

from __future__ import annotations

import struct

import trio

MAX_INFLIGHT = 20_000        # records handed to a worker and not yet acknowledged
BATCH = 2_000                # records per message to the worker
STATS_EVERY = 0.5

HDR = struct.Struct(">IB")
ACK = struct.Struct(">QQ")
ACK_KNOWN = struct.Struct(">QQQQ")     # tail mode: segment, offset, record end, seq
COUNT = struct.Struct(">Q")
T_CONFIG, T_RECORDS, T_STOP = ord("C"), ord("R"), ord("S")     # relay -> worker
T_SEGS = ord("G")                                              # relay -> worker (tail mode)
T_ACKED = ord("K")                                             # relay -> worker
T_ACK, T_STATS, T_DEAD = ord("A"), ord("T"), ord("D")          # worker -> relay
T_DAMAGE = ord("X")                                            # worker -> relay (tail mode)
T_SKIP = ord("K")                                              # worker -> relay (tail mode)
SKIP = struct.Struct(">qQ")            # seqs jumped over: from (-1: first unacked), to
# tail mode: at most one segment snapshot per this many seconds.  Each one is a send and
# a wake-up of the worker: at 3 ms they were ~11 % of the relay's CPU at full rate
# (bench_durable.py, py-spy); at 10 ms the workers also read larger batches (fewer
# windows/payloads and acks per event), and an event waits at most 10 ms more.
NOTIFY_EVERY = 0.010
IDLE_CHECK = 0.25            # tail mode: snapshot check without appends (seals, deletions)


def frame(kind: int, payload: bytes) -> bytes:
    return HDR.pack(len(payload) + 1, kind) + payload


async def read_messages(stream: trio.SocketStream, marks: bool = False):
    """Yield ``(type, payload)`` until EOF; with ``marks``, ``(None, b"")`` after the
    messages of each read (before the next read waits)."""
    buf = bytearray()
    while True:
        try:
            # 64 KiB: a 1 MiB receive buffer was allocated (and shrunk) for every few
            # bytes of an ack (~2 % of the relay at full rate, py-spy)
            data = await stream.receive_some(1 << 16)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return                      # the peer died (reset): like EOF
        if not data:
            return
        buf += data
        pos = 0
        n = len(buf)
        while n - pos >= 5:
            length, kind = HDR.unpack_from(buf, pos)
            if n - pos - 4 < length:
                break
            yield kind, bytes(buf[pos + 5:pos + 4 + length])
            pos += 4 + length
        del buf[:pos]
        if marks and pos:
            yield None, b""
