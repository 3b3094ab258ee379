"""Poison events through the REAL command: a refused event, bombs and a 65 MiB body never
block an output; they end in the dead-letter store, counted; good traffic flows on; the
relay's peak RSS stays bounded; ``logjam-relay deadletters list|resend`` round trip."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
import zlib

import pytest
import trio
import zmq

from conftest import free_port
from peers.courier_receiver import CourierReceiver
from peers.lumberjack_reader import LumberjackReader
from relay_harness import meta, recv, relay_settings, send, start_process, stop_process

_PROCS: list = []


def start(*args, **kwargs):
    """start_process, and the relay is killed after the test even when the test fails."""
    proc = start_process(*args, **kwargs)
    _PROCS.append(proc)
    return proc


@pytest.fixture(autouse=True)
def _reap_relays():
    yield
    while _PROCS:
        proc = _PROCS.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()

MiB = 1024 * 1024


def body(i: int) -> bytes:
    return b'{"action":"Poison#test","n":%d}' % i


def url(kind: str, port: int) -> str:
    if kind == "lumberjack":
        return (f"lumberjack://127.0.0.1:{port}?tls=off&window=20&timeout=5&backoff_min=0.05"
                f"&backoff_max=0.3&name=out")
    return (f"courier://127.0.0.1:{port}?tls=off&payload=20&timeout=5&backoff=0.05"
            f"&backoff_max=0.3&name=out")


def make_peer(kind: str, port: int, refuse: bytes | None = None):
    """The receiver, and the arguments of its serve() to listen on ``port``."""
    if kind == "lumberjack":
        return LumberjackReader(port=port, refuse=(
            lambda ev: refuse.decode() in ev.fields["line"]) if refuse else None), ()
    return CourierReceiver(refuse=(lambda ev: refuse in ev) if refuse else None), (port,)


def delivered(kind: str, peer) -> list[int]:
    if kind == "lumberjack":
        return [json.loads(e.fields["line"])["n"] for e in peer.events]
    return [json.loads(e)["payload"]["n"] for e in peer.events]


def metric(port: int, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        m = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) * 1024


def deadletters(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "logjam_relay", "deadletters", *args],
                          capture_output=True, text=True, timeout=120)


async def send_all(ctx, s, bodies) -> None:
    """Through ROUTER, each one acknowledged (202) before the next."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{s.router_port}")
    try:
        for b, comp in bodies:
            await send(dealer, [b"", b"poison-test", b"logs.poison", b, meta(comp=comp)])
            assert (await recv(dealer, timeout=30))[1] == b"202 Accepted"
    finally:
        dealer.close()


@pytest.mark.parametrize("kind", ["lumberjack", "courier"])
def test_refused_event_is_dead_lettered_and_the_rest_flows(tmp_path, kind):
    port, port2 = free_port(), free_port()
    dl = tmp_path / "dl"
    s = relay_settings(tmp_path)
    extra = ["--output", url(kind, port), "--spool-dir", str(tmp_path / "spool"),
             "--dead-letter-dir", str(dl)]
    poison = b'{"action":"Poison#test","n":-1,"venom":true}'
    # a damaged store from an earlier life must not stop the relay nor `deadletters list`:
    # a garbage file, an empty one and a directory, all with store file names
    from logjam_relay.spool import segment as seg
    dl.mkdir()
    (dl / seg.segment_name(1, sealed=True)).write_bytes(b"\x00garbage" * 10)
    (dl / seg.segment_name(2, sealed=False)).write_bytes(b"")
    (dl / seg.segment_name(3, sealed=True)).mkdir()

    async def main():
        peer, args = make_peer(kind, port, refuse=b"venom")
        async with trio.open_nursery() as nursery:
            await nursery.start(peer.serve, *args)
            proc = await trio.to_thread.run_sync(
                lambda: start(s, extra, log_path=tmp_path / "relay.log"))
            ctx = zmq.Context()
            try:
                bodies = [(body(i), 0) for i in range(10)] + [(poison, 0)] + \
                         [(body(i), 0) for i in range(10, 100)]
                t0 = time.monotonic()
                await send_all(ctx, s, bodies)
                # issue 10: good traffic after a poison event is delivered "within
                # seconds" (measured 0.4-0.6 s; the bisection costs ~2·log2(window)
                # reconnects at backoff_min, a growing backoff would take minutes)
                with trio.fail_after(20):
                    while sorted(set(delivered(kind, peer))) != list(range(100)):
                        await trio.sleep(0.05)
                took = time.monotonic() - t0
                print(f"\n{kind}: 100 good events behind a refused one delivered in "
                      f"{took:.1f} s; refusals seen by the peer: {peer.refused}")
                with trio.fail_after(10):
                    while metric(s.metrics_port, "logjam_relay_dead_letters_total",
                                 output="out", reason="refused") != 1:
                        await trio.sleep(0.1)
                assert -1 not in delivered(kind, peer)
                assert stop_process(proc) == 0
            finally:
                ctx.destroy(linger=0)
            nursery.cancel_scope.cancel()

    trio.run(main)

    r = deadletters("list", "--dir", str(dl), "--json")
    assert r.returncode == 0, r.stderr
    letters = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["reason"], x["output"], x["stream"]) for x in letters] == \
        [("refused", "out", "poison-test")]

    # resend it to a receiver that accepts it: the round trip
    async def resend():
        peer, args = make_peer(kind, port2)
        async with trio.open_nursery() as nursery:
            await nursery.start(peer.serve, *args)
            target = url(kind, port2)
            r = await trio.to_thread.run_sync(
                lambda: deadletters("resend", "--dir", str(dl), "--to", target,
                                    "--timeout", "20", "--id", letters[0]["id"]))
            nursery.cancel_scope.cancel()
        return r, peer
    r, peer = trio.run(resend)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resent 1 of 1" in r.stdout
    assert delivered(kind, peer) == [-1]


def bomb() -> bytes:
    b = zlib.compress(b"\0" * (60 * MiB), 9)           # ~61 KB that inflate to 60 MiB
    assert len(b) < 70_000
    return b


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lumberjack", "courier"])
def test_bombs_and_a_65MiB_body_are_dead_lettered_rss_bounded(tmp_path, kind):
    """Phase 1: a relay with max_event_bytes 100 MiB spools a 65 MiB body while the
    receiver is down (the ingress refuses frames over max_event_bytes, so this is how such
    a body reaches an output: a spool written under a larger limit).  Phase 2: restarted
    with the default 10 MiB, the receiver up, 8 zlib bombs (61 KB -> 60 MiB) among 60 good
    events.  Everything good arrives, the 9 bad ones are dead letters, peak RSS bounded."""
    port = free_port()
    dl = tmp_path / "dl"
    s = relay_settings(tmp_path)
    common = ["--output", url(kind, port), "--spool-dir", str(tmp_path / "spool"),
              "--dead-letter-dir", str(dl)]
    big = b'"' + b"x" * (65 * MiB) + b'"'
    result = {}

    async def phase1():
        proc = await trio.to_thread.run_sync(lambda: start(
            s, common + ["--max-event-bytes", "100MiB", "--zmq-max-msg-bytes", "200MiB"],
            log_path=tmp_path / "relay1.log"))
        ctx = zmq.Context()
        try:
            await send_all(ctx, s, [(body(1000), 0), (big, 0), (body(1001), 0)])
        finally:
            ctx.destroy(linger=0)
        assert stop_process(proc) == 0

    async def phase2():
        peer, args = make_peer(kind, port)
        async with trio.open_nursery() as nursery:
            await nursery.start(peer.serve, *args)
            proc = await trio.to_thread.run_sync(
                lambda: start(s, common, log_path=tmp_path / "relay2.log"))
            ctx = zmq.Context()
            try:
                bodies, bombs = [], 8
                for i in range(60):
                    bodies.append((body(i), 0))
                    if i % 6 == 5 and bombs:
                        bodies.append((bomb(), 1))
                        bombs -= 1
                await send_all(ctx, s, bodies)
                want = sorted([*range(60), 1000, 1001])
                with trio.fail_after(90):
                    while sorted(set(delivered(kind, peer))) != want:
                        await trio.sleep(0.05)
                    while metric(s.metrics_port, "logjam_relay_dead_letters_total",
                                 output="out", reason="too_large") < 9:
                        await trio.sleep(0.1)
                result["peak"] = peak_rss_bytes(proc.pid)
                result["lag"] = metric(s.metrics_port, "logjam_relay_loop_lag_max_seconds")
                assert stop_process(proc) == 0
            finally:
                ctx.destroy(linger=0)
            nursery.cancel_scope.cancel()

    trio.run(phase1)
    trio.run(phase2)
    letters = [json.loads(x) for x in deadletters("list", "--dir", str(dl), "--json")
               .stdout.splitlines()]
    assert sorted(x["bytes"] > 60 * MiB for x in letters) == [False] * 8 + [True]
    assert {x["reason"] for x in letters} == {"too_large"}
    peak = result["peak"]
    print(f"\n{kind}: relay peak RSS {peak / MiB:.0f} MiB delivering past a spooled 65 MiB "
          f"body and 8 zlib bombs (61 KB -> 60 MiB each); worst event-loop lag "
          f"{result['lag'] * 1000:.0f} ms (inflating runs in worker threads)")
    # the 65 MiB record is held by the spool reader and the output, and written once to
    # the dead-letter store; 8 bombs inflated at once would add 480 MiB on top
    assert peak < 400 * MiB


def test_courier_partial_ack_survives_sigkill(tmp_path):
    """The receiver acknowledged 30 events of a 100-event payload (in ACKNs of 10), took 10
    more without acknowledging them, then stalls; the relay is
    SIGKILLed and restarted: it resumes inside the payload (events 0..29 are not sent
    again), because the partial ACKN moved the spool cursor to the 30th event's record."""
    import os
    import signal
    port = free_port()
    s = relay_settings(tmp_path)
    url = (f"courier://127.0.0.1:{port}?tls=off&payload=100&timeout=30&backoff=0.05"
           f"&backoff_max=0.3&name=out")
    extra = ["--output", url, "--spool-dir", str(tmp_path / "spool")]
    seen: list[int] = []
    stall = trio.Event()

    async def main():
        async def sink(nonce, part):
            seen.extend(json.loads(e)["payload"]["n"] for e in part)
            if len(seen) >= 40 and not stall.is_set():     # 40 taken, 30 acknowledged
                await trio.sleep_forever()
        rcv = CourierReceiver(ack_chunk=10, sink=sink, store=False)
        async with trio.open_nursery() as nursery:
            await nursery.start(rcv.serve, port)
            proc = await trio.to_thread.run_sync(
                lambda: start(s, extra, log_path=tmp_path / "relay1.log"))
            ctx = zmq.Context()
            try:
                push = ctx.socket(zmq.PUSH)
                push.connect(f"tcp://127.0.0.1:{s.pull_port}")
                for i in range(100):
                    push.send_multipart([b"pack-test", b"logs.x", body(i), meta()])
                push.close(linger=5000)
                with trio.fail_after(20):
                    while len(seen) < 40:
                        await trio.sleep(0.02)
                # the cursor is persisted at least every 0.5 s (spool); let it be written
                await trio.sleep(1.5)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                rcv.kill()
            finally:
                ctx.destroy(linger=0)
            nursery.cancel_scope.cancel()
        first = list(seen)
        seen.clear()
        stall.set()
        rcv2 = CourierReceiver(sink=sink, store=False)
        async with trio.open_nursery() as nursery:
            await nursery.start(rcv2.serve, port)
            proc = await trio.to_thread.run_sync(
                lambda: start(s, extra, log_path=tmp_path / "relay2.log"))
            with trio.fail_after(20):
                while len(set(seen) | set(first)) < 100:
                    await trio.sleep(0.05)
            assert stop_process(proc) == 0
            nursery.cancel_scope.cancel()
        return first

    first = trio.run(main)
    assert first == list(range(40))
    dup = sorted(set(seen) & set(range(30)))
    print(f"\ncourier partial ACK + SIGKILL: {len(first)} delivered before the crash, "
          f"{len(seen)} after, {len(dup)} of the 30 acknowledged ones sent again")
    assert dup == [], f"acknowledged events sent again after the restart: {dup}"
    assert set(seen) | set(first) == set(range(100))
