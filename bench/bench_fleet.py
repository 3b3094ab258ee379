"""The fleet benchmark: edge relays -> two central relays -> Spark, hosts as network
namespaces (tests/fleet_scenario.py; root and iproute2 needed).

Prints, with the absolute figures for context:

1. **Through the central tier**: three edges hold a backlog of N events each (spooled
   while their receivers were down); the receivers come up and the edges drain.  Events
   per second through the two central relays (input, stamp, PUB, spool with
   ``spool_fsync = batch``, archive), as a ratio against the same drain into two
   Lumberjack sinks that only decode and acknowledge (``tests/fleet_sink.py``, the
   in-repo reference reader), in the same run.
2. **202 -> row**: agents send one request at a time at a steady rate through the faults
   of the fleet test (SIGKILL of an edge and of a central, a link down, a deleted
   segment, a full disk) while ``pipeline stats --stream`` (local Spark, 1 s triggers)
   reads both central archives; for every request answered 202 at an edge, the time until
   the streaming run had the micro-batch holding it in its tables: p50 / p99.
3. **The pipeline**: ``pipeline stats`` over both central archives on a Spark standalone
   cluster (master and two workers on hosts of their own): seconds, and how many copies
   it left out.

    sudo .venv/dev/bin/python bench/bench_fleet.py [--backlog 20000] [--rate 100]
                                                   [--link-down 20]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from fleet_hosts import available  # noqa: E402
from fleet_scenario import (  # noqa: E402
    CENTRALS,
    EDGES,
    PORT_IN,
    Fleet,
    Plan,
    archived_request_ids,
    run_pipeline,
    run_traffic,
    standard_faults,
    start_spark,
)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def drain(root: str, backlog: int, sink: bool) -> float:
    """Events per second: the edges' backlogs drained into the centrals (or sinks)."""
    plan = Plan(rate=2000.0, spark=False)
    with Fleet(root, plan, log=lambda *_: None) as f:
        for e in EDGES:
            f.start(e)
        # the backlog: the agents' requests, spooled while nothing receives
        here = os.path.join(HERE, "..", "tests")
        procs = [f.hosts.popen(e, [sys.executable, os.path.join(here, "fleet_agent.py"),
                                   "--edge", e, "--rate", "5000", "--stop",
                                   os.path.join(root, f"stop-{e}"), "--after", "0",
                                   "--out", os.path.join(root, f"fill-{e}.json")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for e in EDGES]
        deadline = time.monotonic() + 300
        while True:
            b = [f.metric(e, "logjam_relay_output_backlog_records") or 0 for e in EDGES]
            if min(b) >= backlog or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for e in EDGES:
            open(os.path.join(root, f"stop-{e}"), "w").close()
        for p in procs:
            p.wait(60)
        total = sum(f.metric(e, "logjam_relay_output_backlog_records") or 0 for e in EDGES)
        t0 = time.monotonic()
        if sink:
            for c in CENTRALS:
                f.procs[c] = f.hosts.popen(c, [sys.executable,
                                               os.path.join(here, "fleet_sink.py"),
                                               str(PORT_IN)])
        else:
            for c in CENTRALS:
                f.start(c, wait=False)
        f.drained(timeout=600)
        dt = time.monotonic() - t0
        for name in list(f.procs):
            f.stop(name)
    return total / dt


def stream_latency(root: str, plan: Plan, spark_master: bool) -> dict:
    """The faults with steady traffic while --stream runs; 202 -> row p50/p99."""
    with Fleet(root, plan, log=print) as f:
        f.small_disk("edge9")
        for c in CENTRALS:
            f.start(c)
        for e in EDGES:
            f.start(e)
        out = os.path.join(root, "stream-out")
        exe = os.path.join(os.path.dirname(sys.executable), "logjam-relay")
        stream = subprocess.Popen(
            [exe, "pipeline", "stats", "--stream", "-q", "--trigger-interval", "1s",
             "--master", "local[2]", *(x for c in CENTRALS for x in ("--input", f.archive(c))),
             "--output", out, "--checkpoint", os.path.join(root, "ckpt")],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(root, "stream.log"), "wb"))
        done_at: dict[int, float] = {}
        stop = threading.Event()

        def watch():
            p = os.path.join(out, "_recomputed.json")
            while not stop.is_set():
                try:
                    with open(p) as fh:
                        b = int(json.load(fh)["batch"])
                    for k in range(max(done_at, default=-1) + 1, b + 1):
                        done_at[k] = time.time()
                except (OSError, ValueError, KeyError):
                    pass
                time.sleep(0.05)
        th = threading.Thread(target=watch, daemon=True)
        th.start()
        spark = {}
        if spark_master:
            sth = threading.Thread(target=lambda: spark.update(url=start_spark(f)))
            sth.start()
        agents, faults = run_traffic(f, standard_faults)
        f.drained(timeout=600)
        # until the stream has taken in everything archived (it may start late on a
        # busy machine): its micro-batches' records cover every archived request
        f.archived(set().union(*(a.answered for a in agents.values()))
                   - {json.loads(fr[2])["request_id"] for fr in faults["deleted"]
                      if fr[0] == b"fleet-production"})
        want = archived_request_ids(f)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            time.sleep(3)
            if stream.poll() is not None:
                break
            recs = os.path.join(out, "_records")
            n = 0
            if done_at and os.path.isdir(recs):
                try:
                    import pyarrow.dataset as pads
                    n = pads.dataset(recs, partitioning="hive", ignore_prefixes=["_", "."]) \
                        .count_rows(filter=pads.field("app") == "fleet")
                except (OSError, ValueError):
                    n = 0
            if n >= sum(want.values()):
                time.sleep(2)
                break
        stop.set()
        stream.terminate()
        stream.wait(60)
        # which micro-batch took in each request: the committed files' origins
        import pyarrow.parquet as pq

        from logjam_relay.pipeline.stats import _batch_files
        batch_of: dict[tuple[str, int], int] = {}
        meta = os.path.join(out, "_records", "_spark_metadata")
        for b in sorted(done_at):
            for fpath in _batch_files(meta, b) or []:
                t = pq.read_table(fpath, columns=["origin_host", "origin_sequence"])
                for h, s in zip(t["origin_host"].to_pylist(),
                                t["origin_sequence"].to_pylist(), strict=True):
                    if h is not None:
                        batch_of.setdefault((h, s), b)
        # request id -> origin (host, sequence), from the archives
        from spool_helpers import spooled_records
        origin_of = {}
        for c in CENTRALS:
            for frames in spooled_records([f.archive(c)]):
                if frames[0] == b"fleet-production":
                    d = json.loads(frames[2])
                    o = d["logjam_origin"]
                    origin_of.setdefault(d["request_id"], (o["host"], o["sequence"]))
        lat = []
        for a in agents.values():
            for rid, t202 in a.answered_at.items():
                o = origin_of.get(rid)
                b = batch_of.get(o) if o else None
                if b is not None:
                    lat.append(done_at[b] - t202)
        pipeline = None
        if spark_master:
            sth.join()
            text, secs = run_pipeline(f, spark["url"], os.path.join(root, "batch-out"))
            left = [ln for ln in text.splitlines() if "copies of events" in ln]
            pipeline = (secs, left[0].split("] ", 1)[-1] if left else "")
        n202 = sum(len(a.answered) for a in agents.values())
        return {"lat": lat, "n202": n202, "ids": len(archived_request_ids(f)),
                "pipeline": pipeline,
                "agent_p99": pct([x for a in agents.values() for x in a.latencies], 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backlog", type=int, default=20000, help="events per edge (1.)")
    ap.add_argument("--rate", type=float, default=100.0, help="requests/s per edge (2.)")
    ap.add_argument("--link-down", type=float, default=20.0, help="seconds (2.)")
    ap.add_argument("--no-spark", action="store_true", help="skip 3.")
    a = ap.parse_args()
    why = available()
    if why:
        sys.exit(f"bench_fleet: {why}")
    root = tempfile.mkdtemp(prefix="bench-fleet-")
    try:
        sink = drain(os.path.join(root, "sink"), a.backlog, sink=True)
        tier = drain(os.path.join(root, "tier"), a.backlog, sink=False)
        print(f"central tier: {tier:,.0f} events/s through 2 central relays, "
              f"sinks {sink:,.0f} events/s: ratio {tier / sink:.2f} "
              f"(3 edges x {a.backlog:,} events backlog)")
        r = stream_latency(os.path.join(root, "lat"),
                           Plan(rate=a.rate, link_down_s=a.link_down), not a.no_spark)
        print(f"202 -> streaming row: p50 {pct(r['lat'], 0.5):.2f} s, p99 "
              f"{pct(r['lat'], 0.99):.2f} s over {len(r['lat']):,} of {r['n202']:,} "
              f"requests answered 202 ({a.rate:g}/s per edge, 1 s triggers, archive seal "
              f"after 1 s; the agents' own 202 p99 through the faults, blocked by the full disk "
              f"and the kills: {r['agent_p99'] * 1000:.0f} ms)")
        if r["pipeline"]:
            print(f"pipeline stats on the standalone cluster: {r['pipeline'][0]:.1f} s "
                  f"({r['ids']:,} requests in the archives; {r['pipeline'][1]})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
