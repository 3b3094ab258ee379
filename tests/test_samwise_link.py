"""The broker link's I/O shortcuts against a scripted broker (no RabbitMQ): publishes
written directly on the socket (whole, partial or refused writes, the rest through the
writer task), confirms read with read(2), and the endpoint waking its broker feeders
itself (no spool watcher task)."""

from __future__ import annotations

import functools
import struct

import pytest
import trio
import trio.testing
import zmq

from logjam_relay.io import zmq_trio
from logjam_relay.protocols import amqp as A
from logjam_relay.protocols import samwise as p
from logjam_relay.samwise import link as L
from logjam_relay.samwise.config import BrokerConfig, SamwiseConfig
from logjam_relay.samwise.endpoint import SamwiseService
from logjam_relay.spool.spool import Spool

FRAME_END = 0xCE


class AckingBroker:
    """Opens a confirm channel, answers passive exchange checks, records every published
    body (in order) and confirms each publish (``basic.ack``, one per publish)."""

    def __init__(self):
        self.bodies: list[bytes] = []
        self.connections = 0

    async def handle(self, stream):
        from pika import frame as pframe
        from pika import spec

        buf = bytearray()

        async def frame():
            while True:
                if len(buf) >= 7:
                    kind, ch, size = struct.unpack_from(">BHI", buf)
                    if len(buf) >= 8 + size:
                        payload = bytes(buf[7:7 + size])
                        assert buf[7 + size] == FRAME_END, "frame end"
                        del buf[:8 + size]
                        return kind, ch, payload
                data = await stream.receive_some(1 << 20)
                if not data:
                    raise EOFError
                buf.extend(data)

        def send(ch, m):
            return stream.send_all(pframe.Method(ch, m).marshal())

        self.connections += 1
        try:
            while len(buf) < 8:
                buf.extend(await stream.receive_some(8))
            del buf[:8]
            await send(0, spec.Connection.Start(server_properties={}, mechanisms=b"PLAIN",
                                                locales=b"en_US"))
            await frame()                                    # start-ok
            await send(0, spec.Connection.Tune(2047, 131072, 0))
            await frame()                                    # tune-ok
            await frame()                                    # open
            await send(0, spec.Connection.OpenOk())
            tag = 0
            while True:
                kind, ch, payload = await frame()
                if kind == 1:
                    cls, meth = struct.unpack_from(">HH", payload)
                    if (cls, meth) == (20, 10):              # channel.open
                        await send(ch, spec.Channel.OpenOk())
                    elif (cls, meth) == (85, 10):            # confirm.select
                        await send(ch, spec.Confirm.SelectOk())
                    elif (cls, meth) == (40, 10):            # exchange.declare (passive)
                        await send(ch, spec.Exchange.DeclareOk())
                    elif (cls, meth) == (60, 40):            # basic.publish
                        tag += 1
                        self.bodies.append(b"")
                elif kind == 3:                              # body
                    self.bodies[-1] += payload
                    await send(1, spec.Basic.Ack(tag, False))
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def broker_cfg(name, port):
    return BrokerConfig(name=name, host="127.0.0.1", port=port, backoff_min=0.05,
                        backoff_max=0.05)


async def serve(nursery, broker):
    listeners = await nursery.start(functools.partial(trio.serve_tcp, broker.handle, 0,
                                                      host="127.0.0.1"))
    return listeners[0].socket.getsockname()[1]


@pytest.mark.parametrize("mode", ["whole", "partial", "refused"])
async def test_direct_writes_keep_every_publish_whole_and_in_order(monkeypatch, mode):
    """The link writes publishes on the socket itself; whatever a write leaves (a short
    write, EAGAIN) goes out through the writer task before anything newer."""
    real_write = L.os.write
    calls = {"n": 0, "short": 0}

    def write(fd, data):
        calls["n"] += 1
        if mode == "partial" and len(data) > 1000:
            calls["short"] += 1
            return real_write(fd, data[:1000])
        if mode == "refused" and calls["n"] % 2:
            calls["short"] += 1
            raise BlockingIOError
        return real_write(fd, data)
    monkeypatch.setattr(L.os, "write", write)

    broker = AckingBroker()
    events: list = []
    bodies = [bytes([i % 251]) * (100 + 997 * i) for i in range(60)]
    async with trio.open_nursery() as n:
        port = await serve(n, broker)
        link = L.Link(broker_cfg("b1", port), events.extend)
        n.start_soon(link.run)
        with trio.fail_after(10):
            while not link.ready:
                await trio.sleep(0.01)
        ex = "amq.direct"
        seq = 0
        for chunk in (bodies[:1], bodies[1:25], bodies[25:]):   # several batches
            items = []
            for b in chunk:
                seq += 1
                items.append(L.Out(seq, ex, A.shortstr(ex), A.shortstr("k"), b,
                                   A.NO_PROPERTIES, False, "k"))
            link.publish(link.gen, items)
            await trio.sleep(0)
        with trio.fail_after(10):
            while sum(len(e[2]) for e in events if e[0] == "confirms") < len(bodies):
                await trio.sleep(0.01)
        n.cancel_scope.cancel()
    assert broker.bodies == bodies
    confirmed = [c for e in events if e[0] == "confirms" for c in e[2]]
    assert sorted(confirmed) == [(i + 1, L.ACK) for i in range(len(bodies))]
    assert calls["n"] > 0                       # the direct path was taken
    if mode != "whole":
        assert calls["short"] > 0               # and the writer finished what it left


def test_raw_fd_only_for_plain_tcp():
    conn = L.Conn(broker_cfg("b1", 1))
    assert conn.raw_fd() == -1                  # not connected
    conn.stream = trio.testing.MemorySendStream()
    assert conn.raw_fd() == -1                  # not a socket (TLS is an SSLStream)


async def test_endpoint_wakes_every_feeder_and_readers_step_over_others(tmp_path):
    """No spool watcher task: the endpoint notifies the feeders after each append, so
    every request is published once and both readers end at the spool's end (each steps
    over the other broker's records); with the real spool a redundant request is
    delivered once."""
    brokers = [AckingBroker(), AckingBroker()]
    async with trio.open_nursery() as n:
        ports = [await serve(n, b) for b in brokers]
        cfg = SamwiseConfig(("tcp://127.0.0.1:0",),
                            tuple(broker_cfg(f"b{i}", port) for i, port in enumerate(ports)))
        spool = Spool(str(tmp_path / "spool"), readers=cfg.reader_names())
        svc = SamwiseService(cfg, spool)
        await n.start(svc.run)
        assert all(not o.watch_spool for o in svc.outputs)
        with trio.fail_after(10):
            while not all(o.connected for o in svc.outputs):
                await trio.sleep(0.01)
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(svc.bound[0])
        try:
            for i in range(41):
                copies = 2 if i % 10 == 9 else None
                req = p.build_publish("amq.direct", "k", b"m%d" % i, copies=copies)
                await zmq_trio.send_multipart(sock, req)
                with trio.fail_after(10):
                    assert await zmq_trio.recv_multipart(sock) == [b"0", b""]
            with trio.fail_after(10):
                while svc.backlog() or sum(o.results["ack"] for o in svc.outputs) < 45:
                    await trio.sleep(0.01)
            # delivered = every target broker confirmed: a redundant request counts once
            # (the positions of a batch's later records derived from the spool's first)
            assert svc.delivered == 41 and not svc._copies_left
        finally:
            sock.close(0)
        n.cancel_scope.cancel()
    spool.close()
    got = sorted(brokers[0].bodies + brokers[1].bodies)
    redundant = [b"m%d" % i for i in (9, 19, 29, 39)]
    assert got == sorted([b"m%d" % i for i in range(41)] + redundant)
    assert all(m in brokers[0].bodies and m in brokers[1].bodies for m in redundant)
    assert brokers[0].bodies and brokers[1].bodies          # round robin used both


async def test_positions_of_a_batch_are_where_the_spool_put_them(tmp_path):
    """The endpoint derives the positions of a batch's records from the first one the
    spool returns (for the redundant publishes' delivery count): they are exactly where a
    reader finds them, for any frame count and size, across a segment roll."""
    import random

    from logjam_relay.samwise.endpoint import _positions
    from logjam_relay.spool.api import KIND_SAMWISE

    rng = random.Random(5)
    spool = Spool(str(tmp_path / "s"), readers=["r"], segment_bytes=64 * 1024)
    want, got = [], []
    for _ in range(40):
        records = [(KIND_SAMWISE, [bytes(rng.randrange(256) for _ in range(rng.choice(
            [0, 1, 7, 300, 5000]))) for _ in range(rng.randrange(1, 25))])
            for _ in range(rng.randrange(1, 12))]
        got += _positions(spool.append_records(records), records)
    reader = spool.reader("r")
    while True:
        recs = reader.read(100)
        if not recs:
            break
        want += [r.position for r in recs]
    spool.close()
    assert len({p.segment for p in want}) > 1          # rolled at least once
    assert got == want
    assert _positions([1, 2], [("a",), ("b",)]) == [1, 2]   # MemoryStore's list
    assert _positions(None, [("a",)]) is None
