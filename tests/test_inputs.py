"""Lumberjack (v1, v2) and Courier inputs: the sans-IO cores, the mapping back to logjam
messages, and real clients (the relay's own writers) into a real relay over TCP and TLS."""

import json
import struct
import zlib

import pytest
import trio

from conftest import free_port
from logjam_relay.inputs import parse_input
from logjam_relay.inputs.mapping import MappingOptions, json_event, lumberjack_v1
from logjam_relay.io import zmq_trio
from logjam_relay.io.net import TLSSettings
from logjam_relay.outputs.courier import CourierOutput, record_to_event
from logjam_relay.outputs.courier import parse_url as courier_url
from logjam_relay.outputs.lumberjack import EventEncoder, LumberjackConfig, LumberjackOutput
from logjam_relay.protocols import lumberjack as lj
from logjam_relay.protocols import lumberjack_server as ljs
from logjam_relay.protocols.logjam import compress, encode_meta
from logjam_relay.spool.api import MemorySource, Position, Record
from relay_harness import running_relay, sync_sub, unmeta

OPTS = MappingOptions()


def body(i):
    return json.dumps({"i": i, "msg": "x" * 40}).encode()


def record(i, comp=0, app_env=b"my-app-production", topic=b"logs.my-app.production"):
    return [app_env, topic, compress(body(i), comp),
            encode_meta(comp, 7, 1_700_000_000_000 + i, i + 1)]


# ------------------------------------------------------------------ sans-IO core

def test_v1_window_plain_and_compressed():
    frames = lj.encode_data_frames([{"a": "1"}, {"b": "2"}, {"c": "3"}])
    for data in (lj.encode_window(frames, 3), lj.encode_window(frames, 3, level=3)):
        c = ljs.ServerConnection()
        for i in range(0, len(data), 7):          # byte-wise arrival
            c.receive_data(data[i:i + 7])
        w = c.next_event()
        assert isinstance(w, ljs.WindowReceived)
        assert (w.version, w.count, w.events) == (1, 3, [{"a": "1"}, {"b": "2"}, {"c": "3"}])
        assert c.ack(w.count) == b"1A\x00\x00\x00\x03"
        assert c.next_event() is ljs.NEED_DATA
        c.receive_data(b"")
        assert isinstance(c.next_event(), ljs.ConnectionClosed)


def test_v2_json_window_as_beats_sends_it():
    docs = [json.dumps({"message": f"m{i}", "fields": {"app": "shop"}}).encode()
            for i in range(5)]
    c = ljs.ServerConnection()
    c.receive_data(ljs.encode_window_v2(docs) + ljs.encode_window_v2(docs[:2], level=0))
    w1, w2 = c.next_event(), c.next_event()
    assert (w1.version, w1.events, w2.events) == (2, docs, docs[:2])
    assert c.ack(2) == b"2A\x00\x00\x00\x02" and c.keepalive() == b"2A\x00\x00\x00\x00"


@pytest.mark.parametrize("data,reason", [
    (b"GET / HTTP/1.1\r\n\r\n", "bad_version"),
    (b"1D\x00\x00\x00\x01\x00\x00\x00\x00", "expected_window"),
    (b"1W\x00\x00\x27\x11", "window_too_large"),
    (b"1W\x00\x00\x00\x02" + lj.encode_data_frame(1, {"a": "b"}.items()) + b"1W\0\0\0\1",
     "unexpected_window"),
    (b"1W\x00\x00\x00\x01" + b"1C\x00\x00\x00\x05hello", "zlib_error"),
    (b"1W\x00\x00\x00\x01" + b"1X\x00", "unknown_frame_type"),
    (b"2W\x00\x00\x00\x01" + lj.encode_data_frame(1, {"a": "b"}.items()), "unexpected_data"),
    (b"2W\x00\x00\x00\x01" + b"2J\x00\x00\x00\x01\x7f\xff\xff\xff", "event_too_large"),
])
def test_bad_input_raises_labelled_error(data, reason):
    c = ljs.ServerConnection(max_event_bytes=1 << 20)
    c.receive_data(data)
    with pytest.raises(lj.LumberjackError) as ei:
        while c.next_event() is not ljs.NEED_DATA:
            pass
    assert ei.value.reason == reason


def test_decompression_bomb_stops_at_the_window_budget():
    bomb = zlib.compress(b"1D" + b"\0" * (200 * 1024 * 1024), 9)    # ~200 KiB -> 200 MiB
    assert len(bomb) < 300_000
    c = ljs.ServerConnection(max_window_bytes=8 * 1024 * 1024)
    c.receive_data(b"1W\x00\x00\x00\x01" + b"1C" + struct.pack(">I", len(bomb)) + bomb)
    with pytest.raises(lj.LumberjackError) as ei:
        c.next_event()
    assert ei.value.reason == "inflate_too_large"


def test_oversized_compressed_frame_refused_before_buffering():
    c = ljs.ServerConnection(max_window_bytes=1 << 20)
    c.receive_data(b"1W\x00\x00\x00\x01" + b"1C" + struct.pack(">I", 1 << 30))
    with pytest.raises(lj.LumberjackError) as ei:
        c.next_event()
    assert ei.value.reason == "window_bytes_exceeded"


# ------------------------------------------------------------------ mapping

def test_mapping_back_from_both_outputs_gives_the_original_message():
    enc = EventEncoder("edge-1")
    for comp in (0, 1):
        rec = Record(Position(0, 0), 0, record(41, comp))
        data, n = enc.encode([rec])
        c = ljs.ServerConnection()
        c.receive_data(lj.encode_window(data, n))
        (fields,) = c.next_event().events
        a, t, b, cmp_, created = lumberjack_v1(fields, "lj", "1.2.3.4:5", OPTS)
        cev = record_to_event(rec, "edge-1")
        assert json_event(cev, "cr", "1.2.3.4:5", OPTS)[:2] == (a, t)
        for got, inp in ((b, "lj"), (json_event(cev, "cr", "p", OPTS)[2], "cr")):
            doc = json.loads(got)
            assert doc.pop("logjam_origin") == {"device": 7, "sequence": 42,
                                                "created_ms": 1_700_000_000_041,
                                                "host": "edge-1", "input": inp}
            assert doc == json.loads(body(41))
        assert (a, t, cmp_) == (b"my-app-production", b"logs.my-app.production", 0)
        assert int.from_bytes(created, "big") == 1_700_000_000_041
    # a second hop keeps the first origin
    once = lumberjack_v1(fields, "lj", "p", OPTS)[2]
    again = dict(fields, line=once.decode(), device="9", sequence="1")
    assert lumberjack_v1(again, "lj2", "p", OPTS)[2] == once


def test_other_events_are_wrapped():
    opts = MappingOptions(app_field="fields.app", env_field="fields.env", default_env="prod")
    raw = json.dumps({"message": "hi", "fields": {"app": "shop-x"}}).encode()
    a, t, b, _, created = json_event(raw, "beats", "10.0.0.1:999", opts)
    assert (a, t, created) == (b"shop-x-prod", b"logs.shop-x.prod", b"\0" * 8)
    doc = json.loads(b)
    assert doc["logjam_origin"] == {"host": "10.0.0.1:999", "input": "beats"}
    assert doc["message"] == "hi"
    a, t, b, _, _ = json_event(b"not json \xff", "beats", "p", OPTS)
    assert (a, t) == (b"unknown-unknown", b"logs.unknown.unknown")
    assert json.loads(b)["message"].startswith("not json")
    a, t, b, _, _ = lumberjack_v1({"line": "x", "app": "a b", "env": "e-1"}, "l", "p", OPTS)
    assert (a, t) == (b"a_b-e_1", b"logs.a_b.e_1")


def test_parse_input_urls(tls_files):
    s = parse_input(f"lumberjack://0.0.0.0:5044?cert={tls_files['server']}&ca={tls_files['ca']}"
                    "&max_window=100&timeout=5s&app_field=fields.app&name=lj1")
    assert (s.port, s.tls, s.max_window, s.timeout, s.mapping.app_field, s.name) == \
        (5044, True, 100, 5.0, "fields.app", "lj1")
    assert parse_input("courier://127.0.0.1?tls=off").port == 5043
    for bad, what in (("lumberjack://0.0.0.0:5044", "no cert"),
                      ("courier://h:1?tls=off&bogus=1", "'bogus'"),
                      ("courier://h:1?tls=off&max_window=0", "'max_window'"),
                      ("zmq://h:1", "scheme"),
                      ("courier://h:1?tls=off&cert=/nope", "'cert'")):
        with pytest.raises(ValueError, match=what):
            parse_input(bad)


def test_every_parameter_docs_inputs_md_lists_is_accepted(tls_files):
    """The parameter names come from docs/inputs.md's table, so a documented parameter the
    parser refuses (or a renamed one) fails here."""
    import pathlib
    import re
    doc = (pathlib.Path(__file__).parent.parent / "docs" / "inputs.md").read_text()
    table = doc.split("## URL parameters", 1)[1].split("\n\n", 2)[1]
    names = [n for row in table.splitlines()[2:]
             for n in re.findall(r"`([a-z_]+)`", row.split("|")[1])]
    assert len(names) >= 15, names
    sample = {"tls": "on", "cert": tls_files["server"], "key": tls_files["server"],
              "ca": tls_files["ca"], "name": "in1", "max_window": "100",
              "max_event_bytes": "1MiB", "max_batch_bytes": "8MiB", "max_held_bytes": "512MiB",
              "timeout": "5s",
              "idle_timeout": "60s", "handshake_timeout": "2s", "max_connections": "10",
              "ack_interval": "1s", "app_field": "fields.app", "env_field": "fields.env",
              "default_app": "a", "default_env": "e", "topic_prefix": "t"}
    for scheme in ("lumberjack", "courier"):
        for name in names:
            params = {"cert": tls_files["server"], name: sample[name]}
            q = "&".join(f"{k}={v}" for k, v in params.items())
            spec = parse_input(f"{scheme}://127.0.0.1:5044?{q}")
            assert spec.port == 5044, (scheme, name)


# ------------------------------------------------------------------ real relay

async def _collect(sub, n, timeout=15):
    got = []
    with trio.fail_after(timeout):
        while len(got) < n:
            m = await zmq_trio.recv_multipart(sub)
            if m[0] != b"heartbeat":
                got.append(m)
    return got


async def _run_output(out, src, n_records):
    async with trio.open_nursery() as nursery:
        nursery.start_soon(out.run)
        with trio.fail_after(20):
            while not src.all_acked:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("tls", [False, True])
async def test_relay_writers_into_relay_inputs(tmp_path, tls_files, tls):
    lport, cport = free_port(), free_port()
    q = f"cert={tls_files['server']}" if tls else "tls=off"
    inputs = [f"lumberjack://127.0.0.1:{lport}?{q}&name=lj",
              f"courier://127.0.0.1:{cport}?{q}&name=cr"]
    async with running_relay(tmp_path, inputs=inputs, device_id=3) as (relay, cl):
        sub = cl.sub()
        await sync_sub(sub)
        n = 250
        src = MemorySource()
        for i in range(n):
            src.append(record(i, comp=i % 2))
        tlsset = TLSSettings(enabled=tls, ca=tls_files["ca"], server_name="localhost")
        out = LumberjackOutput(src, LumberjackConfig(hosts=(("127.0.0.1", lport),), window=40,
                                                     tls=tlsset, relay_host="edge-1"))
        await _run_output(out, src, n)
        got = await _collect(sub, n)
        src2 = MemorySource()
        for i in range(n):
            src2.append(record(i))
        curl = f"courier://127.0.0.1:{cport}?payload=30&hostname=edge-1&" + \
            (f"ca={tls_files['ca']}&server_name=localhost" if tls else "tls=off")
        await _run_output(CourierOutput(courier_url(curl), src2), src2, n)
        got += await _collect(sub, n)
        assert relay.spool.stats()["appends"] >= 2 * n
        st = {i.name: i.stats() for i in relay.inputs}
    assert st["lj"]["events"] == n and st["cr"]["events"] == n, st
    seqs = []
    for k, (a, t, b, m) in enumerate(got):
        _tag, comp, _v, dev, created, seq = unmeta(m)
        seqs.append(seq)
        i = k % n
        doc = json.loads(b)
        origin = doc.pop("logjam_origin")
        assert (a, t, comp, dev, created) == (b"my-app-production", b"logs.my-app.production",
                                              0, 3, 1_700_000_000_000 + i)
        assert origin == {"device": 7, "sequence": i + 1, "created_ms": 1_700_000_000_000 + i,
                          "host": "edge-1", "input": "lj" if k < n else "cr"}
        assert doc == json.loads(body(i))
    assert seqs == sorted(seqs) and len(set(seqs)) == 2 * n


async def test_beats_v2_client_and_metrics(tmp_path):
    lport = free_port()
    async with running_relay(tmp_path, inputs=[f"lumberjack://127.0.0.1:{lport}?tls=off"
                                               "&app_field=fields.app&name=beats"]) as (relay, cl):
        sub = cl.sub()
        await sync_sub(sub)
        docs = [json.dumps({"message": f"line {i}", "fields": {"app": "shop"}}).encode()
                for i in range(20)]
        s = await trio.open_tcp_stream("127.0.0.1", lport)
        await s.send_all(ljs.encode_window_v2(docs[:10]) + ljs.encode_window_v2(docs[10:], 0))
        acks = b""
        with trio.fail_after(10):
            while len(acks) < 12:
                acks += await s.receive_some(100)
        assert acks == b"2A\x00\x00\x00\x0a" * 2
        await s.aclose()
        got = await _collect(sub, 20)
        assert [m[:2] for m in got] == [[b"shop-unknown", b"logs.shop.unknown"]] * 20
        assert [json.loads(m[2])["message"] for m in got] == [f"line {i}" for i in range(20)]
        import urllib.request

        def scrape():
            url = f"http://127.0.0.1:{cl.settings.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.read().decode()
        text = await trio.to_thread.run_sync(scrape)
        assert 'logjam_relay_input_events_total{device="0",input="beats"} 20.0' in text


async def test_third_party_client_timbersnake(tmp_path):
    """timbersnake (PyPI), an asyncio Lumberjack v1/v2 client: it always announces a window
    of 3 and, when compressing, puts the W frame inside the C frame (jls-lumberjack, the
    Logstash library, accepts that, and so does the relay)."""
    import asyncio

    from timbersnake.client import Client

    lport = free_port()
    async with running_relay(tmp_path, inputs=[f"lumberjack://127.0.0.1:{lport}?tls=off"
                                               "&name=ts"]) as (relay, cl):
        sub = cl.sub()
        await sync_sub(sub)
        sent = []
        for level in (0, 6, -1):
            events = [{"message": f"ts {level} {i}", "app": "tsapp", "env": "dev"}
                      for i in range(3)]
            sent += events
            await trio.to_thread.run_sync(
                asyncio.run, Client("127.0.0.1", lport, compression_level=level).send(events))
        got = await _collect(sub, len(sent))
    assert relay.inputs[0].stats()["acks"] == 3
    assert [m[:2] for m in got] == [[b"tsapp-dev", b"logs.tsapp.dev"]] * len(sent)
    for m, ev in zip(got, sent, strict=True):
        doc = json.loads(m[2])
        assert doc.pop("logjam_origin")["input"] == "ts"
        assert doc == ev


async def test_input_with_client_ca_requires_a_client_certificate(tmp_path, tls_files):
    lport = free_port()
    url = f"lumberjack://127.0.0.1:{lport}?cert={tls_files['server']}&ca={tls_files['ca']}&name=m"
    async with running_relay(tmp_path, inputs=[url]) as (relay, cl):
        frames = lj.encode_data_frames([{"line": "{}", "app": "a"}])
        import ssl as _ssl

        async def attempt(cert):
            ctx = _ssl.create_default_context(cafile=tls_files["ca"])
            if cert:
                ctx.load_cert_chain(cert)
            s = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", lport), ctx,
                               server_hostname="localhost")
            try:
                await s.send_all(lj.encode_window(frames, 1))
                with trio.fail_after(10):
                    return await s.receive_some(6)
            except (trio.BrokenResourceError, _ssl.SSLError):
                return None
            finally:
                await trio.aclose_forcefully(s)

        assert await attempt(tls_files["client"]) == b"1A\x00\x00\x00\x01"
        assert await attempt(None) in (None, b"")
        assert relay.inputs[0].stats()["acks"] == 1
        assert relay.inputs[0].errors["tls_handshake"] >= 1


async def test_full_spool_holds_the_ack_and_sends_keepalives(tmp_path):
    """A full spool (policy block; its only output's receiver is down) holds the window's
    ACK; the input sends 2A 0 keep-alives meanwhile, and the ACK follows once the output's
    receiver is up and the spool drains."""
    from peers.lumberjack_reader import LumberjackReader

    lport, out_port = free_port(), free_port()
    async with running_relay(
            tmp_path, inputs=[f"lumberjack://127.0.0.1:{lport}?tls=off&ack_interval=0.2s"],
            outputs=[f"lumberjack://127.0.0.1:{out_port}?tls=off&backoff_min=0.05"
                     "&backoff_max=0.2&window=50"],
            spool_max_bytes="64KiB", spool_segment_bytes="16KiB") as (relay, cl):
        docs = [json.dumps({"message": "x" * 1000, "i": i}).encode() for i in range(10)]
        s = await trio.open_tcp_stream("127.0.0.1", lport)
        got = b""
        acks = keepalives = 0
        with trio.fail_after(30):
            while keepalives < 2:               # windows until one waits for the spool
                await s.send_all(ljs.encode_window_v2(docs, level=0))
                while len(got) < 6:
                    got += await s.receive_some(100)
                while len(got) >= 6:
                    frame, got = got[:6], got[6:]
                    if frame == b"2A\x00\x00\x00\x00":
                        keepalives += 1
                    else:
                        assert frame == b"2A\x00\x00\x00\x0a"
                        acks += 1
                if keepalives:
                    while keepalives < 2:
                        got += await s.receive_some(100)
                        while len(got) >= 6 and got[:6] == b"2A\x00\x00\x00\x00":
                            keepalives += 1
                            got = got[6:]
            assert relay.spool.would_block()
            reader = LumberjackReader(port=out_port, keep_windows=False)
            async with trio.open_nursery() as nursery:
                await nursery.start(reader.serve)
                while b"2A\x00\x00\x00\x0a" not in got:     # the held window's ACK
                    got += await s.receive_some(100)
                nursery.cancel_scope.cancel()
        await s.aclose()
    assert acks >= 1 and keepalives >= 2 and relay.spool_blocked_seconds > 0
