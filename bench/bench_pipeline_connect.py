"""``pipeline stats --remote`` (Spark Connect) against ``--master local[2]``, same records.

    python bench/bench_pipeline_connect.py [--records 1000000] [--repeat-jobs 2] [--dir /tmp]

1. ``--records`` synthetic logjam messages (as bench/bench_pipeline.py: 80 % logs, all four
   compression methods, 2 devices, injected gaps) archived in 64 MiB segments.
2. A Spark Connect server from the installed pyspark (``spark-submit --class
   org.apache.spark.sql.connect.service.SparkConnectServer``, what
   ``sbin/start-connect-server.sh`` runs) with ``--master local[2]``, the same driver memory
   as the command's local session (2g) and the JVM reader's jar, on loopback.  Its start-up
   is timed apart: a Connect server is started once and serves many runs.
3. Whole command against whole command, interleaved, best of ``--repeat-jobs`` after one
   warm-up run of each (the local command's first run writes its JVM class archive; the
   server's first run warms its JIT and Python workers):
   * ``logjam-relay pipeline stats --input A --output O1 --master local[2] -q``
   * ``logjam-relay pipeline stats --input A --output O2 --remote sc://127.0.0.1:PORT -q``
   The ratio is remote time / local time (1.0 = as fast; above 1 = slower).  CPU seconds:
   the local command's whole process tree; for the remote run the client's tree and the
   server's tree during the run.
4. The four tables of both runs must be equal, every column.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_pipeline import _pid_cpu, _tree_cpu, timed  # noqa: E402

TABLES = {"request_stats": ("minute", "app", "env", "action"),
          "exceptions": ("minute", "app", "env", "action", "exception"),
          "topics": ("minute", "app", "env", "topic"), "loss": ("minute", "device")}


def tree_cpu(pid: int) -> float:
    seen: dict[int, float] = {}
    _tree_cpu(pid, seen)
    return sum(seen.values()) + (_pid_cpu(pid) or 0.0)


def differences(a: str, b: str) -> list[str]:
    import pyarrow.parquet as pq
    out = []
    for name, key in TABLES.items():
        x = {tuple(r[k] for k in key): r for r in
             pq.read_table(os.path.join(a, name)).to_pylist()}
        y = {tuple(r[k] for k in key): r for r in
             pq.read_table(os.path.join(b, name)).to_pylist()}
        if x != y:
            out.append(f"{name}: {len(set(x) ^ set(y))} keys differ, "
                       f"{sum(1 for k in set(x) & set(y) if x[k] != y[k])} rows differ")
    return out


def start_server(base: str, port: int, log_path: str) -> tuple[subprocess.Popen, float]:
    import pyspark

    from logjam_relay.pipeline.java import ensure_java
    from logjam_relay.pipeline.jvmreader import build_jar
    os.environ.update(ensure_java())
    jar = build_jar()
    home = os.path.dirname(pyspark.__file__)
    env = dict(os.environ, SPARK_HOME=home, PYSPARK_PYTHON=sys.executable)
    t = time.perf_counter()
    log = open(log_path, "wb")
    p = subprocess.Popen(
        [os.path.join(home, "bin", "spark-submit"), "--class",
         "org.apache.spark.sql.connect.service.SparkConnectServer", "--master", "local[2]",
         "--driver-memory", "2g", "--jars", jar,
         "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
         "--conf", f"spark.connect.grpc.binding.port={port}",
         "--conf", "spark.ui.enabled=false"],
        cwd=base, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    while b"Spark Connect server started at" not in open(log_path, "rb").read():
        if p.poll() is not None:
            raise SystemExit(open(log_path, errors="replace").read()[-3000:])
        time.sleep(0.2)
    return p, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--repeat-jobs", type=int, default=2)
    ap.add_argument("--port", type=int, default=15_102)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()

    from logjam_relay.pipeline import sample
    base = tempfile.mkdtemp(prefix="bench_pipeline_connect_", dir=a.dir)
    server = None
    try:
        t0 = time.perf_counter()
        msgs = sample.make_messages(a.records, malformed=False, gaps=True)
        archive = os.path.join(base, "archive")
        sample.write_archive(os.path.join(base, "spool"), archive, msgs,
                             segment_bytes=64 << 20, batch=1000)
        del msgs
        nseg = len([f for f in os.listdir(archive) if f.endswith(".seg")])
        size = sum(os.path.getsize(os.path.join(archive, f)) for f in os.listdir(archive))
        print(f"records: {a.records}  segments: {nseg}  archive: {size / 1e6:.1f} MB  "
              f"(prepared in {time.perf_counter() - t0:.1f} s)", flush=True)
        server, t_start = start_server(base, a.port, os.path.join(base, "server.log"))
        url = f"sc://127.0.0.1:{a.port}"
        print(f"Connect server (local[2], 2g) started in {t_start:.1f} s", flush=True)

        exe = os.path.join(os.path.dirname(sys.executable), "logjam-relay")
        cmd = ([exe] if os.path.exists(exe) else [sys.executable, "-m", "logjam_relay.cli"]) \
            + ["pipeline", "stats", "--input", archive, "-q"]
        env = dict(os.environ, XDG_CACHE_HOME=os.path.join(base, "cache"))
        env.pop("SPARK_REMOTE", None)
        local = cmd + ["--output", os.path.join(base, "local"), "--master", "local[2]"]
        remote = cmd + ["--output", os.path.join(base, "remote"), "--remote", url]
        load0 = os.getloadavg()[0]
        w_local1, _ = timed(local, env)
        s0 = tree_cpu(server.pid)
        w_remote1, _ = timed(remote, env)
        print(f"first runs: local {w_local1:.2f} s (writes the JVM class archive), remote "
              f"{w_remote1:.2f} s (server CPU {tree_cpu(server.pid) - s0:.1f} s)",
              flush=True)
        t_l, t_r, c_l, c_r, c_s = [], [], [], [], []
        for _ in range(a.repeat_jobs):
            w, c = timed(local, env)
            t_l.append(w)
            c_l.append(c)
            s0 = tree_cpu(server.pid)
            w, c = timed(remote, env)
            t_r.append(w)
            c_r.append(c)
            c_s.append(tree_cpu(server.pid) - s0)
        n = a.records
        tl, tr = min(t_l), min(t_r)
        print(f"load average (1 min) before / after the jobs: {load0:.2f} / "
              f"{os.getloadavg()[0]:.2f}")
        print(f"--master local[2]       : {tl:7.2f} s  {n / tl:10,.0f} rec/s  (runs: "
              f"{', '.join(f'{x:.2f}' for x in t_l)}; CPU s: "
              f"{', '.join(f'{x:.1f}' for x in c_l)})")
        print(f"--remote (Connect)      : {tr:7.2f} s  {n / tr:10,.0f} rec/s  (runs: "
              f"{', '.join(f'{x:.2f}' for x in t_r)}; client CPU s: "
              f"{', '.join(f'{x:.1f}' for x in c_r)}; server CPU s: "
              f"{', '.join(f'{x:.1f}' for x in c_s)})")
        print(f"ratio remote / local    : {tr / tl:.2f}x wall, "
              f"{(min(c_r) + min(c_s)) / min(c_l):.2f}x CPU (client + server / local tree)")
        diff = differences(os.path.join(base, "local"), os.path.join(base, "remote"))
        print("tables equal (all columns)" if not diff else "TABLES DIFFER: " +
              "; ".join(diff), flush=True)
        return 0 if not diff else 1
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(10)
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"kept {base}")


if __name__ == "__main__":
    sys.exit(main())
