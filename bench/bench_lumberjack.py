"""Lumberjack writer throughput into the in-repo reader.

    python bench/bench_lumberjack.py [--events 200000] [--windows 100,1000] [--levels 0,3]
                                     [--pipeline 4] [--tls]

For every (window, zlib level) it measures, in the same run:

* ``encode``   : the writer's CPU cost alone (record -> event mapping, D frames, zlib),
                 no network: the upper bound of what one relay core can forward;
* ``baseline`` : the same pre-encoded window bytes written over a raw trio socket into the
                 same reader, with the same pipelining and ACK handling (socket + reader cost);
* ``writer``   : LumberjackOutput end to end from a MemorySource into the reader, plus
                 the CPU time of the writer process per event (robust on a loaded host).

Baseline and writer runs alternate ``--repeat`` times (default 3); medians are printed.

The reader (``tests/peers/lumberjack_reader.py``, go-lumber behaviour, full decoding of every
event) runs in a separate process, like a real Logstash would.  Events: logjam records
with a ~100 byte uncompressed JSON body; with the 9 mapped fields the 1D frame
is ~300 bytes (the size used in the reference measurements).
Printed: events/s for each, writer/baseline ratio, and the verdict against the
relay's ingest rate (PULL -> PUB with the C socket loops: ~256k msgs/s on a 2-core machine, bench_relay.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time

import trio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))   # the test peers

from logjam_relay.io.net import TLSSettings, connect, server_context  # noqa: E402
from logjam_relay.outputs.lumberjack import (  # noqa: E402
    EventEncoder,
    LumberjackConfig,
    LumberjackOutput,
)
from logjam_relay.protocols import lumberjack as lj  # noqa: E402
from logjam_relay.protocols.logjam import encode_meta  # noqa: E402
from logjam_relay.spool.api import MemorySource  # noqa: E402
from peers.lumberjack_reader import LumberjackReader  # noqa: E402

TARGET = 256_000   # bench_relay.py, PULL -> PUB with the C socket loops, 2 cores (2026-11-21)


def make_records(n: int, seed: int = 1) -> list[list[bytes]]:
    rnd = random.Random(seed)
    actions = [f"Api::V{v}::{c}Controller#{a}" for v in (1, 2)
               for c in ("Users", "Orders", "Search", "Carts") for a in ("index", "show", "create")]
    out = []
    for i in range(n):
        body = json.dumps({
            "action": rnd.choice(actions),
            "code": rnd.choice((200, 200, 200, 201, 302, 404, 500)),
            "total_time": round(rnd.random() * 300, 3),
            "request_id": f"{rnd.getrandbits(64):016x}",
        }, separators=(",", ":")).encode()
        out.append([b"shop-frontend-production", b"logs.shop.frontend", body,
                    encode_meta(0, 1, 1714550400000 + i, i + 1)])
    return out


# ------------------------------------------------------------------ reader process


def _reader_main(conn, certfile):
    ctx = server_context(certfile) if certfile else None
    reader = LumberjackReader(ssl_context=ctx, keep_windows=False, timeout=60)

    async def main():
        async with trio.open_nursery() as n:
            port = await n.start(reader.serve)
            conn.send(port)
            await trio.to_thread.run_sync(conn.recv)     # any message = stop
            conn.send(reader.stats())
            n.cancel_scope.cancel()

    trio.run(main)


# ------------------------------------------------------------------------ measures


def encode_all(records, window: int, level: int):
    src = MemorySource()
    for fr in records:
        src.append(fr)
    enc = EventEncoder("bench-relay")
    t = time.perf_counter()
    windows = []
    while batch := src.read(window):
        frames, n = enc.encode(batch)
        windows.append(lj.encode_window(frames, n, level))
    return time.perf_counter() - t, windows


async def send_preencoded(port: int, windows: list[bytes], window: int, depth: int, ctx):
    stream = await connect("127.0.0.1", port, ssl_context=ctx, server_name="localhost")
    sem = trio.Semaphore(depth)
    done = trio.Event()
    expected = len(windows)

    async def acks():
        conn = lj.Connection(lj.Role.WRITER)
        got = 0
        while got < expected:
            conn.receive_data(await stream.receive_some(65536))
            while (ev := conn.next_event()) is not lj.NEED_DATA:
                if isinstance(ev, lj.Ack):
                    got += 1
                    sem.release()
        done.set()

    t = time.perf_counter()
    async with trio.open_nursery() as n:
        n.start_soon(acks)
        for w in windows:
            await sem.acquire()
            await stream.send_all(w)
        await done.wait()
    el = time.perf_counter() - t
    await stream.aclose()
    return el


async def run_writer(port: int, records, window: int, level: int, depth: int, tls: TLSSettings):
    src = MemorySource()
    for fr in records:
        src.append(fr)
    cfg = LumberjackConfig(hosts=(("127.0.0.1", port),), window=window, compression=level,
                           pipeline=depth, tls=tls, relay_host="bench-relay",
                           backoff_min=0.05, backoff_max=0.5, timeout=60)
    out = LumberjackOutput(src, cfg)
    t = time.perf_counter()
    cpu = time.process_time()      # this process only: the writer, not the reader
    async with trio.open_nursery() as n:
        n.start_soon(out.run)
        while not src.all_acked:
            await trio.sleep(0.002)
        el = time.perf_counter() - t
        cpu = time.process_time() - cpu
        n.cancel_scope.cancel()
    return el, cpu, out.stats()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--windows", default="100,1000")
    ap.add_argument("--levels", default="0,3")
    ap.add_argument("--pipeline", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="runs per measure (median)")
    ap.add_argument("--tls", action="store_true", help="TLS (trustme certificate) instead of TCP")
    args = ap.parse_args()

    certfile = ca_file = None
    tls = TLSSettings(enabled=False)
    if args.tls:
        import tempfile

        import trustme
        ca = trustme.CA()
        d = tempfile.mkdtemp()
        certfile, ca_file = os.path.join(d, "server.pem"), os.path.join(d, "ca.pem")
        ca.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(certfile)
        ca.cert_pem.write_to_path(ca_file)
        tls = TLSSettings(ca=ca_file, server_name="localhost")
    ctx = tls.client_context()

    records = make_records(args.events)
    enc = EventEncoder("bench-relay")
    src1 = MemorySource()
    src1.append(records[0])
    one, _ = enc.encode(src1.read(1))
    print(f"lumberjack bench: {args.events} events, D frame {len(one)} B, "
          f"pipeline {args.pipeline}, {'TLS' if args.tls else 'TCP'}, "
          f"median of {args.repeat}, "
          f"reader = in-repo LumberjackReader in a separate process, python "
          f"{sys.version.split()[0]}, {os.cpu_count()} cpus")

    mpctx = mp.get_context("spawn")
    parent, child = mpctx.Pipe()
    proc = mpctx.Process(target=_reader_main, args=(child, certfile), daemon=True)
    proc.start()
    port = parent.recv()
    hdr = (f"{'window':>6} {'zlib':>4} {'B/event':>7} | {'encode ev/s':>11} | "
           f"{'baseline ev/s':>13} | {'writer ev/s':>11} {'ratio':>5} | {'rtt ms':>6} | "
           f"{'writer cpu us/ev':>16} {'=> ev/s/core':>12} | target")
    print(hdr)
    print("-" * len(hdr))
    try:
        for window in (int(x) for x in args.windows.split(",")):
            for level in (int(x) for x in args.levels.split(",")):
                enc_s, windows = encode_all(records, window, level)
                nbytes = sum(map(len, windows))
                bases, writes = [], []
                for _ in range(args.repeat):      # alternate: load on a shared host drifts
                    bases.append(trio.run(send_preencoded, port, windows, window,
                                          args.pipeline, ctx))
                    writes.append(trio.run(run_writer, port, records, window, level,
                                           args.pipeline, tls))
                    assert writes[-1][2]["events_acked"] == args.events, writes[-1][2]
                del windows
                base_s = statistics.median(bases)
                wr_s = statistics.median(w[0] for w in writes)
                wr_cpu = statistics.median(w[1] for w in writes)
                st = writes[len(writes) // 2][2]
                n = args.events
                w_rate = n / wr_s
                rtt = 1000 * st["window_rtt_sum_seconds"] / max(st["window_rtt_count"], 1)
                cap = n / wr_cpu
                ok = ("OK" if w_rate >= TARGET else
                      "cpu OK, reader-bound" if cap >= TARGET else "below")
                print(f"{window:>6} {level:>4} {nbytes / n:>7.1f} | {n / enc_s:>11,.0f} | "
                      f"{n / base_s:>13,.0f} | {w_rate:>11,.0f} {w_rate / (n / base_s):>5.2f} | "
                      f"{rtt:>6.1f} | {1e6 * wr_cpu / n:>16.1f} {cap:>12,.0f} | {ok}")
    finally:
        parent.send("stop")
        rstats = parent.recv()
        proc.join(5)
    print(f"reader: {rstats['events_received']:,} events in {rstats['windows_received']:,} "
          f"windows, errors {rstats['errors']}")
    print("ratio = writer / baseline (same pre-encoded bytes over a raw socket into the same "
          f"reader); target = {TARGET:,} ev/s (relay ingest rate).")
    print("writer cpu = process time of the writer process per event (the reader runs in "
          "another process);\n=> ev/s/core = what the writer could sustain on one free core.")


if __name__ == "__main__":
    main()
