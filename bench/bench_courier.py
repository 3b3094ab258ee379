"""Courier writer throughput: 200k logjam records of ~300 bytes into the in-repo receiver.

Baseline, measured in the same run: the CPU work the pipeline cannot avoid, done in a plain
loop without sockets or trio - map every record to its JSON event, build the JDAT payload
(zlib), inflate and split it again as the receiver does. The writer run adds TCP on
loopback, trio scheduling, ACKN handling and spool acknowledgements; writer and receiver
share one process (one trio loop, one GIL), so the ratio is the protocol/I-O overhead.

    python bench/bench_courier.py [--events N] [--payload N] [--tls]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import trio

# the test peers (tests/peers/, not part of the installed package)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from logjam_relay.io.net import TLSSettings  # noqa: E402
from logjam_relay.outputs.courier import CourierConfig, CourierOutput, record_to_event  # noqa: E402
from logjam_relay.protocols import courier as P  # noqa: E402
from logjam_relay.protocols.logjam import encode_meta  # noqa: E402
from logjam_relay.spool.api import MemorySource  # noqa: E402
from peers.courier_receiver import CourierReceiver  # noqa: E402


def make_source(n: int) -> MemorySource:
    src = MemorySource()
    filler = "x" * 150
    for i in range(n):
        body = json.dumps({"action": "UsersController#show", "code": 200, "total_time": 12.5,
                           "request_id": f"{i:032x}", "msg": filler}).encode()
        src.append([b"shop-production", b"logs.shop.production", body,
                    encode_meta(0, 7, 1_700_000_000_000 + i, i + 1)])
    return src


def baseline(src: MemorySource, payload: int) -> float:
    records = src.read(len(src._records))
    src.rewind()
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(records), payload):
        events = [record_to_event(r, "bench") for r in records[i:i + payload]]
        frame = P.encode_payload(os.urandom(16), events)
        r = P.FrameReader("server")
        r.receive_data(frame)
        n += len(r.next_event().events)
    dt = time.perf_counter() - t0
    assert n == len(records)
    return dt


async def writer_run(src: MemorySource, payload: int, port: int | None = None
                     ) -> tuple[float, dict]:
    """Writer into the in-repo receiver: in this process, or at ``port`` (subprocess)."""
    src.rewind()
    src._acked = 0
    rcv = CourierReceiver(store=False)
    total = len(src._records)
    async with trio.open_nursery() as n:
        if port is None:
            port = await n.start(rcv.serve)
        else:
            rcv = None
        cfg = CourierConfig(hosts=(("127.0.0.1", port),), payload_size=payload,
                            tls=TLSSettings(enabled=False), hostname="bench")
        out = CourierOutput(cfg, src)
        t0 = time.perf_counter()
        n.start_soon(out.run)
        while not src.all_acked:
            await trio.sleep(0.005)
        dt = time.perf_counter() - t0
        assert rcv is None or rcv.events_delivered == total, rcv.events_delivered
        n.cancel_scope.cancel()
    return dt, out.stats()


async def serve_until_stdin_closes() -> None:
    rcv = CourierReceiver(store=False)
    async with trio.open_nursery() as n:
        port = await n.start(rcv.serve)
        print(port, flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)
        print(rcv.events_delivered, flush=True)
        n.cancel_scope.cancel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--payload", type=int, default=1000)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        trio.run(serve_until_stdin_closes)
        return
    src = make_source(args.events)
    gc.collect()
    gc.freeze()   # the 200k fixture records are not part of what is measured
    ev_size = len(record_to_event(src._records[0], "bench"))
    body_size = len(src._records[0].frames[2])
    print(f"events: {args.events}, logjam body {body_size} B, courier event {ev_size} B, "
          f"payload {args.payload} events")
    base = baseline(src, args.payload)
    print(f"{'baseline (map + zlib + inflate + split, no I/O):':<46} {base:.3f} s  "
          f"{args.events / base:,.0f} events/s")
    dt, st = trio.run(writer_run, src, args.payload)
    report("writer -> receiver, same process/trio loop:", args.events, dt, base, st)
    proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        dt, st = trio.run(writer_run, src, args.payload, port)
        proc.stdin.close()
        delivered = int(proc.stdout.readline())
    finally:
        proc.wait(10)
    assert delivered == args.events, delivered
    report("writer -> receiver in a subprocess:", args.events, dt, base, st)


def report(what: str, n: int, dt: float, base: float, st: dict) -> None:
    rtt = st["payload_rtt_sum_seconds"] / max(1, st["payload_rtt_count"]) * 1000
    print(f"{what:<46} {dt:.3f} s  {n / dt:,.0f} events/s  "
          f"({st['bytes_sent'] / dt / 1e6:.1f} MB/s compressed on the wire)")
    print(f"    ratio to baseline throughput {base / dt:.2f}; payloads {st['payloads_sent']}, "
          f"resent {st['payloads_resent']}, reconnects {st['reconnects']}, "
          f"mean payload RTT {rtt:.1f} ms")


if __name__ == "__main__":
    main()
