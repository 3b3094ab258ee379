"""``block`` policy through a running relay: /readyz names the pause, the blocked-seconds
counter grows while it lasts, and ingest resumes on the acknowledgement that frees space
(not only when a whole segment is deleted)."""

import urllib.error
import urllib.request

import trio

from conftest import free_port
from logjam_relay.io import zmq_trio
from peers.lumberjack_reader import LumberjackReader
from relay_harness import meta, recv, running_relay, send

BODY = b'{"action":"Block#test","n":%d,"pad":"' + b"." * 200 + b'"}'


def get(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(text, name):
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


async def test_block_pause_is_reported_and_ends_on_ack(tmp_path):
    port = free_port()
    url = (f"lumberjack://127.0.0.1:{port}?tls=off&window=20&timeout=5&backoff_min=0.05"
           f"&backoff_max=0.2")
    # one big segment: the old policy resumed only when a whole segment was deleted
    async with running_relay(tmp_path, outputs=[url], spool_dir=str(tmp_path / "sp"),
                             spool_max_bytes=256 * 1024, spool_segment_bytes=64 * 1024,
                             spool_policy="block", batch_size=16,
                             heartbeat_interval=3600) as (relay, cl):
        dealer = cl.dealer()
        accepted = 0
        while True:
            await send(dealer, [b"", b"block-test", b"logs.block", BODY % accepted, meta()])
            with trio.move_on_after(1.0) as waited:
                await zmq_trio.recv_multipart(dealer)
            if waited.cancelled_caught:
                break
            accepted += 1
        port_m = relay.settings.metrics_port
        status, body = await trio.to_thread.run_sync(get, port_m, "/readyz")
        assert status == 503 and "spool full (" in body, body
        t1 = metric((await trio.to_thread.run_sync(get, port_m, "/metrics"))[1],
                    "logjam_relay_spool_blocked_seconds_total")
        await trio.sleep(0.6)
        t2 = metric((await trio.to_thread.run_sync(get, port_m, "/metrics"))[1],
                    "logjam_relay_spool_blocked_seconds_total")
        assert t2 > t1 > 0, (t1, t2)
        segments_before = relay.spool.stats()["deleted_segments"]
        # a receiver that acknowledges one window and then stalls: space freed inside
        # the oldest segment is enough to resume
        windows = []

        async def ack_one_window_then_stall(window):
            windows.append(window)
            if len(windows) > 1:
                await trio.sleep_forever()

        reader = LumberjackReader(port=port, on_window=ack_one_window_then_stall)
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.serve)
            assert await recv(dealer, timeout=20) == [b"block-test", b"202 Accepted"]
            acked = reader.acks_sent
            deleted = relay.spool.stats()["deleted_segments"] - segments_before
            nursery.cancel_scope.cancel()
        # resumed on the one acknowledged window (20 records of a 64 KiB segment), with
        # no segment deleted: the old policy waited for a whole segment
        assert acked == 1 and deleted == 0, (acked, deleted)
        print(f"\nblock: accepted {accepted} before the pause; blocked seconds grew "
              f"{t2 - t1:.2f} in 0.6 s; resumed after {acked} window of 20 events acked, "
              f"segments deleted meanwhile: {deleted}")
