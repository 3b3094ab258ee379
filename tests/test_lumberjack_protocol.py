"""Sans-IO Lumberjack v1: exact bytes of the reference capture and every error case of §3."""

import struct
import zlib

import pytest

from logjam_relay.protocols import lumberjack as lj
from logjam_relay.protocols import lumberjack_acks as lja
from logjam_relay.protocols.lumberjack import (
    NEED_DATA,
    Ack,
    Connection,
    ConnectionClosed,
    Data,
    KeepAlive,
    LumberjackError,
    Role,
    Window,
    WindowComplete,
)

# reference §1: LSF writer -> go-lumber, plain TCP
W3 = bytes.fromhex("31 57 00 00 00 03")
D1 = bytes.fromhex("""
31 44 00 00 00 01 00 00 00 04 00 00 00 04 66 69 6c 65 00 00 00 18 2f 76
61 72 2f 6c 6f 67 2f 61 70 70 2f 73 65 72 76 69 63 65 2e 6c 6f 67 00 00
00 04 68 6f 73 74 00 00 00 02 76 6d 00 00 00 06 6f 66 66 73 65 74 00 00
00 01 30 00 00 00 04 6c 69 6e 65 00 00 00 21 32 30 32 34 2d 30 35 2d 30
31 54 30 30 3a 30 30 3a 30 30 2e 34 39 38 30 38 31 5a 20 57 41 52 4e 2e""")
C3 = bytes.fromhex("""
31 43 00 00 00 ab 78 5e 32 74 61 60 60 60 64 60 60 60 01 e1 b4 cc 9c 54
06 06 06 09 fd b2 c4 22 fd 9c fc 74 fd c4 82 02 fd e2 d4 a2 b2 cc e4 54
bd 9c fc 74 90 9a 8c fc e2 12 06 06 06 a6 b2 5c 06 06 06 b6 fc b4 b4 e2
54 10 9f d1 00 24 99 93 99 07 32 40 d1 c8 c0 c8 44 d7 c0 54 d7 c0 30 c4
c0 c0 0a 8c f4 4c 2c 2d 0c 2c 0c a3 14 c2 1d 83 fc f4 c0 f6 32 51 c1 5e
26 63 13 24 8b 15 30 2d 36 d4 33 32 30 36 36 30 88 52 f0 f4 73 f3 07 db
cb 4c 0d 7b cd cc f1 db 6b a4 67 6c 64 6c 64 6c 0e b1 17 00 00 00 ff ff
01 00 00 ff ff 73 0f 4c 2e""")
D1_FIELDS = {"file": "/var/log/app/service.log", "host": "vm", "offset": "0",
             "line": "2024-05-01T00:00:00.498081Z WARN."}


def events_of(*chunks, eof=False, role=Role.READER, **kw):
    conn = Connection(role, **kw)
    out = []
    for c in chunks:
        conn.receive_data(c)
        while (ev := conn.next_event()) is not NEED_DATA:
            out.append(ev)
    if eof:
        conn.receive_data(b"")
        while (ev := conn.next_event()) is not NEED_DATA:
            out.append(ev)
    return out


def W(n):
    return lj.encode_window_frame(n)


def D(seq, **fields):
    return lj.encode_data_frame(seq, fields.items() or [("line", f"event {seq}")])


def C(frames: bytes, level=3):
    return lj.encode_compressed_frame(frames, level)


def Dn(first, n):
    return b"".join(D(first + i) for i in range(n))


# ----------------------------------------------------------------- exact bytes


def test_encode_window_frame_exact():
    assert lj.encode_window_frame(3) == W3
    assert len(W3) == 6


def test_encode_data_frame_exact_bytes_of_reference():
    frame = lj.encode_data_frame(1, [("file", "/var/log/app/service.log"), ("host", "vm"),
                                     ("offset", "0"),
                                     ("line", "2024-05-01T00:00:00.498081Z WARN.")])
    assert frame == D1
    assert len(frame) == 120


def test_encode_ack_exact():
    assert lj.encode_ack(3) == bytes.fromhex("31 41 00 00 00 03")
    assert lj.encode_ack(0, version=2) == bytes.fromhex("32 41 00 00 00 00")


def test_decode_reference_data_frame():
    evs = events_of(lj.encode_window_frame(1) + D1)
    assert evs == [Window(1), Data(1, D1_FIELDS), WindowComplete(1, 1, 0)]


def test_decode_reference_compressed_frame_lsf():
    assert len(C3) == 177
    evs = events_of(W3 + C3)
    assert evs[0] == Window(3)
    data = [e for e in evs if isinstance(e, Data)]
    assert [d.seq for d in data] == [1, 2, 3]
    assert data[0].fields == D1_FIELDS
    assert data[1].fields["offset"] == "34"
    assert data[2].fields["line"].startswith("2024-05-01T00:00:02")
    assert evs[-1] == WindowComplete(3, 3, 0)
    # 360 bytes inflated, as in the capture
    assert len(zlib.decompress(C3[6:])) == 360


def test_decode_byte_by_byte():
    stream = lj.encode_window_frame(1) + D1 + W3 + C3
    evs = events_of(*[stream[i:i + 1] for i in range(len(stream))], eof=True)
    assert [type(e) for e in evs] == [Window, Data, WindowComplete, Window, Data, Data, Data,
                                      WindowComplete, ConnectionClosed]


def test_encode_window_plain_and_compressed_roundtrip():
    frames = lj.encode_data_frames([{"line": "a"}, {"line": "b"}, [("line", "c")]])
    plain = lj.encode_window(frames, 3, 0)
    assert plain.startswith(W3 + b"1D\x00\x00\x00\x01")
    comp = lj.encode_window(frames, 3, 3)
    assert comp.startswith(W3 + b"1C")
    assert comp.count(b"1C") >= 1 and len(comp) == 12 + struct.unpack(">I", comp[8:12])[0]
    for data in (plain, comp):
        evs = events_of(data)
        assert [e.fields["line"] for e in evs if isinstance(e, Data)] == ["a", "b", "c"]
        assert evs[-1] == WindowComplete(3, 3, 0)


def test_reference_acks_decoded_by_writer():
    evs = events_of(bytes.fromhex("31 41 00 00 00 03 31 41 00 00 00 02"), role=Role.WRITER)
    assert evs == [Ack(3), Ack(2)]


def test_writer_keepalive_2a0():
    evs = events_of(bytes.fromhex("32 41 00 00 00 00") + lj.encode_ack(5), role=Role.WRITER)
    assert evs == [KeepAlive(2), Ack(5)]


def test_writer_eof_and_garbage():
    assert events_of(lj.encode_ack(1), eof=True, role=Role.WRITER) == [Ack(1), ConnectionClosed()]
    with pytest.raises(LumberjackError) as ei:
        events_of(b"1A\x00", eof=True, role=Role.WRITER)
    assert ei.value.reason == "truncated"
    with pytest.raises(LumberjackError) as ei:
        events_of(b"1W\x00\x00\x00\x01", role=Role.WRITER)
    assert ei.value.reason == "unknown_frame_type"
    with pytest.raises(LumberjackError) as ei:
        events_of(b"3A\x00\x00\x00\x01", role=Role.WRITER)
    assert ei.value.reason == "bad_version"


def test_ack_completes_count_or_last_seq():
    assert lj.ack_completes(5, 1, 5)
    assert lj.ack_completes(5, 101, 5)        # go-lumber: count
    assert lj.ack_completes(105, 101, 5)      # jls: last seq
    assert not lj.ack_completes(104, 101, 5)
    assert not lj.ack_completes(4, 1, 5)


def test_window_zero_ignored():
    assert events_of(W(0) + W(1) + D(1)) == [Window(1), Data(1, {"line": "event 1"}),
                                              WindowComplete(1, 1, 0)]


def test_seq_not_checked_rollover():
    evs = events_of(W(3) + D(4294967295) + D(0) + D(1))
    assert evs[-1] == WindowComplete(3, 1, 0)


def test_d_then_c_carries_rest_of_window():
    evs = events_of(W(3) + D(1) + C(D(2) + D(3)))
    assert evs[-1] == WindowComplete(3, 3, 0)
    assert len([e for e in evs if isinstance(e, Data)]) == 3


def test_nested_c_frames():
    evs = events_of(W(3) + C(D(1) + C(D(2)) + D(3)))
    assert [e.seq for e in evs if isinstance(e, Data)] == [1, 2, 3]


def test_clean_eof_between_windows():
    assert events_of(W(1) + D(1), eof=True)[-1] == ConnectionClosed()
    assert events_of(b"", eof=True) == [ConnectionClosed()]


def test_consumed_counts_frame_bytes():
    conn = Connection(Role.READER)
    data = W(2) + D(1) + D(2)
    conn.receive_data(data + b"1W")
    while conn.next_event() is not NEED_DATA:
        pass
    assert conn.consumed == len(data)
    assert not conn.in_window


# -------------------------------------------------------- §3 error table


def _zlib_c(payload: bytes) -> bytes:
    return b"1C" + struct.pack(">I", len(payload)) + payload


def _bad_adler() -> bytes:
    z = zlib.compress(D(1))
    return _zlib_c(z[:-1] + bytes([z[-1] ^ 0xFF]))


ERROR_CASES = [
    # (name, bytes, eof, expected reason)
    ("unknown_frame_type_in_window", W(2) + D(1) + b"1X\x00\x00\x00\x00", False,
     "unknown_frame_type"),
    ("first_frame_D", D(1), False, "expected_window"),
    ("first_frame_C", C(W(1) + D(1)), False, "expected_window"),
    ("version_2_window", b"2W\x00\x00\x00\x01" + D(1), False, "bad_version"),
    ("version_2_data", W(1) + b"2D" + D(1)[2:], False, "bad_version"),
    ("truncated_then_fin", W(1) + D(1)[:-3], True, "truncated"),
    ("truncated_window_then_fin", W(2) + D(1), True, "truncated"),
    ("zlib_bad_header", W(1) + _zlib_c(b"\x00\x00" + zlib.compress(D(1))[2:]), False,
     "zlib_error"),
    ("zlib_bad_adler32", W(1) + _bad_adler(), False, "zlib_error"),
    ("zlib_truncated_stream", W(1) + _zlib_c(zlib.compress(D(1))[:-6]), False, "zlib_error"),
    ("zlib_len_0", W(1) + b"1C\x00\x00\x00\x00", False, "zlib_error"),
    ("window_split_over_two_C", W(4) + C(Dn(1, 2)) + C(Dn(3, 2)), False, "window_split"),
    ("more_D_than_W", W(1) + D(1) + D(2), False, "expected_window"),
    ("W_again_mid_window", W(2) + D(1) + W(1) + D(2), False, "unexpected_window"),
    ("W_inside_C", W(2) + C(D(1) + W(1) + D(2)), False, "unexpected_window"),
    ("W_10001", W(10001), False, "window_too_large"),
]


@pytest.mark.parametrize("name,data,eof,reason", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_table(name, data, eof, reason):
    conn = Connection(Role.READER)
    conn.receive_data(data)
    if eof:
        conn.receive_data(b"")
    delivered = []
    with pytest.raises(LumberjackError) as ei:
        while (ev := conn.next_event()) is not NEED_DATA:
            delivered.append(ev)
        pytest.fail(f"no error, events {delivered}")
    assert ei.value.reason == reason
    # sticky: the connection is dead
    with pytest.raises(LumberjackError):
        conn.next_event()
    if name == "more_D_than_W":
        # the complete first window was delivered before the error (go-lumber caveat)
        assert WindowComplete(1, 1, 0) in delivered
    else:
        assert not any(isinstance(e, WindowComplete) for e in delivered)


def test_truncated_then_silence_is_need_data_in_window():
    """The deadline lives in the I/O layer: the core just waits, and says it is in a window."""
    conn = Connection(Role.READER)
    conn.receive_data(W(1) + D(1)[:-3])
    assert conn.next_event() == Window(1)
    assert conn.next_event() is NEED_DATA
    assert conn.in_window


def test_c_with_more_events_than_w_drops_extras():
    evs = events_of(W(2) + C(Dn(1, 4)) + W(1) + D(9))
    assert [e.seq for e in evs if isinstance(e, Data)] == [1, 2, 9]
    assert evs[3] == WindowComplete(2, 2, 2)


def test_max_window_configurable_and_10000_ok():
    assert events_of(W(10000))[0] == Window(10000)
    with pytest.raises(LumberjackError) as ei:
        events_of(W(11), max_window=10)
    assert ei.value.reason == "window_too_large"


def test_frame_too_large():
    with pytest.raises(LumberjackError) as ei:
        events_of(W(1) + b"1C\xff\xff\xff\xff", max_frame=1024)
    assert ei.value.reason == "frame_too_large"
    with pytest.raises(LumberjackError) as ei:
        events_of(W(1) + b"1D" + struct.pack(">III", 1, 1, 5000), max_frame=1024)
    assert ei.value.reason == "frame_too_large"


def test_send_by_role():
    r = Connection(Role.READER)
    assert r.send(Ack(7)) == lj.encode_ack(7)
    assert r.send(KeepAlive()) == bytes.fromhex("32 41 00 00 00 00")
    w = Connection(Role.WRITER)
    assert w.send(Window(3)) == W3
    assert w.send(Data(1, D1_FIELDS)) == D1
    with pytest.raises(TypeError):
        r.send(Window(1))


def test_non_utf8_values_survive():
    frame = lj.encode_data_frame(1, [(b"line", b"\xff\xfeok")])
    ev = events_of(W(1) + frame)[1]
    assert ev.fields["line"].encode("utf-8", "surrogateescape") == b"\xff\xfeok"


# ------------------------------------------------- the writer's ACK state (WriterAcks)

H, H2 = ("10.0.0.1", 5044), ("10.0.0.2", 5044)


def acks_of(data: bytes, acks: lja.WriterAcks, now: float = 0.0, host=H, eof=False):
    """Feed reader bytes through the writer role and the ACK state, as the output does."""
    out = []
    for ev in events_of(data, role=Role.WRITER, eof=eof):
        out.append(acks.receive_ack(ev.seq, host, now) if type(ev) is Ack else ev)
    return out


def test_writer_acks_complete_windows_in_order_by_count_or_last_seq():
    a = lja.WriterAcks(pipeline=4)
    a.connected()
    a.sent(3)
    a.sent(2)
    # go-lumber's ACK of the reference capture (count) and a jls-style one for 2 (seq 1..2)
    assert acks_of(bytes.fromhex("31 41 00 00 00 03 31 41 00 00 00 02"), a) == \
        [lja.WindowAcked(3), lja.WindowAcked(2)]
    assert a.in_flight == 0 and a.acked_on_connection == 2 and a.partial_acks == 0


def test_writer_acks_keepalive_completes_nothing():
    a = lja.WriterAcks(pipeline=1)
    a.sent(5)
    assert acks_of(bytes.fromhex("32 41 00 00 00 00"), a) == [KeepAlive(2)]
    assert a.in_flight == 1 and a.acked_on_connection == 0


@pytest.mark.parametrize("value", [6, 0xFFFFFFFF])
def test_writer_acks_an_ack_larger_than_the_window_is_an_error(value):
    a = lja.WriterAcks(pipeline=2)
    a.sent(5)
    with pytest.raises(LumberjackError) as ei:
        acks_of(lj.encode_ack(value), a)
    assert ei.value.reason == "unexpected_ack" and a.in_flight == 1


def test_writer_acks_an_ack_with_nothing_in_flight_is_an_error():
    a = lja.WriterAcks(pipeline=2)
    with pytest.raises(LumberjackError) as ei:
        acks_of(lj.encode_ack(1), a)
    assert ei.value.reason == "unexpected_ack"
    a.sent(1)
    assert acks_of(lj.encode_ack(1), a) == [lja.WindowAcked(1)]
    with pytest.raises(LumberjackError):            # one ACK per window, not two
        acks_of(lj.encode_ack(1), a)


def test_writer_acks_short_and_malformed_acks_acknowledge_nothing():
    """logstash-forwarder takes any 6 bytes after a window as its ACK (reference,
    "Senders into a reader"); the writer here takes only a whole 1A/2A frame: a short
    one is a truncated stream, another type or version an error, and neither completes
    the window in flight."""
    cases = [
        (b"1A\x00\x00\x00", True, "truncated"),          # 5 of 6 bytes, then FIN
        (b"1", True, "truncated"),
        (b"1W\x00\x00\x00\x02", False, "unknown_frame_type"),   # 6 bytes, not an ACK
        (b"1D\x00\x00\x00\x02", False, "unknown_frame_type"),
        (b"\x00\x00\x00\x00\x00\x02", False, "bad_version"),
        (b"3A\x00\x00\x00\x02", False, "bad_version"),
    ]
    for data, eof, reason in cases:
        a = lja.WriterAcks(pipeline=1)
        a.sent(2)
        with pytest.raises(LumberjackError) as ei:
            acks_of(data, a, eof=eof)
        assert ei.value.reason == reason, data
        assert a.in_flight == 1 and a.acked_on_connection == 0, data
    # a short ACK that is completed later is one ACK
    a = lja.WriterAcks(pipeline=1)
    a.sent(2)
    conn = Connection(Role.WRITER)
    conn.receive_data(b"1A\x00\x00")
    assert conn.next_event() is NEED_DATA
    conn.receive_data(b"\x00\x02")
    assert a.receive_ack(conn.next_event().seq, H, 0.0) == lja.WindowAcked(2)


def test_writer_acks_partial_ack_falls_back_to_stop_and_wait():
    a = lja.WriterAcks(pipeline=4, retry_after=600.0)
    a.sent(5)
    # one window in flight: wait for the rest; the host goes stop-and-wait
    assert acks_of(lj.encode_ack(3), a, now=10.0) == [lja.PartialAck(3, 5, False, True)]
    assert a.in_flight == 1 and a.partial_acks == 1 and a.fallbacks == 1
    assert a.depth(H, 10.0) == (1, False) and a.depth(H2, 10.0) == (4, False)
    assert acks_of(lj.encode_ack(5), a, now=11.0) == [lja.WindowAcked(5)]
    # several in flight: the ACKs that follow would be ambiguous, the connection ends;
    # already stop-and-wait: not counted again
    a.connected()
    a.sent(5)
    a.sent(5)
    assert acks_of(lj.encode_ack(2), a, now=12.0) == [lja.PartialAck(2, 5, True, False)]
    assert a.partial_acks == 2 and a.fallbacks == 1
    # a bisection sends one window at a time for its own reason: no fallback
    b = lja.WriterAcks(pipeline=4)
    b.sent(2)
    assert b.receive_ack(1, H, 0.0, pipelining=False) == lja.PartialAck(1, 2, False, False)
    assert b.fallbacks == 0 and b.depth(H, 0.0) == (4, False)


def test_writer_acks_stop_and_wait_is_retried_after_a_while():
    a = lja.WriterAcks(pipeline=4, retry_after=600.0)
    assert a.depth(H, 0.0) == (4, False)
    assert a.fall_back(H, 0.0) is True
    assert a.depth(H, 0.0) == (1, False) and a.depth(H2, 0.0) == (4, False)
    assert a.fall_back(H, 1.0) is False               # already stop-and-wait
    assert a.fallbacks == 1
    assert a.depth(H, 599.0) == (1, False)
    assert a.depth(H, 601.0) == (4, True)             # resumes, once
    assert a.depth(H, 602.0) == (4, False)
    assert a.fall_back(H, 602.0) is True and a.fallbacks == 2
    assert lja.WriterAcks(pipeline=1).fall_back(H, 0.0) is False    # nothing to fall from


def test_writer_acks_timeout_with_windows_in_flight_and_no_ack_falls_back():
    a = lja.WriterAcks(pipeline=4)
    a.connected()
    a.sent(1)
    assert a.timed_out(H, 0.0) is False               # one window: just a timeout
    a.sent(1)
    assert a.timed_out(H, 0.0) is True and a.depth(H, 1.0) == (1, False)
    b = lja.WriterAcks(pipeline=4)
    b.sent(1)
    b.sent(1)
    b.receive_ack(1, H, 0.0)
    b.sent(1)
    assert b.timed_out(H, 0.0) is False               # it did pipeline on this connection
    b.connected()
    assert b.in_flight == 0 and b.acked_on_connection == 0
