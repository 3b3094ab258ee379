"""The Lumberjack input's memory through the real command: bombs leave nothing behind, and
what the connections hold stays under ``max_held_bytes`` and the documented ceiling.

The relay runs the documented sized configuration (docs/operations.md, "Memory":
``--max-event-bytes 1MiB -R 4 -S 16 --ingest-max-bytes 4MiB --max-subscriptions 2000``)
with one Lumberjack input, with its default settings or ``max_batch_bytes=16MiB``:

1. a forwarder-like v1 sender sends windows the whole time;
2. two rounds of decompression bombs (61 KB of zlib that inflates to 60 MiB of zeros, in
   one ``1C`` frame of a one-event window; 20 a round with the default 64 MiB batches,
   where each inflates whole, 100 with 16 MiB), each on its own connection, all at once:
   each is closed and counted; the RSS after the second round is the RSS after the
   first (nothing kept per bomb) and near the idle RSS; the sender's windows are acked
   during each round;
3. twice, 40 connections each send 9 of the 10 ``1C`` frames of a ~10 MiB window and
   stall: what they hold reaches ``max_held_bytes``, the connections that would go over
   it are closed (``input_memory``), the rest are cut at the window ``timeout`` (5 s) and
   the input holds nothing again; the second round leaves the RSS where the first did;
4. the sender finishes: every line it counts as acknowledged is in the spool.

The peak RSS (VmHWM) of the relay (no outputs, so no worker processes) must stay under
:func:`logjam_relay.relay.memory.ceiling` for these settings.
"""

from __future__ import annotations

import json
import secrets
import struct
import zlib

import pytest
import trio

from conftest import free_port
from forwarder_sender import ForwarderLikeSender
from logjam_relay.inputs import parse_input
from logjam_relay.inputs.base import HeldBytes
from logjam_relay.protocols import lumberjack as lj
from logjam_relay.protocols import lumberjack_server as ljs
from logjam_relay.relay import memory
from relay_harness import relay_settings, running_relay, start_process, stop_process
from spool_helpers import spooled_records
from test_memory_ceiling import metric, proc_status, scrape

MiB = 1024 * 1024
STALLERS = 40
SIZED = {"max_event_bytes": "1MiB", "rcv_hwm": 4, "snd_hwm": 16,
         "ingest_max_bytes": "4MiB", "max_subscriptions": 2000}
SIZED_ARGS = ["--max-event-bytes", "1MiB", "--rcv-hwm", "4", "--snd-hwm", "16",
              "--ingest-max-bytes", "4MiB", "--max-subscriptions", "2000"]


def _bomb() -> bytes:
    payload = zlib.compress(b"\0" * (60 * MiB), 9)
    return b"1W\0\0\0\1" + b"1C" + struct.pack(">I", len(payload)) + payload


def _stall_window() -> bytes:
    """``1W 10000`` and 9 of its 10 ``1C`` frames (1,000 forwarder-like events of ~1 KB
    each): ~9 MiB of events once inflated, the last frame never comes."""
    out = [b"1W" + struct.pack(">I", 10_000)]
    for k in range(9):
        frames = lj.encode_data_frames(
            [{"file": "/var/log/app.log", "host": "staller", "offset": str(k * 1000 + i),
              "line": f"{k * 1000 + i:06d} " + "s" * 1000} for i in range(1000)],
            first_seq=k * 1000 + 1)
        out.append(lj.encode_compressed_frame(frames, 3))
    return b"".join(out)


# ------------------------------------------------------------------ the core's accounting

def _v1_window(n: int, line: str = "x" * 100, level: int = 3) -> bytes:
    frames = lj.encode_data_frames([{"line": line, "i": str(i)} for i in range(n)])
    return lj.encode_window(frames, n, level=level)


def test_a_window_is_charged_until_given_back_and_a_connection_releases_the_rest():
    held = HeldBytes(64 * MiB)
    c = ljs.ServerConnection(budget=held)
    data = _v1_window(1000) + _v1_window(10, level=0)[:50]     # and a partial window
    c.receive_data(data)
    w = c.next_event()
    assert isinstance(w, ljs.WindowReceived) and w.count == 1000
    assert c.next_event() is ljs.NEED_DATA
    # the window's events (twice their frame bytes, plus per event and per pair) and the
    # read buffer (the start of the next window: no event of it complete yet)
    assert w.charged >= ljs.event_cost(w.nbytes - 6) + 1000 * ljs.EVENT_COST
    assert held.used == w.charged + len(data)
    held.give(w.charged)
    c.release()
    assert held.used == 0 and held.peak > 0


def test_a_protocol_error_gives_everything_back_at_once():
    held = HeldBytes(64 * MiB)
    c = ljs.ServerConnection(budget=held)
    frames = lj.encode_data_frames([{"line": "x" * 100}] * 100)
    c.receive_data(b"1W" + struct.pack(">I", 101) + frames + b"1W\0\0\0\1")   # W in W
    with pytest.raises(lj.LumberjackError) as ei:
        c.next_event()
    assert ei.value.reason == "unexpected_window" and held.used == 0
    assert held.peak > 100 * ljs.EVENT_COST          # its 100 events had been charged
    with pytest.raises(lj.LumberjackError):       # and stays failed
        c.next_event()


@pytest.mark.parametrize("what", ["events", "inflate", "buffer"])
def test_over_the_budget_is_input_memory_and_nothing_stays_held(what):
    held = HeldBytes(4 * MiB)
    other = 3 * MiB if what != "buffer" else 4 * MiB - 1000
    assert held.take(other)                 # what the input's other connections hold
    c = ljs.ServerConnection(budget=held)
    with pytest.raises(lj.LumberjackError) as ei:
        if what == "events":                # 10,000 events: ~7 MiB charged
            c.receive_data(_v1_window(10_000, level=0))
        elif what == "inflate":             # a bomb: inflated no further than what is left
            c.receive_data(b"1W\0\0\0\1" + lj.encode_compressed_frame(b"\0" * (8 * MiB), 9))
        else:                               # raw bytes beyond what is left
            c.receive_data(b"1W\0\0\0\1" + b"1D" + b"\0" * 2000)
        c.next_event()
    assert ei.value.reason == "input_memory"
    assert held.used == other
    assert held.peak <= held.limit


def test_max_held_bytes_default_and_minimum():
    spec = parse_input("lumberjack://127.0.0.1:1?tls=off")
    assert spec.max_held_bytes == 256 * MiB
    assert parse_input("lumberjack://127.0.0.1:1?tls=off&max_batch_bytes=128MiB"
                       ).max_held_bytes == 512 * MiB
    with pytest.raises(ValueError, match="max_held_bytes must be >= "):
        parse_input("lumberjack://127.0.0.1:1?tls=off&max_held_bytes=100MiB")


async def test_courier_payload_over_max_held_bytes_is_refused_and_held_comes_back(tmp_path):
    """A Courier payload of 75,000 tiny events (1 MiB inflated, ~40 MiB as decoded events
    and mapped messages) on an input with max_held_bytes=8MiB: the connection is closed
    (input_memory) before the payload is mapped; a small payload afterwards is acked and
    the input holds nothing once it is done."""
    from logjam_relay.protocols import courier as P
    cport = free_port()
    async with running_relay(
            tmp_path, inputs=[f"courier://127.0.0.1:{cport}?tls=off&name=cr"
                              "&max_batch_bytes=1MiB&max_held_bytes=8MiB"]) as (relay, _):
        inp = relay.inputs[0]

        async def send(events) -> bytes:
            s = await trio.open_tcp_stream("127.0.0.1", cport)
            got = b""
            try:
                await s.send_all(P.encode_hello(P.Helo()) +
                                 P.encode_payload(b"n" * 16, events))
                with trio.fail_after(10):
                    while b"ACKN" not in got:
                        chunk = await s.receive_some(65536)
                        if not chunk:
                            break
                        got += chunk
            except trio.BrokenResourceError:
                pass
            finally:
                await s.aclose()
            return got

        assert b"ACKN" not in await send([b"{}" * 4] * 75_000)
        assert inp.errors["input_memory"] == 1
        assert b"ACKN" in await send([b'{"message":"ok"}'] * 10)
        with trio.fail_after(5):
            while inp.active:
                await trio.sleep(0.01)
        assert inp.held.used == 0 and 0 < inp.held.peak <= inp.held.limit


# ------------------------------------------------------------------ the real command

async def _send_and_wait_close(port: int, data: bytes, results: list) -> None:
    """Send ``data`` on a new connection; wait until the relay closes it."""
    s = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        try:
            await s.send_all(data)
            with trio.fail_after(600):              # a hang, not a speed limit
                while await s.receive_some(65536):
                    pass
        except trio.BrokenResourceError:
            pass
        results.append("closed")
    finally:
        await trio.aclose_forcefully(s)


@pytest.mark.slow
@pytest.mark.parametrize("params,bombs", [("", 20),
                                          ("&max_batch_bytes=16MiB&max_held_bytes=64MiB", 100)],
                         ids=["default", "16MiB"])
async def test_bombs_and_held_windows_stay_under_the_ceiling(tmp_path, params, bombs):
    lport = free_port()
    url = f"lumberjack://127.0.0.1:{lport}?tls=off&timeout=5s&name=lj{params}"
    settings = relay_settings(tmp_path, inputs=[url], **SIZED)
    spool = tmp_path / "spool"
    proc = await trio.to_thread.run_sync(
        lambda: start_process(settings, [*SIZED_ARGS, "--input", url, "--spool-dir",
                                         str(spool)], log_path=tmp_path / "relay.log"))
    pid = proc.pid

    async def metrics() -> str:
        return await trio.to_thread.run_sync(scrape, settings.metrics_port)

    sender = ForwarderLikeSender(lport, [f"G{i:06d} {secrets.token_hex(40)}"
                                         for i in range(400 * 64)], window=64, timeout=30)
    figures = {}
    try:
        await trio.sleep(0.5)
        idle = proc_status(pid)["VmRSS"]
        ceiling = memory.ceiling(settings, baseline=idle, input_peers=0)
        bomb = _bomb()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.run)
            with trio.fail_after(30):
                while not sender.registry:      # the sender is connected and acked
                    await trio.sleep(0.05)
            # ---- 2. bombs, all at once, twice
            after_round = []
            acked_during = []
            for _ in range(2):
                before = len(sender.registry)
                closed: list[str] = []
                async with trio.open_nursery() as round_:
                    for _ in range(bombs):
                        round_.start_soon(_send_and_wait_close, lport, bomb, closed)
                acked_during.append(len(sender.registry) - before)
                assert closed == ["closed"] * bombs
                after_round.append(proc_status(pid)["VmRSS"])
            text = await metrics()
            bomb_errors = (metric(text, "logjam_relay_input_errors_total", input="lj",
                                  reason="inflate_too_large")
                           + metric(text, "logjam_relay_input_errors_total", input="lj",
                                    reason="bad_version"))
            # ---- 3. windows that stall with most of their events in, twice
            stall = _stall_window()
            after_stall = []
            for _ in range(2):
                closed = []
                async with trio.open_nursery() as stallers:
                    for _ in range(STALLERS):
                        stallers.start_soon(_send_and_wait_close, lport, stall, closed)
                after_stall.append(proc_status(pid)["VmRSS"])
            text = await metrics()
            refused = metric(text, "logjam_relay_input_errors_total", input="lj",
                             reason="input_memory")
            cut = metric(text, "logjam_relay_input_errors_total", input="lj",
                         reason="timeout")
            # ---- 4. the sender finishes and closes its connection
            with trio.fail_after(600):              # a hang, not a speed limit
                while not sender.done:
                    await trio.sleep(0.2)
                while metric(text := await metrics(), "logjam_relay_input_active_connections",
                             input="lj"):
                    await trio.sleep(0.2)
            held_after = metric(text, "logjam_relay_input_held_bytes", input="lj")
            after_all = proc_status(pid)["VmRSS"]
        peak = proc_status(pid)["VmHWM"]
        figures = {
            "idle": idle / MiB, "after bomb rounds": [r / MiB for r in after_round],
            "after staller rounds": [r / MiB for r in after_stall],
            "after all": after_all / MiB,
            "peak": peak / MiB,
            "ceiling": ceiling.total / MiB, "inputs term": ceiling.inputs / MiB,
            "bombs counted": bomb_errors, "stallers refused (input_memory)": refused,
            "stallers cut (timeout)": cut, "held after": held_after,
            "sender windows acked during the rounds": [n // 64 for n in acked_during]}
        assert stop_process(proc, timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"\ninput memory ({params or 'default'}): "
          + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}"
                      for k, v in figures.items()) + f"; {ceiling.describe()}")
    spooled = {json.loads(frames[2]).get("line") for frames in spooled_records([spool])
               if frames[0] != b"heartbeat"}
    lost = [line for line in sender.registry if line not in spooled]
    assert peak < ceiling.total, figures
    assert bomb_errors == 2 * bombs, figures
    assert all(n > 0 for n in acked_during), figures
    # nothing kept per bomb (a bomb inflates 16 or 60 MiB): the second round ends where
    # the first did, near idle
    assert after_round[1] - after_round[0] < 32 * MiB, figures
    assert after_round[1] - idle < 32 * MiB, figures
    # the stallers filled the budget, were refused over it, and gave everything back;
    # Python keeps an arena of small objects until it is empty, so some of the second
    # round's memory stays mapped, reused by the next (no growth)
    assert refused >= 2 and refused + cut == 2 * STALLERS, figures
    assert held_after == 0, figures
    assert after_stall[1] - after_stall[0] < 32 * MiB, figures
    assert after_all - idle < 64 * MiB, figures
    assert sender.done and not lost, lost[:5]
