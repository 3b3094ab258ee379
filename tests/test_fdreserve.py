"""The fd reserve keeps the relay's own files working with no descriptor free (issue 21,
item 3).

A child process (so the test process keeps its limit) lowers ``RLIMIT_NOFILE``, fills the
reserve, opens a spool with small segments, a cursor log, a sequence state file, a
dead-letter store and a listening socket, then takes every free descriptor.  With none
left it: appends across many segment rolls (new segment, directory sync, state file),
fdatasyncs off the loop (``sync_async``: a duplicate), compacts a cursor log, rewrites
the sequence state, writes a dead letter in a new file, syncs an archive directory, and
closes two pending connections at accept; an inline Courier and Lumberjack output whose
connects fail for want of a descriptor back off (no crash).  Asserted: all of it worked,
the reserve is full again afterwards (every number went back with ``dup2``), and the same
run without a reserve fails with ``EMFILE`` (so the test can fail).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="RLIMIT_NOFILE and /dev/null semantics of Linux")

CHILD = textwrap.dedent("""
    import errno, json, os, resource, socket, sys
    sys.path.insert(0, sys.argv[2])
    import trio
    from logjam_relay.fdreserve import RESERVE
    from logjam_relay.spool import cursors
    from logjam_relay.relay.sequence import SequenceState
    from logjam_relay.deadletter import DeadLetterStore
    from logjam_relay.outputs import archive
    from logjam_relay.outputs.courier import CourierOutput
    from logjam_relay.outputs.courier import parse_url as co_url
    from logjam_relay.outputs.lumberjack import LumberjackOutput
    from logjam_relay.outputs.lumberjack import parse_url as lj_url
    from pathlib import Path
    from spool_helpers import fill, open_spool

    use_reserve = sys.argv[3] == "1"
    root = Path(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
    if use_reserve:
        RESERVE.fill(8)
    cursors.COMPACT_ENTRIES = 4
    sp = open_spool(root / "spool", readers=("a",), segment_bytes=4096, fsync="interval")
    seq = SequenceState(root / "state" / "seq.json", 0)
    seq.acquire()
    dl = DeadLetterStore(root / "dead", max_bytes=1 << 20)
    dl.file_bytes = 4096
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(8)
    print(lst.getsockname()[1], flush=True)
    sys.stdin.readline()                        # the parent connected twice
    out = {"steps": {}}

    async def main():
        await trio.to_thread.run_sync(lambda: None)     # the worker thread exists
        hog = []
        while True:                             # every free descriptor taken
            try:
                hog.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as e:
                assert e.errno == errno.EMFILE
                break
        out["hogged"] = len(hog)

        async def step(name, fn):
            try:
                r = fn()
                if hasattr(r, "__await__"):
                    await r
                out["steps"][name] = "ok"
            except Exception as e:
                out["steps"][name] = f"{type(e).__name__}: {getattr(e, 'reason', '')} {e}"

        def rolls():
            before = sp._next_segno
            fill(sp, 0, 400, batch=10)          # ~30 segments of 4 KiB
            assert sp._next_segno - before >= 10, sp._next_segno - before
        await step("segment rolls", rolls)

        async def sync():
            fill(sp, 400, 5)
            await sp.sync_async()
            assert not sp._unsynced
        await step("sync_async", sync)

        def acks():
            r = sp.reader("a")
            for _ in range(12):
                got = r.read(20)
                r.ack(got[-1].position)
                r.persist()
            assert r._log.compactions >= 2, r._log.compactions
        await step("cursor log compaction", acks)

        def state():
            w = seq.write_errors
            seq.reserve(1000)
            assert seq.write_errors == w, seq.write_errors
        await step("sequence state", state)

        def dead():
            for i in range(3):                  # more than one file of 4 KiB
                assert dl.put("a", "too_large", [b"x" * 3000, b"y"]) is not None
        await step("dead letters", dead)

        await step("archive directory sync", lambda: archive._fsync_dir(str(root)))

        def refuse():
            n = sum(RESERVE.refuse(lst.fileno()) for _ in range(2))
            assert n == 2, n
        await step("refuse at accept", refuse)

        async def connects():
            # inline outputs: a connect with no descriptor free fails and backs off
            port = lst.getsockname()[1]
            outs = [CourierOutput(co_url(f"courier://127.0.0.1:{port}?tls=off&backoff=0.05"
                                         "&backoff_max=0.1&name=a"), sp.reader("a")),
                    LumberjackOutput(sp.reader("a"), lj_url(
                        f"lumberjack://127.0.0.1:{port}?tls=off&backoff_min=0.05"
                        "&backoff_max=0.1&name=a"))]
            for o in outs:
                with trio.move_on_after(1):
                    await o.run()
                assert o.connect_failures >= 2 and o.connections == 0, o.stats()
        await step("output connects back off", connects)
        sp.close()
        dl.close()
        out["reserve"] = RESERVE.stats()
        for fd in hog:
            os.close(fd)

    trio.run(main)
    try:
        out["state_reserved"] = json.loads((root / "state" / "seq.json").read_text())["reserved"]
    except FileNotFoundError:
        out["state_reserved"] = None
    print(json.dumps(out), flush=True)
""")


def run_child(tmp_path, use_reserve: bool) -> dict:
    import logjam_relay
    src = str(__import__("pathlib").Path(logjam_relay.__file__).parents[1])
    tests = str(__import__("pathlib").Path(__file__).parent)
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {tests!r}); " + CHILD,
         str(tmp_path), src, "1" if use_reserve else "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
        for c in conns:
            c.settimeout(5)
            if use_reserve:                     # closed by the refusal: EOF or reset
                try:
                    assert c.recv(1) == b""
                except ConnectionResetError:
                    pass
            c.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_with_no_descriptor_free_the_relays_files_work_on_the_reserve(tmp_path):
    out = run_child(tmp_path, use_reserve=True)
    print(out)
    assert out["hogged"] > 0
    assert all(v == "ok" for v in out["steps"].values()), out["steps"]
    res = out["reserve"]
    # every step drew on the reserve, and got its number back: the reserve is full
    assert res["used"] > 0 and res["refused"] == 2 and res["held"] == res["size"] == 8, res
    assert res["lost"] == 0 and res["exhausted"] == 0, res
    assert out["state_reserved"] > 1000


def test_without_the_reserve_the_same_steps_fail(tmp_path):
    out = run_child(tmp_path, use_reserve=False)
    steps = out["steps"]
    assert "emfile" in steps["segment rolls"], steps
    assert "emfile" in steps["sync_async"], steps
    assert steps["sequence state"] != "ok" and steps["dead letters"] != "ok", steps
    assert steps["refuse at accept"] != "ok"
