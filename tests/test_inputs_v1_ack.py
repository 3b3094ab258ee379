"""A Lumberjack v1 sender that takes any 6 bytes as the ACK of its window (logstash-forwarder)
loses nothing through the real command while the relay's spool is full.

The relay's input must send nothing on a v1 connection while a window waits for the spool
(go-lumber's v1 server: "keepalive not supported by v1"): a ``2A 0`` keep-alive would move
the forwarder's registry past what is durable.  The set-up is the issue's: a 1 MiB spool
that nothing drains (policy block, the output's receiver down), ``ack_interval=1s``, a
sender whose timeout (2 s here, 15 s in the forwarder) is longer than the keep-alive
interval.  Figures, in lines of the sender:

* lost: lines in the sender's registry (acknowledged, never sent again) that the output's
  receiver never got once the relay was back and the spool drained: must be 0;
* duplicated: lines the receiver got more than once (the documented bound: one window per
  relay fault, docs/inputs.md).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
from collections import Counter

import pytest
import trio

from conftest import free_port
from forwarder_sender import ForwarderLikeSender
from peers.lumberjack_reader import LumberjackReader
from relay_harness import relay_settings, start_process, stop_process
from spool_helpers import spooled_records
from test_memory_ceiling import metric, scrape

WINDOW = 256
LINES = 40 * WINDOW
SENDER_TIMEOUT = 2.0


def _lines(n: int) -> list[str]:
    # random hex: zlib cannot shrink a window much, so TCP buffers do not hide the problem
    return [f"L{i:06d} {secrets.token_hex(80)}" for i in range(n)]


def _line_of(body: bytes) -> str | None:
    return json.loads(body).get("line")


class Edge:
    """The relay under test: a Lumberjack input, a 1 MiB spool, a Lumberjack output whose
    receiver (port ``out_port``) is down until the test starts it."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.lport, self.out_port = free_port(), free_port()
        self.settings = relay_settings(tmp_path)
        self.spool = tmp_path / "spool"
        self.args = [
            "--input", f"lumberjack://127.0.0.1:{self.lport}?tls=off&ack_interval=1s&name=lj",
            "--spool-dir", str(self.spool), "--spool-max-bytes", "1MiB",
            "--spool-segment-bytes", "256KiB", "--spool-policy", "block",
            "--output", f"lumberjack://127.0.0.1:{self.out_port}?tls=off&window=500"
                        "&backoff_min=0.05&backoff_max=0.5&name=out"]
        self.log = tmp_path / "relay.log"
        self.proc = None

    async def start(self):
        self.proc = await trio.to_thread.run_sync(start_process, self.settings, self.args,
                                                  self.log)

    async def metric(self, name: str, **labels) -> float:
        text = await trio.to_thread.run_sync(scrape, self.settings.metrics_port)
        return metric(text, name, **labels)

    async def withdrawn(self) -> float:
        """Windows this run withdrew (the sender closed while they waited for the spool)."""
        return await self.metric("logjam_relay_input_errors_total", input="lj",
                                 reason="withdrawn")

    def stop(self, sig=signal.SIGTERM) -> int:
        if sig == signal.SIGKILL:
            os.kill(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)
        return stop_process(self.proc, sig, timeout=30)


async def _until(cond, what: str, limit: float = 120):
    """Poll ``cond`` (async) until true; ``limit`` only guards against a hang."""
    with trio.fail_after(limit):
        while not await cond():
            await trio.sleep(0.2)


class Receiver:
    def __init__(self, port: int):
        self.got: Counter[str] = Counter()
        self.reader = LumberjackReader(port=port, keep_windows=False, on_window=self._on)

    def _on(self, w):
        for ev in w.events:
            line = _line_of(ev.fields["line"])
            if line is not None:
                self.got[line] += 1


def _figures(sender: ForwarderLikeSender, got: Counter[str]) -> dict:
    acked = set(sender.registry)
    return {"registry": len(acked), "delivered": sum(got.values()),
            "lost": len(acked - set(got)),
            "duplicated": sum(n - 1 for n in got.values() if n > 1)}


def test_keepalive_is_for_v2_windows_only():
    """go-lumber's v1 server: "keepalive not supported by v1"; v2 (Beats) gets 2A 0."""
    from logjam_relay.protocols import lumberjack as lj
    from logjam_relay.protocols import lumberjack_server as ljs
    c = ljs.ServerConnection()
    c.receive_data(lj.encode_window(lj.encode_data_frames([{"line": "a"}]), 1))
    assert c.next_event().version == 1 and c.keepalive() is None
    c.receive_data(ljs.encode_window_v2([b"{}"]))
    assert c.next_event().version == 2 and c.keepalive() == b"2A\0\0\0\0"


@pytest.mark.parametrize("stop", ["SIGKILL", "SIGTERM"])
async def test_forwarder_like_v1_sender_loses_nothing_across_a_full_spool_and_a_stop(
        tmp_path, stop):
    edge = Edge(tmp_path)
    sender = ForwarderLikeSender(edge.lport, _lines(LINES), window=WINDOW,
                                 timeout=SENDER_TIMEOUT)
    sig = getattr(signal, stop)
    await edge.start()
    try:
        # ---- 1. the spool fills; the sender waits for an ACK and times out (twice)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.run)

            async def stuck():
                return (sender.done or sender.timeouts >= 2) \
                    and await edge.metric("logjam_relay_spool_paused") == 1
            await _until(stuck, "the spool full and the sender stuck")
            withdrawn = await edge.withdrawn()
            rc = edge.stop(sig)
            nursery.cancel_scope.cancel()
        assert rc == (0 if stop == "SIGTERM" else -signal.SIGKILL)
        spooled = Counter(ln for f in spooled_records([edge.spool])
                          if f[0] != b"heartbeat" and (ln := _line_of(f[2])) is not None)
        at_stop = {"registry": len(sender.registry),
                   "spooled": sum(spooled.values()),
                   "registry not in the spool": len(set(sender.registry) - set(spooled)),
                   **sender.stats()}
        # ---- 2. the relay is back, the output's receiver is up: the spool drains and the
        # forwarder (still running) resends the window it was on and finishes
        receiver = Receiver(edge.out_port)
        async with trio.open_nursery() as nursery:
            await nursery.start(receiver.reader.serve)
            await edge.start()
            await sender.run()

            async def drained():
                return await edge.metric("logjam_relay_output_backlog_records") == 0
            await _until(drained, "the spool drained")
            withdrawn += await edge.withdrawn()
            nursery.cancel_scope.cancel()
        assert edge.stop() == 0
    finally:
        if edge.proc.poll() is None:
            edge.proc.kill()
            edge.proc.wait()
    fig = _figures(sender, receiver.got)
    # the documented bound: one window per relay fault (a window spooled whose ACK the
    # stop cut off) and per sender timeout that did not withdraw its window (it fired
    # while the window was being written to the spool)
    bound = 1 + max(0, sender.timeouts - withdrawn)
    print(f"\nv1 forwarder-like sender, {stop} with the spool full: at the stop {at_stop}; "
          f"after the restart and drain {fig}; windows withdrawn {withdrawn:.0f}, duplicates "
          f"allowed {bound} windows")
    assert sender.done and len(sender.registry) == LINES
    assert at_stop["registry not in the spool"] == 0, at_stop
    assert fig["lost"] == 0, fig
    assert fig["duplicated"] <= bound * WINDOW, fig
    # the sender never took a keep-alive for an ACK: every ACK it got was a real 1A <n>
    assert set(sender.acks) == {b"1A" + WINDOW.to_bytes(4, "big")}, sender.acks


async def test_forwarder_like_v1_sender_that_times_out_and_resends_while_the_spool_is_full(
        tmp_path):
    """The relay stays up; the sender times out 3 times on the same window (closing its
    connection and resending on a new one each time); then the receiver comes up and the
    spool drains.  A window whose sender gave up before it was spooled is withdrawn, not
    spooled once per attempt."""
    edge = Edge(tmp_path)
    sender = ForwarderLikeSender(edge.lport, _lines(LINES), window=WINDOW,
                                 timeout=SENDER_TIMEOUT)
    receiver = Receiver(edge.out_port)
    await edge.start()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.run)

            async def paused():
                return await edge.metric("logjam_relay_spool_paused") == 1
            await _until(paused, "the spool full")
            t0 = sender.timeouts

            async def resent():             # three timeouts while the spool is full
                return sender.timeouts >= t0 + 3
            await _until(resent, "three timeouts on a full spool")
            stuck = sender.stats()
            await nursery.start(receiver.reader.serve)
            with trio.fail_after(120):
                while not sender.done:
                    await trio.sleep(0.2)

            async def drained():
                return await edge.metric("logjam_relay_output_backlog_records") == 0
            await _until(drained, "the spool drained")
            withdrawn = await edge.withdrawn()
            nursery.cancel_scope.cancel()
        assert edge.stop() == 0
    finally:
        if edge.proc.poll() is None:
            edge.proc.kill()
            edge.proc.wait()
    fig = _figures(sender, receiver.got)
    bound = max(0, sender.timeouts - withdrawn)    # timeouts that did not withdraw
    print(f"\nv1 forwarder-like sender resending after timeouts: while stuck {stuck}; "
          f"after the drain {fig}, final sender {sender.stats()}, windows withdrawn "
          f"{withdrawn:.0f}, duplicates allowed {bound} windows")
    assert len(sender.registry) == LINES and fig["lost"] == 0, fig
    # each timeout on the full spool closed the connection before the window was
    # spooled: withdrawn, not spooled once per attempt (768 duplicates without that)
    assert withdrawn >= 3, withdrawn
    assert fig["duplicated"] <= bound * WINDOW, fig
    assert set(sender.acks) == {b"1A" + WINDOW.to_bytes(4, "big")}, sender.acks


@pytest.mark.parametrize("version,more", [(1, 0), (2, 0), (2, 70_000)],
                         ids=["v1", "v2", "v2-read-ahead-full"])
async def test_a_sender_gone_while_its_window_waits_is_withdrawn(tmp_path, version, more):
    """A full spool holds a window (v2: with 2A 0 keep-alives every 0.05 s); the sender
    resets the connection: the window is withdrawn (reason ``withdrawn``; ``io`` when a
    keep-alive hits the reset first, as when the sender had sent more than the 64 KiB the
    input reads ahead), never an internal error, and nothing is held."""
    import json
    import socket as so
    import struct

    from logjam_relay.protocols import lumberjack as lj
    from logjam_relay.protocols import lumberjack_server as ljs
    from relay_harness import running_relay

    lport = free_port()
    async with running_relay(
            tmp_path, inputs=[f"lumberjack://127.0.0.1:{lport}?tls=off&ack_interval=0.05s"
                              "&name=lj"],
            outputs=[f"lumberjack://127.0.0.1:{free_port()}?tls=off"],
            spool_max_bytes="64KiB", spool_segment_bytes="16KiB") as (relay, _):
        inp = relay.inputs[0]
        docs = [json.dumps({"message": "x" * 1000, "i": i}).encode() for i in range(10)]
        window = (ljs.encode_window_v2(docs, level=0) if version == 2 else
                  lj.encode_window(lj.encode_data_frames(
                      [{"line": d.decode()} for d in docs]), 10))
        with trio.fail_after(30):
            while True:             # windows until one waits for the spool
                s = await trio.open_tcp_stream("127.0.0.1", lport)
                await s.send_all(window)
                got = b""
                with trio.move_on_after(0.5):
                    while len(got) < 6:
                        got += await s.receive_some(6)
                if got[:6] in (b"", b"2A\0\0\0\0"):      # v1: nothing; v2: keep-alive
                    break
                await s.aclose()
            assert relay.spool.would_block()
            if more:        # the start of a next window, more than the input reads ahead
                await s.send_all(b"2W\0\0\0\1" + b"2J\0\0\0\1" + struct.pack(">I", 2 * more)
                                 + b"x" * more)
                await trio.sleep(0.3)
            # reset: SO_LINGER 0
            s.socket.setsockopt(so.SOL_SOCKET, so.SO_LINGER, struct.pack("ii", 1, 0))
            await trio.aclose_forcefully(s)
            while inp.active:
                await trio.sleep(0.01)
        errors = dict(inp.errors)
        assert "internal" not in errors, errors
        assert errors.get("withdrawn", 0) + errors.get("io", 0) >= 1, errors
        assert inp.held.used == 0
