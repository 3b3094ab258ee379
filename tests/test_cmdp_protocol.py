"""Sans-IO CMDP: golden frames from the reference capture, byte-identity with
ConstellationDAQ 1.0.2's encoder, and the malformed-variant matrix decoded by both
our decoder and ConstellationDAQ's own (they must agree)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import msgpack
import pytest
from constellation.core.message.cmdp1 import (
    CMDP1LogMessage,
    CMDP1Message,
    CMDP1Notification,
    CMDP1StatMessage,
)
from constellation.core.protocol.cmdp1 import LogLevel as CLogLevel
from constellation.core.protocol.cmdp1 import Metric, log_level_from_levelno
from hypothesis import given
from hypothesis import strategies as st

from logjam_relay.protocols import cmdp
from logjam_relay.protocols.cmdp import (
    CMDPError,
    LogLevel,
    LogMessage,
    MetricType,
    Notification,
    Publisher,
    StatMessage,
)

logging.addLevelName(logging.ERROR, "ERROR")  # undo constellation's global rename
logging.setLoggerClass(logging.Logger)

SENDER = "PyRef.emitter1"
T_NS = 1735787045 * 10**9 + 123456000  # 2025-01-02T03:04:05.123456Z
T_DT = datetime.fromtimestamp(1735787045.123456, UTC)
HDR_HEX = "a5434d445001ae50795265662e656d697474657231d7ff1d6f28006776022580"


def P(o) -> bytes:
    return msgpack.packb(o, use_bin_type=True)


HDR = bytes.fromhex(HDR_HEX)
STAT_PAYLOAD = P(12.5) + P(0) + P("%")


def upstream_decode(frames):
    """ConstellationDAQ 1.0.2's decoding path, as MonitoringListener._receive runs it."""
    msg = CMDP1Message.disassemble(frames)
    if msg.is_log_message():
        m = CMDP1LogMessage.from_cmdp_message(msg)
        m.to_log_record()
        return m
    if msg.is_stat_message():
        return CMDP1StatMessage.from_cmdp_message(msg)
    if msg.is_notification():
        return CMDP1Notification.from_cmdp_message(msg)
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- golden frames

GOLDEN = [  # (message, topic hex, header hex, payload hex), from reference/cmdp.md
    (StatMessage(SENDER, T_NS, "CPULOAD", 12.5, "%"),
     "535441542f4350554c4f4144", HDR_HEX, "cb402900000000000000a125"),
    (StatMessage(SENDER, T_NS, "EVENTS_TOTAL", 42, ""),
     "535441542f4556454e54535f544f54414c", HDR_HEX, "2a00a0"),
    (StatMessage(SENDER, T_NS, "TEMPERATURE", -3, "degC"),
     "535441542f54454d5045524154555245", HDR_HEX, "fd00a464656743"),
    (StatMessage(SENDER, T_NS, "STATE_NAME", "RUN", ""),
     "535441542f53544154455f4e414d45", HDR_HEX, "a352554e00a0"),
    (LogMessage(SENDER, T_NS, LogLevel.INFO, "COMPONENT", "fixed-time hello"),
     "4c4f472f494e464f2f434f4d504f4e454e54", HDR_HEX, b"fixed-time hello".hex()),
    (LogMessage(SENDER, T_NS, LogLevel.WARNING, "", "no-topic warning", {"lineno": 7}),
     "4c4f472f5741524e494e47", HDR_HEX[:-2] + "81a66c696e656e6f07", b"no-topic warning".hex()),
    (Notification(SENDER, T_NS, "LOG", {"COMPONENT": "reference emitter component"}),
     "4c4f473f", HDR_HEX,
     "81a9434f4d504f4e454e54bb7265666572656e636520656d697474657220636f6d706f6e656e74"),
]


@pytest.mark.parametrize(("msg", "topic", "header", "payload"), GOLDEN,
                         ids=[g[0].topic for g in GOLDEN])
def test_golden_frames(msg, topic, header, payload):
    frames = [bytes.fromhex(topic), bytes.fromhex(header), bytes.fromhex(payload)]
    assert cmdp.encode(msg) == frames
    assert cmdp.decode(frames) == msg
    upstream_decode(frames)


def test_stat_notification_golden_payload():
    topics = {"CPULOAD": "CPU load of the host", "EVENTS_TOTAL": "number of events processed",
              "TEMPERATURE": "sensor temperature", "STATE_NAME": "string-valued metric"}
    frames = cmdp.encode(Notification(SENDER, T_NS, "STAT", topics))
    assert frames[0] == b"STAT?"
    assert frames[2][:12].hex() == "84a74350554c4f4144b44350"
    assert upstream_decode(frames).topics == topics


@pytest.mark.parametrize("value", [12.5, 42, -3, "RUN", True, None, 2**40, -(2**40), 1e-300])
def test_stat_bytes_identical_to_constellation_encoder(value):
    theirs = CMDP1StatMessage(SENDER, Metric("CpuLoad", "%", "d"), value, T_DT).assemble().frames
    ours = cmdp.encode(StatMessage(SENDER, T_NS, "CPULOAD", value, "%"))
    assert ours == theirs


@pytest.mark.parametrize("levelno", [5, 10, 20, 30, 35, 40, 50])
def test_log_bytes_identical_to_constellation_encoder(levelno):
    level = cmdp.level_from_levelno(levelno)
    assert level.name == log_level_from_levelno(levelno).name
    assert int(level) == int(CLogLevel[level.name])
    theirs = CMDP1LogMessage(SENDER, CLogLevel[level.name], "COMP", "héllo ✓", T_DT,
                             {"lineno": 1}).assemble().frames
    ours = cmdp.encode(LogMessage(SENDER, T_NS, level, "COMP", "héllo ✓", {"lineno": 1}))
    assert ours == theirs


def test_timestamp_forms():
    # timestamp32 when nsec == 0 and sec < 2**32, timestamp96 when sec >= 2**34
    assert cmdp.encode_header("a", 1735787045 * 10**9)[8:].hex() == "d6ff6776022580"
    h = cmdp.encode_header("a", 19880000000 * 10**9 + 500000000)
    assert h[8:11].hex() == "c70cff"
    assert cmdp.decode_header(h)[1] == 19880000000 * 10**9 + 500000000
    # full nanoseconds survive (the Python upstream only has microseconds)
    assert cmdp.decode_header(cmdp.encode_header("a", T_NS + 789))[1] == T_NS + 789


def test_metric_type_on_the_wire_is_opt_in():
    assert cmdp.encode_stat_payload(1, "", MetricType.RATE) == P(1) + P(0) + P("")
    p = cmdp.encode_stat_payload(1, "", MetricType.RATE, wire_metric_type=True)
    assert p == P(1) + P(4) + P("")
    frames = [b"STAT/X", HDR, p]
    assert cmdp.decode(frames).metric_type is MetricType.RATE
    assert upstream_decode(frames).value == 1  # ConstellationDAQ ignores the middle object


@given(name=st.from_regex(r"[A-Z0-9_]{1,20}", fullmatch=True),
       value=st.one_of(st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                       st.text(max_size=50), st.booleans(), st.none()),
       unit=st.text(max_size=10), t=st.integers(0, 2**62),
       mtype=st.sampled_from([None, *MetricType]))
def test_stat_roundtrip(name, value, unit, t, mtype):
    m = StatMessage("LogjamRelay.x", t, name, value, unit, mtype)
    frames = cmdp.encode(m, wire_metric_type=True)
    assert cmdp.decode(frames) == m
    u = upstream_decode(frames)
    assert u.value == value and u.metric.unit == unit and u.metric.name == name


@given(text=st.text(max_size=200), comp=st.from_regex(r"[A-Z0-9_]{0,12}", fullmatch=True),
       level=st.sampled_from(list(LogLevel)),
       tags=st.dictionaries(st.text(max_size=8), st.integers(0, 2**32), max_size=4))
def test_log_roundtrip(text, comp, level, tags):
    m = LogMessage("LogjamRelay.x", T_NS, level, comp, text, tags)
    frames = cmdp.encode(m)
    assert cmdp.decode(frames) == m
    u = upstream_decode(frames)
    assert (u.log_message, u.log_level.name, u.log_topic) == (text, level.name, comp)


def test_lone_surrogates_are_replaced_not_fatal():
    frames = cmdp.encode(LogMessage("s", T_NS, LogLevel.INFO, "", "bad \udc80 text"))
    assert cmdp.decode(frames).text == "bad ? text"


def test_we_decode_constellation_messages():
    m = CMDP1LogMessage.from_log_record(
        logging.makeLogRecord({"name": "comp", "levelno": 35, "msg": "status %d", "args": (1,)}),
        SENDER)
    d = cmdp.decode(m.assemble().frames)
    assert (d.level, d.component, d.text) == (LogLevel.STATUS, "COMP", "status 1")
    assert d.tags["funcName"] is None or isinstance(d.tags["funcName"], str)
    n = CMDP1Notification(SENDER, "STAT", {"A": "a"}).assemble().frames
    assert cmdp.decode(n).topics == {"A": "a"}


# --------------------------------------------------------------------------- variant matrix

TS32 = bytes.fromhex("d6ff67760225")
TS96 = bytes.fromhex("c70cff1dcd650000000004a0fe7280")
H = P("CMDP\x01") + P(SENDER)

ACCEPTED = {
    "timestamp32": [b"STAT/X", H + TS32 + b"\x80", STAT_PAYLOAD],
    "timestamp96": [b"STAT/X", H + TS96 + b"\x80", STAT_PAYLOAD],
    "flags_1": [b"STAT/X", HDR, P(1.0) + P(1) + P("")],
    "value_int": [b"STAT/X", HDR, P(7) + P(0) + P("")],
    "value_array": [b"STAT/X", HDR, P([1, 2]) + P(0) + P("")],
    "value_map": [b"STAT/X", HDR, P({"a": 1}) + P(0) + P("")],
    "value_float32": [b"STAT/X", HDR, b"\xca\x3f\xc0\x00\x00" + P(0) + P("")],
    "trailing_header": [b"STAT/X", HDR + b"\xc0", STAT_PAYLOAD],
    "trailing_payload": [b"STAT/X", HDR, STAT_PAYLOAD + b"\x01"],
    "empty_sender": [b"STAT/X", P("CMDP\x01") + P("") + TS32 + b"\x80", STAT_PAYLOAD],
    "tags": [b"LOG/INFO", H + TS32 + P({"k": [1, "v"]}), b"text"],
    "lowercase_metric": [b"STAT/lower", HDR, STAT_PAYLOAD],
    "lowercase_level": [b"LOG/info/X", HDR, b"text"],
    "notification": [b"STAT?", HDR, P({"A": "desc"})],
    "topic_utf8": ["STAT/É".encode(), HDR, STAT_PAYLOAD],
}

REJECTED = {  # name -> (frames, our reason)
    "protocol_bin": ([b"STAT/X", P(b"CMDP\x01") + P(SENDER) + TS32 + b"\x80", STAT_PAYLOAD],
                     "bad_protocol"),
    "protocol_v2": ([b"STAT/X", P("CMDP\x02") + P(SENDER) + TS32 + b"\x80", STAT_PAYLOAD],
                    "bad_version"),
    "protocol_other": ([b"STAT/X", P("CSCP\x01") + P(SENDER) + TS32 + b"\x80", STAT_PAYLOAD],
                       "bad_protocol"),
    "header_array": ([b"STAT/X", P(["CMDP\x01", SENDER, msgpack.Timestamp(1, 0), {}]),
                      STAT_PAYLOAD], "bad_protocol"),
    "timestamp_int": ([b"STAT/X", H + P(T_NS) + b"\x80", STAT_PAYLOAD], "bad_timestamp"),
    "timestamp_missing": ([b"STAT/X", H, STAT_PAYLOAD], "truncated"),
    "tags_nil": ([b"STAT/X", H + TS32 + b"\xc0", STAT_PAYLOAD], "bad_tags"),
    "tags_int_keys": ([b"STAT/X", H + TS32 + P({1: "a"}), STAT_PAYLOAD], "bad_map_key"),
    "stat_payload_array": ([b"STAT/X", HDR, P([12.5, 0, "%"])], "truncated"),
    "unit_missing": ([b"STAT/X", HDR, P(12.5) + P(0)], "truncated"),
    "unit_nil": ([b"STAT/X", HDR, P(12.5) + P(0) + b"\xc0"], "bad_unit"),
    "level_error": ([b"LOG/ERROR", HDR, b"text"], "bad_level"),
    "prefix_lowercase": ([b"stat/X", HDR, STAT_PAYLOAD], "bad_topic"),
    "prefix_other": ([b"FOO/X", HDR, STAT_PAYLOAD], "bad_topic"),
    "two_frames": ([b"STAT/X", HDR], "frame_count"),
    "four_frames": ([b"STAT/X", HDR, STAT_PAYLOAD, b""], "frame_count"),
    "sender_bin": ([b"STAT/X", P("CMDP\x01") + P(b"x") + TS32 + b"\x80", STAT_PAYLOAD],
                   "bad_sender"),
    "log_payload_msgpack_str": ([b"LOG/INFO", HDR, P("hello")], "bad_utf8"),
    "log_payload_not_utf8": ([b"LOG/INFO", HDR, b"\xff\xfe"], "bad_utf8"),
    "header_empty": ([b"STAT/X", b"", STAT_PAYLOAD], "truncated"),
    "header_garbage": ([b"STAT/X", b"\xc1", STAT_PAYLOAD], "bad_msgpack"),
    "sender_bad_utf8": ([b"STAT/X", P("CMDP\x01") + b"\xa2\xff\xfe" + TS32 + b"\x80",
                         STAT_PAYLOAD], "bad_utf8"),
    "topic_not_utf8": ([b"STAT/\xff", HDR, STAT_PAYLOAD], "bad_topic"),
    "notification_not_map": ([b"LOG?", HDR, P(["A"])], "bad_notification"),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_variants(name):
    frames = ACCEPTED[name]
    cmdp.decode(frames)
    upstream_decode(frames)


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_rejected_variants(name):
    frames, reason = REJECTED[name]
    with pytest.raises(CMDPError) as ei:
        cmdp.decode(frames)
    assert ei.value.reason == reason
    assert ei.value.message and reason in str(ei.value)
    # ConstellationDAQ rejects it too (sometimes with a non-MessageDecodingError: see docs)
    with pytest.raises(Exception):  # noqa: B017
        upstream_decode(frames)


@pytest.mark.parametrize("payload", [P(1) + P("0") + P(""), P(1) + P(300) + P(""),
                                     P(1) + P(-1) + P("")])
def test_stricter_than_python_upstream_on_flags(payload):
    # The Python decoder throws the middle object away; the C++ decoder needs a uint8.
    # We side with C++: anything but an int 0..255 is an error.
    with pytest.raises(CMDPError) as ei:
        cmdp.decode([b"STAT/X", HDR, payload])
    assert ei.value.reason == "bad_metric_type"


# --------------------------------------------------------------------------- publisher


def test_parse_subscription():
    assert cmdp.parse_subscription(b"\x01STAT/") == (True, b"STAT/")
    assert cmdp.parse_subscription(b"\x00LOG/") == (False, b"LOG/")
    assert cmdp.parse_subscription(b"") is None
    assert cmdp.parse_subscription(b"\x02x") is None


def test_publisher_subscriptions_and_notifications():
    p = Publisher("LogjamRelay.t")
    p.register_stat("CPU", "cpu")
    p.register_log("RELAY")
    assert not p.wants(b"STAT/CPU") and not p.wants_log(LogLevel.INFO, "RELAY")
    assert p.receive_subscription(b"\x01STAT/", 1) == []
    assert p.wants(b"STAT/CPU") and not p.wants(b"LOG/INFO")
    assert not p.wants_log(LogLevel.CRITICAL, "RELAY")
    (note,) = p.receive_subscription(b"\x01STAT?", 2)
    assert cmdp.decode(note) == Notification("LogjamRelay.t", 2, "STAT", {"CPU": "cpu"})
    (note,) = p.receive_subscription(b"\x01LOG?", 3)
    assert cmdp.decode(note).topics == {"RELAY": ""}
    p.receive_subscription(b"\x01LOG/WARNING", 4)
    assert p.wants_log(LogLevel.WARNING, "RELAY") and not p.wants_log(LogLevel.INFO, "RELAY")
    p.receive_subscription(b"\x01LOG/INFO/OUT", 4)
    assert p.wants_log(LogLevel.INFO, "OUTPUTS") and not p.wants_log(LogLevel.INFO, "RELAY")
    p.receive_subscription(b"\x00STAT/", 5)
    assert not p.wants(b"STAT/CPU")
    # an empty subscription ("everything") also gets both notifications
    assert len(p.receive_subscription(b"\x01", 6)) == 2
    assert p.register_stat("CPU", "cpu") is False and p.register_stat("CPU", "new") is True


def test_sanitize_and_check_names():
    assert cmdp.sanitize_name("outputs.courier-1") == "OUTPUTS_COURIER_1"
    assert cmdp.sanitize_name("...") == "_"
    assert cmdp.check_name("OUTPUT/A_1") == "OUTPUT/A_1"
    with pytest.raises(ValueError):
        cmdp.check_name("lower")
