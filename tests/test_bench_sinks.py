"""The C benchmark sinks (bench/sink.c) ACK what the real outputs send and count right.

bench_durable.py relies on them as receivers that are not the bottleneck; a sink that
ACKs wrongly would stall the writer (no ACK) or lose events (early ACK), so both
protocols are driven here by the relay's own output classes over loopback TCP, with
zlib on and off (Lumberjack) and JDAT and streamed EVNT (Courier).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess

import pytest
import trio

from logjam_relay.io.net import TLSSettings
from logjam_relay.outputs.courier import CourierConfig, CourierOutput
from logjam_relay.outputs.lumberjack import LumberjackConfig, LumberjackOutput
from logjam_relay.protocols.logjam import encode_meta
from logjam_relay.spool.api import MemorySource

SRC = os.path.join(os.path.dirname(__file__), "..", "bench", "sink.c")


@pytest.fixture(scope="module")
def sink_bin(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler: the bench sinks cannot be built")
    out = str(tmp_path_factory.mktemp("sink") / "sink")
    r = subprocess.run([cc, "-O2", "-o", out, SRC, "-lz"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


class Sink:
    def __init__(self, binary: str, *args: str):
        self.proc = subprocess.Popen([binary, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        word, port = self.proc.stdout.readline().split()
        assert word == "port"
        self.port = int(port)

    def counts(self) -> tuple[int, int, int, int]:
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        word, *nums = self.proc.stdout.readline().split()
        assert word == "count"
        return tuple(int(x) for x in nums)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(5)


def source(n: int) -> MemorySource:
    src = MemorySource()
    for i in range(n):
        body = json.dumps({"action": "A#b", "code": 200, "request_id": f"{i:032x}",
                           "message": "x" * 150}).encode()
        src.append([b"app-production", b"logs.app.production", body,
                    encode_meta(0, 1, 1_700_000_000_000 + i, i + 1)])
    return src


async def drain(out, src: MemorySource) -> None:
    async with trio.open_nursery() as n:
        n.start_soon(out.run)
        with trio.fail_after(30):
            while not src.all_acked:
                await trio.sleep(0.01)
        n.cancel_scope.cancel()


@pytest.mark.parametrize("level", [0, 3])
async def test_lumberjack_sink_acks_every_window(sink_bin, level):
    sink = Sink(sink_bin, "lumberjack", "0")
    try:
        n = 2_345   # not a multiple of the window: the last window is short
        src = source(n)
        cfg = LumberjackConfig(hosts=(("127.0.0.1", sink.port),), window=1000,
                               compression=level, pipeline=4, tls=TLSSettings(enabled=False),
                               relay_host="t", timeout=10)
        await drain(LumberjackOutput(src, cfg), src)
        events, windows, nbytes, errors = sink.counts()
        assert (events, windows, errors) == (n, 3, 0)
        assert nbytes > 0
    finally:
        sink.close()


@pytest.mark.parametrize("mode", ["evnt", "jdat"])
async def test_courier_sink_acks_every_payload(sink_bin, mode):
    sink = Sink(sink_bin, "courier", "0", mode)
    try:
        n = 2_345
        src = source(n)
        cfg = CourierConfig(hosts=(("127.0.0.1", sink.port),), payload_size=500,
                            tls=TLSSettings(enabled=False), hostname="t")
        out = CourierOutput(cfg, src)
        await drain(out, src)
        events, payloads, _, errors = sink.counts()
        assert (events, payloads, errors) == (n, 5, 0)
    finally:
        sink.close()


def test_courier_sink_answers_ping_and_unknown(sink_bin):
    sink = Sink(sink_bin, "courier", "0")
    try:
        with socket.create_connection(("127.0.0.1", sink.port), timeout=5) as s:
            s.sendall(b"PING\0\0\0\0" + b"WHAT\0\0\0\0")
            got = b""
            while len(got) < 16:
                got += s.recv(64)
            assert got == b"PONG\0\0\0\0????\0\0\0\0"
        s2 = socket.create_connection(("127.0.0.1", sink.port), timeout=5)
        s2.sendall(b"JDAT\0\0\0\x14" + b"n" * 16 + b"junk")   # not zlib: disconnected
        assert s2.recv(64) == b""
        s2.close()
        assert sink.counts()[3] == 1
    finally:
        sink.close()
