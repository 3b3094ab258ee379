"""Bad input on the inputs, through the real command: every case gets a closed connection
and a labelled counter; the relay survives and its peak memory stays bounded."""

import re
import struct
import urllib.request
import zlib

import trio

from conftest import free_port
from logjam_relay.protocols import courier as P
from logjam_relay.protocols import lumberjack as lj
from relay_harness import relay_settings, start_process, stop_process

BOMB_INFLATED = 256 * 1024 * 1024
BATCH_BUDGET = 8 * 1024 * 1024


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _errors(text: str, inp: str) -> dict[str, float]:
    pattern = (r'logjam_relay_input_errors_total\{device="0",input="' + re.escape(inp) +
               r'",reason="([a-z_]+)"\} (\S+)')
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text)}


def _vm_hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(re.search(r"VmHWM:\s+(\d+) kB", fh.read()).group(1))


async def _closed_by_server(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data``; return what the server sent before it closed the connection."""
    s = await trio.open_tcp_stream("127.0.0.1", port)
    got = b""
    try:
        try:
            await s.send_all(data)
        except trio.BrokenResourceError:
            return got
        with trio.fail_after(timeout):
            while True:
                try:
                    chunk = await s.receive_some(65536)
                except trio.BrokenResourceError:
                    return got
                if not chunk:
                    return got
                got += chunk
    finally:
        await s.aclose()


def _bomb() -> bytes:
    c = zlib.compressobj(9)
    chunk = b"\0" * (1 << 20)
    out = [c.compress(b"1D") ]
    for _ in range(BOMB_INFLATED >> 20):
        out.append(c.compress(chunk))
    out.append(c.flush())
    return b"".join(out)


async def test_bad_input_closes_counts_and_stays_bounded(tmp_path):
    lport, cport = free_port(), free_port()
    s = relay_settings(tmp_path)
    common = f"tls=off&timeout=1s&max_connections=40&max_batch_bytes={BATCH_BUDGET}"
    proc = start_process(s, ["--input", f"lumberjack://127.0.0.1:{lport}?{common}&name=lj",
                             "--input", f"courier://127.0.0.1:{cport}?{common}&name=cr"],
                         log_path=tmp_path / "relay.log")
    try:
        base_kib = _vm_hwm_kib(proc.pid)
        bomb = _bomb()
        assert len(bomb) < 1024 * 1024
        # --- Lumberjack
        assert await _closed_by_server(lport, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == b""
        assert await _closed_by_server(lport, b"1W\x00\x00\x27\x11") == b""       # 10001
        assert await _closed_by_server(
            lport, b"1W\x00\x00\x00\x01" + b"1C" + struct.pack(">I", len(bomb)) + bomb) == b""
        assert await _closed_by_server(
            lport, b"2W\x00\x00\x00\x01" + b"2J\x00\x00\x00\x01\x7f\xff\xff\xff") == b""
        assert await _closed_by_server(lport, b"1W\x00\x00\x00\x01" +
                                       b"1C\x00\x00\x00\x10" + b"\xff" * 16) == b""
        # --- Courier
        assert await _closed_by_server(cport, b"\x00\x01garbage" * 10) == b""
        helo = P.encode_hello(P.Helo())
        jdat = P.frame(P.JDAT, b"n" * 16 + bomb)
        reply = await _closed_by_server(cport, helo + jdat)
        assert reply.startswith(b"VERS") and b"ACKN" not in reply
        # --- slowloris: many connections trickling an unfinished window, each cut after the
        # window timeout (1 s); connections beyond max_connections are refused at once
        async def trickle(results):
            s = await trio.open_tcp_stream("127.0.0.1", lport)
            try:
                await s.send_all(b"1W\x00\x00\x00\x05" + b"1D\x00")
                with trio.fail_after(15):
                    for _ in range(100):
                        try:
                            await s.send_all(b"\x00")
                            with trio.move_on_after(0.2):
                                if not await s.receive_some(10):
                                    results.append("closed")
                                    return
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            results.append("closed")
                            return
                results.append("open")
            finally:
                await s.aclose()

        results: list[str] = []
        async with trio.open_nursery() as nursery:
            for _ in range(60):
                nursery.start_soon(trickle, results)
        assert results == ["closed"] * 60
        # a good window still gets its ACK: the relay is alive and well
        frames = lj.encode_data_frames([{"line": "{}", "app": "a"}] * 3)
        assert await _closed_by_server_ack(lport, lj.encode_window(frames, 3)) == \
            b"1A\x00\x00\x00\x03"
        peak_growth_mib = (_vm_hwm_kib(proc.pid) - base_kib) / 1024
        text = await trio.to_thread.run_sync(_metrics, s.metrics_port)
    finally:
        rc = stop_process(proc)
    ljerr, crerr = _errors(text, "lj"), _errors(text, "cr")
    print(f"bad input: lumberjack errors {ljerr}, courier errors {crerr}, peak RSS growth "
          f"{peak_growth_mib:.1f} MiB (bomb inflates to {BOMB_INFLATED >> 20} MiB)")
    assert rc == 0
    for reason in ("bad_version", "window_too_large", "inflate_too_large", "event_too_large",
                   "zlib_error", "timeout"):
        assert ljerr.get(reason, 0) >= 1, (reason, ljerr)
    assert ljerr.get("too_many_connections", 0) >= 1, ljerr      # 60 trickles > 40 allowed
    assert crerr.get("too_large", 0) >= 1 and sum(crerr.values()) >= 2, crerr
    assert peak_growth_mib < 64, peak_growth_mib


async def _closed_by_server_ack(port: int, data: bytes) -> bytes:
    s = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        await s.send_all(data)
        got = b""
        with trio.fail_after(10):
            while len(got) < 6:
                got += await s.receive_some(6)
        return got
    finally:
        await s.aclose()
