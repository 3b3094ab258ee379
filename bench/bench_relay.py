"""Relay throughput: PULL (or ROUTER) -> relay -> PUB, against zmq.proxy (C) in the same run.

    python bench/bench_relay.py [--messages 1000000] [--paths pull,router,lz4]
                                [--repeat N] [--threads] [--relay-arg=--pub-thread=false]

For each path the same load generator (a separate process, PUSH or DEALER,
pre-built 300-byte JSON messages) and the same counter (a separate process,
SUB) are pointed first at ``zmq.proxy`` (C, libzmq) bound on the same ports, then
at a ``logjam-relay`` subprocess.  The proxy run doubles as the check that the
generator and counter are not the bottleneck: their rate through the proxy is
printed.  Generator and counter are the small C program ``zmq_load.c`` (built here
with gcc against pyzmq's bundled libzmq) so they run far faster than the proxy
path; without gcc, ``--python-load`` or a failed build, Python versions are used
and the proxy figure is then bounded by the Python counter (~110-190k msg/s).  Reported: msgs/s for both, the ratio relay/proxy, and the relay's CPU
seconds per million messages (from /proc); ``--threads``: each thread's, the relay's and
zmq.proxy's; ``--relay-arg``: more of the relay's options (``--pub-thread=false``: PUB on the
event loop, as logjam-device has it).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

import zmq

TOPIC = b"logs.bench"
APP = b"bench-test"


_handed_out: set[int] = set()


def free_port() -> int:
    """A free port not handed out before in this run (bind-to-0 can repeat one)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


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


def build_c_load() -> str | None:
    """Compile zmq_load.c against pyzmq's libzmq; the binary's path, or None."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    libdir = os.path.realpath(os.path.join(os.path.dirname(zmq.__file__), "..", "pyzmq.libs"))
    libs = [f for f in os.listdir(libdir) if f.startswith("libzmq")] if os.path.isdir(libdir) else []
    if not gcc or not libs:
        return None
    out = os.path.join(tempfile.mkdtemp(prefix="bench-zmq-load-"), "zmq_load")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zmq_load.c")
    r = subprocess.run([gcc, "-O2", "-o", out, src, f"-L{libdir}", f"-l:{libs[0]}",
                        f"-Wl,-rpath,{libdir}"], capture_output=True, text=True)
    if r.returncode != 0:
        print("  (could not build zmq_load.c, using Python load tools)\n" + r.stderr)
        return None
    return out


def frames_file(directory: str) -> str:
    meta = struct.pack(">HBBIQQ", 0xCABD, 0, 1, 0, 1700000000123, 1)
    path = os.path.join(directory, "frames.bin")
    with open(path, "wb") as fh:
        for topic in (b"logs.warmup", TOPIC):
            for frame in (APP, topic, body300(), meta):
                fh.write(struct.pack(">I", len(frame)) + frame)
    return path


def run_c_load(tool: str, in_ep: str, out_ep: str, kind: str, n: int, pid: int) -> tuple:
    """Counter and generator as C processes; returns (results, cpu0, cpu1)."""
    work = tempfile.mkdtemp(prefix="bench-frames-")
    cnt = subprocess.Popen([tool, "count", out_ep, str(n), TOPIC.decode(), "logs.warmup"],
                           stdout=subprocess.PIPE, text=True)
    assert cnt.stdout.readline().strip() == "ready"
    cpu0 = cpu_seconds(pid)
    gen = subprocess.Popen([tool, "gen", in_ep, "dealer" if kind == "router" else "push",
                            str(n), frames_file(work)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    results: dict = {}

    def watch_counter():
        for line in cnt.stdout:
            word, *rest = line.split()
            if word == "go":
                gen.stdin.write("go\n")
                gen.stdin.flush()
            elif word == "count":
                results["count"] = (float(rest[0]), int(rest[1]))
                return

    t = threading.Thread(target=watch_counter, daemon=True)
    t.start()
    word, secs = gen.stdout.readline().split()
    results["gen"] = (float(secs),)
    t.join(600)
    cpu1 = cpu_seconds(pid)
    gen.wait(10)
    cnt.wait(10)
    shutil.rmtree(work, ignore_errors=True)
    return results, cpu0, cpu1


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


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid`` (name: the main thread is "main", libzmq's
    are ZMQbg/..., the relay's Python threads "python" with their thread id)."""
    out = {}
    tck = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                head, rest = fh.read().rsplit(")", 1)
        except OSError:
            continue
        name = "main" if tid == str(pid) else head.split("(", 1)[1] + f"#{tid}"
        f = rest.split()
        out[name] = (int(f[11]) + int(f[12])) / tck
    return out


def run_path(target: str, kind: str, n: int, extra: list[str], tool: str | None,
             env: dict | None = None, threads: bool = False) -> dict:
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
        proc = subprocess.Popen(argv, env={**os.environ, **(env or {})})
        pid = proc.pid
        time.sleep(1.0)
    in_ep, out_ep = f"tcp://127.0.0.1:{in_port}", f"tcp://127.0.0.1:{out_port}"
    t0 = thread_cpu(pid) if threads else {}
    if tool:
        results, cpu0, cpu1 = run_c_load(tool, in_ep, out_ep, kind, n, pid)
    else:
        cnt = mctx.Process(target=counter, args=(out_ep, n, ready, go, done))
        cnt.start()
        ready.wait(10)
        cpu0 = cpu_seconds(pid)
        gen = mctx.Process(target=generator, args=(in_ep, kind, n, go, done))
        gen.start()
        results = {}
        for _ in range(2):
            item = done.get(timeout=600)
            results[item[0]] = item[1:]
        cpu1 = cpu_seconds(pid)
        gen.join(10)
        cnt.join(10)
    if threads:
        t1 = thread_cpu(pid)
        per = {k: (v - t0.get(k, 0.0)) / n * 1e6 for k, v in t1.items()}
        print(f"  {target} CPU s per million by thread: " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > 0))
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
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each path's proxy/relay pair this many times; print the median "
                         "ratio (a shared host's load drifts)")
    ap.add_argument("--pure-python", action="store_true",
                    help="also run the relay with LOGJAM_RELAY_PURE_PYTHON=1 (no C loops)")
    ap.add_argument("--python-load", action="store_true",
                    help="use the Python generator and counter instead of zmq_load.c")
    ap.add_argument("--threads", action="store_true",
                    help="also print the CPU per million messages of each thread, the "
                         "relay's and zmq.proxy's")
    ap.add_argument("--relay-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for the relay's command line (repeatable), "
                         "e.g. --relay-arg=--pub-thread=false")
    args = ap.parse_args()
    n = args.messages
    tool = None if args.python_load else build_c_load()
    print(f"relay bench: {n} messages of {len(body300())} B JSON, {os.cpu_count()} cpus shared; "
          f"load generator and counter are separate {'C' if tool else 'Python'} processes")
    for path in args.paths.split(","):
        kind = "router" if path == "router" else "pull"
        extra = (["-x", "lz4"] if path == "lz4" else []) + args.relay_arg
        label = {"pull": "PULL -> PUB", "router": "ROUTER (DEALER async) -> PUB",
                 "lz4": "PULL -> PUB with -x lz4"}[path]
        ratios = []
        for _ in range(args.repeat):
            base = run_path("proxy", kind, n, [], tool, threads=args.threads)
            relay = run_path("relay", kind, n, extra, tool, threads=args.threads)
            ratios.append(relay["rate"] / base["rate"])
            print(f"{label:32s} zmq.proxy {base['rate']:>9,.0f} msg/s (generator alone "
                  f"{base['gen_rate']:>9,.0f}/s) | relay {relay['rate']:>9,.0f} msg/s | "
                  f"ratio {ratios[-1]:.2f} | relay CPU {relay['cpu_per_million']:.2f} s per "
                  f"million (proxy {base['cpu_per_million']:.2f})", flush=True)
        if args.repeat > 1:
            ratios.sort()
            print(f"{label:32s} median ratio of {args.repeat} proxy/relay pairs "
                  f"{statistics.median(ratios):.2f} (min {ratios[0]:.2f}, max {ratios[-1]:.2f})")
        if args.pure_python:
            pure = run_path("relay", kind, n, extra, tool, {"LOGJAM_RELAY_PURE_PYTHON": "1"})
            print(f"{'  same, pyzmq loops only':32s} {'':>34s} | relay {pure['rate']:>9,.0f} "
                  f"msg/s | ratio {pure['rate'] / base['rate']:.2f} | relay CPU "
                  f"{pure['cpu_per_million']:.2f} s per million | C loops "
                  f"{relay['rate'] / pure['rate']:.2f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
