"""A flood of bad input, through the real command, seen on the CMDP LOG topics.

What the design promises for bad input: the protocol's error reply, a counter with a label,
a rate-limited log line, and nothing else lost.  Here the relay runs as operators run it
(``python -m logjam_relay`` with ``--cmdp-port``), a subscriber decodes its LOG topics with
ConstellationDAQ's own classes, and some hundred thousand invalid messages of four kinds
arrive on PULL while a good client keeps asking on ROUTER.  Asserted:

* the LOG lines per kind are few: at most 5 per 10 s window (``ratelimit.py``), whatever
  the flood's size;
* every invalid message is accounted for: the lines that got through plus the
  "``<reason>``: N similar messages suppressed" lines that follow a window add up to
  exactly what was sent, which is also ``logjam_relay_invalid_total{reason}``;
* what the relay logged (its log file) is what CMDP carried, line for line;
* the good client's requests were all answered 202 during the flood.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.request

import pytest
import zmq
from constellation.core.message.cmdp1 import CMDP1LogMessage, CMDP1Message

from conftest import free_port
from fuzzers import metric
from relay_harness import meta, relay_settings, start_process, stop_process

logging.addLevelName(logging.ERROR, "ERROR")  # undo constellation's global rename
logging.setLoggerClass(logging.Logger)

pytestmark = pytest.mark.slow

#: the invalid kinds of the flood (PULL: no reply) and the reason each is counted under
KINDS = {
    "frame_count": [b"flood-test", b"logs"],
    "topic": [b"flood-test", b"bad.topic", b"{}", meta()],
    "stream_name": [b"nodash", b"logs", b"{}", meta()],
    "meta_size": [b"flood-test", b"logs", b"{}", b"short"],
}
PER_KIND = 40_000
WINDOW, BURST = 10.0, 5            # ratelimit.RateLimitedLog's defaults


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


class LogSubscriber(threading.Thread):
    """Every LOG message of the relay's CMDP XPUB, decoded by ConstellationDAQ."""

    def __init__(self, ctx: zmq.Context, port: int):
        super().__init__(daemon=True)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"LOG/")
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.lines: list[tuple[str, str]] = []          # (topic, message)
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        while not self.stop.is_set():
            if not poller.poll(100):
                continue
            frames = self.sub.recv_multipart()
            try:
                m = CMDP1LogMessage.from_cmdp_message(CMDP1Message.disassemble(frames))
            except Exception as e:               # noqa: BLE001 -- reported by the test
                self.errors.append(f"{frames[:1]}: {e!r}")
                continue
            self.lines.append((frames[0].decode(), m.log_message))
        self.sub.close(linger=0)

    def count(self, pattern: str) -> int:
        return sum(1 for _, m in self.lines if re.search(pattern, m))


class GoodDealer(threading.Thread):
    """A valid request every 50 ms on ROUTER; the reply of each, and how long it took."""

    def __init__(self, ctx: zmq.Context, port: int):
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.replies: list[tuple[bytes, float]] = []
        self.unanswered = 0
        self.stop = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop.is_set():
            t0 = time.monotonic()
            self.sock.send_multipart([b"", b"good-env", b"logs.good", b"{}", meta()])
            if poller.poll(10_000):
                frames = self.sock.recv_multipart()
                self.replies.append((frames[-1], time.monotonic() - t0))
            else:
                self.unanswered += 1
            time.sleep(0.05)
        self.sock.close(linger=0)


def _wait(cond, timeout: float, what) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.1)


def test_a_flood_of_bad_input_is_a_few_log_lines_each_counted(tmp_path):
    cmdp_port = free_port()
    settings = relay_settings(tmp_path)
    log_path = tmp_path / "relay.log"
    proc = start_process(settings, ["--cmdp-port", str(cmdp_port), "--cmdp-name",
                                    "relay.flood", "--chirp-interface", "127.0.0.1"],
                         log_path=log_path)
    ctx = zmq.Context()
    sub = LogSubscriber(ctx, cmdp_port)
    good = GoodDealer(ctx, settings.router_port)
    try:
        sub.start()
        # the subscription is through once an invalid ping's warning arrives (a reason
        # of its own: the flood's reasons start with a fresh window)
        ping = ctx.socket(zmq.DEALER)
        ping.connect(f"tcp://127.0.0.1:{settings.router_port}")
        deadline = time.monotonic() + 30
        while not sub.count(r"invalid ping"):
            assert time.monotonic() < deadline, "no LOG line on CMDP within 30 s"
            ping.send_multipart([b"", b"ping"])         # too few frames: 400, logged
            time.sleep(0.3)
        ping.close(linger=0)
        good.start()

        # ---- the flood: PER_KIND of each kind, interleaved, as fast as PULL takes them
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{settings.pull_port}")
        t_flood = time.monotonic()
        kinds = list(KINDS.values())
        for i in range(PER_KIND * len(kinds)):
            push.send_multipart(kinds[i % len(kinds)])

        def counted() -> dict[str, float]:
            text = _scrape(settings.metrics_port)
            return {r: metric(text, "logjam_relay_invalid_total", reason=r) for r in KINDS}
        _wait(lambda: all(v >= PER_KIND for v in counted().values()), 120,
              lambda: f"the relay counted {counted()} of {PER_KIND} each")
        flood_s = time.monotonic() - t_flood
        # ---- one more of each once the last window is over: its line reports what that
        # window suppressed
        time.sleep(max(0.0, t_flood + WINDOW * (int(flood_s // WINDOW) + 1) + 0.5
                       - time.monotonic()))
        for frames in kinds:
            push.send_multipart(frames)
        push.close(linger=2000)
        _wait(lambda: all(sub.count(rf"^{r}: \d+ similar messages suppressed") >= 1
                          for r in KINDS), 30,
              lambda: f"no suppressed-count line for every reason: {sub.lines[-12:]}")
        time.sleep(1.0)                                   # the rest of the LOG lines
        good.stop.set()
        good.join(15)
        text = _scrape(settings.metrics_port)
    finally:
        good.stop.set()
        sub.stop.set()
        rc = stop_process(proc, timeout=30)
        sub.join(5)
        ctx.destroy(linger=0)
    assert rc == 0

    assert not sub.errors, sub.errors[:5]
    logged = log_path.read_text()
    windows = int(flood_s // WINDOW) + 2
    for reason in KINDS:
        lines = sub.count(rf"^invalid message \({reason}\) from ")
        suppressed = [int(n) for _, m in sub.lines
                      for n in re.findall(rf"^{reason}: (\d+) similar messages suppressed$", m)]
        total = metric(text, "logjam_relay_invalid_total", reason=reason)
        # few lines, whatever the flood
        assert BURST <= lines <= BURST * windows, (reason, lines, flood_s)
        # every invalid message accounted for: lines + suppressed == sent == counted
        assert lines + sum(suppressed) == PER_KIND + 1 == total, \
            (reason, lines, suppressed, total)
        # what the relay's log says is what CMDP carried
        assert len(re.findall(rf"invalid message \({reason}\) from ", logged)) == lines
        assert len(re.findall(rf"{reason}: \d+ similar messages suppressed", logged)) == \
            len(suppressed)
    assert all(t.startswith("LOG/WARNING") for t, m in sub.lines
               if "invalid message" in m or "suppressed" in m), sub.lines[:5]
    # the good client was answered throughout, every time 202
    assert good.unanswered == 0
    assert len(good.replies) >= 10 and {r for r, _ in good.replies} == {b"202 Accepted"}, \
        good.replies[:5]
    print(f"\nflood {PER_KIND * len(KINDS):,} invalid messages in {flood_s:.1f} s: "
          f"{len(sub.lines)} LOG lines on CMDP; good requests {len(good.replies)}, slowest "
          f"{max(s for _, s in good.replies) * 1000:.0f} ms")
