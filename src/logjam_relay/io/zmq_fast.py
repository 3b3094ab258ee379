"""The optional C fast path for the hot socket loops (see ``_zmqfast.c``).

``drain(sock, limit)`` receives up to ``limit`` whole messages without blocking, like
the pyzmq loop in :mod:`logjam_relay.io.zmq_trio`; ``drain_bytes(sock, limit, max_bytes)``
also stops after the message that brings the bytes to ``max_bytes`` and returns
``(messages, total_bytes, largest_frame)``.  ``publish(sock, records, start)``
sends ``records[start:]`` (each a sequence of frames) in order and returns
``(index, errno)`` of the first record whose first frame could not be sent (EAGAIN,
EHOSTUNREACH...), or ``(len(records), 0)``.  Both at a fraction of pyzmq's per-frame
cost.
``pump(src, xpub, watch, timeout_ms, batch)`` is the loop of an XPUB's own thread
(:mod:`logjam_relay.io.xpubthread`), without the GIL; :class:`Ring` is that thread's
hand-over queue (``publish`` and ``ingest_pass`` take it in place of a socket) and
``ring_pump(ring, xpub, ...)`` the same loop with it as the source.
``ingest_pass(sock, pub, ...)`` is the relay's ingest hot path in one C loop (drain,
stamp, publish, encode the spool records; see ``_zmqfast.c`` and ``relay/ingestpass.py``).
``AVAILABLE`` is False when the extension was not built, libzmq could not be found in
this process, or ``LOGJAM_RELAY_PURE_PYTHON=1`` is set (benchmarks use that for the
baseline); callers then use pyzmq alone.
"""

from __future__ import annotations

import os

import zmq

AVAILABLE = False
WHY_NOT = ""
#: ``ingest_pass`` can compress with LZ4 (``-x lz4``): python-lz4's liblz4 is bound
LZ4 = False
drain = drain_bytes = publish = ingest_pass = pump = ring_pump = None  # type: ignore[assignment]
Ring = None  # type: ignore[assignment,misc]

#: flags of ``pump``'s result (``_zmqfast.c``)
PUMP_XPUB, PUMP_WATCH, PUMP_TIMEOUT, PUMP_STOP = 1, 2, 8, 16


def _loaded_libzmq() -> str | None:
    """Path of the libzmq pyzmq loaded (Linux: from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                path = line.rstrip("\n").split(None, 5)[-1]
                if path.startswith("/") and "libzmq" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def _setup() -> None:
    global AVAILABLE, WHY_NOT, drain, drain_bytes, publish, ingest_pass, pump, ring_pump, Ring
    global LZ4
    from .. import _native
    if _native.PURE_PYTHON:
        WHY_NOT = "LOGJAM_RELAY_PURE_PYTHON is set"
        return
    _zmqfast = _native.load("logjam_relay.io._zmqfast")
    if _zmqfast is None:
        WHY_NOT = "C extension not built"
        return
    zmq.zmq_version()   # pyzmq's backend (and libzmq with it) is loaded by now
    path = _loaded_libzmq()
    if path is None:
        WHY_NOT = "libzmq not found in this process"
        return
    try:
        _zmqfast.init(path)
    except OSError as e:
        WHY_NOT = str(e)
        return
    try:
        import lz4.block._block as lz4_ext
        _zmqfast.init_lz4(lz4_ext.__file__)
        LZ4 = True
    except (ImportError, OSError, AttributeError):
        LZ4 = False
    fast_drain, fast_publish, Error = _zmqfast.drain, _zmqfast.publish, _zmqfast.ZMQFastError
    fast_drain_bytes = _zmqfast.drain_bytes

    def drain_(sock: zmq.Socket, limit: int) -> list[list[bytes]]:
        if sock.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        try:
            return fast_drain(sock.underlying, limit)
        except Error as e:
            raise zmq.ZMQError(e.errno) from None

    def drain_bytes_(sock: zmq.Socket, limit: int, max_bytes: int):
        if sock.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        try:
            return fast_drain_bytes(sock.underlying, limit, max_bytes)
        except Error as e:
            raise zmq.ZMQError(e.errno) from None

    def publish_(sock: zmq.Socket, records, start: int = 0) -> tuple[int, int]:
        if sock.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        try:
            return fast_publish(sock.underlying, records, start)
        except Error as e:
            raise zmq.ZMQError(e.errno) from None

    fast_pass = _zmqfast.ingest_pass

    def ingest_pass_(sock: zmq.Socket, pub: zmq.Socket, *args):
        if sock.closed or pub.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        try:
            return fast_pass(sock.underlying, pub.underlying, *args)
        except Error as e:
            raise zmq.ZMQError(e.errno) from None

    fast_pump = _zmqfast.pump

    def pump_(src: zmq.Socket, xpub: zmq.Socket, watch, timeout_ms: int, batch: int):
        if src.closed or xpub.closed or any(w.closed for w in watch):
            raise zmq.ZMQError(zmq.ENOTSOCK)
        try:
            return fast_pump(src.underlying, xpub.underlying, [w.underlying for w in watch],
                             timeout_ms, batch)
        except Error as e:
            raise zmq.ZMQError(e.errno) from None

    fast_ring_pump = _zmqfast.ring_pump

    def ring_pump_(ring: _Ring, xpub: zmq.Socket, watch, timeout_ms: int, batch: int):
        if ring.closed or xpub.closed or any(w.closed for w in watch):
            raise zmq.ZMQError(zmq.ENOTSOCK)
        try:
            return fast_ring_pump(ring.underlying, xpub.underlying,
                                  [w.underlying for w in watch], timeout_ms, batch)
        except Error as e:
            raise zmq.ZMQError(e.errno) from None

    class _Ring:
        """The hand-over queue of an XPUB's thread (``_zmqfast.c``, "the hand-over
        ring"): one producer (``publish``, ``ingest_pass``: pass the ring where they take
        a socket), one consumer (``ring_pump``).  ``max_records`` 0: no bound."""

        __slots__ = ("underlying", "closed")

        def __init__(self, max_records: int):
            self.underlying = _zmqfast.ring(max_records)
            self.closed = False

        def stop(self) -> None:
            """``ring_pump`` returns ``PUMP_STOP`` once what is queued is forwarded."""
            if not self.closed:
                _zmqfast.ring_stop(self.underlying)

        @property
        def queued(self) -> int:
            return 0 if self.closed else _zmqfast.ring_queued(self.underlying)

        def counts(self) -> tuple[int, int]:
            """``(forwarded, dropped)``: the records ``ring_pump`` put on the XPUB so far
            and, of them, those sent lossy (kept by the consumer, read from any thread)."""
            return _zmqfast.ring_counts(self.underlying)

        def kick(self) -> None:
            """``ring_pump`` returns ``PUMP_WATCH`` soon (any thread): Python work waits
            for the consumer's thread (it otherwise stays in C while records flow)."""
            if not self.closed:
                _zmqfast.ring_kick(self.underlying)

        def close(self, linger: int = 0) -> None:
            """Free what is queued: only once no thread pumps the ring."""
            self.closed = True
            _zmqfast.ring_close(self.underlying)

    drain, drain_bytes, publish, ingest_pass = drain_, drain_bytes_, publish_, ingest_pass_
    pump, ring_pump, Ring = pump_, ring_pump_, _Ring
    AVAILABLE = True


_setup()
