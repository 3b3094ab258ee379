"""The trio/pyzmq I/O layer: batch drain, batch publish with HWM drops, replies to gone
peers; the C fast path and the pyzmq path must behave the same (real sockets)."""

from __future__ import annotations

import os
import sys

import pytest
import zmq

from conftest import require_native
from logjam_relay.io import zmq_fast, zmq_trio


@pytest.fixture(params=["c", "python"])
def impl(request, monkeypatch):
    """Run a test against the C loops and against pyzmq alone."""
    if request.param == "c":
        return require_native(zmq_fast.drain, f"logjam_relay.io._zmqfast ({zmq_fast.WHY_NOT})")
    monkeypatch.setattr(zmq_fast, "publish", None)
    return zmq_trio.drain_py


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def pair(ctx, a, b):
    sa, sb = ctx.socket(a), ctx.socket(b)
    for s in (sa, sb):
        s.setsockopt(zmq.LINGER, 0)
    sa.bind("inproc://t")
    sb.connect("inproc://t")
    return sa, sb


def test_drain_whole_messages_in_order_and_stops_at_limit(ctx, impl):
    pull, push = pair(ctx, zmq.PULL, zmq.PUSH)
    msgs = [[b"app-env", b"logs.x", b"%d" % i, b""] for i in range(10)]
    msgs.append([b"single"])
    msgs.append([b"", b"", b""])
    msgs.append([b"big", os.urandom(1 << 20)])
    for m in msgs:
        push.send_multipart(m)
    got = []
    while len(got) < len(msgs):
        batch = impl(pull, 4)
        assert len(batch) <= 4
        if not batch:
            assert pull.poll(2000), "messages did not arrive"
            continue
        got.extend(batch)
    assert got == msgs
    assert all(type(f) is bytes for m in got for f in m)
    assert impl(pull, 100) == []                      # nothing queued: no blocking


@pytest.fixture(params=["c", "python"])
def drain_bytes(request):
    if request.param == "c":
        return require_native(zmq_fast.drain_bytes,
                              f"logjam_relay.io._zmqfast ({zmq_fast.WHY_NOT})")
    return zmq_trio.drain_bytes_py


def test_drain_bytes_stops_at_the_byte_bound_and_reports_sizes(ctx, drain_bytes):
    """The batch stops after the message that reaches max_bytes (at least one message,
    never more than limit), with the total and the largest frame of what it returns."""
    pull, push = pair(ctx, zmq.PULL, zmq.PUSH)
    sizes = [100, 5000, 300, 70000, 10, 10, 1 << 20, 7]
    msgs = [[b"a-b", b"logs", os.urandom(n)] for n in sizes]
    for m in msgs:
        push.send_multipart(m)
    assert pull.poll(2000)
    got, batches = [], []
    while len(got) < len(msgs):
        batch, total, biggest = drain_bytes(pull, 3, 5200)
        if not batch:
            assert pull.poll(2000), "messages did not arrive"
            continue
        assert total == sum(len(f) for m in batch for f in m)
        assert biggest == max(len(f) for m in batch for f in m)
        assert len(batch) <= 3
        # every message but the last left the batch under the bound
        assert sum(len(f) for m in batch[:-1] for f in m) < 5200
        batches.append([len(m[2]) for m in batch])
        got.extend(batch)
    assert got == msgs
    assert batches == [[100, 5000, 300], [70000], [10, 10, 1 << 20], [7]]
    assert drain_bytes(pull, 10, 0) == ([], 0, 0)
    for m in msgs:                                   # max_bytes 0: only the count bounds
        push.send_multipart(m)
    got = []
    while len(got) < len(msgs):
        batch, total, _ = drain_bytes(pull, 100, 0)
        if not batch:
            assert pull.poll(2000)
        got.extend(batch)
    assert got == msgs


def test_drain_bytes_on_a_closed_socket_raises_zmq_error(ctx, drain_bytes):
    pull, _ = pair(ctx, zmq.PULL, zmq.PUSH)
    pull.close()
    with pytest.raises(zmq.ZMQError):
        drain_bytes(pull, 10, 100)


def test_drain_on_a_closed_socket_raises_zmq_error(ctx, impl):
    pull, _ = pair(ctx, zmq.PULL, zmq.PUSH)
    pull.close()
    with pytest.raises(zmq.ZMQError):
        impl(pull, 10)


def test_publish_batch_counts_hwm_drops_and_keeps_order(ctx, impl):
    xpub = ctx.socket(zmq.XPUB)
    xpub.setsockopt(zmq.SNDHWM, 10)
    xpub.setsockopt(zmq.LINGER, 0)
    xpub.bind("inproc://pub")
    pub = zmq_trio.PubSocket(xpub)
    fast_sub = ctx.socket(zmq.SUB)
    slow_sub = ctx.socket(zmq.SUB)
    fast_sub.setsockopt(zmq.RCVHWM, 0)       # inproc: an unbounded pipe for this one
    slow_sub.setsockopt(zmq.RCVHWM, 10)
    for s in (fast_sub, slow_sub):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect("inproc://pub")
    assert xpub.recv() == b"\x01"   # subscriptions arrived
    records = [(b"a-b", b"logs", b"%d" % i, b"m") for i in range(200)]
    got = []
    for k in range(0, 200, 4):      # the fast subscriber keeps up; the slow one never reads
        pub.publish_batch(records[k:k + 4])
        while fast_sub.poll(0):
            got.append(tuple(fast_sub.recv_multipart()))
    while fast_sub.poll(100):
        got.append(tuple(fast_sub.recv_multipart()))
    assert pub.published == 200
    assert pub.drops > 0                               # the slow subscriber's queue was full
    assert got == records                              # nobody else lost anything
    n_slow = 0
    while slow_sub.poll(100):
        slow_sub.recv_multipart()
        n_slow += 1
    assert n_slow < 200


def test_send_replies_counts_gone_peers_and_delivers_the_rest(ctx, impl):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("inproc://r")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"peer")
    dealer.connect("inproc://r")
    dealer.send_multipart([b"", b"hello"])
    assert router.recv_multipart() == [b"peer", b"", b"hello"]
    replies = [[b"peer", b"", b"202 Accepted"], [b"gone", b"", b"202 Accepted"],
               [b"peer", b"", b"400 Bad Request"], [b"gone2", b"x"]]
    assert zmq_trio.send_replies(router, replies) == 2
    assert dealer.recv_multipart() == [b"", b"202 Accepted"]
    assert dealer.recv_multipart() == [b"", b"400 Bad Request"]
    assert not dealer.poll(50)


def test_publish_accepts_buffers_and_rejects_bad_records(ctx, impl):
    pull, push = pair(ctx, zmq.PULL, zmq.PUSH)
    if zmq_fast.publish is not None:
        assert zmq_fast.publish(push, [(b"a", bytearray(b"b"), memoryview(b"c"))]) == (1, 0)
        assert pull.recv_multipart() == [b"a", b"b", b"c"]
        with pytest.raises(ValueError):
            zmq_fast.publish(push, [()])
        with pytest.raises(TypeError):
            zmq_fast.publish(push, [(b"a", 5)])
        with pytest.raises(TypeError):
            zmq_fast.publish(push, [7])
    else:
        assert zmq_trio.send_replies(push, [(b"a", bytearray(b"b"), memoryview(b"c"))]) == 0
        assert pull.recv_multipart() == [b"a", b"b", b"c"]


def _poll_until(guard, cond, timeout=10.0):
    import time
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        seen.extend(guard.poll())
        if cond():
            return seen
        time.sleep(0.01)
    raise AssertionError(f"condition not reached: {guard.stats()}")


def test_subscription_guard_caps_cuts_the_flooder_and_forgets_it(ctx):
    """Over max_subscriptions the sending peer is disconnected and counted; a subscriber
    within the cap keeps receiving; when the flooder is gone its entries are forgotten and
    new subscriptions are accepted again."""
    xpub = ctx.socket(zmq.XPUB)
    for opt, v in zmq_trio.xpub_options().items():
        xpub.setsockopt(opt, v)
    xpub.setsockopt(zmq.LINGER, 0)
    xpub.bind("tcp://127.0.0.1:*")
    ep = xpub.getsockopt_string(zmq.LAST_ENDPOINT)
    pub = zmq_trio.PubSocket(xpub, max_subscriptions=500)
    guard = pub.guard
    good = ctx.socket(zmq.SUB)
    good.setsockopt(zmq.LINGER, 0)
    good.setsockopt(zmq.SUBSCRIBE, b"app-")
    good.connect(ep)
    seen = _poll_until(guard, lambda: guard.entries == 1)
    assert seen == [b"\x01app-"] and guard.topics == {b"app-": 1}
    flood = ctx.socket(zmq.SUB)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.SNDHWM, 0)
    flood.setsockopt(zmq.RECONNECT_IVL, 60_000)      # stays away once cut
    flood.connect(ep)
    for i in range(3000):
        flood.setsockopt(zmq.SUBSCRIBE, b"%08d" % i + os.urandom(8))
    _poll_until(guard, lambda: guard.disconnected == 1 and guard.entries == 1)
    # cut at the count (refused) or, when the guard looks after the whole flood arrived,
    # at the socket's byte budget first (84 KB of SUBSCRIBE commands > 500 x 140 + 4096):
    # either way the flooder alone
    assert guard.disconnected == 1 and guard.held_bytes == len(b"app-")
    assert guard.topics == {b"app-": 1}
    pub.publish([b"app-x", b"logs", b"1", b"m"])
    pub.publish([b"00000001", b"not for the good one"])
    assert good.poll(2000)
    assert good.recv_multipart() == [b"app-x", b"logs", b"1", b"m"]
    assert not good.poll(100)
    late = ctx.socket(zmq.SUB)                        # room again
    late.setsockopt(zmq.LINGER, 0)
    late.setsockopt(zmq.SUBSCRIBE, b"app-")
    late.connect(ep)
    seen = _poll_until(guard, lambda: guard.entries == 2)
    assert seen == [b"\x01app-"] and guard.topics == {b"app-": 2}
    good.close()
    seen = _poll_until(guard, lambda: guard.entries == 1)
    assert guard.topics == {b"app-": 1} and seen == []   # not the last subscriber
    late.setsockopt(zmq.UNSUBSCRIBE, b"app-")
    seen = _poll_until(guard, lambda: guard.entries == 0)
    assert seen == [b"\x00app-"] and guard.topics == {}
    assert guard.disconnected == 1
    assert len(guard._conns) == 1                     # only `late` is still connected
    guard.close()


def test_xpub_refuses_a_topic_longer_than_max_topic_bytes(ctx):
    xpub = ctx.socket(zmq.XPUB)
    for opt, v in zmq_trio.xpub_options().items():
        xpub.setsockopt(opt, v)
    xpub.setsockopt(zmq.LINGER, 0)
    xpub.bind("tcp://127.0.0.1:*")
    pub = zmq_trio.PubSocket(xpub, max_subscriptions=10)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"x" * (zmq_trio.MAX_TOPIC_BYTES + 2))
    sub.connect(xpub.getsockopt_string(zmq.LAST_ENDPOINT))
    ok = ctx.socket(zmq.SUB)
    ok.setsockopt(zmq.LINGER, 0)
    ok.setsockopt(zmq.SUBSCRIBE, b"y" * zmq_trio.MAX_TOPIC_BYTES)
    ok.connect(xpub.getsockopt_string(zmq.LAST_ENDPOINT))
    _poll_until(pub.guard, lambda: pub.guard.entries == 1)
    import time
    time.sleep(0.2)
    pub.guard.poll()
    assert list(pub.subscriptions) == [b"y" * zmq_trio.MAX_TOPIC_BYTES]
    pub.close()


_SUB_PEER = """
import sys, time, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.SUB)
s.setsockopt(zmq.SUBSCRIBE, bytes.fromhex(sys.argv[2]))
s.connect(sys.argv[1])
time.sleep(float(sys.argv[3]))
"""


def _sub_peer(endpoint: str, topic: bytes, seconds: float):
    """A SUB in a process of its own (no descriptor of this process is taken for it but
    the connection XPUB accepts)."""
    import subprocess
    return subprocess.Popen([sys.executable, "-c", _SUB_PEER, endpoint, topic.hex(),
                             str(seconds)])


def test_xpub_subscription_on_a_reused_descriptor_is_not_dropped(ctx):
    """A connection ends and the next one gets its descriptor number; its subscription is
    read while the monitor's ACCEPTED for it is queued but not taken yet (found beside two
    busy loops: the good subscriber's subscription was dropped as the dead connection's).
    The guard looks at the monitor first: the subscription is forwarded."""
    import time
    xpub = ctx.socket(zmq.XPUB)
    for opt, v in zmq_trio.xpub_options().items():
        xpub.setsockopt(opt, v)
    xpub.setsockopt(zmq.LINGER, 0)
    xpub.bind("tcp://127.0.0.1:*")
    ep = xpub.getsockopt_string(zmq.LAST_ENDPOINT)
    pub = zmq_trio.PubSocket(xpub, max_subscriptions=10)
    guard = pub.guard
    # a peer whose subscription is too long: libzmq ends its connection
    bad = _sub_peer(ep, b"x" * (zmq_trio.MAX_TOPIC_BYTES + 2), 0.3)
    bad.wait(timeout=30)
    time.sleep(0.3)
    guard.poll()                                  # its ACCEPTED and DISCONNECTED taken
    ok_topic = b"y" * zmq_trio.MAX_TOPIC_BYTES
    real = guard.sock
    peers = []

    class Late:
        """The XPUB, but the good peer connects during the guard's first read, after
        the guard has looked at the monitor."""
        def __getattr__(self, name):
            return getattr(real, name)

        def recv(self, *a, **k):
            if not peers:
                peers.append(_sub_peer(ep, ok_topic, 30))
                real.poll(20_000, zmq.POLLIN)     # its subscription is there
            return real.recv(*a, **k)

    guard.sock = Late()
    try:
        _poll_until(guard, lambda: guard.entries == 1)
        assert list(pub.subscriptions) == [ok_topic]
    finally:
        guard.sock = real
        for p in peers:
            p.kill()
            p.wait()
        pub.close()


def _rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_stalled_subscriber_costs_at_most_snd_hwm_messages(ctx, impl):
    """300 messages of 1 MiB to a TCP subscriber that never reads: PUB keeps at most
    snd_hwm of them (the lossy resend drops for the full pipe, it does not buffer).
    libzmq then leaves the full pipe out of matching until it drains, so ``drops`` counts
    the first message of such a stall, not every message the subscriber missed."""
    xpub = ctx.socket(zmq.XPUB)
    xpub.setsockopt(zmq.SNDHWM, 8)
    xpub.setsockopt(zmq.LINGER, 0)
    xpub.setsockopt(zmq.SNDBUF, 65536)
    xpub.bind("tcp://127.0.0.1:*")
    pub = zmq_trio.PubSocket(xpub)
    # the subscriber: a raw ZMTP 3.0 peer that subscribes to everything and never reads
    # (a libzmq SUB in this process would only add its own queue)
    import socket
    port = int(xpub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", port))
    raw.sendall(b"\xff" + b"\0" * 8 + b"\x7f")
    got = b""
    while len(got) < 10:
        got += raw.recv(10 - len(got))
    raw.sendall(b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32)
    while len(got) < 64:                              # the whole greeting, as libzmq does
        got += raw.recv(64 - len(got))
    ready = b"\x05READY\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB"
    raw.sendall(b"\x04" + bytes([len(ready)]) + ready + b"\x00\x01\x01")
    assert xpub.poll(2000) and xpub.recv() == b"\x01"
    body = os.urandom(1 << 20)
    before = _rss()
    for _ in range(0, 300, 10):
        pub.publish_batch([(b"a-b", b"logs", body, b"m")] * 10)
    grown = _rss() - before
    assert pub.published == 300
    assert pub.drops >= 1                             # the queue was found full
    # snd_hwm (8) + what sits in the subscriber's pipe and the socket buffers
    assert grown < 48 * (1 << 20), f"RSS grew {grown / (1 << 20):.0f} MiB"
    raw.close()
    xpub.close(linger=0)
