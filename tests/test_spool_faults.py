"""Spool integrity through the real command (issue 11): damage costs only the damaged records.

Each case: a relay subprocess with a Lumberjack output whose receiver is down accepts
N requests (all answered 202), is SIGKILLed, the spool is damaged, the receiver comes
up, the relay is restarted and 1,000 new requests follow.  Asserted: what the receiver
misses is exactly the damaged records, the lost counter (/metrics) equals that number,
every new request is delivered.  Run with ``-s`` to see the table rows.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import urllib.request

import pytest
import trio
import zmq

from conftest import free_port
from logjam_relay.spool import cursors as curlog
from logjam_relay.spool import segment as fmt
from peers.lumberjack_reader import LumberjackReader
from relay_harness import relay_settings, start_process, stop_process
from spool_requests import send_requests as _send_requests

N_OLD = 5000
N_NEW = 1000
SEGMENT_BYTES = 128 * 1024        # ~7 segments for N_OLD
BODY = b'{"action":"Fault#test","n":%d,"pad":"........................................"}'
_N = re.compile(rb'"n":(\d+)')


def lj_url(port):
    return (f"lumberjack://127.0.0.1:{port}?tls=off&window=200&timeout=5&backoff_min=0.05"
            f"&backoff_max=0.2&name=lj")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def send_requests(ctx, settings, numbers) -> set[int]:
    return await _send_requests(ctx, settings, numbers, BODY, b'fault')


def segment_records(spool_dir) -> list[dict]:
    """Per segment file: path, segno, and (offset, end, n) of every record."""
    out = []
    for name in sorted(os.listdir(spool_dir)):
        parsed = fmt.parse_segment_name(name)
        if parsed is None:
            continue
        path = os.path.join(spool_dir, name)
        recs = []
        offs = list(fmt.iter_records(path, allow_torn_tail=True))
        size = os.path.getsize(path)
        end_all = size - fmt.SEAL_RECORD_LEN if parsed[1] else size
        for i, (off, _kind, frames) in enumerate(offs):
            end = offs[i + 1][0] if i + 1 < len(offs) else end_all
            m = _N.search(frames[2])
            recs.append((off, end, int(m.group(1)) if m else None))
        out.append({"path": path, "segno": parsed[0], "sealed": parsed[1], "records": recs,
                    "size": size})
    return out


def _ns(seg) -> set[int]:
    return {n for _, _, n in seg["records"] if n is not None}


# ----------------------------------------------------------------------------- damage

def flip_middle(spool_dir, segs) -> set[int]:
    seg = [s for s in segs if s["sealed"]][len(segs) // 2]
    mid = seg["size"] // 2
    with open(seg["path"], "r+b") as f:
        f.seek(mid)
        b = f.read(4)
        f.seek(mid)
        f.write(bytes(x ^ 0xFF for x in b))
    return {n for off, end, n in seg["records"] if off <= mid + 3 and end > mid}


def flip_header(spool_dir, segs) -> set[int]:
    seg = [s for s in segs if s["sealed"]][2]
    with open(seg["path"], "r+b") as f:
        f.seek(4)
        f.write(b"\xff\xfe\xfd\xfc")              # magic and header CRC no longer match
    return set()                                  # every record is intact


def delete_middle(spool_dir, segs) -> set[int]:
    seg = [s for s in segs if s["sealed"]][len(segs) // 2]
    os.unlink(seg["path"])
    return _ns(seg)


def cursor_past_end(spool_dir, segs) -> set[int]:
    cdir = os.path.join(spool_dir, "cursors")
    last = segs[-1]
    for name in curlog.names(cdir):
        curlog.write_entry(cdir, name, last["segno"] + 7, 1 << 30, 10 ** 9)
    return set()


def zero_two(spool_dir, segs) -> set[int]:
    sealed = [s for s in segs if s["sealed"]]
    lost = set()
    for seg in (sealed[1], sealed[3]):
        with open(seg["path"], "r+b") as f:
            f.write(b"\0" * seg["size"])
        lost |= _ns(seg)
    return lost


def cut_1000(spool_dir, segs) -> set[int]:
    seg = [s for s in segs if s["sealed"]][1]
    new = seg["size"] - 1000
    os.truncate(seg["path"], new)
    return {n for off, end, n in seg["records"] if end > new}


def cursor_into_missing_segment(spool_dir, segs):
    """The output's cursor points at the 11th record of a segment that is then deleted:
    the records before the cursor count as acknowledged (not resent, not lost), the
    segment's records from the cursor on are lost."""
    seg = [s for s in segs if s["sealed"]][len(segs) // 2]
    off, _end, _n = seg["records"][10]
    with open(seg["path"], "rb") as f:
        f.seek(off + 12)
        seq = int.from_bytes(f.read(8), "little")
    cdir = os.path.join(spool_dir, "cursors")
    for name in curlog.names(cdir):
        curlog.write_entry(cdir, name, seg["segno"], off, seq)
    os.unlink(seg["path"])
    lost = {n for _o, _e, n in seg["records"][10:]}
    acked = {n for s in segs if s["segno"] < seg["segno"] for _o, _e, n in s["records"]} | \
        {n for _o, _e, n in seg["records"][:10]}
    return lost, acked


CASES = {
    "4 bytes flipped in the middle of a sealed segment": flip_middle,
    "header flipped in segment 3": flip_header,
    "a middle segment deleted": delete_middle,
    "a cursor pointing past the end": cursor_past_end,
    "two sealed segments zeroed": zero_two,
    "1,000 bytes cut off a sealed segment": cut_1000,
    "a cursor pointing into a deleted segment": cursor_into_missing_segment,
}


@pytest.mark.parametrize("case", list(CASES))
def test_damage_costs_only_the_damaged_records(tmp_path, case):
    port = free_port()
    spool_dir = str(tmp_path / "spool")
    s = relay_settings(tmp_path, heartbeat_interval=3600)
    extra = ["--output", lj_url(port), "--spool-dir", spool_dir,
             "--spool-segment-bytes", str(SEGMENT_BYTES)]
    log = tmp_path / "relay.log"

    async def main():
        ctx = zmq.Context()
        try:
            # phase 1: receiver down, everything stays in the spool
            proc = await trio.to_thread.run_sync(lambda: start_process(s, extra, log_path=log))
            old = await send_requests(ctx, s, range(N_OLD))
            assert len(old) == N_OLD
            # the segments a roll closed are sealed off the event loop (spool/writer.py
            # SealJob), maybe after the last 202: the cases damage sealed segments
            with trio.fail_after(30):
                while sum(1 for n in os.listdir(spool_dir)
                          if (p := fmt.parse_segment_name(n)) and not p[1]) > 1:
                    await trio.sleep(0.02)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            segs = segment_records(spool_dir)
            assert len(segs) >= 5, [x["path"] for x in segs]
            damaged = CASES[case](spool_dir, segs)
            acked = set()
            if isinstance(damaged, tuple):
                damaged, acked = damaged          # records the forged cursor acknowledges
            # phase 2: receiver up, relay restarted, new requests
            reader = LumberjackReader(port=port)
            async with trio.open_nursery() as nursery:
                await nursery.start(reader.serve)
                proc = await trio.to_thread.run_sync(
                    lambda: start_process(s, extra, log_path=log))
                new = await send_requests(ctx, s, range(N_OLD, N_OLD + N_NEW))
                assert len(new) == N_NEW
                expect = (old - damaged - acked) | new
                with trio.fail_after(60):
                    while not expect <= {_n(ev) for ev in reader.events}:
                        await trio.sleep(0.05)
                    # the backlog is 0 once everything that exists was acknowledged
                    while metric_sum(await trio.to_thread.run_sync(scrape, s.metrics_port),
                                     "logjam_relay_output_backlog_records") > 0:
                        await trio.sleep(0.05)
                text = await trio.to_thread.run_sync(scrape, s.metrics_port)
                assert await trio.to_thread.run_sync(stop_process, proc) == 0
                nursery.cancel_scope.cancel()
            return old - acked, new, damaged, reader, text
        finally:
            ctx.destroy(linger=0)

    old, new, damaged, reader, text = trio.run(main)
    got = collections.Counter(_n(ev) for ev in reader.events)
    missing = old - set(got)
    lost_counter = int(metric_sum(text, "logjam_relay_spool_lost_records_total"))
    dups = sum(c - 1 for c in got.values() if c > 1)
    print(f"\n| {case} | lost of the old: {len(missing)} (damaged: {len(damaged)}) | "
          f"new delivered: {len(new & set(got))}/{N_NEW} | lost counter: {lost_counter} | "
          f"duplicates: {dups} |")
    assert missing == damaged, f"lost {len(missing)}, damaged {len(damaged)}"
    assert new <= set(got)
    assert lost_counter == len(missing)
    logtext = log.read_text()
    assert "Traceback" not in logtext
    if damaged:     # every loss also has a log line naming the segment and the range
        assert re.search(r"spool: .*(segment \d+|between segment).*records \d+\.\.\d+|"
                         r"spool: records \d+\.\.\d+ are not on disk .*segment", logtext), \
            logtext[-3000:]


def _n(ev) -> int:
    return json.loads(ev.fields["line"])["n"]
