"""Lumberjack v1, the writer's ACK state, sans-IO (:class:`WriterAcks`).

The writer's half of the connection state that is not bytes: which windows are in
flight, what each ACK the writer-role :class:`~.lumberjack.Connection` decodes does to
them, and which hosts get one window at a time after a fallback from pipelining.  No
sockets, no trio, no clock reads: the caller gives the time (outputs/lumberjack.py, as
outputs/courier.py gives it to ``ClientConnection``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .lumberjack import LumberjackError, ack_completes

__all__ = ["WriterAcks", "WindowAcked", "PartialAck", "PIPELINE_RETRY_AFTER"]

#: after a fallback to stop-and-wait, a host gets pipelined windows again after this long
PIPELINE_RETRY_AFTER = 600.0


@dataclass(frozen=True, slots=True)
class WindowAcked:
    """An ACK completed the oldest window in flight, of ``count`` events."""

    count: int


@dataclass(frozen=True, slots=True)
class PartialAck:
    """An ACK smaller than the oldest window in flight.  ``end``: more windows are in
    flight, so the ACKs that follow would be ambiguous (every window restarts at seq 1):
    the connection must end and the windows be resent.  Otherwise wait for the rest of
    the ACK (or the timeout).  ``fell_back``: the host went stop-and-wait now."""

    value: int
    count: int
    end: bool
    fell_back: bool


class WriterAcks:
    """The writer's ACK state (sans-IO; the caller gives the time): the windows in flight
    on the current connection, oldest first, what each :class:`Ack` does to them, and
    which hosts get one window at a time after a fallback from pipelining.

    Every window restarts its sequence at 1, so the ACK of a whole window of ``n`` is
    ``n`` for every known reader (go-lumber acks the count, jls-lumberjack the last seq,
    the Java input the highest seq: :func:`ack_completes`).  What is not such an ACK:

    * an ACK with no window in flight, or larger than the oldest window: the peer is not
      a Lumberjack reader of these windows (``LumberjackError("unexpected_ack")``);
    * a smaller ACK (:class:`PartialAck`): no known v1 reader sends one for a window it
      understood (go-lumber does for a ``C`` frame with more events than ``W``).  The host
      goes stop-and-wait for ``retry_after`` seconds, as it does when a connection with
      several windows in flight times out before its first ACK (:meth:`timed_out`); a
      reader restarted or replaced may well pipeline again after that.

    Short or malformed ACK frames never get here: :class:`Connection` (writer role) takes
    an ACK only as a whole 6-byte ``1A``/``2A`` frame and fails on anything else (unlike
    logstash-forwarder, which takes any 6 bytes as the ACK of its window:
    ``shared/specs/reference/lumberjack-v1.md``)."""

    def __init__(self, pipeline: int, retry_after: float = PIPELINE_RETRY_AFTER):
        self.pipeline = pipeline
        self.retry_after = retry_after
        self._in_flight: deque[int] = deque()      # event counts, oldest window first
        self._stop_and_wait_until: dict = {}       # host -> time pipelining is tried again
        self.acked_on_connection = 0
        self.partial_acks = 0
        self.fallbacks = 0

    @property
    def in_flight(self) -> int:
        """Windows sent on this connection and not acknowledged."""
        return len(self._in_flight)

    def connected(self) -> None:
        """A new connection: nothing is in flight on it (the caller resends what was not
        acknowledged, calling :meth:`sent` again)."""
        self._in_flight.clear()
        self.acked_on_connection = 0

    def sent(self, count: int) -> None:
        """A window of ``count`` events was written."""
        self._in_flight.append(count)

    def depth(self, host, now: float) -> tuple[int, bool]:
        """(windows allowed in flight to ``host``, whether pipelining resumes now):
        ``pipeline``, or 1 for ``retry_after`` seconds after a fallback."""
        until = self._stop_and_wait_until.get(host)
        if until is None:
            return self.pipeline, False
        if now < until:
            return 1, False
        del self._stop_and_wait_until[host]
        return self.pipeline, True

    def fall_back(self, host, now: float) -> bool:
        """Stop-and-wait for ``host`` from ``now``; False when it already was (or the
        output does not pipeline): not counted again."""
        if self.depth(host, now)[0] <= 1:
            return False
        self._stop_and_wait_until[host] = now + self.retry_after
        self.fallbacks += 1
        return True

    def receive_ack(self, value: int, host, now: float, *,
                    pipelining: bool = True) -> WindowAcked | PartialAck:
        """What ACK ``value`` (not 0: that is a :class:`KeepAlive`) does.  ``pipelining``
        False: the caller sends one window at a time for a reason of its own (a
        bisection), so a partial ACK says nothing about pipelining: no fallback."""
        if not self._in_flight:
            raise LumberjackError("unexpected_ack", f"ACK {value} with no window in flight")
        count = self._in_flight[0]
        if not ack_completes(value, 1, count):
            if value > count:
                raise LumberjackError("unexpected_ack", f"ACK {value} for a window of {count}")
            self.partial_acks += 1
            fell = self.fall_back(host, now) if pipelining else False
            return PartialAck(value, count, len(self._in_flight) > 1, fell)
        self._in_flight.popleft()
        self.acked_on_connection += 1
        return WindowAcked(count)

    def timed_out(self, host, now: float) -> bool:
        """No ACK came within the timeout.  With several windows in flight and none
        acknowledged on this connection, the reader may not take pipelined windows: fall
        back (True when it did now)."""
        if self.acked_on_connection == 0 and len(self._in_flight) > 1:
            return self.fall_back(host, now)
        return False
