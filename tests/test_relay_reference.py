"""Every row of the reference ROUTER table and every PULL case, over real sockets.

shared/specs/reference/logjam-device.md is what the C logjam-device does byte
for byte; the relay must be indistinguishable, except where documented (an
invalid topic in a request is answered 400 instead of 202-then-drop).
"""

import zlib

import pytest
import trio

from relay_harness import (
    meta,
    next_data,
    nothing_within,
    recv,
    running_relay,
    send,
    sync_sub,
    unmeta,
)

BODY = b'{"action":"Probe#index","code":200,"total_time":12.5,"severity":1,"m":"xxxxxxxxxx"}'
META_OK = meta()
MARK = [b"mark-test", b"logs.mark", b"{}", META_OK]


async def published_after(pub_sub, push, frames_sent):
    """Send frames_sent via PUSH and then a marker; return what was published before the marker."""
    await send(push, MARK)
    got = []
    while True:
        m = await next_data(pub_sub)
        if m[0] == b"mark-test":
            return got
        got.append(m)


ROUTER_TABLE = [
    # (sent DEALER frames, expected reply or None, published?)
    ([b"", b"probe-test", b"logs.probe", BODY, META_OK], [b"probe-test", b"202 Accepted"], True),
    ([b"probe-test", b"logs.probe", BODY, META_OK], None, True),
    ([b"", b"ping", b"probe-test", b"{}", META_OK], [b"ping", b"200 OK", b"vm"], False),
    ([b"", b"ping", b"probe-test", b"{}", meta(tag=0x1234)], [b"ping", b"400 Bad Request"], False),
    ([b"", b"ping", b"probe-test"], [b"ping", b"400 Bad Request"], False),
    ([b"", b"ping"], [b"ping", b"400 Bad Request"], False),
    ([b"", b"probe-test", b"logs.probe"], [b"probe-test", b"400 Bad Request"], False),
    ([b"", b"probe-test", b"logs.probe", BODY], [b"probe-test", b"400 Bad Request"], False),
    ([b"", b"probe-test", b"logs.probe", BODY, META_OK[:23]],
     [b"probe-test", b"400 Bad Request"], False),
    ([b"", b"probe-test", b"logs.probe", BODY, meta(ver=2)],
     [b"probe-test", b"400 Bad Request"], False),
    ([b"", b"probetest", b"logs.probe", BODY, META_OK], [b"probetest", b"400 Bad Request"], False),
    # logjam-device: 202 Accepted, then dropped. The relay answers 400 (documented).
    ([b"", b"probe-test", b"foo.bar", BODY, META_OK], [b"probe-test", b"400 Bad Request"], False),
    ([b"", b"probe-test", b"logs.probe", BODY, META_OK, b"extra"],
     [b"probe-test", b"400 Bad Request"], False),
    ([b""], [b"unknown-unknown", b"400 Bad Request"], False),
    ([b"probe-test", b"foo.bar", BODY, META_OK], None, False),
]


@pytest.mark.parametrize("sent,reply,published", ROUTER_TABLE,
                         ids=[f"row{i}" for i in range(len(ROUTER_TABLE))])
async def test_router_table(tmp_path, sent, reply, published):
    async with running_relay(tmp_path, device_id=7) as (relay, cl):
        sub, dealer, push = cl.sub(), cl.dealer(), cl.push()
        await sync_sub(sub)
        await send(dealer, sent)
        if reply is None:
            assert await nothing_within(dealer, 0.3)
        else:
            assert await recv(dealer) == reply
        got = await published_after(sub, push, sent)
        if published:
            assert len(got) == 1
            app, topic, body, m = got[0]
            assert (app, topic, body) == (b"probe-test", b"logs.probe", BODY)
            tag, comp, ver, dev, created, _seq = unmeta(m)
            assert (tag, comp, ver, dev, created) == (0xCABD, 0, 1, 7, 1700000000123)
        else:
            assert got == []


async def test_pull_reference_vector(tmp_path):
    """[probe-test, logs.probe, body81, meta(0,1,0,created,1)] with -d 7: only device and seq change."""
    async with running_relay(tmp_path, device_id=7) as (relay, cl):
        sub, push = cl.sub(), cl.push()
        hb = await sync_sub(sub)
        hb_seq = unmeta(hb[3])[5]
        body81 = b"x" * 81
        await send(push, [b"probe-test", b"logs.probe", body81, meta(dev=99, seq=42)])
        m = await next_data(sub)
        assert m[:3] == [b"probe-test", b"logs.probe", body81]
        tag, comp, ver, dev, created, seq = unmeta(m[3])
        assert (tag, comp, ver, dev, created) == (0xCABD, 0, 1, 7, 1700000000123)
        assert seq > hb_seq  # client seq 42 and device 99 are replaced
        assert m[3][:16] == bytes.fromhex("cabd0001000000070000018bcfe5687b")


@pytest.mark.parametrize("frames,check", [
    ([b"probe-test", b"logs.probe", b"{}", meta(created=0)], "device_time"),
    ([b"probe-test", b"logs.probe", b"garbage", meta(comp=3)], "comp3_untouched"),
    ([b"probe-test", b"logs.probe", b"{}", meta(tag=0xBDCA)], "swapped_tag"),
    ([b"probe-test", b"logs.probe", b"{}"], "legacy"),
    ([b"probe-test", b"logsfoo", b"{}", META_OK], "prefix_topic"),
])
async def test_pull_accepted_cases(tmp_path, frames, check):
    async with running_relay(tmp_path) as (relay, cl):
        sub, push = cl.sub(), cl.push()
        await sync_sub(sub)
        t0 = trio.current_time()
        import time
        wall0 = int(time.time() * 1000)
        await send(push, frames)
        m = await next_data(sub)
        assert m[:3] == frames[:3]
        tag, comp, ver, dev, created, seq = unmeta(m[3])
        assert tag == 0xCABD and ver == 1 and dev == 0
        if check in ("device_time", "legacy"):
            assert abs(created - wall0) < 5000
            assert comp == 0
        elif check == "comp3_untouched":
            assert comp == 3 and m[2] == b"garbage"
        else:
            assert created == 1700000000123
        assert trio.current_time() - t0 < 5


@pytest.mark.parametrize("frames,reason", [
    ([b"probe-test", b"logs.probe"], "frame_count"),
    ([b"probe-test", b"logs.probe", b"{}", META_OK, b"x"], "frame_count"),
    ([b"probe-test", b"logs.probe", b"{}", META_OK[:23]], "meta_size"),
    ([b"probe-test", b"logs.probe", b"{}", meta(tag=0x1234)], "meta_tag"),
    ([b"probe-test", b"logs.probe", b"{}", meta(ver=2)], "meta_version"),
    ([b"probetest", b"logs.probe", b"{}", META_OK], "stream_name"),
    ([b"probe-test", b"foo.bar", b"{}", META_OK], "topic"),
])
async def test_pull_dropped_and_counted(tmp_path, frames, reason):
    async with running_relay(tmp_path) as (relay, cl):
        sub, push = cl.sub(), cl.push()
        await sync_sub(sub)
        got = await published_after(sub, push, await send(push, frames))
        assert got == []
        c = relay.pipeline.counters
        assert c.invalid == 1 and c.invalid_by_reason[reason] == 1


async def test_allow_invalid_meta(tmp_path):
    async with running_relay(tmp_path, allow_invalid_meta=True) as (relay, cl):
        sub, push = cl.sub(), cl.push()
        await sync_sub(sub)
        await send(push, [b"probe-test", b"logs.probe", b"{}", meta(tag=0x1234)])
        m = await next_data(sub)
        assert m[:3] == [b"probe-test", b"logs.probe", b"{}"]
        assert unmeta(m[3])[1] == 0


async def test_heartbeat_frame_and_stats(tmp_path):
    async with running_relay(tmp_path, device_id=7) as (relay, cl):
        sub = cl.sub()
        stats = cl.sub(port=cl.settings.stats_port)
        hb = await sync_sub(sub)
        assert hb[0] == b"heartbeat"
        assert hb[1] == f"tcp://vm:{cl.settings.pub_port}".encode()
        assert hb[2] == b"{}"
        tag, comp, ver, dev, created, seq = unmeta(hb[3])
        assert (tag, comp, ver, dev) == (0xCABD, 0, 1, 7)
        st = await recv(stats)
        assert st[0] == b"stats" and st[1] == b"7" and int(st[2]) >= 0 and len(st) == 3


async def test_zlib_passthrough_and_recompress(tmp_path):
    async with running_relay(tmp_path, compress="zlib") as (relay, cl):
        sub, push = cl.sub(), cl.push()
        await sync_sub(sub)
        z = zlib.compress(BODY)
        await send(push, [b"probe-test", b"logs.probe", z, meta(comp=1)])
        await send(push, [b"probe-test", b"logs.probe", BODY, META_OK])
        m1 = await next_data(sub)
        m2 = await next_data(sub)
        assert m1[2] == z and unmeta(m1[3])[1] == 1
        assert unmeta(m2[3])[1] == 1 and zlib.decompress(m2[2]) == BODY
        assert unmeta(m2[3])[5] == unmeta(m1[3])[5] + 1


@pytest.mark.parametrize("method,comp", [("lz4", 3), ("snappy", 2), ("zlib", 1)])
async def test_recompression_every_method_keeps_order(tmp_path, method, comp):
    from logjam_relay.protocols import logjam as L
    async with running_relay(tmp_path, compress=method, compressors=3,
                             batch_size=512) as (relay, cl):
        sub, push = cl.sub(), cl.push()
        await sync_sub(sub)
        n = 2000
        for i in range(n):
            body = b'{"i":%d,"pad":"%s"}' % (i, b"x" * 200)
            await send(push, [b"probe-test", b"logs.probe", body, meta(comp=0)])
        got = []
        while len(got) < n:
            got.append(await next_data(sub))
    seqs = [unmeta(m[3])[5] for m in got]
    assert seqs == sorted(seqs)
    bodies = [L.decompress(m[2], unmeta(m[3])[1]) for m in got]
    assert [int(b[5:b.index(b",")]) for b in bodies] == list(range(n))
    assert {unmeta(m[3])[1] for m in got} == {comp}
    assert relay.pipeline.counters.compressed == n
