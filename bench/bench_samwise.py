"""Publish rate through the samwise endpoint vs. pika publishing directly, both with confirms.

    python bench/bench_samwise.py [--messages 20000] [--size 200] [--url amqp://guest:guest@127.0.0.1:5672/]

Baseline: one pika SelectConnection publishing the same messages to the same
exchange/queue with publisher confirms, pipelined (up to --window unconfirmed),
the best way to use the client.  Endpoint: DEALER clients (REQ-style envelope), each in its own process like
real samd clients, pipelining samwise 1.1 publish requests into the endpoint (in-memory spool),
which publishes to the broker with confirms; timed until the last message is
confirmed by the broker.  Both run in the same process, one after the other,
against the same queue (purged between runs).
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time
import uuid

import pika
import trio
import zmq

from logjam_relay.protocols import samwise as proto
from logjam_relay.samwise.config import SamwiseConfig, parse_broker
from logjam_relay.samwise.endpoint import MemoryStore, SamwiseService


def baseline(params, key, bodies, window) -> float:
    """pika SelectConnection, confirms, pipelined: seconds for all confirms."""
    done = threading.Event()
    st = {"sent": 0, "acked": 0, "t0": 0.0, "t1": 0.0, "ch": None}
    n = len(bodies)

    def pump():
        ch = st["ch"]
        while st["sent"] < n and st["sent"] - st["acked"] < window:
            ch.basic_publish("amq.direct", key, bodies[st["sent"]])
            st["sent"] += 1

    def on_confirm(frame):
        m = frame.method
        st["acked"] = m.delivery_tag if m.multiple else st["acked"] + 1
        if st["acked"] >= n:
            st["t1"] = time.perf_counter()
            conn.close()
            return
        pump()

    def on_channel(ch):
        st["ch"] = ch
        ch.confirm_delivery(on_confirm, callback=lambda _f: start())

    def start():
        st["t0"] = time.perf_counter()
        pump()

    conn = pika.SelectConnection(params, on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
                                 on_close_callback=lambda c, e: (c.ioloop.stop(), done.set()))
    conn.ioloop.start()
    return st["t1"] - st["t0"]


def _client_proc(endpoint, key, size, first, count, ready, go):
    """A separate process (like real samd clients): pipelined DEALER, up to 200 in flight."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    reqs = [[b""] + proto.build_publish("amq.direct", key, (b"%08d" % i).ljust(size, b"x"))
            for i in range(first, first + count)]
    ready.set()
    go.wait()
    sent = got = 0
    while got < count:
        while sent < count and sent - got < 200:
            s.send_multipart(reqs[sent])
            sent += 1
        rep = s.recv_multipart()
        assert rep[1] == b"0", rep
        got += 1
    s.close()
    ctx.term()


async def through_endpoint(broker_arg, key, n, size, clients, window) -> tuple[float, float]:
    cfg = SamwiseConfig.from_args(["tcp://127.0.0.1:0"], [broker_arg], max_inflight=window)
    svc = SamwiseService(cfg, MemoryStore())
    mp = multiprocessing.get_context("spawn")
    async with trio.open_nursery() as nursery:
        eps = await nursery.start(svc.run)
        with trio.fail_after(10):
            while not svc.outputs[0].connected:
                await trio.sleep(0.01)
        per = n // clients
        go = mp.Event()
        readies = [mp.Event() for _ in range(clients)]
        procs = [mp.Process(target=_client_proc, args=(eps[0], key, size, k * per, per, readies[k], go))
                 for k in range(clients)]
        for pr in procs:
            pr.start()
        for r in readies:
            await trio.to_thread.run_sync(r.wait)
        t0 = time.perf_counter()
        go.set()
        for pr in procs:
            await trio.to_thread.run_sync(pr.join)
        accepted = time.perf_counter() - t0
        while svc.backlog():
            await trio.sleep(0.001)
        confirmed = time.perf_counter() - t0
        res = svc.stats()["brokers"][svc.outputs[0].name]["results"]
        assert res.get("ack") == per * clients, res
        nursery.cancel_scope.cancel()
    return accepted, confirmed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--window", type=int, default=2000)
    ap.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    a = ap.parse_args()
    a.messages -= a.messages % a.clients
    bcfg = parse_broker("bench=" + a.url)
    params = pika.ConnectionParameters(bcfg.host, bcfg.port, bcfg.vhost,
                                       pika.PlainCredentials(bcfg.user, bcfg.password))
    qname = f"bench-samwise-{uuid.uuid4().hex[:8]}"
    c = pika.BlockingConnection(params)
    ch = c.channel()
    ch.queue_declare(qname, auto_delete=False)
    ch.queue_bind(qname, "amq.direct", qname)
    bodies = [(b"%08d" % i).ljust(a.size, b"x") for i in range(a.messages)]
    try:
        base = baseline(params, qname, bodies, a.window)
        ch.queue_purge(qname)
        accepted, confirmed = trio.run(through_endpoint, "bench=" + a.url, qname, a.messages,
                                       a.size, a.clients, a.window)
        ch.queue_purge(qname)
    finally:
        ch.queue_delete(qname)
        c.close()
    n = a.messages
    print(f"messages={n} size={a.size}B clients={a.clients} window={a.window} (1 broker, confirms)")
    print(f"baseline pika direct      : {n / base:10.0f} msg/s  ({base:.3f} s)")
    print(f"samwise endpoint accepted : {n / accepted:10.0f} msg/s  ({accepted:.3f} s, replies, in spool)")
    print(f"samwise endpoint confirmed: {n / confirmed:10.0f} msg/s  ({confirmed:.3f} s, all broker-confirmed)")
    print(f"ratio confirmed/baseline  : {base / confirmed:10.2f}")


if __name__ == "__main__":
    main()
