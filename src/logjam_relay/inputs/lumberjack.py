"""Lumberjack input (v1 and v2/Beats): windows in, spooled, then ACKed."""

from __future__ import annotations

from ..protocols import lumberjack_server as ljs
from .base import BaseInput
from .mapping import json_event, lumberjack_v1


class LumberjackInput(BaseInput):
    error_types = (ljs.LumberjackError,)

    async def _connection(self, stream, peer: str) -> None:
        spec = self.spec
        conn = ljs.ServerConnection(max_window=spec.max_window,
                                    max_event_bytes=spec.max_event_bytes,
                                    max_window_bytes=spec.max_batch_bytes, budget=self.held)
        try:
            await self._serve(conn, stream, peer)
        finally:
            conn.release()

    async def _serve(self, conn, stream, peer: str) -> None:
        spec = self.spec
        name, opts = self.name, spec.mapping
        started = None              # when the first byte of the current window arrived
        while True:
            ev = conn.next_event()
            if ev is ljs.NEED_DATA:
                data, started = await self.read_more(stream, conn.buffered or conn.in_window,
                                                     started)
                conn.receive_data(data)
                continue
            if type(ev) is ljs.WindowReceived:
                started = None
                try:
                    if ev.version == 1:
                        acc = [lumberjack_v1(f, name, peer, opts) for f in ev.events]
                    else:
                        acc = [json_event(raw, name, peer, opts) for raw in ev.events]
                    if ev.dropped:
                        self.errors["events_beyond_window"] += ev.dropped
                    # v1: nothing is sent until the window is spooled (keepalive() is None)
                    if not await self.spool_and_ack(acc, stream, conn, conn.keepalive(),
                                                    lambda ev=ev: conn.ack(ev.count),
                                                    ev.count, "window"):
                        return
                finally:
                    acc = None          # noqa: F841 (not held, uncharged, until the next)
                    self.held.give(ev.charged)
                continue
            return      # ConnectionClosed
