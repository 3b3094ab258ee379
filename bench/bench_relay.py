"""Relay throughput: PULL (or ROUTER) -> relay -> PUB, against zmq.proxy (C) in the same run.

    python bench/bench_relay.py [--messages 1000000] [--paths pull,router,lz4]

For each path the same load generator (a separate process, PUSH or DEALER,
pre-built 300-byte JSON messages) and the same counter (a separate process,
SUB) are pointed first at ``zmq.proxy`` (C, libzmq) bound on the same ports, then
at a ``logjam-relay`` subprocess.  The proxy run doubles as the check that the
generator and counter are not the bottleneck: their rate through the proxy is
printed.  Reported: msgs/s for both, the ratio relay/proxy, and the relay's CPU
seconds per million messages (from /proc).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time

import zmq

TOPIC = b"logs.bench"
APP = b"bench-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def body300() -> bytes:
    b = (b'{"action":"Bench#index","code":200,"total_time":12.5,"severity":1,'
         b'"started_ms":1700000000123,"request_id":"0123456789abcdef","message":"')
    return b + b"x" * (300 - len(b) - 2) + b'"}'


def generator(endpoint: str, kind: str, n: int, go, done) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER if kind == "router" else zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.LINGER, -1)
    sock.connect(endpoint)
    meta = struct.pack(">HBBIQQ", 0xCABD, 0, 1, 0, 1700000000123, 1)
    body = body300()
    send = sock.send
    more = zmq.SNDMORE
    # warm-up until the counter says the path is up (slow joiner)
    while not go.is_set():
        send(APP, more); send(b"logs.warmup", more); send(body, more); send(meta)  # noqa: E702
        time.sleep(0.01)
    t0 = time.perf_counter()
    for _ in range(n):
        send(APP, more)
        send(TOPIC, more)
        send(body, more)
        send(meta)
    done.put(("gen", time.perf_counter() - t0))
    sock.close(linger=-1)
    ctx.term()


def counter(endpoint: str, n: int, ready, go, done) -> None:
    """Count published messages whose topic frame is TOPIC.

    The topic is frame 1 (relay, PULL proxy) or frame 2 (ROUTER proxy: the routing id
    comes first), so frames 1 and 2 are both looked at.
    """
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    ready.set()
    recv = sub.recv
    get = sub.get
    RCVMORE = zmq.RCVMORE

    def topic_frames():
        recv()
        f1 = recv() if get(RCVMORE) else b""
        f2 = recv() if get(RCVMORE) else b""
        while get(RCVMORE):
            recv()
        return f1, f2

    while True:     # warm-up traffic until the first timed message
        f1, f2 = topic_frames()
        if b"logs.warmup" in (f1, f2):
            go.set()
        if TOPIC in (f1, f2):
            break
    t0 = time.perf_counter()
    t_last = t0
    count = 1
    poll = sub.poll
    while count < n:
        if not poll(5000):      # 5 s of silence: messages were lost; report, don't hang
            break
        f1, f2 = topic_frames()
        if f1 == TOPIC or f2 == TOPIC:
            count += 1
            t_last = time.perf_counter()
    done.put(("count", t_last - t0, count))
    ctx.destroy(linger=0)


def proxy(frontend_kind: str, in_port: int, out_port: int) -> None:
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER if frontend_kind == "router" else zmq.PULL)
    front.setsockopt(zmq.RCVHWM, 100_000)
    front.bind(f"tcp://127.0.0.1:{in_port}")
    back = ctx.socket(zmq.PUB)
    back.setsockopt(zmq.SNDHWM, 1_000_000)
    back.bind(f"tcp://127.0.0.1:{out_port}")
    try:
        zmq.proxy(front, back)
    except zmq.ContextTerminated:
        pass


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tck


def run_path(target: str, kind: str, n: int, extra: list[str]) -> dict:
    in_port, out_port = free_port(), free_port()
    mctx = mp.get_context("fork")
    ready, go, done = mctx.Event(), mctx.Event(), mctx.Queue()
    proc = None
    if target == "proxy":
        proc = mctx.Process(target=proxy, args=(kind, in_port, out_port), daemon=True)
        proc.start()
        pid = proc.pid
    else:
        state = tempfile.mkdtemp(prefix="bench-relay-")
        in_flag = ["-t", str(in_port), "-p", str(free_port())] if kind == "router" else \
            ["-p", str(in_port), "-t", str(free_port())]
        argv = [sys.executable, "-m", "logjam_relay", *in_flag, "-P", str(out_port),
                "-s", str(free_port()), "-m", "0", "--bind", "127.0.0.1", "--state-dir", state,
                "-q", *extra]
        proc = subprocess.Popen(argv)
        pid = proc.pid
        time.sleep(1.0)
    cnt = mctx.Process(target=counter, args=(f"tcp://127.0.0.1:{out_port}", n, ready, go, done))
    cnt.start()
    ready.wait(10)
    cpu0 = cpu_seconds(pid)
    gen = mctx.Process(target=generator, args=(f"tcp://127.0.0.1:{in_port}", kind, n, go, done))
    gen.start()
    results = {}
    for _ in range(2):
        item = done.get(timeout=600)
        results[item[0]] = item[1:]
    cpu1 = cpu_seconds(pid)
    gen.join(10)
    cnt.join(10)
    if target == "proxy":
        proc.kill()
        proc.join()
    else:
        proc.terminate()
        proc.wait(10)
    elapsed, received = results["count"]
    if received < n:
        print(f"  !! {target}: counter received {received} of {n} messages")
    return {"rate": received / elapsed, "gen_rate": n / results["gen"][0], "elapsed": elapsed,
            "cpu_per_million": (cpu1 - cpu0) / received * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--paths", default="pull,router,lz4")
    args = ap.parse_args()
    n = args.messages
    print(f"relay bench: {n} messages of {len(body300())} B JSON, 2 cpus shared; "
          f"load generator and counter are separate processes")
    for path in args.paths.split(","):
        kind = "router" if path == "router" else "pull"
        extra = ["-x", "lz4"] if path == "lz4" else []
        base = run_path("proxy", kind, n, [])
        relay = run_path("relay", kind, n, extra)
        label = {"pull": "PULL -> PUB", "router": "ROUTER (DEALER async) -> PUB",
                 "lz4": "PULL -> PUB with -x lz4"}[path]
        print(f"{label:32s} zmq.proxy {base['rate']:>9,.0f} msg/s (generator alone "
              f"{base['gen_rate']:>9,.0f}/s) | relay {relay['rate']:>9,.0f} msg/s | "
              f"ratio {relay['rate'] / base['rate']:.2f} | relay CPU "
              f"{relay['cpu_per_million']:.2f} s per million")
    return 0


if __name__ == "__main__":
    sys.exit(main())
