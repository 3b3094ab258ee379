"""A real chain through the real command: edge relay (ZeroMQ in, spool, Lumberjack and
Courier out) -> central relay (Lumberjack and Courier inputs, spool, PUB).

The central relay is SIGKILLed mid-stream 5 times, then stopped for 10 s (the network
between them is cut) and started again.  Figures, per input path:

* lost: 202-accepted edge messages whose origin never reached the central spool: must be 0;
* duplicated: at most one window (100 events) per fault and path;
* the central sequence numbers in its spool are consecutive within each run (after a
  SIGKILL they continue after the crash reservation, after the clean stop at exactly +1),
* every message on the central PUB carries its origin (edge device and sequence).
"""

import json
import os
import signal
import urllib.request

import pytest
import trio
import zmq

from conftest import free_port
from logjam_relay.io import zmq_trio
from relay_harness import meta, relay_settings, start_process, stop_process, unmeta
from spool_helpers import spooled_records

N = 6000
WINDOW = 100
KILLS = 5
STOP_SECONDS = 10.0
BODY = b'{"action":"Chain#test","n":%d,"pad":"..............................."}'


def _metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


def _backlog(text: str) -> float | None:
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("logjam_relay_output_backlog_records{")]
    return sum(vals) if len(vals) == 2 else None


@pytest.mark.slow
def test_chain_sigkill_and_outage_lose_nothing(tmp_path):
    lport, cport = free_port(), free_port()
    central = relay_settings(tmp_path / "central", device_id=2)
    edge = relay_settings(tmp_path / "edge", device_id=1)
    c_spool, c_archive = tmp_path / "central-spool", tmp_path / "central-archive"
    c_args = ["--input", f"lumberjack://127.0.0.1:{lport}?tls=off&name=lj",
              "--input", f"courier://127.0.0.1:{cport}?tls=off&name=cr",
              "--spool-dir", str(c_spool), "--archive-dir", str(c_archive),
              "--archive-retention", "7d"]
    e_args = ["--spool-dir", str(tmp_path / "edge-spool"),
              "--output", f"lumberjack://127.0.0.1:{lport}?tls=off&window={WINDOW}&pipeline=1"
                          "&timeout=5&backoff_min=0.05&backoff_max=0.5&name=lj",
              "--output", f"courier://127.0.0.1:{cport}?tls=off&payload={WINDOW}&pending=1"
                          "&timeout=5&backoff=0.05&backoff_max=0.5&name=cr"]
    log = tmp_path / "relays.log"
    cproc = start_process(central, c_args, log_path=log)
    eproc = start_process(edge, e_args, log_path=log)
    pub_seen: list[tuple[int, dict]] = []
    accepted = 0
    total = 0
    faults = 0

    async def main():
        nonlocal cproc, accepted, faults
        outage_over, produced = trio.Event(), trio.Event()
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(f"tcp://127.0.0.1:{central.pub_port}")
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{edge.router_port}")

        async def subscriber():
            while True:
                m = await zmq_trio.recv_multipart(sub)
                if m[0] != b"heartbeat":
                    pub_seen.append((unmeta(m[3])[5], json.loads(m[2])))

        async def producer():
            """At least N messages, and on until the central relay is back after the outage
            (the stream spans every fault however long the kills take on a busy machine)."""
            nonlocal accepted, total
            start = 0
            while start < N or not outage_over.is_set():
                for i in range(start, start + 50):
                    await zmq_trio.send_multipart(dealer, [b"", b"chain-test", b"logs.chain.test",
                                                           BODY % i, meta(dev=0)])
                for _ in range(50):
                    with trio.fail_after(10):
                        r = await zmq_trio.recv_multipart(dealer)
                    assert r[-1] == b"202 Accepted"
                    accepted += 1
                start += 50
                total = start
                await trio.sleep(0.12)      # ~400 msg/s
            produced.set()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(subscriber)
                nursery.start_soon(producer)
                async def mid_stream():
                    """Until this run of the central relay has published 150 more events."""
                    n0 = len(pub_seen)
                    with trio.fail_after(60):
                        while len(pub_seen) < n0 + 150:
                            await trio.sleep(0.005)

                for _ in range(KILLS):
                    await mid_stream()
                    os.kill(cproc.pid, signal.SIGKILL)
                    cproc.wait()
                    faults += 1
                    cproc = await trio.to_thread.run_sync(start_process, central, c_args, log)
                await mid_stream()
                assert stop_process(cproc) == 0            # the network cut: 10 s without it
                faults += 1
                await trio.sleep(STOP_SECONDS)
                cproc = await trio.to_thread.run_sync(start_process, central, c_args, log)
                await mid_stream()
                outage_over.set()
                with trio.fail_after(120):
                    await produced.wait()
                    while accepted < total or _backlog(await trio.to_thread.run_sync(
                            _metrics, edge.metrics_port)) != 0:
                        await trio.sleep(0.2)
                await trio.sleep(0.5)          # the last messages reach the subscriber
                nursery.cancel_scope.cancel()
        finally:
            ctx.destroy(linger=0)

    try:
        trio.run(main)
    finally:
        crc = stop_process(cproc)
        erc = stop_process(eproc)
    assert (crc, erc) == (0, 0)

    # ---- what reached the central relay, from its spool + archive
    seqs: list[int] = []
    origins: dict[str, list[int]] = {"lj": [], "cr": []}
    for frames in spooled_records([c_spool, c_archive]):
        _t, _c, _v, device, _created, seq = unmeta(frames[3])
        assert device == 2
        seqs.append(seq)
        if frames[0] == b"heartbeat":
            continue
        doc = json.loads(frames[2])
        o = doc["logjam_origin"]
        assert (o["device"], o["host"]) == (1, "vm") and frames[:2] == [b"chain-test",
                                                                          b"logs.chain.test"]
        assert o["sequence"] >= 1 and doc["n"] < total
        origins[o["input"]].append(doc["n"])
    figures = {}
    missing = {}
    for path, ns in origins.items():
        lost = total - len(set(ns))
        dup = len(ns) - len(set(ns))
        figures[path] = (lost, dup)
        missing[path] = sorted(set(range(total)) - set(ns))[:20]     # which, to debug a loss
    jumps = [(a, b) for a, b in zip(seqs, seqs[1:], strict=False) if b != a + 1]
    pub_origins = sum(1 for _, d in pub_seen if d.get("logjam_origin", {}).get("device") == 1)
    print(f"chain: accepted {accepted}, faults {faults} (SIGKILL x{KILLS} + {STOP_SECONDS:g} s "
          f"stop); lumberjack lost/dup {figures['lj']}, courier lost/dup {figures['cr']}; "
          f"central spool sequence jumps {len(jumps)} {jumps}; PUB messages seen "
          f"{len(pub_seen)}, with origin {pub_origins}")
    assert accepted == total >= N
    for path, (lost, dup) in figures.items():
        assert lost == 0, (path, figures, missing)
        assert dup <= faults * WINDOW, (path, figures)
    # central sequences: consecutive within a run, never reused; a SIGKILL may jump ahead
    assert all(b > a for a, b in jumps), jumps
    assert len(jumps) <= KILLS, jumps
    assert pub_seen and pub_origins == len(pub_seen)
    pub_seqs = [s for s, _ in pub_seen]
    assert len(set(pub_seqs)) == len(pub_seqs)             # no number published twice
