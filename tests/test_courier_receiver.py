"""The in-repo Courier receiver over real loopback sockets (TCP and TLS)."""

import zlib

import pytest
import trio

from logjam_relay.io.net import TLSSettings, connect, server_context
from logjam_relay.protocols import courier as P
from peers.courier_receiver import CourierReceiver

NONCE = b"\x11" * 16
HELO = P.encode_hello(P.Helo())


async def read_until_eof(stream, limit=5.0) -> bytes:
    out = bytearray()
    with trio.fail_after(limit):
        try:
            while data := await stream.receive_some(65536):
                out += data
        except trio.BrokenResourceError:     # RST
            pass
    return bytes(out)


async def read_exactly(stream, n, limit=5.0) -> bytes:
    out = bytearray()
    with trio.fail_after(limit):
        while len(out) < n:
            data = await stream.receive_some(n - len(out))
            assert data, f"EOF after {len(out)} of {n} bytes"
            out += data
    return bytes(out)


async def good_exchange(port, events=(b'{"ok":1}',), ssl_context=None):
    """A well-behaved client: HELO, one JDAT, expect VERS + ACKN."""
    s = await connect("127.0.0.1", port, ssl_context=ssl_context)
    try:
        await s.send_all(HELO + P.encode_payload(NONCE, list(events)))
        data = await read_exactly(s, 40 + 28)
        assert data[:4] == b"VERS"
        assert data[40:] == P.encode_ackn(NONCE, len(events))
    finally:
        await s.aclose()


@pytest.fixture
async def receiver(nursery):
    r = CourierReceiver(ack_timeout=0.2)
    r.port = await nursery.start(r.serve)
    return r


def _jdat_raw(body: bytes) -> bytes:
    return b"JDAT" + (16 + len(body)).to_bytes(4, "big") + NONCE + body


# Every row of the reference error table: closed, no ACKN, no ????; the receiver lives on.
ERRORS = {
    "non_zlib": _jdat_raw(b"definitely not zlib"),
    "truncated_zlib": _jdat_raw(zlib.compress(b"\x00\x00\x00\x02{}" * 50)[:-5]),
    "bad_inner_length": _jdat_raw(zlib.compress(b"\x00\x00\x00\x02{}\x00\x01\x00\x00{}")),
    "jdat_too_small": b"JDAT\x00\x00\x00\x10" + NONCE,
    "too_large": b"JDAT\x00\xa0\x00\x01" + b"x" * 100,
    "ping_with_body": b"PING\x00\x00\x00\x01x",
    "helo_too_large": b"HELO\x00\x00\x00\x21" + bytes(33),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
async def test_error_closes_without_reply_and_receiver_recovers(receiver, name):
    s = await trio.open_tcp_stream("127.0.0.1", receiver.port)
    first = b"" if name == "helo_too_large" else HELO
    await s.send_all(first + ERRORS[name])
    data = await read_until_eof(s)
    await s.aclose()
    assert data == (b"" if not first else P.encode_hello(P.GO_VERS))   # VERS only
    assert receiver.events == []
    await good_exchange(receiver.port)
    assert receiver.events == [b'{"ok":1}']
    assert sum(receiver.errors.values()) == 1


async def test_streamed_evnt_rejected_by_ruby_receiver_with_close(nursery):
    r = CourierReceiver(P.RUBY2)
    port = await nursery.start(r.serve)
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(HELO + P.encode_payload(NONCE, [b"{}"], streamed=True))
    data = await read_until_eof(s)
    assert data == bytes.fromhex("564552530000001400000000000000020000000c0000000052594c43")
    assert r.errors == {"too_large": 1}


async def test_length_at_limit_waits(receiver):
    s = await trio.open_tcp_stream("127.0.0.1", receiver.port)
    await s.send_all(HELO + b"JDAT\x00\xa0\x00\x00")
    await read_exactly(s, 40)
    with trio.move_on_after(0.3) as scope:
        await s.receive_some(100)
    assert scope.cancelled_caught          # still waiting for the body, no reply
    await s.aclose()


@pytest.mark.parametrize("behaviour,reply", [
    (P.DEFAULT, P.encode_hello(P.GO_VERS)),
    (P.GO, P.encode_hello(P.GO_VERS)),
    (P.RUBY2, P.encode_hello(P.RUBY_VERS)),
    (P.RUBY1, P.UNKN_FRAME),
])
async def test_handshake_replies_and_streamed_delivery_bytewise(nursery, behaviour, reply):
    r = CourierReceiver(behaviour)
    port = await nursery.start(r.serve)
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(HELO)
    assert await read_exactly(s, len(reply)) == reply
    events = [b'{"i":%d}' % i for i in range(100)]
    data = P.encode_payload(NONCE, events, streamed=behaviour.accept_streaming)
    for i in range(len(data)):
        await s.send_all(data[i:i + 1])
    assert await read_exactly(s, 28) == P.encode_ackn(NONCE, 100)
    await s.send_all(P.PING_FRAME)
    assert await read_exactly(s, 8) == P.PONG_FRAME
    await s.send_eof()
    assert await read_until_eof(s) == b""          # graceful: server closes after our FIN
    assert r.events == events and r.errors == {}


async def test_unknown_type_gets_question_marks(receiver):
    s = await trio.open_tcp_stream("127.0.0.1", receiver.port)
    await s.send_all(HELO + P.frame(b"ZZZZ", b"abc") + P.PING_FRAME)
    data = await read_exactly(s, 40 + 8 + 8)
    assert data[40:] == P.UNKN_FRAME + P.PONG_FRAME
    await s.aclose()


async def test_partial_acks_in_chunks_and_keepalive_timer(nursery):
    gate = trio.Event()
    calls = []

    async def sink(nonce, part):
        calls.append(len(part))
        if len(calls) == 3:
            await gate.wait()

    r = CourierReceiver(ack_chunk=4, sink=sink, ack_timeout=0.1)
    port = await nursery.start(r.serve)
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(HELO + P.encode_payload(NONCE, [b"{}"] * 12))
    await read_exactly(s, 40)
    assert await read_exactly(s, 56) == P.encode_ackn(NONCE, 4) + P.encode_ackn(NONCE, 8)
    # the third chunk blocks: keep-alive ACKNs with the last sequence every ack_timeout
    assert await read_exactly(s, 56) == P.encode_ackn(NONCE, 8) * 2
    gate.set()
    data = await read_exactly(s, 28)
    while data == P.encode_ackn(NONCE, 8):           # a timer ACKN may still be in flight
        data = await read_exactly(s, 28)
    assert data == P.encode_ackn(NONCE, 12)
    assert r.timer_acks_sent >= 2
    await s.aclose()


async def test_ping_while_pending_closes(nursery):
    gate = trio.Event()

    async def sink(nonce, part):
        await gate.wait()

    r = CourierReceiver(P.GO, sink=sink)
    port = await nursery.start(r.serve)
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(HELO + P.encode_payload(NONCE, [b"{}"]) + P.PING_FRAME)
    assert await read_until_eof(s) == P.encode_hello(P.GO_VERS)
    assert r.errors == {"ping_not_idle": 1}
    gate.set()


async def test_pending_limit_acks_ten_then_closes(nursery):
    gate = trio.Event()

    async def sink(nonce, part):
        await gate.wait()

    r = CourierReceiver(P.GO, sink=sink)
    port = await nursery.start(r.serve)
    s = await trio.open_tcp_stream("127.0.0.1", port)
    nonces = [bytes([i]) * 16 for i in range(12)]
    await s.send_all(HELO + b"".join(P.encode_payload(n, [b'{"n":1}']) for n in nonces))
    await read_exactly(s, 40)
    while r.overloaded == 0:
        await trio.sleep(0.01)
    gate.set()
    data = await read_until_eof(s)
    assert data == b"".join(P.encode_ackn(n, 1) for n in nonces[:10])
    assert len(r.events) == 10


async def test_tls(nursery, tls_files):
    r = CourierReceiver(ssl_context=server_context(tls_files["server"]))
    port = await nursery.start(r.serve)
    ctx = TLSSettings(ca=tls_files["ca"]).client_context()
    await good_exchange(port, [b'{"tls":true}'], ssl_context=ctx)
    assert r.events == [b'{"tls":true}']


async def test_kill_drops_connections_and_restart_on_same_port(nursery):
    r = CourierReceiver()
    port = await nursery.start(r.serve)
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(HELO)
    await read_exactly(s, 40)
    r.kill()
    assert await read_until_eof(s) == b""
    port2 = await nursery.start(r.serve, port)
    assert port2 == port
    await good_exchange(port)
