"""CMDP sender over real sockets, decoded by ConstellationDAQ 1.0.2's own listener
(discovered through CHIRP on loopback) and decoder classes."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid

import pytest
import trio
import zmq
from constellation.core import base as c_base
from constellation.core.chirp import CHIRPServiceIdentifier
from constellation.core.listener import StandaloneListener
from constellation.core.message.cmdp1 import (
    CMDP1LogMessage,
    CMDP1Message,
    CMDP1Notification,
    CMDP1StatMessage,
)

from logjam_relay.health.cmdp import (
    MAX_LOG_MESSAGE_BYTES,
    MAX_LOG_TEXT,
    MAX_LOG_TRACEBACK,
    CMDPConfig,
    CMDPLogHandler,
    CMDPSender,
    LoopLag,
    ProcessStats,
    RelayStatsProvider,
    Stat,
    canonical_name,
    clip,
    component_of,
)
from logjam_relay.io import zmq_trio
from logjam_relay.protocols.cmdp import LogLevel, MetricType, Publisher

logging.addLevelName(logging.ERROR, "ERROR")  # undo constellation's global rename
logging.setLoggerClass(logging.Logger)

# Duration of the load run.  10 s keeps the suite short on a shared 2-core box and
# already covers ~200 STAT rounds and ~10k log records; set e.g. 60 for a soak run.
LOAD_SECONDS = float(os.environ.get("LOGJAM_CMDP_LOAD_SECONDS", "10"))
RELAY_LOGGER = "logjam_relay"


# --------------------------------------------------------------------------- helpers


class RecordingListener(StandaloneListener):
    """ConstellationDAQ's MonitoringListener (CHIRP discovery, SubscriberPool) with a
    ``_receive`` that runs the same decoder classes but counts every outcome:
    upstream's own ``_receive`` only logs MessageDecodingError and dies on others."""

    def __init__(self, *args, **kwargs):
        self.lock = threading.Lock()
        self.frames_received = 0
        self.stats: list[CMDP1StatMessage] = []
        self.logs: list[CMDP1LogMessage] = []
        self.notifications: list[CMDP1Notification] = []
        self.failures: list[tuple[list[bytes], str]] = []
        super().__init__(*args, **kwargs)

    def _receive(self, frames: list[bytes]) -> None:
        with self.lock:
            self.frames_received += 1
        try:
            msg = CMDP1Message.disassemble(frames)
            if msg.is_log_message():
                m = CMDP1LogMessage.from_cmdp_message(msg)
                m.to_log_record()
                self.logs.append(m)
            elif msg.is_stat_message():
                self.stats.append(CMDP1StatMessage.from_cmdp_message(msg))
            elif msg.is_notification():
                self.notifications.append(CMDP1Notification.from_cmdp_message(msg))
            else:
                raise AssertionError(f"unknown message {frames[0]!r}")
        except Exception as e:  # noqa: BLE001 - every failure counts
            self.failures.append((frames, repr(e)))

    @property
    def decoded(self) -> int:
        return len(self.stats) + len(self.logs) + len(self.notifications)


@contextlib.asynccontextmanager
async def constellation_listener(group: str, topics: list[str], name: str = "probe"):
    lst = RecordingListener(name, group, ["lo"])
    logging.setLoggerClass(logging.Logger)
    for lname in ("MNTR", "LINK", "RECORDINGLISTENER"):
        logging.getLogger(lname).setLevel(logging.WARNING)  # no per-message trace records
    lst.set_topics(topics)
    t = threading.Thread(target=lst.run_listener, name=f"cdaq-{name}", daemon=True)
    t.start()
    try:
        yield lst
    finally:
        if lst._com_thread_evt is not None:
            lst._com_thread_evt.set()
        await trio.to_thread.run_sync(t.join, 10)
        assert not t.is_alive()
        if lst in c_base.SATELLITE_LIST:
            c_base.SATELLITE_LIST.remove(lst)


async def wait_until(pred, timeout: float = 15.0, what: str = "condition"):
    with trio.move_on_after(timeout):
        while not pred():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def relay_logging(sender: CMDPSender, level: int = 1):
    lg = logging.getLogger(RELAY_LOGGER)
    old = (lg.level, lg.propagate)
    lg.setLevel(level)
    lg.propagate = False  # keep pytest's capture out of the load
    sender.install_log_handler(lg)
    try:
        yield lg
    finally:
        sender.remove_log_handler(lg)
        lg.setLevel(old[0])
        lg.propagate = old[1]


def make_sender(name: str, group: str, provider=None, **cfg) -> CMDPSender:
    config = CMDPConfig(cmdp_port=1, cmdp_name=name, chirp_group=group, **cfg)
    return CMDPSender(config, provider, endpoint="tcp://127.0.0.1:*",
                      chirp_interfaces=["127.0.0.1"])


def new_group() -> str:
    return "t" + uuid.uuid4().hex[:12]


# --------------------------------------------------------------------------- end to end


class FakeRelay:
    def __init__(self):
        self.n = 0
        self.invalid: dict[str, int] = {"bad_meta": 0}

    def tick(self, k: int) -> None:
        self.n += k
        if self.n > 1000:  # a new invalid reason appears mid-run -> new STAT topic
            self.invalid["too_big"] = self.n // 1000
        self.invalid["bad_meta"] += 1

    def relay(self):
        return {"msgs_received": self.n, "bytes_received": self.n * 512,
                "invalid": dict(self.invalid), "pings": self.n // 100, "pub_drops": 0,
                "sequence": self.n + 1}

    def outputs(self):
        return {"lumberjack": {"backlog": self.n % 97, "acked": self.n, "resends": 3,
                               "reconnects": 1, "ack_rtt": 0.0123},
                "courier-2": {"backlog": 0, "acked": self.n // 2, "resends": 0,
                              "reconnects": 0, "ack_rtt": 0.5}}


def extra_values():
    return {"STATE_NAME": Stat("RUN ✓", MetricType.LAST_VALUE, "", "a string"),
            "FLAG": (True, MetricType.LAST_VALUE, ""),
            "NOTHING": (None, MetricType.LAST_VALUE, "n/a"),
            "BIG": (2**63 + 5, MetricType.ACCUMULATE, "B"),
            "NEG": (-1.5e300, MetricType.AVERAGE, "°C")}


async def test_load_every_message_decoded_by_constellation():
    """Under a steady log storm and fast STAT rounds, ConstellationDAQ's listener,
    which found the relay through CHIRP, decodes 100 % of what the relay sent."""
    group = new_group()
    fake = FakeRelay()
    lag = LoopLag()
    provider = RelayStatsProvider(fake.relay, fake.outputs, ProcessStats(), lag,
                                  extra=extra_values)
    sender = make_sender("loadtest", group, provider, stat_interval=0.05, log_level=1)
    topics = ["STAT/", "LOG/", "STAT?", "LOG?"]
    async with trio.open_nursery() as nursery, \
            constellation_listener(group, topics) as lst:
        nursery.start_soon(lag.run)
        await nursery.start(sender.run)
        with relay_logging(sender) as root:
            await wait_until(lambda: len(sender.publisher.subscriptions) == 4,
                             what="CHIRP discovery + subscriptions")
            comps = [logging.getLogger(f"{RELAY_LOGGER}.{c}")
                     for c in ("relay", "outputs.lumberjack", "outputs.courier", "spool")]
            levels = [5, logging.DEBUG, logging.INFO, logging.WARNING, 35, logging.ERROR,
                      logging.CRITICAL]
            end = trio.current_time() + LOAD_SECONDS
            i = 0
            while trio.current_time() < end:
                for _ in range(10):  # ~1000 records/s
                    lg = comps[i % len(comps)]
                    if i % 500 == 0:
                        try:
                            raise ValueError("boom")
                        except ValueError:
                            lg.exception("failure #%d", i)
                    else:
                        lg.log(levels[i % len(levels)], "record %d: héllo ✓ %s", i, "x" * (i % 50))
                    i += 1
                fake.tick(10)
                await trio.sleep(0.01)
            root.info("done")  # from the top of our tree: component LOGJAM_RELAY
            # Quiesce: no more records, no more STAT rounds; everything sent must arrive.
            sender.stats_provider = None
            await wait_until(lambda: not sender.handler.queue, what="log queue drained")
            sender.stat_round()  # registers the last new component now (LOG? notification)
        total = sum(sender.sent.values())
        # the listener decodes in a Python thread of this process: on a loaded machine it
        # may be tens of seconds behind when the load stops (15 s was too short once, with
        # three test workers and two busy loops on two cores); what is asserted is that
        # everything arrives and decodes, and that nothing was dropped (below)
        try:
            await wait_until(lambda: lst.frames_received >= total, timeout=90.0)
        except AssertionError:
            raise AssertionError(f"timed out waiting for all messages: {lst.frames_received:,}"
                                 f" of {total:,} received") from None
        nursery.cancel_scope.cancel()

    assert lst.failures == []
    assert lst.frames_received == lst.decoded == total
    assert sender.pub.drops == 0 and sender.handler.dropped == 0
    assert sender.sent["log"] == i + 1 == len(lst.logs)
    assert sender.sent["stat"] == len(lst.stats) > 20 * 20
    # content checks, all from ConstellationDAQ's decoded objects
    assert {m.sender for m in lst.stats + lst.logs} == {"LogjamRelay.loadtest"}
    names = {m.metric.name for m in lst.stats}
    assert {"INGEST_RATE", "INGEST_BYTES", "INVALID_BAD_META", "INVALID_TOO_BIG", "PINGS",
            "PUB_DROPS", "SEQUENCE", "LOOP_LAG", "CPU", "RSS", "OUTPUT_LUMBERJACK_BACKLOG",
            "OUTPUT_COURIER_2_ACK_RATE", "OUTPUT_LUMBERJACK_RESENDS",
            "OUTPUT_LUMBERJACK_RECONNECTS", "OUTPUT_LUMBERJACK_ACK_RTT", "STATE_NAME",
            "BIG", "NEG"} <= names
    last = {m.metric.name: m for m in lst.stats}
    assert last["STATE_NAME"].value == "RUN ✓" and last["BIG"].value == 2**63 + 5
    assert last["OUTPUT_LUMBERJACK_ACK_RTT"].metric.unit == "ms"
    assert last["OUTPUT_LUMBERJACK_ACK_RTT"].value == pytest.approx(12.3)
    assert last["RSS"].value > 1_000_000
    # the STAT? answer grew when INVALID_TOO_BIG appeared
    stat_notes = [n for n in lst.notifications if n.topics_prefix == "STAT"]
    assert any("INVALID_TOO_BIG" in n.topics for n in stat_notes)
    assert set(stat_notes[-1].topics) == names
    log_notes = [n for n in lst.notifications if n.topics_prefix == "LOG"]
    assert {"RELAY", "OUTPUTS_LUMBERJACK", "SPOOL"} <= set(log_notes[-1].topics)
    # LOG topics: levels mapped, components, TRACE tags, tracebacks
    seen = {(m.log_level.name, m.log_topic) for m in lst.logs}
    assert {lv for lv, _ in seen} == {"TRACE", "DEBUG", "INFO", "WARNING", "STATUS", "CRITICAL"}
    trace = next(m for m in lst.logs if m.log_level.name == "TRACE")
    assert {"thread", "filename", "lineno", "funcname"} <= set(trace.tags)
    assert trace.tags["filename"] == "test_cmdp_sender.py"
    assert isinstance(trace.tags["thread"], int) and isinstance(trace.tags["lineno"], int)
    info = next(m for m in lst.logs if m.log_level.name == "INFO")
    assert info.tags == {} and "héllo ✓" in info.log_message
    exc = [m for m in lst.logs if "traceback" in m.tags]
    assert exc and "ValueError: boom" in exc[0].tags["traceback"]


async def test_stat_only_subscription_sends_no_log_traffic():
    group = new_group()
    sender = make_sender("statonly", group, lambda: {"CPU": (1.0, MetricType.AVERAGE, "%")}, log_level=1,
                         stat_interval=0.05)
    async with trio.open_nursery() as nursery, \
            constellation_listener(group, ["STAT/"]) as lst:
        await nursery.start(sender.run)
        with relay_logging(sender):
            await wait_until(lambda: sender.publisher.subscriptions == {b"STAT/"},
                             what="subscription")
            lg = logging.getLogger(f"{RELAY_LOGGER}.relay")
            for k in range(200):
                lg.log([5, 10, 20, 30, 35, 40, 50][k % 7], "nobody wants this %d", k)
            await wait_until(lambda: len(lst.stats) >= 5, what="STAT messages")
        nursery.cancel_scope.cancel()
    assert lst.failures == [] and lst.logs == [] and lst.notifications == []
    assert sender.sent["log"] == 0 and sender.sent["notification"] == 0
    # the handler did not even queue them: no LOG subscriber
    assert sender.handler.enqueued == 0 and sender.handler.unsubscribed == 200
    assert {m.metric.name for m in lst.stats} == {"CPU"}


async def test_notifications_answer_every_query_subscriber():
    """Two raw SUB sockets (no CHIRP) ask ``STAT?``: each gets the list (XPUB_VERBOSE)."""
    sender = make_sender("notes", new_group(),
                         lambda: {"A": (1, 1, ""), "B_RATE": Stat(2.5, MetricType.RATE, "1/s")},
                         stat_interval=0.02, chirp_enabled=False)
    ctx = zmq.Context.instance()
    subs = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(sender.run)
        assert sender.chirp is None
        await wait_until(lambda: "B_RATE" in sender.publisher.stat_topics, what="first round")
        try:
            for _ in range(2):
                s = ctx.socket(zmq.SUB)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"tcp://127.0.0.1:{port}")
                s.setsockopt(zmq.SUBSCRIBE, b"STAT?")
                subs.append(s)
                with trio.fail_after(10):
                    frames = await zmq_trio.recv_multipart(s)
                note = CMDP1Notification.disassemble(frames)
                assert note.topics_prefix == "STAT" and note.sender == "LogjamRelay.notes"
                assert set(note.topics) == {"A", "B_RATE"}
                assert "RATE" in note.topics["B_RATE"] and "1/s" in note.topics["B_RATE"]
            # LOG? from the first socket: the (empty) list of log components
            subs[0].setsockopt(zmq.SUBSCRIBE, b"LOG?")
            with trio.fail_after(10):
                while True:
                    frames = await zmq_trio.recv_multipart(subs[0])
                    if frames[0] == b"LOG?":
                        break
            assert CMDP1Notification.disassemble(frames).topics == {}
        finally:
            zmq_trio.close_all(subs, 0)
        nursery.cancel_scope.cancel()


async def test_log_records_from_other_threads_reach_subscribers():
    sender = make_sender("threads", new_group(), None, chirp_enabled=False)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    try:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(sender.run)
            sub.connect(f"tcp://127.0.0.1:{port}")
            sub.setsockopt(zmq.SUBSCRIBE, b"LOG/WARNING")
            await wait_until(lambda: sender.publisher.subscriptions, what="subscription")
            with relay_logging(sender):
                lg = logging.getLogger(f"{RELAY_LOGGER}.outputs.courier")
                await trio.to_thread.run_sync(lg.warning, "from a thread")
                lg.info("not subscribed")
                with trio.fail_after(10):
                    frames = await zmq_trio.recv_multipart(sub)
            m = CMDP1LogMessage.disassemble(frames)
            assert (m.log_level.name, m.log_topic, m.log_message) == (
                "WARNING", "OUTPUTS_COURIER", "from a thread")
            assert m.tags == {}
            nursery.cancel_scope.cancel()
    finally:
        sub.close(0)


# --------------------------------------------------------------------------- handler (no I/O)


def _attached_handler(maxsize=3, subs=(b"LOG/",)) -> CMDPLogHandler:
    pub = Publisher("LogjamRelay.t")
    pub.subscriptions = frozenset(subs)
    h = CMDPLogHandler(maxsize)
    wakes = []
    h.attach(pub, None, wakes.append)
    return h


def test_handler_bounded_queue_never_blocks():
    h = _attached_handler(maxsize=3)
    lg = logging.getLogger("logjam_relay.test_bounded")
    lg.propagate = False
    lg.addHandler(h)
    try:
        for k in range(10):
            lg.warning("r%d", k)
    finally:
        lg.removeHandler(h)
        lg.propagate = True
    assert len(h.queue) == 3 and h.dropped == 7 and h.enqueued == 3
    assert [h.pop()[2] for _ in range(3)] == ["r0", "r1", "r2"]
    assert h.bytes == 0


@pytest.mark.parametrize("text", ["", "a" * MAX_LOG_TEXT, "a" * (MAX_LOG_TEXT + 1),
                                  "é" * 5000, "✓" * 3000 + "x", "\U0001f600" * 1000],
                         ids=["empty", "at-limit", "over", "2-byte", "3-byte", "4-byte"])
def test_clip_keeps_utf8_and_states_its_size(text):
    for keep_end in (False, True):
        out, size = clip(text, MAX_LOG_TEXT, keep_end=keep_end)
        raw = text.encode()
        assert len(out.encode()) <= size <= MAX_LOG_TEXT + 64
        if len(raw) <= MAX_LOG_TEXT:
            assert out == text
        else:
            cut = f"{len(raw) - MAX_LOG_TEXT} bytes cut"
            assert cut in out
            kept = out.replace(f"[{cut}] ", "") if keep_end else out.replace(f" [{cut}]", "")
            assert (text.endswith(kept) if keep_end else text.startswith(kept))
            assert len(kept.encode()) > MAX_LOG_TEXT - 4


def test_handler_bounds_the_bytes_it_holds():
    """Long texts and tracebacks are clipped (the traceback keeps its end, where the error
    is) and the queue holds at most maxbytes: what would cross it is dropped, counted."""
    pub = Publisher("LogjamRelay.t")
    pub.subscriptions = frozenset((b"LOG/",))
    h = CMDPLogHandler(10000, maxbytes=20 * MAX_LOG_MESSAGE_BYTES)
    h.attach(pub, None, lambda: None)
    lg = logging.getLogger("logjam_relay.test_bytes")
    lg.propagate = False
    lg.addHandler(h)
    try:
        for k in range(100):
            try:
                raise ValueError("deep " + "y" * 20000 + f" end{k}")
            except ValueError:
                lg.exception("x" * 100000)
    finally:
        lg.removeHandler(h)
        lg.propagate = True
    assert 0 < h.bytes <= h.maxbytes
    assert h.enqueued == len(h.queue) >= 20 and h.dropped == 100 - h.enqueued
    level, comp, text, t_ns, tags = h.pop()
    assert text.startswith("x" * 100) and text.endswith(" bytes cut]")
    assert len(text.encode()) <= MAX_LOG_TEXT + 64
    assert tags["traceback"].endswith("end0\n") and "bytes cut]" in tags["traceback"]
    assert len(tags["traceback"].encode()) <= MAX_LOG_TRACEBACK + 64
    msg = pub.log(level, comp, text, t_ns, tags)
    assert sum(map(len, msg)) <= MAX_LOG_MESSAGE_BYTES
    while h.queue:
        h.pop()
    assert h.bytes == 0


def test_handler_ignores_the_sender_itself_and_reentrant_records():
    h = _attached_handler(maxsize=100)
    tree = logging.getLogger("logjam_relay")
    old = tree.propagate
    # only this handler: another one left on the tree by an earlier test of this process
    # would format the record first, outside the guard, and log the inner record itself
    old_handlers = tree.handlers[:]
    tree.handlers = [h]
    tree.propagate = False
    # and the plain record factory: a relay built in this process installed the redacting
    # one (redact.py), which formats at creation, before any handler (tested in test_secrets)
    old_factory = logging.getLogRecordFactory()
    logging.setLogRecordFactory(logging.LogRecord)

    class Loud:  # formatting it logs again: endless recursion without the guard
        def __str__(self):
            logging.getLogger("logjam_relay.inner").warning("loud %s", self)
            return "loud"

    try:
        logging.getLogger("logjam_relay.health.cmdp").warning("the sender about itself")
        assert len(h.queue) == 0
        logging.getLogger("logjam_relay.outer").warning("value %s", Loud())
    finally:
        tree.handlers = old_handlers
        tree.propagate = old
        logging.setLogRecordFactory(old_factory)
    assert [h.pop()[1:3] for _ in range(len(h.queue))] == [("OUTER", "value loud")]


def test_handler_levels_components_and_trace_tags():
    h = _attached_handler(maxsize=100)
    for levelno, want in [(1, LogLevel.TRACE), (5, LogLevel.TRACE), (10, LogLevel.DEBUG),
                          (20, LogLevel.INFO), (30, LogLevel.WARNING), (35, LogLevel.STATUS),
                          (40, LogLevel.CRITICAL), (50, LogLevel.CRITICAL)]:
        rec = logging.LogRecord("logjam_relay.outputs.lumberjack", levelno, "/x/y.py", 7,
                                "m %s", ("a",), None, func="fn")
        h.handle(rec)
        level, comp, text, t_ns, tags = h.pop()
        assert (level, comp, text) == (want, "OUTPUTS_LUMBERJACK", "m a")
        assert t_ns == int(rec.created * 1e9)
        if want in (LogLevel.TRACE, LogLevel.DEBUG, LogLevel.CRITICAL):
            assert tags["funcname"] == tags["funcName"] == "fn"
            assert tags["filename"] == "y.py" and tags["lineno"] == 7
            assert tags["thread"] == threading.get_ident()
        else:
            assert tags == {}
    # a bad %-format does not raise into the caller
    h.handle(logging.LogRecord("x", 20, "f", 1, "%d", ("nan",), None))
    assert "bad log arguments" in h.pop()[2]


def test_component_names():
    assert component_of("logjam_relay.outputs.courier") == "OUTPUTS_COURIER"
    assert component_of("logjam_relay.relay") == "RELAY"
    assert component_of("root") == "ROOT"
    assert component_of("some-lib.sub") == "SOME_LIB_SUB"


# --------------------------------------------------------------------------- small parts


def test_config_defaults_and_names():
    c = CMDPConfig()
    assert not c.enabled and c.cmdp_port == 0 and c.chirp_group == "logjam"
    assert c.canonical_name.startswith("LogjamRelay.")
    assert canonical_name("box_1") == "LogjamRelay.box_1"
    assert canonical_name("Other.box") == "Other.box"
    for bad in ("a.b.c", "has space", "x-y"):
        with pytest.raises(ValueError):
            canonical_name(bad)
    with pytest.raises(ValueError):
        CMDPConfig(cmdp_port=70000).validate()


def test_relay_stats_provider_rates():
    now = [100.0]
    vals = {"msgs_received": 0, "bytes_received": 0}
    p = RelayStatsProvider(lambda: vals, lambda: {"lj": {"acked": vals["msgs_received"]}},
                           clock=lambda: now[0])
    first = p()
    assert first["INGEST_RATE"].value == 0.0
    now[0] += 2.0
    vals.update(msgs_received=1000, bytes_received=4096)
    s = p()
    assert s["INGEST_RATE"] == Stat(500.0, MetricType.RATE, "1/s", s["INGEST_RATE"].description)
    assert s["INGEST_BYTE_RATE"].value == 2048.0 and s["OUTPUT_LJ_ACK_RATE"].value == 500.0
    assert s["INGEST_MSGS"].value == 1000 and "INVALID_TOTAL" not in s


def test_process_stats():
    now = [0.0]
    ps = ProcessStats(clock=lambda: now[0])
    now[0] = 1.0
    sum(range(200000))
    d = ps.stats()
    assert d["rss_bytes"] > 1_000_000 and d["cpu_seconds"] > 0 and d["cpu_percent"] >= 0


async def test_loop_lag_measures_a_blocked_loop():
    import time

    lag = LoopLag(period=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(lag.run)
        await wait_until(lambda: lag.samples >= 1, what="first sample")
        lag.take_max()
        n = lag.samples
        time.sleep(0.1)  # block the event loop on purpose
        await wait_until(lambda: lag.samples > n, what="sample after block")
        assert lag.take_max() >= 0.05
        nursery.cancel_scope.cancel()


def test_unused_chirp_service_id_matches_upstream():
    from logjam_relay.protocols.chirp import Service

    assert Service.MONITORING == CHIRPServiceIdentifier.MONITORING.value


def test_bad_metrics_are_skipped_not_fatal():
    vals = {"OK": (1, 1, ""), "BADTYPE": (1, 9, ""), "BADTUPLE": (1, 2, "", "", "x"),
            "BADVALUE": (object(), 1, ""), "lower.case-name": Stat(2.0)}
    sender = make_sender("bad", "g", lambda: vals, chirp_enabled=False)
    sender.pub = type("FakePub", (), {"publish": lambda self, f: None, "drops": 0})()
    sender.publisher.subscriptions = frozenset({b"STAT/"})
    assert sender.stat_round() == 2
    assert sender.provider_errors == 3
    assert set(sender.publisher.stat_topics) == {"OK", "LOWER_CASE_NAME", "BADVALUE"}
