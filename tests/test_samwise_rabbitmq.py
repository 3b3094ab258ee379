"""samwise endpoint against a real RabbitMQ (127.0.0.1:5672, guest/guest).

Two brokers are emulated by two throw-away vhosts (created with rabbitmqctl
for this pytest session, deleted at the end).  Messages are consumed with a real AMQP
client (pika BlockingConnection, in a worker thread).  With env CI set, an
unreachable RabbitMQ fails these tests; otherwise they are skipped.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid

import pika
import pytest
import trio
import zmq

from logjam_relay.io import zmq_trio
from logjam_relay.protocols import samwise as p
from logjam_relay.samwise.config import BrokerConfig, SamwiseConfig
from logjam_relay.samwise.endpoint import MemoryStore, SamwiseService
from logjam_relay.samwise.output import make_record
from logjam_relay.spool.api import KIND_SAMWISE

HOST, PORT = "127.0.0.1", 5672
HOW = ("RabbitMQ is not reachable on 127.0.0.1:5672 (guest/guest); start it with "
       "`rabbitmq-server -detached` (and `rabbitmqctl await_startup`)")


def _params(vhost="/"):
    return pika.ConnectionParameters(HOST, PORT, vhost, pika.PlainCredentials("guest", "guest"),
                                     socket_timeout=3, connection_attempts=1)


def _ctl(*args, check=True):
    return subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True,
                          timeout=60, check=check)


@pytest.fixture(scope="session")
def rabbit():
    try:
        pika.BlockingConnection(_params()).close()
    except Exception as e:
        if os.environ.get("CI"):
            pytest.fail(f"{HOW}: {e!r}")
        pytest.skip(HOW)


@pytest.fixture(scope="session")
def vhosts(rabbit):
    names = [f"lj-samwise-{os.getpid()}-{x}" for x in "ab"]
    procs = [subprocess.Popen(["rabbitmqctl", "-q", "add_vhost", n]) for n in names]
    assert all(pr.wait(60) == 0 for pr in procs)
    try:
        procs = [subprocess.Popen(["rabbitmqctl", "-q", "set_permissions", "-p", n, "guest",
                                   ".*", ".*", ".*"]) for n in names]
        assert all(pr.wait(60) == 0 for pr in procs)
        yield names
    finally:
        procs = [subprocess.Popen(["rabbitmqctl", "-q", "delete_vhost", n]) for n in names]
        for pr in procs:
            pr.wait(60)


def broker(name, vhost, port=PORT) -> BrokerConfig:
    return BrokerConfig(name=name, host=HOST, port=port, vhost=vhost, backoff_min=0.05,
                        backoff_max=0.5, heartbeat=10)


@contextlib.asynccontextmanager
async def running(brokers, wait_connected=None, store=None, **kw):
    cfg = SamwiseConfig(("tcp://127.0.0.1:0",), tuple(brokers), **kw)
    svc = SamwiseService(cfg, store or MemoryStore())
    async with trio.open_nursery() as n:
        eps = await n.start(svc.run)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(eps[0])
        try:
            want = [o for o in svc.outputs if wait_connected is None or o.name in wait_connected]
            with trio.fail_after(10):
                while not all(o.connected for o in want):
                    await trio.sleep(0.01)
            yield svc, sock
        finally:
            sock.close(0)
            n.cancel_scope.cancel()


async def request(sock, frames):
    await zmq_trio.send_multipart(sock, [b""] + frames)
    with trio.fail_after(10):
        rep = await zmq_trio.recv_multipart(sock)
    assert rep[0] == b""
    return rep[1:]


async def drained(svc, timeout=15):
    with trio.fail_after(timeout):
        while svc.backlog():
            await trio.sleep(0.01)


class Queue:
    """A queue bound to amq.direct with a unique routing key in one vhost."""

    durable = False

    def __init__(self, vhost, exchange="amq.direct"):
        self.vhost, self.name = vhost, f"q-{uuid.uuid4().hex[:12]}"
        self.key = self.name
        c = pika.BlockingConnection(_params(vhost))
        ch = c.channel()
        ch.queue_declare(self.name, durable=self.durable, auto_delete=False)
        ch.queue_bind(self.name, exchange, self.key)
        c.close()

    def get_all(self, expect: int | None = None, timeout=10.0):
        c = pika.BlockingConnection(_params(self.vhost))
        ch = c.channel()
        out = []
        deadline = time.monotonic() + timeout
        while True:
            m, props, body = ch.basic_get(self.name, auto_ack=True)
            if m is not None:
                out.append((props, body))
                continue
            if expect is None or len(out) >= expect or time.monotonic() > deadline:
                break
            c.sleep(0.02)
        ch.queue_delete(self.name)
        c.close()
        return out


async def make_queue(vhost, exchange="amq.direct"):
    return await trio.to_thread.run_sync(Queue, vhost, exchange)


async def bind_queue(vhost, queue, key, exchange="amq.direct"):
    """Bind ``queue`` in ``vhost`` to ``exchange`` with one more routing ``key``."""
    def bind():
        c = pika.BlockingConnection(_params(vhost))
        c.channel().queue_bind(queue, exchange, key)
        c.close()
    await trio.to_thread.run_sync(bind)


async def get_all(q, expect=None):
    return await trio.to_thread.run_sync(q.get_all, expect)


def exchange_exists(vhost, name):
    c = pika.BlockingConnection(_params(vhost))
    try:
        c.channel().exchange_declare(name, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker as e:
        assert e.reply_code == 404
        return False
    finally:
        if c.is_open:
            c.close()


# ----------------------------------------------------------------------------- tests


async def test_both_layouts_properties_and_headers(vhosts):
    q = await make_queue(vhosts[0])
    async with running([broker("a", vhosts[0])]) as (svc, sock):
        assert await request(sock, p.build_publish("amq.direct", q.key, b"v100", version=100)) == [b"0"]
        props = p.Properties("text/plain", "utf-8", 2, 5, "corr-1", "reply-q", "60000", "mid-1",
                             "t", "guest", "app-1", "cl-1")
        f = p.build_publish("amq.direct", q.key, b"v120", properties=props,
                            headers={"hkey": "hval", "bin": b"\xff\x00"})
        assert await request(sock, f) == [b"0", b""]
        # libsamwise style: header count in pairs, content_type in all 12 frames
        f = [b"120", b"publish", b"round robin", b"amq.direct", q.key.encode(), b"0", b"0", b"12",
             *([b"text/plain"] * 12), b"1", b"k1", b"v1", b"REAL-PAYLOAD"]
        assert await request(sock, f) == [b"0", b""]
        await drained(svc)
        assert svc.stats()["brokers"]["a"]["results"] == {"ack": 3}
    msgs = await get_all(q, 3)
    assert [b for _, b in msgs] == [b"v100", b"v120", b"REAL-PAYLOAD"]
    pr = msgs[1][0]
    assert (pr.content_type, pr.content_encoding, pr.delivery_mode, pr.priority) == \
        ("text/plain", "utf-8", 2, 5)
    assert (pr.correlation_id, pr.reply_to, pr.expiration, pr.message_id, pr.type) == \
        ("corr-1", "reply-q", "60000", "mid-1", "t")
    assert (pr.user_id, pr.app_id, pr.cluster_id) == ("guest", "app-1", "cl-1")
    assert pr.headers == {"hkey": "hval", "bin": b"\xff\x00"}
    assert msgs[0][0].headers is None and msgs[0][0].content_type is None
    assert msgs[2][0].content_type == "text/plain" and msgs[2][0].headers == {"k1": "v1"}


async def test_round_robin_and_redundant_across_two_brokers(vhosts):
    qa, qb = await make_queue(vhosts[0]), await make_queue(vhosts[1])
    assert qa.key != qb.key
    # bind both queues to the same key in their vhost
    key = qa.key
    await bind_queue(vhosts[1], qb.name, key)
    async with running([broker("a", vhosts[0]), broker("b", vhosts[1])]) as (svc, sock):
        for i in range(10):
            assert await request(sock, p.build_publish("amq.direct", key, b"rr%d" % i)) == [b"0", b""]
        for i in range(3):
            assert await request(sock, p.build_publish("amq.direct", key, b"red%d" % i,
                                                       copies=2)) == [b"0", b""]
        await drained(svc)
        st = svc.stats()
        assert st["delivered"] == 13
        assert st["brokers"]["a"]["results"]["ack"] == 8 and st["brokers"]["b"]["results"]["ack"] == 8
    a = [b for _, b in await get_all(qa, 8)]
    b = [b for _, b in await get_all(qb, 8)]
    assert a[:5] == [b"rr0", b"rr2", b"rr4", b"rr6", b"rr8"]
    assert b[:5] == [b"rr1", b"rr3", b"rr5", b"rr7", b"rr9"]
    assert a[5:] == b[5:] == [b"red0", b"red1", b"red2"]


async def test_round_robin_skips_unreachable_broker(vhosts, port_factory):
    q = await make_queue(vhosts[0])
    dead = broker("dead", "/", port=port_factory())
    async with running([dead, broker("a", vhosts[0])], wait_connected={"a"},
                       handoff_after=0) as (svc, sock):
        for i in range(6):
            assert await request(sock, p.build_publish("amq.direct", q.key, b"m%d" % i)) == [b"0", b""]
        # redundant 2 with one broker down: accepted, one copy delivered, one waits in the spool
        assert await request(sock, p.build_publish("amq.direct", q.key, b"r", copies=2)) == [b"0", b""]
        with trio.fail_after(10):
            while svc.outputs[1].stats()["reader"]["backlog_records"]:
                await trio.sleep(0.01)
        st = svc.stats()
        assert st["brokers"]["dead"]["connected"] == 0
        # the dead broker's reader holds everything back (it cannot skip records it is not
        # addressed by while disconnected); only "r" is really its own
        assert st["brokers"]["dead"]["reader"]["backlog_records"] == 7
        assert st["brokers"]["dead"]["sent"] == 0
        assert st["delivered"] == 6
    assert [b for _, b in await get_all(q, 7)] == [b"m%d" % i for i in range(6)] + [b"r"]


async def test_messages_waiting_for_a_down_broker_are_handed_to_brokers_that_are_up(
        vhosts, port_factory):
    """Records addressed to a broker that then died (as after a crash while it was the
    round-robin choice) move to brokers that are up once it has been down for
    handoff_after; a redundant copy goes to a broker that does not have it yet; a record
    that every other broker already has keeps waiting, and so does what follows it."""
    qa, qb = await make_queue(vhosts[0]), await make_queue(vhosts[1])
    key = qa.key
    await bind_queue(vhosts[1], qb.name, key)
    brokers = [broker("dead", "/", port=port_factory()), broker("a", vhosts[0]),
               broker("b", vhosts[1])]
    store = MemoryStore()
    for name in SamwiseConfig(("tcp://127.0.0.1:0",), tuple(brokers)).reader_names():
        store.reader(name)
    pub = p.build_publish
    waiting = [(["dead"], pub("amq.direct", key, b"rr%d" % i)) for i in range(5)]
    waiting.append((["dead", "a"], pub("amq.direct", key, b"red", copies=2)))
    waiting.append((["dead", "a", "b"], pub("amq.direct", key, b"all3", copies=3)))
    waiting.append((["dead"], pub("amq.direct", key, b"behind")))
    store.append_records([(KIND_SAMWISE, make_record(t, r)) for t, r in waiting])
    async with running(brokers, wait_connected={"a", "b"}, store=store,
                       handoff_after=0.3) as (svc, sock):
        dead = svc.by_name["dead"]
        with trio.fail_after(15):
            while dead.handed_off < 6 or svc.by_name["a"].reader.stats()["backlog_records"] \
                    or svc.by_name["b"].reader.stats()["backlog_records"]:
                await trio.sleep(0.02)
        await trio.sleep(0.5)  # more hand-off rounds: nothing else may move
        st = svc.stats()["brokers"]
        assert st["dead"]["handed_off"] == 6 and st["dead"]["sent"] == 0
        # "all3" and "behind" still wait for the dead broker
        assert st["dead"]["reader"]["backlog_records"] == 2 + 6  # + the 6 re-addressed copies
    # both outputs drained = broker-confirmed = routed: the queues hold everything already
    a = sorted(b for _, b in await get_all(qa))
    b = sorted(b for _, b in await get_all(qb))
    assert sorted(a + b) == sorted([b"rr%d" % i for i in range(5)] + [b"red", b"red",
                                                                       b"all3", b"all3"])
    assert b"red" in a and b"red" in b           # original copy on a, handed-off copy on b
    assert b"behind" not in a + b


async def test_rpc_declare_delete_and_errors(vhosts):
    name = f"x-{uuid.uuid4().hex[:10]}"
    async with running([broker("a", vhosts[0]), broker("b", vhosts[1])],
                       rpc_allow=("exchange.declare", "exchange.delete")) as (svc, sock):
        assert await request(sock, p.build_rpc("exchange.declare", name, "topic", broker="b")) \
            == [b"0", b""]
        assert not await trio.to_thread.run_sync(exchange_exists, vhosts[0], name)
        assert await trio.to_thread.run_sync(exchange_exists, vhosts[1], name)
        assert await request(sock, p.build_rpc("exchange.declare", name, "topic")) == [b"0", b""]
        assert await trio.to_thread.run_sync(exchange_exists, vhosts[0], name)
        # re-declare with another type: 406 from both brokers, reported (samd says 0)
        rep = await request(sock, p.build_rpc("exchange.declare", name, "fanout"))
        assert rep[0] == b"-1" and b"a: 406" in rep[1] and b"b: 406" in rep[1], rep
        rep = await request(sock, p.build_rpc("exchange.declare", name + "z", "bogus-type",
                                              broker="a", version=100))
        assert rep[0] == b"-1" and b"503" in rep[1], rep
        assert await request(sock, p.build_rpc("exchange.delete", name, broker="", version=100)) \
            == [b"0"]
        assert not await trio.to_thread.run_sync(exchange_exists, vhosts[0], name)
        assert not await trio.to_thread.run_sync(exchange_exists, vhosts[1], name)
        assert await request(sock, p.build_rpc("exchange.delete", name, broker="nope")) == \
            [b"-1", b"unknown broker"]
        # the publishing connections were never disturbed by the rpc errors
        assert all(o.disconnects == 0 and o.connected for o in svc.outputs)
        assert svc.requests[("rpc", "ok")] == 3 and svc.requests[("rpc", "broker_error")] == 2


async def test_mandatory_returned_and_missing_exchange_dropped(vhosts):
    q = await make_queue(vhosts[0])
    async with running([broker("a", vhosts[0])]) as (svc, sock):
        msgs = [
            p.build_publish("amq.direct", "no-such-key", b"unroutable", mandatory=True),
            p.build_publish("amq.direct", q.key, b"one", mandatory=True),
            p.build_publish("no-such-exchange", q.key, b"lost"),
            p.build_publish("amq.direct", q.key, b"two"),
        ]
        for f in msgs:
            assert await request(sock, f) == [b"0", b""]
        assert await request(sock, p.build_publish("amq.direct", q.key, b"x", immediate=True)) \
            == [b"-1", b"immediate flag not supported by RabbitMQ"]
        await drained(svc)
        r = svc.stats()["brokers"]["a"]["results"]
        assert r == {"returned": 1, "ack": 2, "no_exchange": 1}, r
        assert svc.outputs[0].disconnects == 0
    assert [b for _, b in await get_all(q, 2)] == [b"one", b"two"]


async def test_connections_closed_mid_stream_nothing_lost(vhosts):
    q = await make_queue(vhosts[0])
    n_msgs = 3000
    async with running([broker("a", vhosts[0])], max_inflight=200) as (svc, sock):
        out = svc.outputs[0]
        killed = trio.Event()

        async def killer():
            with trio.fail_after(20):
                while out.stats()["results"].get("ack", 0) < 300:
                    await trio.sleep(0.005)
            # the broker drops every connection of this vhost (like a broker restart)
            await trio.to_thread.run_sync(
                lambda: _ctl("close_all_connections", "-p", vhosts[0], "samwise test"))
            killed.set()

        async with trio.open_nursery() as n:
            n.start_soon(killer)
            for i in range(n_msgs):
                await zmq_trio.send_multipart(sock, [b""] + p.build_publish(
                    "amq.direct", q.key, b"%d" % i))
                assert (await zmq_trio.recv_multipart(sock))[1] == b"0"
                if i == n_msgs // 2:
                    with trio.fail_after(20):
                        await killed.wait()
        await drained(svc, timeout=30)
        assert out.disconnects >= 1
        assert svc.stats()["accepted"] == n_msgs
        assert await request(sock, [b"120", b"ping"]) == [b"0", b""]
    bodies = [b for _, b in await get_all(q, n_msgs)]
    assert set(bodies) == {b"%d" % i for i in range(n_msgs)}   # duplicates allowed, no loss


class DurableQueue(Queue):
    """A durable queue (survives a broker restart) bound to amq.direct."""

    durable = True


def _wait_rabbit_up(timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pika.BlockingConnection(_params()).close()
            return
        except Exception:
            time.sleep(0.25)
    raise TimeoutError("RabbitMQ did not come back")


async def test_broker_stopped_and_restarted_mid_stream_nothing_lost(vhosts):
    """rabbitmqctl stop_app / start_app in the middle of a stream of persistent messages:
    the endpoint keeps accepting (requests are spooled), the output reconnects with backoff
    and every message reaches the durable queue (duplicates allowed, no loss)."""
    q = await trio.to_thread.run_sync(DurableQueue, vhosts[0])
    n_msgs = 1000
    props = {"delivery_mode": 2}
    stopped = trio.Event()
    try:
        async with running([broker("a", vhosts[0])], max_inflight=100) as (svc, sock):
            out = svc.outputs[0]

            async def restarter():
                with trio.fail_after(20):
                    while out.stats()["results"].get("ack", 0) < 100:
                        await trio.sleep(0.005)
                await trio.to_thread.run_sync(lambda: _ctl("stop_app"))
                stopped.set()
                await trio.sleep(1.0)       # requests keep arriving while the broker is down
                await trio.to_thread.run_sync(lambda: _ctl("start_app"))
                await trio.to_thread.run_sync(_wait_rabbit_up)

            async with trio.open_nursery() as n:
                n.start_soon(restarter)
                for i in range(n_msgs):
                    await zmq_trio.send_multipart(sock, [b""] + p.build_publish(
                        "amq.direct", q.key, b"%d" % i, properties=props))
                    assert (await zmq_trio.recv_multipart(sock))[1] == b"0"
                    if i == n_msgs // 2:
                        with trio.fail_after(30):
                            await stopped.wait()
            await drained(svc, timeout=60)
            assert out.disconnects >= 1
            assert svc.stats()["accepted"] == n_msgs
        bodies = [b for _, b in await trio.to_thread.run_sync(q.get_all, n_msgs, 30.0)]
    finally:
        if stopped.is_set():
            await trio.to_thread.run_sync(lambda: _ctl("start_app", check=False))
            await trio.to_thread.run_sync(_wait_rabbit_up)
    assert set(bodies) == {b"%d" % i for i in range(n_msgs)}


async def test_rpc_allow_list_refuses_delete_by_default(vhosts):
    name = f"x-{uuid.uuid4().hex[:10]}"
    async with running([broker("a", vhosts[0])]) as (svc, sock):
        assert svc.config.rpc_allow == ("exchange.declare",)
        assert await request(sock, p.build_rpc("exchange.declare", name, "fanout")) == [b"0", b""]
        assert await request(sock, p.build_rpc("exchange.delete", name)) == \
            [b"-1", b"rpc method not allowed"]
        assert await request(sock, p.build_rpc("exchange.delete", name, broker="nope")) == \
            [b"-1", b"rpc method not allowed"]
        assert await trio.to_thread.run_sync(exchange_exists, vhosts[0], name)
        assert svc.requests[("rpc", "not_allowed")] == 2 and svc.requests[("rpc", "ok")] == 1
    async with running([broker("a", vhosts[0])], rpc_allow=()) as (svc, sock):
        assert await request(sock, p.build_rpc("exchange.declare", name + "y", "fanout")) == \
            [b"-1", b"rpc method not allowed"]
        assert not await trio.to_thread.run_sync(exchange_exists, vhosts[0], name + "y")
    async with running([broker("a", vhosts[0])],
                       rpc_allow=("exchange.declare", "exchange.delete")) as (svc, sock):
        assert await request(sock, p.build_rpc("exchange.delete", name)) == [b"0", b""]
        assert not await trio.to_thread.run_sync(exchange_exists, vhosts[0], name)


class HoldingProxy:
    """A TCP proxy in front of RabbitMQ that counts, from the broker's side, the AMQP
    connections the relay opens, and can hold new ones: while ``hold`` is set, a new
    connection is accepted but not forwarded until ``release`` -- the relay's rpc on it
    stays pending as long as the test wants, so the concurrent rpc connections are
    counted in a settled state, not sampled."""

    def __init__(self):
        self.port = 0
        self.hold = False
        self.release = trio.Event()
        self.held = 0               # connections accepted and waiting for the release
        self.peak_held = 0
        self.accepted = 0

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client):
        self.accepted += 1
        async with client:
            if self.hold and not self.release.is_set():
                self.held += 1
                self.peak_held = max(self.peak_held, self.held)
                try:
                    await self.release.wait()
                finally:
                    self.held -= 1
            try:
                up = await trio.open_tcp_stream(HOST, PORT)
            except OSError:
                return
            async with up:
                async with trio.open_nursery() as n:
                    n.start_soon(self._pipe, client, up, n.cancel_scope)
                    n.start_soon(self._pipe, up, client, n.cancel_scope)

    @staticmethod
    async def _pipe(src, dst, scope):
        try:
            while data := await src.receive_some(65536):
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()


@pytest.mark.slow
async def test_rpc_burst_is_bounded(vhosts):
    """Issue 10 §6: 2,000 rpc requests at once opened up to 144 AMQP connections.  Now at
    most samwise_rpc_max_concurrent (8) are open, 64 requests wait, the rest are refused
    at once; every request gets exactly one reply.  The connections are counted from the
    broker's side: a proxy holds every rpc connection open until all admitted requests
    either have one or wait for a slot, so the count does not depend on timing (a 2 ms
    sampler once saw none open on a loaded machine)."""
    n_req, clients, max_concurrent, max_queued = 2000, 4, 8, 64
    proxy = HoldingProxy()
    async with trio.open_nursery() as pn:
        await pn.start(proxy.serve)
        brokers = [broker("a", vhosts[0], proxy.port), broker("b", vhosts[1], proxy.port)]
        async with running(brokers, rpc_max_concurrent=max_concurrent,
                           rpc_max_queued=max_queued, rpc_timeout=300) as (svc, sock):
            assert proxy.accepted == 2                 # the two publishing connections
            proxy.hold = True
            ctx = zmq.Context.instance()
            socks = [ctx.socket(zmq.DEALER) for _ in range(clients)]
            replies: list[list[bytes]] = []
            try:
                for s in socks:
                    s.setsockopt(zmq.LINGER, 0)
                    s.connect(svc.bound[0])

                async def client(s, k):
                    for i in range(n_req // clients):
                        await zmq_trio.send_multipart(s, [b""] + p.build_rpc(
                            "exchange.declare", f"burst-{k}-{i % 3}", "fanout"))
                    for _ in range(n_req // clients):
                        replies.append((await zmq_trio.recv_multipart(s))[1:])

                async with trio.open_nursery() as cn:
                    for k, s in enumerate(socks):
                        cn.start_soon(client, s, k)
                    # settled: every request answered (refused) or admitted, and each
                    # admitted request's two calls (brokers a and b) either hold a
                    # connection at the proxy or wait for a slot
                    with trio.fail_after(120):
                        while not (len(replies) + svc.rpc.requests == n_req and
                                   proxy.held + svc.rpc.waiting == 2 * svc.rpc.requests):
                            await trio.sleep(0.01)
                    held, waiting, admitted = proxy.held, svc.rpc.waiting, svc.rpc.requests
                    print(f"rpc burst held: {admitted} requests admitted, {held} rpc "
                          f"connections open at the broker, {waiting} calls waiting, "
                          f"{len(replies)} refused at once")
                    assert held == max_concurrent, (held, waiting, admitted)
                    assert admitted == max_concurrent + max_queued
                    assert svc.stats()["rpc_connections"] == max_concurrent
                    proxy.release.set()
                    with trio.fail_after(120):
                        while len(replies) < n_req:
                            await trio.sleep(0.01)
            finally:
                for s in socks:
                    s.close(0)
            ok = sum(r == [b"0", b""] for r in replies)
            refused = sum(r == [b"-1", b"too many rpc requests"] for r in replies)
            assert len(replies) == n_req and ok + refused == n_req, \
                {bytes(b"|".join(r)) for r in replies} - {b"0|", b"-1|too many rpc requests"}
            # 8 running + 64 waiting when the burst arrived, none finished before the release
            assert ok == max_concurrent + max_queued and refused == n_req - ok
            print(f"rpc burst: {n_req} requests, {ok} ok, {refused} refused; rpc connections "
                  f"at once: {proxy.peak_held} at the broker (held), peak gauge "
                  f"{svc.stats()['rpc_connections_peak']}; connections the proxy saw: "
                  f"{proxy.accepted} (2 publishing)")
            assert proxy.peak_held == max_concurrent
            assert proxy.accepted == 2 + 2 * ok        # one connection per rpc call
            st = svc.stats()
            assert st["rpc_connections_peak"] == max_concurrent
            assert st["rpc_connections"] == 0 and st["rpc_waiting"] == 0 and svc.rpc.requests == 0
            assert svc.requests[("rpc", "overloaded")] == refused
            assert all(o.disconnects == 0 for o in svc.outputs)
        pn.cancel_scope.cancel()
