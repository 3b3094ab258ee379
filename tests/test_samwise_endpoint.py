"""The samwise ROUTER endpoint without RabbitMQ: brokers point at closed ports, so
every publish is only accepted into the (in-memory) spool."""

from __future__ import annotations

import contextlib
import functools
import threading

import pytest
import trio
import zmq

from logjam_relay.io import zmq_trio
from logjam_relay.protocols import samwise as p
from logjam_relay.samwise.config import BrokerConfig, SamwiseConfig
from logjam_relay.samwise.endpoint import Distributor, MemoryStore, SamwiseService
from logjam_relay.samwise.output import split_record
from logjam_relay.spool.api import KIND_SAMWISE
from test_samwise_protocol import MALFORMED_PUBLISH, MALFORMED_RPC


def dead_broker(name, port):
    return BrokerConfig(name=name, host="127.0.0.1", port=port, backoff_min=0.05, backoff_max=0.2,
                        connect_timeout=1.0)


@contextlib.asynccontextmanager
async def running(tmp_path, port_factory, n_brokers=2, store=None, **kw):
    eps = ("tcp://127.0.0.1:0", f"ipc://{tmp_path}/samwise.ipc")
    brokers = tuple(dead_broker(f"b{i + 1}", port_factory()) for i in range(n_brokers))
    store = store or MemoryStore()
    svc = SamwiseService(SamwiseConfig(eps, brokers, **kw), store)
    ctx = zmq.Context.instance()
    socks = []

    def client(kind=zmq.REQ, ep=0):
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(svc.bound[ep])
        socks.append(s)
        return s
    async with trio.open_nursery() as n:
        await n.start(svc.run)
        try:
            yield svc, store, client
        finally:
            for s in socks:
                s.close(0)
            n.cancel_scope.cancel()


async def req(sock, frames):
    """One request; DEALERs add/strip the empty delimiter like REQ does."""
    dealer = sock.type == zmq.DEALER
    await zmq_trio.send_multipart(sock, ([b""] if dealer else []) + frames)
    with trio.fail_after(10):
        rep = await zmq_trio.recv_multipart(sock)
    if dealer:
        assert rep[0] == b""
        rep = rep[1:]
    return rep


async def test_reference_requests_and_every_malformed_case(tmp_path, port_factory):
    async with running(tmp_path, port_factory) as (svc, store, client):
        r, d = client(zmq.REQ), client(zmq.DEALER, ep=1)
        for s in (r, d):
            assert await req(s, [b"120", b"ping"]) == [b"0", b""]
            assert await req(s, [b"100", b"ping"]) == [b"0"]
            assert await req(s, [b"110", b"ping"]) == [b"-1", b"wrong protocol version"]
            assert await req(s, [b"-1", b"ping"]) == [b"-1", b"malformed request"]
            assert await req(s, [b"120"]) == [b"-1", b"no payload"]
            assert await req(s, [b"120", b"consume"]) == [b"-1", b"unknown action"]
            assert await req(s, [b"120", b"ping\x00", b"extra"]) == [b"0", b""]
            for frames in MALFORMED_PUBLISH:
                assert await req(s, frames) == [b"-1", b"malformed publishing request"], frames
            for frames in MALFORMED_RPC:
                assert await req(s, frames) == [b"-1", b"malformed rpc request"], frames
            assert await req(s, [b"120", b"stop"]) == [b"-1", b"action not permitted"]
            assert await req(s, [b"120", b"ping"]) == [b"0", b""]   # still serving
        assert store.appended == 0
        assert svc.requests[("publish", "malformed_publish")] == 2 * len(MALFORMED_PUBLISH)
        assert svc.requests[("other", "unknown_action")] == 2


async def test_publish_is_in_the_spool_before_the_reply(tmp_path, port_factory):
    async with running(tmp_path, port_factory) as (svc, store, client):
        s = client()
        readers = [o.reader for o in svc.outputs]
        assert [rd.name for rd in readers] == ["samwise.b1", "samwise.b2"]
        f120 = p.build_publish("ex", "rk", b"one", headers={"h": "v"})
        f100 = p.build_publish("ex", "rk", b"two", version=100)
        for i, f in enumerate([f120, f100, f120, p.build_publish("ex", "rk", b"r", copies=2)]):
            rep = await req(s, f)
            assert rep == ([b"0"] if f is f100 else [b"0", b""])
            assert store.appended == i + 1          # stored before the reply was sent
        recs = readers[0].read(10)
        assert all(rec.kind == KIND_SAMWISE for rec in recs)
        targets = [split_record(rec.frames)[0] for rec in recs]
        # both brokers down: plain rotation in config order
        assert targets == [[b"b1"], [b"b2"], [b"b1"], [b"b2", b"b1"]]
        assert split_record(recs[0].frames)[1] == f120 and split_record(recs[1].frames)[1] == f100
        assert await req(s, p.build_publish("ex", "rk", b"x", copies=3)) == \
            [b"-1", b"redundancy exceeds the number of brokers"]
        assert await req(s, p.build_publish("ex", "rk", b"x", immediate=True)) == \
            [b"-1", b"immediate flag not supported by RabbitMQ"]
        assert await req(s, p.build_publish("ex", "rk", b"x", properties={"user_id": "bob"})) == \
            [b"-1", b"user_id must be the broker user"]
        st = svc.stats()
        assert st["accepted"] == 4 and st["requests"]["publish:rejected"] == 3
        assert st["backlog_records"] == 8 and st["brokers"]["b1"]["connected"] == 0
        rep = await req(s, [b"120", b"status"])
        assert rep[0] == b"0" and b"b2 (amqp://guest@127.0.0.1:" in rep[1] and b"nope" in rep[1]


async def test_concurrent_req_and_dealer_clients(tmp_path, port_factory):
    n_clients, n_msgs = 6, 50
    async with running(tmp_path, port_factory) as (svc, store, client):
        async def one(k):
            s = client(zmq.REQ if k % 2 else zmq.DEALER, ep=k % 2)
            for i in range(n_msgs):
                assert await req(s, p.build_publish("ex", "rk", b"%d-%d" % (k, i))) == [b"0", b""]
        async with trio.open_nursery() as n:
            for k in range(n_clients):
                n.start_soon(one, k)
        # a pipelining DEALER: many requests in flight, replies in order
        d = client(zmq.DEALER)
        for i in range(100):
            await zmq_trio.send_multipart(d, [b""] + p.build_publish("ex", "rk", b"p%d" % i))
        for _ in range(100):
            with trio.fail_after(10):
                assert await zmq_trio.recv_multipart(d) == [b"", b"0", b""]
        # a DEALER without the empty delimiter is answered without one
        await zmq_trio.send_multipart(d, [b"120", b"ping"])
        with trio.fail_after(10):
            assert await zmq_trio.recv_multipart(d) == [b"0", b""]
        assert store.appended == n_clients * n_msgs + 100


async def test_rpc_errors_are_reported(tmp_path, port_factory):
    async with running(tmp_path, port_factory, rpc_timeout=2.0,
                       rpc_allow=("exchange.declare", "exchange.delete")) as (svc, store, client):
        s = client()
        rep = await req(s, p.build_rpc("exchange.declare", "x", "direct"))
        assert rep[0] == b"-1" and rep[1].startswith(b"b1: cannot connect") and b"; b2: " in rep[1]
        assert await req(s, p.build_rpc("exchange.delete", "x", broker="zz")) == \
            [b"-1", b"unknown broker"]
        # the endpoint serves other requests while an rpc is pending
        d = client(zmq.DEALER)
        await zmq_trio.send_multipart(d, [b""] + p.build_rpc("exchange.delete", "x", broker="b2"))
        assert await req(client(zmq.DEALER), [b"120", b"ping"]) == [b"0", b""]
        with trio.fail_after(10):
            rep = await zmq_trio.recv_multipart(d)
        assert rep[1] == b"-1" and rep[2].startswith(b"b2: ")


class FailingStore(MemoryStore):
    fail = True
    full = False

    async def append_records(self, records):   # an async store works too
        await trio.lowlevel.checkpoint()
        if self.fail:
            raise OSError("disk full")
        return super().append_batch(records)

    def would_block(self):
        return self.full


async def test_spool_failure_is_an_error_reply(tmp_path, port_factory):
    store = FailingStore()
    async with running(tmp_path, port_factory, store=store) as (svc, _, client):
        s = client()
        assert await req(s, p.build_publish("ex", "rk", b"x")) == [b"-1", b"spool error"]
        store.fail = False
        assert await req(s, p.build_publish("ex", "rk", b"x")) == [b"0", b""]
        store.full = True
        assert await req(s, p.build_publish("ex", "rk", b"y")) == [b"-1", b"spool error"]
        assert await req(s, [b"120", b"ping"]) == [b"0", b""]
        assert svc.stats()["spool_errors"] == 2 and store.appended == 1


async def test_no_thread_and_no_connection_outlives_the_service(tmp_path, port_factory):
    """The broker links run on the trio thread (no pika thread); a broker that accepts
    TCP but never speaks AMQP sees every connection closed when the service stops."""
    conns: list[trio.SocketStream] = []
    eofs = []

    async def handler(stream):
        conns.append(stream)
        while await stream.receive_some(4096):
            pass
        eofs.append(stream)

    threads_before = {t.name for t in threading.enumerate()}
    async with trio.open_nursery() as n:
        listeners = await n.start(functools.partial(trio.serve_tcp, handler, 0,
                                                    host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        brokers = tuple(BrokerConfig(name=f"b{i}", host="127.0.0.1", port=port,
                                     connect_timeout=30.0) for i in range(3))
        cfg = SamwiseConfig(("tcp://127.0.0.1:0",), brokers)
        svc = SamwiseService(cfg, MemoryStore())
        async with trio.open_nursery() as sn:
            await sn.start(svc.run)
            with trio.fail_after(10):
                while len(conns) < 3:
                    await trio.sleep(0.01)
            assert {t.name for t in threading.enumerate()} <= threads_before | {"Trio thread cache"}
            sn.cancel_scope.cancel()
        with trio.fail_after(5):
            while len(eofs) < 3:
                await trio.sleep(0.01)
        n.cancel_scope.cancel()
    assert len(conns) == 3


def test_distributor_prefers_connected_brokers():
    class Out:
        def __init__(self, name, connected):
            self.name, self.connected = name, connected
    outs = [Out("a", True), Out("b", False), Out("c", True)]
    d = Distributor(outs)
    assert [d.pick(1) for _ in range(4)] == [["a"], ["c"], ["a"], ["c"]]
    assert d.pick(2) == ["a", "c"] and d.pick(3) == ["c", "a", "b"]
    outs[1].connected = True
    assert [d.pick(1)[0] for _ in range(3)] == ["a", "b", "c"]


_RR = [b"120", b"publish", b"round robin", b"amq.direct", b"probe", b"", b""]


# property counts 2 and 13 abort samd (an assert, no reply: measured,
# shared/specs/reference/samwise.md)
@pytest.mark.parametrize("frames", [_RR + [b"0", b"0", b"payload"],
                                    _RR + [b"2", b"p1", b"p2", b"0", b"payload"],
                                    _RR + [b"13", *[b""] * 13, b"0", b"payload"]],
                         ids=["props-0", "props-2", "props-13"])
async def test_samd_crash_input_is_a_clean_error(tmp_path, port_factory, frames):
    async with running(tmp_path, port_factory, n_brokers=1) as (svc, store, client):
        assert await req(client(), frames) == [b"-1", b"malformed publishing request"]
        assert store.appended == 0


async def test_rpc_concurrency_and_queue_are_bounded():
    """A broker that accepts TCP and never answers: with samwise_rpc_max_concurrent=1 and
    samwise_rpc_max_queued=1, three rpc requests at once open one rpc connection at a
    time, the third is refused at once, and every request gets one reply."""
    open_now = 0
    peak = 0

    async def stall(stream):
        nonlocal open_now, peak
        open_now += 1
        peak = max(peak, open_now)
        try:
            while await stream.receive_some(4096):
                pass
        finally:
            open_now -= 1

    async with trio.open_nursery() as n:
        listeners = await n.start(functools.partial(trio.serve_tcp, stall, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        b = BrokerConfig(name="b1", host="127.0.0.1", port=port, connect_timeout=30.0)
        cfg = SamwiseConfig(("tcp://127.0.0.1:0",), (b,), rpc_max_concurrent=1,
                            rpc_max_queued=1, rpc_timeout=0.5)
        svc = SamwiseService(cfg, MemoryStore())
        await n.start(svc.run)
        with trio.fail_after(10):
            while open_now < 1:                 # the publishing connection (handshaking)
                await trio.sleep(0.01)
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(svc.bound[0])
        try:
            for i in range(3):
                await zmq_trio.send_multipart(d, [b""] + p.build_rpc("exchange.declare", f"x{i}",
                                                                     "direct"))
            with trio.fail_after(10):
                replies = [(await zmq_trio.recv_multipart(d))[1:] for _ in range(3)]
        finally:
            d.close(0)
        assert replies[0] == [b"-1", b"too many rpc requests"]     # answered at once
        assert all(r[0] == b"-1" and (r[1] == b"b1: timeout" or r[1] == b"rpc timeout")
                   for r in replies[1:]), replies
        assert peak == 2                        # publishing + one rpc at a time
        assert svc.rpc.peak_connections == 1 and svc.rpc.requests == 0
        assert svc.requests[("rpc", "overloaded")] >= 1
        n.cancel_scope.cancel()


class ScriptedBroker:
    """Just enough of an AMQP broker (frames by pika's spec) to open a confirm channel;
    then each connection runs ``after_open(stream, k)`` (k = connection number)."""

    def __init__(self, after_open, heartbeat=0):
        self.after_open = after_open
        self.heartbeat = heartbeat
        self.connections = 0

    async def _frames(self, stream, buf):
        from pika import frame as pframe
        while True:
            n, f = pframe.decode_frame(bytes(buf)) if buf else (0, None)
            if n:
                del buf[:n]
                return f
            data = await stream.receive_some(65536)
            if not data:
                raise EOFError
            buf += data

    async def handle(self, stream):
        from pika import frame as pframe
        from pika import spec

        def send(ch, m):
            return stream.send_all(pframe.Method(ch, m).marshal())
        self.connections += 1
        k = self.connections
        buf = bytearray()
        try:
            while len(buf) < 8:
                buf += await stream.receive_some(8)
            del buf[:8]                                       # protocol header
            await send(0, spec.Connection.Start(server_properties={}, mechanisms=b"PLAIN",
                                                locales=b"en_US"))
            await self._frames(stream, buf)                   # start-ok
            await send(0, spec.Connection.Tune(2047, 131072, self.heartbeat))
            await self._frames(stream, buf)                   # tune-ok
            await self._frames(stream, buf)                   # open
            await send(0, spec.Connection.OpenOk())
            await self._frames(stream, buf)                   # channel.open
            await send(1, spec.Channel.OpenOk())
            await self._frames(stream, buf)                   # confirm.select
            await send(1, spec.Confirm.SelectOk())
            await self.after_open(stream, k)
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def test_link_counts_protocol_errors_and_drops_silent_brokers():
    """Bad bytes from a broker drop that connection (counted by reason, then reconnect);
    a broker that goes silent is dropped after two heartbeat intervals; connection.blocked
    is reported."""
    from pika import frame as pframe
    from pika import spec

    async def after_open(stream, k):
        if k == 1:
            await stream.send_all(pframe.Method(1, spec.Basic.Ack(1)).marshal()[:-1] + b"\x00")
        elif k == 2:
            await stream.send_all(pframe.Method(0, spec.Connection.Blocked("low disk")).marshal())
        await trio.sleep_forever()                    # silent: no heartbeats, no data

    fake = ScriptedBroker(after_open, heartbeat=1)
    async with trio.open_nursery() as n:
        listeners = await n.start(functools.partial(trio.serve_tcp, fake.handle, 0,
                                                    host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        b = BrokerConfig(name="b1", host="127.0.0.1", port=port, backoff_min=0.05,
                         backoff_max=0.05, heartbeat=1)
        svc = SamwiseService(SamwiseConfig(("tcp://127.0.0.1:0",), (b,)), MemoryStore())
        await n.start(svc.run)
        out = svc.outputs[0]
        with trio.fail_after(10):
            while fake.connections < 2 or not out.connected:
                await trio.sleep(0.01)
            while not out.stats()["blocked"]:
                await trio.sleep(0.01)
            # no data for 2 heartbeat intervals: dropped, reconnected
            while fake.connections < 3:
                await trio.sleep(0.05)
        st = out.stats()
        assert st["amqp_errors"] == {"bad_frame_end": 1}
        assert st["disconnects"] >= 1 and "heartbeat" in out.last_error
        n.cancel_scope.cancel()
