"""The Courier writer end to end: spool (MemorySource) -> writer -> in-repo receiver.

Real loopback sockets, ephemeral ports. Timeouts are scaled down from the production
defaults (15 s network timeout, 10 s idle PING, 5 s receiver keep-alive timer) so the
suite stays short; the ratios between them are kept, which is what the behaviour depends on.
"""

import json
import socket
import struct

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import require_native
from logjam_relay.io.net import TLSSettings, server_context
from logjam_relay.outputs.courier import (
    BAD_META_TAG,
    NOT_JSON_TAG,
    CourierConfig,
    CourierOutput,
    parse_url,
    record_to_event,
)
from logjam_relay.protocols import courier as P
from logjam_relay.protocols.logjam import compress, encode_meta
from logjam_relay.spool.api import KIND_SAMWISE, MemorySource, Position, Record
from peers.courier_receiver import CourierReceiver

PLAIN = TLSSettings(enabled=False)


def fill(src: MemorySource, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        src.append([b"my-app-prod", b"logs.my-app.prod", b'{"i":%d}' % i,
                    encode_meta(0, 3, 1_700_000_000_000 + i, i + 1)])


def config(*ports, **kw) -> CourierConfig:
    kw.setdefault("tls", PLAIN)
    kw.setdefault("payload_size", 25)
    kw.setdefault("backoff_initial", 0.01)
    kw.setdefault("backoff_max", 0.05)
    kw.setdefault("network_timeout", 3.0)
    kw.setdefault("hostname", "relay-host")
    return CourierConfig(hosts=tuple(("127.0.0.1", p) for p in ports), **kw)


async def wait_for(pred, timeout=15.0):
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.01)


def seqs(rcv: CourierReceiver) -> list[int]:
    return [json.loads(e)["logjam"]["sequence"] for e in rcv.events]


def assert_in_order_acks(src: MemorySource) -> None:
    offs = [p.offset for p in src.acked_positions]
    assert offs == sorted(offs) and offs[-1] == len(src._records) - 1
    assert src.all_acked


# -------------------------------------------------------------- URL parsing


def test_parse_url_defaults_and_parameters(tls_files):
    c = parse_url("courier://logs.example:5043")
    assert c.hosts == (("logs.example", 5043),) and c.payload_size == 1000
    assert c.max_pending == 10 and c.network_timeout == 15.0 and c.idle_ping == 10.0
    assert (c.backoff_initial, c.backoff_max) == (1.0, 30.0)
    assert c.tls.enabled and c.tls.verify
    c = parse_url("courier://a:1,[::1]:2?payload=1000&tls=off&pending=5&timeout=2.5&ping=1"
                  "&backoff=0.5&backoff_max=10&level=6&evnt=off&hostname=h1")
    assert c.hosts == (("a", 1), ("::1", 2)) and not c.tls.enabled and c.max_pending == 5
    assert (c.network_timeout, c.idle_ping, c.backoff_initial, c.backoff_max) == (2.5, 1, .5, 10)
    assert c.compress_level == 6 and not c.streaming and c.hostname == "h1"
    c = parse_url(f"courier://h:1?ca={tls_files['ca']}&cert={tls_files['client']}"
                  "&server_name=localhost&verify=on")
    assert c.tls.ca == tls_files["ca"] and c.tls.server_name == "localhost"


@pytest.mark.parametrize("url,needle", [
    ("http://h:1", "scheme"),
    ("courier://h", "needs a port"),
    ("courier://h:0", "out of range"),
    ("courier://h:x", "not a number"),
    ("courier://h:1/path", "path"),
    ("courier://h:1?payload=0", "payload"),
    ("courier://h:1?payload=abc", "payload"),
    ("courier://h:1?pending=-1", "pending"),
    ("courier://h:1?tls=maybe", "tls"),
    ("courier://h:1?timeout=nan", "timeout"),
    ("courier://h:1?level=10", "level"),
    ("courier://h:1?verify=x", "verify"),
    ("courier://h:1?payload=1&payload=2", "payload"),
    ("courier://h:1?bogus=1", "bogus"),
    ("courier://h:1?ca=/nonexistent/ca.pem", "ca"),
    ("courier://h:1?tls=off&server_name=x", "server_name"),
    ("courier://h:1?backoff=5&backoff_max=1", "backoff_max"),
    ("courier://h:1?server_name=", "server_name"),
])
def test_parse_url_errors_name_the_parameter(url, needle):
    with pytest.raises(ValueError, match=needle):
        parse_url(url)


def test_parse_url_key_without_cert(tls_files):
    with pytest.raises(ValueError, match="key"):
        parse_url(f"courier://h:1?key={tls_files['client']}")


# ------------------------------------------------------------ event mapping


def rec(app_env=b"my-app-prod", body=b'{"a":1}', comp=0, meta=None, kind=0):
    meta = meta or encode_meta(comp, 7, 1_700_000_000_123, 42)
    return Record(Position(0, 0), kind, [app_env, b"logs.x", compress(body, comp), meta])


@pytest.mark.parametrize("comp", [0, 1, 2, 3])
def test_event_mapping(comp):
    ev = json.loads(record_to_event(rec(comp=comp), "h"))
    assert ev == {"@timestamp": "2023-11-14T22:13:20.123Z", "app": "my-app", "env": "prod",
                  "topic": "logs.x", "host": "h",
                  "logjam": {"device": 7, "sequence": 42, "created_ms": 1_700_000_000_123},
                  "payload": {"a": 1}}


@pytest.mark.parametrize("body", [b"plain text", b"NaN", b'{"a":', b"\xff\xfe{}",
                                  b'{"a":1} trailing'])
def test_event_mapping_body_not_json(body):
    ev = json.loads(record_to_event(rec(body=body), "h"))
    assert "payload" not in ev and ev["tags"] == [NOT_JSON_TAG]
    assert ev["message"] == body.decode("utf-8", "replace")


def test_event_mapping_odd_inputs():
    ev = json.loads(record_to_event(rec(app_env=b'no_dash"'), "h"))
    assert (ev["app"], ev["env"]) == ('no_dash"', "")
    ev = json.loads(record_to_event(rec(meta=b"short"), "h"))
    assert ev["tags"] == [BAD_META_TAG] and ev["message"] == '{"a":1}'
    assert record_to_event(rec(kind=KIND_SAMWISE), "h") is None


# ------------------------------------------------------------- end to end


@pytest.mark.parametrize("behaviour,streaming", [
    (P.GO, True),          # VERS 32, EVNT flag -> EVNT
    (P.RUBY2, False),      # VERS 20, no flag -> JDAT
    (P.RUBY1, False),      # ???? -> no handshake, JDAT
])
async def test_handshake_variants_deliver_exactly_once(nursery, behaviour, streaming):
    rcv = CourierReceiver(behaviour)
    port = await nursery.start(rcv.serve)
    src = MemorySource()
    fill(src, 480)
    src.append([b"x"], kind=KIND_SAMWISE)      # not a logjam record: skipped, still acked
    fill(src, 20, 480)
    out = CourierOutput(config(port), src)
    nursery.start_soon(out.run)
    await wait_for(lambda: src.all_acked)
    assert seqs(rcv) == list(range(1, 501))
    assert out.streaming is streaming and out.reconnects == 0 and out.errors == {}
    assert out.stats()["events_skipped"] == 1 and out.stats()["events_acked"] == 500
    assert_in_order_acks(src)
    ev = json.loads(rcv.events[0])
    assert ev["app"] == "my-app" and ev["host"] == "relay-host" and ev["payload"] == {"i": 0}


async def test_partial_and_keepalive_acks(nursery):
    async def sink(nonce, part):
        await trio.sleep(0.02)

    rcv = CourierReceiver(sink=sink, ack_chunk=3, ack_timeout=0.01)
    port = await nursery.start(rcv.serve)
    src = MemorySource()
    fill(src, 200)
    out = CourierOutput(config(port, payload_size=20), src)
    nursery.start_soon(out.run)
    await wait_for(lambda: src.all_acked)
    assert seqs(rcv) == list(range(1, 201))
    assert out.keepalive_acks > 0 and rcv.timer_acks_sent > 0
    assert out.reconnects == 0 and out.stats()["payloads_acked"] == 10
    assert_in_order_acks(src)


@pytest.mark.parametrize("scale", [0.1, 1.0], ids=["scaled-2s", "real-20s"])
async def test_stalled_receiver_with_keepalive_acks_is_not_a_timeout(nursery, scale):
    """A receiver that stalls 20 s (and the same scaled by 0.1: 2 s stall, 1.5 s network
    timeout, 0.5 s keep-alive ACKN timer, 1 s idle PING). Real: 15 s network timeout,
    5 s keep-alive ACKN timer (as the Go receiver), 10 s idle PING.

    The stall is longer than the network timeout; only the keep-alive ACKNs (same
    sequence) keep the connection alive, exactly as with the real Go receiver."""
    stalled = []

    async def sink(nonce, part):
        if not stalled:
            stalled.append(nonce)
            await trio.sleep(20 * scale)

    rcv = CourierReceiver(sink=sink, ack_timeout=5 * scale)
    port = await nursery.start(rcv.serve)
    src = MemorySource()
    fill(src, 100)
    out = CourierOutput(config(port, network_timeout=15 * scale, idle_ping=10 * scale), src)
    nursery.start_soon(out.run)
    await wait_for(lambda: src.all_acked, timeout=15.0 + 30 * scale)
    assert seqs(rcv) == list(range(1, 101))
    assert out.reconnects == 0 and out.errors == {}
    assert out.keepalive_acks >= 2


async def test_timeout_resends_only_unacked_events_with_same_nonce(nursery):
    gate = trio.Event()
    stalled = []

    async def sink(nonce, part):
        if json.loads(part[0])["logjam"]["sequence"] == 6 and not stalled:
            stalled.append(nonce)
            await gate.wait()          # never returns on this connection

    rcv = CourierReceiver(sink=sink, ack_chunk=5, ack_timeout=100)
    port = await nursery.start(rcv.serve)
    src = MemorySource()
    fill(src, 20)
    out = CourierOutput(config(port, payload_size=20, network_timeout=0.3), src)
    nursery.start_soon(out.run)
    await wait_for(lambda: src.all_acked)
    assert rcv.payload_log[0][1] == 20
    assert rcv.payload_log[1] == (stalled[0], 15)      # same nonce, 15 remaining events
    assert seqs(rcv) == list(range(1, 21))             # exactly once
    assert out.errors == {"timeout": 1} and out.events_resent == 15
    gate.set()


async def test_receiver_killed_and_restarted_ten_times(nursery):
    state = {"delivered": 0, "kills": 0}
    kill = trio.Event()

    async def sink(nonce, part):
        state["delivered"] += len(part)
        if state["delivered"] >= 250 * (state["kills"] + 1):
            kill.set()

    rcv = CourierReceiver(sink=sink)
    port = await nursery.start(rcv.serve)
    src = MemorySource()
    fill(src, 3000)
    out = CourierOutput(config(port, payload_size=50), src)
    nursery.start_soon(out.run)
    for _ in range(10):
        with trio.fail_after(15):
            await kill.wait()
        kill = trio.Event()
        rcv.kill()
        await wait_for(lambda: not rcv.serving)
        state["kills"] += 1
        await nursery.start(rcv.serve, port)
    await wait_for(lambda: src.all_acked)
    got = seqs(rcv)
    assert set(got) == set(range(1, 3001))
    dupes = len(got) - 3000
    # bound: what was unacknowledged at each kill (at most max_pending payloads)
    assert dupes <= 10 * 10 * 50
    assert out.reconnects >= 10 and out.events_resent >= dupes
    assert_in_order_acks(src)


@pytest.mark.parametrize("pending,overloads", [(10, False), (12, True)])
async def test_pending_limit_of_the_go_receiver(nursery, pending, overloads):
    async def sink(nonce, part):
        await trio.sleep(0.005)

    rcv = CourierReceiver(P.GO, sink=sink)
    port = await nursery.start(rcv.serve)
    src = MemorySource()
    fill(src, 600)
    out = CourierOutput(config(port, payload_size=10, max_pending=pending), src)
    nursery.start_soon(out.run)
    await wait_for(lambda: src.all_acked)
    assert set(seqs(rcv)) == set(range(1, 601))
    assert (rcv.overloaded > 0) is overloads
    if not overloads:
        assert out.reconnects == 0 and len(seqs(rcv)) == 600


@pytest.mark.parametrize("behaviour", [P.DEFAULT, P.RUBY1])
async def test_idle_ping(nursery, behaviour):
    rcv = CourierReceiver(behaviour)
    port = await nursery.start(rcv.serve)
    src = MemorySource()
    fill(src, 10)
    out = CourierOutput(config(port, idle_ping=0.05, network_timeout=1.0), src)
    nursery.start_soon(out.run)
    await wait_for(lambda: out.pings_sent >= 3)
    fill(src, 10, 10)                       # payloads still flow between PINGs
    await wait_for(lambda: src.all_acked)
    assert out.reconnects == 0 and out.errors == {}
    assert seqs(rcv) == list(range(1, 21))


@pytest.mark.parametrize("tls", [False, True])
async def test_graceful_shutdown_half_closes_after_last_ackn(nursery, tls, tls_files):
    ctx = server_context(tls_files["server"]) if tls else None
    rcv = CourierReceiver(ssl_context=ctx)
    port = await nursery.start(rcv.serve)
    src = MemorySource()
    fill(src, 100)
    settings = TLSSettings(ca=tls_files["ca"]) if tls else PLAIN
    out = CourierOutput(config(port, tls=settings), src)
    done = trio.Event()

    async def run():
        await out.run()
        done.set()

    nursery.start_soon(run)
    await wait_for(lambda: out.events_sent == 100)
    out.request_shutdown()
    with trio.fail_after(5):
        await done.wait()
    assert src.all_acked and seqs(rcv) == list(range(1, 101))
    await wait_for(lambda: rcv.active_connections == 0)
    assert rcv.errors == {}                  # closed after our FIN / close_notify, cleanly


async def test_cancellation_is_clean(nursery):
    gate = trio.Event()

    async def sink(nonce, part):
        await gate.wait()

    rcv = CourierReceiver(sink=sink)
    port = await nursery.start(rcv.serve)
    src = MemorySource()
    fill(src, 100)
    out = CourierOutput(config(port), src)
    with trio.move_on_after(5) as scope:
        async with trio.open_nursery() as n:
            n.start_soon(out.run)
            await wait_for(lambda: rcv.payloads >= 1)
            n.cancel_scope.cancel()
    assert not scope.cancelled_caught
    assert not src.all_acked
    gate.set()            # the receiver finishes its payload and sees our socket closed
    await wait_for(lambda: rcv.active_connections == 0)


async def test_tls_with_client_certificate_and_server_name(nursery, tls_files):
    ctx = server_context(tls_files["server"], ca=tls_files["ca"], require_client_cert=True)
    rcv = CourierReceiver(ssl_context=ctx)
    port = await nursery.start(rcv.serve)
    src = MemorySource()
    fill(src, 100)
    tls = TLSSettings(ca=tls_files["ca"], cert=tls_files["client"], server_name="localhost")
    out = CourierOutput(config(port, tls=tls), src)
    nursery.start_soon(out.run)
    await wait_for(lambda: src.all_acked)
    assert seqs(rcv) == list(range(1, 101)) and out.errors == {}


async def test_tls_verification_failure_retries_without_crashing(nursery, tls_files):
    rcv = CourierReceiver(ssl_context=server_context(tls_files["server"]))
    port = await nursery.start(rcv.serve)
    src = MemorySource()
    fill(src, 10)
    tls = TLSSettings(ca=tls_files["ca"], server_name="wrong.example")
    out = CourierOutput(config(port, tls=tls), src)
    nursery.start_soon(out.run)
    await wait_for(lambda: out.errors.get("tls", 0) >= 3)
    assert rcv.events == [] and out.reconnects >= 3


async def test_several_hosts_fail_over(nursery, port_factory):
    rcv = CourierReceiver()
    port = await nursery.start(rcv.serve)
    dead = port_factory()
    src = MemorySource()
    fill(src, 50)
    out = CourierOutput(config(dead, port), src)
    nursery.start_soon(out.run)
    await wait_for(lambda: src.all_acked)
    assert seqs(rcv) == list(range(1, 51)) and out.errors.get("io", 0) >= 1


# ----------------------------------------- misbehaving servers: close, recover


async def _read_some(stream, n):
    got = b""
    while len(got) < n:
        data = await stream.receive_some(65536)
        if not data:
            break
        got += data
    return got


async def _vers(stream):
    await _read_some(stream, 40)
    await stream.send_all(P.encode_hello(P.GO_VERS))


async def fault_eof(stream):
    pass


async def fault_garbage(stream):
    await _read_some(stream, 40)
    await stream.send_all(P.frame(b"ZZZZ", b"abc"))


async def fault_vers_too_large(stream):
    await _read_some(stream, 40)
    await stream.send_all(b"VERS\x00\x20\x00\x00" + bytes(1000))


async def fault_vers_twice(stream):
    await _vers(stream)
    await stream.send_all(P.encode_hello(P.GO_VERS))


async def fault_ackn_bad_length(stream):
    await _vers(stream)
    await _read_some(stream, 30)
    await stream.send_all(b"ACKN\x00\x00\x00\x13" + bytes(19))


async def fault_pong_with_body(stream):
    await _vers(stream)
    await stream.send_all(b"PONG\x00\x00\x00\x01x")


async def fault_close_after_payload(stream):
    # what every row of the reference error table looks like to the client
    await _vers(stream)
    await _read_some(stream, 30)


async def fault_rst_after_payload(stream):
    await _vers(stream)
    await _read_some(stream, 30)
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def fault_silent(stream):
    await trio.sleep_forever()


async def fault_no_ackn(stream):
    await _vers(stream)
    await trio.sleep_forever()


@pytest.mark.parametrize("fault,reason", [
    (fault_eof, "eof"), (fault_garbage, "handshake"), (fault_vers_too_large, "too_large"),
    (fault_vers_twice, "unexpected"), (fault_ackn_bad_length, "bad_length"),
    (fault_pong_with_body, "bad_length"), (fault_close_after_payload, "eof"),
    (fault_rst_after_payload, "io"), (fault_silent, "timeout"), (fault_no_ackn, "timeout"),
])
async def test_misbehaving_server_closes_and_recovers(nursery, fault, reason):
    rcv = CourierReceiver()
    count = 0

    async def handler(stream):
        nonlocal count
        count += 1
        if count == 1:
            try:
                await fault(stream)
            finally:
                await trio.aclose_forcefully(stream)
        else:
            await rcv.handle_stream(stream)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    nursery.start_soon(trio.serve_listeners, handler, listeners)
    src = MemorySource()
    fill(src, 100)
    out = CourierOutput(config(port, network_timeout=0.3), src)
    nursery.start_soon(out.run)
    await wait_for(lambda: src.all_acked)
    assert set(seqs(rcv)) == set(range(1, 101))
    # an RST may surface as "connection reset" or, if it races our read, as EOF
    reasons = ("io", "eof") if reason == "io" else (reason,)
    assert sum(out.errors.get(r, 0) for r in reasons) >= 1 and out.reconnects >= 1
    assert_in_order_acks(src)


# ------------------------------------------------- the C event mapping (_courierenc.c)

def _courierenc_or_skip():
    from logjam_relay.outputs import courier_encode as co
    require_native(co._courierenc, "logjam_relay.outputs._courierenc")
    return co


def _py_is_json(b: bytes) -> bool:
    from logjam_relay.outputs.courier_encode import _json_check
    try:
        _json_check(b.decode("utf-8"))
        return True
    except (ValueError, RecursionError):
        return False


JSON_CASES = [
    b'{}', b'[]', b' {"a" : [1, -0.5e+3, true, false, null, "x\\u00e9\\n"]} \r\n', b'"s"', b'0',
    b'-0', b'1E5', b'{"a":{"b":{"c":[[[]]]}}}', b'"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"',
    b'', b' ', b'{', b'}', b'[1,]', b'{"a":1,}', b'{"a" 1}', b'{1:2}', b'01', b'1.', b'.5', b'1e',
    b'1e+', b'-', b'+1', b'NaN', b'Infinity', b'-Infinity', b'[NaN]', b'nul', b'truex', b'"a',
    b'"\\x"', b'"\\u12"', b'"\\u12g4"', b'"tab\there"', b'"\x7f"', b'{} {}', b'[1 2]',
    b'"\xff"', b'"\xc0\xaf"', b'"\xed\xa0\x80"', b'"\xf4\x90\x80\x80"', b'"\xe2\x82"',
    b'\xef\xbb\xbf{}', b'{"a":"b"}\x00', b'[' * 10 + b']' * 10, b'"\\ud800"', b'1 ',
]


def test_c_json_check_equals_python_on_the_edge_cases():
    co = _courierenc_or_skip()
    for case in JSON_CASES:
        assert co._courierenc.is_json(case) == _py_is_json(case), case
    deep = b"[" * 2000 + b"]" * 2000
    assert co._courierenc.is_json(deep) is None          # too deep: Python decides


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                                                                          allow_infinity=False)
                    | st.text(), lambda ch: st.lists(ch) | st.dictionaries(st.text(), ch),
                    max_leaves=20),
       st.integers(0, 50), st.binary(max_size=3))
def test_c_json_check_equals_python_on_generated_documents(doc, cut, junk):
    co = _courierenc_or_skip()
    text = json.dumps(doc, ensure_ascii=bool(cut % 2)).encode()
    for case in (text, text[:cut], text + junk, junk + text, text.replace(b",", b",,", 1)):
        assert co._courierenc.is_json(case) == _py_is_json(case), case


def test_c_courier_mapping_equals_python_on_every_kind_of_record():
    co = _courierenc_or_skip()
    from logjam_relay.spool.api import KIND_LOGJAM, Position, Record
    body = b'{"action":"a#b","code":200}'
    frames = []
    for comp in (0, 1, 2, 3):
        frames.append([b"app-prod", b"logs.x", compress(body, comp),
                       encode_meta(comp, 7, 1_700_000_000_123, 5 + comp)])
    frames += [
        [b"app-prod", b"logs.x", b"not json", encode_meta(0, 7, 1, 1)],
        [b"app-prod", b"logs.x", b"\xff", encode_meta(0, 7, 1, 1)],
        [b"app-prod", b"logs.x", b"xx", encode_meta(1, 7, 1, 1)],            # bad zlib
        [b"app-prod", b"logs.x", body, encode_meta(9, 7, 1, 1)],             # unknown codec
        [b"app-prod", b"logs.x", body, b"short"],
        [b"app-prod", b"logs.x", body, b"\x12\x34" + encode_meta(0, 7, 1, 1)[2:]],  # bad tag
        [b"app-prod", b"logs.x", body, b"\xbd\xca" + encode_meta(0, 7, 1, 1)[2:]],  # swapped
        [b"no-dash", b"\xff\"topic", body, encode_meta(0, 2**32 - 1, 0, 2**64 - 1)],
        [b"app-prod", b"logs.x", body, encode_meta(0, 7, 2**64 - 1, 1)],     # year > 9999
        [b"app-prod", b"logs.x", body, encode_meta(0, 7, 253402300799999, 1)],
        [b"app-prod", b"logs.x", memoryview(body), encode_meta(0, 7, 1, 1)],
        [b"heartbeat", b"tcp://h:1", b"{}", encode_meta(0, 7, 1, 1)],
        [b"a-b", b"t", b"{}"],
    ]
    for i, f in enumerate(frames):
        rec = Record(Position(0, i), KIND_LOGJAM, f)
        assert co.record_to_event(rec, "relay\u00e9") == co.record_to_event_py(rec, "relay\u00e9"), f


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=40) | st.text(alphabet='{}[]",:0123456789.eE+-tnrufals \\\t\n', max_size=30)
       .map(str.encode))
def test_c_json_check_equals_python_on_random_input(blob):
    co = _courierenc_or_skip()
    assert co._courierenc.is_json(blob) == _py_is_json(blob), blob


def test_c_json_check_equals_python_around_the_16_byte_scans():
    """The string and UTF-8 scans step 16 and 8 bytes at a time: a quote, backslash,
    control or non-ASCII byte at every offset of a long string, on both sides of each
    step, is found where Python finds it."""
    co = _courierenc_or_skip()
    specials = (b'"', b'\\', b'\\n', b'\\u00e9', b'\x00', b'\x1f', b'\x20', b'\x7f', b'\xc3\xa9',
                b'\xff', b'\xe2\x82', b'\\q')
    for n in range(0, 40):
        for sp in specials:
            for case in (b'"' + b"x" * n + sp + b'x"', b'{"k":"' + b"y" * n + sp + b'"}',
                         b'"' + b"z" * n + b'"' + sp, b'["' + b"a" * n + b'",' + sp + b"]"):
                assert co._courierenc.is_json(case) == _py_is_json(case), case
