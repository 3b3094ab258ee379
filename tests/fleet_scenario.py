"""A fleet run through the real commands: edge relays -> two central relays -> Spark.

Used by ``tests/test_fleet.py`` (a small run) and ``bench/bench_fleet.py`` (a longer one).
Hosts are network namespaces (:mod:`fleet_hosts`): three edges (devices 7, 8, 9), two
central relays (100, 101) with a Lumberjack input, ``spool_fsync = batch`` and an archive
each, and, for the pipeline, a Spark standalone master and two workers on hosts of their
own.  Each edge's output lists both centrals (failover) and forwards its heartbeats.

One agent per edge sends logjam requests one at a time, each at its own scheduled time,
and records which were answered ``202 Accepted``.  The faults, in order:

* edge 7 is SIGKILLed and started again, ``edge_kills`` times;
* central 100 is SIGKILLed and started again (the edges fail over, then come back);
* edge 8's link goes down for ``link_down_s``; meanwhile it is SIGKILLed, one sealed
  segment of its spool (never delivered) is deleted, and it is started again;
* edge 9's spool disk fills up (a tmpfs and a filler file): ingress blocks until the
  filler goes.

Then ``pipeline stats`` runs over both central archives on the standalone cluster.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request

from fleet_hosts import Hosts

META = struct.Struct(">HBBIQQ")
EDGES = {"edge7": 7, "edge8": 8, "edge9": 9}
CENTRALS = {"centralA": 100, "centralB": 101}
PORT_IN = 5044


@dataclasses.dataclass
class Plan:
    rate: float = 40.0              # requests per second per edge, each on its own
    before_s: float = 3.0           # steady traffic before the first fault
    edge_kills: int = 4             # SIGKILLs of edge 7, one after the other
    between_s: float = 3.0          # between faults
    link_down_s: float = 8.0
    full_disk_s: float = 4.0
    after_s: float = 3.0
    timeout_s: float = 3.0          # an agent's wait for a reply
    segment_bytes: int = 64 << 10   # edge spools: many small segments
    spark: bool = True


def relay_cmd(name: str, device: int, state: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "logjam_relay", "-d", str(device), "--fqdn", name,
            "--state-dir", state, "--heartbeat-interval", "0.5", *extra]


def _get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, str(e)


class Fleet:
    def __init__(self, root, plan: Plan, log=print):
        self.root = str(root)
        os.makedirs(self.root, exist_ok=True)
        self.plan = plan
        self.log = log
        self.hosts = Hosts()
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = open(os.path.join(self.root, "relays.log"), "ab")
        self.tmpfs: list[str] = []
        self.events: list[tuple[float, str]] = []

    # ------------------------------------------------------------------ set-up
    def __enter__(self) -> Fleet:
        self.hosts.__enter__()
        for name in (*CENTRALS, *EDGES, *(SPARK_HOSTS if self.plan.spark else ())):
            self.hosts.add(name)
        return self

    def __exit__(self, *exc) -> None:
        for name in list(self.procs):
            self.stop(name)
        self.hosts.close()
        for d in self.tmpfs:
            subprocess.run(["umount", "-l", d], capture_output=True)
        self.logs.close()

    def d(self, *parts: str) -> str:
        p = os.path.join(self.root, *parts)
        os.makedirs(p, exist_ok=True)
        return p

    def archive(self, central: str) -> str:
        return self.d("archive", central)

    def spool(self, name: str) -> str:
        return self.d("spool", name)

    def args(self, name: str) -> list[str]:
        if name in CENTRALS:
            return ["--input", f"lumberjack://0.0.0.0:{PORT_IN}?tls=off&name=lj",
                    "--spool-dir", self.spool(name), "--spool-fsync", "batch",
                    "--archive-dir", self.archive(name), "--archive-seal-after", "1s",
                    "--spool-segment-bytes", "1MiB"]
        out = ",".join(f"{self.hosts.addr(c)}:{PORT_IN}" for c in CENTRALS)
        extra = ["--spool-max-bytes", "3MiB"] if name == "edge9" else []
        return ["--spool-dir", self.spool(name), "--spool-fsync", "batch",
                "--spool-segment-bytes", str(self.plan.segment_bytes), *extra,
                "--output", f"lumberjack://{out}?tls=off&heartbeats=on&window=200"
                            "&timeout=3&backoff_min=0.05&backoff_max=0.5&name=up"]

    def start(self, name: str, wait: bool = True) -> None:
        dev = {**EDGES, **CENTRALS}[name]
        p = self.hosts.popen(name, relay_cmd(name, dev, self.d("state", name),
                                             self.args(name)),
                             stdout=self.logs, stderr=self.logs)
        self.procs[name] = p
        self.event(f"start {name}")
        if wait:
            self.ready(name)

    def ready(self, name: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        if name in self.hosts.cut:          # unreachable from here: ask on the host
            probe = ("import time, urllib.request\n"
                     f"end = time.monotonic() + {timeout}\n"
                     "while time.monotonic() < end:\n"
                     "    try:\n"
                     "        urllib.request.urlopen('http://127.0.0.1:8082/metrics', "
                     "timeout=1)\n"
                     "        raise SystemExit(0)\n"
                     "    except OSError:\n"
                     "        time.sleep(0.1)\n"
                     "raise SystemExit(1)\n")
            r = self.hosts.run(name, [sys.executable, "-c", probe], timeout=timeout + 10)
            if r.returncode != 0:
                raise TimeoutError(f"{name} did not start")
            return
        url = f"http://{self.hosts.addr(name)}:8082/metrics"
        while time.monotonic() < deadline:
            p = self.procs[name]
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}")
            if _get(url)[0] == 200:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{name} did not start")

    def kill(self, name: str) -> None:
        p = self.procs.pop(name)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        self.event(f"SIGKILL {name}")

    def stop(self, name: str) -> int:
        p = self.procs.pop(name)
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait(10)
        self.event(f"stop {name} ({rc})")
        return rc

    def event(self, what: str) -> None:
        self.events.append((time.time(), what))
        self.log(f"fleet: {what}")

    def small_disk(self, name: str, size: str = "6m") -> str:
        d = self.spool(name)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"mount tmpfs: {r.stderr.strip()}")
        self.tmpfs.append(d)
        return d

    def metric(self, name: str, metric: str) -> float | None:
        code, text = _get(f"http://{self.hosts.addr(name)}:8082/metrics")
        if code != 200:
            return None
        vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(metric + "{") or line.startswith(metric + " ")]
        return sum(vals) if vals else None

    def archived(self, want: set, timeout: float = 60.0) -> None:
        """Until every request id of ``want`` is in the central archives: the archive holds
        sealed segments only, so what the centrals received last is there once
        ``--archive-seal-after`` (1 s) has sealed their open segments."""
        deadline = time.monotonic() + timeout
        while True:
            missing = want - set(archived_request_ids(self))
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(missing)} requests never reached the archives: "
                                   f"{sorted(missing)[:10]}")
            time.sleep(0.5)

    def drained(self, timeout: float = 120.0) -> None:
        """Until every edge's output has nothing left to send."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            backlog = [self.metric(e, "logjam_relay_output_backlog_records") for e in EDGES]
            if all(b == 0 for b in backlog):
                return
            time.sleep(0.3)
        raise TimeoutError(f"the edges did not drain: {backlog}")


# ---------------------------------------------------------------------- the agents

@dataclasses.dataclass
class Agent:
    """What one edge's agent (``tests/fleet_agent.py``) reported."""
    edge: str
    sent: int
    answered: set
    unknown: set                    # no reply in time (a SIGKILL, a long block)
    refused: int
    latencies: list                 # seconds from each 202's scheduled send time
    answered_at: dict               # request id -> wall-clock time of its 202


def run_traffic(fleet: Fleet, faults) -> tuple[dict[str, Agent], object]:
    """One agent on each edge host while ``faults(fleet)`` runs, and ``after_s`` more;
    returns (agents, what ``faults`` returned)."""
    here = os.path.dirname(os.path.abspath(__file__))
    stop = os.path.join(fleet.root, "agents.stop")
    procs = {}
    for e in EDGES:
        procs[e] = fleet.hosts.popen(e, [
            sys.executable, os.path.join(here, "fleet_agent.py"), "--edge", e,
            "--rate", str(fleet.plan.rate), "--timeout", str(fleet.plan.timeout_s),
            "--stop", stop, "--after", str(fleet.plan.after_s),
            "--out", os.path.join(fleet.root, f"agent-{e}.json")],
            stdout=fleet.logs, stderr=fleet.logs)
    try:
        got = faults(fleet)
    finally:
        open(stop, "w").close()
        for p in procs.values():
            p.wait(fleet.plan.after_s + fleet.plan.timeout_s + 60)
    agents = {}
    for e in EDGES:
        with open(os.path.join(fleet.root, f"agent-{e}.json")) as fh:
            r = json.load(fh)
        agents[e] = Agent(e, r["sent"], set(r["answered"]), set(r["unknown"]),
                          r["refused"], r["latencies"],
                          dict(zip(r["answered"], r["answered_at"], strict=True)))
    return agents, got


# ---------------------------------------------------------------------- faults

def segments(spool_dir: str) -> list[tuple[int, str]]:
    from logjam_relay.spool import segment as fmt
    return fmt.sealed_segments(spool_dir)


def records_of(path: str) -> list[list[bytes]]:
    from logjam_relay.spool import segment as fmt
    return [frames for _off, kind, frames in fmt.iter_records(path) if kind == 0]


def standard_faults(fleet: Fleet) -> dict:
    """The faults of the module's docstring; returns what was deleted."""
    p = fleet.plan
    time.sleep(p.before_s)
    for _ in range(p.edge_kills):
        fleet.kill("edge7")
        fleet.start("edge7")
        time.sleep(p.between_s / 2)
    time.sleep(p.between_s / 2)
    fleet.kill("centralA")
    time.sleep(1.0)
    fleet.start("centralA")
    time.sleep(p.between_s)
    # edge 8 cut off; two segments sealed meanwhile; SIGKILL; one of them deleted
    fleet.hosts.down("edge8")
    fleet.event("edge8 link down")
    t_down = time.monotonic()
    before = {s for s, _ in segments(fleet.spool("edge8"))}
    deadline = time.monotonic() + 60
    while len([s for s, _ in segments(fleet.spool("edge8")) if s not in before]) < 2:
        assert time.monotonic() < deadline, "edge8 sealed no segment while cut off"
        time.sleep(0.2)
    fleet.kill("edge8")
    new = [(s, path) for s, path in segments(fleet.spool("edge8")) if s not in before]
    segno, path = new[1]
    deleted = [fr for fr in records_of(path)]
    os.unlink(path)
    fleet.event(f"edge8: deleted sealed segment {segno} ({len(deleted)} records)")
    fleet.start("edge8")
    time.sleep(max(0.0, p.link_down_s - (time.monotonic() - t_down)))
    fleet.hosts.up("edge8")
    fleet.event("edge8 link up")
    time.sleep(p.between_s)
    # edge 9: its spool disk fills up (ingress blocks: no 202 until there is room)
    filler = os.path.join(fleet.spool("edge9"), "filler")
    st = os.statvfs(fleet.spool("edge9"))
    free = st.f_bavail * st.f_frsize
    with open(filler, "wb") as fh:
        try:
            fh.write(b"\0" * max(0, free - (4 << 10)))
        except OSError:
            pass
    fleet.event(f"edge9 disk filled ({free} bytes)")
    deadline = time.monotonic() + 60
    while fleet.metric("edge9", "logjam_relay_spool_disk_full") != 1:
        assert time.monotonic() < deadline, "edge9 never found its disk full"
        time.sleep(0.1)
    full = 1
    fleet.event("edge9 disk full (ENOSPC)")
    time.sleep(p.full_disk_s)
    os.unlink(filler)
    fleet.event("edge9 disk freed")
    return {"deleted": deleted, "edge9_disk_full": full}


# ---------------------------------------------------------------------- Spark

SPARK_HOSTS = ("sparkm", "sparkw1", "sparkw2")


def spark_env(local_ip: str, **extra) -> dict:
    import pyspark

    from logjam_relay.pipeline.java import ensure_java
    env = dict(os.environ, SPARK_LOCAL_IP=local_ip, SPARK_HOME=os.path.dirname(pyspark.__file__),
               PYSPARK_PYTHON=sys.executable, **extra)
    env.update(ensure_java())
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    return env


def start_spark(fleet: Fleet, jit: str = "") -> str:
    """A standalone master and two workers, each on a host of its own; returns the
    master's URL."""
    import pyspark
    spark_class = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
    d = fleet.d("spark")
    m = fleet.hosts.addr("sparkm")

    def start(host, args):
        env = spark_env(fleet.hosts.addr(host), SPARK_DAEMON_MEMORY="256m",
                        SPARK_LOG_DIR=d, SPARK_WORKER_DIR=fleet.d("spark", host),
                        SPARK_NO_DAEMONIZE="1", SPARK_DAEMON_JAVA_OPTS=jit)
        log = open(os.path.join(d, f"{host}.log"), "ab")
        p = fleet.hosts.popen(host, [spark_class, *args], env=env, stdout=log,
                              stderr=subprocess.STDOUT)
        fleet.procs[host] = p
        return p
    start("sparkm", ["org.apache.spark.deploy.master.Master", "--host", m,
                     "--port", "7077", "--webui-port", "8080"])
    url = f"spark://{m}:7077"
    for w in ("sparkw1", "sparkw2"):
        start(w, ["org.apache.spark.deploy.worker.Worker", "--host", fleet.hosts.addr(w),
                  "--cores", "1", "--memory", "700m", url])
    deadline = time.monotonic() + 180
    while True:
        code, text = _get(f"http://{m}:8080/json/")
        try:
            alive = int(json.loads(text).get("aliveworkers", 0)) if code == 200 else 0
        except ValueError:
            alive = 0
        if alive >= 2:
            break
        for h in SPARK_HOSTS:
            if fleet.procs[h].poll() is not None:
                raise RuntimeError(f"spark {h} exited: see {d}/{h}.log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Spark workers did not register: see {d}")
        time.sleep(0.5)
    fleet.event("spark standalone cluster up (master + 2 workers)")
    return url


def run_pipeline(fleet: Fleet, master: str, out: str, jit: str = "") -> tuple[str, float]:
    """``logjam-relay pipeline stats`` over both central archives on the cluster (the
    driver on the test process's leg of the bridge); returns (its output, seconds)."""
    exe = os.path.join(os.path.dirname(sys.executable), "logjam-relay")
    cmd = [exe, "pipeline", "stats", "--master", master,
           *(x for c in CENTRALS for x in ("--input", f"file://{fleet.archive(c)}")),
           "--output", out, "--conf", "spark.executor.memory=512m",
           "--conf", "spark.cores.max=2", "--conf", "spark.sql.shuffle.partitions=4",
           "--conf", f"spark.executor.extraJavaOptions={jit}",
           "--conf", "spark.driver.host=198.18.0.1"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=spark_env("198.18.0.1"), capture_output=True, text=True,
                       timeout=900)
    dt = time.monotonic() - t0
    out_text = r.stdout + r.stderr
    if r.returncode != 0:
        raise AssertionError(f"pipeline stats failed ({r.returncode}):\n{out_text[-4000:]}")
    return out_text, dt


def read_tables(out: str) -> dict[str, list[dict]]:
    import pyarrow.dataset as pads
    got = {}
    for name in ("request_stats", "origin_loss", "loss", "gaps"):
        p = os.path.join(out, name)
        files = [f for f in os.listdir(p) if not f.startswith(("_", "."))] \
            if os.path.isdir(p) else []
        got[name] = pads.dataset(p, partitioning="hive", ignore_prefixes=["_", "."]) \
            .to_table().to_pylist() if files else []
    return got


def archived_request_ids(fleet: Fleet) -> dict[str, int]:
    """request_id -> how many times it is in the central archives (any copy)."""
    from spool_helpers import spooled_records
    ids: dict[str, int] = {}
    for c in CENTRALS:
        for frames in spooled_records([fleet.archive(c)]):
            if frames[0] != b"fleet-production":
                continue
            rid = json.loads(frames[2])["request_id"]
            ids[rid] = ids.get(rid, 0) + 1
    return ids
