"""The Lumberjack output against the in-repo reader over loopback TCP and TLS."""

import json
import struct
import zlib

import pytest
import trio

from conftest import require_native
from logjam_relay.io.net import TLSSettings, server_context
from logjam_relay.outputs.lumberjack import (
    EventEncoder,
    LumberjackConfig,
    LumberjackOutput,
    parse_url,
)
from logjam_relay.protocols import lumberjack as lj
from logjam_relay.protocols.logjam import compress, encode_meta
from logjam_relay.spool.api import KIND_SAMWISE, MemorySource
from peers.lumberjack_reader import LumberjackReader

FAST = dict(backoff_min=0.01, backoff_max=0.05, relay_host="relay-1")


def body(i):
    return json.dumps({"i": i, "msg": "x" * 40}).encode()


def make_source(n, compressions=(0,), app_env=b"my-app-production", topic=b"logs.app"):
    src = MemorySource()
    for i in range(n):
        comp = compressions[i % len(compressions)]
        src.append([app_env, topic, compress(body(i), comp),
                    encode_meta(comp, 7, 1_700_000_000_000 + i, i + 1)])
    return src


def config(port, **kw):
    kw = {**FAST, "tls": TLSSettings(enabled=False), **kw}
    return LumberjackConfig(hosts=(("127.0.0.1", port),), **kw)


def seqs(reader):
    return [int(e.fields["sequence"]) for e in reader.events]


async def start_reader(nursery, **kw):
    r = LumberjackReader(**kw)
    await nursery.start(r.serve)
    return r


async def deliver_all(nursery, src, cfg, timeout=15):
    out = LumberjackOutput(src, cfg)
    cs = trio.CancelScope()
    nursery.start_soon(_run_in, out, cs)
    with trio.fail_after(timeout):
        while not src.all_acked:
            await trio.sleep(0.005)
    cs.cancel()
    return out


async def _run_in(out, cs):
    with cs:
        await out.run()


# ------------------------------------------------------------------ normal flow


@pytest.mark.parametrize("compression", [0, 3])
@pytest.mark.parametrize("pipeline", [1, 3])
async def test_normal_flow(nursery, compression, pipeline):
    r = await start_reader(nursery)
    src = make_source(103, compressions=(0, 1, 2, 3))
    out = await deliver_all(nursery, src, config(r.port, window=10, compression=compression,
                                                 pipeline=pipeline))
    assert sorted(seqs(r)) == list(range(1, 104))
    assert len(r.events) == 103                       # no duplicates without failures
    assert [len(w.events) for w in r.windows][:10] == [10] * 10
    st = out.stats()
    assert st["events_sent"] == st["events_acked"] == 103 and st["events_resent"] == 0
    assert st["windows_acked"] == 11 and st["connections"] == 1 and st["connect_attempts"] == 1
    assert st["window_rtt_count"] == 11 and st["window_rtt_sum_seconds"] > 0
    # sequence restarts at 1 in every window
    assert all([e.seq for e in w.events] == list(range(1, len(w.events) + 1)) for w in r.windows)
    assert src.acked_positions[-1].offset == 102


async def test_event_mapping(nursery):
    r = await start_reader(nursery)
    src = make_source(4, compressions=(0, 1, 2, 3), app_env=b"my-app-production")
    await deliver_all(nursery, src, config(r.port, window=10))
    for i, ev in enumerate(r.events):
        assert ev.fields == {
            "line": body(i).decode(), "app": "my-app", "env": "production",
            "topic": "logs.app", "device": "7", "sequence": str(i + 1),
            "created_ms": str(1_700_000_000_000 + i), "host": "relay-1", "type": "logjam",
        }
        json.loads(ev.fields["line"])


async def test_undecodable_body_is_tagged_not_lost(nursery):
    r = await start_reader(nursery)
    src = MemorySource()
    src.append([b"a-b", b"logs", b"not zlib \xff", encode_meta(1, 1, 5, 1)])       # bad zlib
    src.append([b"a-b", b"logs", b"\x00\x00\x00\x10xx", encode_meta(3, 1, 5, 2)])  # bad lz4
    src.append([b"noenv", b"logs", b"{}", b"short meta"])                           # bad meta
    src.append([b"a-b", b"logs", b"{}", encode_meta(0, 1, 5, 4)], kind=KIND_SAMWISE)  # skipped
    src.append([b"a-b", b"logs", b"{}", encode_meta(0, 1, 5, 5)])                   # fine
    out = await deliver_all(nursery, src, config(r.port))
    evs = r.events
    assert len(evs) == 4
    assert evs[0].fields["tags"] == "logjam_decode_error"
    assert evs[0].fields["line"] == "not zlib \ufffd"
    assert evs[1].fields["tags"] == "logjam_decode_error"
    assert evs[2].fields["tags"] == "logjam_decode_error"
    assert evs[2].fields["app"] == "noenv" and evs[2].fields["env"] == ""
    assert evs[2].fields["sequence"] == ""
    assert "tags" not in evs[3].fields and evs[3].fields["sequence"] == "5"
    st = out.stats()
    assert st["decode_errors"] == 3 and st["skipped_records"] == 1


def test_encoder_output_parses():
    enc = EventEncoder("h")
    src = make_source(3)
    frames, n = enc.encode(src.read(10))
    assert n == 3
    conn = lj.Connection(lj.Role.READER)
    conn.receive_data(lj.encode_window(frames, n, 1))
    evs = []
    while (ev := conn.next_event()) is not lj.NEED_DATA:
        evs.append(ev)
    assert evs[-1] == lj.WindowComplete(3, 3, 0)


async def test_only_non_logjam_records_are_acked_without_sending(nursery):
    r = await start_reader(nursery)
    src = MemorySource()
    for _ in range(3):
        src.append([b"x"], kind=KIND_SAMWISE)
    out = await deliver_all(nursery, src, config(r.port))
    assert r.events == [] and out.stats()["skipped_records"] == 3


# --------------------------------------------------------------------------- TLS


async def test_tls_with_client_certificate(nursery, tls_files):
    ctx = server_context(tls_files["server"], ca=tls_files["ca"], require_client_cert=True)
    r = await start_reader(nursery, ssl_context=ctx)
    tls = TLSSettings(ca=tls_files["ca"], cert=tls_files["client"], server_name="localhost")
    src = make_source(50)
    await deliver_all(nursery, src, config(r.port, tls=tls, window=8, compression=3))
    assert sorted(seqs(r)) == list(range(1, 51))


async def test_tls_url(nursery, tls_files):
    r = await start_reader(nursery, ssl_context=server_context(tls_files["server"]))
    cfg = parse_url(f"lumberjack://localhost:{r.port}?ca={tls_files['ca']}&window=5",
                    **FAST)
    assert cfg.tls.enabled and cfg.tls.verify
    src = make_source(12)
    await deliver_all(nursery, src, cfg)
    assert sorted(seqs(r)) == list(range(1, 13))


async def test_tls_verification_failure_retries_and_never_sends(nursery, tls_files):
    r = await start_reader(nursery, ssl_context=server_context(tls_files["server"]))
    src = make_source(5)
    out = LumberjackOutput(src, config(r.port, tls=TLSSettings(server_name="localhost")))
    cs = trio.CancelScope()
    nursery.start_soon(_run_in, out, cs)
    with trio.fail_after(10):
        while out.connect_failures < 3:
            await trio.sleep(0.01)
    cs.cancel()
    assert r.events == [] and out.events_sent == 0 and not src.acked_positions


# ------------------------------------------------------------- acks and timeouts


async def test_ack_equal_last_seq_accepted(nursery):
    r = await start_reader(nursery, ack_mode="last_seq")
    src = make_source(25)
    out = await deliver_all(nursery, src, config(r.port, window=10))
    assert out.stats()["disconnects"] == {} and len(r.events) == 25


async def test_keepalives_ignored_and_extend_deadline(nursery):
    # ack after 1.2 s, keep-alive every 0.05 s, writer timeout 0.6 s: no timeout (the ack
    # comes at twice the timeout; 0.6 s leaves a loaded machine's scheduling room: with
    # 0.25 s one run beside two busy loops saw a keep-alive gap over it)
    r = await start_reader(nursery, ack_delay=1.2, keepalive_interval=0.05)
    src = make_source(6)
    out = await deliver_all(nursery, src, config(r.port, window=3, timeout=0.6, pipeline=1))
    st = out.stats()
    assert st["keepalives"] > 0 and st["disconnects"] == {} and st["events_resent"] == 0
    assert len(r.events) == 6


async def test_timeout_reconnects_and_resends(nursery):
    async def stall_first_connection(w):
        if w.connection == 1:
            await trio.sleep(1)

    r = await start_reader(nursery, on_window=stall_first_connection)
    src = make_source(20)
    out = await deliver_all(nursery, src, config(r.port, window=5, timeout=0.2, pipeline=2))
    st = out.stats()
    assert st["disconnects"].get("timeout", 0) >= 1
    assert st["events_resent"] >= 5 and st["connections"] >= 2
    assert set(seqs(r)) == set(range(1, 21))


async def test_bogus_ack_value_reconnects(nursery):
    state = {"n": 0}

    def ack_value(wc):
        state["n"] += 1
        return wc.count + 7 if state["n"] == 1 else wc.count

    r = await start_reader(nursery, ack_value=ack_value)
    src = make_source(10)
    out = await deliver_all(nursery, src, config(r.port, window=5))
    assert out.stats()["disconnects"].get("unexpected_ack") == 1
    assert set(seqs(r)) == set(range(1, 11))


async def test_partial_ack_ignored_then_timeout(nursery):
    state = {"n": 0}

    def ack_value(wc):
        state["n"] += 1
        return wc.count - 1 if state["n"] == 1 else wc.count

    r = await start_reader(nursery, ack_value=ack_value)
    src = make_source(10)
    out = await deliver_all(nursery, src, config(r.port, window=5, timeout=0.2, pipeline=1))
    st = out.stats()
    assert st["partial_acks"] == 1 and st["disconnects"].get("timeout") == 1
    assert set(seqs(r)) == set(range(1, 11))


async def test_failover_to_second_host(nursery, port_factory):
    r = await start_reader(nursery)
    dead = port_factory()
    src = make_source(10)
    cfg = LumberjackConfig(hosts=(("127.0.0.1", dead), ("127.0.0.1", r.port)),
                           tls=TLSSettings(enabled=False), window=4, **FAST)
    out = await deliver_all(nursery, src, cfg)
    assert out.connect_failures >= 1 and len(r.events) == 10


async def test_restart_of_output_resends_unacked(nursery):
    """A supervisor restart: the new task rewinds the source and resends."""
    dead = await start_reader(nursery, no_ack=True)
    src = make_source(10)
    out = LumberjackOutput(src, config(dead.port, window=5, timeout=30))
    cs = trio.CancelScope()
    nursery.start_soon(_run_in, out, cs)
    with trio.fail_after(5):
        while dead.events_received < 10:
            await trio.sleep(0.005)
    cs.cancel()
    assert not src.acked_positions
    r = await start_reader(nursery)
    await deliver_all(nursery, src, config(r.port, window=5))
    assert sorted(seqs(r)) == list(range(1, 11))


async def test_cancellation_is_clean(nursery):
    r = await start_reader(nursery)
    src = make_source(3)
    out = LumberjackOutput(src, config(r.port))
    with trio.move_on_after(0.3):
        await out.run()
    assert src.all_acked and out.connected_to is None


# ------------------------------------------------------- reader restarts mid-stream


async def test_reader_restarted_10_times_mid_stream(nursery):
    n_events, window, pipeline, restarts = 3000, 20, 4, 10
    src = make_source(n_events)
    progress = {"target": 0, "event": trio.Event()}

    def on_window(w):
        if reader.windows_received >= progress["target"]:
            progress["event"].set()

    reader = LumberjackReader(on_window=on_window, ack_delay=0.002)
    out = LumberjackOutput(src, config(0, window=window, pipeline=pipeline, timeout=5))
    out_scope = trio.CancelScope()
    for i in range(restarts + 1):
        progress["target"] = reader.windows_received + 6
        progress["event"] = trio.Event()
        with trio.CancelScope() as rs:
            async with trio.open_nursery() as rn:
                await rn.start(reader.serve)
                if i == 0:
                    out.config = config(reader.port, window=window, pipeline=pipeline,
                                        timeout=5)
                    nursery.start_soon(_run_in, out, out_scope)
                with trio.fail_after(15):
                    if i < restarts:
                        await progress["event"].wait()
                        rs.cancel()            # kill the reader with windows in flight
                    else:
                        while not src.all_acked:
                            await trio.sleep(0.01)
                        rs.cancel()
    out_scope.cancel()
    got = seqs(reader)
    assert set(got) == set(range(1, n_events + 1))        # every message delivered
    dups = len(got) - n_events
    assert 0 <= dups <= restarts * pipeline * window        # bounded by windows in flight
    assert reader.connections >= restarts + 1
    st = out.stats()
    assert st["events_acked"] == n_events
    assert st["connect_attempts"] >= restarts + 1


# ------------------------------------------- every error case of the reference table


class ManglingProxy:
    """TCP proxy writer -> reader that corrupts the first window of the first connection."""

    def __init__(self, target_port, mangle):
        self.target_port = target_port
        self.mangle = mangle
        self.port = None
        self.connections = 0

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client):
        self.connections += 1
        mangle = self.mangle if self.connections == 1 else None
        try:
            upstream = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        except OSError:
            await client.aclose()
            return
        async with trio.open_nursery() as n:
            n.start_soon(self._pump, client, upstream, mangle, n.cancel_scope)
            n.start_soon(self._pump, upstream, client, None, n.cancel_scope)
        await trio.aclose_forcefully(client)
        await trio.aclose_forcefully(upstream)

    async def _pump(self, src, dst, mangle, scope):
        try:
            if mangle is not None:
                conn = lj.Connection(lj.Role.READER)
                buf = b""
                done = False
                while not done:
                    data = await src.receive_some(65536)
                    if not data:
                        return
                    buf += data
                    conn.receive_data(data)
                    while (ev := conn.next_event()) is not lj.NEED_DATA:
                        if isinstance(ev, lj.WindowComplete):
                            done = True
                            break
                end = conn.consumed
                out, action = mangle(buf[:end])
                await dst.send_all(out)
                if action == "eof":
                    await dst.send_eof()
                    await trio.sleep_forever()
                if action == "silence":
                    await trio.sleep_forever()
                if buf[end:]:
                    await dst.send_all(buf[end:])
            while data := await src.receive_some(65536):
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            scope.cancel()


def _events_of(window: bytes):
    conn = lj.Connection(lj.Role.READER)
    conn.receive_data(window)
    evs = []
    while (ev := conn.next_event()) is not lj.NEED_DATA:
        evs.append(ev)
    return [e for e in evs if isinstance(e, lj.Data)]


def _frames(events):
    return b"".join(lj.encode_data_frame(e.seq, e.fields.items()) for e in events)


def _c_payload(w):           # a compressed window: W(6) + 1C + len(4) + payload
    return w[12:]


def _recompress_truncated(w):
    p = _c_payload(w)[:-6]
    return w[:6] + b"1C" + struct.pack(">I", len(p)) + p


def _split_two_c(w):
    evs = _events_of(w)
    h = len(evs) // 2
    return (w[:6] + lj.encode_compressed_frame(_frames(evs[:h]))
            + lj.encode_compressed_frame(_frames(evs[h:])))


def _d_then_c(w):
    evs = _events_of(w)
    return w[:6] + _frames(evs[:1]) + lj.encode_compressed_frame(_frames(evs[1:]))


def _w_mid_window(w):
    evs = _events_of(w)
    return w[:6] + _frames(evs[:1]) + lj.encode_window_frame(1) + _frames(evs[1:])


def _w_smaller(w):
    n = struct.unpack(">I", w[2:6])[0]
    return lj.encode_window_frame(n - 1) + w[6:]


TABLE = [
    # name, compression, mangle -> (bytes, action), expected reader error reason or None
    ("unknown_frame_type", 0, lambda w: (w[:6] + b"1X" + w[8:], None), "unknown_frame_type"),
    ("first_frame_not_W", 0, lambda w: (w[6:], None), "expected_window"),
    ("first_frame_C", 3, lambda w: (w[6:], None), "expected_window"),
    ("version_2", 0, lambda w: (b"2" + w[1:], None), "bad_version"),
    ("truncated_then_fin", 0, lambda w: (w[:-3], "eof"), "truncated"),
    ("truncated_then_silence", 0, lambda w: (w[:-3], "silence"), "timeout"),
    ("zlib_bad_header", 3, lambda w: (w[:12] + b"\x00\x00" + w[14:], None), "zlib_error"),
    ("zlib_bad_adler32", 3, lambda w: (w[:-1] + bytes([w[-1] ^ 0xFF]), None), "zlib_error"),
    ("zlib_truncated_stream", 3, lambda w: (_recompress_truncated(w), None), "zlib_error"),
    ("zlib_len_0", 3, lambda w: (w[:6] + b"1C\x00\x00\x00\x00", None), "zlib_error"),
    ("window_split_over_two_C", 3, lambda w: (_split_two_c(w), None), "window_split"),
    ("C_more_events_than_W", 3, lambda w: (_w_smaller(w), None), None),   # partial ack
    ("more_D_than_W", 0, lambda w: (_w_smaller(w), None), "expected_window"),
    ("D_then_C_ok", 3, lambda w: (_d_then_c(w), None), None),
    ("W_again_mid_window", 0, lambda w: (_w_mid_window(w), None), "unexpected_window"),
    ("W_10001", 0, lambda w: (lj.encode_window_frame(10001) + w[6:], None), "window_too_large"),
]


@pytest.mark.parametrize("name,compression,mangle,reason", TABLE, ids=[t[0] for t in TABLE])
async def test_reader_error_cases_writer_recovers(nursery, name, compression, mangle, reason):
    r = await start_reader(nursery, timeout=0.3)
    proxy = ManglingProxy(r.port, mangle)
    await nursery.start(proxy.serve)
    src = make_source(20)
    out = await deliver_all(nursery, src, config(proxy.port, window=5, pipeline=2,
                                                 compression=compression, timeout=0.6))
    assert set(seqs(r)) == set(range(1, 21))
    assert len(seqs(r)) <= 20 + 2 * 5
    if reason == "timeout":
        assert r.timeouts == 1
    elif reason is not None:
        assert r.errors.get(reason) == 1, r.errors
    if name == "D_then_C_ok":
        assert out.stats()["disconnects"] == {} and len(r.events) == 20
    elif name == "C_more_events_than_W":
        st = out.stats()
        assert r.dropped_events == 1 and st["partial_acks"] == 1
        assert st["pipeline_fallbacks"] == 1 and st["connections"] >= 2
    else:
        assert out.stats()["connections"] >= 2


# ------------------------------------------------------------------- URL parsing


def test_parse_url_full():
    cfg = parse_url("lumberjack://h1:5044,h2,[::1]:6000?window=1000&compression=3&tls=on"
                    "&ca=/ca.pem&cert=/c.pem&key=/k.pem&server_name=logs.example&verify=on"
                    "&timeout=30&pipeline=4&loadbalance=off&backoff_min=1&backoff_max=60"
                    "&relay_host=r1")
    assert cfg.hosts == (("h1", 5044), ("h2", 5044), ("::1", 6000))
    assert (cfg.window, cfg.compression, cfg.timeout, cfg.pipeline) == (1000, 3, 30.0, 4)
    assert cfg.loadbalance is False and cfg.relay_host == "r1"
    assert cfg.tls == TLSSettings(True, "/ca.pem", "/c.pem", "/k.pem", "logs.example", True)
    assert (cfg.backoff_min, cfg.backoff_max) == (1.0, 60.0)


def test_parse_url_defaults():
    cfg = parse_url("lumberjack://logs")
    assert cfg.hosts == (("logs", 5044),)
    assert cfg.tls.enabled and cfg.tls.verify
    assert cfg.window == 1000 and cfg.compression == 3 and cfg.timeout == 30.0
    assert parse_url("lumberjack://h?tls=off&compression=0").tls.enabled is False


@pytest.mark.parametrize("url,word", [
    ("http://h", "scheme"),
    ("lumberjack://", "host"),
    ("lumberjack://h:notaport", "h:notaport"),
    ("lumberjack://h:0", "h:0"),
    ("lumberjack://h?window=abc", "'window'"),
    ("lumberjack://h?window=0", "window"),
    ("lumberjack://h?window=10001", "window"),
    ("lumberjack://h?compression=10", "compression"),
    ("lumberjack://h?timeout=-1", "timeout"),
    ("lumberjack://h?timeout=nan", "'timeout'"),
    ("lumberjack://h?pipeline=0", "pipeline"),
    ("lumberjack://h?tls=maybe", "'tls'"),
    ("lumberjack://h?verify=2", "'verify'"),
    ("lumberjack://h?loadbalance=x", "'loadbalance'"),
    ("lumberjack://h?colour=red", "'colour'"),
    ("lumberjack://h?ca=", "'ca'"),
    ("lumberjack://h?window=1&window=2", "'window'"),
    ("lumberjack://h?backoff_min=5&backoff_max=1", "backoff"),
])
def test_parse_url_errors(url, word):
    with pytest.raises(ValueError) as ei:
        parse_url(url)
    assert word in str(ei.value)


def test_zlib_window_is_one_c_frame():
    enc = EventEncoder("h")
    frames, n = enc.encode(make_source(50).read(50))
    w = lj.encode_window(frames, n, 3)
    assert w[:6] == lj.encode_window_frame(50) and w[6:8] == b"1C"
    assert 12 + struct.unpack(">I", w[8:12])[0] == len(w)
    assert zlib.decompress(w[12:]) == frames


async def test_stop_and_wait_fallback_is_retried_after_a_while(mock_clock):
    """The output asks its ACK state (sans-IO tests: test_lumberjack_protocol.py) with
    trio's clock."""
    from logjam_relay.outputs.lumberjack import PIPELINE_RETRY_AFTER, LumberjackOutput
    out = LumberjackOutput(make_source(1), config(5044, pipeline=4))
    host, other = ("127.0.0.1", 5044), ("127.0.0.2", 5044)
    assert out._depth(host) == 4
    assert out.acks.fall_back(host, trio.current_time())
    assert out._depth(host) == 1 and out._depth(other) == 4
    assert out.stats()["pipeline_fallbacks"] == 1
    mock_clock.jump(PIPELINE_RETRY_AFTER - 1)
    assert out._depth(host) == 1
    mock_clock.jump(2)
    assert out._depth(host) == 4


# ------------------------------------------------- the C event mapping (_ljencode.c)

def _c_encoder_or_skip():
    from logjam_relay.outputs import lumberjack_encode as out
    require_native(out._ljencode, "logjam_relay.outputs._ljencode")
    return out


def test_c_event_mapping_equals_python_on_every_kind_of_record():
    from logjam_relay.spool.api import KIND_LOGJAM, Position, Record
    out = _c_encoder_or_skip()
    body = b'{"action":"a#b","code":200}'
    recs = []
    for comp in (0, 1, 2, 3):
        recs.append([b"app-prod", b"logs.x", compress(body, comp),
                     encode_meta(comp, 7, 1_700_000_000_000, 5 + comp)])
    recs += [
        [b"app-prod", b"logs.x", b"not zlib", encode_meta(1, 7, 1, 1)],     # undecodable
        [b"app-prod", b"logs.x", b"\xff\xfe", encode_meta(9, 7, 1, 1)],     # unknown codec
        [b"app-prod", b"logs.x", body, b"short meta"],
        [b"app-prod", b"logs.x", body],                                      # 3 frames
        [], [b"only"],
        [b"heartbeat", b"tcp://h:9606", b"{}", encode_meta(0, 7, 1, 1)],
        [b"no-dash", b"\xff topic", b"\xc3\x28 not utf-8", encode_meta(0, 2**32 - 1,
                                                                         2**64 - 1, 2**64 - 1)],
        [b"app-prod", b"logs.x", memoryview(body), encode_meta(0, 7, 1, 1)],
        [b"app-prod", b"logs.x", bytearray(body), encode_meta(0, 7, 1, 1)],
    ]
    records = [Record(Position(0, i), KIND_LOGJAM, f) for i, f in enumerate(recs)]
    records.insert(3, Record(Position(0, 99), KIND_SAMWISE, [b"b1", b"120"]))
    c, py = out.EventEncoder("relay-1"), out.EventEncoder("relay-1")
    assert c.encode(records) == py.encode_py(records)
    assert c.decode_errors == py.decode_errors == 6
    frames, n = c.encode(records)
    assert n == len(recs) - 1                         # all but the heartbeat
    conn = lj.Connection(lj.Role.READER)
    conn.receive_data(lj.encode_window(frames, n))
    events = []
    while (ev := conn.next_event()) is not lj.NEED_DATA:
        if type(ev) is lj.Data:
            events.append(ev)
    assert len(events) == n and events[0].fields["line"] == body.decode()
    assert events[10].fields["device"] == str(2**32 - 1)
    assert events[10].fields["sequence"] == str(2**64 - 1)
