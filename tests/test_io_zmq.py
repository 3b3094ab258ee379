"""The trio/pyzmq I/O layer: batch drain, batch publish with HWM drops, replies to gone
peers; the C fast path and the pyzmq path must behave the same (real sockets)."""

from __future__ import annotations

import os

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
