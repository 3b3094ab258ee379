"""bench/durable_ack.c, the latency bench's floor of a durable 202 (``c-ack``, ``c-durable``,
``c-durable-thread``), does what bench_latency.py says it does: every request is answered
"202 Accepted" in order, published on PUB as it came, and -- with a file -- its body is in
the file when its 202 arrives.  A floor that answered early would make the relay look slow
against it; one that lost requests would make the bench wait for replies that never come.

What this cannot see: the order of a 202 and its body's write() (or fdatasync) when they
are microseconds apart -- the reply's trip over loopback is longer.  A floor that answered
a millisecond before writing fails here (tried: a 1 ms sleep between the replies and the
write fails the one-at-a-time phase); the fdatasync before the reply stands on reading
durable_ack.c.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import zmq

from conftest import free_port

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

N = 3000
PING = 200     # requests sent one at a time, each after the last one's 202
APP, TOPIC = b"bench-test", b"logs.bench"
META = bytes(24)


@pytest.fixture(scope="module")
def durable_ack():
    if not (shutil.which("gcc") or shutil.which("cc")):
        if os.environ.get("CI"):
            pytest.fail("CI has gcc: durable_ack.c must be built")
        pytest.skip("no C compiler: durable_ack.c cannot be built")
    import bench_latency
    return bench_latency.durable_ack_tool()


@pytest.mark.parametrize("mode", ["c-ack", "c-durable", "c-durable-thread"])
def test_every_request_is_answered_in_order_published_and_on_file_before_its_202(
        durable_ack, tmp_path, mode):
    router, pub = free_port(), free_port()
    path = tmp_path / "bodies"
    argv = [durable_ack, f"tcp://127.0.0.1:{router}", f"tcp://127.0.0.1:{pub}",
            "-" if mode == "c-ack" else str(path)] + (["thread"] if mode.endswith("thread")
                                                      else [])
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    sub = ctx.socket(zmq.SUB)
    try:
        for s in (dealer, sub):
            s.linger = 0
            s.rcvtimeo = 30_000
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{pub}")
        dealer.connect(f"tcp://127.0.0.1:{router}")
        sent: list[bytes] = []

        def request(body: bytes) -> None:
            dealer.send_multipart([b"", APP, TOPIC, body, META])
            sent.append(body)

        # warm-ups until the SUB has one (PUB drops what comes before the subscription)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        for i in range(300):
            request(b"warm-%d" % i)
            if poller.poll(100):
                break
        else:
            pytest.fail("the SUB never got a warm-up")
        warm = len(sent)
        while sub.poll(200):
            sub.recv_multipart()
        bodies = [b'{"request_id":"%032x","x":"%s"}' % (i, b"y" * (i % 200)) for i in range(N)]
        for i in range(warm):
            assert dealer.recv_multipart() == [b"", b"202 Accepted"], i
        # one at a time first: when a 202 is here, its body is in the file
        for b in bodies[:PING]:
            request(b)
            assert dealer.recv_multipart() == [b"", b"202 Accepted"]
            if mode != "c-ack":
                assert os.path.getsize(path) == sum(map(len, sent)), (len(sent), mode)
        # then all at once: every one answered, in order
        for b in bodies[PING:]:
            request(b)
        for i in range(PING, N):
            assert dealer.recv_multipart() == [b"", b"202 Accepted"], i
        got = [sub.recv_multipart() for _ in range(N)]
        assert got == [[APP, TOPIC, b, META] for b in bodies]
        if mode == "c-ack":
            assert not path.exists()
        else:
            assert path.read_bytes() == b"".join(sent)
        assert warm >= 1
    finally:
        dealer.close()
        sub.close()
        ctx.term()
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert f"durable_ack: {len(sent)} requests in " in err, err


def test_over_the_floor_divides_the_relays_ratio_by_the_floors_of_the_same_round():
    """bench_latency.over_floor: (batch / no spool) / (c-durable / c-ack), per round and
    percentile; no line without c-ack or without the no-spool relay of the same tree."""
    import bench_latency as BL
    t = {k: BL.Target(k, k) for k in ("c-ack", "c-durable", "c-durable-thread", "none",
                                       "batch")}
    try:
        def res(p50, p99, p999, mx):
            return {"r_p50": p50, "r_p99": p99, "r_p999": p999, "r_max": mx}
        rnd = {"c-ack": res(1, 2, 4, 8), "c-durable": res(4, 4, 8, 8),
               "c-durable-thread": res(2, 8, 8, 16), "none": res(2, 2, 2, 2),
               "batch": res(8, 6, 4, 2)}
        got = {c.split("'")[0]: [f(rnd, k) for k in BL.KEYS]
               for target, c, f in BL.over_floor(list(t.values()))}
        assert got == {"c-durable": [1.0, 1.5, 1.0, 1.0],
                       "c-durable-thread": [2.0, 0.75, 1.0, 0.5]}
        assert BL.over_floor([t["c-durable"], t["none"], t["batch"]]) == []
        assert BL.over_floor([t["c-ack"], t["c-durable"], t["batch"]]) == []
        rnd["none"]["r_p99"] = 0
        assert [f(rnd, "p99") for _, _, f in BL.over_floor(list(t.values()))] == [None, None]
    finally:
        for target in t.values():
            shutil.rmtree(target.work, ignore_errors=True)
