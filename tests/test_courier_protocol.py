"""Sans-IO Courier core: framing, limits, client and server state machines.

Hex strings are the bytes measured on the wire (shared/specs/reference/courier.md).
"""

import zlib

import pytest

from logjam_relay.protocols import courier as P

NONCE = bytes.fromhex("00000000000000002020202020202000")


def feed(reader_or_conn, data, *args, bytewise=False):
    """Feed data (optionally one byte at a time) and collect every event."""
    out = []
    chunks = [data[i:i + 1] for i in range(len(data))] if bytewise else [data]
    for c in chunks:
        reader_or_conn.receive_data(c)
        while (ev := reader_or_conn.next_event(*args)) is not None:
            out.append(ev)
    return out


# ------------------------------------------------------------------ framing


def test_vers_from_ruby_receiver_parses():
    raw = bytes.fromhex("56455253000000140000000000000002" "0000000c0000000052594c43")
    (ev,) = feed(P.FrameReader("client"), raw)
    assert ev == P.Vers(0, 2, 12, 0, b"RYLC", False)
    assert not ev.supports_evnt


def test_vers_from_go_receiver_advertises_evnt_and_roundtrips():
    raw = bytes.fromhex("56455253000000200100000000000002" "0000000c000000004c435652"
                        "000000000000000000000000")
    (ev,) = feed(P.FrameReader("client"), raw)
    assert ev.supports_evnt and ev.long and ev.ident == b"LCVR"
    assert P.encode_hello(ev) == raw
    assert P.encode_hello(P.GO_VERS) == raw


def test_helo_is_32_bytes_and_short_or_long_bodies_are_accepted():
    helo = P.encode_hello(P.Helo())
    assert helo[:8] == b"HELO\x00\x00\x00\x20" and len(helo) == 40
    r = P.FrameReader("server", max_handshake=P.MAX_LENGTH)
    # body < 8 bytes = zeros; extra bytes ignored (R2)
    evs = feed(r, P.frame(P.HELO, b"\x01") + P.frame(P.HELO, bytes(20) + b"x" * 50))
    assert evs[0].flags == 0x01000000 and evs[1].ident == bytes(4)


def test_ackn_matches_capture():
    assert P.encode_ackn(NONCE, 1).hex() == (
        "41434b4e00000014" "00000000000000002020202020202000" "00000001")
    (ev,) = feed(P.FrameReader("client"), P.encode_ackn(NONCE, 1000))
    assert ev == P.Ackn(NONCE, 1000)


@pytest.mark.parametrize("bytewise", [False, True])
def test_jdat_roundtrip(bytewise):
    events = [b'{"a":1}', b"", b'{"b":"' + b"x" * 5000 + b'"}']
    data = P.encode_payload(NONCE, events) + P.PING_FRAME
    assert data[:4] == b"JDAT" and data[24:26] == b"\x78\x5e"    # zlib level 3 as Go
    evs = feed(P.FrameReader("server"), data, bytewise=bytewise)
    assert evs == [P.Payload(NONCE, tuple(events), False), P.Ping()]


@pytest.mark.parametrize("bytewise", [False, True])
def test_evnt_is_streamed_and_ends_at_the_end_of_the_zlib_stream(bytewise):
    events = [b'{"n":%d}' % i for i in range(300)]
    data = P.encode_payload(NONCE, events, streamed=True)
    assert data[:8] == b"EVNT\xff\xff\xff\xff"
    evs = feed(P.FrameReader("server"), data + data + P.PING_FRAME, bytewise=bytewise)
    assert evs == [P.Payload(NONCE, tuple(events), True)] * 2 + [P.Ping()]


def test_unknown_type_body_is_skipped():
    r = P.FrameReader("server")
    evs = feed(r, P.frame(b"ZZZZ", b"abc") + P.PING_FRAME, bytewise=True)
    assert evs == [P.UnknownMessage(b"ZZZZ", 3), P.Ping()]


def _jdat_raw(body: bytes) -> bytes:
    return b"JDAT" + (16 + len(body)).to_bytes(4, "big") + NONCE + body


@pytest.mark.parametrize("data,reason", [
    (_jdat_raw(b"not zlib at all"), "zlib"),
    (_jdat_raw(zlib.compress(b"\x00\x00\x00\x05hello" * 100)[:-6]), "zlib_truncated"),
    (_jdat_raw(zlib.compress(b"\x00\x00\x00\x02{}\x00\x00\x01\x00{}")), "bad_event_length"),
    (_jdat_raw(zlib.compress(b"\x00\x00")), "bad_event_length"),
    (_jdat_raw(zlib.compress(b"") + b"junk"), "zlib_trailing"),
    (b"JDAT\x00\x00\x00\x10" + NONCE, "too_small"),
    (b"JDAT\x00\xa0\x00\x01", "too_large"),                    # 10485761, header only
    (b"ZZZZ\x00\xa0\x00\x01", "too_large"),
    (b"PING\x00\x00\x00\x01x", "bad_length"),
])
def test_server_side_errors(data, reason):
    r = P.FrameReader("server")
    with pytest.raises(P.CourierError) as ei:
        feed(r, data)
    assert ei.value.reason == reason


def test_length_at_the_limit_waits_for_the_body():
    r = P.FrameReader("server")
    assert feed(r, b"JDAT\x00\xa0\x00\x00") == []


def test_streamed_evnt_refused_when_not_supported():
    r = P.FrameReader("server", allow_stream=False)
    with pytest.raises(P.CourierError) as ei:
        feed(r, P.encode_payload(NONCE, [b"{}"], streamed=True))
    assert ei.value.reason == "too_large"


def test_inflate_limit():
    r = P.FrameReader("server", max_uncompressed=1000)
    with pytest.raises(P.CourierError):
        feed(r, P.encode_payload(NONCE, [b"x" * 2000]))
    r = P.FrameReader("server", max_uncompressed=1000)
    with pytest.raises(P.CourierError):
        feed(r, P.encode_payload(NONCE, [b"x" * 2000], streamed=True))


@pytest.mark.parametrize("data,reason", [
    (b"ACKN\x00\x00\x00\x13" + bytes(19), "bad_length"),
    (b"PONG\x00\x00\x00\x01x", "bad_length"),
    (b"????\x00\x00\x00\x01x", "bad_length"),
    (b"VERS\x00\xa0\x00\x01", "too_large"),
])
def test_client_side_errors(data, reason):
    with pytest.raises(P.CourierError) as ei:
        feed(P.FrameReader("client"), data)
    assert ei.value.reason == reason


# ------------------------------------------------------------- client state


def ready_client(vers=P.GO_VERS, **kw):
    c = P.ClientConnection(**kw)
    c.start(0.0)
    reply = P.UNKN_FRAME if vers is None else P.encode_hello(vers)
    (ev,) = feed(c, reply, 0.0)
    assert isinstance(ev, P.HandshakeComplete)
    return c, ev


def test_handshake_variants():
    c, ev = ready_client(P.GO_VERS)
    assert ev.streaming and c.streaming
    assert c.send_payload(NONCE, [b"{}"], 0.0)[:4] == b"EVNT"
    c, ev = ready_client(P.RUBY_VERS)
    assert not ev.streaming
    assert c.send_payload(NONCE, [b"{}"], 0.0)[:4] == b"JDAT"
    c, ev = ready_client(None)                  # ???? = no handshake, JDAT
    assert ev == P.HandshakeComplete(False, None)
    c, ev = ready_client(P.GO_VERS, allow_streaming=False)
    assert not ev.streaming


@pytest.mark.parametrize("reply", [P.PONG_FRAME, P.encode_ackn(NONCE, 1), P.frame(b"ZZZZ")])
def test_handshake_rejects_anything_but_vers_or_unknown(reply):
    c = P.ClientConnection()
    c.start(0.0)
    with pytest.raises(P.CourierError) as ei:
        feed(c, reply, 0.0)
    assert ei.value.reason == "handshake"


def test_payload_before_handshake_and_empty_payload_refused():
    c = P.ClientConnection()
    c.start(0.0)
    assert not c.can_send()
    with pytest.raises(RuntimeError):
        c.send_payload(NONCE, [b"{}"], 0.0)
    c, _ = ready_client()
    with pytest.raises(ValueError):
        c.send_payload(NONCE, [], 0.0)


def test_window_limit():
    c, _ = ready_client(max_pending=3)
    for i in range(3):
        c.send_payload(bytes([i]) * 16, [b"{}"], 0.0)
    assert not c.can_send()
    feed(c, P.encode_ackn(bytes([0]) * 16, 1), 1.0)
    assert c.can_send()


def test_partial_acks_keepalive_and_clamping():
    c, _ = ready_client()
    n2 = b"\x02" * 16
    c.send_payload(NONCE, [b"{}"] * 10, 0.0)
    evs = feed(c, b"".join([
        P.encode_ackn(b"\x09" * 16, 5),     # unknown nonce: ignored
        P.encode_ackn(NONCE, 4),            # partial
        P.encode_ackn(NONCE, 4),            # no advance: keep-alive
        P.encode_ackn(NONCE, 2),            # going back: ignored (keep-alive)
        P.encode_ackn(NONCE, 1000),         # beyond count: complete
        P.encode_ackn(NONCE, 1000),         # now unknown
    ]), 1.0)
    assert evs == [P.PayloadAck(NONCE, 4, 4, False), P.PayloadAck(NONCE, 4, 0, False),
                   P.PayloadAck(NONCE, 4, 0, False), P.PayloadAck(NONCE, 10, 6, True)]
    assert c.ignored_acks == 2 and c.keepalive_acks == 2 and not c.pending
    c.send_payload(n2, [b"{}"], 2.0)
    assert feed(c, P.encode_ackn(n2, 0), 2.0) == [P.PayloadAck(n2, 0, 0, False)]


def test_network_timeout_is_reset_by_every_ackn_for_a_known_nonce():
    c, _ = ready_client(network_timeout=15.0)
    c.send_payload(NONCE, [b"{}"] * 3, 100.0)
    assert c.deadline() == 115.0
    c.check(114.9)
    feed(c, P.encode_ackn(NONCE, 0), 110.0)            # keep-alive, no progress
    assert c.deadline() == 125.0
    feed(c, P.encode_ackn(b"\x07" * 16, 0), 120.0)     # unknown nonce: no reset
    assert c.deadline() == 125.0
    with pytest.raises(P.CourierError) as ei:
        c.check(125.0)
    assert ei.value.reason == "timeout"


def test_handshake_timeout():
    c = P.ClientConnection(network_timeout=15.0)
    c.start(10.0)
    c.check(24.0)
    with pytest.raises(P.CourierError):
        c.check(25.0)


def test_ping_only_when_idle_and_pong_timeout():
    c, _ = ready_client(idle_ping=10.0, network_timeout=15.0)
    assert not c.want_ping(9.9) and c.want_ping(10.0)
    c.send_payload(NONCE, [b"{}"], 10.0)
    assert not c.want_ping(50.0)                   # payload outstanding: never PING
    with pytest.raises(RuntimeError):
        c.ping(50.0)
    feed(c, P.encode_ackn(NONCE, 1), 12.0)
    assert c.deadline() == 22.0 and not c.want_ping(21.9) and c.want_ping(22.0)
    assert c.ping(22.0) == b"PING\x00\x00\x00\x00"
    assert not c.can_send()                        # nothing else while a PING is out
    assert feed(c, P.PONG_FRAME, 23.0) == [P.Pong()]
    assert c.can_send() and c.deadline() == 33.0
    c.ping(33.0)
    with pytest.raises(P.CourierError) as ei:
        c.check(48.0)
    assert "PONG" in str(ei.value)


def test_unexpected_pong_and_vers_after_handshake():
    c, _ = ready_client()
    with pytest.raises(P.CourierError):
        feed(c, P.PONG_FRAME, 0.0)
    c, _ = ready_client()
    with pytest.raises(P.CourierError):
        feed(c, P.encode_hello(P.GO_VERS), 0.0)


# ------------------------------------------------------------- server state


@pytest.mark.parametrize("behaviour,reply", [
    (P.GO, P.encode_hello(P.GO_VERS)),
    (P.DEFAULT, P.encode_hello(P.GO_VERS)),
    (P.RUBY2, bytes.fromhex("564552530000001400000000000000020000000c0000000052594c43")),
    (P.RUBY1, b"????\x00\x00\x00\x00"),
])
def test_server_handshake(behaviour, reply):
    s = P.ServerConnection(behaviour)
    assert feed(s, P.encode_hello(P.Helo()), 0.0) == []
    assert s.data_to_send() == reply


@pytest.mark.parametrize("behaviour,first", [
    (P.GO, P.PING_FRAME), (P.GO, P.frame(b"ZZZZ", b"abc")), (P.RUBY2, P.PING_FRAME),
    (P.RUBY2, P.frame(b"ZZZZ", b"abc")), (P.DEFAULT, P.PING_FRAME),
])
def test_server_first_message_must_be_helo_or_payload(behaviour, first):
    s = P.ServerConnection(behaviour)
    with pytest.raises(P.CourierError):
        feed(s, first, 0.0)
    assert s.data_to_send() == b""


def test_server_legacy_client_without_handshake():
    s = P.ServerConnection(P.GO)
    (ev,) = feed(s, P.encode_payload(NONCE, [b"{}"]), 0.0)
    assert isinstance(ev, P.Payload)


def test_server_unknown_and_second_helo():
    helo = P.encode_hello(P.Helo())
    for b, ok in ((P.GO, False), (P.DEFAULT, True), (P.RUBY2, True), (P.RUBY1, True)):
        s = P.ServerConnection(b)
        feed(s, helo, 0.0)
        s.data_to_send()
        if ok:
            feed(s, P.frame(b"ZZZZ", b"abc"), 0.0)
            assert s.data_to_send() == b"????\x00\x00\x00\x00"
        else:
            with pytest.raises(P.CourierError):
                feed(s, P.frame(b"ZZZZ", b"abc"), 0.0)
    for b, ok in ((P.GO, False), (P.RUBY2, True)):
        s = P.ServerConnection(b)
        feed(s, helo, 0.0)
        s.data_to_send()
        if ok:
            feed(s, helo, 0.0)
            assert s.data_to_send() == P.UNKN_FRAME
        else:
            with pytest.raises(P.CourierError):
                feed(s, helo, 0.0)


def test_server_ping_while_pending():
    for b in (P.GO, P.RUBY2):
        s = P.ServerConnection(b)
        feed(s, P.encode_hello(P.Helo()) + P.encode_payload(NONCE, [b"{}"]), 0.0)
        if b is P.GO:
            with pytest.raises(P.CourierError) as ei:
                feed(s, P.PING_FRAME, 0.0)
            assert ei.value.reason == "ping_not_idle"
        else:
            assert feed(s, P.PING_FRAME, 0.0) == [P.Ping()]    # queued behind the ACKN
    s = P.ServerConnection(P.GO)
    feed(s, P.encode_hello(P.Helo()), 0.0)
    s.data_to_send()
    feed(s, P.PING_FRAME, 0.0)
    assert s.data_to_send() == P.PONG_FRAME


def test_server_pending_limit():
    s = P.ServerConnection(P.GO)
    evs = feed(s, b"".join(P.encode_payload(bytes([i]) * 16, [b"{}"]) for i in range(12)), 0.0)
    assert len(evs) == 11 and isinstance(evs[10], P.Overloaded)
    assert len(s.pending) == 10                  # the 11th and later are dropped


def test_server_ack_timer_keepalive_for_oldest():
    s = P.ServerConnection(P.GO, ack_timeout=5.0)
    n2 = b"\x02" * 16
    feed(s, P.encode_payload(NONCE, [b"{}"] * 12) + P.encode_payload(n2, [b"{}"] * 3), 0.0)
    assert s.deadline() == 5.0
    assert s.on_timer(4.9) == b""
    assert s.on_timer(5.0) == P.encode_ackn(NONCE, 0)
    assert s.deadline() == 10.0
    assert s.ack(NONCE, 4, 7.0) == P.encode_ackn(NONCE, 4)    # re-armed after every ACKN
    assert s.deadline() == 12.0
    assert s.on_timer(12.0) == P.encode_ackn(NONCE, 4)
    s.ack(NONCE, 12, 13.0)
    assert s.on_timer(18.0) == P.encode_ackn(n2, 0)
    s.ack(n2, 3, 19.0)
    assert s.deadline() == float("inf")


def test_client_and_server_cores_talk():
    c = P.ClientConnection()
    s = P.ServerConnection()
    feed(s, c.start(0.0), 0.0)
    (hs,) = feed(c, s.data_to_send(), 0.0)
    assert hs.streaming
    events = [b'{"i":%d}' % i for i in range(50)]
    (p,) = feed(s, c.send_payload(NONCE, events, 1.0), 1.0)
    assert p.events == tuple(events)
    acks = feed(c, s.ack(NONCE, 20, 1.0) + s.ack(NONCE, 50, 1.0), 1.0)
    assert [a.advanced for a in acks] == [20, 30] and acks[-1].complete
    assert c.idle
