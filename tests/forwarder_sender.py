"""A Lumberjack v1 sender that behaves like logstash-forwarder (0.4, ``publisher1.go``).

What matters about it for a receiver (read in elastic/logstash-forwarder ``publisher1.go``
and ``config.go``):

* one window at a time: ``1W n`` then ONE ``1C`` frame (zlib level 3) of ``1D`` frames;
  the data-frame sequence numbers run on across windows (they do not restart at 1);
* the whole request (writing the window and reading the ACK) has one deadline,
  ``timeout`` (network ``timeout``, 15 s by default);
* it reads until it has **any** 6 bytes and takes them as the ACK of the whole window
  ("TODO(sissel): verify ack"): a ``2A 0`` keep-alive acknowledges everything; the
  window's events then go to the registrar (``registry`` here), which is what the
  forwarder will never send again;
* on a write error (a deadline counts) it sleeps 1 s, closes and reconnects; on a read
  error it closes and reconnects; either way it then sends the **same** window again
  (same compressed bytes); a failed connect is retried every second.

The registry is a list of the lines the sender considers delivered; ``run()`` can be
cancelled and called again (a relay restart: the forwarder keeps running and resends the
window it was on).
"""

from __future__ import annotations

import socket
import struct
import zlib
from collections import Counter

import trio

from logjam_relay.protocols import lumberjack as lj

HOST_FIELD = "forwarder-host"


class ForwarderLikeSender:
    def __init__(self, port: int, lines: list[str], *, window: int = 512,
                 timeout: float = 15.0, host: str = "127.0.0.1",
                 fields: dict[str, str] | None = None):
        self.port, self.host = port, host
        self.lines = lines
        self.window = window
        self.timeout = timeout
        self.fields = dict(fields or {})
        self.registry: list[str] = []       # acked, as the forwarder's registrar sees it
        self.next = 0                       # index of the first line not acked
        self.sequence = 0
        self._payload: bytes | None = None  # the window being sent (built once)
        self._count = 0
        self.windows_sent = 0               # every time a window was written (resends too)
        self.timeouts = 0                   # requests that hit the deadline
        self.errors = 0                     # other read/write errors (closed by the peer)
        self.connects = 0
        self.acks: Counter[bytes] = Counter()   # the 6 bytes taken as ACK, by value
        self.stream: trio.SocketStream | None = None

    @property
    def done(self) -> bool:
        return self.next >= len(self.lines)

    def _build(self) -> None:
        if self._payload is not None:
            return
        batch = self.lines[self.next:self.next + self.window]
        frames = []
        for i, line in enumerate(batch):
            self.sequence += 1
            ev = {"file": "/var/log/app.log", "host": HOST_FIELD,
                  "offset": str(self.next + i), "line": line, **self.fields}
            frames.append(lj.encode_data_frame(self.sequence, ev.items()))
        c = zlib.compressobj(3)
        payload = c.compress(b"".join(frames)) + c.flush()
        self._payload = (b"1W" + struct.pack(">I", len(batch)) + b"1C"
                         + struct.pack(">I", len(payload)) + payload)
        self._count = len(batch)

    async def _connect(self) -> None:
        while True:
            try:
                with trio.fail_after(self.timeout):
                    self.stream = await trio.open_tcp_stream(self.host, self.port)
                self.stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.connects += 1
                return
            except (OSError, trio.TooSlowError):
                await trio.sleep(1.0)

    async def _close(self) -> None:
        if self.stream is not None:
            await trio.aclose_forcefully(self.stream)
            self.stream = None

    async def _request(self) -> bytes | None:
        """Write the window and read 6 bytes within ``timeout``; None on any failure."""
        assert self.stream is not None and self._payload is not None
        with trio.move_on_after(self.timeout) as cs:
            try:
                self.windows_sent += 1
                await self.stream.send_all(self._payload)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self.errors += 1
                await trio.sleep(1.0)               # oops(): sleep 1 s, reconnect
                return None
            got = b""
            try:
                while len(got) < 6:
                    chunk = await self.stream.receive_some(6 - len(got))
                    if not chunk:
                        self.errors += 1
                        return None
                    got += chunk
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self.errors += 1
                return None
            return got
        if cs.cancelled_caught:
            self.timeouts += 1
        return None

    async def run(self) -> None:
        """Send every line, window by window, until all are in the registry."""
        while not self.done:
            self._build()
            while True:
                if self.stream is None:
                    await self._connect()
                ack = await self._request()
                if ack is not None:
                    break
                await self._close()                 # reconnect and send it again
            self.acks[ack] += 1
            self.registry.extend(self.lines[self.next:self.next + self._count])
            self.next += self._count
            self._payload = None
        await self._close()

    def stats(self) -> dict:
        return {"registry": len(self.registry), "windows_sent": self.windows_sent,
                "timeouts": self.timeouts, "errors": self.errors, "connects": self.connects,
                "acks": {k.hex(): v for k, v in self.acks.items()}}
