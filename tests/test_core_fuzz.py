"""Bad input never crashes the OUTPUT-side and samwise sans-IO cores: hypothesis feeds
random bytes, truncations, bit flips and spliced garbage of valid streams, in random
chunks, to

* the AMQP client core (``protocols/amqp.py``) from the protocol header on, handshake
  included (what a broker, or anything listening on its port, sends to samwise);
* the Courier client core (``protocols/courier_conn.ClientConnection``: what a receiver
  sends to the Courier output);
* the Courier server core (``ServerConnection``) with each receiver behaviour (the
  in-repo receiver; the relay's own input is fuzzed in test_inputs_fuzz.py);
* the Lumberjack client core (what a reader sends back to the Lumberjack output).

Only the module's own error class may come out (``AmqpError`` / ``CourierError`` /
``LumberjackError``, with a reason); the unmutated streams must parse completely, so the
drivers are checked against them too.
"""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from logjam_relay.protocols import amqp as A
from logjam_relay.protocols import courier as co
from logjam_relay.protocols import lumberjack as lj

FUZZ = settings(max_examples=250, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _chunks(data: bytes, cuts: list[int]):
    prev = 0
    for cut in sorted(set(cuts)) + [len(data)]:
        if cut > prev:
            yield data[prev:cut]
            prev = cut


# ------------------------------------------------------------------ AMQP (broker -> client)

def _m(ch: int, method, args: bytes = b"") -> bytes:
    return A.method_frame(ch, method, args)


def amqp_stream() -> bytes:
    props = A.encode_table({"product": "RabbitMQ", "capabilities": {"publisher_confirms": True},
                            "n": 7, "s": "x"})
    start = bytes((0, 9)) + props + A.longstr(b"AMQPLAIN PLAIN") + A.longstr(b"en_US")
    ret_hdr = struct.pack(">HHQ", A.BASIC, 0, 3) + struct.pack(">H", 0)
    return (_m(0, A.CONNECTION_START, start)
            + _m(0, A.CONNECTION_TUNE, struct.pack(">HIH", 2047, 131072, 60))
            + _m(0, A.CONNECTION_OPEN_OK, A.shortstr(""))
            + _m(1, A.CHANNEL_OPEN_OK, A.longstr(b""))
            + _m(1, A.CONFIRM_SELECT_OK)
            + _m(1, A.BASIC_ACK, struct.pack(">QB", 1, 0))
            + _m(1, A.BASIC_NACK, struct.pack(">QB", 3, 1))
            + A.frame(A.FRAME_HEARTBEAT, 0, b"")
            + _m(1, A.BASIC_RETURN, struct.pack(">H", 312) + A.shortstr("NO_ROUTE")
                 + A.shortstr("ex") + A.shortstr("rk"))
            + A.frame(A.FRAME_HEADER, 1, ret_hdr) + A.frame(A.FRAME_BODY, 1, b"abc")
            + _m(0, A.CONNECTION_BLOCKED, A.shortstr("low memory"))
            + _m(0, A.CONNECTION_UNBLOCKED)
            + _m(1, A.CHANNEL_FLOW, b"\x01")
            + _m(2, A.EXCHANGE_DECLARE_OK) + _m(2, A.EXCHANGE_DELETE_OK)
            + _m(1, A.CHANNEL_CLOSE, struct.pack(">H", 404) + A.shortstr("NOT_FOUND")
                 + struct.pack(">HH", 60, 40))
            + _m(0, A.CONNECTION_CLOSE, struct.pack(">H", 320) + A.shortstr("bye")
                 + struct.pack(">HH", 0, 0)))


def drive_amqp(data: bytes, cuts: list[int]) -> list:
    c = A.AmqpClient("guest", "guest")
    c.start()
    events: list = []
    try:
        for chunk in _chunks(data, cuts):
            events += c.receive_data(chunk)
            c.data_to_send()
            if c.state == "open":                       # commands must not raise either
                c.publish(1, A.shortstr("ex"), A.shortstr("rk"), b"x" * 10)
                c.heartbeat()
        return events
    except A.AmqpError as e:
        assert e.reason and isinstance(e.reason, str)
        assert c.state == "closed" and c.receive_data(b"\x01" * 20) == []
        return [e]


AMQP_VALID = amqp_stream()


def test_amqp_valid_stream_parses_completely():
    for cuts in ([], list(range(0, len(AMQP_VALID), 3))):
        evs = drive_amqp(AMQP_VALID, cuts)
        assert [type(e).__name__ for e in evs] == [
            "ConnectionOpen", "ChannelOpenOk", "ConfirmSelectOk", "Ack", "Nack", "Returned",
            "ConnectionBlocked", "ConnectionUnblocked", "ExchangeDeclareOk",
            "ExchangeDeleteOk", "ChannelClosed", "ConnectionClosed"], evs
        assert evs[5] == A.Returned(1, 312, "NO_ROUTE", "ex", "rk", b"abc")


@FUZZ
@given(st.binary(max_size=600), st.lists(st.integers(0, 600), max_size=8))
@example(b"AMQP\x00\x00\x09\x01", [])
@example(b"\x01\x00\x00\xff\xff\xff\xff", [])
def test_amqp_random_bytes(data, cuts):
    drive_amqp(data, cuts)


@FUZZ
@given(st.integers(0, len(AMQP_VALID)), st.lists(st.integers(0, len(AMQP_VALID)), max_size=6))
def test_amqp_truncations(n, cuts):
    evs = drive_amqp(AMQP_VALID[:n], cuts)
    assert all(not isinstance(e, Exception) for e in evs)   # a prefix is never an error


def _flip(data: bytes, flips) -> bytes:
    b = bytearray(data)
    for pos, bit in flips:
        b[pos % len(b)] ^= 1 << bit
    return bytes(b)


FLIPS = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), min_size=1, max_size=6)


@FUZZ
@given(FLIPS, st.lists(st.integers(0, len(AMQP_VALID)), max_size=6))
def test_amqp_bit_flips(fl, cuts):
    drive_amqp(_flip(AMQP_VALID, fl), cuts)


@FUZZ
@given(st.integers(0, len(AMQP_VALID)), st.binary(min_size=1, max_size=64),
       st.lists(st.integers(0, len(AMQP_VALID) + 64), max_size=6))
def test_amqp_spliced_garbage(at, junk, cuts):
    drive_amqp(AMQP_VALID[:at] + junk + AMQP_VALID[at:], cuts)


# ------------------------------------------------------ Courier client (receiver -> output)

NONCES = [bytes([i]) * 16 for i in range(1, 4)]


def courier_client_stream(vers: bool = True) -> bytes:
    hello = co.encode_hello(co.Vers(co.FLAG_EVNT, 2, 12, 0, b"LCVR", True)) if vers \
        else co.frame(co.UNKN)
    return (hello + co.encode_ackn(NONCES[0], 1) + co.encode_ackn(NONCES[0], 1)
            + co.encode_ackn(NONCES[1], 99) + co.encode_ackn(b"z" * 16, 5)
            + co.encode_ackn(NONCES[0], 2) + co.encode_ackn(NONCES[2], 3))


def drive_courier_client(data: bytes, cuts: list[int]) -> int:
    c = co.ClientConnection(max_pending=5, network_timeout=10.0, idle_ping=0.5,
                            max_frame=4096)
    now = 0.0
    c.start(now)
    acked = 0
    try:
        for chunk in _chunks(data, cuts):
            c.receive_data(chunk)
            while True:
                now += 0.01
                ev = c.next_event(now)
                if ev is None:
                    break
                if isinstance(ev, co.HandshakeComplete):
                    for n in NONCES:
                        c.send_payload(n, [b'{"a":1}', b'{"b":2}'], now)
                elif isinstance(ev, co.PayloadAck):
                    acked += ev.advanced
                    assert 0 <= ev.sequence <= 2
            c.check(now)
            c.deadline()
            if c.want_ping(now):
                c.ping(now)
        return acked
    except co.CourierError as e:
        assert e.reason and isinstance(e.reason, str)
        return -1


CC_VALID = courier_client_stream()


def test_courier_client_valid_streams_parse_completely():
    for stream in (CC_VALID, courier_client_stream(vers=False)):
        assert drive_courier_client(stream, []) == 6
        assert drive_courier_client(stream, list(range(0, len(stream), 3))) == 6


@FUZZ
@given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=8))
@example(b"VERS\xff\xff\xff\xff", [])
@example(b"VERS\x00\x00\x00\x00ACKN\x00\x00\x00\x00", [])
def test_courier_client_random_bytes(data, cuts):
    drive_courier_client(data, cuts)


@FUZZ
@given(st.integers(0, len(CC_VALID)), st.lists(st.integers(0, len(CC_VALID)), max_size=6))
def test_courier_client_truncations(n, cuts):
    assert drive_courier_client(CC_VALID[:n], cuts) >= 0


@FUZZ
@given(FLIPS, st.lists(st.integers(0, len(CC_VALID)), max_size=6))
def test_courier_client_bit_flips(fl, cuts):
    drive_courier_client(_flip(CC_VALID, fl), cuts)


@FUZZ
@given(st.integers(0, len(CC_VALID)), st.binary(min_size=1, max_size=40),
       st.lists(st.integers(0, len(CC_VALID) + 40), max_size=6))
def test_courier_client_spliced_garbage(at, junk, cuts):
    drive_courier_client(CC_VALID[:at] + junk + CC_VALID[at:], cuts)


# ------------------------------------------------ Courier server (output -> receiver peer)

def courier_server_stream() -> bytes:
    ev = [b'{"message":"a"}', b'{"message":"b","n":1}']
    return (co.encode_hello(co.Helo(flags=co.FLAG_EVNT)) + co.encode_payload(NONCES[0], ev)
            + co.encode_payload(NONCES[1], ev, streamed=True) + co.frame(co.PING)
            + co.frame(b"XXXX", b"junk"))


def drive_courier_server(data: bytes, cuts: list[int], behaviour) -> int:
    c = co.ServerConnection(behaviour, ack_timeout=1.0, max_uncompressed=64 * 1024)
    now = 0.0
    payloads = 0
    try:
        for chunk in _chunks(data, cuts):
            c.receive_data(chunk)
            while True:
                now += 0.01
                ev = c.next_event(now)
                c.data_to_send()
                if ev is None:
                    break
                if isinstance(ev, co.Payload):
                    payloads += 1
                    c.ack(ev.nonce, 1, now)
                    c.ack(ev.nonce, len(ev.events), now)
                elif isinstance(ev, co.Ping):
                    c.pong()
            c.on_timer(now + 5)
        return payloads
    except co.CourierError as e:
        assert e.reason and isinstance(e.reason, str)
        return -1


CS_VALID = courier_server_stream()
BEHAVIOURS = st.sampled_from(sorted(co.BEHAVIOURS.values(), key=lambda b: b.name))


def test_courier_server_valid_stream_parses_completely():
    assert drive_courier_server(CS_VALID, [], co.DEFAULT) == 2
    assert drive_courier_server(CS_VALID, list(range(0, len(CS_VALID), 4)), co.DEFAULT) == 2


@FUZZ
@given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=8), BEHAVIOURS)
def test_courier_server_random_bytes(data, cuts, b):
    drive_courier_server(data, cuts, b)


@FUZZ
@given(st.integers(0, len(CS_VALID)), st.lists(st.integers(0, len(CS_VALID)), max_size=6),
       BEHAVIOURS)
def test_courier_server_truncations(n, cuts, b):
    drive_courier_server(CS_VALID[:n], cuts, b)


@FUZZ
@given(FLIPS, st.lists(st.integers(0, len(CS_VALID)), max_size=6), BEHAVIOURS)
def test_courier_server_bit_flips(fl, cuts, b):
    drive_courier_server(_flip(CS_VALID, fl), cuts, b)


# --------------------------------------------------- Lumberjack client (reader -> output)

LJ_WRITER_VALID = (lj.encode_ack(0, version=2) + lj.encode_ack(2) + lj.encode_ack(3)
                   + lj.encode_ack(5, version=2))
LJ_READER_VALID = (lj.encode_window(lj.encode_data_frames([{"a": "1"}, {"line": "x" * 40}]), 2)
                   + lj.encode_window(lj.encode_data_frames([{"c": "3"}]), 1, level=3))


def drive_lumberjack(data: bytes, cuts: list[int], role) -> int:
    """Feed in chunks, then EOF; the events produced (-1 on a LumberjackError)."""
    c = lj.Connection(role, max_window=16, max_frame=4096)
    n = 0
    try:
        for chunk in [*_chunks(data, cuts), b""]:
            c.receive_data(chunk)
            while True:
                ev = c.next_event()
                if ev is lj.NEED_DATA or isinstance(ev, lj.ConnectionClosed):
                    break
                n += 1
        return n
    except lj.LumberjackError as e:
        assert e.reason and isinstance(e.reason, str)
        return -1


def test_lumberjack_valid_streams_parse_completely():
    assert drive_lumberjack(LJ_WRITER_VALID, [3, 7], lj.Role.WRITER) == 4
    # reader: Window, Data x2, WindowComplete, Window, Data, WindowComplete
    assert drive_lumberjack(LJ_READER_VALID, [5, 11], lj.Role.READER) == 7


ROLES = st.sampled_from([lj.Role.WRITER, lj.Role.READER])


@FUZZ
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=6), ROLES)
def test_lumberjack_random_bytes(data, cuts, role):
    drive_lumberjack(data, cuts, role)


@FUZZ
@given(FLIPS, st.lists(st.integers(0, 200), max_size=6), ROLES)
def test_lumberjack_bit_flips_and_truncations(fl, cuts, role):
    valid = LJ_WRITER_VALID if role is lj.Role.WRITER else LJ_READER_VALID
    drive_lumberjack(_flip(valid, fl), cuts, role)
    drive_lumberjack(valid[:fl[0][0] % len(valid)], cuts, role)


# ------------------------------------------------ the dead-letter store's files

def _store_file(tmp_path_factory) -> bytes:
    from logjam_relay.deadletter import DeadLetterStore
    from logjam_relay.protocols.logjam import encode_meta
    d = tmp_path_factory.mktemp("dl")
    st = DeadLetterStore(d, max_bytes=1024 * 1024)
    for i in range(6):
        st.put("o", "refused", [b"app-prod", b"logs", b'{"i":%d}' % i, encode_meta(0, 1, 1, i)],
               position=(1, i), detail=f"#{i}")
    st._seal()
    st.close()
    (path,) = list(d.iterdir())
    return path.read_bytes()


_STORE: list[bytes] = []


@FUZZ
@given(FLIPS, st.integers(0, 10**6))
def test_damaged_dead_letter_file_never_raises(tmp_path_factory, fl, cut):
    """Bit flips and truncations of a store file: read_dead_letters (what `deadletters
    list` and `resend` use) yields the intact letters and never raises."""
    from logjam_relay.deadletter import read_dead_letters
    from logjam_relay.spool import segment as seg
    if not _STORE:
        _STORE.append(_store_file(tmp_path_factory))
    data = _flip(_STORE[0], fl)
    data = data[:cut % (len(data) + 1)]
    d = tmp_path_factory.mktemp("dmg")
    (d / seg.segment_name(1, sealed=True)).write_bytes(data)
    letters = list(read_dead_letters(d))
    assert len(letters) <= 6
    for x in letters:
        x.summary()
