"""CPU seconds by thread, as logjam-device labels ``logjam:device:cpu_seconds_total``.

logjam-device exports one series per thread: ``thread="main"`` (its event loop) and
``thread="compressorN"`` (its compressor pool), each the thread's user + system time.
The relay keeps those labels for its counterparts and adds its other threads and its
output worker processes (docs/operations.md, "Metrics"):

* ``main``: the thread running the relay's event loop (ingest, stamping, publishing,
  spooling, the C socket loops);
* ``compressorN``: the ``-x`` recompression threads (``relay/compressors.py``; 0 without
  ``-x``, where they do not run);
* ``metrics_http``: the metrics endpoint's own thread (``health/http.py``);
* ``zmq_ioN``: libzmq's I/O threads (``ZMQbg/IO/N``, ``io_threads`` of them);
* ``other``: the rest of the relay process (short-lived worker threads: spool syncs,
  password checks; libzmq's reaper; threads that ended);
* ``output:<name>``: an output worker process (every thread of it).

Read from ``/proc/self/task/<tid>/stat`` at scrape time (clock ticks, 10 ms).  Every
series is monotonic: a thread that ends keeps the last value read for its label, and
``other`` is the process total (``os.times()``, which keeps what ended threads used)
minus the named series, never going down; an output worker that is restarted adds to
the value its predecessor reached.  A scrape that cannot read ``/proc`` (out of file
descriptors) repeats the last values; where there is no ``/proc`` at all, ``main`` is
the whole process.
"""

from __future__ import annotations

import os
import re

try:
    _TICK = float(os.sysconf("SC_CLK_TCK"))
except (AttributeError, ValueError, OSError):      # pragma: no cover - not POSIX
    _TICK = 100.0

_ZMQ_IO = re.compile(r"ZMQbg/IO/(\d+)$")


def stat_cpu(path: str) -> tuple[str, float] | None:
    """``(comm, utime + stime in seconds)`` of a ``/proc/.../stat`` file, or None when the
    thread or process is gone; OSError when it could not be read (out of descriptors)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    left, right = data.find(b"("), data.rfind(b")")
    fields = data[right + 2:].split()
    if left < 0 or right < 0 or len(fields) < 13:
        return None
    # after "(comm) ": state is field 3 of proc(5); utime and stime are fields 14 and 15
    return (data[left + 1:right].decode("utf-8", "replace"),
            (int(fields[11]) + int(fields[12])) / _TICK)


def process_cpu() -> float:
    t = os.times()
    return t.user + t.system


class ThreadCpu:
    """``sample(named, workers)`` -> {thread label: CPU seconds}, monotonic per label."""

    def __init__(self, task_dir: str = "/proc/self/task"):
        self.task_dir = task_dir
        self._last: dict[int, tuple[str, float]] = {}    # tid -> (label, cpu) last read
        self._carried: dict[str, float] = {}              # label -> CPU of ended threads
        self._other = 0.0
        self._workers: dict[str, tuple[int, float]] = {}  # output -> (pid, cpu) last read
        self._workers_carried: dict[str, float] = {}
        self._out: dict[str, float] | None = None         # the last sample
        self._unnamed: set[int] = set()    # tids seen with no label: not read again

    @staticmethod
    def label(tid: int, comm: str, named: dict[int, str]) -> str | None:
        lbl = named.get(tid)
        if lbl is not None:
            return lbl
        m = _ZMQ_IO.match(comm)
        return f"zmq_io{m.group(1)}" if m else None

    def sample(self, named: dict[int, str], workers: dict[str, int] | None = None,
               total: float | None = None) -> dict[str, float]:
        """``named``: native thread id -> label (main, compressorN, metrics_http), whose
        labels are always present; ``workers``: output name -> worker pid (0: none now);
        ``total``: the process's CPU (``os.times()`` when None)."""
        total = process_cpu() if total is None else total
        out = dict.fromkeys(named.values(), 0.0)
        if not os.path.isdir(self.task_dir):     # no /proc: the whole process is "main"
            out["main"] = total
            return out
        now: dict[int, tuple[str, float]] = {}
        try:
            tids = set(map(int, os.listdir(self.task_dir)))
            self._unnamed &= tids
            for tid in tids:
                if tid in self._unnamed and tid not in named:
                    continue                    # in "other": its time is in the total
                got = stat_cpu(f"{self.task_dir}/{tid}/stat")
                if got is None:
                    continue
                lbl = self.label(tid, got[0], named)
                if lbl is not None:
                    now[tid] = (lbl, got[1])
                else:
                    self._unnamed.add(tid)
            wout = self._sample_workers(workers or {})
        except (OSError, ValueError):
            # not now (out of descriptors): the last values, nothing taken for ended
            if self._out is not None:
                return self._out
            return out | {"other": self._other}
        for tid, (lbl, cpu) in self._last.items():
            cur = now.get(tid)
            if cur is None or cur[0] != lbl or cur[1] < cpu:   # ended (or tid reused)
                self._carried[lbl] = self._carried.get(lbl, 0.0) + cpu
        self._last = now
        for lbl, cpu in self._carried.items():
            out[lbl] = out.get(lbl, 0.0) + cpu
        for lbl, cpu in now.values():
            out[lbl] = out.get(lbl, 0.0) + cpu
        self._other = max(self._other, round(total - sum(out.values()), 6))
        out["other"] = self._other
        self._out = out | wout
        return self._out

    def _sample_workers(self, workers: dict[str, int]) -> dict[str, float]:
        """Raises OSError (nothing changed) when a worker's stat cannot be read."""
        got_all = {name: stat_cpu(f"/proc/{pid}/stat") if pid else None
                   for name, pid in workers.items()}
        out = {}
        for name, pid in workers.items():
            label = f"output:{name}"
            last_pid, last_cpu = self._workers.get(name, (0, 0.0))
            got = got_all[name]
            if pid != last_pid or (got is not None and got[1] < last_cpu):
                # a new worker (or none now): its predecessor's CPU stays in the series
                self._workers_carried[name] = self._workers_carried.get(name, 0.0) + last_cpu
                last_cpu = 0.0
            cpu = got[1] if got is not None else last_cpu
            self._workers[name] = (pid, cpu)
            out[label] = self._workers_carried.get(name, 0.0) + cpu
        return out
