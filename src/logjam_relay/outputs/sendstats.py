"""What the two network writers (Courier, Lumberjack) count the same way.

:class:`SendStats` is their common base: the events and the *units* (a Lumberjack window,
a Courier payload) sent, resent and acknowledged, the bytes written, the connections, the
refusals and bisections of the poison handling (``outputs/poison.py``), and the round-trip
time of each acknowledged unit (from its send to the ACK that completed it).  The writer
says what happened (:meth:`count_sent`, :meth:`count_acked`); :meth:`send_stats` names the
figures for ``stats()`` (``windows_sent``, ``payload_rtt_last_seconds``, ...:
docs/metrics.md).
"""

from __future__ import annotations


class SendStats:
    """Counters of one network writer; ``UNIT`` names what it sends and gets acknowledged."""

    UNIT = "unit"

    def __init__(self) -> None:
        self.events_sent = 0
        self.events_acked = 0
        self.events_resent = 0
        self.units_sent = 0
        self.units_acked = 0
        self.units_resent = 0
        self.bytes_sent = 0
        self.connections = 0
        self.connect_failures = 0
        self.refusals = 0
        self.bisections = 0
        self.rtt_last = 0.0
        self.rtt_sum = 0.0
        self.rtt_max = 0.0
        self.rtt_count = 0

    def count_sent(self, events: int, nbytes: int, resent: bool = False) -> None:
        """A unit of ``events`` events, ``nbytes`` on the wire, was written (``resent``:
        again, after a reconnect)."""
        self.units_sent += 1
        self.events_sent += events
        self.bytes_sent += nbytes
        if resent:
            self.units_resent += 1
            self.events_resent += events

    def count_acked(self, events: int = 0, units: int = 0,
                    rtt: float | None = None) -> None:
        """``events`` more events and ``units`` more units are acknowledged; ``rtt``: a
        unit's acknowledgement completed ``rtt`` seconds after it was sent."""
        self.events_acked += events
        self.units_acked += units
        if rtt is not None:
            self.rtt_last = rtt
            self.rtt_sum += rtt
            self.rtt_count += 1
            if rtt > self.rtt_max:
                self.rtt_max = rtt

    def send_stats(self) -> dict:
        u = self.UNIT
        return {
            "events_sent": self.events_sent,
            "events_acked": self.events_acked,
            "events_resent": self.events_resent,
            f"{u}s_sent": self.units_sent,
            f"{u}s_acked": self.units_acked,
            f"{u}s_resent": self.units_resent,
            "bytes_sent": self.bytes_sent,
            "connections": self.connections,
            "connect_failures": self.connect_failures,
            "refusals": self.refusals,
            "bisections": self.bisections,
            f"{u}_rtt_last_seconds": self.rtt_last,
            f"{u}_rtt_sum_seconds": self.rtt_sum,
            f"{u}_rtt_max_seconds": self.rtt_max,
            f"{u}_rtt_count": self.rtt_count,
        }
