"""The sans-IO logjam core against the vectors of shared/specs/reference/logjam-device.md."""

import struct
import zlib

import lz4.block
import pytest
import snappy
from hypothesis import given
from hypothesis import strategies as st

from logjam_relay.protocols import logjam as L

FQDN = b"vm"


def meta(tag=0xCABD, comp=0, ver=1, dev=0, created=1700000000123, seq=1):
    return struct.pack(">HBBIQQ", tag, comp, ver, dev, created, seq)


META_OK = meta()
BODY = b'{"action":"Probe#index","total_time":12.5,"code":200,"severity":1,"x":"........"}'


# ---------------------------------------------------------------- meta frame

def test_meta_vector_from_reference():
    # device 7, created kept, seq 4
    out = L.encode_meta(0, 7, 1700000000123, 4)
    assert out == bytes.fromhex("cabd0001000000070000018bcfe5687b0000000000000004")
    assert L.decode_meta(out) == L.Meta(0, 1, 7, 1700000000123, 4)


def test_heartbeat_meta_vector():
    frames = L.heartbeat_frames("vm", 9606, 7, 0x1A1FDD1485B, 17)
    assert frames == [b"heartbeat", b"tcp://vm:9606", b"{}",
                      bytes.fromhex("cabd000100000007000001a1fdd1485b0000000000000011")]


def test_stats_frames_vector():
    assert L.stats_frames(7, 18) == [b"stats", b"7", b"18"]
    assert L.stats_frames(0, 0) == [b"stats", b"0", b"0"]


def test_byte_swapped_tag_accepted():
    assert L.meta_problem(meta(tag=0xBDCA)) is None
    assert L.decode_meta(meta(tag=0xBDCA, seq=5)).sequence == 5


@pytest.mark.parametrize("frame,reason", [
    (META_OK[:23], "meta_size"),
    (META_OK + b"x", "meta_size"),
    (b"", "meta_size"),
    (meta(tag=0x1234), "meta_tag"),
    (meta(ver=2), "meta_version"),
    (meta(ver=0), "meta_version"),
])
def test_broken_meta(frame, reason):
    assert L.meta_problem(frame) == reason
    with pytest.raises(L.LogjamError) as ei:
        L.decode_meta(frame)
    assert ei.value.reason == reason


def test_compression_byte_not_checked():
    assert L.meta_problem(meta(comp=77)) is None


# ------------------------------------------------------- stream name and topic

@pytest.mark.parametrize("name,ok", [
    (b"probe-test", True), (b"probetest", False), (b"a-b-c", True), (b"-", True),
    (b"probe-te\x7fst", True),         # 127 is inside 32..127
    (b"probe-te\x1fst", False), (b"probe-t\xc3\xa4st", False), (b"", False),
    (b"probe test-x", True),
])
def test_stream_name(name, ok):
    assert L.valid_stream_name(name) is ok


@pytest.mark.parametrize("topic,ok", [
    (b"logs", True), (b"logs.probe", True), (b"logsfoo", True),    # prefix-only, as measured
    (b"javascript.x", True), (b"events", True), (b"frontend.page", True),
    (b"frontend.ajax", True), (b"mobile", True), (b"frontend.other", False),
    (b"foo.bar", False), (b"", False), (b"Logs", False),
])
def test_topic(topic, ok):
    assert L.valid_topic(topic) is ok


def test_validator_caches_and_bounds():
    v = L.Validator(max_entries=2)
    assert v.data_problem(b"a-b", b"logs") is None
    assert v.data_problem(b"ab", b"logs") == "stream_name"
    assert v.data_problem(b"a-b", b"x") == "topic"
    for i in range(5):
        assert v.data_problem(b"s-%d" % i, b"logs.%d" % i) is None
    assert len(v.good_streams) <= 2 and len(v.good_topics) <= 2


def test_split_app_env():
    assert L.split_app_env(b"my-app-production") == ("my-app", "production")
    assert L.split_app_env("probe-test") == ("probe", "test")
    assert L.split_app_env(b"noenv") == ("noenv", "")


# ------------------------------------------------------------ ROUTER table

def router(frames):
    return L.classify_router(frames, FQDN)


def test_router_request_accepted():
    ev = router([b"", b"probe-test", b"logs.probe", BODY, META_OK])
    assert isinstance(ev, L.Data)
    assert ev.reply == [b"probe-test", b"202 Accepted"]
    assert (ev.app_env, ev.topic, ev.body) == (b"probe-test", b"logs.probe", BODY)
    assert ev.meta.created_ms == 1700000000123


def test_router_async_no_reply_published():
    ev = router([b"probe-test", b"logs.probe", BODY, META_OK])
    assert isinstance(ev, L.Data) and ev.reply is None


def test_router_ping_ok():
    ev = router([b"", b"ping", b"probe-test", b"{}", META_OK])
    assert ev == L.Ping(True, b"probe-test", [b"ping", b"200 OK", b"vm"])


@pytest.mark.parametrize("frames", [
    [b"", b"ping", b"probe-test", b"{}", meta(tag=0x1234)],
    [b"", b"ping", b"probe-test"],
    [b"", b"ping"],
    [b"", b"ping", b"probe-test", b"{}", META_OK, b"extra"],
])
def test_router_ping_bad(frames):
    ev = router(frames)
    assert isinstance(ev, L.Ping) and not ev.valid
    assert ev.reply == [b"ping", b"400 Bad Request"]


@pytest.mark.parametrize("frames,reason", [
    ([b"", b"probe-test", b"logs.probe"], "frame_count"),
    ([b"", b"probe-test", b"logs.probe", BODY], "frame_count"),
    ([b"", b"probe-test", b"logs.probe", BODY, META_OK[:23]], "meta_size"),
    ([b"", b"probe-test", b"logs.probe", BODY, meta(ver=2)], "meta_version"),
    ([b"", b"probetest", b"logs.probe", BODY, META_OK], "stream_name"),
    ([b"", b"probe-test", b"logs.probe", BODY, META_OK, b"extra"], "frame_count"),
    # logjam-device answers 202 and drops; we answer 400 (documented difference)
    ([b"", b"probe-test", b"foo.bar", BODY, META_OK], "topic"),
])
def test_router_bad_request(frames, reason):
    ev = router(frames)
    assert isinstance(ev, L.Invalid) and ev.reason == reason
    assert ev.reply == [frames[1], b"400 Bad Request"]


def test_router_only_empty_frame():
    ev = router([b""])
    assert isinstance(ev, L.Invalid)
    assert ev.reply == [b"unknown-unknown", b"400 Bad Request"]


def test_router_async_invalid_topic_no_reply():
    ev = router([b"probe-test", b"foo.bar", BODY, META_OK])
    assert isinstance(ev, L.Invalid) and ev.reply is None and ev.reason == "topic"


def test_router_no_frames():
    assert isinstance(router([]), L.Invalid)


def test_router_allow_invalid_meta():
    ev = L.classify_router([b"", b"probe-test", b"logs.probe", BODY, meta(tag=0x1234)], FQDN,
                           allow_invalid_meta=True)
    assert isinstance(ev, L.Data) and ev.meta is None
    assert ev.reply == [b"probe-test", b"202 Accepted"]


# --------------------------------------------------------------- PULL cases

def test_pull_ok_and_legacy():
    ev = L.classify_pull([b"probe-test", b"logs.probe", BODY, META_OK])
    assert isinstance(ev, L.Data) and ev.meta.sequence == 1
    ev = L.classify_pull([b"probe-test", b"logs.probe", BODY])
    assert isinstance(ev, L.Data) and ev.meta is None


@pytest.mark.parametrize("frames,reason", [
    ([b"probe-test", b"logs.probe"], "frame_count"),
    ([b"probe-test", b"logs.probe", BODY, META_OK, b"x"], "frame_count"),
    ([b"probe-test", b"logs.probe", BODY, META_OK[:23]], "meta_size"),
    ([b"probe-test", b"logs.probe", BODY, meta(tag=0x1234)], "meta_tag"),
    ([b"probe-test", b"logs.probe", BODY, meta(ver=2)], "meta_version"),
    ([b"probetest", b"logs.probe", BODY, META_OK], "stream_name"),
    ([b"probe-test", b"foo.bar", BODY, META_OK], "topic"),
    ([], "frame_count"),
])
def test_pull_invalid(frames, reason):
    ev = L.classify_pull(frames)
    assert isinstance(ev, L.Invalid) and ev.reason == reason


def test_pull_prefix_only_topic_and_swapped_tag():
    assert isinstance(L.classify_pull([b"a-b", b"logsfoo", BODY, meta(tag=0xBDCA)]), L.Data)


# ------------------------------------------------------------- body codecs

@pytest.mark.parametrize("body", [b"", b"{}", BODY, BODY * 100, bytes(range(256)) * 10])
def test_codecs_round_trip(body):
    for m in (0, 1, 2, 3):
        assert L.decompress(L.compress(body, m), m) == body


def test_codec_formats_are_logjams():
    b = BODY * 3
    assert L.compress(b, 1) == zlib.compress(b) and L.compress(b, 1)[:2] == b"\x78\x9c"
    assert L.compress(b, 2) == snappy.compress(b)
    lz = L.compress(b, 3)
    assert lz[:4] == struct.pack(">I", len(b))
    assert lz4.block.decompress(lz[4:], uncompressed_size=len(b)) == b


@pytest.mark.parametrize("method,body", [
    (1, b"not zlib"), (1, zlib.compress(BODY)[:-3]), (2, b"\xff\xff\xff\xff\xff\xff"),
    (2, b""), (3, b"\x00\x00"), (3, b"\x00\x00\x00\x10garbage"), (3, b"\xff\xff\xff\xff" + b"x"),
    (9, b"x"),
])
def test_decompress_garbage_is_a_clean_error(method, body):
    with pytest.raises(L.LogjamError):
        L.decompress(body, method)


def test_decompress_bomb_refused():
    big = zlib.compress(b"\0" * (2 * 1024 * 1024))
    with pytest.raises(L.LogjamError):
        L.decompress(big, 1, max_size=1024 * 1024)


# -------------------------------------------------------------- fuzzing

frame = st.one_of(st.binary(max_size=40), st.sampled_from(
    [b"", b"ping", b"probe-test", b"logs.x", META_OK, meta(tag=0xBDCA), META_OK[:23]]))


@given(st.lists(frame, max_size=8))
def test_classify_never_raises(frames):
    for ev in (router(frames), L.classify_pull(frames)):
        assert isinstance(ev, (L.Data, L.Ping, L.Invalid))
    ev = router(frames)
    if frames and frames[0] == b"":
        assert ev.reply is not None and len(ev.reply) in (2, 3)
    else:
        assert ev.reply is None


@given(st.binary(max_size=64), st.integers(0, 4))
def test_decompress_never_raises_anything_else(body, method):
    try:
        L.decompress(body, method)
    except L.LogjamError:
        pass
