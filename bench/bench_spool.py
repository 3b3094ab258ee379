"""Spool append and replay throughput against raw file I/O baselines (same run).

    python bench/bench_spool.py [--seconds 0.6] [--dir /tmp]

Messages: 4 logjam frames with a 300-byte body, appended in batches of 1000
(one append_batch per drained batch, as the relay does).  The record encoder is timed
alone too: the Python one against the C one (``_segenc.c``) in the same run.  Baselines:
append -> os.write of the same pre-encoded bytes with the same fsync policy;
replay -> os.read of the segment files in 1 MiB chunks (no parsing, no CRC).
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import tempfile
import time

from logjam_relay.spool import segment as fmt
from logjam_relay.spool.spool import Spool

BATCH = 1000


def make_batch(start: int) -> list[list[bytes]]:
    body = os.urandom(300)
    return [[b"myapp-production", b"logs.web.request", body,
             struct.pack(">HBBIQQ", 0xCABD, 3, 1, 1, 1_700_000_000_000, start + i)]
            for i in range(BATCH)]


def bench_append(base: str, fsync: str, seconds: float, batch) -> tuple[float, int, int]:
    d = tempfile.mkdtemp(dir=base)
    sp = Spool(d, readers=["r"], fsync=fsync, fsync_interval_s=0.05,
               segment_bytes=64 << 20, max_bytes=8 << 30)
    n = nbytes = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sp.append_batch(batch)
        n += BATCH
    dt = time.perf_counter() - t0
    nbytes = sp.stats()["bytes_appended"]
    sp.close()
    return dt, n, nbytes, d


def bench_raw_write(base: str, fsync: str, data: bytes, seconds: float) -> tuple[float, int]:
    path = os.path.join(tempfile.mkdtemp(dir=base), "raw")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    n = 0
    last = time.perf_counter()
    t0 = last
    while time.perf_counter() - t0 < seconds:
        os.write(fd, data)
        n += 1
        if fsync == "batch" or (fsync == "interval" and time.perf_counter() - last >= 0.05):
            os.fdatasync(fd)
            last = time.perf_counter()
    dt = time.perf_counter() - t0
    os.close(fd)
    return dt, n * len(data)


def bench_encode(batch, seconds: float) -> tuple[float, float | None]:
    """Records per second of the Python encoder and of the C one (None: not built)."""
    out = []
    for enc in (fmt.encode_logjam_batch_py,
                fmt._encode_logjam_batch if fmt._encode_c is not None else None):
        if enc is None:
            out.append(None)
            continue
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            enc(batch, n)
            n += len(batch)
        out.append(n / (time.perf_counter() - t0))
    return out[0], out[1]


def bench_replay(d: str) -> tuple[float, int, int, float, int]:
    sp = Spool(d, readers=["r"])
    r = sp.reader("r")
    t0 = time.perf_counter()
    n = 0
    while recs := r.read(1000):
        n += len(recs)
    dt = time.perf_counter() - t0
    sp.close()
    files = [os.path.join(d, f) for f in sorted(os.listdir(d)) if fmt.parse_segment_name(f)]
    nbytes = sum(os.path.getsize(f) for f in files)
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(1 << 20):
                pass
    raw_dt = time.perf_counter() - t0
    # the Spark path: iter_records over the same files
    t0 = time.perf_counter()
    m = 0
    for f in files:
        for _ in fmt.iter_records(f):
            m += 1
    it_dt = time.perf_counter() - t0
    assert m == n
    return dt, n, nbytes, raw_dt, it_dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=0.6)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench_spool_", dir=args.dir)
    try:
        batch = make_batch(0)
        data = fmt.encode_logjam_batch(batch, 0)
        mb = 1e6
        replay_dir = None
        py_rate, c_rate = bench_encode(batch, args.seconds)
        print(f"encode (Python)     {py_rate:>10,.0f} events/s | C encoder (_segenc.c) " + (
            f"{c_rate:>10,.0f} events/s | C {c_rate / py_rate:5.1f}x" if c_rate else "not built"))
        for fsync in ("never", "interval", "batch"):
            dt, n, nbytes, d = bench_append(base, fsync, args.seconds, batch)
            raw_dt, raw_bytes = bench_raw_write(base, fsync, data, args.seconds)
            rate = nbytes / dt / mb
            raw_rate = raw_bytes / raw_dt / mb
            print(f"append fsync={fsync:<8} {n / dt:>10,.0f} events/s {rate:8.1f} MB/s | "
                  f"raw os.write {raw_rate:8.1f} MB/s | ratio {rate / raw_rate:5.2f}")
            if fsync == "never":
                replay_dir = d
            else:
                shutil.rmtree(d)
        dt, n, nbytes, raw_dt, it_dt = bench_replay(replay_dir)
        rate, raw_rate, it_rate = nbytes / dt / mb, nbytes / raw_dt / mb, nbytes / it_dt / mb
        print(f"replay reader.read  {n / dt:>10,.0f} events/s {rate:8.1f} MB/s | "
              f"raw os.read  {raw_rate:8.1f} MB/s | ratio {rate / raw_rate:5.2f}")
        print(f"replay iter_records {n / it_dt:>10,.0f} events/s {it_rate:8.1f} MB/s | "
              f"raw os.read  {raw_rate:8.1f} MB/s | ratio {it_rate / raw_rate:5.2f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
