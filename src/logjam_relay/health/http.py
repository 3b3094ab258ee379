"""A tiny HTTP/1.1 server on trio for /metrics, /healthz and /readyz.

No threads (prometheus_client's own server runs one): each connection is a
task in the relay's nursery, requests are small GETs, responses close the
connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

log = logging.getLogger("logjam_relay.http")

Handler = Callable[[], tuple[int, str, bytes]]   # -> (status, content type, body)

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request",
            503: "Service Unavailable", 500: "Internal Server Error"}
MAX_REQUEST = 8192


class HTTPServer:
    def __init__(self, routes: dict[str, Handler], host: str, port: int):
        self.routes = routes
        self.host = "" if host in ("0.0.0.0", "*") else host
        self.port = port
        self.bound_port: int | None = None
        self.requests = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host=self.host or None)
        self.bound_port = listeners[0].socket.getsockname()[1]
        task_status.started(self.bound_port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(10):
                data = b""
                while b"\r\n\r\n" not in data and b"\n\n" not in data:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        return
                    data += chunk
                    if len(data) > MAX_REQUEST:
                        await self._respond(stream, 400, "text/plain", b"request too large\n")
                        return
                line = data.split(b"\n", 1)[0].decode("latin-1").strip()
                parts = line.split()
                if len(parts) < 2:
                    await self._respond(stream, 400, "text/plain", b"bad request\n")
                    return
                method, target = parts[0], parts[1]
                path = target.split("?", 1)[0]
                self.requests += 1
                handler = self.routes.get(path)
                if handler is None:
                    await self._respond(stream, 404, "text/plain", b"not found\n")
                    return
                if method not in ("GET", "HEAD"):
                    await self._respond(stream, 405, "text/plain", b"GET only\n")
                    return
                try:
                    status, ctype, body = handler()
                except Exception:
                    log.exception("handler for %s failed", path)
                    status, ctype, body = 500, "text/plain", b"internal error\n"
                await self._respond(stream, status, ctype, b"" if method == "HEAD" else body,
                                    length=len(body))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    @staticmethod
    async def _respond(stream, status: int, ctype: str, body: bytes,
                       length: int | None = None) -> None:
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
                f"Content-Type: {ctype}\r\nContent-Length: {len(body) if length is None else length}"
                f"\r\nConnection: close\r\n\r\n").encode()
        await stream.send_all(head + body)
