"""Durable cursors through the real command: five SIGKILLs of the relay while a Lumberjack
and a Courier output drain into receivers that acknowledge at once.  Asserted: no accepted
message lost, and the duplicates after each crash within the documented bound (README,
docs/operations.md): what the output had in flight plus the 8 windows/payloads whose
acknowledgement may not have reached the cursor log yet -- ``window x (pipeline + 8)``
events for Lumberjack, ``payload x (pending + 8)`` for Courier.  The outputs run in worker
processes; a worker reads on only while at most 8 of its acks are unconfirmed by the relay
(outputs/ackgate.py), so the bound holds however late the relay's loop reads the acks.
Two of the kills come after the relay was stopped (SIGSTOP) for half a second while its
workers and the receivers ran on: a relay loop that lags without limit, what a loaded
machine approaches; there the bound is reached exactly.  Run with ``-s`` for the
figures."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time

import pytest
import trio
import zmq

from conftest import free_port
from logjam_relay.outputs.ackgate import UNCONFIRMED_ACKS
from peers.courier_receiver import CourierReceiver
from peers.lumberjack_reader import LumberjackReader
from relay_harness import relay_settings, start_process, stop_process
from spool_requests import send_requests as _send_requests

BODY = b'{"action":"Crash#test","n":%d,"pad":"....................................."}'
LJ_WINDOW, LJ_PIPELINE = 100, 2
CO_PAYLOAD, CO_PENDING = 50, 4
UNCONFIRMED = 8         # the documented figure (README, docs/operations.md)
ROUNDS = 5
PER_ROUND = 2500
WARM = 100              # of each round: sent first, delivered before the workers wait
STALLED = (1, 3)        # rounds whose kill comes after the relay was stopped for STALL s
STALL = 0.5
_COURIER_N = re.compile(rb'n\\?"\s*:\s*(\d+)')


async def send_requests(ctx, settings, numbers) -> set[int]:
    return await _send_requests(ctx, settings, numbers, BODY, b'crash')


def lj_numbers(reader) -> list[int]:
    return [json.loads(ev.fields["line"])["n"] for ev in reader.events]


def output_workers(proc) -> list[int]:
    """The pids of the relay's two output worker processes (it starts them as it starts)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        kids = []
        for task in os.listdir(f"/proc/{proc.pid}/task"):
            with open(f"/proc/{proc.pid}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
        workers = []
        for pid in kids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"logjam_relay.outputs.worker" in f.read():
                        workers.append(pid)
            except FileNotFoundError:
                pass
        if len(workers) == 2:
            return workers
        time.sleep(0.05)
    raise AssertionError("the relay did not start its two output workers")


def co_numbers(rcv) -> list[int]:
    out = []
    for ev in rcv.events:
        m = _COURIER_N.search(ev)
        out.append(int(m.group(1)))
    return out


@pytest.mark.slow
def test_five_sigkills_lose_nothing_and_duplicate_at_most_in_flight(tmp_path):
    lj_port, co_port = free_port(), free_port()
    spool_dir = str(tmp_path / "spool")
    s = relay_settings(tmp_path, heartbeat_interval=3600)
    extra = ["--spool-dir", spool_dir,
             "--output", f"lumberjack://127.0.0.1:{lj_port}?tls=off&window={LJ_WINDOW}"
                         f"&pipeline={LJ_PIPELINE}&timeout=5&backoff_min=0.05&backoff_max=0.2"
                         f"&name=lj",
             "--output", f"courier://127.0.0.1:{co_port}?tls=off&payload={CO_PAYLOAD}"
                         f"&pending={CO_PENDING}&backoff=0.05&backoff_max=0.2&name=co"]
    log = tmp_path / "relay.log"
    # in flight: the windows/payloads sent and not yet acknowledged, plus (the outputs run
    # in worker processes, output_isolation=process) the acknowledgements a worker may
    # have unconfirmed by the relay when it reads on (outputs/ackgate.py)
    assert UNCONFIRMED_ACKS == UNCONFIRMED
    bounds = {"lj": LJ_WINDOW * (LJ_PIPELINE + UNCONFIRMED),
              "co": CO_PAYLOAD * (CO_PENDING + UNCONFIRMED)}
    figures = []

    async def main():
        ctx = zmq.Context()
        # receivers that acknowledge at once: the bound must not depend on their pace
        lj = LumberjackReader(port=lj_port)
        co = CourierReceiver()
        accepted: set[int] = set()
        stopped: list[int] = []             # worker pids held with SIGSTOP
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(lj.serve)
                await nursery.start(co.serve, co_port)
                n = 0
                for rnd in range(ROUNDS + 1):
                    proc = await trio.to_thread.run_sync(
                        lambda: start_process(s, extra, log_path=log))
                    if rnd == ROUNDS:
                        break
                    # both outputs connected and drained (what the last crash left too),
                    # then their workers wait while the rest of the round is spooled: both
                    # have a backlog of it when they go on together, and drain at the kill
                    accepted |= await send_requests(ctx, s, range(n, n + WARM))
                    with trio.fail_after(60):
                        while not (accepted <= set(lj_numbers(lj))
                                   and accepted <= set(co_numbers(co))):
                            await trio.sleep(0.01)
                    workers = await trio.to_thread.run_sync(output_workers, proc)
                    for w in workers:
                        os.kill(w, signal.SIGSTOP)
                        stopped.append(w)
                    before = (len(lj.events), len(co.events))
                    accepted |= await send_requests(ctx, s, range(n + WARM, n + PER_ROUND))
                    n += PER_ROUND
                    while stopped:
                        os.kill(stopped.pop(), signal.SIGCONT)
                    stall = rnd in STALLED
                    # kill while both outputs drain: each has delivered something since
                    # this relay started and has more to deliver.  A stalled round stops
                    # the relay as soon as either output delivers (the other one's worker
                    # runs on while it is stopped): waiting for both let the first drain
                    # its whole backlog before the stop on a loaded machine
                    with trio.fail_after(30):
                        while (len(lj.events) <= before[0] and len(co.events) <= before[1]) \
                                if stall else \
                                (len(lj.events) <= before[0] or len(co.events) <= before[1]):
                            await trio.sleep(0)
                    at_stop = (len(lj.events), len(co.events))
                    if stall:
                        # the relay's loop stops (it reads no acks, confirms none) while
                        # its workers and the receivers run on
                        os.kill(proc.pid, signal.SIGSTOP)
                        at_stop = (len(lj.events), len(co.events))
                        await trio.sleep(STALL)
                    else:
                        # kill at a varied point of the drain, and while both outputs still
                        # have a backlog: a point counted in events, polled at every turn
                        # of this loop (which also runs the receivers), not a sleep, which
                        # a fast or a loaded machine can outlast
                        target = (rnd % 3) * 300
                        left = PER_ROUND - WARM - 2 * LJ_WINDOW
                        with trio.fail_after(30):
                            while True:
                                done = (len(lj.events) - before[0], len(co.events) - before[1])
                                if min(done) >= target or max(done) >= left:
                                    break
                                await trio.sleep(0)
                    backlog = {"lj": len(accepted - set(lj_numbers(lj))),
                               "co": len(accepted - set(co_numbers(co)))}
                    os.kill(proc.pid, signal.SIGKILL)
                    await trio.to_thread.run_sync(proc.wait)
                    got = {"lj": lj_numbers(lj), "co": co_numbers(co)}
                    figures.append({"backlog_at_kill": backlog, "stalled": stall,
                                    "while_stopped": {"lj": len(got["lj"]) - at_stop[0],
                                                      "co": len(got["co"]) - at_stop[1]},
                                    "len": {k: len(v) for k, v in got.items()},
                                    "seen": {k: set(v) for k, v in got.items()}})
                with trio.fail_after(60):
                    while not (accepted <= set(lj_numbers(lj))
                               and accepted <= set(co_numbers(co))):
                        await trio.sleep(0.05)
                assert await trio.to_thread.run_sync(stop_process, proc) == 0
                nursery.cancel_scope.cancel()
        finally:
            for w in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w, signal.SIGCONT)
            ctx.destroy(linger=0)
        return accepted, lj_numbers(lj), co_numbers(co)

    accepted, lj_all, co_all = trio.run(main)
    # duplicates attributable to crash k: deliveries after crash k of events that had
    # already been delivered before it
    rows = []
    for k, fig in enumerate(figures):
        row = {}
        for out, got in (("lj", lj_all), ("co", co_all)):
            hi = figures[k + 1]["len"][out] if k + 1 < len(figures) else len(got)
            after = got[fig["len"][out]:hi]     # deliveries from crash k to the next one
            row[out] = sum(1 for x in after if x in fig["seen"][out])
        rows.append(row)
        stopped = (f" (relay stopped {STALL} s first; delivered meanwhile: lj "
                   f"{fig['while_stopped']['lj']}, co {fig['while_stopped']['co']})"
                   if fig["stalled"] else "")
        print(f"\ncrash {k + 1}{stopped}: "
              f"backlog at kill lj {fig['backlog_at_kill']['lj']}, "
              f"co {fig['backlog_at_kill']['co']}; duplicates after restart: "
              f"lj {row['lj']} (bound {bounds['lj']}), co {row['co']} (bound {bounds['co']})")
    lost_lj = accepted - set(lj_all)
    lost_co = accepted - set(co_all)
    print(f"accepted {len(accepted)}; lost: lj {len(lost_lj)}, co {len(lost_co)}; "
          f"duplicates total: lj {len(lj_all) - len(set(lj_all))}, "
          f"co {len(co_all) - len(set(co_all))}")
    assert not lost_lj and not lost_co
    assert len(accepted) == ROUNDS * PER_ROUND
    for row in rows:
        assert row["lj"] <= bounds["lj"] and row["co"] <= bounds["co"], rows
    # every kill hit both outputs mid-drain (otherwise a crash would prove nothing)
    assert all(f["backlog_at_kill"]["lj"] > 0 and f["backlog_at_kill"]["co"] > 0
               for f in figures), [f["backlog_at_kill"] for f in figures]
    assert "Traceback" not in log.read_text()

