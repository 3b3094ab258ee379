"""Where the relay's event loop stalls under a fixed-rate load.

    python bench/stall_trace.py [--rate 100000] [--seconds 10] [--path dealer|push]
                                [--fsync none|interval|batch] [--threshold-ms 2]
                                [--segment-bytes N] [--tick-us 200]

Runs a relay in this process (trio, with a trio Instrument) and ``zmq_latency.c`` (the
fixed-rate load of bench_latency.py) against it.  Recorded:

* every task step longer than ``--threshold-ms``: its task, its wall time and the main
  thread's CPU time during it (wall >> CPU: the thread was preempted or waited for the
  GIL; wall ~ CPU: work done on the loop), and the stack a watchdog thread sampled while
  it ran (every 0.5 ms: the innermost relay frames);
* every garbage collection (``gc.callbacks``): generation and duration;
* the time between two loop turns spent outside task steps (I/O wait excluded);
* with a spool: every sync (``sync_async``, and the group commit's ``sync_begin`` ..
  ``sync_end``), apart those of a round after a segment roll (the seal's and the
  directory's syncs owed: the stall of a round after a roll), the spool's ``write()`` calls and the roll's
  parts (on the loop, in worker threads); under ``batch`` how long the replies waited in
  the group commit.

Printed: the latency line of zmq_latency, then the stalls grouped by where they were
sampled, the GC pauses, and the busiest tasks.  A diagnostic, not a benchmark: the
instrument costs a little on every task step.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import pathlib
import sys
import tempfile
import threading
import time
import traceback

import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import bench_latency as BL  # noqa: E402
import bench_relay as BR  # noqa: E402

#: the writer's methods a roll runs, and where they run
ROLL_PARTS = {"seal_active": "on the loop", "_create_segment": "on the loop",
              "roll": "on the loop", "_seal_written": "on the loop",
              "_seal_rename": "on the loop", "_seal_finish": "on the loop",
              "_seal_write": "in a worker thread", "_seal_dirsync": "in a worker thread"}


def thread_cpu(clk) -> float:
    return time.clock_gettime(clk)


class Tracer(trio.abc.Instrument):
    def __init__(self, threshold: float):
        self.threshold = threshold
        self.main = threading.get_ident()
        self.clk = time.pthread_getcpuclockid(self.main)
        self.step_task = None
        self.step_t0 = 0.0
        self.step_c0 = 0.0
        self.step_no = 0
        self.samples: dict[int, list[str]] = {}
        self.long_steps: list[tuple] = []
        self.busy = collections.Counter()
        self.gcs: list[tuple[int, float]] = []
        self._gc_t0 = 0.0
        self.stop = False
        threading.Thread(target=self._watch, daemon=True).start()

    def arm(self) -> None:
        """Start-up is done (tune_gc ran): count from here."""
        self.long_steps.clear()
        self.busy.clear()
        gc.callbacks.append(self._gc)

    def _gc(self, phase, info):
        if phase == "start":
            self._gc_t0 = time.perf_counter()
            self._gc_c0 = time.thread_time()
        else:
            self.gcs.append((info["generation"], time.perf_counter() - self._gc_t0,
                             time.thread_time() - self._gc_c0))

    def before_task_step(self, task):
        self.step_no += 1
        self.step_task = task
        self.step_c0 = thread_cpu(self.clk)
        self.step_t0 = time.perf_counter()

    def after_task_step(self, task):
        dt = time.perf_counter() - self.step_t0
        self.step_task = None
        self.busy[task.name] += dt
        if dt >= self.threshold:
            cpu = thread_cpu(self.clk) - self.step_c0
            self.long_steps.append((dt, cpu, task.name, self.samples.pop(self.step_no, [])))
        else:
            self.samples.pop(self.step_no, None)

    def _watch(self):
        frames = sys._current_frames
        while not self.stop:
            time.sleep(0.0005)
            if self.step_task is None:
                continue
            no = self.step_no
            if time.perf_counter() - self.step_t0 < self.threshold / 2:
                continue
            f = frames().get(self.main)
            if f is None:
                continue
            stack = traceback.extract_stack(f)
            mine = [f"{os.path.basename(fr.filename)}:{fr.lineno} {fr.name}" for fr in stack
                    if "logjam_relay" in fr.filename or "trio" in fr.filename]
            self.samples.setdefault(no, []).append(" < ".join(reversed(mine[-4:])))


async def run(args, tool: str, tracer: Tracer) -> None:
    from logjam_relay.gc_tuning import tune_gc
    from logjam_relay.relay.service import build
    from relay_harness import relay_settings

    tmp = tempfile.mkdtemp(prefix="stall-trace-")
    extra = {}
    if args.fsync != "none":
        extra = {"spool_dir": os.path.join(tmp, "spool"), "spool_fsync": args.fsync}
        if args.segment_bytes:
            extra["spool_segment_bytes"] = args.segment_bytes
    settings = relay_settings(pathlib.Path(tmp), metrics_port=0, heartbeat_interval=5.0, stats_interval=1.0,
                              **extra)
    relay = build(settings)
    syncs: list[float] = []
    roll_syncs: list[float] = []        # the syncs of a round after a roll
    raw_syncs: list[float] = []
    writes: list[tuple[float, float]] = []
    rolls: list[tuple[str, float]] = []
    if relay.spool is not None:
        real_sync = relay.spool.sync_async

        async def timed_sync():
            rolled = bool(relay.spool.writer.sealing)     # a seal is queued: after a roll
            t0 = time.perf_counter()
            await real_sync()
            syncs.append(time.perf_counter() - t0)
            if rolled:
                roll_syncs.append(syncs[-1])
        relay.spool.sync_async = timed_sync
        # the group commit's rounds with the C thread: sync_begin .. sync_end (a round
        # after a roll: a seal is queued, or the new segment's name is owed)
        real_begin, real_end = relay.spool.sync_begin, relay.spool.sync_end
        begun: dict[int, tuple[float, bool]] = {}

        def timed_begin():
            w = relay.spool.writer
            rolled = bool(w.sealing) or w.dir_synced < w.dir_gen
            t0 = time.perf_counter()
            job = real_begin()
            if job is not None:
                if hasattr(job, "closed_fds"):  # what the job syncs says (a tree with it)
                    rolled = bool(job.closed_fds) or job.dir_fd >= 0
                begun[id(job)] = (t0, rolled)
            return job

        async def timed_end(job):
            t0, rolled = begun.pop(id(job), (time.perf_counter(), False))
            await real_end(job)
            syncs.append(time.perf_counter() - t0)
            if rolled:
                roll_syncs.append(syncs[-1])
        relay.spool.sync_begin, relay.spool.sync_end = timed_begin, timed_end
        from logjam_relay.spool import fs as spool_mod  # the seam's os calls
        real_write = spool_mod._write
        clk = time.pthread_getcpuclockid(threading.get_ident())

        def timed_write(fd, data):
            t0, c0 = time.perf_counter(), time.clock_gettime(clk)
            try:
                return real_write(fd, data)
            finally:
                writes.append((time.perf_counter() - t0, time.clock_gettime(clk) - c0))
        spool_mod._write = timed_write
        real_fds = spool_mod._fdatasync

        def timed_fdatasync(fd):            # in the worker thread: the syscall alone
            t0 = time.perf_counter()
            try:
                return real_fds(fd)
            finally:
                raw_syncs.append(time.perf_counter() - t0)
        # the C fdatasync thread (spool/syncthread.py) calls the system's fdatasync: a
        # replaced one would switch it off, so the syscall is timed only without it
        try:
            from logjam_relay.spool import syncthread
            c_thread = not syncthread.OFF_REASON
        except ImportError:                 # a tree from before it
            c_thread = False
        if not c_thread:
            spool_mod._fdatasync = timed_fdatasync
        # segment roll: sealing (seal record, fsync, rename, directory fsync, state file)
        # and creating the next segment; on the loop, or (background seals) the loop's
        # parts and the worker threads' parts of a SealJob.  The names a tree lacks are
        # skipped (a before/after of two trees with the same script).
        writer = relay.spool.writer
        for name in ROLL_PARTS:
            real = getattr(writer, name, None)
            if real is None:
                continue

            def timed(*a, _real=real, _name=name, **k):
                t0 = time.perf_counter()
                try:
                    return _real(*a, **k)
                finally:
                    rolls.append((_name, time.perf_counter() - t0))
            setattr(writer, name, timed)
    async with trio.open_nursery() as nursery:
        await nursery.start(relay.run)
        tune_gc()
        tracer.arm()
        if args.gc_threshold:
            gc.set_threshold(*(int(x) for x in args.gc_threshold.split(",")))
        held: list[float] = []
        if getattr(relay, "commits", None) is not None:
            # how long replies wait inside the group commit (handed in -> sent)
            gcm = relay.commits
            handed: collections.deque = collections.deque()
            real_submit, real_send = gcm.submit, gcm._send

            def submit(sock, replies, *a, **k):
                if replies:
                    handed.append((time.perf_counter(), len(replies)))
                return real_submit(sock, replies, *a, **k)

            def send(sock, replies):
                n = len(replies)
                now = time.perf_counter()
                while n > 0 and handed:
                    t0, m = handed.popleft()
                    held.append(now - t0)
                    n -= m
                return real_send(sock, replies)
            gcm.submit, gcm._send = submit, send
        port = settings.router_port if args.path == "dealer" else settings.pull_port
        cmd = [tool, f"tcp://127.0.0.1:{port}", args.path, str(args.rate), str(args.seconds),
               f"tcp://127.0.0.1:{settings.pub_port}", str(args.tick_us)]
        r = await trio.run_process(cmd, capture_stdout=True)
        print(r.stdout.decode().strip())
        print(f"relay loop_lag_max {relay.loop_lag_max * 1000:.1f} ms", end="")
        if getattr(relay, "commits", None) is not None:
            st = {k: v for k, v in relay.commits.stats().items() if k != "wait_seconds"}
            print(f"; group commit {st}", end="")
        print()
        if held:
            held.sort()
            print(f"replies held in the group commit: {len(held)} batches, p50 "
                  f"{held[len(held) // 2] * 1000:.2f} ms, p99 "
                  f"{held[int(len(held) * 0.99)] * 1000:.2f} ms, max {held[-1] * 1000:.2f} ms")
        if syncs:
            syncs.sort()
            print(f"syncs (sync_async, sync_begin..sync_end: fdatasync in a thread, back on the "
                  f"loop): {len(syncs)} calls, "
                  f"p50 {syncs[len(syncs) // 2] * 1000:.2f} ms, p99 "
                  f"{syncs[int(len(syncs) * 0.99)] * 1000:.2f} ms, max {syncs[-1] * 1000:.2f} ms")
        if roll_syncs:
            d = sorted(roll_syncs)
            print(f"  of them after a roll (a seal or the directory owed): {len(d)} calls, p50 "
                  f"{d[len(d) // 2] * 1000:.2f} ms, p90 {d[int(len(d) * 0.9)] * 1000:.2f} ms, "
                  f"max {d[-1] * 1000:.2f} ms")
        if raw_syncs:
            d = sorted(raw_syncs)
            print(f"fdatasync syscall alone: {len(d)} calls, p50 {d[len(d) // 2] * 1000:.2f} "
                  f"ms, p99 {d[int(len(d) * 0.99)] * 1000:.2f} ms, max {d[-1] * 1000:.2f} ms")
        if writes:
            w = sorted(writes)
            print(f"spool write() on the loop: {len(w)} calls, p50 {w[len(w) // 2][0] * 1000:.2f}"
                  f" ms, p99 {w[int(len(w) * 0.99)][0] * 1000:.2f} ms, max {w[-1][0] * 1000:.2f} "
                  f"ms (its CPU {w[-1][1] * 1000:.2f} ms)")
        for name, where in ROLL_PARTS.items():
            d = sorted(x[1] for x in rolls if x[0] == name)
            if d:
                print(f"spool {name} {where}: {len(d)} calls, max {d[-1] * 1000:.2f} ms, "
                      f"total {sum(d) * 1000:.1f} ms")
        relay.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=100_000)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--path", default="dealer", choices=("dealer", "push"))
    ap.add_argument("--fsync", default="none", choices=("none", "interval", "batch"))
    ap.add_argument("--threshold-ms", type=float, default=2.0)
    ap.add_argument("--segment-bytes", type=int, default=0,
                    help="spool_segment_bytes (default: the relay's, 64 MiB); smaller ones "
                         "roll more often")
    ap.add_argument("--tick-us", type=int, default=200,
                    help="the load tool's tick (0: every message alone at its own time, "
                         "as bench_latency.py --modes message)")
    ap.add_argument("--gc-threshold", default="",
                    help="gc.set_threshold after the relay's own tune_gc (e.g. 500000,20,100)")
    args = ap.parse_args()
    BR.free_port()
    tool = BL.build_tool()
    tracer = Tracer(args.threshold_ms / 1000)
    trio.run(run, args, tool, tracer, instruments=[tracer])
    tracer.stop = True
    steps = tracer.long_steps
    print(f"\n{len(steps)} task steps >= {args.threshold_ms:g} ms "
          f"(total {sum(s[0] for s in steps) * 1000:.0f} ms):")
    by_where = collections.defaultdict(list)
    for dt, cpu, name, samples in steps:
        where = samples[0] if samples else "(not sampled)"
        by_where[(name.rsplit(".", 1)[-1], where)].append((dt, cpu))
    for (name, where), v in sorted(by_where.items(), key=lambda kv: -sum(x[0] for x in kv[1])):
        dts = sorted(x[0] for x in v)
        cpu = sum(x[1] for x in v) / sum(x[0] for x in v)
        print(f"  {len(v):4d}x max {dts[-1] * 1000:6.1f} ms, median {dts[len(dts) // 2] * 1000:5.1f}"
              f" ms, CPU/wall {cpu:.2f}  {name}: {where}")
    gcs = tracer.gcs
    if not gcs:
        print("  no garbage collection after start-up")
    for g in range(3):
        d = sorted(x[1] for x in gcs if x[0] == g)
        c = sorted(x[2] for x in gcs if x[0] == g)
        if d:
            print(f"  gc gen{g}: {len(d)} collections, wall max {d[-1] * 1000:.2f} ms, "
                  f"total {sum(d) * 1000:.1f} ms; CPU max {c[-1] * 1000:.2f} ms, "
                  f"total {sum(c) * 1000:.1f} ms")
    print("  busiest tasks: " + ", ".join(f"{n.rsplit('.', 1)[-1]} {t:.2f} s"
                                          for n, t in tracer.busy.most_common(5)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
