"""Pipeline.stamp_pull (C loop, relay/_stamp.c) and the C prepare_pull + commit (the -x
path) against prepare_pull_py + commit_py (Python).

Random PULL batches mixing the fast path with everything that must leave it (new
streams and topics, legacy 3-frame messages, pings, broken meta, wrong frame counts,
zero created times, both tag byte orders, compression bytes): both paths must give the
same records (byte for byte), the same published batches, the same sequence numbers and
the same counters.
"""

import random
import struct

import pytest

from conftest import require_native
from logjam_relay.relay import stamping
from logjam_relay.relay.stamping import Pipeline


def meta(tag=0xCABD, comp=0, ver=1, dev=0, created=1700000000123, seq=1) -> bytes:
    return struct.pack(">HBBIQQ", tag, comp, ver, dev, created, seq)


def random_batch(rnd: random.Random, n: int) -> list[list[bytes]]:
    streams = [b"shop-production", b"api-staging", b"x-y", b"noenv", b""]
    topics = [b"logs.shop", b"logs.api.x", b"javascript", b"events", b"bad topic", b""]
    out = []
    for _ in range(n):
        r = rnd.random()
        a, t = rnd.choice(streams[:3]), rnd.choice(topics[:3])
        body = b'{"n":%d}' % rnd.getrandbits(20)
        if r < 0.75:
            m = meta(tag=rnd.choice((0xCABD, 0xBDCA)), comp=rnd.choice((0, 0, 1, 2, 3)),
                     created=rnd.choice((0, 1700000000123, 1)), seq=rnd.getrandbits(32))
            out.append([a, t, body, m])
        elif r < 0.80:
            out.append([a, t, body])                                   # legacy
        elif r < 0.85:
            out.append([rnd.choice(streams), b"ping", b"", meta()])    # ping
        elif r < 0.90:
            out.append([a, t, body, meta(ver=2)])                      # broken meta
        elif r < 0.93:
            out.append([a, t, body, b"short"])
        elif r < 0.96:
            out.append([rnd.choice(streams), rnd.choice(topics), body, meta()])
        else:
            out.append([a] * rnd.randint(1, 6))                        # frame count
    return out


def run(pipeline_cls_path: str, batches, now):
    published = []
    p = Pipeline(7, 1000, published.append, fqdn=b"vm")
    records = []
    for batch in batches:
        if pipeline_cls_path == "two-step":
            acc = p.prepare_pull_py(batch)
            records.append(p.commit_py(acc, now) if acc else [])
        elif pipeline_cls_path == "c-two-step":
            acc = p.prepare_pull(batch)
            records.append(p.commit(acc, now) if acc else [])
        else:
            records.append(p.stamp_pull(batch, now))
    c = p.counters
    counters = {k: (dict(v) if hasattr(v, "items") else v)
                for k in c.__slots__ for v in [getattr(c, k)]}
    return records, published, p.seq, counters


@pytest.mark.parametrize("seed", range(8))
def test_stamp_pull_equals_prepare_and_commit(seed):
    require_native(stamping._stamp, "logjam_relay.relay._stamp")
    rnd = random.Random(seed)
    batches = [random_batch(rnd, rnd.randint(0, 300)) for _ in range(6)]
    now = 1_750_000_000_000 + seed
    ref = run("two-step", batches, now)
    for how in ("fused", "c-two-step"):
        got = run(how, batches, now)
        assert got[0] == ref[0]          # records, batch by batch
        assert got[1] == ref[1]          # what was published
        assert got[2] == ref[2]          # last sequence
        assert got[3] == ref[3]          # every counter
    assert sum(map(len, ref[0])) > 0 and ref[3]["invalid"] > 0   # both paths exercised


def test_c_prepare_pull_gives_the_python_tuples():
    require_native(stamping._stamp, "logjam_relay.relay._stamp")
    rnd = random.Random(3)
    for _ in range(5):
        batch = random_batch(rnd, 300)
        ref = Pipeline(7, 1, lambda r: None, fqdn=b"vm")
        got = Pipeline(7, 1, lambda r: None, fqdn=b"vm")
        for _ in range(2):                 # first sight of the streams, then known ones
            assert got.prepare_pull(batch) == ref.prepare_pull_py(batch)
        assert vars_of(got.counters) == vars_of(ref.counters)


def test_c_prepare_router_gives_the_python_tuples_and_replies():
    require_native(stamping._stamp, "logjam_relay.relay._stamp")
    rnd = random.Random(4)
    for _ in range(5):
        batch = []
        for m in random_batch(rnd, 300):
            ident = b"id-%d" % rnd.randrange(5)
            r = rnd.random()
            batch.append([ident, b"", *m] if r < 0.5 else [ident, *m] if r < 0.95
                         else [ident, b"x", *m])      # not a request: no empty frame
        batch.append([b"id-big", b"", b"nope-env", b"logs.x", b"y" * 5000, meta()])
        ref = Pipeline(7, 1, lambda r: None, fqdn=b"vm")
        got = Pipeline(7, 1, lambda r: None, fqdn=b"vm")
        for _ in range(2):                 # first sight of the streams, then known ones
            r_ref, r_got = [], []
            assert got.prepare_router(batch, r_got) == ref.prepare_router_py(batch, r_ref)
            assert r_got == r_ref
        assert vars_of(got.counters) == vars_of(ref.counters)
        assert ref.counters.replies_202 > 100 and ref.counters.replies_400 > 0


def test_largest_body_counts_slow_path_messages_too():
    """received_max_bytes is the largest body seen, whichever path took the message."""
    for method in ("prepare_pull", "prepare_pull_py"):
        p = Pipeline(7, 1, lambda r: None, fqdn=b"vm")
        getattr(p, method)([[b"shop-production", b"logs.shop", b"b" * 10, meta()]])
        getattr(p, method)([[b"shop-production", b"logs.shop", b"b" * 10, meta()],
                            [b"shop-production", b"logs.shop", b"b" * 900],   # legacy
                            [b"shop-production", b"logs.shop", b"b" * 20, meta()]])
        assert p.counters.received_max_bytes == 900, method


def vars_of(c):
    return {k: getattr(c, k) for k in c.__slots__}


COMMIT_CASES = [
    [(b"a", b"t", b"b", 3, b"\0" * 8), (b"a", b"t", b"", 255, b"12345678")],
    [(b"a", b"t", b"b", 256, b"\0" * 8)],                   # compression out of range
    [(b"a", b"t", b"b", -1, b"\0" * 8)],
    [(b"a", b"t", b"b", True, b"\0" * 8)],
    [(b"a", b"t", b"b", 1, b"short")],                        # created not 8 bytes
    [(b"a", b"t", b"b", 1)],                                  # not 5 fields
    [[b"a", b"t", b"b", 1, b"\0" * 8]],                      # a list, not a tuple
    [(b"a", b"t", bytearray(b"b"), 1, b"\0" * 8)],
    [(b"a", None, b"b", 1, b"\0" * 8)],
    [],
]


@pytest.mark.parametrize("acc", COMMIT_CASES)
@pytest.mark.parametrize("first", [1, (1 << 64) - 1, (1 << 64) - 2])
def test_c_commit_same_as_python_or_same_error(acc, first):
    """The C commit declines anything but plain tuples (and a sequence past 2^64 - 1):
    then commit_py runs, so the result or the exception is Python's."""
    require_native(stamping._stamp, "logjam_relay.relay._stamp")

    def outcome(method):
        pub = []
        p = Pipeline(0x0A0B0C0D, first, pub.append, fqdn=b"vm")
        try:
            recs = getattr(p, method)(list(acc), 1_750_000_000_000)
        except Exception as e:
            return ("raise", type(e), str(e), p.seq, pub)
        return ("ok", recs, p.seq, pub, vars_of(p.counters))

    assert outcome("commit") == outcome("commit_py")


def test_stamp_pull_fast_path_bytes():
    require_native(stamping._stamp, "logjam_relay.relay._stamp")
    out = []
    p = Pipeline(0x01020304, 5, out.append, fqdn=b"vm")
    p.validator.good_streams.add(b"a-b")
    p.validator.good_topics.add(b"logs")
    recs = p.stamp_pull([[b"a-b", b"logs", b"{}", meta(tag=0xBDCA, comp=2, created=0)]],
                        0x1122334455667788)
    assert recs == [(b"a-b", b"logs", b"{}",
                     bytes.fromhex("cabd0201 01020304 1122334455667788 0000000000000005"))]
    assert out == [recs] and p.seq == 5


def test_stamp_pull_without_the_extension(monkeypatch):
    """The pure-Python fallback is the two steps."""
    monkeypatch.setattr(stamping, "_stamp", None)
    rnd = random.Random(99)
    batches = [random_batch(rnd, 200) for _ in range(3)]
    assert run("fused", batches, 1) == run("two-step", batches, 1)
