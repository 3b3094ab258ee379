"""Group commit under ``spool_fsync = batch`` (relay/groupcommit.py, issue 25 §2).

A real relay (in-process, trio), real ZeroMQ DEALERs on loopback and a real spool on
disk.  The spool's ``sync_async`` and ``sync_begin``/``sync_end`` are watched on the
instance: a 202 may leave only once a sync that *started after* its record was appended
has *returned* (their contract: everything appended before the call started is durable
when it returns).
Every reply the relay sends is checked against that, at the moment it is sent.  The
end-to-end check against a file system that drops unsynced writes is test_powerloss.py.
"""

from __future__ import annotations

import contextlib

import trio
import zmq

from conftest import free_port, require_native
from logjam_relay.io import zmq_trio
from logjam_relay.relay.service import build
from logjam_relay.spool.errors import SpoolWriteError
from logjam_relay.spool.fsyncpolicy import FsyncPolicy
from relay_harness import Clients, meta, recv, relay_settings

APP, TOPIC = b"bench-test", b"logs.gc"


class Watch:
    """Durable records (by the sync contract) and the 202s sent, checked at each send.
    ``gate``: while it is not set, every sync waits for it before its fdatasync."""

    def __init__(self, relay, monkeypatch, fail_first: int = 0, fail_always: bool = False,
                 gate: trio.Event | None = None):
        self.relay = relay
        spool = relay.spool
        self.durable = 0              # records known to be on disk
        self.sent_202 = 0
        self.violations: list[tuple[int, int]] = []
        self.syncs = 0
        self.failures = 0
        real_sync = spool.sync_async

        async def sync_async():
            before = spool.appends           # appended before this sync started
            self.syncs += 1
            if gate is not None:
                await gate.wait()
            if fail_always or self.failures < fail_first:
                self.failures += 1
                raise SpoolWriteError("eio", "injected: fdatasync failed")
            await real_sync()
            self.durable = max(self.durable, before)

        spool.sync_async = sync_async
        real_begin, real_end = spool.sync_begin, spool.sync_end
        begun: dict[int, int] = {}         # id(job) -> appended before it started

        def sync_begin():
            if gate is not None or fail_always or fail_first:
                return None                  # through sync_async above: it can wait, fail
            before = spool.appends
            job = real_begin()
            if job is not None:
                self.syncs += 1
                begun[id(job)] = before
            return job

        async def sync_end(job):
            before = begun.pop(id(job))
            await real_end(job)
            self.durable = max(self.durable, before)

        spool.sync_begin, spool.sync_end = sync_begin, sync_end
        real_send = zmq_trio.send_replies

        def send_replies(sock, replies):
            n = sum(1 for r in replies if r[-1].startswith(b"202"))
            if n:
                self.sent_202 += n
                # the k-th 202 answers the k-th record (one client stream, no heartbeats)
                if self.sent_202 > self.durable:
                    self.violations.append((self.sent_202, self.durable))
            return real_send(sock, replies)

        monkeypatch.setattr(zmq_trio, "send_replies", send_replies)


@contextlib.asynccontextmanager
async def batch_relay(tmp_path, monkeypatch, inputs=(), delay: float = 0.0,
                      segment_bytes: int = 64 << 20, **watch):
    settings = relay_settings(tmp_path, spool_dir=str(tmp_path / "spool"),
                              spool_fsync="batch", heartbeat_interval=3600,
                              metrics_port=0, inputs=list(inputs),
                              spool_fsync_batch_delay=delay,
                              spool_segment_bytes=segment_bytes)
    relay = build(settings)
    w = Watch(relay, monkeypatch, **watch)
    ctx = zmq.Context()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(relay.run)
            yield relay, Clients(ctx, settings), w
            relay.shutdown()
            with trio.fail_after(30):
                await relay.stopped.wait()
    finally:
        ctx.destroy(linger=0)


def _thread_syncs(relay) -> int | None:
    """The syncs the spool's C thread did (syncthread.py), None where it is not in use
    (not built, switched off); CI builds it, so there it must be in use."""
    import os

    from logjam_relay.spool import syncthread
    if syncthread.OFF_REASON:
        assert not os.environ.get("CI") or syncthread.OFF_REASON.startswith(
            "LOGJAM_RELAY_"), syncthread.OFF_REASON
        return None
    st = relay.spool.writer.sync_thread
    assert st is not None
    return st.jobs


def request(i: int) -> list[bytes]:
    return [b"", APP, TOPIC, b'{"n":%d,"pad":"%s"}' % (i, b"x" * 200), meta(seq=i + 1)]


async def load(dealer: zmq.Socket, n: int, got: list, window: int = 500) -> None:
    """Send n requests asynchronously (at most ``window`` unanswered), collect replies."""
    sent = 0
    answered = 0
    while answered < n:
        while sent < n and sent - answered < window:
            await zmq_trio.send_multipart(dealer, request(sent))
            sent += 1
        with trio.fail_after(30):
            frames = await zmq_trio.recv_multipart(dealer)
        got.append(frames[-1])
        answered += 1


async def test_202s_leave_only_after_the_fdatasync_that_covers_them(tmp_path, monkeypatch):
    n, clients = 4000, 4
    async with batch_relay(tmp_path, monkeypatch) as (relay, c, w):
        dealers = [c.dealer() for _ in range(clients)]
        got: list[list[bytes]] = [[] for _ in dealers]
        async with trio.open_nursery() as nursery:
            for d, g in zip(dealers, got, strict=True):
                nursery.start_soon(load, d, n, g)
        commits = relay.commits
        st = commits.stats()
        spool_fsyncs = relay.spool.fsyncs
        thread_syncs = _thread_syncs(relay)
    appended = relay.spool.appends
    assert all(g == [b"202 Accepted"] * n for g in got)      # every message answered
    assert w.violations == [], w.violations[:5]
    assert w.sent_202 == n * clients
    assert st["released"] == n * clients and st["pending"] == 0
    # grouped: far fewer syncs than replies (each sync answered many messages)
    assert 1 <= spool_fsyncs <= w.syncs < n * clients
    assert st["largest_group"] > 1, st
    assert thread_syncs is None or thread_syncs == spool_fsyncs   # all in the C thread
    # the segments hold every record the spool counted, numbered without a gap
    # (scan_segment checks the numbers inside a segment; here they go on from one segment
    # to the next)
    from logjam_relay.spool import segment as fmt
    segs = sorted(p for p in (tmp_path / "spool").iterdir() if p.suffix in (".seg", ".open"))
    scans = [fmt.scan_segment(p) for p in segs]
    assert scans and all(r.error is None and r.cut_bytes == 0 for r in scans), scans
    assert all(a.next_seq == b.header.first_seq for a, b in zip(scans, scans[1:], strict=False))
    assert sum(r.records for r in scans) == appended >= n * clients


async def test_202s_go_on_across_rolls_without_the_seals_worker_threads(tmp_path,
                                                                        monkeypatch):
    """Issue 44: the round after a segment roll waited for the closed segment's seal record
    and the directory's fsync, done in trio's worker threads; each of their hand-backs
    needs the GIL, which a busy event loop holds (5 ms a switch), so every roll cost the
    202s ~100 ms at 100k msg/s, one message per ingest pass.  Here no worker thread can
    run at all (the default thread limiter's only token is taken): the rounds still answer
    across several rolls -- their syncs (the closed segment's records, the new segment's,
    the directory) are one job of the C sync thread -- while the seals wait.  Before, the
    first round after the first roll never returned."""
    from logjam_relay.spool import syncthread
    require_native(syncthread._c, "logjam_relay.spool._syncthread")
    n = 1200                                        # ~330 KB of records: several rolls
    async with batch_relay(tmp_path, monkeypatch, segment_bytes=64 << 10) as (relay, c, w):
        writer = relay.spool.writer
        dealer = c.dealer()
        got: list[bytes] = []
        await load(dealer, 10, got)                 # the first segment exists
        limiter = trio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = 1
        holder = object()
        with trio.fail_after(30):                   # a worker in flight (the spare) ends
            await limiter.acquire_on_behalf_of(holder)
        try:
            jobs = writer.sync_thread.jobs
            await load(dealer, n, got)              # fails (30 s without a reply) before
            rolled = [j for j in writer.sealing if not j.seg.sealed]
            assert len(rolled) >= 2, writer.sealing     # rolls whose seals are held
            assert writer.sync_thread.jobs > jobs
        finally:
            limiter.release_on_behalf_of(holder)
            limiter.total_tokens = 40
        with trio.fail_after(30):                   # the seals go on now
            while writer.sealing:
                await trio.sleep(0.01)
    assert got == [b"202 Accepted"] * (n + 10)
    assert w.violations == [], w.violations[:5]


async def test_batch_delay_spaces_the_rounds(tmp_path, monkeypatch):
    """spool_fsync_batch_delay: a round starts at most once per delay, what arrives
    meanwhile joins it; every message is answered, never before its sync.  Four clients
    with 50 requests in flight each: with a 50 ms delay the rounds (their starts, taken
    where a round begins: its appends) are 50 ms apart or more; without it some are
    closer (the control: the measurement can see a shorter gap)."""
    gaps: dict[float, list[float]] = {}
    for delay in (0.05, 0.0):
        async with batch_relay(tmp_path / f"d{delay}", monkeypatch, delay=delay) as (
                relay, c, w):
            commits = relay.commits
            assert commits.min_round == delay
            starts: list[float] = []
            real_write = commits._write

            def write(real_write=real_write, starts=starts):
                starts.append(trio.current_time())
                real_write()
            monkeypatch.setattr(commits, "_write", write)
            dealers = [c.dealer() for _ in range(4)]
            got: list[list[bytes]] = [[] for _ in dealers]
            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                for d, g in zip(dealers, got, strict=True):
                    nursery.start_soon(load, d, 600, g, 50)
            took = trio.current_time() - t0
        assert all(g == [b"202 Accepted"] * 600 for g in got)
        assert w.violations == [], w.violations[:5]
        gaps[delay] = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        assert len(gaps[delay]) >= 5, len(starts)
        if delay:
            # trio's clock: a wait ends at its deadline or later, never before
            assert min(gaps[delay]) >= delay, sorted(gaps[delay])[:5]
            assert len(starts) <= took / delay + 2, (len(starts), took)
    assert min(gaps[0.0]) < 0.05, sorted(gaps[0.0])[:5]


async def test_a_failing_fdatasync_holds_the_202s_back_until_one_succeeds(tmp_path,
                                                                            monkeypatch):
    async with batch_relay(tmp_path, monkeypatch, fail_first=3) as (relay, c, w):
        dealer = c.dealer()
        got: list[bytes] = []
        await load(dealer, 50, got, window=50)
        failures = relay.spool_write_failures
        pending = relay.commits.pending
    assert got == [b"202 Accepted"] * 50
    assert w.failures == 3 and failures == 3
    assert w.violations == [] and pending == 0


async def test_shutdown_with_a_failing_fdatasync_withholds_every_202(tmp_path, monkeypatch):
    async with batch_relay(tmp_path, monkeypatch, fail_always=True) as (relay, c, w):
        dealer = c.dealer()
        for i in range(20):
            await zmq_trio.send_multipart(dealer, request(i))
        with trio.fail_after(30):        # spooled, not answered; the ingest pauses meanwhile
            while relay.spool.appends < 1 or w.failures < 2:
                await trio.sleep(0.01)
        assert relay.commits.pending == relay.spool.appends > 0
        assert relay.commits.would_block()
    # the shutdown drains the socket: the rest is spooled too, then the sync fails again
    assert w.sent_202 == 0            # not one 202 for a record that never reached the disk
    assert relay.commits.withheld == 20 and relay.commits.pending == 0


async def test_nothing_is_acknowledged_while_the_fdatasync_has_not_returned(tmp_path,
                                                                            monkeypatch):
    """DEALER requests and a Lumberjack window (the input ACKs through the same rounds):
    handed in, but while the sync is held nothing more is written to the segment and not
    one 202 nor the ACK leaves; released, all do."""
    from logjam_relay.protocols import lumberjack_server as ljs
    from relay_harness import nothing_within

    gate = trio.Event()
    lport = free_port()
    async with batch_relay(tmp_path, monkeypatch, gate=gate,
                           inputs=[f"lumberjack://127.0.0.1:{lport}?tls=off"]) as (relay, c, w):
        dealer = c.dealer()
        for i in range(10):
            await zmq_trio.send_multipart(dealer, request(i))
        stream = await trio.open_tcp_stream("127.0.0.1", lport)
        docs = [b'{"message":"line %d"}' % i for i in range(5)]
        await stream.send_all(ljs.encode_window_v2(docs))
        with trio.fail_after(30):           # all 15 records handed to the group commit,
            # and a round's sync started (held at the gate; on a loaded machine the round
            # may start after the records are handed in)
            while relay.commits.pending_records < 15 or w.syncs < 1:
                await trio.sleep(0.01)
        appended = relay.spool.appends      # (what the held round wrote before its sync)
        assert await nothing_within(dealer, 0.3)
        early = b""
        with trio.move_on_after(0.2):
            while True:
                early += await stream.receive_some(100)
        # only keepalives (ACK of sequence 0, every ack_interval) while the window waits
        assert early == b"2A\x00\x00\x00\x00" * (len(early) // 6), early
        assert w.sent_202 == 0
        assert relay.spool.appends == appended      # nothing written while a sync runs
        gate.set()
        got = [await recv(dealer, 30) for _ in range(10)]
        acks = b""
        with trio.fail_after(30):
            while b"2A\x00\x00\x00\x05" not in acks:
                acks += await stream.receive_some(100)
        await stream.aclose()
    assert [g[-1] for g in got] == [b"202 Accepted"] * 10
    assert acks.replace(b"2A\x00\x00\x00\x00", b"") == b"2A\x00\x00\x00\x05"
    assert w.violations == []


async def test_when_the_rounds_end_no_one_waits_forever(tmp_path):
    """The group commit's task cancelled mid-sync (the relay's nursery ends): an input
    waiting in commit() under a shield gets False, a waiting 202 is withheld, a 400 of the
    same batch still leaves; what is handed in afterwards does not wait either."""
    from logjam_relay.relay.groupcommit import GroupCommit
    from logjam_relay.spool.spool import Spool

    sp = Spool(tmp_path / "sp", readers=["a"], fsync=FsyncPolicy("batch", off_loop=True))
    gate = trio.Event()
    real_sync = sp.sync_async
    syncing = trio.Event()

    async def held_sync():
        syncing.set()
        await gate.wait()
        await real_sync()
    sp.sync_async = held_sync
    sp.sync_begin = lambda: None                    # every round through held_sync
    sent: list = []
    gc = GroupCommit(sp, lambda sock, replies: sent.extend(replies))
    results: list = []

    async def input_waits():
        with trio.CancelScope(shield=True):
            results.append(await gc.commit([[APP, TOPIC, b'{"n":2}', meta()]]))

    async with trio.open_nursery() as outer:
        with trio.CancelScope() as rounds:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gc.run)
                gc.submit("sock", [["id", APP, b"202 Accepted"], ["id", APP, b"400 Bad"]],
                          records=[[APP, TOPIC, b'{"n":1}', meta()]])
                with trio.fail_after(10):
                    await syncing.wait()            # the first batch is written, syncing
                outer.start_soon(input_waits)
                with trio.fail_after(10):
                    while gc.pending_records < 2:
                        await trio.sleep(0.01)
                assert sent == [] and gc.pending == 2 and sp.appends == 1
                rounds.cancel()
        with trio.fail_after(10):
            while not results:
                await trio.sleep(0.01)
    assert results == [False] and gc.ended
    assert sent == [["id", APP, b"400 Bad"]] and gc.withheld == 1 and gc.pending == 0
    gc.submit("sock", [["id", APP, b"202 Accepted"]], records=[[APP, TOPIC, b"{}", meta()]])
    assert gc.withheld == 2 and await gc.durable() is False
    sp.close()


async def test_a_batch_delay_without_batch_says_it_has_no_effect(tmp_path, caplog):
    """spool_fsync_batch_delay spaces the group commit's rounds: with spool_fsync =
    "interval", or without a spool, it does nothing, and the start-up log says so (once,
    with where the value came from); with "batch" it says nothing."""
    said = {}
    for name, extra in (("interval", {"spool_dir": str(tmp_path / "i"),
                                      "spool_fsync": "interval"}),
                        ("nospool", {}),
                        ("batch", {"spool_dir": str(tmp_path / "b"), "spool_fsync": "batch"})):
        settings = relay_settings(tmp_path / name, heartbeat_interval=3600, metrics_port=0,
                                  spool_fsync_batch_delay=0.002, **extra)
        settings.sources["spool_fsync_batch_delay"] = "relay.toml"
        caplog.clear()
        relay = build(settings)
        async with trio.open_nursery() as nursery:
            await nursery.start(relay.run)
            relay.shutdown()
            with trio.fail_after(30):
                await relay.stopped.wait()
        said[name] = [r.getMessage() for r in caplog.records
                      if "spool_fsync_batch_delay" in r.getMessage()]
    assert said["interval"] == [
        'spool_fsync_batch_delay (file relay.toml) = 0.002s has no effect: it spaces the '
        'group commit\'s rounds, which run only with a spool and spool_fsync = "batch" '
        '(here: spool_fsync = "interval")'], said
    assert len(said["nospool"]) == 1 and said["nospool"][0].endswith("(here: no spool_dir)")
    assert said["batch"] == []


async def test_the_fdatasync_histogram_counts_every_sync(tmp_path, monkeypatch):
    """/metrics' logjam_relay_spool_fdatasync_seconds: one observation per fdatasync of the
    records (here the group commit's, from the C sync thread), cumulative buckets."""
    import re

    from prometheus_client import generate_latest

    from logjam_relay.health.metrics import make_registry
    async with batch_relay(tmp_path, monkeypatch) as (relay, c, w):
        got: list[bytes] = []
        await load(c.dealer(), 300, got, window=50)
        registry, _ = make_registry(relay)
        text = generate_latest(registry).decode()
        fsyncs = relay.spool.fsyncs
        thread_syncs = _thread_syncs(relay)
    assert got == [b"202 Accepted"] * 300
    name = "logjam_relay_spool_fdatasync_seconds"
    assert f"# TYPE {name} histogram" in text
    buckets = [(le, float(v)) for le, v in
               re.findall(name + r'_bucket\{device="[^"]*",le="([^"]+)"\} (\S+)', text)]
    count = float(re.search(name + r"_count\{[^}]*\} (\S+)", text).group(1))
    total = float(re.search(name + r"_sum\{[^}]*\} (\S+)", text).group(1))
    # (no segment was sealed here: every fsync was one of the records')
    assert fsyncs >= 1 and count == fsyncs, (count, fsyncs)
    assert thread_syncs is None or thread_syncs == count
    assert buckets[-1] == ("+Inf", count) and len(buckets) == 15
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    assert 0 < total < 60 * count


async def test_a_rounds_replies_leave_while_the_next_sync_runs_and_despite_its_failure(
        tmp_path):
    """The replies of a round whose sync returned while more was handed in leave after the
    next round's sync started (``sync_begin``), before it returns; when that next round
    cannot start (here ``sync_begin`` fails) they still leave -- they are on disk --, and
    the next round's 202s only once a retried sync covers them.  (Without the C sync
    thread ``sync_begin`` never starts a sync and the rounds are as before: nothing of
    this to test; CI builds the thread, and there it must be in use.)"""
    import os

    import pytest

    from logjam_relay.relay.groupcommit import GroupCommit
    from logjam_relay.spool import syncthread
    from logjam_relay.spool.spool import Spool
    if syncthread.OFF_REASON:
        assert not os.environ.get("CI") or syncthread.OFF_REASON.startswith(
            "LOGJAM_RELAY_"), syncthread.OFF_REASON
        pytest.skip(f"no C sync thread: {syncthread.OFF_REASON}")

    sp = Spool(tmp_path / "sp", readers=["a"], fsync=FsyncPolicy("batch", off_loop=True))
    real_begin, real_end = sp.sync_begin, sp.sync_end
    log: list = []
    hold: list[trio.Event] = []              # while set: the next sync_end waits for it
    fail_next_begin = [False]

    def sync_begin():
        if fail_next_begin[0]:
            fail_next_begin[0] = False
            log.append("begin failed")
            raise SpoolWriteError("eio", "injected: no descriptor for the sync")
        log.append(("begin", sp.appends))
        return real_begin()

    async def sync_end(job):
        if hold:
            await hold.pop().wait()
        await real_end(job)
        log.append(("end", sp.appends))

    async def until(item):
        with trio.fail_after(10):
            while item not in log:
                await trio.sleep(0.005)

    sp.sync_begin, sp.sync_end = sync_begin, sync_end
    gc = GroupCommit(sp, lambda sock, replies: log.extend(r[-1] for r in replies))
    rec = [[APP, TOPIC, b'{"n":1}', meta()]]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gc.run)
        for n, (first, second) in enumerate([(b"202 one", b"202 two"),
                                             (b"202 three", b"202 four")]):
            gate = trio.Event()
            hold.append(gate)
            gc.submit("s", [["id", first]], records=rec)
            await until(("begin", 2 * n + 1))             # its sync runs, held
            gc.submit("s", [["id", second]], records=rec)  # waits for the next round
            if n == 1:
                fail_next_begin[0] = True                 # the next round cannot start
            gate.set()
            await until(second)
        nursery.cancel_scope.cancel()
    # round 2 began before round 1's reply left, and that left before round 2 ended
    assert log[:4] == [("begin", 1), ("end", 1), ("begin", 2), b"202 one"], log
    assert log.index(b"202 one") < log.index(("end", 2)) < log.index(b"202 two"), log
    # round 4's begin failed: round 3's reply left all the same, round 4's after the retry
    assert log[log.index(("end", 3)):][:2] == [("end", 3), "begin failed"], log
    assert log.index(b"202 three") < log.index(("begin", 4)), log
    assert log.index(("end", 4)) < log.index(b"202 four"), log
    assert gc.sync_failures == 1 and gc.withheld == 0
    sp.close()


async def test_the_group_commit_on_metrics(tmp_path, monkeypatch):
    """/metrics under spool_fsync=batch: rounds, the replies sent after their fdatasync,
    none waiting at the end, and the wait histogram with one observation per batch of
    replies (between 1 and 300 of them here), each no longer than the test itself."""
    import re

    from prometheus_client import generate_latest

    from logjam_relay.health.metrics import make_registry
    async with batch_relay(tmp_path, monkeypatch) as (relay, c, w):
        got: list[bytes] = []
        t0 = trio.current_time()
        await load(c.dealer(), 300, got, window=50)
        took = trio.current_time() - t0
        text = generate_latest(make_registry(relay)[0]).decode()
        rounds = relay.commits.rounds
    assert got == [b"202 Accepted"] * 300 and w.violations == []

    def value(name: str) -> float:
        return float(re.search(name + r'\{device="[^"]*"\} (\S+)', text).group(1))
    assert value("logjam_relay_group_commit_replies_total") == 300
    assert 1 <= value("logjam_relay_group_commit_rounds_total") == rounds <= 300
    assert value("logjam_relay_group_commit_waiting_replies") == 0
    assert value("logjam_relay_group_commit_waiting_records") == 0
    assert value("logjam_relay_group_commit_failures_total") == 0
    assert value("logjam_relay_group_commit_withheld_total") == 0
    name = "logjam_relay_group_commit_wait_seconds"
    assert f"# TYPE {name} histogram" in text
    count = value(name + "_count")
    assert rounds <= count <= 300
    assert 0 < value(name + "_sum") <= count * took
    inf = float(re.search(name + r'_bucket\{device="[^"]*",le="\+Inf"\} (\S+)', text).group(1))
    assert inf == count


async def test_no_group_commit_metrics_without_batch(tmp_path):
    """Without spool_fsync=batch there is no group commit, and /metrics says nothing of it."""
    from prometheus_client import generate_latest

    from logjam_relay.health.metrics import make_registry
    settings = relay_settings(tmp_path, spool_dir=str(tmp_path / "spool"),
                              spool_fsync="interval", metrics_port=0)
    relay = build(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(relay.run)
        text = generate_latest(make_registry(relay)[0]).decode()
        relay.shutdown()
        with trio.fail_after(30):
            await relay.stopped.wait()
    assert "logjam_relay_spool_fdatasync_seconds" in text
    assert "group_commit" not in text


async def test_a_finished_sync_is_seen_before_its_round_takes_it(tmp_path):
    """``sync_ready``/``round_ready`` (the C thread's ``done``): false while the
    fdatasync runs or when nothing is in flight, true once it is done and until the round
    takes the result; ``yield_to_round`` never holds the ingest longer than about 2 ms."""
    from logjam_relay.relay.groupcommit import GroupCommit
    from logjam_relay.spool import syncthread
    from logjam_relay.spool.spool import Spool

    sp = Spool(tmp_path / "sp", readers=["a"], fsync=FsyncPolicy("batch", off_loop=True))
    gc = GroupCommit(sp, lambda sock, replies: None)
    assert not gc.round_ready()
    t0 = trio.current_time()
    with trio.fail_after(5):
        await gc.yield_to_round()               # no round: back after its 2 ms at most
    assert trio.current_time() - t0 < 1.0
    sp.append_batch([[APP, TOPIC, b'{"n":1}', meta()]])
    job = sp.sync_begin()
    if syncthread.OFF_REASON:                   # no C thread: sync_async does it all
        assert job is None
        sp.close()
        return
    assert job is not None and job.fd >= 0
    with trio.fail_after(10):
        while not sp.sync_ready(job):
            await trio.sleep(0.001)
    assert sp.sync_ready(job)                   # stays so until taken
    await sp.sync_end(job)
    assert not sp.writer.sync_thread.done() and sp.writer.unsynced is False
    sp.close()


async def test_a_round_that_fills_the_spool_pauses_ingress_at_once(tmp_path, monkeypatch):
    """``spool_policy=block`` under ``batch``: the group commit appends after the ingest
    handed the batch in, so the ingest's own "spool full?" check came too early; the round
    that fills the spool now wakes the resting ingest, which pauses (the warning, the
    paused time counted) without waiting for another message -- as without the group
    commit.  One message bigger than the 16 KiB spool, one batch, nothing after it."""
    settings = relay_settings(tmp_path, spool_dir=str(tmp_path / "spool"),
                              spool_fsync="batch", spool_policy="block",
                              spool_max_bytes=16 << 10, spool_segment_bytes=4 << 10,
                              heartbeat_interval=3600, metrics_port=0,
                              outputs=["lumberjack://127.0.0.1:1?tls=off&name=down"])
    relay = build(settings)
    Watch(relay, monkeypatch)
    ctx = zmq.Context()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(relay.run)
            push = Clients(ctx, settings).push()
            await zmq_trio.send_multipart(
                push, [APP, TOPIC, b'{"pad":"%s"}' % (b"x" * (20 << 10)), meta(seq=1)])
            with trio.fail_after(20):
                while relay.spool.appends < 1:
                    await trio.sleep(0.01)
                while relay.spool.blocked_in_progress() <= 0.2:
                    await trio.sleep(0.01)
            assert relay.spool.would_block()
            relay.shutdown()
            with trio.fail_after(30):
                await relay.stopped.wait()
    finally:
        ctx.destroy(linger=0)
    assert relay.spool_writes.blocked_seconds > 0.2
