"""A full disk never deadlocks (issue 11), through the real command on a small tmpfs.

The spool lives on a 4 MiB tmpfs, far below its ``max_bytes``; the Lumberjack receiver
is down, so the disk fills.  For each policy, with the default 64 MiB segments and with
small ones: ``block`` pauses ingress (``/readyz`` 503 naming ENOSPC, the blocked-seconds
counter grows while it lasts, the error is ENOSPC and never EIO) and resumes within
seconds once the receiver drains the spool; ``drop_oldest`` drops the oldest records
and counts them.  Afterwards new requests are all delivered.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request

import pytest
import trio
import zmq

from conftest import free_port
from logjam_relay.io import zmq_trio
from peers.lumberjack_reader import LumberjackReader
from relay_harness import meta, relay_settings, start_process, stop_process

BODY = b'{"action":"Disk#test","n":%d,"pad":"' + b"x" * 900 + b'"}'
DISK = "4m"
WINDOW = 200


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]     # CI may run as a sudoer
    opts = f"size={DISK},uid={os.getuid()},gid={os.getgid()}"
    r = subprocess.run(sudo + ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        why = f"cannot mount a tmpfs here: {r.stderr.decode().strip()}"
        if os.environ.get("CI"):        # CI has root or sudo: a skip would hide the case
            pytest.fail(f"{why}; CI is set")
        pytest.skip(why)
    try:
        yield mnt
    finally:
        subprocess.run(sudo + ["umount", "-l", str(mnt)], check=False)


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def numbers(reader) -> list[int]:
    return [json.loads(ev.fields["line"])["n"] for ev in reader.events]


@pytest.mark.parametrize("segments", ["default", "small"])
@pytest.mark.parametrize("policy", ["block", "drop_oldest"])
def test_full_disk_never_deadlocks(tmp_path, small_disk, policy, segments):
    port = free_port()
    spool_dir = str(small_disk / "spool")
    s = relay_settings(tmp_path, heartbeat_interval=3600)
    extra = ["--spool-dir", spool_dir, "--spool-policy", policy,
             "--spool-max-bytes", "1GiB",
             "--output", f"lumberjack://127.0.0.1:{port}?tls=off&window={WINDOW}&timeout=5"
                         f"&backoff_min=0.05&backoff_max=0.2&name=lj"]
    if segments == "small":
        extra += ["--spool-segment-bytes", "256KiB"]
    log = tmp_path / "relay.log"
    fig = {}

    async def main():
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        proc = await trio.to_thread.run_sync(lambda: start_process(s, extra, log_path=log))
        dealer.connect(f"tcp://127.0.0.1:{s.router_port}")
        accepted: set[int] = set()
        sent = 0
        outstanding = 0
        try:
            # phase 1: receiver down; fill the disk (8 MiB of requests for a 4 MiB disk)
            stalled = False
            while sent < 8000 and not stalled:
                for n in range(sent, sent + 100):
                    await zmq_trio.send_multipart(
                        dealer, [b"", b"disk-test", b"logs.disk", BODY % n, meta()])
                outstanding += 100
                for n in range(sent, sent + 100):
                    with trio.move_on_after(3.0) as t:
                        r = await zmq_trio.recv_multipart(dealer)
                        outstanding -= 1
                        if r[-1] == b"202 Accepted":
                            accepted.add(n)
                    if t.cancelled_caught:
                        stalled = True
                        break
                sent += 100
            fig["sent_phase1"] = sent
            fig["accepted_phase1"] = len(accepted)
            if policy == "block":
                assert stalled, "the disk never filled"
                status, body = await trio.to_thread.run_sync(http_get, s.metrics_port,
                                                             "/readyz")
                assert status == 503 and "disk full (ENOSPC)" in body, (status, body)
                fig["readyz"] = body.strip().splitlines()[-1]
                text = (await trio.to_thread.run_sync(http_get, s.metrics_port, "/metrics"))[1]
                m1 = metric(text, "logjam_relay_spool_blocked_seconds_total")
                await trio.sleep(1.2)
                text = (await trio.to_thread.run_sync(http_get, s.metrics_port, "/metrics"))[1]
                m2 = metric(text, "logjam_relay_spool_blocked_seconds_total")
                assert m2 > m1, "blocked seconds must grow while the block lasts"
                assert metric(text, "logjam_relay_spool_paused") == 1
                fig["blocked_seconds_growth"] = round(m2 - m1, 2)
            else:
                assert not stalled, "drop_oldest must keep answering on a full disk"
                assert len(accepted) == sent
            # phase 2: the receiver drains; the outstanding requests are answered
            reader = LumberjackReader(port=port)
            async with trio.open_nursery() as nursery:
                await nursery.start(reader.serve)
                t0 = trio.current_time()
                with trio.fail_after(30):       # a deadlock fails here, not a speed claim
                    # the requests left waiting: their replies arrive in order
                    base = len(accepted) if policy == "block" else sent
                    k = 0
                    while outstanding:
                        r = await zmq_trio.recv_multipart(dealer)
                        outstanding -= 1
                        if r[-1] == b"202 Accepted":
                            accepted.add(base + k)
                        k += 1
                fig["resumed_after_s"] = round(trio.current_time() - t0, 2)
                status, _ = await trio.to_thread.run_sync(http_get, s.metrics_port, "/readyz")
                # new requests, all answered and delivered
                new = set(range(100_000, 100_500))
                with trio.fail_after(30):
                    for n in sorted(new):
                        await zmq_trio.send_multipart(
                            dealer, [b"", b"disk-test", b"logs.disk", BODY % n, meta()])
                        r = await zmq_trio.recv_multipart(dealer)
                        assert r[-1] == b"202 Accepted"
                    accepted |= new
                    while not new <= set(numbers(reader)):
                        await trio.sleep(0.05)
                    while True:
                        text = (await trio.to_thread.run_sync(http_get, s.metrics_port,
                                                              "/metrics"))[1]
                        if metric(text, "logjam_relay_output_backlog_records") == 0:
                            break
                        await trio.sleep(0.1)
                status, _ = await trio.to_thread.run_sync(http_get, s.metrics_port, "/readyz")
                assert status == 200
                assert await trio.to_thread.run_sync(stop_process, proc) == 0
                nursery.cancel_scope.cancel()
            return accepted, reader, text
        finally:
            dealer.close()
            ctx.destroy(linger=0)
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    accepted, reader, text = trio.run(main)
    got = set(numbers(reader))
    missing = accepted - got
    lost = int(metric(text, "logjam_relay_spool_lost_records_total"))
    logtext = log.read_text()
    print(f"\n{policy}/{segments} segments on a {DISK} tmpfs: {fig}; accepted "
          f"{len(accepted)}, delivered {len(got & accepted)}, missing {len(missing)}, "
          f"lost counter {lost}")
    assert "errno 28" in logtext and "errno 5)" not in logtext    # ENOSPC, never EIO
    assert "Traceback" not in logtext
    # every missing record is counted, and nothing else: records a worker process had
    # read from a segment the relay then dropped count only if they are never
    # acknowledged (test_loss_accounting.py measures it under sustained drops)
    assert lost == len(missing), (lost, len(missing))
    if policy == "block":
        assert not missing and lost == 0
    else:
        # drop_oldest loses only the oldest, and counts every record it dropped; what the
        # output had read before its segment was dropped (at most window x (pipeline + 8)
        # records, README) may still be delivered, at the start of the lost span or inside
        # it (seen once: 0-4319 and 4523-4722 lost, 4320-4522 delivered)
        run = sorted(missing)
        inside = set(range(run[0], run[-1] + 1)) - missing
        assert lost > 0 and len(inside) <= WINDOW * (4 + 8), (len(inside), run[:3], run[-3:])
        assert max(run) < max(got & set(range(100_000)))
