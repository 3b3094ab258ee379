"""The ingest hot path in one C loop: drain, stamp, publish and encode the spool records.

:func:`run` drives ``zmq_fast.ingest_pass`` (``io/_zmqfast.c``) for one drained batch of
a PULL or ROUTER socket: every message on the fast path of :mod:`.stamping` (known stream
and topic, good meta, the usual frames, none over ``max_event_bytes``) is stamped,
published on the XPUB and encoded as a spool record without becoming a Python object; a
ROUTER request's ``202 Accepted`` reply is collected for the caller to send once the
batch is in the spool.  What the loop does not take comes back here:

* a message off the fast path (first sight of a stream, legacy, ping, broken meta, too
  large...): it and the rest of the batch (drained the ordinary way, in order) are
  returned as ``leftover`` for :meth:`Relay._process` -- the sequence numbers stay in
  socket order;
* a record the XPUB refused (a subscriber at its HWM): sent lossy and counted by
  :meth:`PubSocket.publish_refused`, as :meth:`PubSocket.publish_batch` does (the
  relay's PUB hand-over refuses only when its thread is behind: the record is dropped,
  counted).

Sequence numbers, counters, published frames, replies and spool bytes are those of
``drain_bytes`` + :meth:`Pipeline.stamp_pull` / :meth:`Pipeline.prepare_router` +
:meth:`Pipeline.commit` + ``Spool.append_batch`` (tests/test_ingestpass.py runs both over
the same traffic).  Without the C socket loops (``zmq_fast.ingest_pass`` is None) the
relay uses those.  ``-x lz4`` compresses the uncompressed bodies inside the loop (the
same bytes as :meth:`Pipeline.compress_in_place`, counted the same); ``-x zlib`` and ``-x
snappy`` take the ordinary path and the compressor threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..io import zmq_fast
from ..protocols import logjam as L


@dataclass(slots=True)
class PassResult:
    stamped: int = 0                    # records stamped and published by the C loop
    spool: bytes | None = None          # their spool records (when spool_seq >= 0)
    spool_seq: int = -1                 # the spool sequence number of the first
    last_meta: bytes | None = None      # the meta frame of the last
    replies: list = field(default_factory=list)   # ROUTER: [id, app, 202] per request
    leftover: list | None = None        # messages for the ordinary path, in order
    oversize: bool = False              # a frame of leftover is over max_event


def available(compress: int = 0) -> bool:
    """Whether the C loop runs here, for ``-x`` ``compress`` (0: none; only LZ4 is
    compressed inside the loop -- zlib's cost per body belongs on the compressor threads)."""
    if zmq_fast.ingest_pass is None:
        return False
    return compress == 0 or (compress == L.LZ4_COMPRESSION and zmq_fast.LZ4)


def run(sock, pub, pipeline, limit: int, max_bytes: int, max_event: int, now_ms: int,
        spool_seq: int = -1, router: bool = False, compress: int = 0) -> PassResult:
    """One batch of at most ``limit`` messages / about ``max_bytes`` bytes from ``sock``
    (PULL, or ROUTER with ``router``) onto ``pub`` (a :class:`PubSocket`, or the hand-over
    of an XPUB's thread, :class:`~logjam_relay.io.xpubthread.ThreadedPub`); ``spool_seq``
    >= 0 encodes the spool records numbered from it.  ``pipeline.seq`` and its counters
    are up to date when this returns (the records are published)."""
    p = pipeline
    c = p.counters
    now8 = now_ms.to_bytes(8, "big")
    gs = p.validator.good_streams
    gt = p.validator.good_topics
    fast = zmq_fast.ingest_pass
    res = PassResult(spool_seq=spool_seq)
    replies = res.replies
    chunks: list[bytes] = []
    taken = total = 0
    while True:
        left = max_bytes - total if max_bytes > 0 else 0
        (consumed, nb, seq, nfast, nbytes, maxb, spool, last_meta, stop, extra, ncomp,
         cbytes) = fast(sock, pub.sock, limit - taken, left, max_event, gs, gt, p.device, p.seq,
                        now8, spool_seq + res.stamped if spool_seq >= 0 else -1, router,
                        replies, L.ACCEPTED, compress)
        if ncomp:
            c.compressed += ncomp
            c.compressed_bytes += cbytes
        taken += consumed
        total += nb
        p.seq = seq
        res.stamped += nfast
        if spool is not None:
            chunks.append(spool)
            res.last_meta = last_meta
        if router:
            c.router += consumed - (stop == 1)
        else:
            c.pull += consumed - (stop == 1)
        c.received += nfast
        c.published += nfast
        c.received_bytes += nbytes
        if maxb > c.received_max_bytes:
            c.received_max_bytes = maxb
        pub.published += nfast - (stop == 2)
        more = taken < limit and not (max_bytes > 0 and total >= max_bytes)
        if stop == 2:
            pub.publish_refused(extra)      # PUB: sent lossy; a hand-over: dropped
            if more:
                continue
        elif stop == 1:
            rest = []
            if more:
                rest, _, _ = zmq_fast.drain_bytes(sock, limit - taken,
                                                  max_bytes - total if max_bytes > 0 else 0)
            res.leftover = [extra, *rest]
            res.oversize = any(len(f) > max_event for m in res.leftover for f in m)
        break
    c.replies_202 += len(replies)
    if chunks:
        res.spool = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return res
