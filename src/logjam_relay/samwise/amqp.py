"""RabbitMQ backend: one broker = one pika ``SelectConnection`` on its own thread.

Why pika's SelectConnection on a dedicated thread (and not a BlockingConnection
or aiormq):

* publisher confirms must be pipelined (thousands in flight); a
  BlockingChannel with confirms waits one round trip per message;
* aiormq's ``basic_publish`` runs a lock and a task per message and adds a
  random ``message_id`` to every message that has none (it would alter what
  the client sent), and driving it from trio needs trio-asyncio or an asyncio
  thread anyway;
* pika's IOLoop offers exactly one documented thread-safe entry point,
  ``add_callback_threadsafe``, and trio offers ``TrioToken.run_sync_soon``:
  neither side ever blocks the other.

:class:`AmqpLink` lives on the pika thread (everything in it except
``start``/``publish``/``rpc``/``reconnect``/``request_stop`` runs there).
:class:`BrokerOutput` is the trio side: it reads its spool reader, publishes
the records addressed to its broker, tracks confirms and acknowledges the
spool in order.  The thread is started and joined inside ``BrokerOutput.run``,
so it never outlives the nursery that runs it.
"""

from __future__ import annotations

import collections
import logging
import ssl
import threading
import time
from dataclasses import dataclass

import pika
import trio
from pika import spec
from pika.adapters.select_connection import IOLoop

from ..protocols import samwise as proto
from ..ratelimit import RateLimitedLog
from ..spool.api import KIND_SAMWISE, SpoolReader
from .config import BrokerConfig

log = logging.getLogger("logjam_relay.samwise.amqp")
# pika logs several ERROR lines per failed connection attempt; we log (rate limited)
# ourselves, so quiet it unless someone configured the "pika" logger explicitly.
if logging.getLogger("pika").level == logging.NOTSET:
    logging.getLogger("pika").setLevel(logging.CRITICAL)
_rl = RateLimitedLog(log)

# Results of one publish at one broker.
ACK = "ack"              # confirmed
RETURNED = "returned"    # mandatory and unroutable: basic.return then basic.ack
NO_EXCHANGE = "no_exchange"  # the exchange does not exist on this broker: dropped
NACK = "nack"            # broker-internal error: re-sent after a reconnect

NEGATIVE_CACHE_S = 1.0   # a missing exchange is re-checked at most once a second


def pika_parameters(cfg: BrokerConfig) -> pika.ConnectionParameters:
    kw = {}
    if cfg.tls:
        kw["ssl_options"] = pika.SSLOptions(ssl.create_default_context(), cfg.host)
    return pika.ConnectionParameters(
        host=cfg.host, port=cfg.port, virtual_host=cfg.vhost,
        credentials=pika.PlainCredentials(cfg.user, cfg.password),
        heartbeat=cfg.heartbeat, socket_timeout=cfg.connect_timeout,
        stack_timeout=cfg.connect_timeout * 2, blocked_connection_timeout=None,
        connection_attempts=1, client_properties={"connection_name": f"logjam-relay samwise {cfg.name}"},
        **kw,
    )


def basic_properties(ev: proto.Publish) -> spec.BasicProperties:
    """The AMQP properties and headers that samd parses but never sends."""
    p = ev.properties
    headers = None
    if ev.headers:
        headers = {}
        for k, v in ev.headers:
            try:
                headers[k] = v.decode("utf-8")
            except UnicodeDecodeError:
                headers[k] = v        # sent as an AMQP byte array ('x')
    return spec.BasicProperties(
        content_type=p.content_type, content_encoding=p.content_encoding, headers=headers,
        delivery_mode=p.delivery_mode, priority=p.priority, correlation_id=p.correlation_id,
        reply_to=p.reply_to, expiration=p.expiration, message_id=p.message_id, type=p.type,
        user_id=p.user_id, app_id=p.app_id, cluster_id=p.cluster_id,
    )


@dataclass(slots=True)
class _Out:
    seq: int
    exchange: str
    routing_key: str
    body: bytes
    properties: spec.BasicProperties
    mandatory: bool


class AmqpLink:
    """The pika side of one broker.  Events go to ``on_events(list)`` on the trio thread:

    ``("up", gen)``, ``("down", gen, reason)``, ``("confirms", gen, [(seq, result), ...])``,
    ``("rpc", rpc_id, error_or_None)``, ``("stopped",)``.
    """

    def __init__(self, cfg: BrokerConfig, token: trio.lowlevel.TrioToken, on_events):
        self.cfg = cfg
        self._params = pika_parameters(cfg)
        self._token = token
        self._on_events = on_events
        self._lock = threading.Lock()
        self._events: list = []
        self._flush_scheduled = False
        self.ioloop = IOLoop()
        self.thread = threading.Thread(target=self._main, name=f"samwise-amqp-{cfg.name}",
                                       daemon=True)
        # --- pika-thread state
        self._stopping = False
        self._gen = 0
        self._conn = None
        self._ch = None
        self._ready = False
        self._backoff = cfg.backoff_min
        self._tag = 0
        self._tags: dict[int, int] = {}          # delivery tag -> seq
        self._low = 1                            # lowest tag possibly unconfirmed
        self._mandatory: dict[int, _Out] = {}    # tag -> message, for basic.return matching
        self._returned: set[int] = set()
        self._outq: collections.deque[_Out] = collections.deque()
        self._known: set[str] = set()            # exchanges that exist
        self._missing: dict[str, float] = {}     # exchange -> time found missing
        self._check_ch = None
        self._checking: str | None = None
        self._rpc_conns: set = set()

    # ------------------------------------------------------------ trio side API

    def start(self) -> None:
        self.thread.start()

    def publish(self, gen: int, items: list[_Out]) -> None:
        self.ioloop.add_callback_threadsafe(lambda: self._publish(gen, items))

    def rpc(self, rpc_id: int, method: str, exchange: str, exchange_type: str, timeout: float):
        self.ioloop.add_callback_threadsafe(
            lambda: self._rpc(rpc_id, method, exchange, exchange_type, timeout))

    def reconnect(self, gen: int, reason: str) -> None:
        self.ioloop.add_callback_threadsafe(lambda: self._drop(gen, reason))

    def request_stop(self) -> None:
        try:
            self.ioloop.add_callback_threadsafe(self._stop)
        except Exception:  # ioloop already closed
            pass

    # ------------------------------------------------------------ event delivery

    def _emit(self, ev) -> None:
        with self._lock:
            self._events.append(ev)
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        try:
            self._token.run_sync_soon(self._deliver)
        except trio.RunFinishedError:
            pass

    def _deliver(self) -> None:  # trio thread
        with self._lock:
            evs, self._events = self._events, []
            self._flush_scheduled = False
        self._on_events(evs)

    # ------------------------------------------------------------ pika thread

    def _main(self) -> None:
        try:
            self._connect()
            self.ioloop.start()
        except Exception:
            log.exception("samwise broker %s: pika thread crashed", self.cfg.name)
        finally:
            try:
                self.ioloop.close()
            except Exception:
                pass
            self._emit(("stopped",))

    def _connect(self) -> None:
        if self._stopping:
            return
        self._gen += 1
        gen = self._gen
        self._conn = pika.SelectConnection(
            self._params,
            on_open_callback=lambda c: self._on_open(gen, c),
            on_open_error_callback=lambda c, e: self._on_closed(gen, f"connect failed: {e!r}"),
            on_close_callback=lambda c, e: self._on_closed(gen, f"connection closed: {e!r}"),
            custom_ioloop=self.ioloop,
        )

    def _on_open(self, gen, conn) -> None:
        conn.channel(on_open_callback=lambda ch: self._on_channel(gen, ch))

    def _on_channel(self, gen, ch) -> None:
        if gen != self._gen:
            return
        self._ch = ch
        ch.add_on_close_callback(lambda c, e: self._drop(gen, f"channel closed: {e!r}"))
        ch.add_on_return_callback(self._on_return)
        ch.confirm_delivery(self._on_confirm, callback=lambda _f: self._on_confirm_ok(gen))

    def _on_confirm_ok(self, gen) -> None:
        if gen != self._gen:
            return
        self._ready = True
        self._tag = 0
        self._low = 1
        self._tags.clear()
        self._mandatory.clear()
        self._returned.clear()
        self._known.clear()
        self._missing.clear()
        self._backoff = self.cfg.backoff_min
        log.info("samwise broker %s: connected to %s", self.cfg.name, self.cfg.display)
        self._emit(("up", gen))

    def _drop(self, gen, reason) -> None:
        """Give up the current connection (it is re-opened by _on_closed)."""
        if gen != self._gen:
            return
        self._set_down(gen, reason)
        conn = self._conn
        if conn is not None and conn.is_open:
            try:
                conn.close()
            except Exception:
                pass

    def _set_down(self, gen, reason) -> None:
        was = self._ready
        self._ready = False
        self._ch = None
        self._check_ch = None
        self._checking = None
        self._outq.clear()
        if was and not self._stopping:
            _rl.warning(f"down-{self.cfg.name}", "samwise broker %s: down: %s", self.cfg.name, reason)
        self._emit(("down", gen, reason))

    def _on_closed(self, gen, reason) -> None:
        if gen != self._gen:
            return
        self._set_down(gen, reason)
        self._conn = None
        if self._stopping:
            self.ioloop.stop()
            return
        delay = self._backoff
        self._backoff = min(self.cfg.backoff_max, self._backoff * 2)
        _rl.warning(f"retry-{self.cfg.name}", "samwise broker %s: %s; retry in %.1fs",
                    self.cfg.name, reason, delay)
        self.ioloop.call_later(delay, self._connect)

    def _stop(self) -> None:
        self._stopping = True
        for c in list(self._rpc_conns):
            try:
                c.close()
            except Exception:
                pass
        conn = self._conn
        if conn is not None and (conn.is_open or conn.is_opening):
            try:
                conn.close()
            except Exception:
                self.ioloop.stop()
                return
            # _on_closed stops the loop; don't wait for a dead peer forever
            self.ioloop.call_later(1.0, self.ioloop.stop)
        else:
            self.ioloop.stop()

    # --- publishing

    def _publish(self, gen, items) -> None:
        if gen != self._gen or not self._ready:
            return  # the trio side learns "down" and re-sends from the spool
        self._outq.extend(items)
        self._pump()

    def _pump(self) -> None:
        q = self._outq
        ch = self._ch
        known = self._known
        while q and self._ready:
            m = q[0]
            if m.exchange not in known:
                t = self._missing.get(m.exchange)
                if t is not None and time.monotonic() - t < NEGATIVE_CACHE_S:
                    q.popleft()
                    self._emit(("confirms", self._gen, [(m.seq, NO_EXCHANGE)]))
                    continue
                self._check_exchange(m.exchange)
                return
            q.popleft()
            try:
                ch.basic_publish(m.exchange, m.routing_key, m.body, m.properties, m.mandatory)
            except Exception as e:
                self._drop(self._gen, f"publish failed: {e!r}")
                return
            self._tag += 1
            self._tags[self._tag] = m.seq
            if m.mandatory:
                self._mandatory[self._tag] = m

    def _check_exchange(self, name: str) -> None:
        """Passive declare on a side channel: a missing exchange closes only that channel."""
        if self._checking is not None:
            return
        self._checking = name
        ch = self._check_ch
        if ch is not None and ch.is_open:
            self._declare_passive(ch, name)
        else:
            gen = self._gen
            self._conn.channel(on_open_callback=lambda c: self._check_opened(gen, c))

    def _check_opened(self, gen, ch) -> None:
        if gen != self._gen:
            return
        self._check_ch = ch
        ch.add_on_close_callback(lambda c, e: self._check_closed(gen, c, e))
        if self._checking is not None:
            self._declare_passive(ch, self._checking)

    def _declare_passive(self, ch, name) -> None:
        gen = self._gen
        ch.exchange_declare(name, passive=True, callback=lambda _f: self._check_done(gen, name, True))

    def _check_closed(self, gen, ch, e) -> None:
        if gen != self._gen or ch is not self._check_ch:
            return
        self._check_ch = None
        name = self._checking
        if name is None:
            return
        if getattr(e, "reply_code", None) == 404:
            self._check_done(gen, name, False)
        else:
            self._drop(gen, f"check channel closed: {e!r}")

    def _check_done(self, gen, name, exists: bool) -> None:
        if gen != self._gen or self._checking != name:
            return
        self._checking = None
        if exists:
            self._known.add(name)
            self._missing.pop(name, None)
        else:
            self._missing[name] = time.monotonic()
        self._pump()

    def _on_return(self, ch, method, props, body) -> None:
        # basic.return carries no delivery tag; RabbitMQ sends it right before the
        # basic.ack of that message.  Match on exchange, routing key and body
        # (identical messages route identically, so any of them is right).
        for tag, m in self._mandatory.items():
            if (tag not in self._returned and m.body == body and m.exchange == method.exchange
                    and m.routing_key == method.routing_key):
                self._returned.add(tag)
                return
        _rl.warning("unmatched-return", "samwise broker %s: unmatched basic.return", self.cfg.name)

    def _on_confirm(self, frame) -> None:
        m = frame.method
        tag = m.delivery_tag
        ok = isinstance(m, spec.Basic.Ack)
        tags = range(self._low, tag + 1) if m.multiple else (tag,)
        out = []
        pop = self._tags.pop
        for t in tags:
            seq = pop(t, None)
            if seq is None:
                continue
            r = ACK if ok else NACK
            if self._mandatory.pop(t, None) is not None and t in self._returned:
                self._returned.discard(t)
                r = RETURNED
            out.append((seq, r))
        if m.multiple:
            self._low = tag + 1
        else:
            while self._low <= self._tag and self._low not in self._tags:
                self._low += 1
        if out:
            self._emit(("confirms", self._gen, out))

    # --- rpc on a short-lived connection of its own: a broker error (e.g. an
    # unknown exchange type closes the *connection* with 503) never disturbs
    # the publishing connection.

    def _rpc(self, rpc_id, method, exchange, exchange_type, timeout) -> None:
        state = {"done": False, "conn": None}

        def finish(err):
            if state["done"]:
                return
            state["done"] = True
            self._emit(("rpc", rpc_id, err))
            c = state["conn"]
            if c is not None:
                self._rpc_conns.discard(c)
                if c.is_open:
                    try:
                        c.close()
                    except Exception:
                        pass

        def on_channel(ch):
            ch.add_on_close_callback(lambda c, e: finish(_amqp_error(e)))
            if method == proto.EXCHANGE_DECLARE:
                ch.exchange_declare(exchange, exchange_type=exchange_type,
                                    callback=lambda _f: finish(None))
            else:
                ch.exchange_delete(exchange, callback=lambda _f: finish(None))

        if self._stopping:
            finish("shutting down")
            return
        try:
            c = pika.SelectConnection(
                self._params,
                on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
                on_open_error_callback=lambda c, e: finish(f"cannot connect: {_amqp_error(e)}"),
                on_close_callback=lambda c, e: finish(_amqp_error(e)),
                custom_ioloop=self.ioloop,
            )
        except Exception as e:
            finish(f"cannot connect: {e!r}")
            return
        state["conn"] = c
        self._rpc_conns.add(c)
        self.ioloop.call_later(timeout, lambda: finish("timeout"))


def _amqp_error(e) -> str:
    code = getattr(e, "reply_code", None)
    text = getattr(e, "reply_text", None)
    if code is not None:
        return f"{code} {text}"
    return repr(e) if e is not None else "closed"


# =========================================================================== trio side


def split_record(frames: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """A samwise spool record: [comma-separated target brokers] + the request as received."""
    return frames[0].split(b","), frames[1:]


def make_record(targets: list[str], request: list[bytes]) -> list[bytes]:
    return [",".join(targets).encode()] + request


class BrokerOutput:
    """Publishes the spool records addressed to one broker; acks the spool in order."""

    def __init__(self, cfg: BrokerConfig, reader: SpoolReader, *, max_inflight: int = 2000,
                 read_batch: int = 500, on_delivered=None, handoff=None,
                 handoff_after: float = 10.0):
        self.cfg = cfg
        self.name = cfg.name
        self._bname = cfg.name.encode()
        self.reader = reader
        self.max_inflight = max_inflight
        self.read_batch = read_batch
        self._on_delivered = on_delivered   # callback(position) when this broker confirmed
        # async callback(broker, [(position, targets, request)]) -> how many of them were
        # re-addressed to other brokers (in order); used while this broker is down
        self._handoff = handoff
        self.handoff_after = handoff_after
        self._down_since = time.monotonic()
        self.handed_off = 0
        self.link: AmqpLink | None = None
        self.connected = False
        self.gen = 0
        self._seq = 0
        self._pending: dict[int, tuple[list, float]] = {}   # seq -> (window entry, t_sent)
        self._window: collections.deque[list] = collections.deque()  # [position, done]
        self._wake = trio.Event()
        self._stopped = trio.Event()
        self._rpcs: dict[int, list] = {}
        self._rpc_id = 0
        # metrics
        self.results: collections.Counter[str] = collections.Counter()
        self.sent = 0
        self.disconnects = 0
        self.bad_records = 0
        self.confirm_latency_sum = 0.0
        self.confirm_latency_max = 0.0
        self.confirm_count = 0
        self.last_error = ""

    # ------------------------------------------------------------------ run

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.link = AmqpLink(self.cfg, trio.lowlevel.current_trio_token(), self._on_events)
        self.link.start()
        try:
            task_status.started()
            await self._feed()
        finally:
            with trio.CancelScope(shield=True):
                self.link.request_stop()
                with trio.move_on_after(5):
                    await self._stopped.wait()
                self.link.thread.join(timeout=1.0)
                if self.link.thread.is_alive():
                    log.error("samwise broker %s: pika thread did not stop", self.name)
                self.connected = False
                for r in self._rpcs.values():
                    r[1] = "shutting down"
                    r[0].set()

    def _poke(self) -> None:
        self._wake.set()

    async def _sleep_until_poked(self) -> None:
        if self._wake.is_set():
            self._wake = trio.Event()
            await trio.lowlevel.checkpoint()
            return
        await self._wake.wait()
        self._wake = trio.Event()

    async def _feed(self) -> None:
        reader = self.reader
        while True:
            if not self.connected:
                if (self._handoff is not None
                        and time.monotonic() - self._down_since >= self.handoff_after
                        and await self._hand_off_backlog()):
                    continue
                with trio.move_on_after(min(1.0, self.handoff_after)):
                    await self._sleep_until_poked()
                continue
            if len(self._pending) >= self.max_inflight:
                await self._sleep_until_poked()
                continue
            recs = reader.read(min(self.read_batch, self.max_inflight - len(self._pending)))
            if not recs:
                async with trio.open_nursery() as n:
                    # whichever comes first: spool data or a state change
                    async def data():
                        await reader.wait()
                        n.cancel_scope.cancel()

                    async def poked():
                        await self._sleep_until_poked()
                        n.cancel_scope.cancel()
                    n.start_soon(data)
                    n.start_soon(poked)
                continue
            self._send(recs)
            await trio.lowlevel.checkpoint()

    async def _hand_off_backlog(self) -> bool:
        """This broker has been down for ``handoff_after``: re-address the records waiting
        for it to brokers that are up (the endpoint appends them to the spool again, then
        this reader acknowledges the originals).  Order is kept: it stops at the first
        record no other broker can take (``redundant n`` already on every other broker).
        True if it made progress."""
        reader = self.reader
        recs = reader.read(self.read_batch)
        if not recs:
            return False
        items = []
        for rec in recs:
            if rec.kind == KIND_SAMWISE and rec.frames:
                targets, req = split_record(rec.frames)
                if self._bname in targets:
                    items.append((rec, targets, req))
        try:
            taken = await self._handoff(self.name, [(r.position, t, q) for r, t, q in items])
        except Exception:
            log.exception("samwise broker %s: hand-off failed", self.name)
            taken = 0
        if taken >= len(items):
            last = recs[-1].position
        else:
            # acknowledge up to the record before the first one nobody else took
            blocked = items[taken][0].position
            before = [r.position for r in recs if r.position < blocked]
            last = before[-1] if before else None
        if last is not None:
            reader.ack(last)
        reader.rewind()
        self.handed_off += taken
        if taken:
            _rl.warning("handoff", "samwise broker %s: down for %.0f s, handed %d waiting "
                        "message(s) to other brokers", self.name,
                        time.monotonic() - self._down_since, taken)
        return last is not None

    def _send(self, recs) -> None:
        items = []
        now = time.monotonic()
        window = self._window
        for rec in recs:
            entry = [rec.position, True]
            window.append(entry)
            if rec.kind != KIND_SAMWISE or not rec.frames:
                continue
            targets, req = split_record(rec.frames)
            if self._bname not in targets:
                continue
            try:
                ev = proto.parse_request(req)
                if not isinstance(ev, proto.Publish):
                    raise proto.SamwiseError(proto.MALFORMED_PUBLISH, "not a publish")
            except proto.SamwiseError as e:
                self.bad_records += 1
                _rl.error("bad-record", "samwise broker %s: dropping bad spool record %s: %s",
                          self.name, rec.position, e)
                continue
            entry[1] = False
            self._seq += 1
            self._pending[self._seq] = (entry, now)
            items.append(_Out(self._seq, ev.exchange, ev.routing_key, ev.payload,
                              basic_properties(ev), ev.mandatory))
        if items:
            self.sent += len(items)
            self.link.publish(self.gen, items)
        self._advance()

    def _advance(self) -> None:
        window = self._window
        last = None
        while window and window[0][1]:
            last = window.popleft()[0]
        if last is not None:
            self.reader.ack(last)

    # ------------------------------------------------------------- events (trio thread)

    def _on_events(self, evs) -> None:
        for ev in evs:
            kind = ev[0]
            if kind == "confirms":
                if ev[1] == self.gen and self.connected:
                    self._on_confirms(ev[2])
            elif kind == "up":
                self.gen = ev[1]
                self.connected = True
                self._poke()
            elif kind == "down":
                if ev[1] == self.gen:
                    self.last_error = ev[2]
                    if self.connected:
                        self.disconnects += 1
                    self._lost()
            elif kind == "rpc":
                r = self._rpcs.get(ev[1])
                if r is not None:
                    r[1] = ev[2]
                    r[0].set()
            elif kind == "stopped":
                self._stopped.set()
        self._advance()

    def _lost(self) -> None:
        """Connection gone: everything unconfirmed is re-sent from the spool later."""
        if self.connected:
            self._down_since = time.monotonic()
        self.connected = False
        self._pending.clear()
        self._window.clear()
        self.reader.rewind()
        self._poke()

    def _on_confirms(self, confirms) -> None:
        now = time.monotonic()
        pending = self._pending
        nack = False
        for seq, result in confirms:
            p = pending.pop(seq, None)
            if p is None:
                continue
            if result == NACK:
                nack = True
                continue
            entry, t0 = p
            entry[1] = True
            self.results[result] += 1
            if result == ACK:
                dt = now - t0
                self.confirm_count += 1
                self.confirm_latency_sum += dt
                if dt > self.confirm_latency_max:
                    self.confirm_latency_max = dt
                if self._on_delivered is not None:
                    self._on_delivered(entry[0], self.name)
            elif result == RETURNED:
                _rl.warning("returned", "samwise broker %s: mandatory message returned "
                            "(unroutable)", self.name)
            elif result == NO_EXCHANGE:
                _rl.error("no-exchange", "samwise broker %s: exchange does not exist, "
                          "message dropped", self.name)
        if nack:
            self.results[NACK] += 1
            self.link.reconnect(self.gen, "basic.nack")
            self._lost()
        self._poke()

    # ------------------------------------------------------------------ rpc

    async def rpc(self, method: str, exchange: str, exchange_type: str, timeout: float) -> str | None:
        """Run exchange.declare/delete on this broker; None on success, else the error."""
        if self.link is None:
            return "not running"
        self._rpc_id += 1
        rid = self._rpc_id
        slot = [trio.Event(), None]
        self._rpcs[rid] = slot
        try:
            self.link.rpc(rid, method, exchange, exchange_type, timeout)
            with trio.move_on_after(timeout + 1.0):
                await slot[0].wait()
                return slot[1]
            return "timeout"
        finally:
            del self._rpcs[rid]

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        r = {
            "connected": int(self.connected),
            "inflight": len(self._pending),
            "sent": self.sent,
            "results": dict(self.results),
            "disconnects": self.disconnects,
            "handed_off": self.handed_off,
            "bad_records": self.bad_records,
            "confirm_latency_seconds_sum": self.confirm_latency_sum,
            "confirm_latency_seconds_count": self.confirm_count,
            "confirm_latency_seconds_max": self.confirm_latency_max,
        }
        try:
            r["reader"] = self.reader.stats()
        except Exception:
            pass
        return r
