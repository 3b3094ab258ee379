"""Attackers and meters for fault tests through the real ``logjam-relay`` command.

Every attacker runs in a process of its own, so a flood never competes with the test's
measurements for the test process's GIL (the machine's cores are another matter: that is
the point).  Start one with :func:`start`; :meth:`Attacker.stop` ends it (SIGTERM) and
returns the counters it printed as one JSON line.  Each can also be run by hand::

    python tests/fuzzers.py subflood --port 9606 --conns 8
    python tests/fuzzers.py garbage --endpoint tcp://127.0.0.1:9604 --kind dealer --peers 16
    python tests/fuzzers.py peers --port 9604 --kind DEALER --count 200

Attackers
  ``subflood``  raw ZMTP 3.0 SUB connections (NULL mechanism) sending random subscriptions
                of ``topic_len`` bytes as fast as the relay takes them, each connection
                re-opened when the relay cuts it.  Raw sockets: a pyzmq SUB would keep
                every topic in its own trie, and throttles.
  ``garbage``   pyzmq DEALER or PUSH peers sending random multipart messages (random frame
                counts and sizes, now and then one large frame, and messages that start
                like real requests: a samwise version frame, a logjam meta frame) without
                ever reading a reply.
  ``peers``     many idle ZeroMQ connections (a full ZMTP handshake, then nothing), each
                re-opened when the relay closes it: a peer-connection flood.

Meters (used in the test process)
  :class:`ProcessPeaks`  the peak RSS (VmHWM) of the relay and of every output worker it
                         runs, restarted ones included.
  :class:`MetricsProbe`  scrapes ``/metrics`` every ``interval`` s: latency of each scrape,
                         failures, and the peak of chosen gauges (subscriptions held, ...).
  :class:`GoodDealer`    a well-behaved logjam DEALER: one valid request at a time, each
                         reply's latency recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))

# --------------------------------------------------------------------------- ZMTP

SOCKET_TYPES = {"SUB", "DEALER", "PUSH", "REQ", "PUB", "ROUTER", "PULL"}


def _read(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = s.recv(n - len(buf))
        if not got:
            raise ConnectionError("closed during the handshake")
        buf += got
    return buf


def zmtp_connect(host: str, port: int, socket_type: str = "SUB",
                 timeout: float = 10.0) -> socket.socket:
    """A TCP connection with a complete ZMTP 3.0 NULL handshake as ``socket_type``.
    Raises OSError / ConnectionError when the relay refuses or closes it."""
    s = socket.create_connection((host, port), timeout=timeout)
    try:
        # the greeting in two steps, as libzmq does (signature first, then the rest)
        s.sendall(b"\xff" + b"\0" * 8 + b"\x7f")
        _read(s, 10)
        s.sendall(b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31)
        _read(s, 54)
        st = socket_type.encode()
        prop = b"\x0bSocket-Type" + len(st).to_bytes(4, "big") + st
        body = b"\x05READY" + prop
        s.sendall(b"\x04" + bytes([len(body)]) + body)
        # the relay's READY (or an ERROR command when it refuses the peer)
        flags, size = _read(s, 2)
        if flags & 0x02:                       # long size
            size = int.from_bytes(bytes([size]) + _read(s, 7), "big")
        cmd = _read(s, size)
        if not cmd.startswith(b"\x05READY"):
            raise ConnectionError(f"handshake refused: {cmd[:40]!r}")
        return s
    except BaseException:
        s.close()
        raise


class Counters:
    def __init__(self):
        self.lock = threading.Lock()
        self.values: dict[str, int] = {}

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.values[key] = self.values.get(key, 0) + n

    def peak(self, key: str, v: int) -> None:
        with self.lock:
            if v > self.values.get(key, 0):
                self.values[key] = v


# --------------------------------------------------------------------------- attackers

def subflood(stop: threading.Event, c: Counters, host: str, port: int, conns: int,
             topic_len: int, pace: float) -> None:
    """``conns`` connections, each sending random subscriptions until the relay cuts it,
    then a new one.  ``pace``: seconds to wait after a cut (0 = reconnect at once)."""
    pool = random.randbytes(1 << 20)

    def one(k: int) -> None:
        rng = random.Random(k ^ os.getpid())
        serial = 0
        while not stop.is_set():
            try:
                s = zmtp_connect(host, port, "SUB")
            except (OSError, ConnectionError):
                c.add("connect_failed")
                stop.wait(0.05)
                continue
            c.add("connections")
            try:
                while not stop.is_set():
                    chunk = []
                    for _ in range(64):
                        serial += 1
                        off = rng.randrange(len(pool) - topic_len)
                        topic = (serial.to_bytes(8, "big") + pool[off:off + topic_len])[
                            :topic_len]
                        frame = b"\x01" + topic
                        chunk.append(b"\x00" + bytes([len(frame)]) + frame)
                    s.sendall(b"".join(chunk))
                    c.add("subscriptions", len(chunk))
            except OSError:
                c.add("cut")
            finally:
                s.close()
            if pace:
                stop.wait(pace)

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _garbage_message(rng: random.Random, max_frames: int, max_frame: int,
                     big_every: int, big_bytes: int, flavour: str) -> list[bytes]:
    n = rng.randint(1, max_frames)
    frames = [rng.randbytes(rng.randint(0, max_frame)) for _ in range(n)]
    r = rng.random()
    if flavour == "samwise" and r < 0.5:
        # starts like a samwise request: a version, an action, then garbage
        frames = [rng.choice([b"1", b"2", b"3", b"-1", b"x"]),
                  rng.choice([b"publish\0", b"rpc\0", b"ping", b"status", b"stop"]),
                  rng.choice([b"round robin\0", b"redundant\0", b""])] + frames
    elif flavour == "logjam" and r < 0.5:
        # app-env, topic, body, a meta frame with a random tag/compression/version
        meta = struct.pack(">HBBIQQ", rng.choice([0xCABD, rng.getrandbits(16)]),
                           rng.randint(0, 5), rng.randint(0, 3), 0,
                           rng.getrandbits(63), rng.getrandbits(63))
        frames = [rng.choice([b"a-b", b"", b"x" * 300]), b"logs.x", frames[0], meta] + \
            frames[1:rng.randint(1, 3)]
    if big_every and rng.randrange(big_every) == 0:
        frames[rng.randrange(len(frames))] = b"B" * big_bytes
    return frames


def garbage(stop: threading.Event, c: Counters, endpoint: str, kind: str, peers: int,
            max_frames: int, max_frame: int, big_every: int, big_bytes: int,
            flavour: str) -> None:
    """``peers`` sockets, each sending random messages without blocking (a full queue is
    skipped) and never reading what comes back."""
    import zmq
    ctx = zmq.Context()
    stype = {"dealer": zmq.DEALER, "push": zmq.PUSH}[kind]

    def one(k: int) -> None:
        rng = random.Random(k * 7919 + os.getpid())
        s = ctx.socket(stype)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 64)
        if stype == zmq.DEALER:
            s.setsockopt(zmq.RCVHWM, 1)         # the replies it never reads
        s.connect(endpoint)
        try:
            while not stop.is_set():
                frames = _garbage_message(rng, max_frames, max_frame, big_every, big_bytes,
                                          flavour)
                if stype == zmq.DEALER and rng.random() < 0.7:
                    frames = [b""] + frames       # as a REQ would (the empty delimiter)
                try:
                    s.send_multipart(frames, zmq.NOBLOCK)
                    c.add("messages")
                    c.add("bytes", sum(map(len, frames)))
                except zmq.Again:
                    c.add("full")
                    stop.wait(0.005)
        finally:
            s.close(linger=0)

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(peers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ctx.term()


def peers(stop: threading.Event, c: Counters, host: str, ports: list[int], kinds: list[str],
          count: int, churn: float, openers: int) -> None:
    """Keep ``count`` idle ZeroMQ connections open over ``ports`` (round robin, each as the
    socket type in ``kinds`` at the same index), ``openers`` handshakes at a time (a relay
    may hold a handshake for a while); every ``churn`` s close and re-open one."""
    open_: list[socket.socket] = []
    lock = threading.Lock()

    def opener(k: int) -> None:
        i = k
        while not stop.is_set():
            with lock:
                if len(open_) >= count:
                    full = True
                else:
                    full = False
            if full:
                stop.wait(0.05)
                continue
            j = i % len(ports)
            i += 1
            try:
                s = zmtp_connect(host, ports[j], kinds[j], timeout=5)
            except (OSError, ConnectionError):
                c.add("refused")
                stop.wait(0.02)
                continue
            s.setblocking(False)
            c.add("opened")
            with lock:
                open_.append(s)
                c.peak("open_max", len(open_))

    def reaper() -> None:
        # notice the connections the relay closed; churn the others
        last = time.monotonic()
        while not stop.is_set():
            with lock:
                keep = []
                for s in open_:
                    try:
                        if s.recv(65536) == b"":
                            raise ConnectionError
                        keep.append(s)
                    except BlockingIOError:
                        keep.append(s)
                    except OSError:
                        c.add("closed_by_relay")
                        s.close()
                open_[:] = keep
                if churn and time.monotonic() - last >= churn and open_:
                    open_.pop(0).close()
                    c.add("churned")
                    last = time.monotonic()
            stop.wait(0.05)

    threads = [threading.Thread(target=opener, args=(k,), daemon=True)
               for k in range(openers)]
    threads.append(threading.Thread(target=reaper, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in open_:
        s.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=0, help="stop after (0 = on SIGTERM)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("subflood")
    a.add_argument("--host", default="127.0.0.1")
    a.add_argument("--port", type=int, required=True)
    a.add_argument("--conns", type=int, default=4)
    a.add_argument("--topic-len", type=int, default=128)
    a.add_argument("--pace", type=float, default=0.0)
    g = sub.add_parser("garbage")
    g.add_argument("--endpoint", required=True)
    g.add_argument("--kind", choices=("dealer", "push"), default="dealer")
    g.add_argument("--peers", type=int, default=8)
    g.add_argument("--max-frames", type=int, default=6)
    g.add_argument("--max-frame", type=int, default=2048)
    g.add_argument("--big-every", type=int, default=200, help="1 in N messages has a big "
                   "frame (0 = never)")
    g.add_argument("--big-bytes", type=int, default=512 * 1024)
    g.add_argument("--flavour", choices=("samwise", "logjam", "random"), default="random")
    p = sub.add_parser("peers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, action="append", required=True)
    p.add_argument("--kind", action="append", required=True,
                   help="ZMTP socket type per --port (DEALER for ROUTER, PUSH for PULL, ...)")
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--churn", type=float, default=0.0)
    p.add_argument("--openers", type=int, default=8)
    args = ap.parse_args(argv)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    c = Counters()
    t0 = time.monotonic()
    if args.cmd == "subflood":
        target, kw = subflood, dict(host=args.host, port=args.port, conns=args.conns,
                                    topic_len=args.topic_len, pace=args.pace)
    elif args.cmd == "garbage":
        target, kw = garbage, dict(endpoint=args.endpoint, kind=args.kind, peers=args.peers,
                                   max_frames=args.max_frames, max_frame=args.max_frame,
                                   big_every=args.big_every, big_bytes=args.big_bytes,
                                   flavour=args.flavour)
    else:
        if len(args.kind) != len(args.port) or not set(args.kind) <= SOCKET_TYPES:
            ap.error("one --kind (a ZMTP socket type) per --port")
        target, kw = peers, dict(host=args.host, ports=args.port, kinds=args.kind,
                                 count=args.count, churn=args.churn, openers=args.openers)
    worker = threading.Thread(target=target, args=(stop, c), kwargs=kw, daemon=True)
    worker.start()
    while worker.is_alive() and not stop.is_set():
        if args.seconds and time.monotonic() - t0 >= args.seconds:
            stop.set()
        stop.wait(0.1)
    stop.set()
    worker.join(10)
    out = dict(c.values)
    out["seconds"] = round(time.monotonic() - t0, 2)
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- control

class Attacker:
    """One attacker process (:func:`start`)."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "fuzzers.py"),
                                      *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.result: dict | None = None

    def stop(self, timeout: float = 20.0) -> dict:
        if self.result is not None:
            return self.result
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        try:
            self.result = json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            self.result = {"error": err.decode(errors="replace")[-2000:]}
        return self.result


def start(name: str, *argv: str) -> Attacker:
    """``start("pub flood", "subflood", "--port", "9606")``."""
    return Attacker(name, list(argv))


# --------------------------------------------------------------------------- meters

def proc_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("VmSize", "VmRSS", "VmHWM", "Threads"):
                out[k] = int(v.split()[0]) * (1024 if k != "Threads" else 1)
    return out


def child_pids(pid: int, marker: bytes = b"logjam_relay.outputs.worker") -> list[int]:
    """The children of ``pid`` whose command line contains ``marker`` (output workers)."""
    out = []
    for k in os.listdir("/proc"):
        if not k.isdigit():
            continue
        try:
            with open(f"/proc/{k}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid and marker in open(f"/proc/{k}/cmdline", "rb").read():
                out.append(int(k))
        except (OSError, ValueError, IndexError):
            pass
    return out


def run_queue_waits_ns(pid: int, tids=None, comm_prefixes=None) -> dict[int, int]:
    """Per thread of ``pid``, the nanoseconds it has spent runnable but waiting for a CPU
    (``/proc/PID/task/TID/schedstat``, second field): time a busy machine took from it,
    not time it spent on its own work or blocked.  ``tids``: only these threads and, with
    ``comm_prefixes``, those whose name starts with one of them."""
    out = {}
    try:
        names = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in names:
        tid = int(t)
        if tids is not None and tid not in tids:
            if not comm_prefixes:
                continue
            try:
                with open(f"/proc/{pid}/task/{t}/comm") as fh:
                    if not fh.read().startswith(tuple(comm_prefixes)):
                        continue
            except OSError:
                continue
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as fh:
                out[tid] = int(fh.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return out


def run_queue_wait_ns(pid: int, tids=None, comm_prefixes=None) -> int:
    """The sum of :func:`run_queue_waits_ns`."""
    return sum(run_queue_waits_ns(pid, tids, comm_prefixes).values())


#: the relay's threads besides its event loop that a reply goes through: libzmq's I/O
#: threads (the ROUTER's reads and writes) and the spool's fdatasync thread (the group
#: commit answers after it); not the XPUB threads, which the subscription floods keep
#: busy and which a reply does not wait for
REPLY_PATH_THREADS = ("ZMQbg/IO", "spool-fdatasync")


class ReplyPathWait:
    """How long, in seconds, the path of a reply of the relay ``pid`` waited for a CPU
    since the meter was made: the relay's event loop (its main thread), plus the one of
    its other :data:`REPLY_PATH_THREADS` that waited most (the relay has several libzmq
    I/O threads, one per context, and a reply goes through one: adding them all up would
    excuse a stall of the loop by what the others waited meanwhile), plus the client's own
    side: the thread ``client_tid`` (default the caller) and this process's threads
    whose name starts with ``client_prefix`` (the I/O thread of the client's ZeroMQ
    context, named by :func:`client_context`).  A reply late by that much was late because
    the machine was busy; what is left is the relay's own delay."""

    def __init__(self, pid: int, client_tid: int | None = None,
                 client_prefix: str | None = None):
        self.pid = pid
        self.client_tid = client_tid if client_tid is not None else threading.get_native_id()
        self.client_prefix = (client_prefix,) if client_prefix else None
        self._start = self._sample()

    def _sample(self) -> tuple[dict[int, int], int]:
        return (run_queue_waits_ns(self.pid, {self.pid}, REPLY_PATH_THREADS),
                run_queue_wait_ns(os.getpid(), {self.client_tid}, self.client_prefix))

    def mark(self) -> None:
        """Start measuring from now."""
        self._start = self._sample()

    def since_mark(self) -> float:
        """Seconds the path waited since :meth:`mark` (or since the meter was made)."""
        (relay0, client0), (relay, client) = self._start, self._sample()
        d = {t: v - relay0.get(t, 0) for t, v in relay.items()}
        loop = d.pop(self.pid, 0)
        return (loop + max(d.values(), default=0) + client - client0) / 1e9


_client_contexts = iter(range(100, 1000))


def client_context():
    """``(context, thread name prefix)``: a ZeroMQ context whose I/O thread has a name of
    its own (``ZMQ_THREAD_NAME_PREFIX``), for :class:`ReplyPathWait`."""
    import zmq
    ctx = zmq.Context()
    n = next(_client_contexts)
    ctx.set(zmq.THREAD_NAME_PREFIX, n)
    return ctx, f"{n}/ZMQbg/IO"


class ProcessPeaks:
    """The peak RSS of a relay and its output workers: the relay's own VmHWM is read at
    the end (the kernel keeps it), the workers' VmHWM is sampled every ``interval`` s
    while they live (restarted workers are new processes, each with its own peak)."""

    def __init__(self, pid: int, interval: float = 0.2):
        self.pid = pid
        self.interval = interval
        self.workers: dict[int, int] = {}
        self.relay_peak = 0
        self.samples: list[tuple[float, int]] = []     # (time, relay VmRSS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            try:
                st = proc_status(self.pid)
                self.relay_peak = max(self.relay_peak, st["VmHWM"])
                self.samples.append((time.monotonic() - t0, st["VmRSS"]))
            except (OSError, KeyError):
                pass
            for w in child_pids(self.pid):
                try:
                    self.workers[w] = max(self.workers.get(w, 0), proc_status(w)["VmHWM"])
                except (OSError, KeyError):
                    pass
            self._stop.wait(self.interval)

    def stop(self) -> tuple[int, int]:
        """(relay peak, sum of the workers' peaks), in bytes."""
        self._stop.set()
        self._thread.join()
        try:
            self.relay_peak = max(self.relay_peak, proc_status(self.pid)["VmHWM"])
        except (OSError, KeyError):
            pass
        return self.relay_peak, sum(self.workers.values())


def metric(text: str, name: str, **labels) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


class MetricsProbe:
    """Scrapes ``http://127.0.0.1:PORT/metrics`` every ``interval`` s in a thread: each
    scrape's latency, the scrapes that failed or took longer than ``timeout``, and the
    peak of each ``gauges`` entry (name -> (metric, labels))."""

    def __init__(self, port: int, gauges: dict[str, tuple[str, dict]], interval: float = 0.5,
                 timeout: float = 5.0, relay_pid: int | None = None, give_up: float = 60.0):
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.gauges = gauges
        self.interval = interval
        self.timeout = timeout
        #: with ``relay_pid``, a scrape is too slow when its latency less the run-queue
        #: wait of its path (:class:`ReplyPathWait`: the relay's event loop serves it)
        #: exceeds ``timeout``; the connection itself gives up after ``give_up`` s
        self.relay_pid = relay_pid
        self.give_up = give_up if relay_pid is not None else timeout
        self.waits: list[float] = []
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.peaks: dict[str, float] = {k: 0.0 for k in gauges}
        self.last = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def scrape(self) -> str:
        with urllib.request.urlopen(self.url, timeout=self.give_up) as r:
            return r.read().decode()

    def _run(self) -> None:
        path = ReplyPathWait(self.relay_pid) if self.relay_pid is not None else None
        while not self._stop.is_set():
            t0 = time.monotonic()
            if path is not None:
                path.mark()
            try:
                text = self.scrape()
            except OSError as e:
                self.failures.append(f"{time.monotonic() - t0:.1f}s: {e!r}")
            else:
                dt = time.monotonic() - t0
                waited = path.since_mark() if path is not None else 0.0
                self.latencies.append(dt)
                self.waits.append(waited)
                if dt - waited > self.timeout:
                    self.failures.append(f"{dt:.1f}s (run-queue wait {waited:.1f} s): slow")
                self.last = text
                for k, (name, labels) in self.gauges.items():
                    self.peaks[k] = max(self.peaks[k], metric(text, name, **labels))
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class GoodDealer:
    """A well-behaved logjam client on ROUTER: sends a valid request, waits for its reply
    (up to ``give_up`` s), records the latency, waits ``pause`` s, sends the next.
    ``late(limit)``: the requests not answered within ``limit`` s."""

    def __init__(self, port: int, pause: float = 0.2, give_up: float = 30.0,
                 relay_pid: int | None = None):
        import zmq
        self.relay_pid = relay_pid
        #: per answered request, the run-queue wait of its path (:class:`ReplyPathWait`,
        #: with ``relay_pid``): a request's own delay is its latency less this
        self.waits: list[float] = []
        self.ctx, self._io_prefix = client_context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.pause = pause
        self.give_up = give_up
        self.latencies: list[float] = []       # None-free: unanswered ones go to lost
        self.lost = 0
        self.wrong: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        path = ReplyPathWait(self.relay_pid, client_prefix=self._io_prefix) \
            if self.relay_pid is not None else None
        while not self._stop.is_set():
            n += 1
            meta = struct.pack(">HBBIQQ", 0xCABD, 0, 1, 0, int(time.time() * 1000), n)
            if path is not None:
                path.mark()
            t0 = time.monotonic()
            self.sock.send_multipart([b"", b"good-dealer", b"logs.good", b'{"n":%d}' % n,
                                      meta])
            got = None
            while time.monotonic() - t0 < self.give_up:
                if self.sock.poll(100):
                    got = self.sock.recv_multipart()
                    break
            if got is None:
                self.lost += 1
                continue
            self.latencies.append(time.monotonic() - t0)
            if path is not None:
                self.waits.append(path.since_mark())
            if got != [b"good-dealer", b"202 Accepted"]:
                self.wrong.append(got)
            self._stop.wait(self.pause)

    def late(self, limit: float) -> list[float]:
        return [t for t in self.latencies if t > limit]

    def late_of_its_own(self, limit: float) -> list[tuple[float, float]]:
        """``(latency, run-queue wait)`` of the requests whose latency less the time
        their path waited for a CPU exceeds ``limit`` (needs ``relay_pid``)."""
        return [(t, w) for t, w in zip(self.latencies, self.waits, strict=True) if t - w > limit]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


class GoodSubscriber:
    """A well-behaved subscriber on PUB: subscribes to ``prefix`` and counts what arrives
    (its own queue unbounded: only the relay's side can drop)."""

    def __init__(self, port: int, prefix: bytes):
        import zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, prefix)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(100):
                self.sock.recv_multipart()
                self.received += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


if __name__ == "__main__":
    main()
