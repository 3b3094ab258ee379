"""Power loss through the real command (issue 21, item 4): the spool on a FUSE file
system that keeps unsynced writes apart and drops them on a crash (``powerloss_fs.py``,
like LazyFS).  ROUTER load (the numbers answered 202 are recorded), the receiver up,
SIGKILL mid-load, every unsynced write dropped, restart, drain.  Then:

* ``spool_fsync = batch``: every message answered 202 reached the receiver;
* every mode: the loss the restarted relay reports (its log line and the lost counter)
  equals the real loss: the records it had spooled that the receiver never got.

The receiver's copy is what counts: a record delivered before the crash whose spool
copy was not synced is not lost.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request

import pytest
import trio
import zmq

from conftest import free_port
from logjam_relay.io import zmq_trio
from logjam_relay.spool import segment as fmt
from peers.lumberjack_reader import LumberjackReader
from powerloss_fs import Mount
from relay_harness import meta, relay_settings, start_process, stop_process

BODY = b'{"n":%d,"action":"Power#loss","pad":"' + b"z" * 300 + b'"}'
STEP = 200


def _unavailable(why: str):
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI is set (.ci/run installs fuse3 and mfusepy)")
    pytest.skip(why)


@pytest.fixture(params=["strict", "immediate"])
def powerloss_mount(request, tmp_path):
    if not os.path.exists("/dev/fuse"):
        _unavailable("/dev/fuse is missing")
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        _unavailable(f"mfusepy/libfuse3 not usable: {e}")
    m = Mount(tmp_path / "mnt", tmp_path / "fs.sock", dirs=request.param)
    try:
        m.start(tmp_path / "fs.log")
    except RuntimeError as e:
        _unavailable(str(e))
    try:
        yield m
    finally:
        m.stop()


def _sync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


class Received:
    def __init__(self):
        self.seen: set[int] = set()
        self.events = 0

    def on_window(self, window) -> None:
        for ev in window.events:
            line = ev.fields["line"]
            self.seen.add(int(line[5:line.index(",")]))
        self.events += len(window.events)


def on_disk(spool: str) -> set[int]:
    """The request numbers in the spool's segment files (what survived the crash)."""
    out: set[int] = set()
    for name in os.listdir(spool):
        if fmt.parse_segment_name(name) is None:
            continue
        try:
            for _off, _kind, frames in fmt.iter_records(os.path.join(spool, name),
                                                        allow_torn_tail=True):
                body = bytes(frames[2]) if len(frames) == 4 else b""
                if body.startswith(b'{"n":'):
                    out.add(int(body[5:body.index(b",")]))
        except (fmt.SegmentError, OSError):
            continue                        # the rest of that file is not readable
    return out


def run_powerloss(tmp_path, mount: Mount, fsync: str, load_s: float = 4.0) -> dict:
    spool = os.path.join(mount.mountpoint, "spool")
    # the spool directory was made long before (an operator's mkdir, synced)
    os.makedirs(os.path.join(spool, "cursors"))
    for d in (mount.mountpoint, spool, os.path.join(spool, "cursors")):
        _sync_dir(d)
    port = free_port()
    s = relay_settings(tmp_path, heartbeat_interval=3600)
    extra = ["--spool-dir", spool, "--spool-fsync", fsync, "--spool-segment-bytes", "256KiB",
             "--output", f"lumberjack://127.0.0.1:{port}?tls=off&timeout=10"
                         f"&backoff_min=0.05&backoff_max=0.5&name=lj"]
    log = tmp_path / "relay.log"
    got = Received()
    fig: dict = {"fsync": fsync, "dirs": mount.dirs}
    accepted: set[int] = set()
    disk: set[int] = set()

    async def load(dealer, stop: trio.Event):
        n = 0
        while not stop.is_set():
            for k in range(n, n + STEP):
                await zmq_trio.send_multipart(dealer, [b"", b"power-test", b"logs.power",
                                                       BODY % k, meta()])
            for k in range(n, n + STEP):          # replies come back in request order
                r = await zmq_trio.recv_multipart(dealer)
                if r[-1] == b"202 Accepted":
                    accepted.add(k)
            n += STEP
        fig["sent"] = n

    async def main():
        ctx = zmq.Context()
        reader = LumberjackReader(port=port, keep_windows=False, on_window=got.on_window)
        proc = None
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(reader.serve)
                proc = await trio.to_thread.run_sync(
                    lambda: start_process(s, extra, log_path=log))
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(f"tcp://127.0.0.1:{s.router_port}")
                stop = trio.Event()
                with trio.move_on_after(load_s + 30) as load_scope:
                    async with trio.open_nursery() as inner:
                        inner.start_soon(load, dealer, stop)
                        await trio.sleep(load_s)
                        # power loss: the relay dies mid-load ...
                        proc.send_signal(signal.SIGKILL)
                        await trio.to_thread.run_sync(proc.wait)
                        await trio.sleep(0.5)      # replies already on their way
                        inner.cancel_scope.cancel()
                assert not load_scope.cancelled_caught
                dealer.close()
                fig["accepted"] = len(accepted)
                fig["received_before"] = len(got.seen)
                # ... its output workers see the end of their socket and exit; then
                # everything not synced is gone
                deadline = time.monotonic() + 20
                while (st := mount.stats())["open"]:
                    assert time.monotonic() < deadline, f"files still open: {st}"
                    await trio.sleep(0.05)
                fig["unsynced_bytes"] = st["unsynced_bytes"]
                crash = mount.crash()
                fig["lost_bytes"] = crash["lost_bytes"]
                fig["lost_files"] = len(crash["lost_files"])
                disk.update(on_disk(spool))
                before = log.read_text()
                proc = await trio.to_thread.run_sync(
                    lambda: start_process(s, extra, log_path=log))
                with trio.fail_after(120):         # a hang fails here, not a speed claim
                    while True:
                        text = await trio.to_thread.run_sync(scrape, s.metrics_port)
                        if metric(text, "logjam_relay_output_backlog_records") == 0:
                            break
                        await trio.sleep(0.1)
                fig["appended_after"] = int(metric(
                    text, "logjam_relay_spool_appended_records_total"))
                fig["lost_counter"] = int(metric(text, "logjam_relay_spool_lost_records_total"))
                assert await trio.to_thread.run_sync(stop_process, proc) == 0
                nursery.cancel_scope.cancel()
            after = log.read_text()[len(before):]
            fig["restart_log"] = [ln for ln in after.splitlines()
                                  if "lost" in ln or "not on disk" in ln or "cut" in ln]
        finally:
            ctx.destroy(linger=0)
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()

    trio.run(main)
    fig["received"] = len(got.seen)
    fig["duplicates"] = got.events - len(got.seen)
    lost = accepted - got.seen
    fig["missing_202"] = len(lost)
    # what the restarted relay can know is lost: records older than one that survived
    # (a hole); records newer than everything on disk and never delivered left no
    # trace (appended after the last sync): nothing on disk tells they existed
    newest = max(disk, default=-1)
    fig["on_disk"] = len(disk)
    fig["lost_holes"] = len({n for n in lost if n < newest})
    fig["lost_untraceable"] = len({n for n in lost if n > newest})
    m = [re.search(r"lost (\d+) records that are not on disk", ln)
         for ln in fig["restart_log"]]
    fig["lost_logged"] = sum(int(x.group(1)) for x in m if x)
    return fig


@pytest.mark.slow
@pytest.mark.parametrize("fsync", ["batch", "interval", "never"])
def test_power_loss_loses_nothing_answered_under_batch_and_reports_the_truth(
        tmp_path, powerloss_mount, fsync):
    fig = run_powerloss(tmp_path, powerloss_mount, fsync)
    print(f"\npower loss, spool_fsync={fsync}, directories {powerloss_mount.dirs}: {fig}")
    if fsync == "batch":
        assert fig["missing_202"] == 0, fig          # every 202 was synced first
    # the report names exactly the records that are gone and were never delivered, as
    # far as anything on disk shows they existed; a record delivered before the crash
    # is not lost, even if its spool copy is gone
    assert fig["lost_counter"] == fig["lost_logged"] == fig["lost_holes"], fig


def test_the_model_keeps_exactly_what_was_synced(powerloss_mount):
    """The file system's durability model (powerloss_fs.py): file data and size are
    durable up to the file's last fsync/fdatasync; directory entries, with ``strict``,
    once their directory is fsynced (an fsync of the file is not enough), with
    ``immediate`` at once.  A crash drops everything else."""
    m = powerloss_mount
    strict = m.dirs == "strict"
    root = m.mountpoint
    d = os.path.join(root, "d")
    os.mkdir(d)
    _sync_dir(root)
    old = os.path.join(d, "old")
    with open(old, "wb") as f:
        f.write(b"kept")
        f.flush()
        os.fsync(f.fileno())
    gone = os.path.join(d, "gone")
    with open(gone, "wb") as f:
        f.write(b"synced, then unlinked")
        f.flush()
        os.fsync(f.fileno())
    _sync_dir(d)
    fd = os.open(old, os.O_WRONLY | os.O_APPEND)
    os.write(fd, b" and synced")
    os.fdatasync(fd)
    os.write(fd, b" but not this")                 # never synced
    os.ftruncate(fd, 2)                            # nor this
    os.close(fd)
    new = os.path.join(d, "new")
    with open(new, "wb") as f:                      # its data synced, its entry not
        f.write(b"fresh")
        f.flush()
        os.fsync(f.fileno())
    os.rename(old, os.path.join(d, "renamed"))     # not synced in the directory
    os.unlink(gone)
    assert sorted(os.listdir(d)) == ["new", "renamed"]
    res = m.crash()
    names = sorted(os.listdir(d))
    if strict:
        assert names == ["gone", "old"], names
        assert open(old, "rb").read() == b"kept and synced"
        assert open(gone, "rb").read() == b"synced, then unlinked"
        assert sorted(res["lost_files"]) == ["/d/new", "/d/renamed"]
    else:
        assert names == ["new", "renamed"], names
        assert open(os.path.join(d, "renamed"), "rb").read() == b"kept and synced"
        assert open(new, "rb").read() == b"fresh"
        assert res["lost_files"] == []
    assert m.stats()["unsynced_bytes"] == 0
