"""zmq_max_peers through the ZAP handler (io/peers.py), and what the subscription guard does
about many connections at once (io/subscriptions.py): docs/operations.md, "Memory"."""

from __future__ import annotations

import socket
import time

import pytest
import trio
import zmq

from fuzzers import metric, zmtp_connect
from logjam_relay import config
from logjam_relay.io import zmq_trio
from logjam_relay.relay import memory
from relay_harness import meta, recv, running_relay, send


def _scrape(relay) -> str:
    from prometheus_client import generate_latest
    return generate_latest(relay.metrics_registry).decode()


async def _connect(port: int, kind: str) -> socket.socket:
    return await trio.to_thread.run_sync(zmtp_connect, "127.0.0.1", port, kind, 5.0)


async def test_a_connection_over_zmq_max_peers_is_reset_counted_and_comes_back(tmp_path):
    """A new connection over the bound is reset before its handshake ends (a ZAP refusal
    would make a libzmq client give up for good and drop what it queued), counted, and a
    libzmq client that was reset gets in once a place is free, with what it queued."""
    async with running_relay(tmp_path, zmq_max_peers=2) as (relay, clients):
        s = clients.settings
        for port, kind, name in ((s.router_port, "DEALER", "router"),
                                 (s.pull_port, "PUSH", "pull"), (s.pub_port, "SUB", "pub")):
            held = [await _connect(port, kind), await _connect(port, kind)]
            with pytest.raises((ConnectionError, OSError)):
                (await _connect(port, kind)).close()
            text = _scrape(relay)
            assert metric(text, "logjam_relay_zmq_peers_refused_total", socket=name,
                          reason="max_peers") == 1
            assert metric(text, "logjam_relay_zmq_peers", socket=name) == 2
            held[0].close()
            with trio.fail_after(5):             # the relay sees it go: room again
                while relay.peer_limit.peers(name) > 1:
                    await trio.sleep(0.02)
            third = await _connect(port, kind)
            for c in (held[1], third):
                c.close()
            with trio.fail_after(5):
                while relay.peer_limit.peers(name):
                    await trio.sleep(0.02)
        assert metric(_scrape(relay), "logjam_relay_zmq_max_peers") == 2

        first, second = clients.dealer(), clients.dealer()
        for d in (first, second):
            await send(d, [b"", b"app-env", b"logs.x", b"{}", meta()])
            assert await recv(d) == [b"app-env", b"202 Accepted"]
        third = clients.dealer()
        await send(third, [b"", b"late-one", b"logs.x", b"{}", meta()])
        with trio.move_on_after(0.5):
            await recv(third)
            pytest.fail("the third peer got in over zmq_max_peers=2")
        assert relay.peer_limit.refused[("router", "max_peers")] >= 2    # it retries
        first.close()
        assert await recv(third, timeout=10) == [b"late-one", b"202 Accepted"]
        second.close()
        third.close()


async def test_without_a_bound_every_peer_is_admitted(tmp_path):
    async with running_relay(tmp_path) as (relay, clients):
        s = clients.settings
        held = [await _connect(s.router_port, "DEALER") for _ in range(20)]
        assert relay.peer_limit.max_peers == 0
        assert relay.peer_limit.peers("router") == 20
        assert sum(relay.peer_limit.refused.values()) == 0
        for h in held:
            h.close()


def test_zmq_max_peers_is_validated_and_bounds_the_ceiling(tmp_path):
    with pytest.raises(config.ConfigError) as ei:
        config.load({"zmq_max_peers": -1}, environ={})
    assert "zmq_max_peers" in str(ei.value)
    s = config.load({"zmq_max_peers": 8, "rcv_hwm": 4, "max_event_bytes": 1 << 20,
                     "state_dir": str(tmp_path)}, environ={})
    c = memory.ceiling(s, baseline=0, output_bytes=0)
    message = s.resolved_zmq_max_msg_bytes() + memory.ENVELOPE_BYTES
    assert c.ingress_queues == 2 * 8 * 5 * message              # ROUTER + PULL
    assert c.connections == (2 + 2) * 8 * memory.ZMQ_CONNECTION_BYTES
    unbounded = config.load({"state_dir": str(tmp_path)}, environ={})
    with pytest.raises(ValueError):
        memory.ceiling(unbounded, baseline=0, output_bytes=0)
    assert memory.ceiling(unbounded, baseline=0, input_peers=3, output_bytes=0) \
        .connections == 3 * memory.ZMQ_CONNECTION_BYTES


# ------------------------------------------------------------------ the guard, directly

@pytest.fixture
def xpub():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    for opt, v in zmq_trio.xpub_options().items():
        sock.setsockopt(opt, v)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    yield sock, int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    sock.close(linger=0)
    ctx.term()


def _until(guard, cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        guard.poll()
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"condition not reached: {guard.stats()}")


def _subscribe(s: socket.socket, topic: bytes, times: int) -> None:
    frame = b"\x01" + topic
    s.sendall((b"\x00" + bytes([len(frame)]) + frame) * times)


def test_many_connections_share_one_byte_budget(xpub):
    """Each connection is under the per-connection budget, together they are over: the one
    that sent most is cut, the others stay (a flood from many connections holds no more
    than one connection could)."""
    sock, port = xpub
    guard = zmq_trio.SubscriptionGuard(sock, max_subscriptions=100)
    budget = guard.max_peer_bytes                   # 100 x 140 + 4096
    try:
        conns = [zmtp_connect("127.0.0.1", port, "SUB") for _ in range(3)]
        _until(guard, lambda: guard.peers == 3)
        topic = b"t" * 100                            # one pair each: only bytes add up
        frame = len(topic) + 3
        sizes = [budget * 3 // 10, budget * 3 // 10, budget * 45 // 100]
        for c, n in zip(conns, sizes, strict=True):
            _subscribe(c, topic, n // frame)
        _until(guard, lambda: guard.disconnected == 1)
        time.sleep(0.3)
        guard.poll()
        assert guard.disconnected == 1, guard.stats()
        conns[2].settimeout(5)
        try:                                           # the biggest was cut
            while conns[2].recv(65536):
                pass
        except ConnectionResetError:
            pass
        for c in conns[:2]:                            # the others are still there
            c.settimeout(0.2)
            with pytest.raises(TimeoutError):
                c.recv(65536)
        for c in conns:
            c.close()
    finally:
        guard.close()


def test_after_an_expensive_connection_end_new_peers_wait(xpub):
    """The end of a connection makes libzmq walk the subscription trie on the socket's
    thread: after one that held many long topics, admit() says busy for a while; with
    an empty trie a connection's end costs next to nothing."""
    sock, port = xpub
    guard = zmq_trio.SubscriptionGuard(sock, max_subscriptions=2000)
    try:
        idle = zmtp_connect("127.0.0.1", port, "SUB")
        _until(guard, lambda: guard.peers == 1)
        idle.close()
        _until(guard, lambda: guard.peers == 0)
        assert guard.walk_seconds < 0.001                  # an empty trie: next to nothing
        _until(guard, lambda: guard.admit() is None, timeout=1.0)
        heavy = zmtp_connect("127.0.0.1", port, "SUB")
        frames = []
        for i in range(1500):
            f = b"\x01" + b"%08d" % i + b"x" * 120
            frames.append(b"\x00" + bytes([len(f)]) + f)
        heavy.sendall(b"".join(frames))
        _until(guard, lambda: guard.entries == 1500)
        assert guard.held_bytes == 1500 * 128
        heavy.close()
        _until(guard, lambda: guard.peers == 0)
        assert guard.entries == 0
        assert guard.admit() == "busy"
        # 2 tries x 192,000 bytes x 0.4 us, over a 20 % share: about 0.8 s
        assert guard.walk_seconds >= 2 * 1500 * 128 * guard.WALK_SECONDS_PER_BYTE
        _until(guard, lambda: guard.stats()["ending"] == 0)
    finally:
        guard.close()
