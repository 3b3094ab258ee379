"""The samwise endpoint: a ROUTER serving samd's REQ (and DEALER) clients.

Flow of a publish: receive a batch of requests -> parse (``protocols.samwise``)
-> pick the target broker(s) -> ``store.append_batch`` (the spool) -> reply
``[0]`` / ``[0, '']``.  The reply therefore means "accepted and in the spool".
One :class:`~logjam_relay.samwise.output.BrokerOutput` per broker reads its own
spool reader and publishes the records addressed to it with confirms; the endpoint
wakes them after each append (they run no spool watcher of their own).

Spool record (``KIND_SAMWISE``): ``[b"broker-a,broker-b", *request frames as received]``.

The store is any object with ``append_batch(list[(kind, frames)])`` (sync, or
returning an awaitable) and ``reader(name) -> SpoolReader``;
:class:`MemoryStore` is the in-memory one for tests.  Wiring the real spool
is ``SamwiseService(config, store=spool)``.
"""

from __future__ import annotations

import collections
import inspect
import logging
from typing import Protocol

import trio
import zmq

from ..io import zmq_trio
from ..protocols import samwise as proto
from ..ratelimit import RateLimitedLog
from ..spool.api import KIND_SAMWISE, MemorySource, Position, SpoolReader
from ..spool.segment import MIN_RECORD
from .config import SamwiseConfig
from .output import BrokerOutput, make_record
from .rpc import NOT_ALLOWED, OVERLOADED, QUEUE_TIMEOUT, RpcOverloaded, RpcRunner

log = logging.getLogger("logjam_relay.samwise")
_rl = RateLimitedLog(log)

IMMEDIATE_UNSUPPORTED = b"immediate flag not supported by RabbitMQ"
NOT_ENOUGH_BROKERS = b"redundancy exceeds the number of brokers"
USER_ID_MISMATCH = b"user_id must be the broker user"
SPOOL_ERROR = b"spool error"
UNKNOWN_BROKER = b"unknown broker"
CONTROL_REFUSED = b"action not permitted"


# the reply to an accepted publish, per protocol version (never mutated: env + reply is new)
_OK_REPLIES = {v: proto.ok_reply(v) for v in (proto.VERSION_1_0, proto.VERSION_1_1)}


def _positions(r, records: list) -> list[Position] | None:
    """The spool positions of ``records`` appended in one call that returned ``r``: the
    list itself (:class:`MemoryStore`), or, from the real spool's first position, the
    following ones (one write, consecutive records: the record layout of
    docs/spool-format.md).  None when the store did not say."""
    if isinstance(r, list):
        return r if len(r) == len(records) else None
    if not isinstance(r, Position):
        return None
    out = []
    seg, off = r
    for _kind, frames in records:
        out.append(Position(seg, off))
        off += MIN_RECORD + 4 * len(frames) + sum(map(len, frames))
    return out


class SpoolFull(Exception):
    pass


class SamwiseStore(Protocol):
    """``append_records`` (or ``append_batch``) of ``(kind, frames)``; sync or async.
    Optional ``would_block()``: true while the spool is full (publishes get an error)."""

    def append_records(self, records: list[tuple[int, list[bytes]]]): ...
    def reader(self, name: str) -> SpoolReader: ...


class MemoryStore:
    """In-memory store: every appended record goes to every reader (same positions)."""

    def __init__(self):
        self._readers: dict[str, MemorySource] = {}
        self.appended = 0

    def reader(self, name: str) -> MemorySource:
        if name not in self._readers:
            if self.appended:
                raise RuntimeError("MemoryStore: create readers before appending")
            self._readers[name] = MemorySource(name)
        return self._readers[name]

    def append_batch(self, records: list[tuple[int, list[bytes]]]) -> list[Position]:
        out = []
        for kind, frames in records:
            for r in self._readers.values():
                pos = r.append(frames, kind)
            out.append(pos)
            self.appended += 1
        return out

    append_records = append_batch

    def append(self, frames: list[bytes], kind: int = KIND_SAMWISE) -> Position:
        return self.append_batch([(kind, frames)])[0]


class Distributor:
    """samd's rotation: a cursor over the brokers in config order; connected ones first."""

    def __init__(self, outputs: list[BrokerOutput]):
        self.outputs = outputs
        self._cursor = 0

    def pick(self, n: int) -> list[str]:
        outs = self.outputs
        k = len(outs)
        if n == 1:                      # round robin: the first connected from the cursor
            c = self._cursor
            for i in range(k):
                j = c + i
                if j >= k:
                    j -= k
                if outs[j].connected:
                    self._cursor = j + 1 if j + 1 < k else 0
                    return [outs[j].name]
            self._cursor = c + 1 if c + 1 < k else 0
            return [outs[c].name]
        order = [(self._cursor + i) % k for i in range(k)]
        up = [i for i in order if outs[i].connected]
        down = [i for i in order if not outs[i].connected]
        chosen = (up + down)[:n]
        self._cursor = (chosen[0] + 1) % k
        return [outs[i].name for i in chosen]


class SamwiseService:
    """Endpoint + broker outputs.  ``await nursery.start(service.run)``."""

    #: ZeroMQ MAXMSGSIZE of the endpoint (0 = none): a memory guard, set from
    #: zmq_max_msg_bytes by the relay (a peer sending a larger frame is disconnected)
    max_msg_bytes = 0
    #: bytes one drained batch may hold (0 = only recv_batch bounds it): ingest_max_bytes
    max_batch_bytes = 0
    #: ZeroMQ RCVHWM (and SNDHWM: replies never outnumber requests) of the endpoint, per
    #: peer: the relay sets min(rcv_hwm, 1000) (docs/operations.md, "Memory")
    rcv_hwm = 1000
    #: io.peers.PeerLimit: zmq_max_peers through the ZAP handler (set by the relay)
    peer_limit = None

    def __init__(self, config: SamwiseConfig, store: SamwiseStore, *,
                 zmq_context: zmq.Context | None = None):
        self.config = config
        self.store = store
        self.ctx = zmq_context or zmq.Context.instance()
        self.outputs = [
            BrokerOutput(b, store.reader(config.reader_name(b.name)),
                         max_inflight=config.max_inflight, read_batch=config.read_batch,
                         on_delivered=self._on_delivered,
                         handoff=self._hand_off if config.handoff_after > 0 else None,
                         handoff_after=config.handoff_after,
                         publish_delay=config.publish_delay,
                         watch_spool=False)      # _handle_batch / _hand_off notify them
            for b in config.brokers
        ]
        self.by_name = {o.name: o for o in self.outputs}
        self.users = {b.user for b in config.brokers}
        self.distributor = Distributor(self.outputs)
        self.rpc = RpcRunner(max_concurrent=config.rpc_max_concurrent,
                             max_queued=config.rpc_max_queued, allow=config.rpc_allow,
                             timeout=config.rpc_timeout)
        self.bound: list[str] = []     # actual endpoints (ephemeral ports resolved)
        self._sock: zmq.Socket | None = None
        self._memo = proto.PublishMemo()           # samcli-like traffic: parse headers once
        self._wait_scope: trio.CancelScope | None = None
        self._rpc_active = 0                       # rpc tasks that may still send a reply
        # metrics
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.accepted = 0
        self.delivered = 0
        self.replies_dropped = 0
        self.spool_errors = 0
        self._copies_left: dict[Position, set[str]] = {}
        self._handoff_alias: dict[Position, tuple[Position, str]] = {}
        self._handoff_rr = 0
        # the real Spool has append_records((kind, frames)) and append_batch (logjam only)
        self._append = getattr(store, "append_records", None) or store.append_batch
        self._would_block = getattr(store, "would_block", None)

    # ------------------------------------------------------------------ run

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # unroutable reply -> error, counted
        if self.max_msg_bytes:
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_msg_bytes)
        # each peer's queue holds rcv_hwm whole requests (each frame up to MAXMSGSIZE)
        sock.setsockopt(zmq.RCVHWM, self.rcv_hwm)
        sock.setsockopt(zmq.SNDHWM, self.rcv_hwm)
        if self.peer_limit is not None and self.peer_limit.max_peers:
            from ..io.peers import set_domain
            set_domain(sock, "samwise")          # every handshake asks the ZAP handler
        try:
            for ep in self.config.endpoints:
                sock.bind(ep)
                self.bound.append(sock.get(zmq.LAST_ENDPOINT).decode())
            if self.peer_limit is not None:
                self.peer_limit.watch("samwise", sock, endpoints=self.bound)
            self._sock = sock
            async with trio.open_nursery() as nursery:
                for o in self.outputs:
                    await nursery.start(o.run)
                task_status.started(self.bound)
                await self._serve(sock, nursery)
        finally:
            self._sock = None
            if self.peer_limit is not None:
                self.peer_limit.forget("samwise")    # its monitor
            sock.close(linger=0)

    async def _serve(self, sock: zmq.Socket, nursery: trio.Nursery) -> None:
        """Reply first, then yield: a REQ client waits for exactly this reply, and the
        broker outputs' work (publishing, confirms) can wait until it is sent.

        One request of a single REQ client costs one drain, one ``zmq.EVENTS`` check and
        one wait: no cancel scope (unless an rpc task might send on the socket meanwhile,
        see :meth:`_reply`) and no extra trip through the scheduler."""
        limit = self.config.recv_batch
        drain = zmq_trio.drain
        if self.max_batch_bytes:                   # bounded in bytes too (ingest_max_bytes)
            max_bytes = self.max_batch_bytes

            def drain(sock, limit):
                return zmq_trio.drain_bytes(sock, limit, max_bytes)[0]
        fd = sock.FD
        get = sock.get
        events, pollin = int(zmq.EVENTS), int(zmq.POLLIN)   # ints: no enum per request
        wait_readable = trio.lowlevel.wait_readable
        checkpoint = trio.lowlevel.checkpoint
        batch = drain(sock, limit)
        while True:
            if batch:
                await self._handle_batch(batch, nursery)
            # EVENTS also re-arms the edge-triggered FD: when it says nothing is pending,
            # the FD signals the next change, so waiting on it cannot miss a request
            if get(events) & pollin:
                if batch:
                    await checkpoint()             # busy: let the others run too
                batch = drain(sock, limit)
                if not batch:
                    await checkpoint()             # never spin
                continue
            if self._rpc_active:
                # an rpc task's reply (another task's send) can consume the socket's
                # edge-triggered FD signal; _reply cancels this wait so it re-drains
                with trio.CancelScope() as self._wait_scope:
                    await wait_readable(fd)
                self._wait_scope = None
            else:
                await wait_readable(fd)            # only this task uses the socket now
            batch = drain(sock, limit)

    async def _handle_batch(self, batch: list[list[bytes]], nursery: trio.Nursery) -> None:
        replies: list = []             # (envelope, frames) or (envelope, publish-index)
        records: list[tuple[int, list[bytes]]] = []
        pub_versions: list[tuple[int, list[str]]] = []
        lookup = self._memo.lookup
        multi = False                  # a publish with more than one target broker
        for msg in batch:
            if len(msg) < 2:
                continue  # ROUTER never delivers fewer than identity + 1 frame
            if msg[1] == b"":
                env, body = msg[:2], msg[2:]
            else:  # a DEALER without the empty delimiter
                env, body = msg[:1], msg[1:]
            try:
                # a publish whose headers were seen before: the remembered template (its
                # payload is another request's; only the headers are used here)
                hit = lookup(body)
                ev = hit[0] if hit is not None else self._memo.parse(body)[0]
            except proto.SamwiseError as e:
                self._count(body, e.reason)
                _rl.warning(e.reason, "samwise: rejected request: %s", e)
                replies.append((env, proto.error_reply(e.message)))
                continue
            if isinstance(ev, proto.Publish):
                err = self._check_publish(ev)
                if err is not None:
                    self.requests[("publish", "rejected")] += 1
                    replies.append((env, proto.error_reply(err)))
                    continue
                targets = self.distributor.pick(ev.copies)
                if len(targets) > 1:
                    multi = True
                records.append((KIND_SAMWISE, make_record(targets, body)))
                pub_versions.append((ev.version, targets))
                replies.append((env, len(records) - 1))
            elif isinstance(ev, proto.Ping):
                self.requests[("ping", "ok")] += 1
                replies.append((env, proto.ok_reply(ev.version)))
            elif isinstance(ev, proto.Status):
                self.requests[("status", "ok")] += 1
                replies.append((env, proto.ok_reply(ev.version, self.status_text().encode())))
            elif isinstance(ev, proto.Rpc):
                if not self.rpc.allowed(ev.method):
                    self.requests[("rpc", "not_allowed")] += 1
                    _rl.warning("rpc-not-allowed", "samwise: rpc %s refused (not in "
                                "samwise_rpc_allow)", ev.method)
                    replies.append((env, proto.error_reply(NOT_ALLOWED)))
                elif ev.broker and ev.broker not in self.by_name:
                    self.requests[("rpc", "rejected")] += 1
                    replies.append((env, proto.error_reply(UNKNOWN_BROKER)))
                elif not self.rpc.admit():
                    self.requests[("rpc", "overloaded")] += 1
                    _rl.warning("rpc-overloaded", "samwise: too many rpc requests, refused")
                    replies.append((env, proto.error_reply(OVERLOADED)))
                else:
                    self._rpc_active += 1
                    nursery.start_soon(self._rpc, env, ev)
            else:  # Control: stop / restart
                self.requests[(ev.action, "rejected")] += 1
                replies.append((env, proto.error_reply(CONTROL_REFUSED)))

        stored = False
        if records:
            try:
                if self._would_block is not None and self._would_block():
                    raise SpoolFull
                r = self._append(records)
                if r is not None and type(r) is not Position and inspect.isawaitable(r):
                    r = await r
                stored = True
            except SpoolFull:
                self.spool_errors += 1
                _rl.error("spool-full", "samwise: spool full, refusing publishes")
            except Exception:
                self.spool_errors += 1
                log.exception("samwise: spool append failed")
            if stored:
                self.requests[("publish", "accepted")] += len(pub_versions)
                self.accepted += len(pub_versions)
                self._notify_outputs()
            else:
                self.requests[("publish", "spool_error")] += len(pub_versions)
            if stored and multi:
                positions = _positions(r, records)
                if positions is not None:
                    for (_version, targets), pos in zip(pub_versions, positions, strict=True):
                        if len(targets) > 1:
                            self._copies_left[pos] = set(targets)
        out = []
        ok = _OK_REPLIES
        for env, rep in replies:
            if isinstance(rep, int):
                version = pub_versions[rep][0]
                rep = (ok.get(version) or proto.ok_reply(version)) if stored \
                    else proto.error_reply(SPOOL_ERROR)
            out.append(env + rep)
        sock = self._sock
        if out and sock is not None:
            self.replies_dropped += zmq_trio.send_replies(sock, out)

    def _notify_outputs(self) -> None:
        """Every broker's reader has new records (its own, or others' to step over so its
        cursor does not pin the spool): wake the feeders (a feeder gathering a batch
        takes many notifications as one)."""
        for o in self.outputs:
            o.notify()

    def _check_publish(self, ev: proto.Publish) -> bytes | None:
        if ev.immediate:
            return IMMEDIATE_UNSUPPORTED
        if ev.copies > len(self.outputs):
            return NOT_ENOUGH_BROKERS
        uid = ev.properties.user_id
        if uid is not None and (len(self.users) != 1 or uid not in self.users):
            # RabbitMQ closes the channel (406) when user_id is not the connection's user
            return USER_ID_MISMATCH
        return None

    def _count(self, body: list[bytes], reason: str) -> None:
        action = proto.cstr(body[1]).decode("ascii", "replace")[:16] if len(body) > 1 else ""
        if action not in ("publish", "rpc", "ping", "status"):
            action = "other"
        self.requests[(action, reason)] += 1

    def _reply(self, env: list[bytes], frames: list[bytes]) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            if not zmq_trio.send_multipart_nowait(sock, env + frames):
                self.replies_dropped += 1
        except zmq.ZMQError:  # peer gone (ROUTER_MANDATORY: EHOSTUNREACH)
            self.replies_dropped += 1
        if self._wait_scope is not None:
            self._wait_scope.cancel()

    async def _rpc(self, env: list[bytes], ev: proto.Rpc) -> None:
        try:
            await self._rpc_run(env, ev)
        finally:
            self._rpc_active -= 1
            self.rpc.done()

    async def _rpc_run(self, env: list[bytes], ev: proto.Rpc) -> None:
        outs = [self.by_name[ev.broker]] if ev.broker else self.outputs
        errors: list[str] = []
        overloaded = False

        async def one(o: BrokerOutput):
            nonlocal overloaded
            try:
                err = await self.rpc.call(o.cfg, ev.method, ev.exchange, ev.exchange_type)
            except RpcOverloaded:
                overloaded = True
                return
            if err is not None:
                errors.append(f"{o.name}: {err}")

        async with trio.open_nursery() as n:
            for o in outs:
                n.start_soon(one, o)
        if overloaded:
            self.requests[("rpc", "overloaded")] += 1
            self._reply(env, proto.error_reply(QUEUE_TIMEOUT))
        elif errors:
            self.requests[("rpc", "broker_error")] += 1
            self._reply(env, proto.error_reply("; ".join(sorted(errors)).encode()[:1000]))
        else:
            self.requests[("rpc", "ok")] += 1
            self._reply(env, proto.ok_reply(ev.version))

    async def _hand_off(self, broker: str, items: list) -> int:
        """Re-address records waiting for the down ``broker`` to brokers that are up and
        not already among each record's targets; append them to the spool again.
        Returns how many (a prefix of ``items``) were taken."""
        up = [o.name for o in self.outputs if o.connected and o.name != broker]
        records: list[tuple[int, list[bytes]]] = []
        origins: list[Position] = []
        for pos, targets, req in items:
            names = {t.decode() for t in targets}
            cands = [n for n in up if n not in names]
            if not cands:
                break
            new = cands[self._handoff_rr % len(cands)]
            self._handoff_rr += 1
            records.append((KIND_SAMWISE, make_record([new], req)))
            origins.append(pos)
        if not records:
            return 0
        if self._would_block is not None and self._would_block():
            return 0
        r = self._append(records)
        if inspect.isawaitable(r):
            r = await r
        self._notify_outputs()
        positions = _positions(r, records)
        if positions is not None:
            for newpos, pos in zip(positions, origins, strict=True):
                if pos in self._copies_left:
                    self._handoff_alias[newpos] = (pos, broker)
        return len(records)

    def _on_delivered(self, pos: Position, broker: str) -> None:
        alias = self._handoff_alias.pop(pos, None)
        if alias is not None:
            pos, broker = alias
        left = self._copies_left.get(pos)
        if left is None:
            self.delivered += 1
            return
        left.discard(broker)
        if not left:
            del self._copies_left[pos]
            self.delivered += 1

    # ------------------------------------------------------------------ stats

    def backlog(self) -> int:
        total = 0
        for o in self.outputs:
            try:
                total += int(o.reader.stats().get("backlog_records", 0))
            except Exception:
                pass
        return total

    def stats(self) -> dict:
        return {
            "requests": {f"{a}:{r}": v for (a, r), v in sorted(self.requests.items())},
            "accepted": self.accepted,
            "delivered": self.delivered,
            "replies_dropped": self.replies_dropped,
            "spool_errors": self.spool_errors,
            "backlog_records": self.backlog(),
            **self.rpc.stats(),
            "brokers": {o.name: o.stats() for o in self.outputs},
        }

    def status_text(self) -> str:
        lines = ["", "BACKENDS:", f"{len(self.outputs)} backend(s) registered:", ""]
        for o in self.outputs:
            s = o.stats()
            lines += [
                f"{o.name} ({o.cfg.display}):",
                f"  connected: {'yep' if o.connected else 'nope'}",
                f"  in flight: {s['inflight']}",
                f"  backlog: {s.get('reader', {}).get('backlog_records', '?')}",
                f"  results: {s['results']}",
                f"  disconnects: {s['disconnects']}" + (f" (last: {o.last_error})" if o.last_error else ""),
                "",
            ]
        lines += ["METRICS:", "", "samwise:", f"  accepted requests: {self.accepted}",
                  f"  delivered: {self.delivered}", ""]
        return "\n".join(lines)
