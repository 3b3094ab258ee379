"""The cyclic garbage collector off the hot paths: one policy for the relay and the output
workers (the bottom floor: both call it once their start-up is done); and glibc's
``malloc_trim``, which gives freed heap back to the OS."""

from __future__ import annotations


def _load_malloc_trim():
    try:
        import ctypes
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):     # not glibc
        return None


#: ``malloc_trim(pad)``: glibc returns free heap memory to the OS; None where the C
#: library has none.  The inputs call it after a connection that held much ends, the XPUB
#: subscription limit after many entries were freed.
malloc_trim = _load_malloc_trim()


def tune_gc() -> None:
    """Keep the cyclic garbage collector off the hot path (called once start-up is done).

    Every drained message is a list and a tuple or two, all tracked by the collector:
    with the default thresholds (700, 10, 10) a collection ran every few hundred
    messages and the full ones walked every object of the process; the profile of the
    relay at full rate had ~10-18 % of the event loop thread in ``gc_collect_main``
    (bench_relay.py, bench_durable.py).  Almost nothing on this path makes cycles
    (records die by reference count), so: move what start-up made to the permanent
    generation (never walked again) and collect far less often.  Cycles are still
    collected, just in larger, rarer passes.
    """
    import gc
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
