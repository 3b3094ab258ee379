"""One ``logjam-relay pipeline stats`` run, profiled: the CPU of every thread of its process
tree (sampled from /proc every 0.2 s, grouped: JIT compilers, GC, executor tasks, the
driver's Python, ...) and, from Spark's event log, each stage's tasks, executor CPU and
GC time.  CPU seconds are what other load on the machine disturbs least.

    python bench/profile_stats.py ARCHIVE [--engine jvm] [--conf KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import proctree

TICK = os.sysconf("SC_CLK_TCK")


def snapshot(root: int, seen: dict) -> None:
    kids, _ = proctree.scan()
    procs = [root, *proctree.descendants(root, kids)]
    for pid in procs:
        try:
            with open(f"/proc/{pid}/comm") as fh:
                pcomm = fh.read().strip()
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as fh:
                    st = fh.read()
            except OSError:
                continue
            comm = st[st.index("(") + 1:st.rindex(")")]
            f = st[st.rindex(")") + 2:].split()
            cpu = (int(f[11]) + int(f[12])) / TICK
            seen[(pid, int(t))] = (pcomm, comm, max(cpu, seen.get((pid, int(t)), ("", "", 0))[2]))


def group(pcomm: str, comm: str) -> str:
    if pcomm != "java":
        return f"process {pcomm}"
    if comm.startswith("C2 Compiler"):
        return "JIT C2"
    if comm.startswith("C1 Compiler"):
        return "JIT C1"
    if comm.startswith(("GC Thread", "G1 ", "VM Thread", "VM Periodic")):
        return "GC + VM"
    if comm.startswith("Executor task"):
        return "executor tasks"
    return "java other"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("archive")
    ap.add_argument("--engine", default="jvm")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--conf", action="append", default=[])
    ap.add_argument("--threads", action="store_true", help="print the top threads too")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="profstats-")
    ev = os.path.join(tmp, "events")
    os.mkdir(ev)
    exe = os.path.join(os.path.dirname(sys.executable), "logjam-relay")
    cmd = ([exe] if os.path.exists(exe) else [sys.executable, "-m", "logjam_relay.cli"]) + [
        "pipeline", "stats", "--input", a.archive, "--output", os.path.join(tmp, "out"),
        "--master", a.master, "-q", "--engine", a.engine,
        "--conf", "spark.eventLog.enabled=true", "--conf", f"spark.eventLog.dir=file://{ev}",
        "--conf", "spark.eventLog.compress=false"]
    for c in a.conf:
        cmd += ["--conf", c]
    load0 = os.getloadavg()[0]
    epoch0 = time.time()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: dict = {}
    import threading
    out: list[bytes] = []
    th = threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True)
    th.start()
    while p.poll() is None:
        snapshot(p.pid, seen)
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    th.join()
    if p.returncode:
        sys.stdout.write(b"".join(out).decode(errors="replace")[-3000:])
        return 1
    # the driver's own CPU (the python process itself) after exit: from the last sample
    groups: dict[str, float] = {}
    for (pcomm, comm, cpu) in seen.values():
        g = group(pcomm, comm)
        groups[g] = groups.get(g, 0.0) + cpu
    total = sum(groups.values())
    print(f"wall {wall:.2f} s  tree CPU {total:.1f} s  load {load0:.2f} -> "
          f"{os.getloadavg()[0]:.2f}  conf {' '.join(a.conf) or '-'}")
    print("  " + "  ".join(f"{g} {c:.1f}" for g, c in sorted(groups.items(), key=lambda x: -x[1])))
    if a.threads:
        top = sorted(seen.values(), key=lambda x: -x[2])[:15]
        print("  top threads: " + ", ".join(f"{c}={v:.1f}" for _p, c, v in top))
    stages: dict[int, dict] = {}
    marks: dict[str, float] = {}
    for f in glob.glob(os.path.join(ev, "**", "*"), recursive=True):
        if not os.path.isfile(f):
            continue
        with open(f) as fh:
            for line in fh:
                e = json.loads(line)
                if e.get("Event") == "SparkListenerTaskEnd":
                    m = e.get("Task Metrics") or {}
                    s = stages.setdefault(e["Stage ID"], {"tasks": 0, "cpu": 0, "run": 0, "gc": 0})
                    s["tasks"] += 1
                    s["cpu"] += m.get("Executor CPU Time", 0) / 1e9
                    s["run"] += m.get("Executor Run Time", 0) / 1e3
                    s["gc"] += m.get("JVM GC Time", 0) / 1e3
                elif e.get("Event") == "SparkListenerStageCompleted":
                    i = e["Stage Info"]
                    st = stages.setdefault(i["Stage ID"], {"tasks": 0, "cpu": 0, "run": 0,
                                                          "gc": 0})
                    st["name"] = i["Stage Name"].split(" at ")[0]
                    st["span"] = (i.get("Submission Time", 0) / 1e3 - epoch0,
                                  i.get("Completion Time", 0) / 1e3 - epoch0)
                elif e.get("Event") in ("SparkListenerApplicationStart",
                                        "SparkListenerApplicationEnd"):
                    marks[e["Event"][len("SparkListenerApplication"):].lower()] = \
                        e["Timestamp"] / 1e3 - epoch0
    for sid in sorted(stages):
        s = stages[sid]
        span = s.get("span")
        at = f"  at {span[0]:.1f}-{span[1]:.1f} s" if span else ""
        print(f"  stage {sid}: {s['tasks']} tasks  CPU {s['cpu']:.2f} s  run {s['run']:.2f} s  "
              f"GC {s['gc']:.2f} s  ({s.get('name', '?')}){at}")
    if marks:
        print("  timeline (s after the command started): " + ", ".join(
            f"Spark application {k} {v:.1f}" for k, v in marks.items()) +
            f", the command exited {wall:.1f}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
