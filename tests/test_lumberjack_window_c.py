"""The compressed Lumberjack window made in C without the GIL (``_ljencode.window_start``,
``lumberjack_encode.compress_window``): byte for byte what the Python
``protocols.lumberjack.encode_window`` gives, for every level and for windows from one
byte to several MiB; the job signals its eventfd; a cancelled wait leaves nothing behind.
"""

import os

import pytest
import trio

from conftest import require_native
from logjam_relay.outputs import lumberjack_encode as le
from logjam_relay.protocols import lumberjack as lj


def _windows():
    rnd = os.urandom(1 << 16)
    yield b"x"
    yield b"1D" + b"\x00" * 400
    yield (rnd + b'{"action":"a#b","code":200,"pad":"..."}' * 5000)
    yield os.urandom(3 << 20) + b"abc" * (1 << 20)        # ~6 MiB, partly incompressible


async def test_c_window_equals_python_at_every_level():
    require_native(le._ljencode, "logjam_relay.outputs._ljencode")
    assert le._WINDOW_C
    for data in _windows():
        for level in range(1, 10):
            assert await le.compress_window(data, 1000, level) == \
                lj.encode_window(data, 1000, level), (len(data), level)
    # level 0 (plain) and the bounds go through the reference
    assert await le.compress_window(b"abc", 3, 0) == lj.encode_window(b"abc", 3, 0)
    with pytest.raises(ValueError):
        await le.compress_window(b"abc", 0, 3)


def test_c_window_job_signals_its_eventfd():
    mod = require_native(le._ljencode, "logjam_relay.outputs._ljencode")
    efd = os.eventfd(0)
    try:
        data = b"y" * 300_000
        job = mod.window_start(data, 5, 3, efd)
        assert os.eventfd_read(efd) == 1            # blocks until the thread is done
        assert job.done()
        assert job.finish() == lj.encode_window(data, 5, 3)
        with pytest.raises(RuntimeError):
            job.finish()
        with pytest.raises(ValueError):
            mod.window_start(data, 5, 10, efd)
    finally:
        os.close(efd)


async def test_cancelled_wait_joins_the_thread_and_closes_the_eventfd():
    require_native(le._ljencode, "logjam_relay.outputs._ljencode")
    fds_before = len(os.listdir("/proc/self/fd"))
    data = os.urandom(4 << 20)
    with trio.move_on_after(0) as scope:
        await le.compress_window(data, 10, 9)
    assert scope.cancelled_caught
    assert len(os.listdir("/proc/self/fd")) == fds_before
    # and the module still works afterwards
    assert await le.compress_window(b"z" * 1000, 1, 3) == lj.encode_window(b"z" * 1000, 1, 3)
