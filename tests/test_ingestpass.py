"""The relay's C ingest pass (io/_zmqfast.c ingest_pass, relay/ingestpass.py) against
the Python steps it replaces: drain_bytes + Pipeline.prepare_pull_py (PULL) or
prepare_router_py (ROUTER) + commit_py + PubSocket.publish_batch +
segment.encode_logjam_batch_py, over the same traffic on real sockets.  The reference is
the pure-Python twins, not the C ones (_stamp.c, _segenc.c): the ingest pass shares its
stamp and its record encoding with them (_c/meta.h, _c/record_crc.h), so a fault there
would be on both sides of a comparison with them.

Both sides must publish the same frames (byte for byte, in order), leave the same
sequence numbers and counters, produce the same spool bytes (CRC included) and ROUTER
replies, count the same HWM drops, and hand the messages off the fast path (with the rest
of their batch) to the ordinary path in socket order.  Fuzzed with random frame counts
and contents.
"""

from __future__ import annotations

import itertools
import random
import struct
import time

import pytest
import zmq

from conftest import require_native
from logjam_relay.io import zmq_fast, zmq_trio
from logjam_relay.io.xpubthread import ThreadedPub
from logjam_relay.protocols import logjam as L
from logjam_relay.relay import ingestpass
from logjam_relay.relay.stamping import Pipeline
from logjam_relay.spool import segment as fmt
from test_stamp import random_batch

MAX_EVENT = 2000
_names = itertools.count()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


class Side:
    """PUSH -> PULL (or DEALER -> ROUTER) in, XPUB (PubSocket) -> SUB out, a Pipeline."""

    def __init__(self, ctx, name: str, hwm: int = 0, router: bool = False, ring=False,
                 compress: int = 0):
        self.router = router
        self.replies: list[list[bytes]] = []
        self.pull = ctx.socket(zmq.ROUTER if router else zmq.PULL)
        self.push = ctx.socket(zmq.DEALER if router else zmq.PUSH)
        if router:
            self.push.setsockopt(zmq.ROUTING_ID, b"client-1")
        xpub, self.sub = ctx.socket(zmq.XPUB), ctx.socket(zmq.SUB)
        for s in (self.pull, self.push, xpub, self.sub):
            s.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.push.setsockopt(zmq.SNDHWM, 0)
        xpub.setsockopt(zmq.SNDHWM, hwm)
        self.sub.setsockopt(zmq.RCVHWM, hwm)
        self.pull.bind(f"inproc://in-{name}")
        self.push.connect(f"inproc://in-{name}")
        xpub.bind(f"inproc://out-{name}")
        self.sub.connect(f"inproc://out-{name}")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        if ring:       # the relay's default: the XPUB on its own thread, fed by a ring
            self.pub = ThreadedPub(xpub, None, name=name, hwm=hwm, ring=True)
            self.pub.start()
            t0 = time.monotonic()
            while not self.pub.subscriptions:
                assert time.monotonic() - t0 < 10, "no subscription"
                time.sleep(0.01)
        else:
            self.pub = zmq_trio.PubSocket(xpub)
            assert xpub.poll(2000)
            self.pub.poll_subscriptions()
        self.p = Pipeline(7, 1000, self.pub.publish_batch, fqdn=b"vm", compress_method=compress)
        self.spool = b""
        self.spool_seq = 50

    def feed(self, msgs):
        for m in msgs:
            self.push.send_multipart(m)

    def received(self) -> list[list[bytes]]:
        out = []
        while self.sub.poll(50):
            out.append(self.sub.recv_multipart())
        return out

    def spool_records(self, records):
        if records:
            self.spool += fmt.encode_logjam_batch_py(records, self.spool_seq)
            self.spool_seq += len(records)

    def state(self):
        c = self.p.counters
        counters = {k: (dict(v) if hasattr(v, "items") else v)
                    for k in c.__slots__ for v in [getattr(c, k)]}
        return (self.p.seq, counters, self.pub.published, self.pub.drops, self.spool,
                self.replies)

    def stamp(self, batch, now):
        # the relay's ordinary path (app.py), in pure Python: prepare, -x compress,
        # commit (Pipeline.stamp_pull is prepare + commit, tests/test_stamp.py)
        p = self.p
        acc = p.prepare_router_py(batch, self.replies) if self.router \
            else p.prepare_pull_py(batch)
        if not acc:
            return []
        idx = p.needs_compression(acc)
        if idx:
            p.compress_in_place(acc, idx)
            p.count_compressed(acc, idx)
        return p.commit_py(acc, now)


def reference_round(s: Side, limit: int, max_bytes: int, now: int) -> int:
    batch, _, _ = zmq_fast.drain_bytes(s.pull, limit, max_bytes)
    if batch:
        s.spool_records(s.stamp(batch, now))
    return len(batch)


def fused_round(s: Side, limit: int, max_bytes: int, now: int, spool: bool = True) -> int:
    r = ingestpass.run(s.pull, s.pub, s.p, limit, max_bytes, MAX_EVENT, now,
                       s.spool_seq if spool else -1, s.router, s.p.compress_method)
    s.replies += r.replies
    if r.stamped and spool:
        assert r.spool_seq == s.spool_seq
        recs, pos, status = fmt.parse_records(r.spool, 0, len(r.spool), 1 << 30)
        assert status is None and pos == len(r.spool) and len(recs) == r.stamped
        assert r.last_meta == recs[-1][3][3]
        s.spool += r.spool
        s.spool_seq += r.stamped
    elif spool:
        assert r.spool is None
    if r.leftover:
        assert r.oversize == any(len(f) > MAX_EVENT for m in r.leftover for f in m)
        recs = s.stamp(r.leftover, now)
        if spool:
            s.spool_records(recs)
    return r.stamped + len(r.leftover or ())


def drive(round_fn, s: Side, msgs, limit, max_bytes, now, **kw):
    s.feed(msgs)
    got = 0
    while got < len(msgs):
        n = round_fn(s, limit, max_bytes, now, **kw)
        if not n:
            assert s.pull.poll(2000), "messages did not arrive"
        got += n
    assert round_fn(s, limit, max_bytes, now, **kw) == 0


def fuzz_batch(rnd: random.Random, n: int) -> list[list[bytes]]:
    out = random_batch(rnd, n)
    for m in out:
        r = rnd.random()
        if r < 0.05:            # random bytes in a random frame
            k = rnd.randrange(len(m))
            m[k] = rnd.randbytes(rnd.choice((0, 1, 23, 24, 25, 100)))
        elif r < 0.08:          # a frame over max_event
            m[rnd.randrange(len(m))] = b"x" * (MAX_EVENT + 1)
        elif r < 0.10:          # 5 to 8 frames
            m.extend(rnd.randbytes(3) for _ in range(rnd.randint(1, 4)))
    return out


def as_router(rnd: random.Random, msgs):
    """DEALER messages: requests (an empty frame first: replies due) and async ones."""
    return [[b"", *m] if rnd.random() < 0.5 else m for m in msgs]


def compare(ctx, msgs, limit, max_bytes, hwm=0, spool=True, router=False, ring=False,
            compress=0):
    require_native(zmq_fast.ingest_pass, f"logjam_relay.io._zmqfast ({zmq_fast.WHY_NOT})")
    now = 1_750_000_000_000
    tag = next(_names)
    ref = Side(ctx, f"ref{tag}", hwm, router, compress=compress)
    got = Side(ctx, f"got{tag}", hwm, router, ring=ring, compress=compress)
    drive(reference_round, ref, msgs, limit, max_bytes, now)
    drive(fused_round, got, msgs, limit, max_bytes, now, spool=spool)
    if ring:
        assert got.pub.close(), "the XPUB thread did not stop"   # forwards all first
    assert got.received() == ref.received()
    want = ref.state()
    if not spool:
        want = (*want[:4], b"", want[5])
    assert got.state() == want
    return ref


@pytest.mark.parametrize("seed", range(6))
def test_same_as_drain_stamp_publish_encode(ctx, seed):
    rnd = random.Random(seed)
    msgs = fuzz_batch(rnd, 600)
    ref = compare(ctx, msgs, rnd.choice((1, 7, 100, 1024)), rnd.choice((0, 3000, 1 << 20)))
    c = ref.p.counters
    assert c.received > 300 and c.invalid > 0 and c.legacy > 0    # both paths exercised


@pytest.mark.parametrize("seed", range(6))
def test_router_same_as_prepare_commit_with_replies(ctx, seed):
    rnd = random.Random(100 + seed)
    msgs = as_router(rnd, fuzz_batch(rnd, 600))
    ref = compare(ctx, msgs, rnd.choice((1, 7, 100, 1024)), rnd.choice((0, 3000, 1 << 20)),
                  router=True)
    c = ref.p.counters
    assert c.received > 300 and c.invalid > 0 and c.replies_202 > 100
    assert c.replies_400 > 0 and len(ref.replies) == c.replies_202 + c.replies_400 + \
        sum(1 for r in ref.replies if r[-1] == b"200 OK")


@pytest.mark.parametrize("router", [False, True])
def test_through_the_hand_over_ring_same_as_on_the_pub(ctx, router):
    """The relay's default: the ingest pass moves the frames into the XPUB thread's ring
    (and the ordinary path copies records in); the subscriber gets the same."""
    rnd = random.Random(300 + router)
    msgs = fuzz_batch(rnd, 2000)
    if router:
        msgs = as_router(rnd, msgs)
    ref = compare(ctx, msgs, rnd.choice((7, 100, 1024)), 1 << 20, router=router, ring=True)
    assert ref.p.counters.received > 1000 and ref.p.counters.invalid > 0


@pytest.mark.parametrize("router", [False, True])
def test_x_lz4_inside_the_loop_same_as_the_compressor_path(ctx, router):
    """-x lz4: the loop compresses the uncompressed bodies itself; published frames, spool
    bytes and counters are those of prepare + compress_in_place + commit."""
    require_native(zmq_fast.LZ4 or None, "python-lz4's liblz4 for the ingest pass")
    assert ingestpass.available(L.LZ4_COMPRESSION) and not ingestpass.available(
        L.ZLIB_COMPRESSION)
    rnd = random.Random(400 + router)
    msgs = fuzz_batch(rnd, 1500)
    for m in msgs[::7]:          # empty and large bodies too
        if len(m) == 4:
            m[2] = b"" if rnd.random() < 0.3 else rnd.randbytes(1500) * 1
    if router:
        msgs = as_router(rnd, msgs)
    ref = compare(ctx, msgs, rnd.choice((7, 100, 1024)), 1 << 20, router=router,
                  compress=L.LZ4_COMPRESSION)
    c = ref.p.counters
    assert c.compressed > 300 and c.received > 600 and c.invalid > 0


def test_x_lz4_in_the_loop_gives_the_batch_compressors_bytes_across_sizes(ctx):
    """-x lz4 in the loop: every body's block equals the relay's other LZ4 path's (the
    batch compressor, relay/_recompress.c: both call LZ4_compress_default) and decompresses
    to the body, in any order of sizes -- below and above 64 KiB, where LZ4 switches its
    hash table's kind -- and of contents (text that compresses, bytes that do not).
    python-lz4's own compress() (the pure-Python fallback) uses LZ4's streaming call,
    whose blocks differ for text under 64 KiB: equal content, other bytes (docs).  A kept
    state with LZ4_compress_fast_extState_fastReset (27 % faster) gives other bytes again
    for text after the first body: not used."""
    from logjam_relay.relay import stamping
    require_native(stamping._recompress, "logjam_relay.relay._recompress")
    require_native(zmq_fast.LZ4 or None, "python-lz4's liblz4 for the ingest pass")
    rnd = random.Random(77)
    words = [rnd.randbytes(rnd.randint(2, 9)).hex().encode() for _ in range(300)]

    def body(n: int) -> bytes:
        if rnd.random() < 0.25:
            return rnd.randbytes(n)
        out = bytearray()
        while len(out) < n:
            out += rnd.choice(words) + b" "
        return bytes(out[:n])

    sizes = [0, 1, 12, 13, 100, 1500, 65535, 65536, 65537, 70000, 200_000, 5, 64_000]
    sizes += [rnd.choice((rnd.randint(0, 3000), rnd.randint(60_000, 140_000)))
              for _ in range(150)]
    bodies = [body(n) for n in sizes]
    meta = struct.pack(">HBBIQQ", 0xCABD, 0, 1, 0, 1700000000123, 1)
    s = Side(ctx, "lz4-sizes", compress=L.LZ4_COMPRESSION)
    now = 1_750_000_000_000
    # the first message of a stream is the Python path's (it learns the stream name)
    drive(fused_round, s, [[b"shop-production", b"logs.shop", b"warm-up", meta]], 1, 0,
          now, spool=False)
    assert len(s.received()) == 1
    s.feed([[b"shop-production", b"logs.shop", b_, meta] for b_ in bodies])
    got, in_c = [], 0
    while len(got) < len(bodies):
        r = ingestpass.run(s.pull, s.pub, s.p, 64, 0, 1 << 20, now, -1, False,
                           L.LZ4_COMPRESSION)
        assert not r.leftover
        in_c += r.stamped
        if not r.stamped:
            assert s.pull.poll(2000), "messages did not arrive"
        got += s.received()
    assert in_c == len(bodies)
    blocks = [m[2] for m in got]
    assert blocks == stamping._recompress.compress_batch(bodies, L.LZ4_COMPRESSION)
    assert [L.decompress(b_, L.LZ4_COMPRESSION, 1 << 20) for b_ in blocks] == bodies
    assert all(m[3][2] == L.LZ4_COMPRESSION for m in got)


def test_all_fast_without_spool(ctx):
    meta = struct.pack(">HBBIQQ", 0xCABD, 2, 1, 9, 0, 5)
    msgs = [[b"shop-production", b"logs.shop", b"%d" % i * 30, meta] for i in range(3000)]
    compare(ctx, msgs, 1024, 32 << 20, spool=False)


def test_subscriber_at_hwm_is_counted_and_sent_lossy(ctx):
    meta = struct.pack(">HBBIQQ", 0xBDCA, 0, 1, 0, 1700000000123, 1)
    msgs = [[b"shop-production", b"logs.shop", b"body %d" % i, meta] for i in range(400)]
    ref = compare(ctx, msgs, 1024, 0, hwm=10)
    assert ref.pub.drops > 0


def test_no_byte_bound_and_one_message_batches(ctx):
    rnd = random.Random(99)
    compare(ctx, fuzz_batch(rnd, 200), 1, 0)
    compare(ctx, as_router(rnd, fuzz_batch(rnd, 200)), 1, 0, router=True)


def test_router_subscriber_at_hwm_and_no_spool(ctx):
    meta = struct.pack(">HBBIQQ", 0xCABD, 0, 1, 0, 0, 1)
    msgs = [[b"", b"shop-production", b"logs.shop", b"body %d" % i, meta] for i in range(300)]
    ref = compare(ctx, msgs, 64, 0, hwm=10, spool=False, router=True)
    assert ref.pub.drops > 0 and len(ref.replies) == 300
