"""The relay with its spool and a Lumberjack output, end to end over real sockets."""

import json
import os
import signal
import sys
import urllib.request

import trio
import zmq

from conftest import free_port
from logjam_relay.io import zmq_trio
from peers.lumberjack_reader import LumberjackReader
from relay_harness import (
    meta,
    recv,
    relay_settings,
    running_relay,
    send,
    start_process,
    stop_process,
)

BODY = b'{"action":"Spool#test","n":%d,"pad":"................................................"}'


def lj_url(port, **params):
    q = "&".join(f"{k}={v}" for k, v in {"tls": "off", "window": 50, "timeout": 5,
                                            "backoff_min": 0.05, "backoff_max": 0.3,
                                            **params}.items())
    return f"lumberjack://127.0.0.1:{port}?{q}"


async def wait_events(reader, n, timeout=30.0):
    with trio.fail_after(timeout):
        while len(reader.events) < n:
            await trio.sleep(0.02)


def numbers(reader):
    return [json.loads(ev.fields["line"])["n"] for ev in reader.events]


async def request(dealer, i):
    await send(dealer, [b"", b"spool-test", b"logs.spool", BODY % i, meta()])
    return await recv(dealer)


async def test_accepted_messages_reach_lumberjack_with_mapping(tmp_path):
    reader = LumberjackReader()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(reader.serve)
        async with running_relay(tmp_path, device_id=3, outputs=[lj_url(port)],
                                 spool_dir=str(tmp_path / "spool")) as (relay, cl):
            dealer, push = cl.dealer(), cl.push()
            for i in range(100):
                assert await request(dealer, i) == [b"spool-test", b"202 Accepted"]
            for i in range(100, 200):
                await send(push, [b"spool-test", b"logs.spool", BODY % i, meta(comp=0)])
            await wait_events(reader, 200)
            sup = relay.outputs[0]
            url = f"http://127.0.0.1:{cl.settings.metrics_port}/metrics"
            zero = f'logjam_relay_output_backlog_records{{device="3",output="{sup.name}"}} 0.0'
            # the heartbeats (every 0.2 s here) are spooled too, and the output skips each
            # one a moment later: the backlog is 0 between them, read it from /metrics then
            with trio.fail_after(10):
                while True:
                    text = await trio.to_thread.run_sync(
                        lambda: urllib.request.urlopen(url, timeout=5).read().decode())
                    if zero in text:
                        break
                    await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    assert sorted(numbers(reader)) == list(range(200))
    ev = reader.events[0].fields
    assert ev["app"] == "spool" and ev["env"] == "test" and ev["topic"] == "logs.spool"
    assert ev["device"] == "3" and ev["type"] == "logjam" and int(ev["sequence"]) > 0
    assert ev["created_ms"] == "1700000000123" and ev["host"] == "vm"
    name = sup.name
    assert f'logjam_relay_output_events_acked_total{{device="3",output="{name}"}} 200.0' in text
    assert "logjam_relay_spool_bytes" in text


async def test_upstream_outage_backlog_on_disk_then_delivered(tmp_path):
    port = free_port()
    async with running_relay(tmp_path, outputs=[lj_url(port)],
                             spool_dir=str(tmp_path / "spool")) as (relay, cl):
        dealer = cl.dealer()
        for i in range(300):
            assert (await request(dealer, i))[1] == b"202 Accepted"
        sup = relay.outputs[0]
        assert sup.reader.stats()["backlog_records"] >= 300
        reader = LumberjackReader(port=port)
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.serve)
            await wait_events(reader, 300)
            nursery.cancel_scope.cancel()
    assert sorted(set(numbers(reader))) == list(range(300))


async def test_block_policy_pauses_ingress_and_resumes(tmp_path):
    port = free_port()
    async with running_relay(tmp_path, outputs=[lj_url(port)], spool_dir=str(tmp_path / "sp"),
                             spool_max_bytes=64 * 1024, spool_segment_bytes=16 * 1024,
                             spool_policy="block", batch_size=16) as (relay, cl):
        dealer = cl.dealer()
        accepted = 0
        # upstream is down: the spool fills up and the relay stops answering
        while True:
            await send(dealer, [b"", b"spool-test", b"logs.spool", BODY % accepted, meta()])
            with trio.move_on_after(1.0) as waited:
                await zmq_trio.recv_multipart(dealer)
            if waited.cancelled_caught:
                break
            accepted += 1
        assert relay.spool.would_block()
        assert 100 < accepted < 2000
        reader = LumberjackReader(port=port)
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.serve)
            # the request that was left waiting is answered once room is made
            assert await recv(dealer, timeout=20) == [b"spool-test", b"202 Accepted"]
            accepted += 1
            await wait_events(reader, accepted)
            nursery.cancel_scope.cancel()
    assert sorted(set(numbers(reader))) == list(range(accepted))
    assert relay.spool_blocked_seconds > 0


async def test_drop_oldest_counts_lost_per_output(tmp_path):
    port = free_port()
    async with running_relay(tmp_path, outputs=[lj_url(port)], spool_dir=str(tmp_path / "sp"),
                             spool_max_bytes=64 * 1024, spool_segment_bytes=16 * 1024,
                             spool_policy="drop_oldest",
                             heartbeat_interval=3600) as (relay, cl):   # no heartbeat records
        dealer = cl.dealer()
        n = 2000
        for i in range(n):
            assert (await request(dealer, i))[1] == b"202 Accepted"
        # the output's worker reports the dropped records it skipped with its next
        # snapshot: until then they are pending (neither delivered nor lost)
        with trio.fail_after(10):
            while (st := relay.outputs[0].reader.stats())["lost_pending"]:
                await trio.sleep(0.01)
        assert st["lost"] > 0
        assert relay.spool.stats()["bytes"] <= 64 * 1024 + 16 * 1024
        reader = LumberjackReader(port=port)
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.serve)
            await wait_events(reader, n - st["lost"])
            await trio.sleep(0.3)
            nursery.cancel_scope.cancel()
    got = set(numbers(reader))
    assert len(got) == n - st["lost"]
    # drop_oldest loses a contiguous run of the oldest records, never the newest; the
    # window the output had already read before its segment was dropped may still be
    # delivered (then it is not counted as lost: acked + backlog + lost == received)
    missing = sorted(set(range(n)) - got)
    assert missing == list(range(missing[0], missing[0] + st["lost"]))
    assert got >= set(range(missing[-1] + 1, n)), "drop_oldest never loses the newest"


def test_sigkill_mid_stream_loses_nothing_accepted(tmp_path):
    """Relay killed with SIGKILL while sending; restarted; every 202-accepted message arrives."""
    port = free_port()
    s = relay_settings(tmp_path, outputs=[lj_url(port)], spool_dir=str(tmp_path / "spool"),
                       spool_fsync="batch")
    extra = ["--output", lj_url(port), "--spool-dir", str(tmp_path / "spool"),
             "--spool-fsync", "batch"]
    accepted: set[int] = set()

    async def main():
        reader = LumberjackReader(port=port, ack_delay=0.01)
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.serve)
            ctx = zmq.Context()
            i = 0
            try:
                for _round in range(2):
                    proc = await trio.to_thread.run_sync(
                        lambda: start_process(s, extra, log_path=tmp_path / "relay.log"))
                    dealer = ctx.socket(zmq.DEALER)
                    dealer.setsockopt(zmq.LINGER, 0)
                    dealer.connect(f"tcp://127.0.0.1:{s.router_port}")
                    for _ in range(1500):
                        await send(dealer, [b"", b"spool-test", b"logs", BODY % i, meta()])
                        with trio.move_on_after(5):
                            r = await zmq_trio.recv_multipart(dealer)
                            if r[1] == b"202 Accepted":
                                accepted.add(i)
                        i += 1
                        if _round == 0 and i == 1000:
                            os.kill(proc.pid, signal.SIGKILL)
                            proc.wait()
                            break
                    dealer.close()
                    if _round == 1:
                        await wait_events(reader, 0)
                        with trio.fail_after(30):
                            while not accepted <= set(numbers(reader)):
                                await trio.sleep(0.05)
                        assert stop_process(proc) == 0
            finally:
                ctx.destroy(linger=0)
            nursery.cancel_scope.cancel()
        return reader

    reader = trio.run(main)
    got = set(numbers(reader))
    assert len(accepted) >= 2000
    assert accepted <= got, f"missing upstream: {sorted(accepted - got)[:10]}"


def test_pure_python_relay_end_to_end(tmp_path):
    """LOGJAM_RELAY_PURE_PYTHON=1: none of the C twins (socket loops, spool parsing,
    Lumberjack mapping, recompression) is used; the relay does the same job: replies,
    gapless PUB with -x lz4, every message delivered upstream."""
    from logjam_relay.protocols.logjam import decode_meta, decompress
    port = free_port()
    s = relay_settings(tmp_path, outputs=[lj_url(port)], spool_dir=str(tmp_path / "spool"))
    extra = ["--output", lj_url(port), "--spool-dir", str(tmp_path / "spool"), "-x", "lz4"]

    async def main():
        reader = LumberjackReader(port=port)
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.serve)
            proc = await trio.to_thread.run_sync(
                lambda: start_process(s, extra, log_path=tmp_path / "relay.log",
                                      env_extra={"LOGJAM_RELAY_PURE_PYTHON": "1"}))
            ctx = zmq.Context()
            try:
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"spool-test")
                sub.connect(f"tcp://127.0.0.1:{s.pub_port}")
                await trio.sleep(0.5)          # slow joiner
                dealer = ctx.socket(zmq.DEALER)
                dealer.connect(f"tcp://127.0.0.1:{s.router_port}")
                push = ctx.socket(zmq.PUSH)
                push.connect(f"tcp://127.0.0.1:{s.pull_port}")
                for i in range(300):
                    await send(dealer, [b"", b"spool-test", b"logs.spool", BODY % i, meta()])
                    assert (await recv(dealer))[1] == b"202 Accepted"
                for i in range(300, 600):
                    await send(push, [b"spool-test", b"logs.spool", BODY % i, meta(comp=0)])
                published = []
                with trio.fail_after(20):
                    while len(published) < 600:
                        published.append(await zmq_trio.recv_multipart(sub))
                await wait_events(reader, 600)
                version = (await trio.run_process(
                    [sys.executable, "-m", "logjam_relay", "--version"], capture_stdout=True,
                    env={**os.environ, "LOGJAM_RELAY_PURE_PYTHON": "1"})).stdout
                assert stop_process(proc) == 0
            finally:
                ctx.destroy(linger=0)
            nursery.cancel_scope.cancel()
        return reader, published, version

    reader, published, version = trio.run(main)
    assert b"C: none" in version
    metas = [decode_meta(m[3]) for m in published]
    assert all(m.compression == 3 for m in metas)                     # -x lz4 applied
    seqs = [m.sequence for m in metas]
    assert seqs == sorted(set(seqs))            # increasing (heartbeats take numbers too)
    assert sorted(json.loads(decompress(m[2], 3))["n"] for m in published) == list(range(600))
    assert sorted(numbers(reader)) == list(range(600))
