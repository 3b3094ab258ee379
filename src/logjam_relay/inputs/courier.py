"""Courier input (log-courier / logjam-relay Courier output): payloads in, spooled, ACKNed."""

from __future__ import annotations

import trio

from ..protocols.courier import Ping
from ..protocols.courier_server import CourierError, InputConnection, Payload
from .base import BaseInput, _Closed
from .mapping import json_event


class CourierInput(BaseInput):
    error_types = (CourierError,)

    async def _connection(self, stream, peer: str) -> None:
        spec = self.spec
        conn = InputConnection(ack_timeout=spec.ack_interval,
                               max_payload_bytes=spec.max_batch_bytes,
                               max_event_bytes=spec.max_event_bytes)
        name, opts = self.name, spec.mapping
        clock = trio.current_time
        started = None
        while True:
            try:
                ev = conn.next_event(clock())
            finally:
                out = conn.data_to_send()       # VERS, PONG, ????
                if out:
                    await stream.send_all(out)
            if ev is None:
                data, started = await self.read_more(stream, conn.busy, started)
                if not data:
                    if conn.busy:
                        raise CourierError("truncated", "connection closed inside a message")
                    return
                conn.receive_data(data)
                continue
            if type(ev) is Payload:
                started = None
                acc = [json_event(raw, name, peer, opts) for raw in ev.events]
                if not await self.spool_and_ack(
                        acc, stream, conn.reader, conn.keepalive(ev.nonce),
                        lambda ev=ev: conn.ack(ev.nonce, len(ev.events), clock()),
                        len(ev.events), "payload"):
                    return
            elif isinstance(ev, Ping):
                await stream.send_all(conn.pong())
            else:       # Overloaded: cannot happen (one payload at a time); be safe
                raise _Closed("overloaded", "too many pending payloads")
