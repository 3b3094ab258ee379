"""The durable path at full rate: spool on, a Lumberjack and a Courier output.

    python bench/bench_durable.py [--duration 60] [--baseline-messages 2000000]
                                  [--isolation inline|process] [--no-subscriber]

One run, in one process tree:

1. **baseline**: ``zmq.proxy`` (C, libzmq) PULL -> PUB with the C load generator and
   counter of bench_relay.py (``zmq_load.c``), ``--baseline-messages`` messages of 300 B,
   once before and once after the durable run (the mean is the baseline: a shared
   host's load drifts over a minute).
2. **durable**: a ``logjam-relay`` subprocess with the spool on, one Lumberjack output
   (zlib level 3, window 1000) and one Courier output (EVNT, payload 1000), draining into
   the C sinks of ``sink.c`` (ACK correctly, count; far faster than the relay, their CPU
   per event is printed to show it).  The same C generator pushes 300 B messages into
   PULL as fast as the relay takes them (ZeroMQ HWM back-pressure) for ``--duration``
   seconds; a C SUB counts what is published (``--no-subscriber`` leaves it out).

Printed, every ``--every`` seconds: the relay's ingest rate (from its /metrics), each
output's delivered rate (the sink's count) and spool backlog (records, /metrics);
then the summary: ingest rate as a ratio against the proxy, and against logjam-device
with the issue's factor (logjam-device ran at 0.46x zmq.proxy: the target is >= 0.46x of
the proxy), each output's delivered rate and whether its backlog stayed bounded (it
grew in the last third of the run by less than one second of ingest), the time the
outputs needed to drain after the load stopped, and CPU seconds per million messages:
for the relay process (ingest, and the outputs when they run inline), and, with
``--isolation process``, for each output's worker process.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_relay as BR  # noqa: E402

DEVICE_FACTOR = 0.46        # logjam-device / zmq.proxy, measured side by side
SINK_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sink.c")


def build_sink() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("bench_durable: needs a C compiler for sink.c")
    out = os.path.join(tempfile.mkdtemp(prefix="bench-sink-"), "sink")
    r = subprocess.run([cc, "-O2", "-o", out, SINK_SRC, "-lz"], capture_output=True, text=True)
    if r.returncode:
        sys.exit("bench_durable: cannot build sink.c:\n" + r.stderr)
    return out


class Sink:
    def __init__(self, binary: str, kind: str):
        self.kind = kind
        self.proc = subprocess.Popen([binary, kind, "0"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        word, port = self.proc.stdout.readline().split()
        self.port = int(port)
        self.lock = threading.Lock()

    def events(self) -> int:
        with self.lock:
            self.proc.stdin.write("?\n")
            self.proc.stdin.flush()
            return int(self.proc.stdout.readline().split()[1])

    def errors(self) -> int:
        with self.lock:
            self.proc.stdin.write("?\n")
            self.proc.stdin.flush()
            return int(self.proc.stdout.readline().split()[4])

    def cpu(self) -> float:
        return BR.cpu_seconds(self.proc.pid)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(5)


_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def scrape(port: int) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def metric(m: dict, name: str, **labels) -> float:
    for (n, lbl), v in m.items():
        if n in (name, name + "_total") and all(f'{k}="{val}"' in lbl for k, val in labels.items()):
            return v
    return 0.0


def children_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of the direct children of ``pid`` (output worker processes)."""
    out = {}
    kids = []
    try:
        # every thread's: trio starts processes from its worker threads, and a child is
        # listed under the thread that started it as long as that thread lives
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                kids += open(f"/proc/{pid}/task/{t}/children").read().split()
            except OSError:
                pass
    except OSError:
        return out
    for k in kids:
        try:
            out[int(k)] = BR.cpu_seconds(int(k))
        except OSError:
            pass
    return out


def child_names(pid: int) -> dict[int, str]:
    names = {}
    for k in children_cpu(pid):
        try:
            cmd = open(f"/proc/{k}/cmdline", "rb").read().split(b"\0")
            args = [x.decode() for x in cmd if x]
            names[k] = f"{args[-1]} (pid {k})" if "logjam_relay.outputs.worker" in args \
                else " ".join(args)[-60:]
        except OSError:
            pass
    return names


def run_durable(args, tool: str, sink_bin: str) -> dict:
    lj, co = Sink(sink_bin, "lumberjack"), Sink(sink_bin, "courier")
    in_port, out_port, mport = BR.free_port(), BR.free_port(), BR.free_port()
    state = tempfile.mkdtemp(prefix="bench-durable-")
    argv = [sys.executable, "-m", "logjam_relay", "-p", str(in_port), "-t", "0",
            "-P", str(out_port), "-s", "0", "-m", str(mport), "-M", "127.0.0.1",
            "--bind", "127.0.0.1", "--state-dir", state, "-q",
            "--output", f"lumberjack://127.0.0.1:{lj.port}?tls=off&window=1000&compression=3"
                        "&name=lumberjack",
            "--output", f"courier://127.0.0.1:{co.port}?tls=off&payload=1000&name=courier"]
    env = dict(os.environ)
    if args.isolation:
        env["LOGJAM_RELAY_OUTPUT_ISOLATION"] = args.isolation
    relay = subprocess.Popen(argv, env=env)
    work = tempfile.mkdtemp(prefix="bench-frames-")
    gen = cnt = None
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                scrape(mport)
                break
            except OSError:
                if relay.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("bench_durable: the relay did not start") from None
                time.sleep(0.2)
        in_ep, out_ep = f"tcp://127.0.0.1:{in_port}", f"tcp://127.0.0.1:{out_port}"
        if not args.no_subscriber:
            cnt = subprocess.Popen([tool, "count", out_ep, str(10**12), BR.TOPIC.decode(),
                                    "logs.warmup"], stdout=subprocess.PIPE, text=True)
            assert cnt.stdout.readline().strip() == "ready"
        gen = subprocess.Popen([tool, "gen", in_ep, "push", str(2_000_000 * args.duration),
                                BR.frames_file(work)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if cnt is not None:
            assert cnt.stdout.readline().strip() == "go"
        else:
            time.sleep(0.5)
        m0 = scrape(mport)
        acc0 = metric(m0, "logjam_relay_messages", outcome="accepted")
        cpu0, kids0 = BR.cpu_seconds(relay.pid), children_cpu(relay.pid)
        sinks0 = {"lumberjack": (lj.events(), lj.cpu()), "courier": (co.events(), co.cpu())}
        t0 = time.monotonic()
        gen.stdin.write("go\n")
        gen.stdin.flush()
        samples = []
        last = (t0, acc0, sinks0["lumberjack"][0], sinks0["courier"][0])
        print(f"{'t s':>5} | {'ingest msg/s':>12} | {'lumberjack ev/s':>15} {'backlog':>9} | "
              f"{'courier ev/s':>12} {'backlog':>9}")
        while True:
            time.sleep(args.every)
            t = time.monotonic()
            m = scrape(mport)
            acc = metric(m, "logjam_relay_messages", outcome="accepted")
            e_lj, e_co = lj.events(), co.events()
            b_lj = metric(m, "logjam_relay_output_backlog_records", output="lumberjack")
            b_co = metric(m, "logjam_relay_output_backlog_records", output="courier")
            dt = t - last[0]
            row = (t - t0, (acc - last[1]) / dt, (e_lj - last[2]) / dt, b_lj,
                   (e_co - last[3]) / dt, b_co, acc)
            samples.append(row)
            last = (t, acc, e_lj, e_co)
            print(f"{row[0]:>5.0f} | {row[1]:>12,.0f} | {row[2]:>15,.0f} {b_lj:>9,.0f} | "
                  f"{row[4]:>12,.0f} {b_co:>9,.0f}", flush=True)
            if t - t0 >= args.duration:
                break
        gen.send_signal(signal.SIGTERM)
        t_load = time.monotonic()
        m1 = scrape(mport)
        acc1 = metric(m1, "logjam_relay_messages", outcome="accepted")
        cpu1, kids1 = BR.cpu_seconds(relay.pid), children_cpu(relay.pid)
        names = child_names(relay.pid)
        sinks1 = {"lumberjack": (lj.events(), lj.cpu()), "courier": (co.events(), co.cpu())}
        elapsed = t_load - t0
        # drain: until both backlogs are 0 (or --drain-limit)
        drain_s = None
        while time.monotonic() - t_load < args.drain_limit:
            m = scrape(mport)
            if (metric(m, "logjam_relay_output_backlog_records", output="lumberjack") == 0
                    and metric(m, "logjam_relay_output_backlog_records", output="courier") == 0):
                drain_s = time.monotonic() - t_load
                break
            time.sleep(0.2)
        final = scrape(mport)
        delivered = {"lumberjack": lj.events(), "courier": co.events()}
        ingested = metric(final, "logjam_relay_messages", outcome="accepted")
        errors = {"lumberjack": lj.errors(), "courier": co.errors()}
        return {
            "elapsed": elapsed, "ingested": acc1 - acc0, "samples": samples,
            "relay_cpu": cpu1 - cpu0,
            "kids_cpu": {names.get(k, str(k)): v - kids0.get(k, 0.0) for k, v in kids1.items()},
            "sinks": {k: (sinks1[k][0] - sinks0[k][0], sinks1[k][1] - sinks0[k][1])
                      for k in sinks0},
            "drain_s": drain_s, "delivered_total": delivered, "ingested_total": ingested,
            "sink_errors": errors,
            "resent": {o: metric(final, "logjam_relay_output_events_resent", output=o)
                       for o in ("lumberjack", "courier")},
        }
    finally:
        for p in (gen, cnt):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(5)
        relay.terminate()
        try:
            relay.wait(15)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay.wait(5)
        lj.close()
        co.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)


def bounded(samples, col: int, rate: float) -> tuple[bool, float]:
    """Backlog growth over the last third of the run; bounded = less than 1 s of ingest."""
    tail = samples[len(samples) * 2 // 3:]
    if len(tail) < 2:
        return True, 0.0
    growth = tail[-1][col] - tail[0][col]
    return growth < rate, growth


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=int, default=60, help="seconds of sustained load")
    ap.add_argument("--baseline-messages", type=int, default=2_000_000)
    ap.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--drain-limit", type=float, default=120.0,
                    help="seconds to wait for the outputs to drain after the load")
    ap.add_argument("--isolation", choices=("inline", "process"), default=None,
                    help="output_isolation for the relay (default: the relay's default)")
    ap.add_argument("--no-subscriber", action="store_true",
                    help="no SUB on the relay's PUB during the durable run")
    ap.add_argument("--skip-baseline", type=float, default=None, metavar="MSG_PER_S",
                    help="use this proxy rate instead of measuring it (for quick checks)")
    args = ap.parse_args()
    tool = BR.build_c_load()
    if tool is None:
        sys.exit("bench_durable: needs zmq_load.c built (gcc and pyzmq's bundled libzmq)")
    sink_bin = build_sink()
    print(f"durable bench: {args.duration} s of 300 B messages into PULL, spool on, "
          f"outputs lumberjack (zlib 3, window 1000) + courier (payload 1000) into C sinks; "
          f"{os.cpu_count()} cpus shared; isolation {args.isolation or 'default'}")
    if args.skip_baseline:
        proxy_rate = args.skip_baseline
        print(f"zmq.proxy PULL -> PUB: {proxy_rate:,.0f} msg/s (given, not measured)")
    else:
        base = BR.run_path("proxy", "pull", args.baseline_messages, [], tool)
        proxy_rate = base["rate"]
        print(f"zmq.proxy PULL -> PUB: {proxy_rate:,.0f} msg/s (generator alone "
              f"{base['gen_rate']:,.0f}/s), {args.baseline_messages:,} messages")
    r = run_durable(args, tool, sink_bin)
    if not args.skip_baseline:
        # the proxy again after the durable run: this host's load drifts; the mean of both
        after = BR.run_path("proxy", "pull", args.baseline_messages, [], tool)["rate"]
        print(f"zmq.proxy PULL -> PUB after the durable run: {after:,.0f} msg/s; "
              f"baseline = mean {(proxy_rate + after) / 2:,.0f} msg/s")
        proxy_rate = (proxy_rate + after) / 2
    rate = r["ingested"] / r["elapsed"]
    ratio = rate / proxy_rate
    print(f"ingest (spool + 2 outputs, {r['elapsed']:.0f} s) {rate:>9,.0f} msg/s | "
          f"ratio to zmq.proxy {ratio:.2f} (target >= {DEVICE_FACTOR:.2f}) | "
          f"= {ratio / DEVICE_FACTOR:.2f}x logjam-device | "
          f"{'OK' if ratio >= DEVICE_FACTOR else 'BELOW'}")
    for col, name in ((2, "lumberjack"), (4, "courier")):
        n, sink_cpu = r["sinks"][name]
        ok, growth = bounded(r["samples"], col + 1, rate)
        print(f"output {name:10s} delivered {n / r['elapsed']:>9,.0f} ev/s "
              f"({n / max(1, r['ingested']):.2f} of ingest) | backlog "
              f"{'bounded' if ok else 'GROWING'} (last third {growth:+,.0f} records, "
              f"end {r['samples'][-1][col + 1]:,.0f}) | sink CPU "
              f"{sink_cpu / max(n, 1) * 1e6:.2f} s/M events | resent {r['resent'][name]:,.0f}"
              f" | sink errors {r['sink_errors'][name]}")
        print(f"  {name}: paced by {pace(r, name, n, sink_cpu, ok)}")
    drain = f"{r['drain_s']:.1f} s" if r["drain_s"] is not None else \
        f"not within {args.drain_limit:.0f} s"
    print(f"after the load: outputs drained in {drain}; ingested {r['ingested_total']:,.0f}, "
          f"delivered lumberjack {r['delivered_total']['lumberjack']:,} courier "
          f"{r['delivered_total']['courier']:,}")
    print(f"relay process CPU {r['relay_cpu'] / max(1, r['ingested']) * 1e6:.2f} s per million "
          f"messages ({'ingest only' if r['kids_cpu'] else 'ingest + both outputs'})")
    for name, cpu in r["kids_cpu"].items():
        print(f"  worker {name}: CPU {cpu / max(1, r['ingested']) * 1e6:.2f} s per million "
              f"messages")
    if r["kids_cpu"]:
        total = r["relay_cpu"] + sum(r["kids_cpu"].values())
        print(f"  relay + workers: CPU {total / max(1, r['ingested']) * 1e6:.2f} s per million "
              f"messages")
    return 0


def pace(r: dict, name: str, delivered: int, sink_cpu: float, bounded_: bool) -> str:
    """Who set the output's pace: the relay's ingest (the output kept up), the receiver
    (its process busy most of a core) or the relay's output (its worker busy, the receiver
    not)."""
    el = r["elapsed"]
    sink_busy = sink_cpu / el
    worker = next((cpu for k, cpu in r["kids_cpu"].items() if k.startswith(name)), None)
    busy = f"receiver busy {sink_busy:.0%} of a core" + (
        f", the relay's {name} worker {worker / el:.0%}" if worker is not None else "")
    if bounded_ and delivered >= 0.98 * r["ingested"]:
        return f"the relay's ingest: the output kept up ({busy})"
    if sink_busy >= 0.9:
        return f"the receiver ({busy})"
    return f"the relay's output ({busy})"


if __name__ == "__main__":
    sys.exit(main())
