"""Bad input never crashes the inputs' sans-IO cores (issue 15, architecture rule): random
bytes, truncations and bit flips of valid streams fed to
``protocols/lumberjack_server.py`` and ``protocols/courier_server.py``, in random chunks.

Only the module's own error class may come out (``LumberjackError`` / ``CourierError``
with a non-empty ``reason``); any other exception fails the test.  A valid stream must
still parse completely, so the drivers are checked against the unmutated input as well.
"""

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from logjam_relay.protocols import courier as co
from logjam_relay.protocols import lumberjack as lj
from logjam_relay.protocols import lumberjack_server as ljs
from logjam_relay.protocols.courier_server import InputConnection, Payload

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# small bounds, so that a mutated length field reaches them quickly
MAX_EVENT = 4096
MAX_WINDOW_BYTES = 64 * 1024


def _docs(n):
    return [json.dumps({"message": f"m{i}", "fields": {"app": "shop"}}).encode()
            for i in range(n)]


def lumberjack_stream() -> bytes:
    v1 = lj.encode_data_frames([{"a": "1"}, {"line": "x" * 50}, {"c": "3"}])
    return (lj.encode_window(v1, 3) + lj.encode_window(v1, 3, level=3)
            + ljs.encode_window_v2(_docs(4)) + ljs.encode_window_v2(_docs(2), level=0))


def courier_stream() -> bytes:
    hello = co.encode_hello(co.Helo(flags=co.FLAG_EVNT))
    ev = [b'{"message":"a"}', b'{"message":"b","n":1}']
    return (hello + co.encode_payload(b"n" * 16, ev)
            + co.encode_payload(b"m" * 16, ev, streamed=True) + co.frame(b"PING"))


LJ_VALID = lumberjack_stream()


def split(data: bytes, cuts: list[int]):
    """``data`` in the non-empty chunks between the positions ``cuts``."""
    prev = 0
    for cut in sorted(set(cuts)) + [len(data)]:
        if data[prev:cut]:
            yield data[prev:cut]
        prev = max(prev, cut)


def drive_lumberjack(data: bytes, cuts: list[int]) -> int:
    """Feed ``data`` in chunks split at ``cuts``, then EOF; the windows parsed."""
    c = ljs.ServerConnection(max_window=100, max_event_bytes=MAX_EVENT,
                             max_window_bytes=MAX_WINDOW_BYTES)
    windows = 0
    try:
        for chunk in split(data, cuts):
            c.receive_data(chunk)
            while True:
                ev = c.next_event()
                if ev is ljs.NEED_DATA:
                    break
                assert type(ev) is ljs.WindowReceived
                assert 0 < ev.count <= 100 and len(ev.events) <= ev.count
                c.ack(ev.count)
                windows += 1
        c.receive_data(b"")
        while True:
            ev = c.next_event()
            if isinstance(ev, ljs.ConnectionClosed):
                return windows
            assert type(ev) is ljs.WindowReceived
            windows += 1
    except lj.LumberjackError as e:
        assert e.reason and isinstance(e.reason, str)
        # the connection is dead: the same error again, never anything else
        try:
            c.next_event()
        except lj.LumberjackError as again:
            assert again.reason == e.reason
        else:
            raise AssertionError("a dead connection produced an event")
        return -1


def drive_courier(data: bytes, cuts: list[int]) -> int:
    c = InputConnection(ack_timeout=5.0, max_payload_bytes=MAX_WINDOW_BYTES,
                        max_event_bytes=MAX_EVENT)
    payloads = 0
    now = 0.0
    try:
        for chunk in split(data, cuts):
            assert c.busy in (True, False)           # must not raise either
            c.receive_data(chunk)
            while True:
                now += 0.001
                ev = c.next_event(now)
                c.data_to_send()
                if ev is None:
                    break
                if type(ev) is Payload:
                    c.keepalive(ev.nonce)
                    c.ack(ev.nonce, len(ev.events), now)
                    payloads += 1
                elif isinstance(ev, co.Ping):
                    c.pong()
        return payloads
    except co.CourierError as e:
        assert e.reason and isinstance(e.reason, str)
        return -1


CO_VALID = courier_stream()


def test_valid_streams_parse_completely():
    assert drive_lumberjack(LJ_VALID, []) == 4
    assert drive_lumberjack(LJ_VALID, list(range(0, len(LJ_VALID), 3))) == 4
    assert drive_courier(CO_VALID, []) == 2
    assert drive_courier(CO_VALID, list(range(0, len(CO_VALID), 5))) == 2


chunks = st.lists(st.integers(min_value=0, max_value=4096), max_size=8)
CORES = {"lumberjack": (drive_lumberjack, LJ_VALID), "courier": (drive_courier, CO_VALID)}
each_core = pytest.mark.parametrize("core", list(CORES))


@each_core
@FUZZ
@given(data=st.binary(max_size=2048), cuts=chunks)
@example(data=b"1W\x00\x00\x00\x01", cuts=[])
@example(data=b"2W\x00\x00\x00\x012C\xff\xff\xff\xff", cuts=[])
@example(data=b"HELO\xff\xff\xff\xff", cuts=[])
def test_random_bytes(core, data, cuts):
    CORES[core][0](data, cuts)


@each_core
@FUZZ
@given(frac=st.floats(min_value=0, max_value=1), cuts=chunks)
def test_truncations(core, frac, cuts):
    drive, valid = CORES[core]
    drive(valid[:int(len(valid) * frac)], cuts)


def _flip(data: bytes, flips) -> bytes:
    b = bytearray(data)
    for pos, bit in flips:
        b[pos % len(b)] ^= 1 << bit
    return bytes(b)


flips = st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=7)),
                 min_size=1, max_size=4)


@each_core
@FUZZ
@given(fl=flips, cuts=chunks)
def test_bit_flips(core, fl, cuts):
    drive, valid = CORES[core]
    drive(_flip(valid, fl), cuts)


@each_core
@FUZZ
@given(frac=st.floats(min_value=0, max_value=1), junk=st.binary(min_size=1, max_size=64),
       cuts=chunks)
def test_spliced_garbage(core, frac, junk, cuts):
    drive, valid = CORES[core]
    at = int(len(valid) * frac)
    drive(valid[:at] + junk + valid[at:], cuts)


# ------------------------------------------------------------- the event mapping
# An exception here would close the connection before the ACK, and the sender would resend
# the same window forever (a poison event that stops the chain): every event must map.

from logjam_relay.inputs.mapping import MappingOptions, json_event, lumberjack_v1  # noqa: E402

OPTS = MappingOptions(app_field="fields.app")
RELAY_JSON = (b'{"@timestamp":"2024-01-01T00:00:00Z","app":"a","env":"e","topic":"logs.a.e",'
              b'"host":"h","logjam":{"device":1,"sequence":2,"created_ms":3},"payload":{"x":1}}')
any_text = st.text(st.characters(exclude_categories=()), max_size=12)   # lone surrogates too
json_text = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4), max_leaves=12)


def _check(t):
    assert len(t) == 5 and all(isinstance(x, bytes) for x in (t[0], t[1], t[2], t[4]))
    assert len(t[4]) == 8


@pytest.mark.parametrize("raw", [
    RELAY_JSON, RELAY_JSON.replace(b'"app":"a"', b'"app":"a\\x"'),
    b'{"app":"a","topic":"\\ud800","logjam":{"device":1,"sequence":2}}',
    b'{"app":"a","payload":"\\udc80","logjam":{"device":1,"sequence":2}}',
    b'{"app":"a","payload":NaN,"logjam":{"device":1,"sequence":2}}',
    b'{"message":"\\ud800"}', b"[" * 100_000, b"\xff\xfe", b""])
def test_mapping_edge_cases(raw):
    _check(json_event(raw, "in", "1.2.3.4:5", OPTS))


@FUZZ
@given(doc=json_text, relay=st.booleans())
def test_json_event_never_raises(doc, relay):
    import json as _json
    if relay:
        doc = {"app": "a", "env": doc, "topic": doc, "host": doc, "payload": doc,
               "logjam": {"device": 1, "sequence": 2, "created_ms": doc}}
    raw = _json.dumps(doc).encode()
    _check(json_event(raw, "in", "peer", OPTS))


@FUZZ
@given(raw=st.binary(max_size=300), flips=st.lists(st.integers(min_value=0), max_size=3))
def test_json_event_random_and_flipped_bytes(raw, flips):
    _check(json_event(raw, "in", "peer", OPTS))
    b = bytearray(RELAY_JSON)
    for pos in flips:
        b[pos % len(b)] ^= 0x20
    _check(json_event(bytes(b), "in", "peer", OPTS))


@FUZZ
@given(fields=st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=8),
       relay=st.booleans(), raw=st.binary(max_size=40))
def test_lumberjack_v1_never_raises(fields, relay, raw):
    text = raw.decode("utf-8", "surrogateescape")       # as the v1 parser decodes
    if relay:
        fields.update({"type": "logjam", "line": text, "app": text, "env": "e",
                       "topic": text, "device": fields.get("d", "1"), "sequence": "2",
                       "created_ms": text})
    _check(lumberjack_v1(fields, "in", "peer", OPTS))
