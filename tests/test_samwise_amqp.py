"""The sans-IO AMQP 0-9-1 publisher core (protocols/amqp.py).

Server frames are encoded and client frames decoded with pika's own spec (an independent
implementation), so every encoding is checked against a second one, byte for byte.
"""

from __future__ import annotations

import random
import struct

import pytest
from pika import frame as pframe
from pika import spec

from logjam_relay.protocols import amqp as A


def srv(channel, method) -> bytes:
    return pframe.Method(channel, method).marshal()


def decode_all(data: bytes) -> list:
    out = []
    while data:
        n, f = pframe.decode_frame(data)
        assert n, data[:40]
        out.append(f)
        data = data[n:]
    return out


START = srv(0, spec.Connection.Start(server_properties={"product": "RabbitMQ", "capabilities": {
    "publisher_confirms": True}, "version": "3.10.8"}, mechanisms=b"AMQPLAIN PLAIN",
    locales=b"en_US"))


def opened(frame_max=131072, heartbeat=60, channel_max=2047, want_heartbeat=30):
    c = A.AmqpClient("guest", "pw", "/v", heartbeat=want_heartbeat)
    c.start()
    assert c.data_to_send() == A.PROTOCOL_HEADER
    assert c.receive_data(START) == []
    start_ok, = decode_all(c.data_to_send())
    assert c.receive_data(srv(0, spec.Connection.Tune(channel_max, frame_max, heartbeat))) == []
    tune_ok, open_ = decode_all(c.data_to_send())
    evs = c.receive_data(srv(0, spec.Connection.OpenOk()))
    return c, start_ok, tune_ok, open_, evs


def test_handshake_plain_login_tune_and_open():
    c, start_ok, tune_ok, open_, evs = opened()
    m = start_ok.method
    assert isinstance(m, spec.Connection.StartOk)
    assert m.mechanism == "PLAIN" and m.response == b"\x00guest\x00pw"
    assert m.client_properties["capabilities"]["publisher_confirms"] is True
    assert (tune_ok.method.channel_max, tune_ok.method.frame_max, tune_ok.method.heartbeat) == \
        (2047, 131072, 30)
    assert open_.method.virtual_host == "/v"
    assert evs == [A.ConnectionOpen(2047, 131072, 30)]
    assert c.state == "open" and c.server_properties["product"] == "RabbitMQ"


@pytest.mark.parametrize("server,want,expect", [
    ((0, 0, 0), 30, (2047, 131072, 0)),            # 0 = no limit; heartbeat off on the server
    ((100, 8192, 10), 30, (100, 8192, 10)),        # the smaller of both
    ((2047, 1 << 20, 60), 0, (2047, 131072, 0)),   # heartbeat off on our side
])
def test_tune_negotiation(server, want, expect):
    c, _, tune_ok, _, evs = opened(channel_max=server[0], frame_max=server[1],
                                   heartbeat=server[2], want_heartbeat=want)
    m = tune_ok.method
    assert (m.channel_max, m.frame_max, m.heartbeat) == expect
    assert evs == [A.ConnectionOpen(*expect)]


def test_channel_confirm_exchange_commands_decode_as_pika_reads_them():
    c = opened()[0]
    c.open_channel(1)
    c.confirm_select(1)
    c.exchange_declare(2, "ex", passive=True)
    c.exchange_declare(1, "ex2", "topic", durable=True)
    c.exchange_delete(1, "ex2", if_unused=True)
    c.heartbeat()
    c.close_channel(2)
    fs = decode_all(c.data_to_send())
    assert isinstance(fs[0].method, spec.Channel.Open) and fs[0].channel_number == 1
    assert isinstance(fs[1].method, spec.Confirm.Select) and not fs[1].method.nowait
    d = fs[2].method
    assert (d.exchange, d.type, d.passive, d.durable) == ("ex", "direct", True, False)
    assert fs[2].channel_number == 2
    d = fs[3].method
    assert (d.exchange, d.type, d.passive, d.durable, d.auto_delete) == \
        ("ex2", "topic", False, True, False)
    assert fs[4].method.exchange == "ex2" and fs[4].method.if_unused is True
    assert isinstance(fs[5], pframe.Heartbeat)
    assert isinstance(fs[6].method, spec.Channel.Close) and fs[6].method.reply_code == 200


@pytest.mark.parametrize("body_len", [0, 1, 4088, 4089, 10000])
def test_publish_is_byte_identical_to_pika(body_len):
    body = bytes(random.Random(body_len).randrange(256) for _ in range(body_len))
    props = spec.BasicProperties(content_type="text/plain", content_encoding="gzip",
                                 headers={"s": "v", "b": b"\xff\x00", "n": 7, "t": True,
                                          "big": 2**40, "nested": {"x": "y"}},
                                 delivery_mode=2, priority=9, correlation_id="c", reply_to="r",
                                 expiration="6000", message_id="m", timestamp=1700000000,
                                 type="t", user_id="guest", app_id="a", cluster_id="cl")
    ours = A.encode_publish(3, A.shortstr("amq.direct"), A.shortstr("rk"), body,
                            A.encode_properties(**{k: v for k, v in vars(props).items()
                                                   if v is not None}),
                            mandatory=True, frame_max=4096)
    want = srv(3, spec.Basic.Publish(exchange="amq.direct", routing_key="rk", mandatory=True))
    want += pframe.Header(3, body_len, props).marshal()
    for i in range(0, body_len, 4088):
        want += pframe.Body(3, body[i:i + 4088]).marshal()
    assert ours == want


def test_publish_without_properties_and_client_method():
    c = opened()[0]
    c.publish(1, A.shortstr(""), A.shortstr("k"), b"hi")
    fs = decode_all(c.data_to_send())
    assert [type(f) for f in fs] == [pframe.Method, pframe.Header, pframe.Body]
    assert fs[1].properties.headers is None and fs[1].body_size == 2
    assert fs[2].fragment == b"hi"
    assert A.encode_properties() == A.NO_PROPERTIES


def test_property_and_name_limits():
    with pytest.raises(ValueError):
        A.shortstr("x" * 256)
    with pytest.raises(ValueError):
        A.encode_properties(priority=256)
    with pytest.raises(ValueError):
        A.encode_properties(colour="red")
    with pytest.raises(ValueError):
        A.encode_table({"x": 1.5})


def test_acks_nacks_and_returns_in_any_chunking():
    c = opened()[0]
    stream = (srv(1, spec.Basic.Ack(5, multiple=True)) + srv(1, spec.Basic.Nack(6))
              + srv(1, spec.Basic.Return(312, "NO_ROUTE", "amq.direct", "nokey"))
              + pframe.Header(1, 9000, spec.BasicProperties(content_type="x")).marshal()
              + pframe.Body(1, b"a" * 4000).marshal() + pframe.Body(1, b"b" * 5000).marshal()
              + srv(1, spec.Basic.Ack(7)) + pframe.Heartbeat().marshal()
              + srv(1, spec.Basic.Return(312, "NO_ROUTE", "e", "k"))
              + pframe.Header(1, 0, spec.BasicProperties()).marshal())
    want = [A.Ack(1, 5, True), A.Nack(1, 6, False),
            A.Returned(1, 312, "NO_ROUTE", "amq.direct", "nokey", b"a" * 4000 + b"b" * 5000),
            A.Ack(1, 7, False), A.Returned(1, 312, "NO_ROUTE", "e", "k", b"")]
    assert c.receive_data(stream) == want
    for size in (1, 3, 7, 100):
        c = opened()[0]
        got = []
        for i in range(0, len(stream), size):
            got += c.receive_data(stream[i:i + size])
        assert got == want, size


def test_closes_from_the_broker_are_answered():
    c = opened()[0]
    evs = c.receive_data(srv(2, spec.Channel.Close(404, "NOT_FOUND - no exchange 'x'", 40, 10)))
    assert evs == [A.ChannelClosed(2, 404, "NOT_FOUND - no exchange 'x'", 40, 10)]
    assert isinstance(decode_all(c.data_to_send())[0].method, spec.Channel.CloseOk)
    evs = c.receive_data(srv(1, spec.Channel.Flow(active=False)))
    assert evs == [] and decode_all(c.data_to_send())[0].method.active is False
    evs = c.receive_data(srv(0, spec.Connection.Blocked("low on memory"))
                         + srv(0, spec.Connection.Unblocked()))
    assert evs == [A.ConnectionBlocked("low on memory"), A.ConnectionUnblocked()]
    evs = c.receive_data(srv(0, spec.Connection.Close(320, "CONNECTION_FORCED - bye", 0, 0))
                         + srv(1, spec.Basic.Ack(1)))
    assert evs == [A.ConnectionClosed(320, "CONNECTION_FORCED - bye", 0, 0)]
    assert isinstance(decode_all(c.data_to_send())[0].method, spec.Connection.CloseOk)
    assert c.state == "closed" and c.receive_data(srv(1, spec.Basic.Ack(2))) == []


def test_client_close_waits_for_close_ok():
    c = opened()[0]
    c.close()
    m = decode_all(c.data_to_send())[0].method
    assert isinstance(m, spec.Connection.Close) and m.reply_code == 200
    assert c.state == "closing"
    assert c.receive_data(srv(0, spec.Connection.CloseOk())) == [A.ConnectionCloseOk()]
    assert c.state == "closed"


def test_login_refused_during_handshake():
    c = A.AmqpClient("guest", "wrong")
    c.start()
    c.receive_data(START)
    c.data_to_send()
    evs = c.receive_data(srv(0, spec.Connection.Close(403, "ACCESS_REFUSED", 0, 0)))
    assert evs == [A.ConnectionClosed(403, "ACCESS_REFUSED", 0, 0)] and c.state == "closed"


def _good_stream():
    return (srv(1, spec.Channel.OpenOk()) + srv(1, spec.Confirm.SelectOk())
            + srv(1, spec.Basic.Ack(1)) + srv(2, spec.Exchange.DeclareOk())
            + srv(1, spec.Basic.Return(312, "NO_ROUTE", "e", "k"))
            + pframe.Header(1, 3, spec.BasicProperties()).marshal()
            + pframe.Body(1, b"abc").marshal() + srv(1, spec.Exchange.DeleteOk()))


def test_every_good_event_type():
    c = opened()[0]
    assert c.receive_data(_good_stream()) == [
        A.ChannelOpenOk(1), A.ConfirmSelectOk(1), A.Ack(1, 1, False), A.ExchangeDeclareOk(2),
        A.Returned(1, 312, "NO_ROUTE", "e", "k", b"abc"), A.ExchangeDeleteOk(1)]


def _frame(kind, ch, payload, end=b"\xce"):
    return struct.pack(">BHI", kind, ch, len(payload)) + payload + end


MALFORMED = {
    "bad_frame_end": srv(1, spec.Basic.Ack(1))[:-1] + b"\x00",
    "frame_too_large": struct.pack(">BHI", 1, 1, 131073) + b"\x00" * 10,
    "bad_frame_type": _frame(9, 0, b""),
    "bad_heartbeat": _frame(8, 1, b""),
    "truncated": _frame(1, 1, struct.pack(">HH", 60, 80) + b"\x00\x00"),
    "unexpected_method": srv(1, spec.Basic.Deliver("ctag", 1, False, "e", "k")),
    "unexpected_content": pframe.Body(1, b"x").marshal(),
    "header_without_return": pframe.Header(1, 1, spec.BasicProperties()).marshal(),
    "body_too_long": (srv(1, spec.Basic.Return(312, "NO_ROUTE", "e", "k"))
                      + pframe.Header(1, 1, spec.BasicProperties()).marshal()
                      + pframe.Body(1, b"xy").marshal()),
    "method_inside_content": (srv(1, spec.Basic.Return(312, "NO_ROUTE", "e", "k"))
                              + srv(1, spec.Basic.Ack(1))),
    "truncated_shortstr": _frame(1, 1, struct.pack(">HHH", 60, 50, 312) + b"\x10ab"),
    "returned_body_too_large": (srv(1, spec.Basic.Return(312, "NO_ROUTE", "e", "k"))
                                + pframe.Header(1, A.MAX_RETURNED_BODY + 1,
                                                spec.BasicProperties()).marshal()),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_input_is_an_amqp_error_and_closes(name):
    c = opened()[0]
    with pytest.raises(A.AmqpError) as ei:
        c.receive_data(MALFORMED[name])
    reason = {"header_without_return": "unexpected_content", "body_too_long": "unexpected_content",
              "method_inside_content": "unexpected_method",
              "truncated_shortstr": "truncated",
              "returned_body_too_large": "frame_too_large"}.get(name, name)
    assert ei.value.reason == reason
    assert c.state == "closed" and c.receive_data(srv(1, spec.Basic.Ack(1))) == []


def _start_with(props_raw: bytes | None = None, mechanisms=b"PLAIN", version=(0, 9)):
    table = props_raw if props_raw is not None else b"\x00\x00\x00\x00"
    args = bytes(version) + table + A.longstr(mechanisms) + A.longstr(b"en_US")
    return A.method_frame(0, A.CONNECTION_START, args)


@pytest.mark.parametrize("data,reason", [
    (b"AMQP\x00\x00\x09\x00", "protocol_version"),       # the broker's own header: no 0-9-1
    (_start_with(version=(0, 8)), "protocol_version"),
    (_start_with(mechanisms=b"AMQPLAIN EXTERNAL"), "auth_mechanism"),
    (_start_with(struct.pack(">I", 3) + b"\x01kZ"), "bad_table"),           # unknown type Z
    (_start_with(struct.pack(">I", 9) + b"\x01k" + b"F" + struct.pack(">I", 50)), "truncated"),
    (_start_with(struct.pack(">I", 0x7FFFFFFF)), "truncated"),
    (A.method_frame(0, A.CONNECTION_TUNE, struct.pack(">HIH", 0, 100, 0)), "unexpected_method"),
    (A.method_frame(0, A.CONNECTION_SECURE, A.longstr(b"challenge")), "unexpected_method"),
    (A.method_frame(1, A.CONNECTION_START, b""), "unexpected_method"),
])
def test_malformed_handshake(data, reason):
    c = A.AmqpClient("u", "p")
    c.start()
    with pytest.raises(A.AmqpError) as ei:
        c.receive_data(data)
    assert ei.value.reason == reason


def test_tune_below_minimum_frame_size_and_secure_after_start():
    c = A.AmqpClient("u", "p")
    c.start()
    c.receive_data(START)
    with pytest.raises(A.AmqpError) as ei:
        c.receive_data(srv(0, spec.Connection.Tune(0, 1024, 0)))
    assert ei.value.reason == "bad_tune"
    c = A.AmqpClient("u", "p")
    c.start()
    c.receive_data(START)
    with pytest.raises(A.AmqpError) as ei:
        c.receive_data(A.method_frame(0, A.CONNECTION_SECURE, A.longstr(b"x")))
    assert ei.value.reason == "auth_mechanism"


def test_every_field_table_type_decodes():
    table = (b"\x01bb\xff" + b"\x01BB\xff" + b"\x01ss\xff\xfe" + b"\x01uu\xff\xfe"
             + b"\x01II\xff\xff\xff\xfe" + b"\x01ii\x00\x00\x00\x05" + b"\x01ll" + b"\xff" * 8
             + b"\x01LL" + b"\x00" * 7 + b"\x01" + b"\x01ff" + struct.pack(">f", 1.5)
             + b"\x01dd" + struct.pack(">d", 2.5) + b"\x01TT" + struct.pack(">Q", 99)
             + b"\x01tt\x01" + b"\x01SS" + A.longstr(b"str") + b"\x01xx" + A.longstr(b"\xff")
             + b"\x01VV" + b"\x01DD\x02" + struct.pack(">i", 314)
             + b"\x01AA" + A.longstr(b"I\x00\x00\x00\x01S" + A.longstr(b"z"))
             + b"\x01FF" + A.encode_table({"in": "ner"}))
    c = A.AmqpClient("u", "p")
    c.start()
    c.receive_data(_start_with(struct.pack(">I", len(table)) + table))
    assert c.server_properties == {
        "b": -1, "B": 255, "s": -2, "u": 65534, "I": -2, "i": 5, "l": -1, "L": 1, "f": 1.5,
        "d": 2.5, "T": 99, "t": True, "S": "str", "x": b"\xff", "V": None, "D": (2, 314),
        "A": [1, "z"], "F": {"in": "ner"}}


def test_deeply_nested_table_is_refused():
    inner = b""
    for _ in range(40):
        inner = A.encode_table({}) if not inner else struct.pack(">I", len(inner) + 3) + b"\x01kF" + inner
    c = A.AmqpClient("u", "p")
    c.start()
    with pytest.raises(A.AmqpError) as ei:
        c.receive_data(_start_with(inner))
    assert ei.value.reason == "bad_table"


def test_fuzzed_broker_input_only_ever_raises_amqp_error():
    """Random corruption of a valid stream: events or AmqpError, nothing else."""
    rng = random.Random(1409)
    good = _good_stream() + srv(0, spec.Connection.Close(320, "x", 0, 0))
    outcomes = {"events": 0, "error": 0}
    for _ in range(3000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            op = rng.random()
            i = rng.randrange(len(data))
            if op < 0.5:
                data[i] = rng.randrange(256)
            elif op < 0.75:
                del data[i:i + rng.randint(1, 8)]
            else:
                data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        c = opened()[0]
        try:
            for k in range(0, len(data), rng.choice((1, 5, 64, len(data)))):
                c.receive_data(bytes(data[k:k + 64 if k + 64 < len(data) else len(data)]))
            outcomes["events"] += 1
        except A.AmqpError:
            outcomes["error"] += 1
    assert outcomes["events"] and outcomes["error"]


def test_acks_decoded_in_place_match_the_general_decoder():
    """receive_data decodes basic.ack frames in place on an open connection; any tag,
    stray bits, any channel and any chunking give what the general decoder gives (it
    still handles them while the connection is closing)."""
    import random
    rng = random.Random(3)
    acks = [(rng.randrange(1, 4), rng.choice([1, 2**64 - 1, rng.randrange(2**64)]),
             rng.randrange(256)) for _ in range(200)]
    stream = b"".join(A.method_frame(ch, A.BASIC_ACK, struct.pack(">QB", tag, bits))
                      for ch, tag, bits in acks)
    want = [A.Ack(ch, tag, bool(bits & 1)) for ch, tag, bits in acks]
    c = opened()[0]
    assert c.receive_data(stream) == want
    for size in (1, 5, 13, 64):
        c = opened()[0]
        got = []
        for i in range(0, len(stream), size):
            got += c.receive_data(stream[i:i + size])
        assert got == want, size
    c = opened()[0]
    c.close()                                   # "closing": the general decoder
    assert c.state == "closing"
    assert c.receive_data(stream) == want
    # a truncated ack (bad size) is still refused by the general decoder
    c = opened()[0]
    with pytest.raises(A.AmqpError):
        c.receive_data(A.method_frame(1, A.BASIC_ACK, b"\x00" * 8))
