"""The ``-x`` recompression threads: ``compressors`` long-lived threads, as logjam-device's.

logjam-device compresses in a pool of ``-s N`` threads (``compressor0`` ...) and exports
the CPU of each as ``logjam:device:cpu_seconds_total{thread="compressorN"}``.  The relay
does the same: the chunks :meth:`CompressorPool.compress` cuts from a batch go round-robin to
threads of its own, named ``compressorN`` for the operating system too (``top -H``,
``/proc/self/task/<tid>/comm``), whose native thread ids the metrics collector reads the
CPU of (``health/cpu.py``).  A chunk is waited for without cancellation (it works on the
batch in place), and an exception in it is raised in the waiting task.

The threads start with :meth:`start` (the relay does when ``-x`` is on) and stop with
:meth:`close`; without ``-x`` there are none and their CPU reads 0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import queue
import threading

import trio

log = logging.getLogger("logjam_relay.relay")

_PR_SET_NAME = 15


def _os_thread_namer():
    """``set_name(name)`` for the calling thread (Linux ``prctl(PR_SET_NAME)``), or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):        # pragma: no cover - not Linux
        return None

    def set_name(name: str) -> None:
        prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode("ascii", "replace")[:15]), 0, 0, 0)

    return set_name


set_os_thread_name = _os_thread_namer()


class CompressorPool:
    """``n`` threads named ``compressor0`` .. ``compressor{n-1}`` running chunks of work."""

    def __init__(self, n: int):
        self.n = max(1, n)
        self.names = [f"compressor{i}" for i in range(self.n)]
        self.tids: list[int] = [0] * self.n        # native ids, 0 until started
        self._queues: list[queue.SimpleQueue] = []
        self._threads: list[threading.Thread] = []
        self._next = 0

    @property
    def started(self) -> bool:
        return bool(self._threads)

    def start(self) -> None:
        if self._threads:
            return
        ready = threading.Barrier(self.n + 1)
        for i in range(self.n):
            q: queue.SimpleQueue = queue.SimpleQueue()
            t = threading.Thread(target=self._work, args=(i, q, ready), name=self.names[i],
                                 daemon=True)
            self._queues.append(q)
            self._threads.append(t)
            t.start()
        ready.wait()                # every tid is known before the first scrape

    def _work(self, i: int, q: queue.SimpleQueue, ready: threading.Barrier) -> None:
        if set_os_thread_name is not None:
            set_os_thread_name(self.names[i])
        self.tids[i] = threading.get_native_id()
        ready.wait()
        while True:
            job = q.get()
            if job is None:
                return
            fn, args, token, box, done = job
            try:
                box.append((True, fn(*args)))
            except BaseException as e:  # noqa: BLE001 -- raised again in the waiting task
                box.append((False, e))
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:     # pragma: no cover - the loop is gone
                pass

    async def run(self, fn, *args):
        """``fn(*args)`` in the next thread of the round; its result (or exception)."""
        if not self._threads:
            self.start()
        i = self._next
        self._next = (i + 1) % self.n
        done = trio.Event()
        box: list = []
        self._queues[i].put((fn, args, trio.lowlevel.current_trio_token(), box, done))
        with trio.CancelScope(shield=True):     # the chunk works on the batch in place
            await done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    async def compress(self, pipeline, acc: list[tuple], idx: list[int]) -> None:
        """Recompress the messages ``idx`` of ``acc`` in place (``pipeline``'s
        ``compress_in_place``), in chunks of at least 128 over up to ``n`` threads, and
        count them."""
        n = len(idx)
        workers = min(self.n, max(1, n // 128))
        if workers == 1:
            await self.run(pipeline.compress_in_place, acc, idx)
        else:
            step = math.ceil(n / workers)
            async with trio.open_nursery() as nursery:
                for start in range(0, n, step):
                    nursery.start_soon(self.run, pipeline.compress_in_place, acc, idx,
                                       start, start + step)
        pipeline.count_compressed(acc, idx)

    def close(self, timeout: float = 5.0) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():                # pragma: no cover - a chunk that never ends
                log.warning("compressor thread %s did not stop within %.0f s", t.name,
                            timeout)
        self._queues.clear()
        self._threads.clear()
        self.tids = [0] * self.n
