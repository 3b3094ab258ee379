"""Outputs in worker processes (output_isolation = "process", outputs/worker.py).

The relay keeps the spool and each output's cursor; a worker process runs the unchanged
output class on records shipped to it and sends its acknowledgements back.  Checked
over real sockets with the in-repo Lumberjack reader and Courier receiver: everything
accepted arrives, the cursor moves, stats/metrics come from the worker, a SIGKILLed
worker is restarted from the acknowledged cursor without losing anything, and a
SIGTERMed relay stops its workers and persists the cursor.
"""

import json
import os
import signal
import urllib.request

import pytest
import trio
import trio.testing
import zmq

from conftest import free_port
from logjam_relay.outputs.ackgate import ConfirmedReader
from logjam_relay.outputs.worker import ProcessOutput
from logjam_relay.outputs.worker_process import RemoteSource
from logjam_relay.spool.api import Position
from peers.courier_receiver import CourierReceiver
from peers.lumberjack_reader import LumberjackReader
from relay_harness import meta, relay_settings, running_relay, send, start_process, stop_process

BODY = b'{"action":"Worker#test","n":%d,"pad":"........................................"}'


def lj_url(port, **params):
    q = "&".join(f"{k}={v}" for k, v in {"tls": "off", "window": 100, "timeout": 5,
                                            "backoff_min": 0.05, "backoff_max": 0.3,
                                            "name": "lj", **params}.items())
    return f"lumberjack://127.0.0.1:{port}?{q}"


def numbers(reader):
    return [json.loads(ev.fields["line"])["n"] for ev in reader.events]


async def push_n(push, start, n):
    for i in range(start, start + n):
        await send(push, [b"worker-test", b"logs.worker", BODY % i, meta()])


async def until(pred, timeout=30.0):
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.02)


# ------------------------------------------------------------------- RemoteSource


async def test_remote_source_keeps_until_acked_and_rewinds():
    sent = []
    src = RemoteSource("x", sent.append)
    src.add(1, [0] * 6, [[b"a", b"t", b"%d" % i, b"m"] for i in range(6)])
    src.add(2, [0] * 4, [[b"a", b"t", b"%d" % i, b"m"] for i in range(6, 10)])
    first = src.read(4)
    assert [r.frames[2] for r in first] == [b"0", b"1", b"2", b"3"]
    assert first[0].position == Position(1, 0)
    src.read(3)
    src.ack(first[-1].position)                 # 0..3 done
    assert sent == [Position(1, 3)]
    src.rewind()                                # reconnect: from the first unacked (4)
    assert [r.frames[2] for r in src.read(100)] == [b"%d" % i for i in range(4, 10)]
    assert src.read(5) == []
    src.ack(Position(2, 3))
    assert src.stats()["worker_buffered"] == 0
    src.ack(Position(2, 3))                     # nothing new: not sent again
    assert len(sent) == 2


async def test_confirmed_reader_reads_on_only_within_the_unconfirmed_acks():
    """outputs/ackgate.py: a worker's output gets new records only while at most
    ``limit`` of its acks are unconfirmed by the relay; acks themselves always go out,
    and a confirmation wakes an output waiting for records."""
    gate = ConfirmedReader(limit=2)
    sent = []

    def send_ack(pos):
        sent.append(pos)
        gate.sent += 1                          # as worker_main's send_ack counts them
    src = RemoteSource("x", send_ack)
    gate.source = src
    src.add(1, [0] * 10, [[b"a", b"t", b"%d" % i, b"m"] for i in range(10)])
    for _ in range(3):                          # three windows of one record, acked
        (rec,) = gate.read(1)
        gate.ack(rec.position)
    assert len(sent) == 3 and gate.stats()["worker_acks_unconfirmed"] == 3
    assert gate.read(1) == []                   # 3 > 2 unconfirmed: nothing new
    assert gate.stats()["worker_reads_held"] == 1
    woke = []

    async def output():
        await gate.wait()
        woke.append(gate.read(1))
    async with trio.open_nursery() as n:
        n.start_soon(output)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == []                       # records there, but the gate is shut
        gate.confirm(1)                         # 2 unconfirmed: reads again
        await trio.testing.wait_all_tasks_blocked()
    assert [r.frames[2] for r in woke[0]] == [b"3"]
    gate.confirm(0)                             # an older count changes nothing
    assert gate.confirmed == 1
    assert gate.name == "x"                     # anything else is the source's


# ---------------------------------------------------------------- relay, end to end


async def test_both_outputs_in_workers_deliver_everything(tmp_path):
    reader = LumberjackReader()
    receiver = CourierReceiver(store=True)
    async with trio.open_nursery() as nursery:
        lport = await nursery.start(reader.serve)
        cport = await nursery.start(receiver.serve)
        outputs = [lj_url(lport),
                   f"courier://127.0.0.1:{cport}?tls=off&payload=200&name=co"]
        async with running_relay(tmp_path, outputs=outputs, output_isolation="process",
                                 spool_dir=str(tmp_path / "spool")) as (relay, cl):
            push = cl.push()
            await push_n(push, 0, 3000)
            await until(lambda: len(reader.events) >= 3000 and receiver.events_delivered >= 3000)
            sups = {s.name: s for s in relay.outputs}
            await until(lambda: all(s.reader.stats()["backlog_records"] == 0
                                    and s.stats().get("events_acked") == 3000
                                    for s in sups.values()))
            pids = {s.output.pid for s in sups.values()}
            assert len(pids) == 2 and os.getpid() not in pids
            url = f"http://127.0.0.1:{cl.settings.metrics_port}/metrics"
            text = await trio.to_thread.run_sync(
                lambda: urllib.request.urlopen(url, timeout=5).read().decode())
            push.close()
        nursery.cancel_scope.cancel()
    assert sorted(numbers(reader)) == list(range(3000))           # once each, no gap
    assert receiver.events_delivered == 3000
    for name in ("lj", "co"):
        assert f'logjam_relay_output_events_acked_total{{device="0",output="{name}"}} 3000.0' \
            in text
        assert f'logjam_relay_output_connected{{device="0",output="{name}"}} 1.0' in text
    for s in sups.values():                                       # workers stopped
        with pytest.raises(ProcessLookupError):
            os.kill(s.output.pid, 0)


async def test_sigkilled_worker_is_restarted_without_loss(tmp_path):
    reader = LumberjackReader(ack_delay=0.02)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(reader.serve)
        async with running_relay(tmp_path, outputs=[lj_url(port)], output_isolation="process",
                                 spool_dir=str(tmp_path / "spool")) as (relay, cl):
            push = cl.push()
            await push_n(push, 0, 2000)
            sup = relay.outputs[0]
            await until(lambda: len(reader.events) >= 300)
            first_pid = sup.output.pid
            os.kill(first_pid, signal.SIGKILL)
            await push_n(push, 2000, 1000)
            await until(lambda: sup.crashes == 1 and sup.output.pid != first_pid)
            await until(lambda: set(numbers(reader)) >= set(range(3000)))
            await until(lambda: sup.reader.stats()["backlog_records"] == 0)
            push.close()
        nursery.cancel_scope.cancel()
    got = numbers(reader)
    assert set(got) == set(range(3000))         # nothing lost
    dup = len(got) - 3000                       # only what was in flight at the kill
    assert 0 <= dup <= 20_000
    assert sup.starts == 2 and "exited with status -9" in sup.last_error


def test_sigterm_stops_workers_and_keeps_the_cursor(tmp_path):
    """The real command: SIGTERM ends the relay and its workers (exit 0); a restart
    delivers only what was not acknowledged before (nothing twice, nothing lost)."""
    port = free_port()
    spool = str(tmp_path / "spool")
    s = relay_settings(tmp_path, outputs=[lj_url(port)], spool_dir=spool)
    # a budget that a loaded machine keeps: the graceful stop is what is tested here
    extra = ["--output", lj_url(port), "--spool-dir", spool, "--output-isolation", "process",
             "--shutdown-timeout", "6"]

    async def main():
        reader = LumberjackReader(port=port)
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.serve)
            ctx = zmq.Context()
            try:
                for rnd in range(2):
                    proc = await trio.to_thread.run_sync(
                        lambda: start_process(s, extra, log_path=tmp_path / "relay.log"))
                    kids = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
                    push = ctx.socket(zmq.PUSH)
                    push.setsockopt(zmq.LINGER, 1000)
                    push.connect(f"tcp://127.0.0.1:{s.pull_port}")
                    await push_n(push, rnd * 1000, 1000)
                    await until(lambda rnd=rnd: len(reader.events) >= (rnd + 1) * 1000)
                    push.close()
                    assert await trio.to_thread.run_sync(stop_process, proc) == 0
                    for k in kids:
                        assert not os.path.exists(f"/proc/{k}/cmdline") or \
                            open(f"/proc/{k}/stat").read().split()[2] == "Z"
            finally:
                ctx.destroy(linger=0)
            nursery.cancel_scope.cancel()
        return reader

    reader = trio.run(main)
    assert sorted(numbers(reader)) == list(range(2000))
    assert "Traceback" not in (tmp_path / "relay.log").read_text()


async def test_process_output_stats_before_the_worker_reports(tmp_path):
    from logjam_relay.outputs.supervisor import OutputSpec
    po = ProcessOutput(OutputSpec("x", "lumberjack", "lumberjack://127.0.0.1:1?tls=off"),
                       reader=None, relay_host="h")
    st = po.stats()
    assert st["isolation"] == "process" and st["worker_inflight"] == 0
    assert not st.get("connected")


async def test_refused_event_in_a_worker_is_dead_lettered_by_the_relay(tmp_path):
    """The worker's dead letter reaches the relay's store with the record's real spool
    position (not the worker's batch position), and the stream flows on."""
    from logjam_relay.deadletter.store import read_dead_letters
    from logjam_relay.spool import segment
    reader = LumberjackReader(refuse=lambda ev: "venom" in ev.fields["line"])
    dl = tmp_path / "dl"
    async with trio.open_nursery() as nursery:
        port = await nursery.start(reader.serve)
        async with running_relay(tmp_path, outputs=[lj_url(port, window=20)],
                                 output_isolation="process", dead_letter_dir=str(dl),
                                 spool_dir=str(tmp_path / "spool")) as (relay, cl):
            push = cl.push()
            await push_n(push, 0, 50)
            await send(push, [b"worker-test", b"logs.worker", b'{"n":-1,"venom":1}', meta()])
            await push_n(push, 50, 50)
            await until(lambda: set(numbers(reader)) >= set(range(100)))
            await until(lambda: relay.dead_letters.count_for("lj") == {"refused": 1})
            push.close()
        nursery.cancel_scope.cancel()
    assert -1 not in numbers(reader)
    letters = list(read_dead_letters(dl))
    assert [(x.output, x.reason, x.frames[2]) for x in letters] == \
        [("lj", "refused", b'{"n":-1,"venom":1}')]
    seg_no, offset = letters[0].position
    spooled = {off: frames for off, _, frames in segment.iter_records(
        next((tmp_path / "spool").glob(f"*{seg_no:0{8}d}*")), allow_torn_tail=True)}
    assert spooled[offset][2] == b'{"n":-1,"venom":1}'


def test_workers_exit_when_the_relay_is_sigkilled(tmp_path):
    """No orphans: a SIGKILLed relay's workers see EOF on their socket and exit."""
    import time
    port = free_port()
    spool = str(tmp_path / "spool")
    s = relay_settings(tmp_path, outputs=[lj_url(port)], spool_dir=spool)
    extra = ["--output", lj_url(port), "--output", lj_url(port, name="lj2"),
             "--spool-dir", spool, "--output-isolation", "process"]
    proc = start_process(s, extra, log_path=tmp_path / "relay.log")
    try:
        deadline = time.monotonic() + 20
        kids: list[str] = []
        while len(kids) < 2 and time.monotonic() < deadline:
            # every thread's children: trio starts processes from its worker threads,
            # and they are listed under the thread that started them while it lives
            kids = [k for t in os.listdir(f"/proc/{proc.pid}/task")
                    for k in open(f"/proc/{proc.pid}/task/{t}/children").read().split()]
            time.sleep(0.05)
        assert len(kids) == 2

        def ignores_sigterm(pid: str) -> bool:       # the worker's main() has run
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
            return False
        while not all(map(ignores_sigterm, kids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        # SIGTERM to a worker alone is ignored: the relay decides when workers stop
        os.kill(int(kids[0]), signal.SIGTERM)
        time.sleep(0.3)
        assert open(f"/proc/{kids[0]}/stat").read().split()[2] != "Z"
    finally:
        proc.kill()
        proc.wait()

    def alive(pid: str) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(k) for k in kids)
    # quietly: a worker whose relay is gone exits without a traceback on the shared log
    assert "Traceback" not in (tmp_path / "relay.log").read_text()


# ------------------------------------------------------- SegmentTail (tail mode)


def _spool(tmp_path, **kw):
    from logjam_relay.spool.spool import Spool
    return Spool(tmp_path / "sp", readers=["t"], segment_bytes=4096, fsync="never", **kw)


def _append(sp, start, n):
    for i in range(start, start + n):
        sp.append_records([(0, [b"app", b"topic", b"%06d" % i + b"." * 60, b"m" * 24])])


def _tail(reader, acks, reports):
    from logjam_relay.spool.tail import SegmentTail
    return SegmentTail("t", reader._ack_pos, reader._ack_seq,
                       lambda pos, known: acks.append(pos), lambda *d: reports.append(d))


def _numbers(recs):
    return [int(r.frames[2][:6]) for r in recs]


def test_segment_tail_reads_acks_and_rewinds_across_segments(tmp_path):
    """The worker's reader on the relay's snapshots: records in order over several
    segments (one sealed while being read), only what the snapshot announces, acks as
    real positions the relay's reader takes, a rewind from the first unacknowledged."""
    from logjam_relay.spool.tail import snapshot
    sp = _spool(tmp_path)
    reader = sp.reader("t")
    acks, reports = [], []
    tail = _tail(reader, acks, reports)
    _append(sp, 0, 100)
    tail.update(snapshot(sp.ledger, 0))
    assert len({e[0] for e in tail._segs.values()}) >= 3
    got = []
    while recs := tail.read(7):
        got += recs
    assert _numbers(got) == list(range(100))
    _append(sp, 100, 10)                          # not announced yet: not read
    assert tail.read(100) == []
    tail.update(snapshot(sp.ledger, 0))
    got += tail.read(100)
    assert _numbers(got) == list(range(110))
    tail.ack(got[40].position)
    tail.ack(got[30].position)                    # older: not sent
    assert acks == [got[40].position]
    reader.ack(acks[-1])                          # the relay's side
    assert reader.stats()["backlog_records"] == 110 - 41
    tail.rewind()
    assert _numbers(tail.read(1000)) == list(range(41, 110))
    tail.rewind()
    tail.ack(got[109].position)
    tail.rewind()
    assert tail.read(10) == [] and reports == []
    reader.ack(acks[-1])
    assert reader.stats()["backlog_records"] == 0 and reader.lost == 0
    sp.close()


def test_segment_tail_skips_dropped_segments_and_the_relay_counts_them(tmp_path):
    """drop_oldest deletes segments under the worker: it reads on from the first
    segment still listed; the relay's reader counts what it never delivered as lost."""
    from logjam_relay.spool.tail import snapshot
    sp = _spool(tmp_path, policy="drop_oldest", max_bytes=16384)
    reader = sp.reader("t")
    acks, reports = [], []
    tail = _tail(reader, acks, reports)
    _append(sp, 0, 10)
    tail.update(snapshot(sp.ledger, 0))
    first = tail.read(5)
    tail.ack(first[-1].position)
    reader.ack(acks[-1])
    _append(sp, 10, 600)                          # far more than 16 KiB: oldest dropped
    tail.update(snapshot(sp.ledger, reader.acknowledged.segment))
    rest = []
    while recs := tail.read(50):
        rest += recs
    got = _numbers(first + rest)
    assert got == sorted(got) and got[-1] == 609 and len(set(got)) == len(got)
    assert got[5] > 5                              # a jump over the dropped segments
    tail.ack(rest[-1].position)
    reader.ack(acks[-1])
    assert reader.stats()["backlog_records"] == 0
    assert reader.lost == 610 - len(got) > 0 and reports == []
    sp.close()


def _linked_tail(reader):
    """A SegmentTail whose acks and skip reports go straight to the relay's reader, in
    order, as over the worker's socket."""
    from logjam_relay.spool.tail import SegmentTail
    reader.reads_elsewhere = True
    return SegmentTail("t", reader._ack_pos, reader._ack_seq, reader.ack, lambda *d: None,
                       reader.skipped)


@pytest.mark.parametrize("gives_up", [False, True])
def test_records_a_worker_read_from_a_dropped_segment_count_only_if_never_acked(
        tmp_path, gives_up):
    """drop_oldest deletes the segments a worker's window was read from: the relay
    cannot know how far the worker read, so nothing of them is counted at once; the
    worker's ack (cumulative, with the record's seq) resolves what it delivered, its
    skip reports what it never read.  A worker that gives the window up (rewind after a
    lost connection) skips it on the re-read: then it counts.  Either way delivered +
    lost == appended, exactly."""
    from logjam_relay.spool.tail import snapshot
    sp = _spool(tmp_path, policy="drop_oldest", max_bytes=16384)
    reader = sp.reader("t")
    tail = _linked_tail(reader)
    _append(sp, 0, 30)
    tail.update(snapshot(sp.ledger, 0))
    window = tail.read(25)                         # in flight, not acknowledged
    tail.ack(window[9].position)                   # a partial ack: the first 10
    _append(sp, 30, 600)                           # the window's segments are dropped
    assert sp.dropped_segments > 0 and window[-1].position.segment not in sp._segs
    assert reader.lost == 0 and reader.pending() > 0
    tail.update(snapshot(sp.ledger, reader.acknowledged.segment))
    delivered = window[:10]
    if gives_up:
        tail.rewind()                              # the window was never delivered
    else:
        delivered = window                         # it was
        tail.ack(window[15].position)              # mid-block acks carry the seq too
        tail.ack(window[-1].position)
    while recs := tail.read(50):
        delivered += recs
        tail.ack(recs[-1].position)
    got = _numbers(delivered)
    assert got == sorted(got) and len(set(got)) == len(got) and got[-1] == 629
    assert reader.stats()["backlog_records"] == 0 and reader.pending() == 0
    assert reader.lost == 630 - len(got) and reader.lost_by_reason == {"dropped": reader.lost}
    sp.close()


def test_segment_tail_reports_a_damaged_record_and_the_relay_registers_the_gap(tmp_path):
    """A corrupt record: the worker stops at it and reports; the relay's damage handling
    (resync) registers a hole and a gap; with the next snapshot the worker reads on
    after it, and the relay's reader counts exactly that record as lost (corrupt)."""
    from logjam_relay.spool.tail import handle_damage, snapshot
    sp = _spool(tmp_path)
    reader = sp.reader("t")
    acks, reports = [], []
    tail = _tail(reader, acks, reports)
    _append(sp, 0, 20)
    sp.seal()
    seg = next(iter(sp._segs.values()))
    offs = [off for off, _, _ in __import__("logjam_relay.spool.segment", fromlist=["x"])
            .iter_records(seg.path)]
    with open(seg.path, "r+b") as f:              # flip a byte in record 7's body
        f.seek(offs[7] + 40)
        b = f.read(1)
        f.seek(offs[7] + 40)
        f.write(bytes([b[0] ^ 0xFF]))
    tail.update(snapshot(sp.ledger, 0))
    got = tail.read(100)
    assert _numbers(got) == list(range(7))
    assert tail.read(100) == [] and len(reports) == 1
    segno, off, seq, reason, _ = reports[0]
    assert (segno, off, seq, reason) == (seg.segno, offs[7], 7, "crc")
    handle_damage(reader, *reports[0])
    handle_damage(reader, *reports[0])           # a repeated report changes nothing
    tail.update(snapshot(sp.ledger, 0))
    got += tail.read(100)
    assert _numbers(got) == [i for i in range(20) if i != 7]
    tail.ack(got[-1].position)
    reader.ack(acks[-1])
    assert reader.lost_by_reason == {"corrupt": 1}
    sp.close()


async def test_worker_reports_a_damaged_record_and_the_relay_counts_it(tmp_path):
    """Tail mode end to end: a record damaged on disk before the worker reads it is
    reported by the worker, handled by the relay (one record lost, reason corrupt), and
    everything else arrives once."""
    from logjam_relay.spool import segment
    port = free_port()
    async with running_relay(tmp_path, outputs=[lj_url(port)], output_isolation="process",
                             spool_dir=str(tmp_path / "spool")) as (relay, cl):
        push = cl.push()
        await push_n(push, 0, 300)
        sup = relay.outputs[0]

        def spooled():
            return [fr[2] for p in (tmp_path / "spool").glob("*.open")
                    for _, _, fr in segment.iter_records(p, allow_torn_tail=True)]
        await until(lambda: sum(b.startswith(b'{"action"') for b in spooled()) == 300)
        relay.spool.seal()
        seg = next(p for p in (tmp_path / "spool").glob("*.seg"))
        recs = [(off, fr) for off, _, fr in segment.iter_records(seg)]
        victim = next(off for off, fr in recs if fr[2].startswith(b'{"action":"Worker#test","n":150,'))
        with open(seg, "r+b") as f:              # one byte of record n=150's body
            f.seek(victim + 60)
            b = f.read(1)
            f.seek(victim + 60)
            f.write(bytes([b[0] ^ 0xFF]))
        reader = LumberjackReader(port=port)
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.serve)
            await until(lambda: len(reader.events) >= 299)
            await until(lambda: sup.reader.stats()["backlog_records"] == 0)
            await until(lambda: sup.stats().get("worker_damage_reports") == 1)
            nursery.cancel_scope.cancel()
        push.close()
        assert sup.reader.stats()["lost_by_reason"] == {"corrupt": 1}
        assert sup.stats()["worker_mode"] == "tail"
    assert sorted(numbers(reader)) == [i for i in range(300) if i != 150]


def test_segment_tail_acks_carry_the_record_end_and_seq(tmp_path):
    """An ack carries the record's end offset and seq (the relay then moves its cursor
    without a disk read, also when the segment was dropped meanwhile): exactly what the
    relay's reader finds reading the record header, the same cursor either way; for the
    last record of a block from the block's end, for one in the middle from the parse
    that read it.  A hint that does not fit the segment is not taken."""
    from logjam_relay.spool.spool import Spool
    from logjam_relay.spool.tail import SegmentTail, snapshot
    sp = Spool(tmp_path / "sp", readers=["t", "u"], segment_bytes=4096, fsync="never")
    _append(sp, 0, 100)
    reader, other = sp.reader("t"), sp.reader("u")
    sent = []
    tail = SegmentTail("t", reader._ack_pos, reader._ack_seq,
                       lambda pos, known: sent.append((pos, known)), lambda *d: None)
    tail.update(snapshot(sp.ledger, 0))
    got = []
    while recs := tail.read(7):
        got += recs
        tail.ack(recs[-1].position)
        pos, known = sent[-1]
        assert known is not None and pos == recs[-1].position
        reader.ack(pos, known)
        other.ack(pos)                               # the disk read
        assert (reader._ack_pos, reader._ack_seq) == (other._ack_pos, other._ack_seq)
    assert _numbers(got) == list(range(100)) and reader.stats()["backlog_records"] == 0
    _append(sp, 100, 10)
    tail.update(snapshot(sp.ledger, 0))
    more = tail.read(10)
    tail.ack(more[2].position)                       # not the last of a block: found
    pos, known = sent[-1]                            # in the parse that read it
    assert pos == more[2].position and known == (more[3].position.offset, 102)
    reader.ack(pos, known)
    other.ack(pos)
    assert (reader._ack_pos, reader._ack_seq) == (other._ack_pos, other._ack_seq)
    # a hint that does not fit the segment is not taken: the header is read
    reader.ack(more[4].position, (10**9, 0))
    other.ack(more[4].position)
    assert (reader._ack_pos, reader._ack_seq) == (other._ack_pos, other._ack_seq)
    assert reader._ack_seq == 105
    sp.close()


def test_worker_keeps_freed_memory_in_the_heap():
    """keep_freed_memory() (a worker's first call, glibc): blocks allocated and freed
    over and over (a window's records and frames, a zlib compressor's state, the
    compressed window) come back from the heap instead of fresh pages the kernel faults
    in each time.  Counted in page faults (not time), in a fresh interpreter, with and
    without it: rounds of 40 MiB in 100 KiB blocks, all freed between rounds."""
    import subprocess
    import sys
    code = ("import resource, sys\n"
            "from logjam_relay.outputs import worker_process as worker\n"
            "ok = worker.keep_freed_memory() if sys.argv[1] == '1' else True\n"
            "def rnd():\n"
            "    blocks = [b'x' * (100 << 10) for _ in range(400)]\n"
            "    del blocks\n"
            "rnd()\n"
            "f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "for k in range(5):\n"
            "    rnd()\n"
            "print(int(ok), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)\n")
    got = {}
    for flag in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", code, flag], capture_output=True,
                             text=True, check=True).stdout.split()
        got[flag] = (int(out[0]), int(out[1]))
    if not got["1"][0]:
        pytest.skip("no mallopt here (not glibc): the worker runs with the defaults")
    pages = 5 * 400 * (100 << 10) // 4096
    assert got["0"][1] > pages // 2                   # the defaults: trimmed, faulted again
    assert got["1"][1] < pages // 50                  # kept in the heap


async def test_an_output_short_of_descriptors_is_retried_within_a_second(autojump_clock):
    """An output that cannot start for want of file descriptors (EMFILE from its socket
    pair) is tried again within FD_RETRY_MAX however long the shortage lasts -- the crash
    backoff had grown to 50 s, and the output stayed stopped that long after descriptors
    were free again -- and those tries do not grow the backoff of a real crash."""
    import errno
    import types

    from logjam_relay.outputs import supervisor as sup

    starts: list[float] = []
    plan = [OSError(errno.EMFILE, "Too many open files")] * 12 + [ValueError("a bug")] + \
        [OSError(errno.ENFILE, "Too many open files in system")] * 3 + [None]

    class Output:
        async def run(self):
            starts.append(trio.current_time())
            what = plan[len(starts) - 1]
            if what is not None:
                raise what
            s.request_stop()

    class Reader:
        def rewind(self):
            pass

    s = sup.OutputSupervisor(types.SimpleNamespace(name="x"), Reader(), Output,
                             backoff_min=0.5, backoff_max=60.0)
    s.request_stop = lambda: setattr(s, "_stop", True)
    await s.run()
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert len(starts) == len(plan) and s.crashes == len(plan) - 1
    assert all(g <= sup.FD_RETRY_MAX for g in gaps[:12]), gaps
    assert max(gaps[8:12]) > sup.FD_RETRY_MAX / 2         # and no busy loop either
    assert gaps[12] <= 0.5                                 # the bug's first backoff: min
    assert all(g <= sup.FD_RETRY_MAX for g in gaps[13:]), gaps
