"""samwise endpoint vs. a samd-equivalent, with samcli-like REQ clients.

    python bench/bench_samwise.py [--requests 5000] [--size 200] [--url amqp://guest:guest@127.0.0.1:5672/]

Clients: ``bench/samwise_req.c`` (built here against pyzmq's libzmq), a REQ socket with
one outstanding request, as samwise's own ``samcli`` - one process per client.  Without
a C compiler a Python REQ client is used (and the figures say so).

Three scenarios, the ones samd was measured in with samcli (2 brokers = 2 connections to
the same RabbitMQ):

* round robin, 1 client;  * redundant 2, 1 client;  * round robin, 4 clients.

Each is run against two servers, each in a process of its own:

* **samd-equivalent** (the baseline of every ratio): a tight, blocking Python loop that does
  per request what samd does (``samd.c:handle_req`` -> ``sam.c``): receive on the REP side,
  parse and validate the request (the same parser), store it (an append to a file, as samd's
  buffer puts it into BerkeleyDB), reply ``[0, ""]``, then publish it to the chosen broker(s)
  with publisher confirms (frames encoded by ``protocols/amqp.py``, one write per message
  on a plain blocking socket, as samd's backend thread does with rabbitmq-c); confirms
  are read as they come.  samd replies once the request is handed to its distributor,
  before anything is published or confirmed (the reference measurements of samd,
  ``shared/specs/reference/samwise.md`` beside the clone, section 4), and publishes on
  other threads: reply-then-publish is that order without the thread hops.  It has no event loop, no spool index, no cursors and no retry.

  Calibration (is it samd?): samd's own figures (samcli, an idle machine) are
  3.7-5.1k / 3.3-5.5k / 5.6-7.1k req/s.  This loop, on the same machines under a load
  average of 5-13 from other work, ran at 1.6-4.7k / 1.7-4.4k / 4.8-7.0k: at or below
  samd's figures, as a busy machine should make it.  A leaner loop (samwise's C batch
  receive/send and its parse memo, ``--lean-baseline``) ran at up to 6.2k / 4.6k / 9.3k
  under load 8-11 -- with 4 clients above samd's best on an idle machine -- so it would no
  longer be samd's rate but a stricter bar;
  docs/samwise.md gives samwise's figures against that one too.
* **samwise endpoint**: ``SamwiseService`` with the real on-disk ``Spool`` (as the relay
  runs it), two ``BrokerOutput``s.

Printed per scenario: client req/s for both, the ratio, and when the last message was
broker-confirmed.  samd's own figures (measured with samcli on these
machines) are printed for context; samd builds here, but this bench does not run it.
Speed is never asserted in tests; this is where it lives.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid

import pika
import zmq

from logjam_relay.protocols import amqp as A
from logjam_relay.protocols import samwise as proto
from logjam_relay.samwise.config import parse_broker

SAMD_ISSUE_14 = {"rr1": (3700, 5100), "red2": (3300, 5500), "rr4": (5600, 7100)}
SCENARIOS = (("rr1", "round robin, 1 client", None, 1),
             ("red2", "redundant 2, 1 client", 2, 1),
             ("rr4", "round robin, 4 clients", None, 4))


def _cpu() -> float:
    """CPU seconds of this process (all threads): user + system."""
    t = os.times()
    return t.user + t.system


# ----------------------------------------------------------------- samd-equivalent


class BlockingPublisher:
    """One broker connection in confirm mode on a blocking socket."""

    def __init__(self, b):
        self.sock = socket.create_connection((b.host, b.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.c = A.AmqpClient(b.user, b.password, b.vhost, heartbeat=0)
        self.c.start()
        self._until(A.ConnectionOpen)
        self.c.open_channel(1)
        self._until(A.ChannelOpenOk)
        self.c.confirm_select(1)
        self._until(A.ConfirmSelectOk)
        self.tag = 0
        self.confirmed = 0      # highest tag below which everything is confirmed
        self.t_last = 0.0

    def _until(self, kind):
        while True:
            self.sock.sendall(self.c.data_to_send())
            for ev in self.c.receive_data(self.sock.recv(65536)):
                if isinstance(ev, kind):
                    return ev
                if isinstance(ev, A.ConnectionClosed | A.ChannelClosed):
                    raise RuntimeError(ev)

    def publish(self, ex: bytes, rk: bytes, body: bytes) -> None:
        self.c.publish(1, ex, rk, body)
        self.sock.sendall(self.c.data_to_send())
        self.tag += 1

    def _take(self, data: bytes) -> None:
        for ev in self.c.receive_data(data):
            if isinstance(ev, A.Ack):   # RabbitMQ confirms in order on one channel
                self.confirmed = max(self.confirmed, ev.delivery_tag)
                self.t_last = time.monotonic()
            elif not isinstance(ev, A.ConnectionBlocked | A.ConnectionUnblocked):
                raise RuntimeError(ev)

    def poll(self) -> None:
        while self.confirmed < self.tag:
            try:
                data = self.sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            self._take(data)

    def wait_all(self) -> None:
        while self.confirmed < self.tag:
            self._take(self.sock.recv(65536))


def samd_equivalent(url, endpoint_q, ctl, store_dir, lean=False):
    b = parse_broker("b=" + url)
    brokers = [BlockingPublisher(b), BlockingPublisher(b)]
    ctx = zmq.Context()
    rep = ctx.socket(zmq.ROUTER)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    fd = os.open(os.path.join(store_dir, "samd-buffer"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    endpoint_q.put((f"tcp://127.0.0.1:{port}", _cpu()))
    poller = zmq.Poller()
    poller.register(rep, zmq.POLLIN)
    poller.register(ctl.fileno(), zmq.POLLIN)
    cursor = 0
    stored = 0
    pack = struct.Struct(">I").pack
    if lean:
        return _lean_loop(brokers, rep, fd, poller, ctl)
    while True:
        ready = dict(poller.poll())
        if ctl.fileno() in ready:
            _report(ctl, brokers, stored)
            return
        while True:
            try:
                msg = rep.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            env, body = msg[:2], msg[2:]
            try:
                ev = proto.parse_request(body)
            except proto.SamwiseError as e:
                rep.send_multipart(env + proto.error_reply(e.message))
                continue
            os.write(fd, b"".join(pack(len(f)) + f for f in body))      # samd's buffer
            stored += 1
            # samd replies once the request is handed to its distributor and its backend
            # thread publishes meanwhile: reply first, then publish (nothing waits for it)
            rep.send_multipart(env + proto.ok_reply(ev.version))
            ex, rk = A.shortstr(ev.exchange), A.shortstr(ev.routing_key)
            for _ in range(ev.copies):
                brokers[cursor].publish(ex, rk, ev.payload)
                cursor = (cursor + 1) % len(brokers)
            for p in brokers:
                p.poll()


def samd_lean(url, endpoint_q, ctl, store_dir):
    """``--lean-baseline``: the same loop with samwise's C batch receive/send and its parse
    memo -- a stricter bar than samd (see the calibration note in the module docstring)."""
    samd_equivalent(url, endpoint_q, ctl, store_dir, lean=True)


def _report(ctl, brokers, stored: int) -> None:
    """Answer the controller's stop: wait for every confirm, then the figures."""
    ctl.recv()
    for p in brokers:
        p.wait_all()
    ctl.send({"stored": stored, "confirmed": sum(p.confirmed for p in brokers),
              "t_last_confirm": max(p.t_last for p in brokers), "cpu": _cpu()})


def _lean_loop(brokers, rep, fd, poller, ctl):
    from logjam_relay.io import zmq_trio
    memo = proto.PublishMemo(lambda ev: (A.shortstr(ev.exchange), A.shortstr(ev.routing_key)))
    drain, send_replies = zmq_trio.drain, zmq_trio.send_replies
    cursor = stored = 0
    while True:
        ready = dict(poller.poll())
        if ctl.fileno() in ready:
            _report(ctl, brokers, stored)
            return
        for msg in drain(rep, 500):
            env, body = msg[:2], msg[2:]
            try:
                ev, (ex, rk) = memo.parse(body)
            except proto.SamwiseError as e:
                send_replies(rep, [env + proto.error_reply(e.message)])
                continue
            os.write(fd, b"".join([struct.pack(f">{len(body)}I", *map(len, body)), *body]))
            stored += 1
            send_replies(rep, [env + proto.ok_reply(ev.version)])
            for _ in range(ev.copies):
                brokers[cursor].publish(ex, rk, ev.payload)
                cursor = (cursor + 1) % len(brokers)
            for p in brokers:
                p.poll()


# ----------------------------------------------------------------- samwise endpoint


def samwise_endpoint(url, endpoint_q, ctl, store_dir):
    import trio

    from logjam_relay.samwise.config import SamwiseConfig
    from logjam_relay.samwise.endpoint import SamwiseService
    from logjam_relay.spool.spool import Spool

    async def main():
        cfg = SamwiseConfig.from_args(["tcp://127.0.0.1:0"], ["a=" + url, "b=" + url])
        spool = Spool(store_dir, readers=cfg.reader_names())
        svc = SamwiseService(cfg, spool)
        async with trio.open_nursery() as n:
            n.start_soon(spool.run)
            eps = await n.start(svc.run)
            with trio.fail_after(10):
                while not all(o.connected for o in svc.outputs):
                    await trio.sleep(0.005)
            endpoint_q.put((eps[0], _cpu()))
            await trio.to_thread.run_sync(ctl.recv)
            t_last = 0.0
            while svc.backlog():
                await trio.sleep(0.0005)
                t_last = time.monotonic()
            st = svc.stats()
            ctl.send({"stored": st["accepted"],
                      "confirmed": sum(b["results"].get("ack", 0) for b in st["brokers"].values()),
                      "t_last_confirm": t_last or time.monotonic(), "cpu": _cpu()})
            n.cancel_scope.cancel()
        spool.close()
    trio.run(main)


# ----------------------------------------------------------------- clients


def build_client() -> str | None:
    gcc = shutil.which("gcc") or shutil.which("cc")
    libdir = os.path.realpath(os.path.join(os.path.dirname(zmq.__file__), "..", "pyzmq.libs"))
    libs = [f for f in os.listdir(libdir) if f.startswith("libzmq")] if os.path.isdir(libdir) else []
    if not gcc or not libs:
        return None
    out = os.path.join(tempfile.mkdtemp(prefix="bench-samwise-req-"), "samwise_req")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "samwise_req.c")
    r = subprocess.run([gcc, "-O2", "-std=c11", "-D_POSIX_C_SOURCE=200809L", "-o", out, src,
                        f"-L{libdir}", f"-l:{libs[0]}", f"-Wl,-rpath,{libdir}"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print("  (could not build samwise_req.c, using a Python REQ client)\n" + r.stderr)
        return None
    return out


def py_client(endpoint, n, frames_file):
    """Python twin of samwise_req.c (same protocol on stdin/stdout)."""
    with open(frames_file, "rb") as fh:
        data = fh.read()
    k = struct.unpack_from(">I", data)[0]
    frames, off = [], 4
    for _ in range(k):
        ln = struct.unpack_from(">I", data, off)[0]
        frames.append(data[off + 4:off + 4 + ln])
        off += 4 + ln
    s = zmq.Context.instance().socket(zmq.REQ)
    s.connect(endpoint)
    s.send_multipart(frames)
    s.recv_multipart()
    print("ready", flush=True)
    sys.stdin.readline()
    bad = 0
    t0 = time.monotonic()
    for _ in range(n):
        s.send_multipart(frames)
        bad += s.recv_multipart()[0] != b"0"
    print(f"done {time.monotonic() - t0:.6f} {bad}", flush=True)


def frames_file(directory, key, size, copies) -> str:
    frames = proto.build_publish("amq.direct", key, b"x" * size, copies=copies)
    path = os.path.join(directory, f"req-{copies}.bin")
    with open(path, "wb") as fh:
        fh.write(struct.pack(">I", len(frames)))
        for f in frames:
            fh.write(struct.pack(">I", len(f)) + f)
    return path


def run_scenario(server, url, tool, key, size, copies, clients, n, work) -> dict:
    mp = multiprocessing.get_context("spawn")
    q = mp.Queue()
    parent, child = mp.Pipe()
    store = tempfile.mkdtemp(dir=work)
    proc = mp.Process(target=server, args=(url, q, child, store))
    proc.start()
    try:
        ep, cpu0 = q.get(timeout=30)
        ff = frames_file(work, key, size, copies)
        cmd = [tool, ep, str(n), ff] if tool else \
            [sys.executable, os.path.abspath(__file__), "--py-client", ep, str(n), ff]
        procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for _ in range(clients)]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        secs, bad = [], 0
        for p in procs:
            parts = p.stdout.readline().split()
            assert parts and parts[0] == "done", parts
            secs.append(float(parts[1]))
            bad += int(parts[2])
            p.wait(10)
        parent.send("drain")
        res = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    total = n * clients
    warm = clients * (copies or 1)        # the untimed first request of each client
    assert bad == 0, f"{bad} error replies"
    assert res["stored"] == total + clients, res
    assert res["confirmed"] == (total * (copies or 1)) + warm, res
    return {"rate": total / max(secs), "confirmed_rate": total / (res["t_last_confirm"] - t0),
            "cpu_us": (res["cpu"] - cpu0) / total * 1e6}


def median_run(rs: list[dict]) -> dict:
    """The median of each figure over the runs (each figure on its own)."""
    return {k: statistics.median(r[k] for r in rs) for k in rs[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000, help="per client")
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    ap.add_argument("--runs", type=int, default=5,
                    help="median of N interleaved runs per figure (the machine is shared)")
    ap.add_argument("--lean-baseline", action="store_true",
                    help="baseline: the samd loop with samwise's C receive/send and parse memo "
                         "(a stricter bar than samd)")
    ap.add_argument("--py-client", nargs=3, metavar=("EP", "N", "FILE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.py_client:
        return py_client(a.py_client[0], int(a.py_client[1]), a.py_client[2])
    bcfg = parse_broker("bench=" + a.url)
    params = pika.ConnectionParameters(bcfg.host, bcfg.port, bcfg.vhost,
                                       pika.PlainCredentials(bcfg.user, bcfg.password))
    key = f"bench-samwise-{uuid.uuid4().hex[:8]}"
    c = pika.BlockingConnection(params)
    ch = c.channel()
    ch.queue_declare(key, auto_delete=False, arguments={"x-max-length": 10000})
    ch.queue_bind(key, "amq.direct", key)
    tool = build_client()
    work = tempfile.mkdtemp(prefix="bench-samwise-")
    print(f"requests={a.requests}/client size={a.size}B, 2 brokers (2 connections to "
          f"{bcfg.host}:{bcfg.port}), confirms, client={'C samwise_req' if tool else 'Python REQ'}, "
          f"baseline {'lean loop' if a.lean_baseline else 'samd-equivalent'}, "
          f"median of {a.runs} interleaved runs, load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs")
    base = "lean loop" if a.lean_baseline else "samd-eq"
    print(f"{'scenario':26} {base:>11} {'samwise':>9} {'ratio':>6}   "
          f"{'confirmed: ' + base + ' / samwise':>29}   "
          f"{'CPU us/req: ' + base + ' / samwise':>29}   "
          f"{'runs (req/s): ' + base + ' | samwise':>31}   samd (samcli)")
    try:
        for tag, label, copies, clients in SCENARIOS:
            baseline = samd_lean if a.lean_baseline else samd_equivalent
            runs: dict = {baseline: [], samwise_endpoint: []}
            order = list(runs)
            for _ in range(a.runs):
                # interleaved, and in alternating order, so both see the same machine load
                for server in order:
                    runs[server].append(run_scenario(server, a.url, tool, key, a.size, copies,
                                                     clients, a.requests, work))
                    ch.queue_purge(key)
                order.reverse()
            b, s = (median_run(runs[baseline]), median_run(runs[samwise_endpoint]))
            lo, hi = SAMD_ISSUE_14[tag]
            spread = " | ".join(" ".join(f"{r['rate'] / 1000:.1f}k" for r in runs[srv])
                                for srv in (baseline, samwise_endpoint))
            print(f"{label:26} {b['rate']:8.0f}/s {s['rate']:7.0f}/s {s['rate'] / b['rate']:5.2f}x   "
                  f"{b['confirmed_rate']:13.0f}/s / {s['confirmed_rate']:7.0f}/s   "
                  f"{b['cpu_us']:19.0f} / {s['cpu_us']:7.0f}   {spread:>31}   "
                  f"{lo}-{hi}/s ({s['rate'] / hi:.2f}x of its best)")
    finally:
        ch.queue_delete(key)
        c.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
