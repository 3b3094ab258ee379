"""The in-repo go-lumber-like reader, driven by raw bytes over loopback TCP/TLS."""

import ssl

import pytest
import trio

from logjam_relay.io.net import TLSSettings, connect, server_context
from logjam_relay.protocols import lumberjack as lj
from peers.lumberjack_reader import LumberjackReader


def W(n):
    return lj.encode_window_frame(n)


def D(seq, line=None):
    return lj.encode_data_frame(seq, [("line", line or f"event {seq}")])


async def recv_exactly(stream, n, timeout=5):
    buf = b""
    with trio.fail_after(timeout):
        while len(buf) < n:
            chunk = await stream.receive_some(n - len(buf))
            if not chunk:
                break
            buf += chunk
    return buf


async def recv_until_eof(stream, timeout=5):
    buf = b""
    with trio.fail_after(timeout):
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:   # RST
                return buf
            if not chunk:
                return buf
            buf += chunk


@pytest.fixture
async def reader_factory(nursery):
    async def make(**kw):
        r = LumberjackReader(**kw)
        await nursery.start(r.serve)
        return r
    return make


async def test_window_delivered_and_acked_with_count(reader_factory):
    r = await reader_factory()
    s = await connect("127.0.0.1", r.port)
    await s.send_all(W(2) + D(101) + D(102))
    assert await recv_exactly(s, 6) == lj.encode_ack(2)       # count, not the seq
    assert r.windows_received == 1
    assert [e.seq for e in r.events] == [101, 102]
    await s.aclose()


async def test_ack_mode_last_seq(reader_factory):
    r = await reader_factory(ack_mode="last_seq")
    s = await connect("127.0.0.1", r.port)
    await s.send_all(W(2) + D(101) + D(102))
    assert await recv_exactly(s, 6) == lj.encode_ack(102)
    await s.aclose()


async def test_pipelined_windows_acked_in_order(reader_factory):
    r = await reader_factory()
    s = await connect("127.0.0.1", r.port)
    await s.send_all(W(2) + D(1) + D(2) + W(3) + lj.encode_compressed_frame(
        D(1) + D(2) + D(3)) + W(1) + D(1))
    assert await recv_exactly(s, 18) == lj.encode_ack(2) + lj.encode_ack(3) + lj.encode_ack(1)
    assert [len(w.events) for w in r.windows] == [2, 3, 1]
    await s.aclose()


async def test_window_zero_is_not_acked(reader_factory):
    r = await reader_factory()
    s = await connect("127.0.0.1", r.port)
    await s.send_all(W(0) + W(1) + D(1))
    assert await recv_exactly(s, 6) == lj.encode_ack(1)    # W 0 got no ACK of its own
    await s.aclose()


async def test_async_callback_delays_ack(reader_factory):
    seen = []
    gate = trio.Event()

    async def on_window(w):
        seen.append(len(w.events))
        await gate.wait()

    r = await reader_factory(on_window=on_window, keep_windows=False)
    s = await connect("127.0.0.1", r.port)
    await s.send_all(W(1) + D(1))
    with trio.move_on_after(0.1):
        await s.receive_some(6)
        pytest.fail("acked before the application accepted the window")
    gate.set()
    assert await recv_exactly(s, 6) == lj.encode_ack(1)
    assert seen == [1] and r.windows == []
    await s.aclose()


@pytest.mark.parametrize("data,reason", [
    (W(2) + D(1) + b"1X\x00\x00\x00\x00", "unknown_frame_type"),
    (D(1), "expected_window"),
    (b"2W\x00\x00\x00\x01" + D(1), "bad_version"),
    (W(4) + lj.encode_compressed_frame(D(1) + D(2)) + lj.encode_compressed_frame(D(3) + D(4)),
     "window_split"),
    (W(2) + D(1) + W(1) + D(2), "unexpected_window"),
    (W(10001), "window_too_large"),
    (W(1) + b"1C\x00\x00\x00\x00", "zlib_error"),
])
async def test_protocol_error_closes_without_ack(reader_factory, data, reason):
    r = await reader_factory()
    s = await connect("127.0.0.1", r.port)
    await s.send_all(data)
    assert await recv_until_eof(s) == b""
    assert r.errors == {reason: 1}
    assert r.windows == []
    await s.aclose()


async def test_more_d_than_w_delivers_first_window_but_never_acks_it(reader_factory):
    r = await reader_factory(ack_delay=0.05)
    s = await connect("127.0.0.1", r.port)
    await s.send_all(W(1) + D(1) + D(2))
    assert await recv_until_eof(s) in (b"", lj.encode_ack(1))
    assert r.errors == {"expected_window": 1}
    assert len(r.windows) == 1      # the duplicate caveat of the reference
    await s.aclose()


async def test_truncated_then_fin_closes(reader_factory):
    r = await reader_factory()
    s = await connect("127.0.0.1", r.port)
    await s.send_all(W(1) + D(1)[:-2])
    await s.send_eof()
    assert await recv_until_eof(s) == b""
    assert r.errors == {"truncated": 1}


async def test_truncated_then_silence_closes_after_timeout(reader_factory):
    r = await reader_factory(timeout=0.2)
    s = await connect("127.0.0.1", r.port)
    await s.send_all(W(1) + D(1)[:-2])
    assert await recv_until_eof(s) == b""
    assert r.timeouts == 1 and r.windows == []
    await s.aclose()


async def test_no_deadline_between_windows(reader_factory):
    r = await reader_factory(timeout=0.1)
    s = await connect("127.0.0.1", r.port)
    await s.send_all(W(1) + D(1))
    assert await recv_exactly(s, 6) == lj.encode_ack(1)
    await trio.sleep(0.3)           # idle longer than the window deadline: still open
    await s.send_all(W(1) + D(2))
    assert await recv_exactly(s, 6) == lj.encode_ack(1)
    assert r.timeouts == 0
    await s.aclose()


async def test_close_after_windows_knob(reader_factory):
    r = await reader_factory(close_after_windows=2)
    s = await connect("127.0.0.1", r.port)
    await s.send_all(W(1) + D(1) + W(1) + D(2))
    assert await recv_until_eof(s) == lj.encode_ack(1)   # second delivered, never acked
    assert len(r.windows) == 2


async def test_keepalives_while_ack_delayed(reader_factory):
    r = await reader_factory(ack_delay=0.25, keepalive_interval=0.05)
    s = await connect("127.0.0.1", r.port)
    await s.send_all(W(1) + D(1))
    conn = lj.Connection(lj.Role.WRITER)
    evs = []
    with trio.fail_after(5):
        while not evs or not isinstance(evs[-1], lj.Ack):
            conn.receive_data(await s.receive_some(64))
            while (ev := conn.next_event()) is not lj.NEED_DATA:
                evs.append(ev)
    assert evs[-1] == lj.Ack(1)
    assert all(e == lj.KeepAlive(2) for e in evs[:-1]) and len(evs) >= 2
    await s.aclose()


async def test_tls(reader_factory, tls_files):
    r = await reader_factory(ssl_context=server_context(tls_files["server"]))
    ctx = TLSSettings(ca=tls_files["ca"]).client_context()
    s = await connect("127.0.0.1", r.port, ssl_context=ctx, server_name="localhost")
    await s.send_all(W(2) + lj.encode_compressed_frame(D(1) + D(2)))
    assert await recv_exactly(s, 6) == lj.encode_ack(2)
    assert len(r.events) == 2
    await s.aclose()


async def test_tls_reader_closes_plain_client(reader_factory, tls_files):
    r = await reader_factory(ssl_context=server_context(tls_files["server"]))
    s = await connect("127.0.0.1", r.port)
    await s.send_all(W(1) + D(1))
    assert await recv_until_eof(s) == b""
    assert r.windows == []


async def test_tls_client_rejects_unknown_ca(reader_factory, tls_files):
    r = await reader_factory(ssl_context=server_context(tls_files["server"]))
    with pytest.raises((trio.BrokenResourceError, ssl.SSLError)):
        await connect("127.0.0.1", r.port, ssl_context=TLSSettings().client_context(),
                      server_name="localhost")


async def test_restart_on_same_port(nursery):
    r = LumberjackReader()
    with trio.CancelScope() as cs:
        async with trio.open_nursery() as n:
            port = await n.start(r.serve)
            s = await connect("127.0.0.1", port)
            await s.send_all(W(1) + D(1))
            assert await recv_exactly(s, 6) == lj.encode_ack(1)
            cs.cancel()
    assert await recv_until_eof(s) == b""        # connection closed by the shutdown
    await nursery.start(r.serve)
    assert r.port == port
    s2 = await connect("127.0.0.1", port)
    await s2.send_all(W(1) + D(2))
    assert await recv_exactly(s2, 6) == lj.encode_ack(1)
    assert r.stats()["events_received"] == 2 and r.connections == 2
