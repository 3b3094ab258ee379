"""TCP/TLS helpers shared by the upstream writers, the inputs and the test peers (tests/peers/)."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import trio

from ..fdreserve import RESERVE, out_of_fds


def _load_tcp_abort() -> Callable[[int], None] | None:
    try:
        import ctypes
        connect = ctypes.CDLL(None, use_errno=True).connect
    except (OSError, AttributeError):
        return None
    unspec = (ctypes.c_ubyte * 16)()            # struct sockaddr, sa_family = AF_UNSPEC

    def abort(fd: int) -> None:
        connect(fd, unspec, 16)
    return abort


#: ``tcp_abort(fd)``: connect(fd, AF_UNSPEC), a TCP disconnect that does not close the fd
#: (Linux); None where libc cannot be loaded.  The fd guard and the XPUB subscription
#: limit end a peer's connection with it.
tcp_abort = _load_tcp_abort()


@dataclass(frozen=True, slots=True)
class TLSSettings:
    """TLS options of one output (client side)."""

    enabled: bool = True
    ca: str | None = None          # CA bundle file; None = system trust store
    cert: str | None = None        # client certificate (PEM)
    key: str | None = None         # client key (PEM)
    server_name: str | None = None  # SNI / name to verify; None = the host we connect to
    verify: bool = True

    def client_context(self) -> ssl.SSLContext | None:
        if not self.enabled:
            return None
        ctx = ssl.create_default_context(cafile=self.ca)
        if not self.verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


def server_context(cert: str, key: str | None = None, ca: str | None = None,
                   require_client_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    if ca:
        ctx.load_verify_locations(ca)
    if require_client_cert:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


async def connect(host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
                  server_name: str | None = None, nodelay: bool = True) -> trio.abc.Stream:
    """Open a TCP connection (TCP_NODELAY on), wrapped in TLS when a context is given."""
    stream = await trio.open_tcp_stream(host, port)
    if nodelay:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if ssl_context is None:
        return stream
    tls = trio.SSLStream(stream, ssl_context, server_hostname=server_name or host,
                         https_compatible=False)
    try:
        await tls.do_handshake()
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return tls


def parse_hostport(s: str, default_port: int) -> tuple[str, int]:
    """'host', 'host:port', '[v6]:port' -> (host, port)."""
    if s.startswith("["):
        host, _, rest = s[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") else default_port
        return host, port
    if s.count(":") == 1:
        host, port = s.split(":")
        return host, int(port)
    return s, default_port


class RefusingListener(trio.abc.Listener[trio.SocketStream]):
    """A :class:`trio.SocketListener` for :func:`trio.serve_listeners` that copes with
    running out of file descriptors: when ``accept`` fails with ``EMFILE``/``ENFILE``, the
    pending connections are closed at once through the fd reserve (``on_refused`` is
    called for each; the peer sees the connection closed instead of waiting), and while
    that is impossible it waits 0.1 s (trio's own loop would log a traceback every
    0.1 s).  Other errors are left to ``serve_listeners``."""

    def __init__(self, inner: trio.SocketListener, on_refused: Callable[[], None]):
        self.inner = inner
        self.socket = inner.socket
        self.on_refused = on_refused

    async def accept(self) -> trio.SocketStream:
        while True:
            try:
                stream = await self.inner.accept()
            except OSError as e:
                if not out_of_fds(e):
                    raise
            else:
                if RESERVE.held >= RESERVE.size or RESERVE.refill() >= RESERVE.size:
                    return stream
                # out of descriptors with the reserve short (an output worker's restart or
                # the spool took slots, another thread the numbers they freed): the number
                # this connection got becomes a slot again and the peer sees it closed at
                # once -- else idle connections waiting here took every number freed, the
                # reserve stayed empty and the output could never restart (fd test, 1 in 6)
                RESERVE.close_socket(stream.socket)
                self.on_refused()
                continue
            try:
                refused = RESERVE.refuse(self.socket.fileno(), RESERVE.keep(0.75))
            except OSError:
                refused = False
            if refused:
                self.on_refused()
            else:
                await trio.sleep(0.1)

    async def aclose(self) -> None:
        await self.inner.aclose()
