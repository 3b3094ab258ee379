"""Pipeline.stamp_pull (C loop, relay/_stamp.c) against prepare_pull + commit (Python).

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
    got = run("fused", batches, now)
    assert got[0] == ref[0]          # records, batch by batch
    assert got[1] == ref[1]          # what was published
    assert got[2] == ref[2]          # last sequence
    assert got[3] == ref[3]          # every counter
    assert sum(map(len, ref[0])) > 0 and ref[3]["invalid"] > 0   # both paths exercised


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
