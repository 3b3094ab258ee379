"""What a segment's file layout does to fdatasync on this disk (no relay involved).

    python bench/bench_fdatasync_layout.py [--dir DIR] [--seconds 8] [--rounds 3]
                                           [--rate-mb 33] [--segment-mb 64]

Two experiments, each layout against ``append`` (how the spool writes segments) in the
same rounds, interleaved:

* **one file**: ``--rate-mb`` MB/s of writes in steps of 0.5 ms, each followed by its own
  fdatasync, into one file that is ``append``: grown by each write (``O_APPEND``);
  ``zero``: a file of zeros written (and synced) beforehand, written over with
  ``pwrite``; ``falloc``: ``posix_fallocate``'d beforehand (unwritten extents), written
  over.
* **rolls**: the same writes into ``--segment-mb`` segments, rolled as the spool rolls
  them (the next file made ahead in a thread and renamed at the roll, the directory
  fsynced in the next round, the closed one's seal -- write, fsync, rename, directory
  fsync -- in a thread): ``append``, or ``zero``: the next file filled with zeros in the
  thread, written over, cut to its data at the seal.

Printed per layout and round: the fdatasync's p50/p99/p99.9/max, how many took over 5 ms
and their sum (the time the writer stood still), and the ratios against ``append``'s of
the same round.  docs/spool-format.md ("Where the disk stalls") says what was measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time

STEP = 0.0005


def stats(lat: list[float]) -> dict:
    lat.sort()

    def q(p):
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000
    slow = [x for x in lat if x > 0.005]
    return {"n": len(lat), "p50": q(0.5), "p99": q(0.99), "p999": q(0.999),
            "max": lat[-1] * 1000, "slow": len(slow), "slow_ms": sum(slow) * 1000}


def zero_fill(fd: int, size: int) -> None:
    z = bytes(1 << 20)
    iov = [z] * 8
    off = 0
    while off < size:
        off += os.pwritev(fd, iov, off)
    os.fdatasync(fd)


def paced(seconds: float, chunk: bytes, step) -> list[float]:
    """Call ``step(chunk)`` every STEP seconds for ``seconds``; its fdatasync times."""
    lat = []
    t_end = time.perf_counter() + seconds
    nxt = time.perf_counter()
    while time.perf_counter() < t_end:
        nxt += STEP
        d = nxt - time.perf_counter()
        if d > 0:
            time.sleep(d)
        lat.append(step(chunk))
    return lat


def one_file(d: str, layout: str, seconds: float, chunk: bytes) -> dict:
    path = os.path.join(d, f"one-{layout}")
    size = int(len(chunk) * seconds / STEP * 1.2) + (1 << 20)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_APPEND if layout == "append"
                                                             else 0))
    if layout == "zero":
        zero_fill(fd, size)
    elif layout == "falloc":
        os.posix_fallocate(fd, 0, size)
        os.fsync(fd)
    off = 0

    def step(c):
        nonlocal off
        if layout == "append":
            os.write(fd, c)
        else:
            os.pwrite(fd, c, off)
        off += len(c)
        t = time.perf_counter()
        os.fdatasync(fd)
        return time.perf_counter() - t
    try:
        return stats(paced(seconds, chunk, step))
    finally:
        os.close(fd)
        os.unlink(path)


def rolls(d: str, layout: str, seconds: float, chunk: bytes, segment: int) -> dict:
    sd = os.path.join(d, f"rolls-{layout}")
    os.makedirs(sd)
    dfd = os.open(sd, os.O_RDONLY | os.O_DIRECTORY)
    spare_path = os.path.join(sd, "next-segment.tmp")
    spare: list[int] = []
    ready = threading.Event()
    threads = []

    def make_spare():
        fd = os.open(spare_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC |
                     (os.O_APPEND if layout == "append" else 0))
        if layout == "zero":
            zero_fill(fd, segment)
        spare.append(fd)
        ready.set()

    def seal(fd, path, end):
        if layout == "zero":
            os.ftruncate(fd, end)
            os.pwrite(fd, b"s" * 48, end)
        else:
            os.write(fd, b"s" * 48)
        os.fsync(fd)
        os.close(fd)
        os.rename(path, path[:-5] + ".seg")
        os.fsync(dfd)

    def start(fn, *args):
        th = threading.Thread(target=fn, args=args)
        th.start()
        threads.append(th)

    segno = 0

    def next_segment():
        nonlocal segno
        ready.wait()
        ready.clear()
        fd = spare.pop()
        path = os.path.join(sd, f"{segno:020d}.open")
        segno += 1
        os.rename(spare_path, path)
        start(make_spare)
        return fd, path

    make_spare()
    fd, path = next_segment()
    off, dir_owed = 0, True

    def step(c):
        nonlocal fd, path, off, dir_owed
        if off + len(c) > segment:
            start(seal, fd, path, off)
            fd, path = next_segment()
            off, dir_owed = 0, True
        if layout == "zero":
            os.pwrite(fd, c, off)
        else:
            os.write(fd, c)
        off += len(c)
        t = time.perf_counter()
        os.fdatasync(fd)
        if dir_owed:
            os.fsync(dfd)
            dir_owed = False
        return time.perf_counter() - t
    try:
        return stats(paced(seconds, chunk, step))
    finally:
        for th in threads:
            th.join()
        os.close(fd)
        for f in spare:
            os.close(f)
        os.close(dfd)
        shutil.rmtree(sd)


def line(name: str, r: dict, base: dict | None) -> str:
    out = (f"  {name:16s} p50 {r['p50']:6.3f} p99 {r['p99']:6.3f} p999 {r['p999']:7.3f} "
           f"max {r['max']:7.1f} ms; {r['slow']:3d} over 5 ms, {r['slow_ms']:6.0f} ms in all")
    if base is not None:
        stalled = (f"{r['slow_ms'] / base['slow_ms']:.2f}x" if base["slow_ms"] >= 1
                   else "n/a:")
        out += (f"  ({r['p50'] / base['p50']:.2f}x p50, {r['max'] / base['max']:.2f}x max, "
                f"{stalled} the stalled time of append's)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate-mb", type=float, default=33.0)
    ap.add_argument("--segment-mb", type=int, default=64)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="fdatasync-layout-", dir=args.dir)
    chunk = b"x" * int(args.rate_mb * 1e6 * STEP)
    print(f"fdatasync by file layout in {args.dir}: {len(chunk):,} B every "
          f"{STEP * 1000:g} ms ({args.rate_mb:g} MB/s), {args.seconds:g} s per run, "
          f"{args.rounds} interleaved rounds")
    got: dict[str, list[dict]] = {}
    try:
        for i in range(args.rounds):
            print(f"-- round {i + 1}", flush=True)
            runs = [("one file, " + lay, lambda lay=lay: one_file(d, lay, args.seconds, chunk))
                    for lay in ("append", "zero", "falloc")]
            runs += [("rolls, " + lay, lambda lay=lay: rolls(d, lay, args.seconds, chunk,
                                                           args.segment_mb << 20))
                     for lay in ("append", "zero")]
            res = {}
            for name, fn in (runs if i % 2 == 0 else runs[::-1]):
                res[name] = fn()
                time.sleep(1)
            for name, _ in runs:
                base = res[name.split(", ")[0] + ", append"]
                print(line(name, res[name], None if name.endswith("append") else base),
                      flush=True)
                got.setdefault(name, []).append(res[name])
        print("-- medians")
        for name, rs in got.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            print(line(name, med, None))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
