"""Running out of file descriptors never kills the relay (issue 21, item 3).

The real command under ``RLIMIT_NOFILE`` = ``LIMIT``, with a Lumberjack output, small spool
segments (they roll every few dozen messages) and a Courier input.  A valid ROUTER client
connects first and keeps sending through every phase:

1. a flood of idle TCP connections (nothing sent) to ROUTER, PULL, the input and /metrics,
   more than the limit: the relay drops the silent ZeroMQ ones
   (``logjam_relay_fd_refused_connections_total{reason="silent"}``), closes the ones waiting
   to be accepted (``reason="accept"``), and is back to normal once the flood is closed;
2. a child process holding ``PEERS`` ZeroMQ DEALER peers (handshake done, then idle): never
   dropped; the guard pauses the ZeroMQ sockets, and idle input connections take the few
   descriptors it kept free, so the relay stays at the limit (``logjam_relay_open_fds``)
   for as long as they stay.  Meanwhile segments roll, the output worker is killed and
   restarted, /metrics answers and new input connections are closed at once (counted) while
   the fd reserve can spare a descriptor, else they wait in the backlog: all on the fd
   reserve (``logjam_relay_fd_reserve_used_total``);
3. the peers leave: new ROUTER and input connections work again.

Asserted: the relay lives and exits 0 on SIGTERM, every message answered 202 is delivered
(0 lost), the counters are > 0 (the input's: each connection closed at accept counted,
and only those, as its client saw it), the fd guard's log lines are rate-limited, no traceback
(but the crash report of the worker that was killed).  Run with ``-s`` for the figures.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import trio
import zmq

from conftest import free_port
from logjam_relay.io import zmq_trio
from peers.lumberjack_reader import LumberjackReader
from relay_harness import meta, relay_argv, relay_settings, stop_process, wait_http

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the fd guard needs /proc and TCP_INFO (Linux)")

LIMIT = 256
PEERS = 300
BODY = b'{"action":"Fd#test","n":%d,"pad":"' + b"." * 300 + b'"}'
SEGMENT = 16 << 10

# raises nothing: the relay is started under the limit (soft = hard)
_WRAP = ("import os, resource, sys; n = int(sys.argv[1]); "
         "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
         "os.execv(sys.executable, [sys.executable, '-m', 'logjam_relay', *sys.argv[2:]])")

# ZeroMQ peers that complete their handshake and then stay idle (never dropped)
_PEERS = ("import sys, time, zmq; ctx = zmq.Context(); socks = []\n"
          "for i in range(int(sys.argv[2])):\n"
          "    s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)\n"
          "    s.connect(sys.argv[1]); socks.append(s)\n"
          "print('ready', flush=True); time.sleep(3600)\n")


def scrape(port: int) -> str:
    """/metrics; while the relay is out of descriptors a connection may be closed at once
    (its reserve serves two at a time, evicting idle ones): then again, a few times."""
    for attempt in range(5):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                return r.read().decode()
        except OSError:
            if attempt == 4:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def idle_connections(port: int, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        out.append(c)
    return out


def closed_at_once(port: int, timeout: float = 5.0) -> bool:
    """Connect and see whether the relay closes the connection (EOF or reset)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        try:
            return c.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


def closed_by_peer(c: socket.socket) -> bool:
    """A non-blocking connection of ``idle_connections``: closed by the relay (EOF or
    reset)?  False while it is open or still waits to be accepted."""
    try:
        return c.recv(1) == b""
    except ConnectionResetError:
        return True
    except OSError:             # open, or not yet accepted by the kernel (SYN_SENT)
        return False


def worker_pids(pid: int) -> list[int]:
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += f.read().split()
        except OSError:
            pass
    out = []
    if True:
        for child in children:
            try:
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    if b"logjam_relay.outputs.worker" in c.read():
                        out.append(int(child))
            except OSError:
                pass
    return out


def highest_segment(spool_dir) -> int:
    nums = [int(n.split(".")[0]) for n in os.listdir(spool_dir) if n[:1].isdigit()]
    return max(nums, default=-1)


@pytest.mark.slow
def test_out_of_file_descriptors_the_relay_lives_and_loses_nothing(tmp_path):
    lj_port, in_port = free_port(), free_port()
    s = relay_settings(tmp_path, heartbeat_interval=3600)
    spool = tmp_path / "spool"
    extra = ["--spool-dir", str(spool), "--spool-segment-bytes", str(SEGMENT),
             "--output", f"lumberjack://127.0.0.1:{lj_port}?tls=off&window=100&timeout=5"
                         "&backoff_min=0.05&backoff_max=0.5&name=lj",
             "--input", f"courier://127.0.0.1:{in_port}?tls=off"]
    log_path = tmp_path / "relay.log"
    fig: dict = {}

    async def main():
        reader = LumberjackReader(port=lj_port)
        ctx = zmq.Context()
        log = open(log_path, "wb")
        env = dict(os.environ)
        env.pop("LOGJAM_RELAY_CONFIG", None)
        proc = peers = None
        flood: list[socket.socket] = []
        accepted: set[int] = set()
        sent = 0
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(reader.serve)
                argv = relay_argv(s, extra)
                proc = subprocess.Popen([sys.executable, "-c", _WRAP, str(LIMIT), *argv[3:]],
                                        stdout=log, stderr=log, env=env)
                await trio.to_thread.run_sync(wait_http, s.metrics_port, proc)
                # the valid client, connected before the floods
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(f"tcp://127.0.0.1:{s.router_port}")

                async def send(k: int) -> int:
                    nonlocal sent
                    nums = range(sent, sent + k)
                    sent += k
                    for n in nums:
                        await zmq_trio.send_multipart(
                            dealer, [b"", b"fd-test", b"logs.fd", BODY % n, meta()])
                    got = 0
                    with trio.fail_after(30):
                        for n in nums:
                            r = await zmq_trio.recv_multipart(dealer)
                            if r[-1] == b"202 Accepted":
                                accepted.add(n)
                                got += 1
                    return got

                await send(500)

                async def until(cond, what: str, timeout: float = 60.0) -> str:
                    """Keep the valid client sending until ``cond(metrics text)``."""
                    with trio.fail_after(timeout):
                        while True:
                            await send(50)
                            text = await trio.to_thread.run_sync(scrape, s.metrics_port)
                            if cond(text):
                                return text
                            assert proc.poll() is None, what
                            await trio.sleep(0.1)

                async def closed_around_scrape(socks):
                    """(closed as the clients see it, a scrape, closed again): a connection
                    closed at accept is counted at the latest between the two looks"""
                    before = sum(map(closed_by_peer, socks))
                    text = await trio.to_thread.run_sync(scrape, s.metrics_port)
                    return before, text, sum(map(closed_by_peer, socks))

                def refused(text, listener, reason):
                    return metric(text, "logjam_relay_fd_refused_connections_total",
                                  listener=listener, reason=reason)

                # ---- 1. silent flood
                flood += idle_connections(s.router_port, 300)
                flood += idle_connections(s.pull_port, 300)
                # as many as the limit: the input's own connections (never dropped) take the
                # last descriptors, so the rest are closed at accept (while the fd reserve
                # can spare one) or wait in the backlog, whatever the guard freed meanwhile
                in_flood = idle_connections(in_port, LIMIT)
                flood += in_flood
                flood += idle_connections(s.metrics_port, 30)
                text = await until(lambda t: refused(t, "router", "silent") > 0 and (
                    refused(t, "pull", "silent") + refused(t, "pull", "accept")) > 0, "silent")
                closed_before, text, closed_after = await closed_around_scrape(in_flood)
                fig["input_flood1"] = (closed_before,
                                       refused(text, f"input_courier-{in_port}", "accept"),
                                       closed_after)
                for c in flood:
                    c.close()
                flood.clear()
                text = await until(lambda t: metric(t, "logjam_relay_fd_paused") == 0 and
                                   metric(t, "logjam_relay_open_fds") < LIMIT // 2, "back")
                fig["flood"] = {f"{ln}/{r}": refused(text, ln, r) for ln, r in (
                    ("router", "silent"), ("router", "accept"), ("pull", "silent"),
                    ("pull", "accept"), (f"input_courier-{in_port}", "accept"),
                    ("metrics", "accept"))}
                # ---- 2. peers that hold their descriptors
                peers = subprocess.Popen(
                    [sys.executable, "-c", _PEERS, f"tcp://127.0.0.1:{s.router_port}",
                     str(PEERS)], stdout=subprocess.PIPE, env=env)
                assert (await trio.to_thread.run_sync(peers.stdout.readline)).strip() == \
                    b"ready"
                await until(lambda t: metric(t, "logjam_relay_fd_paused") == 1, "paused")
                # the guard keeps a few descriptors free by pausing ZeroMQ; idle input
                # connections (never dropped) take those: now the relay is out of them
                flood += idle_connections(in_port, 40)
                text = await until(lambda t: metric(t, "logjam_relay_open_fds") == LIMIT, "out")
                used0 = metric(text, "logjam_relay_fd_reserve_used_total")
                seg0, delivered0 = highest_segment(spool), len(reader.events)
                old = worker_pids(proc.pid)
                assert len(old) == 1
                os.kill(old[0], signal.SIGKILL)
                with trio.fail_after(60):
                    while not (len(reader.events) > delivered0 + 1000
                               and highest_segment(spool) >= seg0 + 3
                               and worker_pids(proc.pid) not in ([], old)):
                        await send(100)
                # a new input connection: closed at once unless a descriptor is free at
                # that instant (the relay hovers at the limit: counted either way)
                fig["input_closed_at_once"] = sum(
                    [await trio.to_thread.run_sync(closed_at_once, in_port, 2.0)
                     for _ in range(3)])
                closed_before, text, closed_after = await closed_around_scrape(flood)
                fig["input_flood_closed"] = (closed_before, closed_after)
                # still out while the peers stay: the count hovers (a connection closed at
                # accept, a segment rolled, frees one for a moment, and the peers' reconnects
                # take it back), so one look may fall between the two: look until it is back
                # at the limit (within what that work frees), for at most 30 s
                still = await until(lambda t: metric(t, "logjam_relay_open_fds") >= LIMIT - 8,
                                    "still out", timeout=30.0)
                fig["held"] = {
                    "open_fds": metric(still, "logjam_relay_open_fds"),
                    "paused": metric(still, "logjam_relay_fd_paused"),
                    "rolled": highest_segment(spool) - seg0,
                    "delivered": len(reader.events) - delivered0,
                    "worker_crashes": metric(text, "logjam_relay_output_crashes_total"),
                    "reserve_used": metric(text, "logjam_relay_fd_reserve_used_total") - used0,
                    "reserve_lost": metric(text, "logjam_relay_fd_reserve_lost_total"),
                    "reserve_held": metric(text, "logjam_relay_fd_reserve"),
                    "router/accept": refused(text, "router", "accept"),
                    "input/accept": refused(text, f"input_courier-{in_port}", "accept")}
                # ---- 3. the peers leave: new connections work again
                peers.kill()
                await trio.to_thread.run_sync(peers.wait)
                for c in flood:
                    c.close()
                flood.clear()
                await until(lambda t: metric(t, "logjam_relay_fd_paused") == 0 and
                            metric(t, "logjam_relay_open_fds") < LIMIT // 2, "back again")
                late = ctx.socket(zmq.DEALER)
                late.setsockopt(zmq.LINGER, 0)
                late.connect(f"tcp://127.0.0.1:{s.router_port}")
                await zmq_trio.send_multipart(late, [b"", b"fd-test", b"logs.fd",
                                                     BODY % sent, meta()])
                with trio.fail_after(10):
                    r = await zmq_trio.recv_multipart(late)
                assert r[-1] == b"202 Accepted"
                accepted.add(sent)
                sent += 1
                late.close()
                fig["input_closed_after"] = await trio.to_thread.run_sync(
                    closed_at_once, in_port, 1.0)
                with trio.fail_after(60):
                    while not accepted <= {json.loads(ev.fields["line"])["n"]
                                           for ev in reader.events}:
                        await trio.sleep(0.1)
                text = await trio.to_thread.run_sync(scrape, s.metrics_port)
                fig["refused_total"] = metric(text, "logjam_relay_fd_refused_connections_total")
                fig["reserve_used"] = metric(text, "logjam_relay_fd_reserve_used_total")
                fig["lost_metric"] = metric(text, "logjam_relay_spool_lost_records_total")
                fig["guard_looks_short"] = metric(text, "logjam_relay_fd_short_total")
                dealer.close()
                fig["rc"] = await trio.to_thread.run_sync(stop_process, proc)
                nursery.cancel_scope.cancel()
        finally:
            for c in flood:
                c.close()
            for p in (peers, proc):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
            ctx.destroy(linger=0)
            log.close()
        got = [json.loads(ev.fields["line"])["n"] for ev in reader.events]
        fig["sent"], fig["accepted"] = sent, len(accepted)
        fig["lost"] = len(accepted - set(got))
        fig["duplicates"] = len(got) - len(set(got))

    t0 = time.monotonic()
    trio.run(main)
    fig["seconds"] = round(time.monotonic() - t0, 1)
    text = log_path.read_text()
    guard_lines = [ln for ln in text.splitlines() if "logjam_relay.fdguard" in ln]
    fig["guard_log_lines"] = len(guard_lines)
    print("\n", fig)
    assert fig["rc"] == 0
    assert fig["lost"] == 0 and fig["lost_metric"] == 0, fig
    assert fig["accepted"] == fig["sent"], fig     # every request of the valid client: 202
    flood, held = fig["flood"], fig["held"]
    assert flood["router/silent"] > 0, fig
    assert flood["pull/silent"] + flood["pull/accept"] > 0, fig
    # the input's connections closed at accept are counted, and only those; how many are
    # closed depends on the fd reserve having a descriptor to spare (more than 3/4 of it
    # held) while they arrive, else they wait in the backlog: 0 to all of them were seen
    # under load (the refusal itself is tested deterministically in test_fdreserve.py)
    closed_before, counted, closed_after = fig["input_flood1"]
    assert closed_before <= counted <= closed_after, fig
    # phase 2: at the limit (within what the relay's own work frees for a moment), ZeroMQ
    # still paused, the idle input connections beyond the limit closed at once
    assert held["open_fds"] >= LIMIT - 8 and held["paused"] == 1, fig
    # each idle input connection the relay closed at accept is counted, and only those (the
    # three probes may be counted after they gave up waiting); whether any is closed depends
    # on the reserve having a descriptor to spare at that instant, else they wait
    refused2 = held["input/accept"] - flood[f"input_courier-{in_port}/accept"]
    closed_before, closed_after = fig["input_flood_closed"]
    assert closed_before + fig["input_closed_at_once"] <= refused2 <= closed_after + 3, fig
    assert held["rolled"] >= 3 and held["delivered"] > 1000, fig
    assert held["worker_crashes"] >= 1, fig
    assert fig["reserve_used"] > 0, fig              # it was out, and the reserve served
    assert fig["input_closed_after"] is False, fig   # not closed at once any more
    # rate-limited: at most 5 lines per reason (2 reasons) per 10 s, plus the summaries,
    # while the guard found too few descriptors free every 0.5 s of phase 2
    windows = int(fig["seconds"] // 10) + 1
    assert fig["guard_log_lines"] <= windows * 2 * 6, fig
    # the only tracebacks are the output's crash reports of the worker that was killed
    for m in re.finditer(r"\n(.*)\nTraceback", text):
        assert "output lj crashed" in m.group(1), m.group(1)
    assert text.count("Traceback") == text.count("WorkerDied: output worker lj")
    assert "relay failed" not in text
    assert re.search(r"dropped \d+ connection\(s\) that sent nothing", text)
