"""A receiver that is simply down is not a receiver that refuses a payload (issue 21, item 6).

Through the real command, for the Courier and the Lumberjack output: payloads/windows are
in flight when the receiver is killed; it stays down (its port refuses connections) for
``OUTAGE`` seconds, then comes back on the same port.  Asserted:

* the connect attempts during the outage (``logjam_relay_output_connect_failures_total``)
  stay within what the exponential backoff allows for the outage's length: the delays are
  ``backoff * 2**k`` (capped at ``backoff_max``) times a jitter of at least
  ``JITTER_MIN``, so at most ``1 + max n with sum(min delay_k, k < n) <= OUTAGE``;
* nothing was split (no "splitting it" log line) and nothing dead-lettered;
* after the receiver is back: every message answered 202 is delivered (0 lost), the
  duplicates stay within what was in flight at the kill (``pending x payload`` events for
  Courier, ``window x pipeline`` for Lumberjack), and SIGTERM exits 0.

Run with ``-s`` for the figures.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
import trio
import zmq

from conftest import free_port
from peers.courier_receiver import CourierReceiver
from peers.lumberjack_reader import LumberjackReader
from relay_harness import relay_settings, start_process, stop_process
from spool_requests import send_requests

BODY = b'{"action":"Outage#test","n":%d,"pad":"........................................"}'
N = 3000
OUTAGE = 12.0
BACKOFF, BACKOFF_MAX = 0.25, 8.0
CO_PAYLOAD, CO_PENDING = 50, 4
LJ_WINDOW, LJ_PIPELINE = 50, 2
# the smallest factor each output's jitter applies to its delay
JITTER_MIN = {"courier": 0.8, "lumberjack": 0.5}
_COURIER_N = re.compile(rb'n\\?"\s*:\s*(\d+)')


def max_attempts(outage: float, backoff: float, backoff_max: float, jitter_min: float) -> int:
    """Most connect attempts exponential backoff allows within ``outage`` seconds: the
    first attempt, then one after each (shortest possible) delay that still fits."""
    n, spent, delay = 1, 0.0, backoff
    while True:
        spent += min(delay, backoff_max) * jitter_min
        if spent > outage:
            return n
        n += 1
        delay *= 2


def metric(port: int, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def output_url(kind: str, port: int, backoff: float, backoff_max: float) -> str:
    if kind == "courier":
        return (f"courier://127.0.0.1:{port}?tls=off&payload={CO_PAYLOAD}&pending={CO_PENDING}"
                f"&backoff={backoff}&backoff_max={backoff_max}&name=out")
    return (f"lumberjack://127.0.0.1:{port}?tls=off&window={LJ_WINDOW}&pipeline={LJ_PIPELINE}"
            f"&timeout=5&backoff_min={backoff}&backoff_max={backoff_max}&name=out")


def delivered(kind: str, peer) -> list[int]:
    if kind == "courier":
        return [int(_COURIER_N.search(ev).group(1)) for ev in peer.events]
    return [json.loads(ev.fields["line"])["n"] for ev in peer.events]


def run_outage(tmp_path, kind: str, *, outage: float = OUTAGE, backoff: float = BACKOFF,
               backoff_max: float = BACKOFF_MAX) -> dict:
    """The scenario; returns its figures (also used to measure with other settings)."""
    port = free_port()
    s = relay_settings(tmp_path, heartbeat_interval=3600)
    log = tmp_path / "relay.log"
    extra = ["--spool-dir", str(tmp_path / "spool"),
             "--output", output_url(kind, port, backoff, backoff_max)]
    fig: dict = {}

    async def slow_sink(nonce, part):
        await trio.sleep(0.01)

    def make_peer():
        if kind == "courier":
            return CourierReceiver(sink=slow_sink)
        return LumberjackReader(port=port, ack_delay=0.03)

    async def serve(peer, task_status=trio.TASK_STATUS_IGNORED):
        with trio.CancelScope() as scope:
            task_status.started(scope)
            if kind == "courier":
                await peer.serve(port)
            else:
                await peer.serve()

    async def main():
        ctx = zmq.Context()
        first, second = make_peer(), make_peer()
        try:
            async with trio.open_nursery() as nursery:
                scope = await nursery.start(serve, first)
                proc = await trio.to_thread.run_sync(
                    lambda: start_process(s, extra, log_path=log))
                accepted = await send_requests(ctx, s, range(N), BODY, b"outage")
                # kill the receiver while it is behind: payloads/windows are in flight
                with trio.fail_after(30):
                    while len(first.events) < N // 10:
                        await trio.sleep(0.005)
                scope.cancel()
                got_first = delivered(kind, first)
                fig["backlog_at_kill"] = len(accepted - set(got_first))
                await trio.sleep(0.5)           # the connection's end reached the output
                c0 = await trio.to_thread.run_sync(
                    metric, s.metrics_port, "logjam_relay_output_connect_failures_total")
                await trio.sleep(outage)
                # stats reach the relay from the worker every 0.5 s
                await trio.sleep(0.6)
                c1 = await trio.to_thread.run_sync(
                    metric, s.metrics_port, "logjam_relay_output_connect_failures_total")
                fig["attempts"] = int(c1 - c0)
                await nursery.start(serve, second)
                with trio.fail_after(60):
                    while not accepted <= set(got_first) | set(delivered(kind, second)):
                        await trio.sleep(0.05)
                fig["dead_letters"] = await trio.to_thread.run_sync(
                    lambda: metric(s.metrics_port, "logjam_relay_dead_letters_total",
                                   reason="refused"))
                fig["rc"] = await trio.to_thread.run_sync(stop_process, proc)
                nursery.cancel_scope.cancel()
        finally:
            ctx.destroy(linger=0)
        got = got_first + delivered(kind, second)
        fig["accepted"] = len(accepted)
        fig["lost"] = len(accepted - set(got))
        fig["duplicates"] = len(got) - len(set(got))
        text = log.read_text()
        fig["splits"] = text.count("splitting it")
        fig["tracebacks"] = text.count("Traceback")
        return fig

    trio.run(main)
    return fig


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["courier", "lumberjack"])
def test_a_receiver_that_is_down_gets_exponential_backoff_and_no_splitting(tmp_path, kind):
    fig = run_outage(tmp_path, kind)
    bound = max_attempts(OUTAGE, BACKOFF, BACKOFF_MAX, JITTER_MIN[kind])
    in_flight = CO_PENDING * CO_PAYLOAD if kind == "courier" else LJ_PIPELINE * LJ_WINDOW
    print(f"\n{kind}: {OUTAGE:.0f} s outage, backoff {BACKOFF}..{BACKOFF_MAX}: "
          f"{fig['attempts']} connect attempts (bound {bound}); splits {fig['splits']}, "
          f"dead letters {fig['dead_letters']:.0f}; accepted {fig['accepted']}, "
          f"backlog at kill {fig['backlog_at_kill']}, lost {fig['lost']}, "
          f"duplicates {fig['duplicates']} (bound {in_flight})")
    assert fig["accepted"] == N
    assert fig["backlog_at_kill"] > 0
    # it retried, exponentially: no more often than the backoff allows
    assert 2 <= fig["attempts"] <= bound, fig
    assert fig["splits"] == 0 and fig["dead_letters"] == 0, fig
    assert fig["lost"] == 0, fig
    assert fig["duplicates"] <= in_flight, fig
    assert fig["rc"] == 0
    assert fig["tracebacks"] == 0
