"""RabbitMQ connections on trio, driven by the sans-IO core ``protocols/amqp.py``.

:class:`Conn` is one AMQP connection (TCP or TLS stream + :class:`AmqpClient`).
:class:`Link` is the publishing connection of one broker: it connects (with backoff,
forever), opens channel 1 in confirm mode and channel 2 for passive exchange checks,
publishes what :class:`~.output.BrokerOutput` gives it and reports back through
``on_events(list)``, called synchronously on the trio thread:

``("up", gen)``, ``("down", gen, reason)``, ``("confirms", gen, [(seq, result), ...])``.

Everything runs on the relay's trio thread: no pika thread, no thread hop per publish
(the reason a single REQ client was slower than samd; see docs/samwise.md).
"""

from __future__ import annotations

import collections
import logging
import os
import ssl
import time
from dataclasses import dataclass

import trio

from ..protocols import amqp as A
from ..ratelimit import RateLimitedLog
from .config import BrokerConfig

log = logging.getLogger("logjam_relay.samwise.amqp")
_rl = RateLimitedLog(log)

# Results of one publish at one broker.
ACK = "ack"              # confirmed
RETURNED = "returned"    # mandatory and unroutable: basic.return then basic.ack
NO_EXCHANGE = "no_exchange"  # the exchange does not exist on this broker: dropped
NACK = "nack"            # broker-internal error: re-sent after a reconnect

NEGATIVE_CACHE_S = 1.0   # a missing exchange is re-checked at most once a second
PUB_CH, CHECK_CH = 1, 2
RECV_BYTES = 256 * 1024


class LinkDown(Exception):
    """The connection (or its publishing channel) is gone; the text is the reason."""


def _closed_text(ev) -> str:
    return f"{ev.reply_code} {ev.reply_text}"


class Conn:
    """One AMQP connection: ``await open()``, then ``receive()`` / ``send()``."""

    def __init__(self, cfg: BrokerConfig, purpose: str = ""):
        self.cfg = cfg
        self.client = A.AmqpClient(
            cfg.user, cfg.password, cfg.vhost, heartbeat=cfg.heartbeat,
            client_properties={"connection_name": f"logjam-relay samwise {cfg.name}{purpose}"})
        self.stream: trio.abc.Stream | None = None
        self.last_recv = time.monotonic()
        self.pending: list = []     # events that came after the one expect() waited for

    async def open(self) -> A.ConnectionOpen:
        """TCP (+TLS) connect and the AMQP handshake, within ``connect_timeout`` each."""
        cfg = self.cfg
        with trio.fail_after(cfg.connect_timeout):
            stream = await trio.open_tcp_stream(cfg.host, cfg.port)
        self.stream = stream
        with trio.fail_after(cfg.connect_timeout * 2):
            if cfg.tls:
                stream = trio.SSLStream(stream, ssl.create_default_context(),
                                        server_hostname=cfg.host)
                self.stream = stream
                await stream.do_handshake()
            self.client.start()
            await self.send()
            while True:
                for ev in await self.receive():
                    if isinstance(ev, A.ConnectionOpen):
                        return ev
                    if isinstance(ev, A.ConnectionClosed):
                        raise LinkDown(f"refused: {_closed_text(ev)}")
                await self.send()

    async def receive(self) -> list:
        fd = self.raw_fd()
        if fd >= 0:
            # plain TCP: wait, then read(2) -- one pass through the scheduler per
            # arrival (SocketStream.receive_some tries first, then waits, then yields
            # again: two passes and an EAGAIN for every batch of confirms)
            await trio.lowlevel.wait_readable(fd)
            try:
                data = os.read(fd, RECV_BYTES)
            except BlockingIOError:
                return []                 # a spurious wake-up: the caller reads again
        else:
            data = await self.stream.receive_some(RECV_BYTES)
        if not data:
            raise LinkDown("connection closed by the broker")
        self.last_recv = time.monotonic()
        return self.client.receive_data(data)

    async def send(self) -> None:
        data = self.client.data_to_send()
        if data:
            await self.stream.send_all(data)

    def raw_fd(self) -> int:
        """The socket's descriptor for a direct non-blocking write, or -1 (TLS, closed)."""
        stream = self.stream
        if type(stream) is not trio.SocketStream:
            return -1
        return stream.socket.fileno()

    async def expect(self, channel: int, *kinds):
        """Send what is queued, then read until an event of ``kinds`` on ``channel``;
        a close of that channel or of the connection raises :class:`LinkDown`."""
        await self.send()
        while True:
            evs = self.pending or await self.receive()
            self.pending = []
            for i, ev in enumerate(evs):
                if isinstance(ev, A.ConnectionClosed):
                    raise LinkDown(_closed_text(ev))
                if getattr(ev, "channel", None) != channel:
                    continue
                if isinstance(ev, kinds):
                    self.pending = evs[i + 1:]
                    return ev
                if isinstance(ev, A.ChannelClosed):
                    raise LinkDown(_closed_text(ev))
            await self.send()

    async def aclose(self, graceful: float = 0.5) -> None:
        """Close politely (connection.close, wait close-ok) for at most ``graceful`` s."""
        stream, self.stream = self.stream, None
        if stream is None:
            return
        with trio.CancelScope(shield=True):
            if self.client.state == "open" and graceful > 0:
                with trio.move_on_after(graceful):
                    self.stream = stream
                    try:
                        self.client.close()
                        await self.send()
                        while self.client.state != "closed":
                            await self.receive()
                    except Exception:
                        pass
                    self.stream = None
            try:
                await trio.aclose_forcefully(stream)
            except Exception:
                pass


@dataclass(slots=True)
class Out:
    """One publish handed to the link."""
    seq: int
    exchange: str
    exchange_b: bytes       # shortstr-encoded
    routing_key_b: bytes    # shortstr-encoded
    body: bytes
    properties: bytes       # encoded basic properties
    mandatory: bool
    routing_key: str = ""


class Link:
    """The publishing connection of one broker (see the module docstring)."""

    def __init__(self, cfg: BrokerConfig, on_events):
        self.cfg = cfg
        self._on_events = on_events
        self._stopping = False
        self.gen = 0
        self.ready = False
        self._conn: Conn | None = None
        self._session_scope: trio.CancelScope | None = None
        self._backoff = cfg.backoff_min
        self._wake_writer = trio.Event()
        self._writing = False                    # the writer task is in send_all
        self._leftover = b""                     # what a direct write could not send
        self._tag = 0
        self._tags: dict[int, int] = {}          # delivery tag -> seq
        self._low = 1                            # lowest tag possibly unconfirmed
        self._mandatory: dict[int, Out] = {}     # tag -> message, for basic.return matching
        self._returned: set[int] = set()
        self._outq: collections.deque[Out] = collections.deque()
        self._known: set[str] = set()            # exchanges that exist
        self._missing: dict[str, float] = {}     # exchange -> time found missing
        self._check_open = False
        self._checking: str | None = None
        self.blocked = False
        self.amqp_errors: collections.Counter[str] = collections.Counter()  # by reason

    # ------------------------------------------------------------ API (trio thread)

    def publish(self, gen: int, items: list[Out]) -> None:
        if gen != self.gen or not self.ready:
            return  # the output learns "down" and re-sends from the spool
        self._outq.extend(items)
        self._pump()

    def reconnect(self, gen: int, reason: str) -> None:
        if gen == self.gen and self._session_scope is not None:
            self._down_reason = reason
            self._session_scope.cancel()

    # ------------------------------------------------------------ life cycle

    async def run(self) -> None:
        """Connect, serve, reconnect with backoff; forever (until cancelled)."""
        try:
            while True:
                self.gen += 1
                gen = self.gen
                self._down_reason = None
                try:
                    with trio.CancelScope() as scope:
                        self._session_scope = scope
                        await self._session(gen)
                    reason = self._down_reason or "session ended"
                except _SESSION_ERRORS as e:
                    reason = down_reason(e, self._conn is not None and self._conn.client.state)
                    if isinstance(e, A.AmqpError):
                        self.amqp_errors[e.reason] += 1
                finally:
                    self._session_scope = None
                    conn, self._conn = self._conn, None
                    if conn is not None:
                        # polite connection.close when the peer is still there (also on
                        # shutdown); shielded, at most 0.2 s for a dead peer
                        await conn.aclose(graceful=0.2)
                self._set_down(gen, reason)
                delay = self._backoff
                self._backoff = min(self.cfg.backoff_max, self._backoff * 2)
                _rl.warning(f"retry-{self.cfg.name}", "samwise broker %s: %s; retry in %.1fs",
                            self.cfg.name, reason, delay)
                await trio.sleep(delay)
        finally:
            self._stopping = True
            conn, self._conn = self._conn, None
            if conn is not None:
                await conn.aclose(graceful=0.5)

    async def _session(self, gen: int) -> None:
        conn = Conn(self.cfg)
        self._conn = conn
        opened = await conn.open()
        conn.client.open_channel(PUB_CH)
        await conn.expect(PUB_CH, A.ChannelOpenOk)
        conn.client.confirm_select(PUB_CH)
        await conn.expect(PUB_CH, A.ConfirmSelectOk)
        self._tag = 0
        self._low = 1
        self._tags.clear()
        self._mandatory.clear()
        self._returned.clear()
        self._known.clear()
        self._missing.clear()
        self._outq.clear()
        self._check_open = False
        self._checking = None
        self._writing = False
        self._leftover = b""
        self._backoff = self.cfg.backoff_min
        self.blocked = False
        self.ready = True
        log.info("samwise broker %s: connected to %s", self.cfg.name, self.cfg.display)
        self._on_events([("up", gen)])
        try:
            async with trio.open_nursery() as n:
                n.start_soon(self._writer, conn)
                if opened.heartbeat:
                    n.start_soon(self._heartbeat, conn, opened.heartbeat)
                await self._reader(conn)
        except BaseExceptionGroup as eg:
            # the reader's or writer's own failure, not the nursery's wrapping
            leaf = _first_leaf(eg, _SESSION_ERRORS)
            if leaf is None:
                raise
            raise leaf from None

    def _set_down(self, gen: int, reason: str) -> None:
        was = self.ready
        self.ready = False
        self._outq.clear()
        self._checking = None
        self._check_open = False
        if was and not self._stopping:
            _rl.warning(f"down-{self.cfg.name}", "samwise broker %s: down: %s",
                        self.cfg.name, reason)
        self._on_events([("down", gen, reason)])

    async def _writer(self, conn: Conn) -> None:
        """Sends what :meth:`_flush` could not write at once (TLS, a full socket buffer)."""
        client = conn.client
        while True:
            data = self._leftover or client.data_to_send()
            if data:
                self._leftover = b""
                self._writing = True
                try:
                    await conn.stream.send_all(data)
                finally:
                    self._writing = False
                continue
            await self._wake_writer.wait()
            self._wake_writer = trio.Event()

    def _kick(self) -> None:
        self._wake_writer.set()

    def _flush(self) -> None:
        """Send what the core queued.  On plain TCP, with the writer task idle, it is
        written here at once (non-blocking): a batch of publishes costs one write(2)
        and no task switch.  The rest, and anything on TLS, goes through the writer
        task, which also reports a failed connection."""
        conn = self._conn
        if conn is None:
            return
        if self._writing or self._leftover:
            self._kick()
            return
        fd = conn.raw_fd()
        if fd < 0:
            self._kick()
            return
        data = conn.client.data_to_send()
        if not data:
            return
        try:
            n = os.write(fd, data)
        except OSError:           # EAGAIN, or an error the writer's send_all reports
            n = 0
        if n < len(data):
            self._leftover = data[n:]
            self._kick()

    async def _heartbeat(self, conn: Conn, interval: int) -> None:
        while True:
            await trio.sleep(interval / 2)
            if time.monotonic() - conn.last_recv > 2 * interval:
                self._down_reason = f"no data from the broker for {2 * interval} s (heartbeats)"
                self._session_scope.cancel()
                return
            conn.client.heartbeat()
            self._flush()

    async def _reader(self, conn: Conn) -> None:
        gen = self.gen
        while True:
            evs = conn.pending or await conn.receive()
            conn.pending = []
            confirms = None
            for ev in evs:
                t = type(ev)
                if t is A.Ack or t is A.Nack:
                    if ev.channel == PUB_CH:
                        c = self._on_confirm(ev.delivery_tag, ev.multiple, t is A.Ack)
                        if c:
                            if confirms is None:
                                confirms = c
                            else:
                                confirms += c
                elif t is A.Returned:
                    self._on_return(ev)
                elif t is A.ChannelClosed:
                    if ev.channel == CHECK_CH:
                        self._check_closed(ev)
                    else:
                        raise LinkDown(f"channel closed: {_closed_text(ev)}")
                elif t is A.ChannelOpenOk and ev.channel == CHECK_CH:
                    self._check_open = True
                    if self._checking is not None:
                        conn.client.exchange_declare(CHECK_CH, self._checking, passive=True)
                elif t is A.ExchangeDeclareOk and ev.channel == CHECK_CH:
                    self._check_done(self._checking, True)
                elif t is A.ConnectionClosed:
                    raise LinkDown(f"connection closed: {_closed_text(ev)}")
                elif t is A.ConnectionBlocked:
                    self.blocked = True
                    _rl.warning(f"blocked-{self.cfg.name}", "samwise broker %s: blocked by the "
                                "broker: %s", self.cfg.name, ev.reason)
                elif t is A.ConnectionUnblocked:
                    self.blocked = False
            if confirms:
                self._on_events([("confirms", gen, confirms)])
            self._flush()   # replies the core queued (close-ok, flow-ok) and new publishes

    # --- publishing

    def _pump(self) -> None:
        q = self._outq
        conn = self._conn
        if conn is None:
            return
        client = conn.client
        known = self._known
        sent = False
        while q and self.ready:
            m = q[0]
            if m.exchange not in known:
                t = self._missing.get(m.exchange)
                if t is not None and time.monotonic() - t < NEGATIVE_CACHE_S:
                    q.popleft()
                    self._on_events([("confirms", self.gen, [(m.seq, NO_EXCHANGE)])])
                    continue
                self._check_exchange(m.exchange)
                break
            q.popleft()
            client.publish(PUB_CH, m.exchange_b, m.routing_key_b, m.body, m.properties,
                           m.mandatory)
            sent = True
            self._tag += 1
            self._tags[self._tag] = m.seq
            if m.mandatory:
                self._mandatory[self._tag] = m
        if sent or self._checking is not None:
            self._flush()

    def _check_exchange(self, name: str) -> None:
        """Passive declare on a side channel: a missing exchange closes only that channel."""
        if self._checking is not None:
            return
        self._checking = name
        client = self._conn.client
        if self._check_open:
            client.exchange_declare(CHECK_CH, name, passive=True)
        else:
            client.open_channel(CHECK_CH)
        self._flush()

    def _check_closed(self, ev: A.ChannelClosed) -> None:
        self._check_open = False
        name = self._checking
        if name is None:
            return
        if ev.reply_code == A.NOT_FOUND:
            self._check_done(name, False)
        else:
            raise LinkDown(f"check channel closed: {_closed_text(ev)}")

    def _check_done(self, name: str | None, exists: bool) -> None:
        if name is None or self._checking != name:
            return
        self._checking = None
        if exists:
            self._known.add(name)
            self._missing.pop(name, None)
        else:
            self._missing[name] = time.monotonic()
        self._pump()

    def _on_return(self, ev: A.Returned) -> None:
        # basic.return carries no delivery tag; RabbitMQ sends it right before the
        # basic.ack of that message.  Match on exchange, routing key and body
        # (identical messages route identically, so any of them is right).
        for tag, m in self._mandatory.items():
            if (tag not in self._returned and m.body == ev.body and m.exchange == ev.exchange
                    and m.routing_key == ev.routing_key):
                self._returned.add(tag)
                return
        _rl.warning("unmatched-return", "samwise broker %s: unmatched basic.return",
                    self.cfg.name)

    def _on_confirm(self, tag: int, multiple: bool, ok: bool) -> list:
        tags = range(self._low, tag + 1) if multiple else (tag,)
        out = []
        pop = self._tags.pop
        mand = self._mandatory
        r = ACK if ok else NACK
        for t in tags:
            seq = pop(t, None)
            if seq is None:
                continue
            if mand and mand.pop(t, None) is not None and t in self._returned:
                self._returned.discard(t)
                out.append((seq, RETURNED))
                continue
            out.append((seq, r))
        if multiple:
            self._low = tag + 1
        else:
            while self._low <= self._tag and self._low not in self._tags:
                self._low += 1
        return out


_SESSION_ERRORS = (OSError, trio.TooSlowError, trio.BrokenResourceError,
                   trio.ClosedResourceError, A.AmqpError, LinkDown, ValueError)


def _first_leaf(eg: BaseExceptionGroup, types) -> BaseException | None:
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            leaf = _first_leaf(e, types)
            if leaf is not None:
                return leaf
        elif isinstance(e, types):
            return e
    return None


def down_reason(e: BaseException, state) -> str:
    if isinstance(e, trio.TooSlowError):
        return "connect failed: timeout"
    if isinstance(e, OSError):
        return f"connect failed: {e.strerror or e!r}" if state in (None, "idle", "handshake") \
            else f"connection lost: {e.strerror or e!r}"
    if isinstance(e, A.AmqpError):
        return f"protocol error ({e.reason}): {e.message}"
    if isinstance(e, trio.BrokenResourceError | trio.ClosedResourceError):
        return f"connection lost: {e!r}"
    return str(e)
