"""The group commit's fdatasync thread in C (spool/syncthread.py, ``_syncthread.c``).

Real descriptors, real fdatasync; the contract it shares with ``trio.to_thread``: the
call returns once the thread's fdatasync returned (the descriptor stays open until then,
even when the caller is cancelled), errors come back as ``OSError`` with the errno, one
job at a time.  The writer uses it on the real file system only; the group commit's own
contract (no 202 before its sync) runs through it in test_groupcommit.py.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import trio

from conftest import require_native
from logjam_relay.spool import fs as fs_mod
from logjam_relay.spool import syncthread
from logjam_relay.spool.spool import Spool
from logjam_relay.spool.fsyncpolicy import FsyncPolicy


def _named(name: str = "spool-fdatasync") -> int:
    """Threads of this process with that name (the C thread names itself)."""
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().strip() == name
        except OSError:
            pass                              # ended meanwhile
    return n


def _eventually(cond, seconds: float = 10.0) -> bool:
    """cond() true now or within ``seconds`` (a joined thread leaves /proc a little after
    pthread_join returns)."""
    import time
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture
def st():
    require_native(syncthread._c, "logjam_relay.spool._syncthread")
    before = _named()
    t = syncthread.make()
    assert t is not None, syncthread.OFF_REASON
    assert _eventually(lambda: _named() == before + 1)      # its own thread
    yield t
    t.close()
    assert _eventually(lambda: _named() == before)          # joined


async def test_syncs_a_file_and_counts(st, tmp_path):
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for _ in range(5):
            os.write(fd, b"x" * 1000)
            took = await st.fdatasync(fd)
            assert 0 < took < 30
        assert st.jobs == 5 and not st.busy()
    finally:
        os.close(fd)


async def test_errors_come_back_with_their_errno(st, tmp_path):
    r, w = os.pipe()                  # fdatasync on a pipe: EINVAL
    try:
        with pytest.raises(OSError) as e:
            await st.fdatasync(r)
        assert e.value.errno == errno.EINVAL
    finally:
        os.close(r)
        os.close(w)
    import resource
    fd = resource.getrlimit(resource.RLIMIT_NOFILE)[1] + 10   # never open: EBADF
    with pytest.raises(OSError) as e:
        await st.fdatasync(fd)
    assert e.value.errno == errno.EBADF
    assert not st.busy()              # free again after a failure


async def test_one_job_of_several_syncs(st, tmp_path):
    """start_many: the fdatasyncs, then the fsyncs (a directory), as one job with one
    wake-up; the first error ends it and names the descriptor's index."""
    a = os.open(tmp_path / "a", os.O_CREAT | os.O_WRONLY, 0o644)
    b = os.open(tmp_path / "b", os.O_CREAT | os.O_WRONLY, 0o644)
    d = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    r, w = os.pipe()                  # fdatasync/fsync on a pipe: EINVAL
    try:
        os.write(a, b"x" * 1000)
        os.write(b, b"y" * 1000)
        st.start_many([a, b], [d])
        assert 0 < await st.finish() < 30
        assert st.jobs == 1 and not st.busy()
        for data, full, bad in (([a, r], [d], 1), ([a], [r], 1), ([r, b], [], 0)):
            st.start_many(data, full)
            with pytest.raises(OSError) as e:
                await st.finish()
            assert e.value.errno == errno.EINVAL and e.value.sync_index == bad
        assert st.jobs == 4 and not st.busy()
        with pytest.raises(ValueError, match="at most 16"):
            st.start_many([a] * 10, [d] * 7)
        with pytest.raises(ValueError, match="no descriptor"):
            st.start_many([], [])
        assert not st.busy()          # nothing was handed over
    finally:
        for fd in (a, b, d, r, w):
            os.close(fd)


async def test_one_job_at_a_time(st, tmp_path):
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        st._c.submit(fd)
        assert st.busy()
        with pytest.raises(RuntimeError, match="in flight"):
            st._c.submit(fd)
        while st._c.result() is None:
            await trio.sleep(0.001)
        assert not st.busy()
        with pytest.raises(RuntimeError, match="no sync was submitted"):
            st._c.result()
    finally:
        os.close(fd)


async def test_a_cancelled_caller_still_waits_for_the_thread(st, tmp_path):
    """Cancelled while the thread syncs: the call returns only after the thread's result
    was taken (the caller closes the descriptor after it), then the cancel is seen."""
    c = st._c
    taken = []

    class Slow:
        """result() says "still running" at first: the caller is inside its
        wait when the cancel comes."""
        polls = 0

        def __getattr__(self, name):
            return getattr(c, name)

        def result(self):
            Slow.polls += 1
            if Slow.polls == 1:
                scope.cancel()            # the caller is cancelled while it waits
                return None
            r = c.result()
            taken.append(r)
            return r

    scope = None
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    st._c = Slow()
    try:
        os.write(fd, b"y" * 100)
        returned = False
        with trio.CancelScope() as scope:
            await st.fdatasync(fd)        # its wait is shielded: no Cancelled out of it
            returned = True
            await trio.sleep(0)           # the cancel is seen at the next checkpoint
        assert returned and scope.cancelled_caught
        assert Slow.polls >= 2 and taken and taken[-1][0] == 0   # the thread's result
        assert not c.busy
    finally:
        st._c = c
        os.close(fd)


async def test_another_exception_still_takes_the_result(st, tmp_path):
    """Anything but a cancel (KeyboardInterrupt, which trio may raise anywhere) while the
    caller waits: it goes on, but only once the thread is done with the descriptor, and
    the thread is free for the next sync."""
    c = st._c

    class Boom(BaseException):
        pass

    class Interrupted:
        polls = 0

        def __getattr__(self, name):
            return getattr(c, name)

        def result(self):
            Interrupted.polls += 1
            if Interrupted.polls == 1:
                raise Boom
            return c.result()

    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    st._c = Interrupted()
    try:
        with pytest.raises(Boom):
            await st.fdatasync(fd)
        assert Interrupted.polls >= 2 and not c.busy
    finally:
        st._c = c
        os.close(fd)
    assert not st.busy()
    fd = os.open(tmp_path / "f", os.O_WRONLY)
    try:
        assert await st.fdatasync(fd) >= 0        # the next sync works
    finally:
        os.close(fd)


async def test_closed_while_a_caller_waits(st, tmp_path, monkeypatch):
    """close() while a caller waits on the eventfd: the caller gets the thread's result
    (close joined the thread) and never reads the closed eventfd's number again (it may
    be another file's by then)."""
    c = st._c

    class Held:
        """result() says "still running" until close() ran: the caller rests on the
        eventfd with nothing more to come."""

        def __getattr__(self, name):
            return getattr(c, name)

        def result(self):
            return c.result() if st.closed else None

    reads = []
    real_read = os.eventfd_read
    monkeypatch.setattr(syncthread.os, "eventfd_read",
                        lambda fd: reads.append(st.closed) or real_read(fd))
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    got = []
    st._c = Held()
    try:
        async def caller():
            got.append(await st.fdatasync(fd))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            with trio.fail_after(10):
                while not reads:              # the thread's wake-up was consumed
                    await trio.sleep(0.001)
            await trio.sleep(0.01)
            assert not got                    # still waiting
            st.close()
        assert len(got) == 1 and got[0] > 0
        assert True not in reads              # nothing read after close
    finally:
        os.close(fd)


async def test_dropped_without_close_ends_its_thread_and_closes_its_eventfd(tmp_path):
    """An owner that never calls close(): when the object goes, its thread is joined and
    its eventfd closed (nothing else would)."""
    import gc
    require_native(syncthread._c, "logjam_relay.spool._syncthread")

    def eventfds() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
            except OSError:
                pass                          # the listing's own descriptor, gone
        return n
    threads, efds = _named(), eventfds()
    t = syncthread.make()
    assert t is not None, syncthread.OFF_REASON
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"x")
        await t.fdatasync(fd)
    finally:
        os.close(fd)
    assert (_named(), eventfds()) == (threads + 1, efds + 1)
    del t
    gc.collect()
    assert _eventually(lambda: _named() == threads)
    assert eventfds() == efds


async def test_the_writer_uses_it_on_the_real_file_system_only(tmp_path, monkeypatch):
    require_native(syncthread._c, "logjam_relay.spool._syncthread")
    sp = Spool(str(tmp_path / "a"), readers=[], fsync=FsyncPolicy("batch", off_loop=True))
    try:
        sp.append_batch([[b"app-env", b"logs", b"{}", b"\0" * 24]])
        await sp.sync_async()
        st = sp.writer.sync_thread
        assert st is not None and st.jobs == 1
        # a test's injected fdatasync: through Filesystem.fdatasync in a worker thread
        calls = []
        monkeypatch.setattr(fs_mod, "_fdatasync", lambda fd: calls.append(fd))
        sp.append_batch([[b"app-env", b"logs", b"{}", b"\0" * 24]])
        await sp.sync_async()
        assert len(calls) == 1 and st.jobs == 1
    finally:
        sp.close()
    assert sp.writer.sync_thread.closed


def test_switched_off_by_the_environment():
    require_native(syncthread._c, "logjam_relay.spool._syncthread")
    code = ("from logjam_relay.spool import syncthread as s; "
            "print(s.make() is None, s.OFF_REASON)")
    for value, off in (("0", True), ("off", True), ("1", False)):
        env = dict(os.environ, LOGJAM_RELAY_SYNC_THREAD=value)
        env.pop("LOGJAM_RELAY_PURE_PYTHON", None)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout
        if off:
            assert out.startswith("True LOGJAM_RELAY_SYNC_THREAD=0"), out
        else:
            assert out.startswith("False"), out
        # the real command: not an unknown setting, and --version says so
        version = subprocess.run([sys.executable, "-m", "logjam_relay", "--version"], env=env,
                                 capture_output=True, text=True, check=True).stdout
        assert ("spool syncs in worker threads (LOGJAM_RELAY_SYNC_THREAD=0)" in version) == off
        subprocess.run([sys.executable, "-m", "logjam_relay", "--check-config"], env=env,
                       capture_output=True, text=True, check=True)
