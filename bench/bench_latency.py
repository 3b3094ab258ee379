"""Latency at a fixed rate: the relay with ``spool_fsync=batch``, with
``interval`` and without a spool, against ``zmq.proxy``, in one run.

    python bench/bench_latency.py [--rates 100000,200000] [--seconds 5]
                                  [--paths dealer,push] [--targets proxy,none,interval,batch]
                                  [--modes ticks,message] [--repeat N]
                                  [--ingest-messages 1000000] [--relay-src NAME=SRC_DIR ...]

The load is ``zmq_latency.c`` (built here with gcc against pyzmq's bundled libzmq, as
bench_relay.py builds zmq_load.c): it sends 300-byte logjam messages on a fixed schedule
(message i is due at t0 + i/rate) and measures every latency from the message's
*scheduled* send time, so a stall of the device shows in full instead of slowing the
load down (no coordinated omission).  Two modes of sending (``--modes``, both by
default, every figure in each):

* ``ticks``: every 200 us the tool sends everything that fell due since the last tick,
  together -- bursts of ~20 messages at 100k msg/s, the load of a batching shipper;
* ``message``: every message alone, at its own scheduled time (the tool sleeps until the
  next one is due), no ticks.  **This is the mode a real agent resembles**: a web
  application sends each request's log when the request ends, one message at a time, and
  many such agents together arrive as a stream of single messages, not in bursts.  It is
  also the harder one for the relay: each message may find the relay idle, so every
  wake-up path (the ingest's wait on the socket, the group commit's rounds, the PUB
  thread's sleep) is taken for every few messages, and a missed wake-up shows as a stall.

Two latencies:

* **reply**: DEALER -> the relay's ROUTER, until the "202 Accepted" is back (under
  ``spool_fsync=batch`` the 202 means "fdatasync'ed");
* **one-way**: from the schedule until the message arrives on a SUB of the PUB socket
  (DEALER -> ROUTER and PUSH -> PULL).  zmq.proxy (C, ROUTER or PULL -> PUB, in a
  separate process) gives the baseline: it does nothing but forward.

Targets: ``proxy`` (zmq.proxy), ``none`` (the relay without a spool), ``interval`` and
``batch`` (the relay with a spool on this disk, ``--spool-dir`` under the temp
directory, 64 MiB segments, no output: the spool is written and synced as with one).
``--relay-src main=/work/main/src`` adds the same relay targets run from another source
tree (a before/after in one run; that tree's C extensions must be built in place).

``c-ack`` and ``c-durable`` (DEALER only; not run by default): ``durable_ack.c``, one C
thread that drains the ROUTER, publishes on PUB, and answers 202 -- at once (``c-ack``), or
after one ``write()`` of the bodies and one ``fdatasync`` per drained group (``c-durable``).
No hand-off to any other thread, nothing validated or numbered: the least a durable 202
costs on this disk and these cores.  ``c-durable-thread``: the same with each group's
``fdatasync`` handed to a second thread while the first goes on draining (the relay's
shape, without Python): what the hand-off itself costs here.  ``c-durable`` over
``c-ack`` is printed beside the relay's ``batch`` over its no-spool run: where the floor's
own ratio is near a target ratio, the machine, not the relay, sets it.  With ``c-ack``,
``c-durable`` (or ``c-durable-thread``), ``none`` and ``batch`` in the run, the line "over
the floor" divides the relay's ``batch`` / no-spool ratio by the floor's, round by round:
1.0, a durable 202 costs the relay what it costs the bare C loop on this disk just then.

``--repeat N`` runs every figure N times with the targets interleaved (the order reversed
every other round) and prints, after the rounds' own lines, the median of each percentile
and the median of each round's own ratios with their range: one 8 s run alone swings 2-3x
on a shared 2-core host, a ratio of two runs minutes apart less.

Printed per rate and path: p50/p99/p99.9/max (ms), how many of the messages were
answered / published; for a spool target the relay's own fdatasyncs of the run (from its
``logjam_relay_spool_fdatasync_seconds`` histogram: the disk's share of a ``batch`` 202;
and for ``batch`` the replies' wait in the group commit, ``logjam_relay_group_commit_wait_seconds``);
and the ratios, p50/p99/p99.9/max each: relay / zmq.proxy (one-way), interval and batch /
no-spool relay (reply), in the same run and mode.  Then the ingest rate (DEALER as fast as the socket takes them,
``--ingest-messages``, replies per second) of ``batch`` against ``interval``: one run of
each swings by +-20 % on a shared 2-core host (the load tool and the relay share the
cores), so ``--ingest-repeat`` rounds run with the targets interleaved and the medians are
compared.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_relay as BR  # noqa: E402

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zmq_latency.c")
KEYS = ("p50", "p99", "p999", "max")
#: --batch-delay: spool_fsync_batch_delay of the batch target ("" = the default, 0)
BATCH_DELAY = ""


def build_tool(src: str = SRC) -> str:
    """``src`` (a C file beside this one) built with gcc against pyzmq's bundled libzmq."""
    import zmq
    gcc = shutil.which("gcc") or shutil.which("cc")
    libdir = os.path.realpath(os.path.join(os.path.dirname(zmq.__file__), "..", "pyzmq.libs"))
    libs = [f for f in os.listdir(libdir) if f.startswith("libzmq")] \
        if os.path.isdir(libdir) else []
    if not gcc or not libs:
        sys.exit("bench_latency: needs gcc and pyzmq's bundled libzmq (pyzmq.libs)")
    name = os.path.splitext(os.path.basename(src))[0]
    out = os.path.join(tempfile.mkdtemp(prefix="bench-zmq-latency-"), name)
    r = subprocess.run([gcc, "-O2", "-o", out, src, f"-L{libdir}", f"-l:{libs[0]}",
                        f"-Wl,-rpath,{libdir}", "-lpthread"], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"bench_latency: cannot build {os.path.basename(src)}:\n" + r.stderr)
    return out


#: the floor of a durable 202 (the ``c-*`` targets)
DURABLE_ACK = os.path.join(os.path.dirname(SRC), "durable_ack.c")


@functools.cache
def durable_ack_tool() -> str:
    """durable_ack.c, built on first use."""
    return build_tool(DURABLE_ACK)


class Target:
    """zmq.proxy or a relay subprocess, bound on fresh ports."""

    def __init__(self, name: str, kind: str, src: str | None = None):
        self.name, self.kind, self.src = name, kind, src
        self.in_port, self.out_port = BR.free_port(), BR.free_port()
        self.proc = None
        self.metrics_port = 0
        self.work = tempfile.mkdtemp(prefix="bench-latency-")

    def start(self, path: str) -> None:
        if self.kind.startswith("c-"):
            dest = "-" if self.kind == "c-ack" else os.path.join(self.work, "bodies")
            mode = ["thread"] if self.kind == "c-durable-thread" else []
            self.proc = subprocess.Popen([durable_ack_tool(), f"tcp://127.0.0.1:{self.in_port}",
                                          f"tcp://127.0.0.1:{self.out_port}", dest, *mode],
                                         stderr=subprocess.DEVNULL)
            return
        if self.kind == "proxy":
            ctx = mp.get_context("fork")
            self.proc = ctx.Process(target=BR.proxy, daemon=True,
                                    args=("router" if path == "dealer" else "pull",
                                          self.in_port, self.out_port))
            self.proc.start()
            return
        in_flag = ["-t", str(self.in_port), "-p", str(BR.free_port())] if path == "dealer" \
            else ["-p", str(self.in_port), "-t", str(BR.free_port())]
        # a spool target's /metrics: its fdatasync histogram is read before it stops
        self.metrics_port = BR.free_port() if self.kind in ("interval", "batch") else 0
        argv = [sys.executable, "-m", "logjam_relay", *in_flag, "-P", str(self.out_port),
                "-s", str(BR.free_port()), "-m", str(self.metrics_port), "-M", "127.0.0.1",
                "--bind", "127.0.0.1",
                "--state-dir", os.path.join(self.work, "state"), "-q"]
        if self.kind != "none":
            argv += ["--spool-dir", os.path.join(self.work, "spool"),
                     "--spool-fsync", self.kind]
        if self.kind == "batch" and BATCH_DELAY:
            argv += ["--spool-fsync-batch-delay", BATCH_DELAY]
        env = dict(os.environ)
        env.pop("LOGJAM_RELAY_CONFIG", None)
        if self.src:
            env["PYTHONPATH"] = self.src + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(argv, env=env)

    def fdatasyncs(self) -> str:
        """The relay's own fdatasyncs of the run (``logjam_relay_spool_fdatasync_seconds``
        from its /metrics): how many, and the buckets of their p50, p99 and maximum -- the
        disk's share of the 202's latency under batch --, and under batch how long the
        replies waited in the group commit (``logjam_relay_group_commit_wait_seconds``:
        the group commit's share).  "" when the tree has no such histogram (a tree from
        before it) or there is no spool."""
        if not self.metrics_port or self.proc is None:
            return ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=10) as resp:
                text = resp.read().decode()
        except OSError:
            return ""
        syncs = histogram(text, "logjam_relay_spool_fdatasync_seconds")
        if syncs is None:
            return ""
        n, upto = syncs
        over = n - next(v for le, v in upto.buckets if le >= 0.032)
        out = (f"{int(n):,} fdatasyncs in the relay: p50 {upto(0.5)}, p99 {upto(0.99)}, "
               f"max {upto(1.0)}; {int(over)} over 32 ms")
        waits = histogram(text, "logjam_relay_group_commit_wait_seconds")
        if waits is not None:
            n, upto = waits
            out += (f"\n  {'':26s} held    {int(n):,} batches' replies waited in the group "
                    f"commit: p50 {upto(0.5)}, p99 {upto(0.99)}, max {upto(1.0)}")
        return out

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.kind == "proxy":
            self.proc.kill()
            self.proc.join()
        else:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self.work, ignore_errors=True)
        self.work = tempfile.mkdtemp(prefix="bench-latency-")


class _Quantile:
    """A histogram's cumulative buckets: ``q(0.99)`` names the bucket of that quantile."""

    def __init__(self, buckets: list[tuple[float, float]]):
        self.buckets = buckets

    def __call__(self, q: float) -> str:
        n = self.buckets[-1][1]
        le = next(le for le, v in self.buckets if v >= q * n)
        return "> 4 s" if le == float("inf") else f"<= {le * 1000:g} ms"


def histogram(text: str, name: str) -> tuple[float, _Quantile] | None:
    """``(count, quantile)`` of histogram ``name`` in a /metrics text; None when it is not
    there or empty."""
    buckets = [(float(le), float(v)) for le, v in
               re.findall(name + r'_bucket\{[^}]*le="([^"]+)"\} (\S+)', text)]
    if not buckets or not buckets[-1][1]:
        return None
    return buckets[-1][1], _Quantile(buckets)


#: --modes: the load tool's TICK_US per mode (0: every message at its own time)
TICKS_US = {"ticks": 200, "message": 0}
MODE_LABEL = {"ticks": "200 us ticks", "message": "per message, no ticks"}


def measure(tool: str, target: Target, path: str, rate: float, seconds: float,
            mode: str = "ticks") -> dict:
    """One run of zmq_latency against a freshly started target; its ``result`` fields."""
    target.start(path)
    try:
        kind = "dealer" if path == "dealer" and target.kind != "proxy" else \
            "dealer-noreply" if path == "dealer" else "push"
        r = subprocess.run([tool, f"tcp://127.0.0.1:{target.in_port}", kind, str(rate),
                            str(seconds), f"tcp://127.0.0.1:{target.out_port}",
                            str(TICKS_US[mode])],
                           capture_output=True, text=True, timeout=seconds + 120)
        disk = target.fdatasyncs() if target.kind != "proxy" else ""
    finally:
        target.stop()
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("result ")), None)
    if line is None:
        raise RuntimeError(f"zmq_latency against {target.name} failed: {r.stderr.strip()}")
    res: dict = {k: float(v) for k, v in re.findall(r"(\w+)=([-\d.]+)", line)}
    res["disk"] = disk
    return res


def disk_floor(directory: str, seconds: float = 2.0) -> str:
    """write(32 KiB) + fdatasync in a loop on the spool's file system: what one sync costs
    on this disk now (a 202 under spool_fsync=batch cannot come faster)."""
    path = os.path.join(directory, "fdatasync-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    buf = b"x" * 32768
    d = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            os.write(fd, buf)
            t0 = time.perf_counter()
            os.fdatasync(fd)
            d.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    d.sort()
    q = [d[min(len(d) - 1, int(f * len(d)))] * 1000 for f in (0.5, 0.99, 0.999)]
    return (f"fdatasync on this disk now: {len(d)} in {seconds:g} s, p50 {q[0]:.2f} p99 "
            f"{q[1]:.2f} p99.9 {q[2]:.2f} max {d[-1] * 1000:.2f} ms")


def fmt(res: dict, p: str, n: int) -> str:
    if f"{p}_p50" not in res:
        return ""
    got = int(res["pubs" if p == "p" else "replies"])
    lat = " ".join(f"{k} {res[f'{p}_{k}']:7.2f}" for k in KEYS)
    return f"{lat} ms ({'published' if p == 'p' else 'answered'} {got:,}/{n:,})"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def ratios(res: dict, base: dict, p: str) -> str:
    """p50/p99/p99.9/max of ``res`` over those of ``base`` (the same run and mode)."""
    return "/".join(ratio(res[f"{p}_{k}"], base[f"{p}_{k}"]) for k in KEYS) + \
        " (p50/p99/p99.9/max)"


def print_result(t: Target, res: dict, n: int) -> None:
    late = f" (sender late by up to {res['late_max_ms']:.1f} ms)" \
        if res["late_max_ms"] > 5 else ""
    if "r_p50" in res:
        print(f"  {t.name:26s} reply   {fmt(res, 'r', n)}{late}", flush=True)
        late = ""
    print(f"  {t.name:26s} one-way {fmt(res, 'p', n)}{late}", flush=True)
    if res["disk"]:
        print(f"  {t.name:26s} disk    {res['disk']}", flush=True)


def baselines(targets: list[Target], t: Target) -> list[tuple[str, str, str, str]]:
    """``(what, baseline target's name, latency prefix, whose)`` of each ratio printed for
    ``t``: its one-way against zmq.proxy's, a spool target's reply against the no-spool
    relay's of the same tree, ``c-durable``'s reply against ``c-ack``'s."""
    out = []
    proxy = next((u for u in targets if u.kind == "proxy"), None)
    if proxy is not None and t.kind != "proxy":
        out.append(("one-way", proxy.name, "p", "zmq.proxy's"))
    nospool = next((u for u in targets if u.kind == "none" and u.src == t.src), None)
    if t.kind in ("interval", "batch") and nospool is not None:
        out.append(("reply", nospool.name, "r", "the no-spool relay's"))
    ack = next((u for u in targets if u.kind == "c-ack"), None)
    if t.kind in ("c-durable", "c-durable-thread") and ack is not None:
        out.append(("reply", ack.name, "r", "c-ack's (the floor of a durable 202 here)"))
    return out


def print_ratios(targets: list[Target], results: dict) -> None:
    for t in targets:
        res = results[t.name]
        bits = [f"{what} {ratios(res, results[base], p)} {whose}"
                for what, base, p, whose in baselines(targets, t)
                if f"{p}_p50" in res and f"{p}_p50" in results[base]]
        if bits:
            print(f"  {t.name:26s} ratios: {'; '.join(bits)}")
    for t, floor, ratio_of in over_floor(targets):
        qs = [ratio_of(results, key) for key in KEYS]
        if None not in qs:
            print(f"  {t.name:26s} over the floor: "
                  f"{'/'.join(f'{q:.2f}x' for q in qs)} (p50/p99/p99.9/max) {floor}")


def print_medians(targets: list[Target], rounds: list[dict], n: int) -> None:
    """The median of each percentile over the rounds, and the median of each round's own
    ratio (both sides of a ratio ran in the same round, minutes apart at most)."""
    k = len(rounds)
    print(f"  == median of {k} rounds (each percentile; ratios: the median of the rounds' "
          "own ratios, min-max in brackets)")
    for t in targets:
        for p, what in (("r", "reply  "), ("p", "one-way")):
            if f"{p}_p50" not in rounds[0][t.name]:
                continue
            med = " ".join(
                f"{key} {statistics.median(r[t.name][f'{p}_{key}'] for r in rounds):7.2f}"
                for key in KEYS)
            got = min(int(r[t.name]["pubs" if p == "p" else "replies"]) for r in rounds)
            print(f"  {t.name:26s} {what} {med} ms (fewest "
                  f"{'published' if p == 'p' else 'answered'} {got:,}/{n:,})")
    for t in targets:
        bits = []
        for what, base, p, whose in baselines(targets, t):
            if f"{p}_p50" not in rounds[0][t.name] or f"{p}_p50" not in rounds[0][base]:
                continue
            parts = []
            for key in KEYS:
                rs = sorted(r[t.name][f"{p}_{key}"] / r[base][f"{p}_{key}"]
                            for r in rounds if r[base][f"{p}_{key}"] > 0)
                parts.append(f"{statistics.median(rs):.2f}x [{rs[0]:.2f}-{rs[-1]:.2f}]"
                             if rs else "n/a")
            bits.append(f"{what} {' / '.join(parts)} {whose}")
        if bits:
            print(f"  {t.name:26s} median ratios (p50 / p99 / p99.9 / max): "
                  f"{'; '.join(bits)}", flush=True)
    for t, floor, ratio_of in over_floor(targets):
        if "r_p50" not in rounds[0][t.name]:
            continue
        parts = []
        for key in KEYS:
            qs = sorted(q for q in (ratio_of(r, key) for r in rounds) if q is not None)
            parts.append(f"{statistics.median(qs):.2f}x [{qs[0]:.2f}-{qs[-1]:.2f}]"
                         if qs else "n/a")
        print(f"  {t.name:26s} over the floor (p50 / p99 / p99.9 / max): "
              f"{' / '.join(parts)} {floor}", flush=True)


def over_floor(targets: list[Target]):
    """``(target, what, ratio_of(round, key))`` for each spool ``batch`` target and each
    floor in the run: its reply ratio to the no-spool relay's divided by the floor's
    (``c-durable`` or ``c-durable-thread`` over ``c-ack``) in the same round.  1.0: a
    durable 202 costs the relay, against its own no-spool 202, what it costs a bare C
    loop against answering at once on this machine and disk in that minute."""
    ack = next((u for u in targets if u.kind == "c-ack"), None)
    if ack is None:
        return []
    out = []
    for t in (u for u in targets if u.kind == "batch"):
        nospool = next((u for u in targets if u.kind == "none" and u.src == t.src), None)
        if nospool is None:
            continue
        for c in (u for u in targets if u.kind in ("c-durable", "c-durable-thread")):
            out.append((t, f"{c.name}'s ratio to c-ack's (the relay's batch/no-spool ratio "
                           f"divided by it, round by round)",
                        functools.partial(_floor_ratio, t.name, nospool.name, c.name,
                                          ack.name)))
    return out


def _floor_ratio(relay: str, nospool: str, floor: str, ack: str, r: dict,
                 key: str) -> float | None:
    """(relay / nospool) / (floor / ack) of round ``r`` at ``key``; None if one is missing
    or zero."""
    k = f"r_{key}"
    try:
        return (r[relay][k] / r[nospool][k]) / (r[floor][k] / r[ack][k])
    except (KeyError, ZeroDivisionError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="100000,200000")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--paths", default="dealer,push")
    ap.add_argument("--targets", default="proxy,none,interval,batch",
                    help="zmq.proxy, the relay with no spool, interval, batch; and c-ack, "
                         "c-durable: durable_ack.c without and with write + fdatasync, "
                         "one thread (the floor of a durable 202 on this machine; "
                         "DEALER only); c-durable-thread: the same with the fdatasync "
                         "handed to a second thread, as the relay does")
    ap.add_argument("--modes", default="ticks,message",
                    help="how the load is sent: ticks (everything due every 200 us, "
                         "together), message (each message alone at its own time, as real "
                         "agents send); every latency figure is run in each")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of every latency figure, the targets interleaved in each "
                         "(the order reversed every other round); with more than one, the "
                         "medians of each percentile and of each round's own ratios are "
                         "printed after the rounds' lines: one 8 s run alone swings 2-3x on "
                         "a shared 2-core host")
    ap.add_argument("--ingest-messages", type=int, default=1_000_000,
                    help="messages of the ingest-rate comparison (0: skip it)")
    ap.add_argument("--ingest-repeat", type=int, default=7,
                    help="rounds of the ingest-rate comparison, targets interleaved; "
                         "medians are compared (0: no ingest comparison)")
    ap.add_argument("--relay-src", action="append", default=[], metavar="NAME=SRC_DIR",
                    help="also run the relay targets from this source tree, named NAME")
    ap.add_argument("--batch-delay", default="", metavar="DURATION",
                    help="spool_fsync_batch_delay of the batch target (default: the relay's, 0)")
    ap.add_argument("--nice", type=int, default=0,
                    help="os.nice() for the whole run (load tool and every target alike; "
                         "negative needs root): less noise from other work on the host")
    args = ap.parse_args()
    global BATCH_DELAY
    BATCH_DELAY = args.batch_delay
    if args.nice:
        os.nice(args.nice)
    modes = args.modes.split(",")
    for m in modes:
        if m not in TICKS_US:
            ap.error(f"--modes: {m!r} is none of {', '.join(TICKS_US)}")
    tool = build_tool()
    trees = [("", None)] + [tuple(x.split("=", 1)) for x in args.relay_src]
    targets: list[Target] = []
    for t in args.targets.split(","):
        if t == "proxy":
            targets.append(Target("zmq.proxy", "proxy"))
            continue
        if t in ("c-ack", "c-durable", "c-durable-thread"):
            targets.append(Target(t, t))
            continue
        for label, src in trees:
            name = {"none": "relay, no spool", "interval": "relay, interval",
                    "batch": f"relay, batch{f' {BATCH_DELAY}' if BATCH_DELAY else ''}"}[t]
            targets.append(Target(f"{name} [{label}]" if label else name, t, src))
    print(f"latency bench: {os.cpu_count()} cpus shared, 300 B messages at a fixed rate "
          f"for {args.seconds:g} s; latency from each message's scheduled send time "
          f"(zmq_latency.c); spool on {tempfile.gettempdir()}")
    print(disk_floor(tempfile.gettempdir()), flush=True)
    for rate in (float(r) for r in args.rates.split(",")):
        n = int(rate * args.seconds)
        for path, mode in ((p, m) for p in args.paths.split(",") for m in modes):
            label = "DEALER -> ROUTER" if path == "dealer" else "PUSH -> PULL"
            print(f"\n{rate / 1000:.0f}k msg/s, {label}, {MODE_LABEL[mode]}:", flush=True)
            rounds: list[dict] = []
            # durable_ack.c has a ROUTER only
            here = [t for t in targets if path == "dealer" or not t.kind.startswith("c-")]
            for i in range(max(1, args.repeat)):
                if args.repeat > 1:
                    print(f"  -- round {i + 1} of {args.repeat}", flush=True)
                results = {}
                for t in (here if i % 2 == 0 else here[::-1]):
                    results[t.name] = measure(tool, t, path, rate, args.seconds, mode)
                for t in here:
                    print_result(t, results[t.name], n)
                print_ratios(here, results)
                rounds.append(results)
            if len(rounds) > 1:
                print_medians(here, rounds, n)
    if args.ingest_messages and args.ingest_repeat > 0:   # (--ingest-repeat 0: none)
        n, k = args.ingest_messages, args.ingest_repeat
        print(f"\ningest: {n:,} messages DEALER -> ROUTER as fast as the socket takes them, "
              f"replies per second; {k} rounds, the targets interleaved in each (one run "
              "alone swings +-20 % on a shared host), median:")
        spool = [t for t in targets if t.kind in ("interval", "batch")]
        rates: dict[str, list[float]] = {t.name: [] for t in spool}
        for i in range(k):
            for t in (spool if i % 2 == 0 else spool[::-1]):
                res = measure(tool, t, "dealer", 0, n)
                if int(res["replies"]) != n:
                    print(f"  {t.name:26s} answered only {int(res['replies']):,}/{n:,}")
                rates[t.name].append(res["r_rate"])
        for t in spool:
            got = sorted(rates[t.name])
            print(f"  {t.name:26s} {statistics.median(got):>9,.0f} replies/s (median; runs "
                  f"{', '.join(f'{r / 1000:.0f}k' for r in got)})", flush=True)
        for t in spool:
            if t.kind == "batch":
                iv = next((u for u in spool if u.kind == "interval" and u.src == t.src), None)
                if iv is not None:
                    pairs = sorted(b / a for a, b in zip(rates[iv.name], rates[t.name], strict=True))
                    print(f"  {t.name:26s} ingest "
                          f"{ratio(statistics.median(rates[t.name]), statistics.median(rates[iv.name]))} "
                          f"the interval rate (medians; the rounds' own ratios "
                          f"{pairs[0]:.2f}-{pairs[-1]:.2f}, median {statistics.median(pairs):.2f})")
    print(disk_floor(tempfile.gettempdir()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
