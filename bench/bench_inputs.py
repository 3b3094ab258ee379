"""The relay's Lumberjack and Courier inputs against the in-repo sinks, same writers.

    python bench/bench_inputs.py [--events 100000] [--window 1000] [--repeat 3]

For each protocol the relay's own writer (LumberjackOutput / CourierOutput, from a
MemorySource) sends the same logjam records

* ``sink``  : into the test peers (tests/peers/lumberjack_reader.py / courier_receiver.py,
              full decoding, nothing else) in its own process: the baseline;
* ``input`` : into a real ``logjam-relay`` process with ``--input``: decoding, mapping back
              to logjam messages, stamping, PUB, spool append (fsync interval), then ACK.

Runs alternate ``--repeat`` times; medians are printed with the input/sink ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import trio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))   # the test peers

from bench_lumberjack import make_records  # noqa: E402
from logjam_relay.io.net import TLSSettings  # noqa: E402
from logjam_relay.outputs.courier import CourierOutput  # noqa: E402
from logjam_relay.outputs.courier import parse_url as courier_url  # noqa: E402
from logjam_relay.outputs.lumberjack import LumberjackConfig, LumberjackOutput  # noqa: E402
from logjam_relay.spool.api import MemorySource  # noqa: E402


def _sink_main(kind, conn):
    from peers.courier_receiver import CourierReceiver
    from peers.lumberjack_reader import LumberjackReader

    async def main():
        async with trio.open_nursery() as n:
            if kind == "lumberjack":
                r = LumberjackReader(keep_windows=False, timeout=60)
                port = await n.start(r.serve)
            else:
                r = CourierReceiver(store=False)
                port = await n.start(r.serve)
            conn.send(port)
            await trio.sleep_forever()
    trio.run(main)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_relay(tmp: str, kind: str) -> tuple[subprocess.Popen, int]:
    port, mport = _free_port(), _free_port()
    args = [sys.executable, "-m", "logjam_relay", "--bind", "127.0.0.1", "-q",
            "-t", str(_free_port()), "-p", str(_free_port()), "-P", str(_free_port()),
            "-s", "0", "-m", str(mport), "-M", "127.0.0.1", "--state-dir", tmp,
            "--spool-dir", os.path.join(tmp, f"spool-{port}"),
            "--input", f"{kind}://127.0.0.1:{port}?tls=off"]
    proc = subprocess.Popen(args)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{mport}/readyz", timeout=1):
                return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("relay did not start")


def _write(kind: str, port: int, records, window: int) -> float:
    src = MemorySource()
    for r in records:
        src.append(r)
    if kind == "lumberjack":
        out = LumberjackOutput(src, LumberjackConfig(hosts=(("127.0.0.1", port),),
                                                     window=window, compression=3,
                                                     tls=TLSSettings(enabled=False)))
    else:
        out = CourierOutput(courier_url(f"courier://127.0.0.1:{port}?tls=off&payload={window}"),
                            src)

    async def main():
        async with trio.open_nursery() as n:
            t0 = time.perf_counter()
            n.start_soon(out.run)
            while not src.all_acked:
                await trio.sleep(0.002)
            dt = time.perf_counter() - t0
            n.cancel_scope.cancel()
        return dt

    return len(records) / trio.run(main)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kinds", default="lumberjack,courier")
    a = ap.parse_args()
    records = make_records(a.events)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in a.kinds.split(","):
            parent, child = mp.Pipe()
            sink = mp.Process(target=_sink_main, args=(kind, child), daemon=True)
            sink.start()
            sink_port = parent.recv()
            relay, in_port = _start_relay(tmp, kind)
            rates = {"sink": [], "input": []}
            try:
                for _ in range(a.repeat):
                    rates["sink"].append(_write(kind, sink_port, records, a.window))
                    rates["input"].append(_write(kind, in_port, records, a.window))
            finally:
                relay.terminate()
                relay.wait(10)
                sink.kill()
            s, i = statistics.median(rates["sink"]), statistics.median(rates["input"])
            print(f"{kind:10s} window {a.window}: sink {s:,.0f} ev/s, relay input {i:,.0f} "
                  f"ev/s, input/sink = {i / s:.2f}  (runs: sink "
                  f"{[round(x) for x in rates['sink']]}, input "
                  f"{[round(x) for x in rates['input']]})")


if __name__ == "__main__":
    main()
