"""Gapless per-device sequence, heartbeat/stats cadence, persistence across restarts."""

import json

import trio
import zmq

from logjam_relay.io import zmq_trio
from relay_harness import meta, recv, running_relay, send, sync_sub, unmeta


async def collect(sub, first_frame, n, timeout=60.0):
    """Receive published messages (in batches) until ``n`` start with ``first_frame``."""
    out = []
    seen = 0
    with trio.fail_after(timeout):
        while seen < n:
            batch = await zmq_trio.recv_batch(sub, 1000)
            seen += sum(m[0] == first_frame for m in batch)
            out.extend(batch)
    return out


async def test_gapless_100k_with_heartbeats(tmp_path):
    n = 100_000
    async with running_relay(tmp_path, heartbeat_interval=0.05, rcv_hwm=0) as (relay, cl):
        sub, push, dealer = cl.sub(), cl.push(), cl.dealer()
        first_hb = await sync_sub(sub)
        start_seq = unmeta(first_hb[3])[5]
        body = b'{"n":%d}'

        async def producer():
            m = meta()
            for i in range(n):
                sock = dealer if i % 10 == 0 else push
                frames = [b"seq-test", b"logs.seq", body % i, m]
                while not zmq_trio.send_multipart_nowait(sock, frames):
                    await zmq_trio.wait_for(sock, zmq.POLLOUT)
                if i % 200 == 0:
                    await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer)
            msgs = await collect(sub, b"seq-test", n)
    seqs = [unmeta(m[3])[5] for m in msgs]
    heartbeats = sum(m[0] == b"heartbeat" for m in msgs)
    assert heartbeats >= 1, "heartbeats must be interleaved with data"
    assert seqs == list(range(start_seq + 1, start_seq + 1 + len(seqs)))
    assert relay.pipeline.counters.received == n
    # DEALER async (no empty frame) and PUSH messages interleave, but each stream keeps order
    pushed = [int(m[2][5:-1]) for m in msgs if m[0] == b"seq-test"]
    from_push = [i for i in pushed if i % 10]
    assert from_push == sorted(from_push)


async def test_heartbeat_and_stats_intervals(tmp_path):
    async with running_relay(tmp_path, heartbeat_interval=0.5, stats_interval=0.25) as (r, cl):
        sub = cl.sub(b"heartbeat")
        stats = cl.sub(port=cl.settings.stats_port)
        await sync_sub(sub)
        await recv(stats)
        t_hb, t_st = [], []

        async def hb():
            for _ in range(4):
                await recv(sub)
                t_hb.append(trio.current_time())

        async def st():
            for _ in range(7):
                await recv(stats)
                t_st.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hb)
            nursery.start_soon(st)
    # the configured intervals are kept (a 2x error would fail); the tolerance is wide
    # because a loaded CI machine delays single wake-ups: this checks the setting's
    # effect, not timing precision (no speed is measured here)
    for ts, want in ((t_hb, 0.5), (t_st, 0.25)):
        gaps = sorted(b - a for a, b in zip(ts, ts[1:], strict=False))
        median = gaps[len(gaps) // 2]
        assert 0.7 * want <= median <= 1.3 * want, (gaps, want)


async def test_heartbeat_consumes_sequence_and_stats_reports_last(tmp_path):
    async with running_relay(tmp_path, heartbeat_interval=0.2, stats_interval=0.1) as (r, cl):
        sub = cl.sub()
        h1 = await sync_sub(sub)
        h2 = await sync_sub(sub)
        assert unmeta(h2[3])[5] == unmeta(h1[3])[5] + 1
        stats = cl.sub(port=cl.settings.stats_port)
        st = await recv(stats)
        assert int(st[2]) >= unmeta(h2[3])[5]


async def test_clean_restart_continues_sequence(tmp_path):
    async with running_relay(tmp_path, heartbeat_interval=0.1) as (relay, cl):
        sub, push = cl.sub(), cl.push()
        await sync_sub(sub)
        for _ in range(5):
            await send(push, [b"a-b", b"logs", b"{}", meta()])
        for _ in range(5):
            await recv(sub)
        last = relay.pipeline.seq
    state = json.loads((tmp_path / "state" / "sequence-device-0.json").read_text())
    assert state == {**state, "clean": True, "sequence": last}
    async with running_relay(tmp_path) as (relay2, cl2):
        assert relay2.pipeline.seq == last
        assert relay2.sequence_state.recovered_from == "clean"


async def test_crash_restart_never_reuses_numbers(tmp_path):
    async with running_relay(tmp_path) as (relay, cl):
        used = relay.pipeline.seq
        reserved = relay.sequence_state.reserved
        assert reserved > used
        # simulate a crash: the state file still holds the running reservation
        path = tmp_path / "state" / "sequence-device-0.json"
        crash_state = path.read_text()
    path.write_text(crash_state)
    async with running_relay(tmp_path) as (relay2, cl2):
        assert relay2.sequence_state.recovered_from == "crash"
        assert relay2.pipeline.seq >= reserved > used


async def test_pub_hwm_drops_are_counted_and_fast_subscriber_unaffected(tmp_path):
    """A subscriber that stops reading loses messages at the HWM (counted); others do not."""
    async with running_relay(tmp_path, snd_hwm=2000, batch_size=100,
                             heartbeat_interval=0.1) as (relay, cl):
        slow = cl.sub()
        slow.setsockopt(zmq.RCVHWM, 10)
        slow.setsockopt(zmq.RCVBUF, 4096)
        fast = cl.sub()
        await sync_sub(slow)
        await sync_sub(fast)
        push = cl.push()
        n = 10_000
        body = b"x" * 4000

        async def producer():
            for _ in range(n):
                await send(push, [b"drop-test", b"logs", body, meta()])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer)
            got = await collect(fast, b"drop-test", n)
        assert sum(m[0] == b"drop-test" for m in got) == n
        assert relay.pub.drops > 0


async def test_reservation_off_the_loop_never_lowers_the_bound_on_disk(tmp_path):
    """reserve_async (the ticker's reservation) writes and fsyncs in a worker thread; a
    reservation that arrives after a higher one (the ingest's, on the loop) is not written
    over it: a crash then continues above every number handed out."""
    import threading

    from logjam_relay.relay import sequence as seqmod
    st = seqmod.SequenceState(tmp_path / "seq.json", 0)
    st.acquire()
    writers = []
    real = st._write_locked

    def spy(payload):
        writers.append(threading.current_thread() is threading.main_thread())
        real(payload)

    st._write_locked = spy
    bound = await st.reserve_async(1000, rate_hint=50_000)
    assert bound == st.reserved == 201_000 and writers == [False]    # not on the loop
    assert json.loads((tmp_path / "seq.json").read_text())["reserved"] == 201_000
    st.reserve(500_000)                                   # the ingest, past the bound
    await st.reserve_async(2000)                          # an older, lower reservation
    assert json.loads((tmp_path / "seq.json").read_text())["reserved"] == 600_000
    assert st.reserved == 600_000
    st.release()
    crashed = seqmod.SequenceState(tmp_path / "seq.json", 0)
    assert crashed.load(None) == 600_001
