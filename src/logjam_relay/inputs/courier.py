"""Courier input (log-courier / logjam-relay Courier output): payloads in, spooled, ACKNed."""

from __future__ import annotations

import trio

from ..protocols.courier import Ping
from ..protocols.courier_server import CourierError, InputConnection, Payload
from ..protocols.lumberjack_server import event_cost
from .base import BaseInput
from .mapping import json_event


class CourierInput(BaseInput):
    error_types = (CourierError,)

    async def _connection(self, stream, peer: str) -> None:
        spec = self.spec
        conn = InputConnection(ack_timeout=spec.ack_interval,
                               max_payload_bytes=spec.max_batch_bytes,
                               max_event_bytes=spec.max_event_bytes)
        charged = [0]           # what this connection's buffers hold of self.held
        try:
            await self._serve(conn, stream, peer, charged)
        finally:
            self.held.give(charged[0])

    def charge(self, conn, charged: list) -> None:
        """Charge the change in what ``conn`` buffers; over max_held_bytes: closed."""
        n = conn.held_bytes - charged[0]
        if n > 0 and not self.held.take(n):
            raise CourierError("input_memory", "the input's connections hold max_held_bytes")
        if n < 0:
            self.held.give(-n)
        charged[0] += n

    async def _serve(self, conn, stream, peer: str, charged: list) -> None:
        name, opts = self.name, self.spec.mapping
        clock = trio.current_time
        started = None
        while True:
            try:
                ev = conn.next_event(clock())
            finally:
                out = conn.data_to_send()       # VERS, PONG, ????
                if out:
                    await stream.send_all(out)
            self.charge(conn, charged)
            if ev is None:
                data, started = await self.read_more(stream, conn.busy, started)
                if not data:
                    if conn.busy:
                        raise CourierError("truncated", "connection closed inside a message")
                    return
                conn.receive_data(data)
                self.charge(conn, charged)
                continue
            if type(ev) is Payload:
                started = None
                cost = sum(event_cost(len(e)) for e in ev.events)
                if not self.held.take(cost):
                    raise CourierError("input_memory",
                                       "the input's connections hold max_held_bytes")
                try:
                    acc = [json_event(raw, name, peer, opts) for raw in ev.events]
                    if not await self.spool_and_ack(
                            acc, stream, _Reader(conn, self, charged),
                            conn.keepalive(ev.nonce),
                            lambda ev=ev: conn.ack(ev.nonce, len(ev.events), clock()),
                            len(ev.events), "payload"):
                        return
                finally:
                    acc = None          # noqa: F841 (not held, uncharged, until the next)
                    self.held.give(cost)
            elif isinstance(ev, Ping):
                await stream.send_all(conn.pong())
            else:       # Overloaded: cannot happen (one payload at a time); be safe
                raise CourierError("overloaded", "too many pending payloads")


class _Reader:
    """What :meth:`BaseInput.spool` reads ahead into, charged like every other read."""

    def __init__(self, conn: InputConnection, inp: CourierInput, charged: list):
        self.conn, self.inp, self.charged = conn, inp, charged

    @property
    def buffered(self) -> int:
        return self.conn.reader.buffered

    def receive_data(self, data: bytes) -> None:
        self.conn.receive_data(data)
        self.inp.charge(self.conn, self.charged)
