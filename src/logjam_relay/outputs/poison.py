"""What the reliable outputs share about events they cannot deliver, and error texts.

* :class:`DeadLetterSink` -- an output's door to the dead-letter store
  (``deadletter/store.py``): events over ``max_event_bytes`` and events the receiver
  keeps refusing go there, written off the event loop, counted per reason.
* Refusal and bisection: a window (Lumberjack) or payload (Courier) whose connection
  was closed by the receiver before its acknowledgement :data:`REFUSE_LIMIT` times in
  a row is split in two; a half that is then refused once more is split again, until
  one event is left: refused :data:`REFUSE_LIMIT` times on its own, it is diverted.
  While a window is under suspicion only it is in flight (stop-and-wait) and the
  reconnect backoff does not grow, so 1000 events cost about 3 + 2·log2(1000) ≈ 23
  short reconnects (seconds, not minutes).  :func:`refusal_action` is that decision,
  shared by both outputs; they differ only in how they split and hold.
* :func:`describe_error` -- the cause of a connection failure in words, e.g. the TLS
  verification error (``certificate verify failed: self-signed certificate``) that trio
  hides behind ``BrokenResourceError``, or the DNS error behind an ``OSError``.
"""

from __future__ import annotations

import functools
import logging
import socket
import ssl
from collections.abc import Sequence

import trio

from .. import _native
from ..protocols.logjam import HEARTBEAT
from ..ratelimit import RateLimitedLog
from ..spool.api import KIND_LOGJAM, Record

log = logging.getLogger("logjam_relay.outputs")

#: consecutive refusals (closed before the ACK) of the same window before it is split
REFUSE_LIMIT = 3

#: what an output does about a refused head window/payload (:func:`refusal_action`)
KEEP, HOLD, BISECT, UNHOLD = "keep", "hold", "bisect", "unhold"


def refusal_action(head, left: int, holding: bool) -> str:
    """The one decision both outputs take when the receiver closed the connection before
    their head window (Lumberjack) or payload (Courier) advanced.  ``head`` has
    ``refusals`` (counted here) and ``suspect`` (a half of a split one); ``left``: its
    events not yet acknowledged; ``holding``: an isolated event is already held back.

    * ``UNHOLD``: what follows the held event is refused as well, so there is no evidence
      against it: put it back and :func:`clear_suspicion` (a receiver that refuses
      everything, a proxy without a backend, never fills the dead-letter store);
    * ``HOLD``: one event left, refused :data:`REFUSE_LIMIT` times in a row: hold it
      back, send what follows, divert it once the receiver acknowledged that;
    * ``BISECT``: split it (a half under suspicion is split at its first refusal);
    * ``KEEP``: retry it as it is.
    """
    head.refusals += 1
    if holding:
        return UNHOLD
    if left <= 1:
        return HOLD if head.refusals >= REFUSE_LIMIT else KEEP
    if head.suspect or head.refusals >= REFUSE_LIMIT:
        return BISECT
    return KEEP


def clear_suspicion(items) -> None:
    for x in items:
        x.suspect = False
        x.refusals = 0


def is_event(rec: Record, heartbeats: bool = False) -> bool:
    """A record an output forwards: a logjam message that is not a heartbeat (any logjam
    message, heartbeats and restart markers too, with ``heartbeats``: the output's URL
    parameter ``heartbeats=on``)."""
    return rec.kind == KIND_LOGJAM and (heartbeats or not (rec.frames and
                                                           rec.frames[0] == HEARTBEAT))


#: a plain body larger than this is mapped in a worker thread (JSON check, copies)
INLINE_BODY_MAX = 64 * 1024

_ljencode = _native.load("logjam_relay.outputs._ljencode")
_scan_c = getattr(_ljencode, "scan", None)


def scan_py(records: list[Record]) -> tuple[int, bool]:
    """``(body_bytes, heavy)`` of a batch (:func:`scan`, in Python: the reference)."""
    total = 0
    heavy = False
    for rec in records:
        fr = rec.frames
        if len(fr) > 2:
            total += len(fr[2])
            if len(fr) > 3 and (len(fr[2]) > INLINE_BODY_MAX or (len(fr[3]) == 24 and fr[3][2])):
                heavy = True
    return total, heavy


def scan(records: list[Record]) -> tuple[int, bool]:
    """``(body_bytes, heavy)``: the summed length of the bodies (frame 2) of ``records``,
    and whether mapping them may take long (:func:`needs_worker`).  One pass in C
    (``_ljencode.scan``) when it is built."""
    if _scan_c is not None:
        r = _scan_c(records, INLINE_BODY_MAX)
        if r is not None:
            return r
    return scan_py(records)


def needs_worker(records: list[Record]) -> bool:
    """Whether mapping ``records`` may take long: a compressed body (inflating it, up to
    ``max_event_bytes``) or a large one.  Such batches are mapped in a worker thread, off
    the event loop; small plain ones inline (a thread hop costs more than they do)."""
    return scan(records)[1]


def skip_non_events(source, heartbeats: bool = False) -> bool:
    """For an output that is not connected and has nothing in flight (everything it read
    is acknowledged): acknowledge at once the records at the read position it would never
    forward (heartbeats, unless ``heartbeats``: spooled for the archive's gapless sequence
    only; other kinds), so that they do not count as its backlog.  Reads one record at a time and stops at the first event,
    rewinding the reader to it (nothing is held in memory meanwhile, so ``drop_oldest``
    accounting stays exact).  Returns True when it stopped at an event: the caller need
    not call it again before it acknowledged something (the cursor cannot pass the event,
    and re-reading a large event on every reconnect would only cost time)."""
    while True:
        recs = source.read(1)
        if not recs:
            return False
        if is_event(recs[0], heartbeats):
            source.rewind()
            return True
        source.ack(recs[0].position)


def _chain(e: BaseException | None):
    seen = 0
    while e is not None and seen < 8:
        yield e
        seen += 1
        e = e.__cause__ or e.__context__


def describe_error(e: BaseException) -> str:
    """A connection failure in words, naming the TLS verification or DNS error if any."""
    for x in _chain(e):
        if isinstance(x, ssl.SSLCertVerificationError):
            return (f"TLS certificate verification failed: {x.verify_message} "
                    f"(verify code {x.verify_code})")
        if isinstance(x, ssl.SSLError):
            return f"TLS error: {x.reason or x}"
        if isinstance(x, socket.gaierror):
            return f"DNS lookup failed: {x.strerror or x}"
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def is_tls_error(e: BaseException) -> bool:
    return any(isinstance(x, ssl.SSLError) for x in _chain(e))


def is_dns_error(e: BaseException) -> bool:
    return any(isinstance(x, socket.gaierror) for x in _chain(e))


class DeadLetterSink:
    """Diverts an output's undeliverable records to the store; counts them per reason."""

    def __init__(self, output: str, store=None):
        self.output = output
        self.store = store
        self._local: dict[str, int] = {}
        self._rlog = RateLimitedLog(log)

    def counts(self) -> dict[str, int]:
        """Dead letters of this output per reason (since the relay started)."""
        if self.store is not None:
            return self.store.count_for(self.output)
        return dict(self._local)

    async def divert(self, items: Sequence[tuple[Record, str, str]]) -> None:
        """Store ``(record, reason, detail)`` items durably (off the event loop)."""
        for rec, reason, detail in items:
            self._rlog.warning(f"dead_letter_{reason}", "output %s: event %s %s (%s): %s",
                               self.output, _describe_record(rec),
                               "diverted to the dead-letter store" if self.store is not None
                               else "not delivered (no dead-letter store)", reason, detail)
            if self.store is None:
                self._local[reason] = self._local.get(reason, 0) + 1
                continue
            # shielded: a record taken out of the stream must reach the store
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(functools.partial(
                    self.store.put, self.output, reason, rec.frames, kind=rec.kind,
                    detail=detail, position=tuple(rec.position)))


def _describe_record(rec: Record) -> str:
    fr = rec.frames
    stream = fr[0][:60].decode("utf-8", "backslashreplace") if fr else "?"
    size = sum(len(f) for f in fr)
    return f"at {rec.position[0]}:{rec.position[1]} ({stream!r}, {size} bytes)"
