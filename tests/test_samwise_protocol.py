"""Sans-IO samwise protocol: every request shape of the reference (samwise.md)."""

import pytest

from logjam_relay.protocols import samwise as p
from logjam_relay.samwise.config import SamwiseConfig, parse_broker, parse_endpoint

E12 = [b""] * 12
RR = [b"120", b"publish", b"round robin"]


def err(frames) -> bytes:
    with pytest.raises(p.SamwiseError) as ei:
        p.parse_request(frames)
    return ei.value.message


@pytest.mark.parametrize("raw,value", [
    (b"120", 120), (b"120abc", 120), (b" 120", 120), (b"+120", 120), (b"-1", -1),
    (b"", 0), (b"abc", 0), (b"x\0\0\0", 0), (b"\t\n 7", 7), (b"99999999999", 2**31 - 1),
])
def test_atoi(raw, value):
    assert p.atoi(raw) == value


@pytest.mark.parametrize("frames,reason", [
    ([b"-1", b"ping"], p.MALFORMED_REQUEST),
    ([b"110", b"ping"], p.WRONG_VERSION),
    ([b"", b"ping"], p.WRONG_VERSION),
    ([b"x\0\0\0", b"ping"], p.WRONG_VERSION),
    ([], p.WRONG_VERSION),
    ([b"120"], p.NO_PAYLOAD),
    ([b"100"], p.NO_PAYLOAD),
    ([b"120", b""], p.UNKNOWN_ACTION),
    ([b"120", b"consume"], p.UNKNOWN_ACTION),
    ([b"120", b"PING"], p.UNKNOWN_ACTION),
    ([b"100", b"status"], p.UNKNOWN_ACTION),
    ([b"100", b"ping", b"extra"], p.MALFORMED_REQUEST),
])
def test_request_errors_in_samd_order(frames, reason):
    assert err(frames) == reason


def test_ping_status_control():
    assert p.parse_request([b"120", b"ping"]) == p.Ping(120)
    assert p.parse_request([b"120abc", b"ping\x00junk", b"extra", b"frames"]) == p.Ping(120)
    assert p.parse_request([b"100", b"ping"]) == p.Ping(100)
    assert p.parse_request([b"120", b"status"]) == p.Status(120)
    assert p.parse_request([b"120", b"stop"]) == p.Control(120, "stop")
    assert p.parse_request([b"120", b"restart", b"x"]) == p.Control(120, "restart")


def test_replies():
    assert p.ok_reply(100) == [b"0"]
    assert p.ok_reply(120) == [b"0", b""]
    assert p.ok_reply(100, b"text") == [b"0", b"text"]
    assert p.error_reply(p.NO_PAYLOAD) == [b"-1", b"no payload"]


def test_publish_120_reference_request():
    frames = [b"120", b"publish", b"round robin", b"amq.direct", b"probe", b"", b"", b"12",
              *E12, b"0", b"hello"]
    assert len(frames) == 22
    ev = p.parse_request(frames)
    assert ev == p.Publish(120, "round robin", 1, "amq.direct", "probe", b"hello")
    ev = p.parse_request([b"120", b"publish", b"redundant", b"2", b"amq.direct", b"probe", b"",
                          b"", b"12", *E12, b"0", b"red2"])
    assert (ev.distribution, ev.copies, ev.payload) == ("redundant", 2, b"red2")


def test_publish_120_properties_headers_trailing():
    props = [b"text/plain", b"utf-8", b"2", b"5", b"corr-1", b"reply", b"60000", b"mid",
             b"type", b"guest", b"app", b"cl"]
    ev = p.parse_request(RR + [b"ex", b"rk", b"1", b"0", b"12", *props, b"4", b"k1", b"v1",
                               b"k2", b"\xff", b"body", b"extra1", b"extra2"])
    assert ev.mandatory and not ev.immediate
    assert ev.properties == p.Properties("text/plain", "utf-8", 2, 5, "corr-1", "reply", "60000",
                                         "mid", "type", "guest", "app", "cl")
    assert ev.headers == (("k1", b"v1"), ("k2", b"\xff"))
    assert ev.payload == b"body" and not ev.headers_as_pairs


def test_publish_libsamwise_pair_count():
    # libsamwise sends the number of pairs; samd would publish b'v1' as the body.
    ev = p.parse_request([b"120", b"publish", b"redundant", b"2", b"amq.direct", b"probe", b"0",
                          b"0", b"12", *([b"text/plain"] * 12), b"1", b"k1", b"v1", b"payload"])
    assert ev.headers == (("k1", b"v1"),) and ev.payload == b"payload" and ev.headers_as_pairs
    assert ev.properties.delivery_mode is None and ev.properties.content_type == "text/plain"


def test_build_roundtrip():
    f = p.build_publish("ex", "rk", b"x", copies=2, mandatory=True,
                        properties={"content_type": "a/b", "priority": 3}, headers={"h": "v"})
    ev = p.parse_request(f)
    assert (ev.copies, ev.mandatory, ev.properties.priority, ev.headers) == (2, True, 3, (("h", b"v"),))
    assert p.parse_request(p.build_publish("ex", "rk", b"x", version=100)) == \
        p.Publish(100, "round robin", 1, "ex", "rk", b"x")
    assert p.parse_request(p.build_rpc("exchange.declare", "e", "topic", broker="b")) == \
        p.Rpc(120, "b", "exchange.declare", "e", "topic")


def test_publish_100_layout():
    ev = p.parse_request([b"100", b"publish", b"round robin", b"ex", b"rk", b"pay"])
    assert ev == p.Publish(100, "round robin", 1, "ex", "rk", b"pay")
    ev = p.parse_request([b"100", b"publish", b"redundant", b"3", b"ex", b"", b"pay"])
    assert (ev.copies, ev.routing_key) == (3, "")


MALFORMED_PUBLISH = [
    [b"120", b"publish"],
    RR + [b"amq.direct"],                                   # exchange only
    [b"120", b"publish", b"round-robin", b"ex", b"rk", b"", b"", b"12", *E12, b"0", b"x"],
    [b"120", b"publish", b"", b"ex", b"rk", b"", b"", b"12", *E12, b"0", b"x"],
    RR + [b"", b"rk", b"", b"", b"12", *E12, b"0", b"x"],    # empty exchange
    RR + [b"ex", b"rk", b"", b"", b"12", *E12, b"0", b""],   # empty payload
    [b"120", b"publish", b"redundant", b"", b"ex", b"rk", b"", b"", b"12", *E12, b"0", b"x"],
    [b"120", b"publish", b"redundant"],
    [b"120", b"publish", b"redundant", b"0", b"ex", b"rk", b"", b"", b"12", *E12, b"0", b"x"],
    [b"120", b"publish", b"redundant", b"-1", b"ex", b"rk", b"", b"", b"12", *E12, b"0", b"x"],
    RR + [b"ex", b"rk", b"pay"],                            # RFC 1.0 layout with 120
    [b"120", b"publish", b"redundant", b"2", b"ex", b"rk", b"pay"],
    # samd crashes on these:
    RR + [b"ex", b"rk", b"", b"", b"0", b"0", b"payload"],   # props count 0
    RR + [b"ex", b"rk", b"", b"", b"2", b"p1", b"p2", b"0", b"payload"],
    RR + [b"ex", b"rk", b"", b"", b"12", *E12],              # counts run past the end
    RR + [b"ex", b"rk", b"", b"", b"12", *E12, b"4", b"k", b"v", b"x"],
    RR + [b"ex", b"rk", b"", b"", b"12", *E12, b"-2", b"x"],
    RR + [b"ex", b"rk", b"", b"", b"12", *E12[:11]],
    RR + [b"ex", b"rk", b"", b"", b"12", *E12, b"3", b"a", b"b", b"c", b"x", b"y"],
    # RabbitMQ would close the channel on these (poison messages): refused here
    RR + [b"bad exchange!", b"rk", b"", b"", b"12", *E12, b"0", b"x"],
    RR + [b"ex", b"rk", b"", b"", b"12", *E12[:6], b"soon", *E12[7:], b"0", b"x"],
    RR + [b"ex", b"rk", b"", b"", b"12", b"", b"", b"300", *E12[3:], b"0", b"x"],
    RR + [b"ex", b"r" * 256, b"", b"", b"12", *E12, b"0", b"x"],
    RR + [b"ex", b"\xff", b"", b"", b"12", *E12, b"0", b"x"],
    # version 100 is strict about the frame count
    [b"100", b"publish", b"round robin", b"ex", b"rk", b"pay", b"extra"],
    [b"100", b"publish", b"round robin", b"ex", b"rk"],
    [b"100", b"publish", b"round robin", b"", b"rk", b"pay"],
]


@pytest.mark.parametrize("frames", MALFORMED_PUBLISH)
def test_malformed_publish(frames):
    assert err(frames) == p.MALFORMED_PUBLISH


MALFORMED_RPC = [
    [b"120", b"rpc"],
    [b"120", b"rpc", b""],
    [b"120", b"rpc", b"", b"exchange.declare"],
    [b"120", b"rpc", b"", b"exchange.declare", b"x"],
    [b"120", b"rpc", b"", b"exchange.declare", b"", b"direct"],
    [b"120", b"rpc", b"", b"exchange.declare", b"x", b""],
    [b"120", b"rpc", b"", b"exchange.delete"],
    [b"120", b"rpc", b"", b"exchange.delete", b""],
    [b"120", b"rpc", b"", b"queue.declare", b"x"],
    [b"100", b"rpc", b"", b"exchange.delete", b"x", b"extra"],
]


@pytest.mark.parametrize("frames", MALFORMED_RPC)
def test_malformed_rpc(frames):
    assert err(frames) == p.MALFORMED_RPC


def test_rpc_ok():
    assert p.parse_request([b"120", b"rpc", b"", b"exchange.declare", b"x", b"fanout", b"more"]) \
        == p.Rpc(120, "", "exchange.declare", "x", "fanout")
    assert p.parse_request([b"100", b"rpc", b"b1", b"exchange.delete", b"x"]) \
        == p.Rpc(100, "b1", "exchange.delete", "x", "")


def test_garbage_never_crashes():
    import random
    rnd = random.Random(7)
    atoms = [b"120", b"100", b"publish", b"rpc", b"redundant", b"round robin", b"12", b"2",
             b"", b"0", b"-5", b"ex", b"exchange.declare", b"\x00", b"999999"]
    for _ in range(5000):
        frames = [rnd.choice(atoms) for _ in range(rnd.randint(0, 24))]
        try:
            p.parse_request(frames)
        except p.SamwiseError:
            pass


def test_config_parsers():
    b = parse_broker("b1=amqp://u%40x:p%3Aw@rabbit.example:5673/v%2F1")
    assert (b.name, b.host, b.port, b.user, b.password, b.vhost) == \
        ("b1", "rabbit.example", 5673, "u@x", "p:w", "v/1")
    assert parse_broker("b=amqp://h").vhost == "/" and parse_broker("b=amqps://h").port == 5671
    assert "p:w" not in repr(b) and "p:w" not in b.display
    for bad, msg in [("noequals", "NAME=amqp"), ("=amqp://h", "broker name"),
                     ("a b=amqp://h", "broker name"), ("b=http://h", "scheme"),
                     ("b=amqp://", "no host"), ("b=amqp://h:99999", "bad URL"),
                     ("b=amqp://h/a/b", "one path segment"), ("b=amqp://h/?x=1", "query")]:
        with pytest.raises(ValueError, match=msg):
            parse_broker(bad)
    assert parse_endpoint("tcp://*:9610") == "tcp://*:9610"
    assert parse_endpoint("ipc:///tmp/sam") == "ipc:///tmp/sam"
    for bad in ["tcp://*", "tcp://*:x", "udp://h:1", "ipc://", "tcp://:1"]:
        with pytest.raises(ValueError, match="--samwise"):
            parse_endpoint(bad)
    with pytest.raises(ValueError, match="duplicate"):
        SamwiseConfig.from_args(["tcp://*:1"], ["a=amqp://h", "a=amqp://g"])
    with pytest.raises(ValueError, match="--amqp-broker"):
        SamwiseConfig.from_args(["tcp://*:1"], [])
    with pytest.raises(ValueError, match="--samwise"):
        SamwiseConfig.from_args([], ["a=amqp://h"])


def test_publish_memo_gives_what_the_parser_gives():
    """PublishMemo: a hit is exactly what parse_request returns for that request."""
    import dataclasses
    import random

    from logjam_relay.protocols.samwise import PublishMemo, SamwiseError, parse_request
    rng = random.Random(7)
    calls = []
    memo = PublishMemo(lambda ev: calls.append(ev.exchange) or ("parts", ev.exchange), size=8)
    templates = [
        p.build_publish("amq.direct", "k", b"-"),
        p.build_publish("amq.topic", "k.x", b"-", copies=2, mandatory=True,
                        properties={"content_type": "text/plain", "delivery_mode": 2},
                        headers={"h": "v", "b": b"\xff"}),
        p.build_publish("amq.direct", "k", b"-", version=100),
        [b"120", b"publish", b"round robin", b"amq.direct", b"k", b"0", b"0", b"12",
         *([b"text/plain"] * 12), b"1", b"k1", b"v1", b"-"],            # libsamwise pairs
        [b"120", b"ping", b"a", b"b", b"c", b"d", b"-"],
        p.build_publish("amq.direct", "k", b"-") + [b"trailing"],       # payload not last
        p.build_publish("amq.direct", "k", b"-", immediate=True),
        [b"120", b"publish", b"round robin", b"amq.direct", b"k", b"0", b"0", b"11", b"-"],
    ]
    publishes = lookups = 0
    for _ in range(400):
        frames = list(rng.choice(templates))
        frames[-1] = rng.choice([b"", b"payload-%d" % rng.randrange(1000), b"\x00x"])
        # lookup (the broker outputs' path: spool record = [targets, *request]) hits only
        # what parse gives: the template with this payload, the same derived parts
        hit = memo.lookup([b"a,b"] + frames, 1)
        try:
            want = parse_request(frames)
        except SamwiseError as e:
            assert hit is None
            with pytest.raises(SamwiseError) as ei:
                memo.parse(frames)
            assert ei.value.message == e.message
            continue
        if hit is not None:
            lookups += 1
            assert dataclasses.replace(hit[0], payload=frames[-1]) == want
            assert hit[1] == ("parts", want.exchange)
        got, derived = memo.parse(frames)
        assert got == want
        assert derived == (("parts", want.exchange) if isinstance(want, p.Publish) else None)
        publishes += isinstance(want, p.Publish)
    assert memo.hits > 100 and lookups > 50
    assert len(calls) == publishes - (memo.hits - lookups)   # a hit does not derive again


def test_publish_memo_is_bounded():
    from logjam_relay.protocols.samwise import PublishMemo
    memo = PublishMemo(size=4, max_key_bytes=200)
    for i in range(50):
        memo.parse(p.build_publish("amq.direct", f"k{i}", b"x"))
        assert len(memo._memo) <= 4
    big = PublishMemo(max_key_bytes=200)
    big.parse(p.build_publish("amq.direct", "k", b"x", headers={"h": "v" * 300}))
    assert not big._memo
