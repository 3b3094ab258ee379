"""The restart marker, through the real command (docs/spool-format.md, "Restart marker").

A relay SIGKILLed with a spool continues after its sequence reservation; on that start it
spools -- and does not publish -- one heartbeat-shaped record with the first number of
the new run whose body names the numbers it skipped,
``{"restart":{"skipped_from":A,"skipped_to":B}}``: A = 1 + the last number spooled (or
the state file's checkpoint, if higher), B = the number before the marker's.  A clean
stop (SIGTERM) and start gives none.  A Lumberjack output with ``heartbeats=on`` forwards
it like any heartbeat; PUB's subscribers never see it.
"""

import json
import os
import signal
import time
import urllib.request

import pytest
import trio
import zmq

from conftest import free_port
from logjam_relay.io import zmq_trio
from peers.lumberjack_reader import LumberjackReader
from relay_harness import meta, relay_settings, start_process, stop_process, sync_sub, unmeta
from spool_helpers import spooled_records

BODY = b'{"action":"Restart#test","n":%d}'


def _metric(text: str, name: str) -> float:
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")]
    assert len(vals) == 1, (name, vals)
    return vals[0]


async def _extra_publishes(port: int, requests: int) -> float:
    """PUB's publishes that were neither heartbeats nor the ``requests`` sent: 0, once
    PUB's thread has counted the last heartbeat it was handed (polled until then)."""
    extra = None
    with trio.move_on_after(10):
        while extra != 0:
            text = await trio.to_thread.run_sync(_scrape, port)
            extra = _metric(text, "logjam_relay_published_total") - \
                _metric(text, "logjam_relay_heartbeats_total") - requests
            await trio.sleep(0.02)
    return extra


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def _seq(frames) -> int:
    return unmeta(frames[3])[5]


@pytest.mark.parametrize("fsync", ["batch", "interval"])
def test_sigkill_restart_spools_one_marker_with_the_skipped_range(tmp_path, fsync):
    settings = relay_settings(tmp_path, device_id=7, heartbeat_interval=0.2)
    spool = tmp_path / "spool"
    state = tmp_path / "state" / "sequence-device-7.json"
    log = tmp_path / "relay.log"
    reader = LumberjackReader()
    got: dict = {}

    async def main():
        ctx = zmq.Context()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(reader.serve)
                args = ["--spool-dir", str(spool), "--spool-fsync", fsync,
                        "--output", f"lumberjack://127.0.0.1:{reader.port}?tls=off"
                                    "&heartbeats=on&window=20&backoff_min=0.05&backoff_max=0.2"]
                seen: list[list[bytes]] = []

                async def subscriber(sub):
                    while True:
                        seen.append(await zmq_trio.recv_multipart(sub))

                async def run(n0: int, n: int):
                    """Start a relay, send n requests (each answered 202), return the
                    process and what its PUB published meanwhile (a fresh SUB)."""
                    proc = await trio.to_thread.run_sync(start_process, settings, args, log)
                    sub = ctx.socket(zmq.SUB)
                    sub.setsockopt(zmq.SUBSCRIBE, b"")
                    sub.setsockopt(zmq.RCVHWM, 0)
                    sub.connect(f"tcp://127.0.0.1:{settings.pub_port}")
                    await sync_sub(sub, timeout=15)
                    start_extra = await _extra_publishes(settings.metrics_port, 0)
                    seen.clear()
                    dealer = ctx.socket(zmq.DEALER)
                    dealer.setsockopt(zmq.LINGER, 0)
                    dealer.connect(f"tcp://127.0.0.1:{settings.router_port}")
                    async with trio.open_nursery() as inner:
                        inner.start_soon(subscriber, sub)
                        for i in range(n0, n0 + n):
                            await zmq_trio.send_multipart(dealer, [b"", b"restart-test",
                                                                   b"logs.restart", BODY % i,
                                                                   meta(dev=0)])
                            with trio.fail_after(15):
                                r = await zmq_trio.recv_multipart(dealer)
                            assert r[-1] == b"202 Accepted"
                        with trio.fail_after(15):
                            while sum(m[0] == b"restart-test" for m in seen) < n:
                                await trio.sleep(0.01)
                        inner.cancel_scope.cancel()
                    # every publish since start-up: the heartbeats and the n requests
                    got.setdefault("unexplained_publishes", []).append(
                        (start_extra, await _extra_publishes(settings.metrics_port, n)))
                    dealer.close()
                    sub.close()
                    return proc, list(seen)

                proc, _ = await run(0, 40)
                await trio.sleep(0.3)           # a heartbeat or two after the data
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                got["before"] = spooled_records([spool])
                got["state"] = json.loads(state.read_text())
                t0 = time.time()
                proc, got["pub2"] = await run(40, 40)
                got["restart_window"] = (t0, time.time())
                assert stop_process(proc) == 0                  # clean stop ...
                got["after_run2"] = spooled_records([spool])
                proc, got["pub3"] = await run(80, 10)           # ... and start: no marker
                with trio.fail_after(30):       # the output forwarded everything
                    while not {_seq(f) for f in spooled_records([spool])} <= \
                            {_seq_of_event(e) for e in reader.events}:
                        await trio.sleep(0.05)
                assert stop_process(proc) == 0
                nursery.cancel_scope.cancel()
        finally:
            ctx.destroy(linger=0)

    trio.run(main)
    before, st = got["before"], got["state"]
    every = spooled_records([spool])
    last = _seq(before[-1])                     # the last number spooled before the crash
    assert [_seq(f) for f in before] == list(range(1, last + 1))   # data and heartbeats
    assert sum(f[0] == b"restart-test" for f in before) == 40
    assert st["clean"] is False and st["sequence"] <= last < st["reserved"]
    first = st["reserved"] + 1                  # the new run continues after the reservation
    # the spool of the first run is untouched; the marker follows it, then the new run
    assert every[:len(before)] == before
    marker = every[len(before)]
    assert marker[:3] == [b"heartbeat", b"tcp://vm:%d" % settings.pub_port,
                          b'{"restart":{"skipped_from":%d,"skipped_to":%d}}' % (
                              last + 1, first - 1)]
    tag, comp, ver, device, created, seq = unmeta(marker[3])
    assert (tag, comp, ver, device, seq) == (0xCABD, 0, 1, 7, first)
    t0, t1 = got["restart_window"]
    assert t0 - 1 <= created / 1000 <= t1 + 1            # stamped when the relay started
    rest = every[len(before) + 1:]
    assert [_seq(f) for f in rest] == list(range(first + 1, first + 1 + len(rest)))
    assert [f[2] for f in rest if f[0] == b"restart-test"] == [BODY % i for i in range(40, 90)]
    assert all(f[0] == b"restart-test" or f[:3] == [b"heartbeat", marker[1], b"{}"]
               for f in rest)
    # the clean stop and start: no marker, no gap (checked above: rest is consecutive)
    assert sum(b"restart" in f[2] and f[0] == b"heartbeat" for f in every) == 1
    # never published: not seen on PUB, and PUB published only heartbeats and requests
    for pub in (got["pub2"], got["pub3"]):
        assert not [m for m in pub if m[0] == b"heartbeat" and m[2] != b"{}"]
        assert first not in {unmeta(m[3])[5] for m in pub}
    assert got["unexplained_publishes"] == [(0, 0)] * 3
    # the output (heartbeats=on) forwarded it like any heartbeat
    fwd = [e.fields for e in reader.events if e.fields["sequence"] == str(first)]
    assert fwd and all(f == {"line": marker[2].decode(), "app": "heartbeat", "env": "",
                             "topic": f"tcp://vm:{settings.pub_port}", "device": "7",
                             "sequence": str(first), "created_ms": str(created),
                             "host": f["host"], "type": "logjam"} for f in fwd)


def _seq_of_event(ev) -> int:
    return int(ev.fields["sequence"])


# ------------------------------------------------------------- the range itself

def _state(tmp_path, payload):
    from logjam_relay.relay.sequence import SequenceState
    path = tmp_path / "seq.json"
    if payload is not None:
        path.write_text(json.dumps({"device": 7, **payload}))
    return SequenceState(path, 7)


@pytest.mark.parametrize("payload,spool_last,first,skipped", [
    (None, None, 1, None),                                            # first start
    (None, 41, 42, None),                                             # state file lost
    ({"sequence": 90, "clean": True}, 90, 91, None),                  # clean stop
    ({"sequence": 0, "reserved": 100_000, "clean": False}, 43, 100_001, (44, 100_000)),
    ({"sequence": 0, "reserved": 100_000, "clean": False}, None, 100_001, (1, 100_000)),
    # the state file's checkpoint is ahead of the spool (numbers used, not spooled)
    ({"sequence": 500, "reserved": 100_500, "clean": False}, 43, 100_501, (501, 100_500)),
    # the spool reached the reservation: nothing skipped
    ({"sequence": 0, "reserved": 100, "clean": False}, 100, 101, None),
    ({"sequence": 100, "reserved": 100, "clean": False}, None, 101, None),
    # the spool is past the state file: continue after the spool, nothing skipped
    ({"sequence": 0, "reserved": 100, "clean": False}, 150, 151, None),
])
def test_skipped_range(tmp_path, payload, spool_last, first, skipped):
    st = _state(tmp_path, payload)
    assert st.load(spool_last) == first
    assert st.skipped() == skipped
    if skipped is not None:
        assert skipped[1] == first - 1 and st.recovered_from == "crash"


def test_no_spool_no_marker_and_no_number_taken():
    from logjam_relay.relay.stamping import Pipeline
    from logjam_relay.relay.ticker import Ticker
    p = Pipeline(7, 100_001, lambda recs: None, fqdn=b"vm")
    spooled = []
    kw = dict(pipeline=p, publish=lambda f: pytest.fail("published"), fqdn="vm", device_id=7,
              pub_port=9606, heartbeat_interval=5, stats_interval=1, publish_stats=None,
              sequence_state=None)
    assert Ticker(**kw, spool_frames=None).restart_marker(44, 100_000) is None
    assert p.seq == 100_000
    assert Ticker(**kw, spool_frames=spooled.append).restart_marker(44, 100_000) == 100_001
    assert p.seq == 100_001 and len(spooled) == 1
    assert spooled[0][:3] == [b"heartbeat", b"tcp://vm:9606",
                              b'{"restart":{"skipped_from":44,"skipped_to":100000}}']
    assert unmeta(spooled[0][3])[3:6:2] == (7, 100_001)


# ------------------------------------------------- an edge into a central relay

def test_every_number_of_an_edge_is_accounted_for_at_the_central_relay(tmp_path):
    """An edge relay (heartbeats=on) into a central relay's Lumberjack input; the edge is
    SIGKILLed and restarted.  In the central spool, the edge's numbers -- its requests,
    heartbeats and restart marker, by their ``logjam_origin`` -- plus the marker's range
    are every number from 1 to the edge's last, nothing left over.  The central relay
    publishes the forwarded heartbeats on its PUB (docs/inputs.md)."""
    lport = free_port()
    central = relay_settings(tmp_path / "central", device_id=100, heartbeat_interval=0.2)
    edge = relay_settings(tmp_path / "edge", device_id=7, heartbeat_interval=0.2)
    c_spool, e_spool = tmp_path / "central-spool", tmp_path / "edge-spool"
    c_args = ["--input", f"lumberjack://127.0.0.1:{lport}?tls=off&name=lj",
              "--spool-dir", str(c_spool)]
    e_args = ["--spool-dir", str(e_spool),
              "--output", f"lumberjack://127.0.0.1:{lport}?tls=off&heartbeats=on&window=20"
                          "&backoff_min=0.05&backoff_max=0.2&name=lj"]
    log = tmp_path / "relays.log"
    cproc = start_process(central, c_args, log_path=log)
    eproc = start_process(edge, e_args, log_path=log)
    pub: list[list[bytes]] = []

    def edge_numbers():
        return {_seq(f) for f in spooled_records([e_spool])}

    def central_origins():
        out = {}
        for f in spooled_records([c_spool]):
            if f[2].startswith(b'{"logjam_origin":'):
                doc = json.loads(f[2])
                out[doc["logjam_origin"]["sequence"]] = (f[0], f[1], doc)
        return out

    async def main():
        nonlocal eproc
        ctx = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{central.pub_port}")

            async def send(n0, n):
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(f"tcp://127.0.0.1:{edge.router_port}")
                for i in range(n0, n0 + n):
                    await zmq_trio.send_multipart(dealer, [b"", b"restart-test", b"logs.restart",
                                                           BODY % i, meta(dev=0)])
                    with trio.fail_after(15):
                        assert (await zmq_trio.recv_multipart(dealer))[-1] == b"202 Accepted"
                dealer.close()

            async with trio.open_nursery() as nursery:
                async def subscriber():
                    while True:
                        pub.append(await zmq_trio.recv_multipart(sub))
                nursery.start_soon(subscriber)
                await send(0, 30)
                await trio.sleep(0.5)
                os.kill(eproc.pid, signal.SIGKILL)
                eproc.wait()
                eproc = await trio.to_thread.run_sync(start_process, edge, e_args, log)
                await send(30, 30)
                await trio.sleep(0.5)
                with trio.fail_after(30):
                    while not edge_numbers() <= set(await trio.to_thread.run_sync(
                            central_origins)):
                        await trio.sleep(0.1)
                nursery.cancel_scope.cancel()
        finally:
            ctx.destroy(linger=0)

    try:
        trio.run(main)
    finally:
        erc, crc = stop_process(eproc), stop_process(cproc)
    assert (erc, crc) == (0, 0)
    origins = central_origins()
    markers = [doc["restart"] for stream, _t, doc in origins.values() if "restart" in doc]
    assert len(markers) == 1
    a, b = markers[0]["skipped_from"], markers[0]["skipped_to"]
    numbers = set(origins) | set(range(a, b + 1))
    assert numbers == set(range(1, max(origins) + 1))           # every number, once
    assert not set(origins) & set(range(a, b + 1))
    kinds = {}
    for stream, topic, doc in origins.values():
        assert doc["logjam_origin"]["device"] == 7 and doc["logjam_origin"]["input"] == "lj"
        if stream == b"heartbeat":
            assert topic == b"tcp://vm:%d" % edge.pub_port
        kinds[stream] = kinds.get(stream, 0) + 1
    assert kinds[b"restart-test"] == 60 and kinds[b"heartbeat"] >= 2
    # the central publishes forwarded heartbeats (and the marker) like any mapped message
    fwd = [m for m in pub if m[0] == b"heartbeat" and m[2].startswith(b'{"logjam_origin":')]
    own = [m for m in pub if m[0] == b"heartbeat" and m[2] == b"{}"]
    assert fwd and own and all(unmeta(m[3])[3] == 100 for m in fwd + own)
