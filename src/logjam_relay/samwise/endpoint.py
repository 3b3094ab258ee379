"""The samwise endpoint: a ROUTER serving samd's REQ (and DEALER) clients.

Flow of a publish: receive a batch of requests -> parse (``protocols.samwise``)
-> pick the target broker(s) -> ``store.append_batch`` (the spool) -> reply
``[0]`` / ``[0, '']``.  The reply therefore means "accepted and in the spool".
One :class:`~logjam_relay.samwise.output.BrokerOutput` per broker reads its own
spool reader and publishes the records addressed to it with confirms.

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
                         publish_delay=config.publish_delay)
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
        try:
            for ep in self.config.endpoints:
                sock.bind(ep)
                self.bound.append(sock.get(zmq.LAST_ENDPOINT).decode())
            self._sock = sock
            async with trio.open_nursery() as nursery:
                for o in self.outputs:
                    await nursery.start(o.run)
                task_status.started(self.bound)
                await self._serve(sock, nursery)
        finally:
            self._sock = None
            sock.close(linger=0)

    async def _serve(self, sock: zmq.Socket, nursery: trio.Nursery) -> None:
        """Reply first, then yield: a REQ client waits for exactly this reply, and the
        broker outputs' work (publishing, confirms) can wait until it is sent."""
        limit = self.config.recv_batch
        drain = zmq_trio.drain
        if self.max_batch_bytes:                   # bounded in bytes too (ingest_max_bytes)
            max_bytes = self.max_batch_bytes

            def drain(sock, limit):
                return zmq_trio.drain_bytes(sock, limit, max_bytes)[0]
        batch: list = []
        while True:
            if not batch:
                # a send from another task (an rpc reply) can consume the socket's
                # edge-triggered FD signal; _reply cancels this wait so it re-drains
                with trio.CancelScope() as self._wait_scope:
                    await zmq_trio.wait_for(sock, zmq.POLLIN)
                self._wait_scope = None
                batch = drain(sock, limit)
                if not batch:
                    await trio.lowlevel.checkpoint()   # a spurious wake-up: never spin
                    continue
            await self._handle_batch(batch, nursery)
            batch = drain(sock, limit)
            if batch:
                await trio.lowlevel.checkpoint()       # busy: let the others run too

    async def _handle_batch(self, batch: list[list[bytes]], nursery: trio.Nursery) -> None:
        replies: list = []             # (envelope, frames) or (envelope, publish-index)
        records: list[tuple[int, list[bytes]]] = []
        pub_versions: list[tuple[int, list[str]]] = []
        for msg in batch:
            if len(msg) < 2:
                continue  # ROUTER never delivers fewer than identity + 1 frame
            if msg[1] == b"":
                env, body = msg[:2], msg[2:]
            else:  # a DEALER without the empty delimiter
                env, body = msg[:1], msg[1:]
            try:
                ev = self._memo.parse(body)[0]
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
                if inspect.isawaitable(r):
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
            else:
                self.requests[("publish", "spool_error")] += len(pub_versions)
            if stored and isinstance(r, list) and len(r) == len(pub_versions):
                for (_version, targets), pos in zip(pub_versions, r, strict=True):
                    if len(targets) > 1 and isinstance(pos, Position):
                        self._copies_left[pos] = set(targets)
        out = []
        for env, rep in replies:
            if isinstance(rep, int):
                version = pub_versions[rep][0]
                rep = proto.ok_reply(version) if stored else proto.error_reply(SPOOL_ERROR)
            out.append(env + rep)
        sock = self._sock
        if out and sock is not None:
            self.replies_dropped += zmq_trio.send_replies(sock, out)

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
        if isinstance(r, list) and len(r) == len(origins):
            for newpos, pos in zip(r, origins, strict=True):
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
