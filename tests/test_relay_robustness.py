"""Bad input never crashes or stalls the relay; SIGTERM flushes and exits 0 quickly."""

import json
import signal
import time
import urllib.request

import pytest
import trio
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay_harness import (
    meta,
    next_data,
    recv,
    relay_settings,
    running_relay,
    send,
    start_process,
    stop_process,
    sync_sub,
    unmeta,
)

GOOD = [b"good-test", b"logs.good", b'{"ok":1}', meta()]

frame = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"ping", b"good-test", b"logs.x", b"foo.bar", meta(), meta(tag=0xBDCA),
                     meta()[:23], meta(ver=7), b"\x00" * 24]),
)
frames_strategy = st.lists(frame, min_size=1, max_size=9)


async def test_random_frames_never_disturb_good_traffic(tmp_path):
    """Hypothesis-generated frame lists on ROUTER and PULL, interleaved with good messages."""
    examples = []

    @settings(max_examples=400, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(frames_strategy, st.booleans())
    def gather(frames, via_router):
        examples.append((frames, via_router))

    gather()
    async with running_relay(tmp_path) as (relay, cl):
        sub, dealer, push = cl.sub(), cl.dealer(), cl.push()
        await sync_sub(sub)
        good_sent = 0
        for i, (frames, via_router) in enumerate(examples):
            await send(dealer if via_router else push, frames)
            if i % 10 == 0:
                await send(push, GOOD)
                good_sent += 1
        # A request with a reply proves the ROUTER still answers after all of it.
        await send(dealer, [b"", *GOOD])
        with trio.fail_after(10):
            while True:
                r = await recv(dealer)
                if r == [b"good-test", b"202 Accepted"]:
                    break
        good_seen = 0
        with trio.fail_after(10):
            while good_seen < good_sent + 1:
                m = await next_data(sub)
                if m[0] == b"good-test":
                    good_seen += 1
        c = relay.pipeline.counters
        assert c.invalid > 0 and sum(c.invalid_by_reason.values()) == c.invalid
        # every published message carries a valid meta and a valid stream/topic
        assert relay.pipeline.seq >= good_sent


async def test_every_malformed_kind_is_counted_by_reason(tmp_path):
    cases = {
        "frame_count": [b"a-b", b"logs"],
        "meta_size": [b"a-b", b"logs", b"{}", meta()[:23]],
        "meta_tag": [b"a-b", b"logs", b"{}", meta(tag=0x1234)],
        "meta_version": [b"a-b", b"logs", b"{}", meta(ver=2)],
        "stream_name": [b"ab", b"logs", b"{}", meta()],
        "topic": [b"a-b", b"foo", b"{}", meta()],
    }
    async with running_relay(tmp_path) as (relay, cl):
        sub, push = cl.sub(), cl.push()
        await sync_sub(sub)
        for frames in cases.values():
            await send(push, frames)
        await send(push, GOOD)
        assert (await next_data(sub))[0] == b"good-test"
        c = relay.pipeline.counters
        assert dict(c.invalid_by_reason) == {k: 1 for k in cases}
        assert c.broken_meta == 3
        url = f"http://127.0.0.1:{cl.settings.metrics_port}/metrics"
        # the relay's HTTP server runs in this very event loop: fetch from a thread
        body = await trio.to_thread.run_sync(lambda: urllib.request.urlopen(url, timeout=5)
                                             .read().decode())
        for reason in cases:
            assert f'logjam_relay_invalid_total{{device="0",reason="{reason}"}} 1.0' in body
        assert 'logjam:device:msgs_invalid_total{device="0"} 6.0' in body


@pytest.mark.parametrize("pub_thread", ["true", "false"])
def test_sigterm_flushes_and_exits_zero(tmp_path, pub_thread):
    """PUB on its own thread (the default) or on the event loop (pub_thread = false)."""
    s = relay_settings(tmp_path, heartbeat_interval=0.2)
    proc = start_process(s, ["--pub-thread", pub_thread], log_path=tmp_path / "relay.log")
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(f"tcp://127.0.0.1:{s.pub_port}")
        deadline = time.monotonic() + 5
        while sub.recv_multipart()[0] != b"heartbeat" and time.monotonic() < deadline:
            pass
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{s.router_port}")
        n = 2000
        for i in range(n):
            dealer.send_multipart([b"", b"term-test", b"logs", b'{"i":%d}' % i, meta()])
        accepted = 0
        while accepted < n:
            if not dealer.poll(5000):
                metrics = urllib.request.urlopen(
                    f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=5).read().decode()
                lines = [x for x in metrics.splitlines() if "relay_" in x and "#" not in x]
                raise AssertionError(f"relay stopped answering after {accepted}: " +
                                     "\n".join(lines))
            if dealer.recv_multipart() == [b"term-test", b"202 Accepted"]:
                accepted += 1
        t0 = time.monotonic()
        rc = stop_process(proc, signal.SIGTERM, timeout=10)
        elapsed = time.monotonic() - t0
        assert rc == 0
        assert elapsed < 2.0, f"shutdown took {elapsed:.2f}s"
        got = 0
        while sub.poll(500):
            m = sub.recv_multipart()
            if m[0] == b"term-test":
                got += 1
        assert got == n, "every accepted message must reach PUB before exit"
        state = json.loads((tmp_path / "state" / "sequence-device-0.json").read_text())
        assert state["clean"] is True and state["sequence"] >= n
    finally:
        if proc.poll() is None:
            proc.kill()
        ctx.destroy(linger=0)


def test_restart_after_sigterm_continues_sequence(tmp_path):
    s = relay_settings(tmp_path)
    seqs = []
    for _ in range(2):
        proc = start_process(s, log_path=tmp_path / "relay.log")
        ctx = zmq.Context()
        try:
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(f"tcp://127.0.0.1:{s.router_port}")
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"again-test")
            sub.connect(f"tcp://127.0.0.1:{s.pub_port}")
            time.sleep(0.3)
            dealer.send_multipart([b"", b"again-test", b"logs", b"{}", meta()])
            assert dealer.poll(5000)
            dealer.recv_multipart()
            assert sub.poll(5000)
            seqs.append(unmeta(sub.recv_multipart()[3])[5])
        finally:
            assert stop_process(proc) == 0
            ctx.destroy(linger=0)
    assert seqs[1] > seqs[0], "a restarted relay must not start again at 1"


async def test_oversize_messages_are_refused_and_huge_frames_disconnect(tmp_path):
    """A body over max_event_bytes is answered 400 on ROUTER and dropped on PULL, counted
    as invalid/too_large, never published; a frame over zmq_max_msg_bytes makes libzmq
    drop the peer before buffering it.  Good traffic flows before and after."""
    async with running_relay(tmp_path, max_event_bytes="64KiB",
                             zmq_max_msg_bytes="256KiB") as (relay, cl):
        sub, dealer, push = cl.sub(), cl.dealer(), cl.push()
        await sync_sub(sub)
        big = [b"big-test", b"logs.big", b"x" * (100 * 1024), meta()]
        await send(dealer, [b"", *big])
        assert await recv(dealer) == [b"big-test", b"400 Bad Request"]
        await send(push, big)
        huge_dealer = cl.dealer()
        await send(huge_dealer, [b"", b"huge-test", b"logs.big", b"y" * (1024 * 1024), meta()])
        await send(dealer, [b"", *GOOD])
        assert await recv(dealer) == [b"good-test", b"202 Accepted"]
        await send(push, GOOD)
        got = [await next_data(sub), await next_data(sub)]
        assert [m[0] for m in got] == [b"good-test", b"good-test"]
        c = relay.pipeline.counters
        with trio.fail_after(5):
            while c.invalid_by_reason["too_large"] < 2:
                await trio.sleep(0.01)
        assert c.invalid_by_reason["too_large"] == 2      # the 1 MiB frame never got in
        assert c.received == 2
        with trio.move_on_after(0.5):
            r = await recv(huge_dealer, 1)
            raise AssertionError(f"a disconnected peer got a reply: {r}")
        assert c.invalid_by_reason["too_large"] == 2      # still: libzmq dropped the frame
        assert c.replies_400 == 1


def test_big_messages_queued_behind_a_full_spool_cost_their_bound_and_sigterm_exits_zero(
        tmp_path):
    """Output dead, spool full, ingress paused: 30 messages just under max_event_bytes and
    10 between max_event_bytes and MAXMSGSIZE queue up (the issue's 30 x 50 MB added 1.5 GB
    and SIGTERM died with MemoryError).  The relay holds no more than its ceiling and
    SIGTERM still exits 0."""
    from conftest import free_port
    from logjam_relay.relay import memory
    MiB = 1024 * 1024
    dead = free_port()
    s = relay_settings(tmp_path, max_event_bytes="1MiB", spool_max_bytes="4MiB",
                       spool_segment_bytes="1MiB", ingest_max_bytes="2MiB", rcv_hwm=100,
                       snd_hwm=16, outputs=[f"lumberjack://127.0.0.1:{dead}?tls=off&window=4"])
    extra = ["--max-event-bytes", "1MiB", "--spool-max-bytes", "4MiB",
             "--spool-segment-bytes", "1MiB", "--ingest-max-bytes", "2MiB", "--rcv-hwm", "100",
             "--snd-hwm", "16", "--spool-dir", str(tmp_path / "spool"), "--output",
             s.outputs[0]]
    proc = start_process(s, extra, log_path=tmp_path / "relay.log")
    ctx = zmq.Context()
    try:
        def status():
            with open(f"/proc/{proc.pid}/status") as fh:
                return {k: int(v.split()[0]) * 1024 for k, _, v in
                        (ln.partition(":") for ln in fh) if k in ("VmRSS", "VmHWM")}
        idle = status()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://127.0.0.1:{s.pull_port}")
        small = [b"big-test", b"logs.big", b"s" * (MiB - 100), meta()]
        over = [b"big-test", b"logs.big", b"o" * (3 * MiB), meta()]
        for _ in range(30):
            push.send_multipart(small)
        for _ in range(10):
            push.send_multipart(over)
        deadline = time.monotonic() + 15
        blocked = 0.0
        while time.monotonic() < deadline:       # until the spool is full and ingest waits
            text = urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics",
                                          timeout=5).read().decode()
            full = [ln for ln in text.splitlines() if ln.startswith("logjam_relay_spool_full")]
            if full and full[0].endswith(" 1.0"):
                blocked = 1.0
                break
            time.sleep(0.1)
        assert blocked, "the spool never filled"
        time.sleep(1.0)                          # what was sent is queued in the relay now
        peak = status()["VmHWM"]
        ceiling = memory.ceiling(s, baseline=idle["VmRSS"], input_peers=1)
        print(f"\nidle RSS {idle['VmRSS'] / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB while "
              f"blocked; {ceiling.describe()}")
        assert peak < ceiling.total
        rc = stop_process(proc, signal.SIGTERM, timeout=15)
        assert rc == 0, (tmp_path / "relay.log").read_text()[-2000:]
        assert "Traceback" not in (tmp_path / "relay.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        ctx.destroy(linger=0)
