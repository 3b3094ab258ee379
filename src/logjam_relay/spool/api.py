"""What reliable outputs see of the spool.

Every reliable output (Lumberjack, Courier, archive, samwise broker) reads the
spool through its own :class:`SpoolReader`.  Records come back in append order;
an output acknowledges a position once the upstream confirmed everything up to
and including it, and the reader persists that as the output's cursor.  After a
reconnect an output may :meth:`rewind` to the first unacknowledged record.

:class:`MemorySource` is a complete in-memory implementation of the same
interface for unit tests of outputs (no durability).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import trio

#: Record kinds stored in the spool.
KIND_LOGJAM = 0    # frames = [app_env, topic, body, meta24] exactly as published
KIND_SAMWISE = 1   # frames = a samwise publish request, as received


class Position(NamedTuple):
    """Where a record lives: segment number and byte offset of the record in it."""

    segment: int
    offset: int


class Record(NamedTuple):
    position: Position
    kind: int
    frames: list[bytes]


class SpoolReader(Protocol):
    name: str

    def read(self, max_records: int) -> list[Record]:
        """Up to ``max_records`` records from the read position; [] when none. Never blocks.

        A list, or (an output worker's :class:`~logjam_relay.spool.tail.SegmentTail`)
        a read-only sequence of the same records (``RecordBlock``, spool/_recblock.h:
        indexing and iteration give Records; slices and ``+`` give lists)."""

    async def wait(self) -> None:
        """Return when :meth:`read` has something (returns at once if it already has)."""

    def ack(self, upto: Position) -> None:
        """Everything up to and including ``upto`` is acknowledged upstream."""

    def rewind(self) -> None:
        """Next :meth:`read` starts again at the first unacknowledged record."""

    def stats(self) -> dict: ...


class MemorySource:
    """In-memory SpoolReader for tests: ``append()`` records, read/ack/rewind them."""

    def __init__(self, name: str = "mem"):
        self.name = name
        self._records: list[Record] = []
        self._read = 0      # index of next record to read
        self._acked = 0     # index of first unacknowledged record
        self._event = trio.Event()
        self.acked_positions: list[Position] = []

    def append(self, frames: list[bytes], kind: int = KIND_LOGJAM) -> Position:
        pos = Position(0, len(self._records))
        self._records.append(Record(pos, kind, frames))
        self._event.set()
        return pos

    def read(self, max_records: int) -> list[Record]:
        out = self._records[self._read:self._read + max_records]
        self._read += len(out)
        return out

    async def wait(self) -> None:
        while self._read >= len(self._records):
            self._event = trio.Event()
            await self._event.wait()

    def ack(self, upto: Position) -> None:
        idx = upto.offset + 1
        if idx > self._acked:
            self._acked = idx
            self.acked_positions.append(upto)

    def rewind(self) -> None:
        self._read = self._acked

    @property
    def all_acked(self) -> bool:
        return self._acked == len(self._records)

    def stats(self) -> dict:
        return {"backlog_records": len(self._records) - self._acked}
