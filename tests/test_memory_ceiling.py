"""The documented RSS ceiling holds whatever arrives (docs/operations.md, "Memory").

The real ``logjam-relay`` command runs under ``RLIMIT_AS`` set to the ceiling that
:func:`logjam_relay.relay.memory.ceiling` gives for its settings (on top of the virtual
size the idle relay maps: thread stacks, libzmq, shared libraries count in RLIMIT_AS),
and gets, at once: decompression bombs, 50 MB frames (over MAXMSGSIZE: peer dropped),
frames just under MAXMSGSIZE and just under max_event_bytes in bulk while the output is
dead and the spool full, a stalled PUB subscriber, and subscription floods on PUB, stats
and CMDP.  Then the output comes back: the relay must still be alive, good traffic must
flow, the peak RSS (VmHWM) must be under the ceiling, and SIGTERM must exit 0.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
import urllib.request
import zlib

import pytest
import trio
import zmq

from conftest import free_port
from logjam_relay.relay import memory
from peers.lumberjack_reader import LumberjackReader
from relay_harness import meta, relay_argv, relay_settings, wait_http

MiB = 1024 * 1024
MAX_EVENT = 1 * MiB
ZMQ_MAX = 4 * MiB


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("VmSize", "VmRSS", "VmHWM", "Threads"):
                out[k] = int(v.split()[0]) * (1024 if k != "Threads" else 1)
    return out


def worker_pids(pid: int) -> list[int]:
    """The relay's output worker processes (children running outputs.worker)."""
    out = []
    for k in os.listdir("/proc"):
        if not k.isdigit():
            continue
        try:
            with open(f"/proc/{k}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"logjam_relay.outputs.worker" in \
                    open(f"/proc/{k}/cmdline", "rb").read():
                out.append(int(k))
        except (OSError, ValueError, IndexError):
            pass
    return out


class WorkerPeaks:
    """Samples the peak RSS (VmHWM) of every output worker the relay runs, restarted ones
    included, every 0.2 s until stopped: their sum, with the relay's own peak, is an upper
    bound of the relay's total resident memory."""

    def __init__(self, pid: int):
        import threading
        self.pid, self.peaks, self.stop = pid, {}, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            for w in worker_pids(self.pid):
                try:
                    self.peaks[w] = max(self.peaks.get(w, 0), proc_status(w)["VmHWM"])
                except (OSError, KeyError):
                    pass
            self.stop.wait(0.2)

    def total(self) -> int:
        self.stop.set()
        self.thread.join()
        return sum(self.peaks.values())


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels) -> float:
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


def start(settings, extra, log_path, as_limit: int | None = None):
    env = dict(os.environ)
    env.pop("LOGJAM_RELAY_CONFIG", None)

    def limit():
        if as_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))

    out = open(log_path, "ab")
    proc = subprocess.Popen(relay_argv(settings, extra), env=env, stdout=out, stderr=out,
                            preexec_fn=limit)
    wait_http(settings.metrics_port, proc, timeout=30)
    return proc


def sock(ctx, kind, port, **opts):
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    for k, v in opts.items():
        s.setsockopt(getattr(zmq, k), v)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def push_until_full(s, frames, seconds: float) -> int:
    """Send without blocking for ``seconds`` (a full queue is skipped, not waited on)."""
    sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            s.send_multipart(frames, zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            time.sleep(0.02)
    return sent


#: the ZeroMQ connections to ROUTER + PULL the storm opens, all at once (the docs'
#: example: "ten input connections")
STORM_INPUT_PEERS = 10


def storm_settings(tmp_path, reader_port: int, cmdp_port: int):
    """The configuration of the storm (docs/operations.md, "Memory", the example)."""
    return relay_settings(
        tmp_path, max_event_bytes=MAX_EVENT, rcv_hwm=4, snd_hwm=16, ingest_max_bytes=4 * MiB,
        max_subscriptions=2000, spool_max_bytes=24 * MiB, spool_segment_bytes=4 * MiB,
        cmdp_port=cmdp_port,
        outputs=[f"lumberjack://127.0.0.1:{reader_port}?window=8&pipeline=2&tls=off"
                 f"&timeout=5"])


#: the idle baselines the docs' examples take (B and Bw of the formula)
DOCS_B, DOCS_BW = 40 * MiB, 30 * MiB


@pytest.mark.slow
async def test_peak_rss_stays_under_the_documented_ceiling(tmp_path):
    reader_port = free_port()
    cmdp_port = free_port()
    settings = storm_settings(tmp_path, reader_port, cmdp_port)
    extra = ["--max-event-bytes", str(MAX_EVENT), "--rcv-hwm", "4", "--snd-hwm", "16",
             "--ingest-max-bytes", str(4 * MiB), "--max-subscriptions", "2000",
             "--spool-max-bytes", str(24 * MiB), "--spool-segment-bytes", str(4 * MiB),
             "--spool-dir", str(tmp_path / "spool"), "--cmdp-port", str(cmdp_port),
             "--chirp-interface", "127.0.0.1", "--output", settings.outputs[0]]
    log_path = tmp_path / "relay.log"
    after_storm: set[str] = set()

    def on_window(w):
        for ev in w.events:
            if ev.fields.get("app") == "after" and ev.fields.get("env") == "storm":
                after_storm.add(ev.fields.get("line"))

    reader = LumberjackReader(port=reader_port, keep_windows=False, on_window=on_window)
    ctx = zmq.Context()
    input_peers = STORM_INPUT_PEERS  # the connections to ROUTER + PULL opened below

    async with trio.open_nursery() as nursery:
        reader_scope = trio.CancelScope()

        async def serve_reader():
            with reader_scope:
                await reader.serve()
        nursery.start_soon(serve_reader)

        # ---- 1. the idle relay: what it maps and holds before anything arrives
        proc = await trio.to_thread.run_sync(start, settings, extra, log_path)
        good = sock(ctx, zmq.PUSH, settings.pull_port)
        for _ in range(50):
            good.send_multipart([b"warm-up", b"logs.warm", b"x" * 1000, meta()])
        await trio.sleep(1.5)
        idle = proc_status(proc.pid)
        workers = worker_pids(proc.pid)
        # output_isolation = "process" (the default): one worker process for the output
        assert len(workers) == memory.output_workers(settings) == 1, workers
        idle_worker = max(proc_status(w)["VmRSS"] for w in workers)
        proc.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(proc.wait, 15) == 0
        good.close()
        ceiling = memory.ceiling(settings, baseline=idle["VmRSS"], input_peers=input_peers,
                                 worker_baseline=idle_worker)
        as_limit = idle["VmSize"] + ceiling.total - idle["VmRSS"]
        print(f"\nidle: VSZ {idle['VmSize'] / MiB:.0f} MiB, RSS {idle['VmRSS'] / MiB:.0f} MiB "
              f"(+ worker {idle_worker / MiB:.0f} MiB), "
              f"{idle['Threads']} threads; {ceiling.describe()}; RLIMIT_AS "
              f"{as_limit / MiB:.0f} MiB")

        # ---- 2. the same relay under RLIMIT_AS, and the storm
        proc = await trio.to_thread.run_sync(start, settings, extra, log_path, as_limit)
        peaks = WorkerPeaks(proc.pid)
        try:
            pid = proc.pid
            stalled = sock(ctx, zmq.SUB, settings.pub_port, RCVHWM=1, RCVBUF=4096,
                           SUBSCRIBE=b"")                      # never reads
            # bombs while the output is up: 61 KB zlib bodies that inflate to 60 MiB
            bomb = zlib.compress(b"\0" * (60 * MiB), 9)
            bomber = sock(ctx, zmq.PUSH, settings.pull_port, SNDHWM=4)
            for _ in range(6):
                bomber.send_multipart([b"bomb-test", b"logs.bomb", bomb, meta(comp=1)])
            # 50 MB frames: over MAXMSGSIZE, libzmq drops the peer before buffering
            huge = b"h" * (50 * 1000 * 1000)
            huge_push = sock(ctx, zmq.PUSH, settings.pull_port, SNDHWM=1)
            huge_dealer = sock(ctx, zmq.DEALER, settings.router_port, SNDHWM=1)
            huge_push.send_multipart([b"huge-test", b"logs.huge", huge, meta()], zmq.NOBLOCK)
            huge_dealer.send_multipart([b"", b"huge-test", b"logs.huge", huge, meta()],
                                       zmq.NOBLOCK)
            del huge
            await trio.sleep(1.0)
            # the output dies; subscription floods start
            reader_scope.cancel()
            floods = []
            for port in (settings.pub_port, settings.stats_port, cmdp_port):
                f = sock(ctx, zmq.SUB, port, SNDHWM=0)
                for _ in range(5000):
                    f.setsockopt(zmq.SUBSCRIBE, os.urandom(128))
                floods.append(f)
            # frames just under MAXMSGSIZE (answered 400 / dropped) and just under
            # max_event_bytes (accepted, until the spool is full and ingress pauses)
            under_zmq = [b"big-test", b"logs.big", b"z" * (ZMQ_MAX - 2048), meta()]
            under_event = [b"big-test", b"logs.big", b"e" * (MAX_EVENT - 100), meta()]
            flooders = [
                (sock(ctx, zmq.PUSH, settings.pull_port, SNDHWM=2), under_zmq),
                (sock(ctx, zmq.PUSH, settings.pull_port, SNDHWM=2), under_zmq),
                (sock(ctx, zmq.DEALER, settings.router_port, SNDHWM=2), [b""] + under_zmq),
                (sock(ctx, zmq.PUSH, settings.pull_port, SNDHWM=2), under_event),
                (sock(ctx, zmq.PUSH, settings.pull_port, SNDHWM=2), under_event),
                (sock(ctx, zmq.DEALER, settings.router_port, SNDHWM=2), [b""] + under_event),
            ]
            async with trio.open_nursery() as storm:
                for s, frames in flooders:
                    storm.start_soon(trio.to_thread.run_sync, push_until_full, s, frames, 6.0)
            assert proc.poll() is None, "the relay died in the storm"
            during = proc_status(pid)
            text = scrape(settings.metrics_port)
            spool_full = metric(text, "logjam_relay_spool_full")
            refused = {n: metric(text, "logjam_relay_subscriptions_refused_total", socket=n)
                       for n in ("pub", "stats", "cmdp")}
            # cut at the cap (refused) or at the socket's byte budget, whichever came first
            flood_cut = {n: metric(text, "logjam_relay_subscription_peers_disconnected_total",
                                   socket=n) for n in ("pub", "stats", "cmdp")}
            too_large = metric(text, "logjam_relay_invalid_total", reason="too_large")
            print(f"storm: RSS {during['VmRSS'] / MiB:.0f} MiB, VSZ "
                  f"{during['VmSize'] / MiB:.0f} MiB, spool full {spool_full:.0f}, "
                  f"too_large {too_large:.0f}, subscriptions refused {refused}")
            for f in floods:
                f.close()
            for s, _ in flooders:
                s.close()
            for s in (bomber, huge_push, huge_dealer, stalled):
                s.close()

            # ---- 3. the output is back: the backlog drains, good traffic flows again
            reader_scope = trio.CancelScope()
            nursery.start_soon(serve_reader)
            sub = sock(ctx, zmq.SUB, settings.pub_port, SUBSCRIBE=b"after-")
            sub.setsockopt(zmq.SUBSCRIBE, b"heartbeat")
            good = sock(ctx, zmq.DEALER, settings.router_port)
            # subscribed once a heartbeat arrives (new PUB peers wait while the ends of
            # the floods' connections are paid back, io/peers.py)
            with trio.fail_after(30):
                while not (sub.poll(0) and sub.recv_multipart()[0] == b"heartbeat"):
                    await trio.sleep(0.02)
            replies = 0
            with trio.fail_after(60):
                while replies < 20:
                    good.send_multipart([b"", b"after-storm", b"logs.after",
                                         b'{"n":%d}' % replies, meta()])
                    while not good.poll(0):
                        await trio.sleep(0.02)
                    assert good.recv_multipart() == [b"after-storm", b"202 Accepted"]
                    replies += 1
            got = 0
            with trio.fail_after(30):
                while got < 20:
                    if sub.poll(0):
                        if sub.recv_multipart()[0] == b"after-storm":
                            got += 1
                    else:
                        await trio.sleep(0.02)
            with trio.move_on_after(60):       # and through the output, after the backlog
                while len(after_storm) < 20:
                    await trio.sleep(0.1)
            if len(after_storm) < 20:
                print(reader.stats())
                print("\n".join(ln for ln in scrape(settings.metrics_port).splitlines()
                                if ("output" in ln or "spool" in ln or "dead" in ln)
                                and not ln.startswith("#")))
            assert len(after_storm) == 20
            assert proc.poll() is None
            final = proc_status(pid)
            worker_peak = peaks.total()
            text = scrape(settings.metrics_port)
            print(f"after: RSS {final['VmRSS'] / MiB:.0f} MiB, peak RSS (VmHWM) "
                  f"{final['VmHWM'] / MiB:.0f} MiB + workers' {worker_peak / MiB:.0f} MiB "
                  f"({len(peaks.peaks)} worker processes), "
                  f"ceiling {ceiling.total / MiB:.0f} MiB, "
                  f"subscriptions held {metric(text, 'logjam_relay_subscriptions'):.0f}")
            assert spool_full == 1, "the storm never filled the spool"
            assert all(n > 0 for n in flood_cut.values()), (refused, flood_cut)
            assert too_large > 0
            assert worker_peak > 0 and final["VmHWM"] + worker_peak < ceiling.total
            good.close()
            sub.close()
            proc.send_signal(signal.SIGTERM)
            rc = await trio.to_thread.run_sync(proc.wait, 30)
            assert rc == 0, log_path.read_text()[-3000:]
        finally:
            peaks.stop.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            reader_scope.cancel()
            ctx.destroy(linger=0)
        nursery.cancel_scope.cancel()


def zmtp_sub_flood(port: int, topics: int, topic_len: int = 32) -> tuple[int, bool]:
    """A raw ZMTP 3.0 SUB (NULL mechanism) that sends ``topics`` random subscriptions
    without keeping them itself (a pyzmq SUB would hold them in its own trie).  Returns
    (subscriptions written, whether the relay closed the connection)."""
    import socket as so
    s = so.create_connection(("127.0.0.1", port), timeout=10)

    def read(n):
        buf = b""
        while len(buf) < n:
            got = s.recv(n - len(buf))
            if not got:
                raise ConnectionError("closed during the handshake")
            buf += got
        return buf
    # the greeting in two steps, as libzmq does (signature first, then the rest)
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f")
    read(10)
    s.sendall(b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31)
    read(54)
    prop = b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB"
    body = b"\x05READY" + prop
    s.sendall(b"\x04" + bytes([len(body)]) + body)
    # the relay's READY before anything else, as libzmq peers wait for it (the relay's
    # ZAP handler answers first: data sent before the handshake ends is a protocol error)
    _, size = read(2)
    read(size)
    sent, closed = 0, False
    chunk = []
    try:
        for _ in range(topics):
            t = b"\x01" + os.urandom(topic_len)
            chunk.append(b"\x00" + bytes([len(t)]) + t)
            if len(chunk) == 1000:
                s.sendall(b"".join(chunk))
                sent += len(chunk)
                chunk = []
        if chunk:
            s.sendall(b"".join(chunk))
            sent += len(chunk)
        s.settimeout(5)
        s.shutdown(so.SHUT_WR)
        while s.recv(65536):                  # the relay's greeting etc., then EOF
            pass
        closed = True
    except OSError:                           # reset by the relay
        closed = True
    finally:
        s.close()
    return sent, closed


def test_300k_subscriptions_are_cut_at_the_cap_and_memory_comes_back(tmp_path):
    """300k random subscriptions on PUB, stats and CMDP (the issue measured +2.8 GB per
    port, never released): with the default cap (10,000) each flood is cut, the RSS grows
    by at most the cap's worth and goes down again once the flooders are gone."""
    cmdp_port = free_port()
    settings = relay_settings(tmp_path, cmdp_port=cmdp_port)
    log_path = tmp_path / "relay.log"
    proc = start(settings, ["--cmdp-port", str(cmdp_port), "--chirp-interface", "127.0.0.1"],
                 log_path)
    try:
        time.sleep(0.5)
        before = proc_status(proc.pid)
        results = {}
        for name, port in (("pub", settings.pub_port), ("stats", settings.stats_port),
                           ("cmdp", cmdp_port)):
            results[name] = zmtp_sub_flood(port, 300_000)
        flooded = proc_status(proc.pid)
        # the pairs stop counting when a connection ends; libzmq's queue of their
        # unsubscriptions drains (and malloc_trim runs) a little later, later still on a
        # loaded machine: wait for both (the deadline only bounds a failure)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = scrape(settings.metrics_port)
            rss = proc_status(proc.pid)["VmRSS"]
            if metric(text, "logjam_relay_subscriptions") == 0 and \
                    rss - before["VmRSS"] < 16 * MiB:
                break
            time.sleep(0.5)
        after = proc_status(proc.pid)
        refused = {n: metric(text, "logjam_relay_subscriptions_refused_total", socket=n)
                   for n in ("pub", "stats", "cmdp")}
        cut = {n: metric(text, "logjam_relay_subscription_peers_disconnected_total", socket=n)
               for n in ("pub", "stats", "cmdp")}
        # the subscription term of the documented ceiling (3 sockets) + the allocator slack
        bound = memory.ceiling(settings, baseline=0, input_peers=0, output_bytes=0) \
            .subscriptions + memory.SLACK_BYTES
        print(f"\n300k subscriptions x 3 sockets: RSS {before['VmRSS'] / MiB:.0f} -> peak "
              f"{flooded['VmHWM'] / MiB:.0f} -> {after['VmRSS'] / MiB:.0f} MiB after they left "
              f"(bound +{bound / MiB:.0f} MiB); refused {refused}; peers cut {cut}; "
              f"sent/closed {results}")
        assert all(closed for _, closed in results.values()), results
        assert all(cut[n] >= 1 for n in cut), (refused, cut)
        assert metric(text, "logjam_relay_subscriptions") == 0
        assert flooded["VmHWM"] - before["VmRSS"] < bound
        assert after["VmRSS"] - before["VmRSS"] < 16 * MiB        # given back
        # still serving: a subscriber gets heartbeats
        ctx = zmq.Context()
        try:
            sub = sock(ctx, zmq.SUB, settings.pub_port, SUBSCRIBE=b"heartbeat")
            assert sub.poll(5000), "no heartbeat after the floods"
        finally:
            ctx.destroy(linger=0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
