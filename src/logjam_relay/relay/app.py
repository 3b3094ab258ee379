"""The relay: one trio nursery supervising ingest, ticker, metrics and outputs."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio
import zmq

from ..config import Settings, ineffective
from ..health.cmdp import LoopLag
from ..io import xpubthread, zmq_fast, zmq_trio
from ..io.peers import set_domain as set_zap_domain
from ..io.xpubthread import ThreadedPub
from ..protocols import logjam as L
from . import batchpath, ingestpass
from .batchpath import Replies
from .binding import bind_cause  # noqa: F401  (re-exported)
from .compressors import CompressorPool
from .sequence import SequenceState, StateDirError
from .spoolwrite import SpoolWrites
from .stamping import Pipeline, safe_label  # noqa: F401  (safe_label re-exported)
from .ticker import Ticker, now_ms, poll_subscriptions

log = logging.getLogger("logjam_relay.relay")
_SOCKET_NAMES = {"router_port": "router", "pull_port": "pull", "pub_port": "pub",
                 "stats_port": "stats"}
#: how long the shutdown waits for the XPUB threads (PUB, stats) together: one may be
#: inside a libzmq trie walk of seconds under a subscription flood (io/xpubthread.py)
XPUB_STOP_SECONDS = 3.0


@dataclass(frozen=True, slots=True)
class RelayParts:
    """Everything a :class:`Relay` is built from; ``relay/service.py`` makes them from the
    settings (``build``).  A part the settings leave out is None (or empty)."""
    sequence_state: SequenceState           # locked (acquire) before the spool was opened
    ctx: zmq.Context
    fqdn: str
    own_ctx: bool = True                    # terminated when the relay stops
    spool: object = None                    # spool.Spool: with an output or a spool_dir
    archive: object = None                  # outputs.archive.Archive
    dead_letters: object = None             # deadletter.DeadLetterStore
    outputs: tuple = ()                     # outputs.supervisor.OutputSupervisor
    curve: object = None                    # io.curve.Curve when CURVE is on
    peer_limit: object = None               # io.peers.PeerLimit (zmq_max_peers, ZAP)
    samwise: object = None                  # samwise.endpoint.SamwiseService
    sockets: tuple = ()                     # closed with the relay's own (the ZAP handler)
    tasks: tuple = ()                       # async starter(relay, nursery), in order
    # the parts that look at the relay are each built from it, by Relay.__init__, in
    # this order (the metrics read the inputs, the HTTP server serves the metrics)
    make_inputs: Callable | None = None     # relay -> tuple of inputs (inputs/)
    make_cmdp: Callable | None = None       # relay -> health.cmdp.CMDPSender
    make_fd_guard: Callable | None = None   # relay -> io.fdguard.FdGuard
    make_metrics: Callable | None = None    # relay -> (registry, RelayCollector)
    make_http: Callable | None = None       # relay -> health.http.HTTPServer


class Relay:
    """A logjam-device replacement, built whole from its :class:`RelayParts`.

    ``await relay.run()`` binds the sockets, reports readiness through
    ``task_status`` and runs until :meth:`shutdown` is called (SIGTERM/SIGINT
    in the CLI) or the surrounding scope is cancelled.  Every stamped batch takes one
    path to its replies, :attr:`path` (relay/batchpath.py), chosen here from the spool
    and its fsync policy.
    """

    def __init__(self, settings: Settings, parts: RelayParts):
        self.settings = s = settings
        self.fqdn = parts.fqdn
        self.ctx = parts.ctx
        self._own_ctx = parts.own_ctx
        self.sequence_state = parts.sequence_state
        self.spool = parts.spool
        self.archive = parts.archive
        self.dead_letters = parts.dead_letters
        self.outputs = parts.outputs            # output supervisors (stats())
        self.curve = parts.curve
        self.peer_limit = parts.peer_limit
        self.samwise = parts.samwise
        self._sockets: list[zmq.Socket] = list(parts.sockets)
        self._tasks = parts.tasks
        self.start_time = time.time()
        self.ready = trio.Event()
        self.stopped = trio.Event()
        self.stopping = False
        self.lag = LoopLag()                    # the loop's lag (metrics, CMDP)
        self.batches = 0
        self.spool_writes = SpoolWrites(lambda: self.stopping)  # counts ingress pauses
        self.replies = Replies()                # the replies' sends and their drops
        self.path = batchpath.choose(self.spool, self.spool_writes, self.replies, s)
        self._outputs_done = trio.Event()
        self._shutdown_requested = trio.Event()
        self.endpoints: dict[str, str] = {}
        method = L.COMPRESSION_BY_NAME.get(s.compress or "none", 0)
        self.compress_method = method
        # -x: logjam-device's compressor threads, named compressor0.. (their CPU is
        # exported per thread); started by run() when the relay compresses
        self.compressors = CompressorPool(s.compressors)
        self.loop_thread_id = threading.get_native_id()  # "main" CPU; set again by run()
        # what run() makes from the bound sockets and the loaded sequence state
        self.pipeline: Pipeline | None = None
        # PUB: an XPUB on a thread of its own (pub_thread = false: on the loop)
        self.pub: ThreadedPub | zmq_trio.PubSocket | None = None
        self.stats_pub: ThreadedPub | None = None
        self.ticker: Ticker | None = None       # heartbeats, stats tick
        self._outputs_scope: trio.CancelScope | None = None
        # the parts that look at the relay, last (RelayParts)
        self.inputs = parts.make_inputs(self) if parts.make_inputs else ()
        self.cmdp = parts.make_cmdp(self) if parts.make_cmdp else None
        self.fd_guard = parts.make_fd_guard(self) if parts.make_fd_guard else None
        self.metrics_registry, self.metrics_collector = \
            parts.make_metrics(self) if parts.make_metrics else (None, None)
        self.http = parts.make_http(self) if parts.make_http else None

    commits = property(lambda self: self.path.commits)  # GroupCommit under spool_fsync=batch
    reply_drops = property(lambda self: self.replies.drops)

    # ------------------------------------------------------------ life cycle
    def shutdown(self) -> None:
        """Stop accepting, flush what was accepted, persist state, return from run()."""
        self._shutdown_requested.set()

    def _bind(self, kind: int, setting: str, options: dict[int, int]) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # Options must be set before bind: accepted connections copy them from the listener.
        for opt, value in options.items():
            sock.setsockopt(opt, value)
        if self.curve is not None:
            self.curve.secure(sock, setting)        # CURVE server + ZAP (io/curve.py)
        if self.peer_limit is not None and (self.peer_limit.max_peers or kind == zmq.XPUB
                                            or sock.getsockopt(zmq.ZAP_DOMAIN)):
            # every handshake asks ZAP, so none ends before the peer limit read the monitor
            # (the XPUBs always: their admission is rationed, io/peers.py)
            set_zap_domain(sock, _SOCKET_NAMES[setting])
        self._sockets.append(sock)
        ep = self.settings.endpoint(getattr(self.settings, setting))
        try:
            sock.bind(ep)
            if self.curve is not None:
                self.curve.bind_plain(sock, setting)    # plain endpoint beside, if any
        except zmq.ZMQError as e:
            raise self.settings.startup_error(setting, bind_cause(ep, e)) from None
        return sock

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        s = self.settings
        self.loop_thread_id = threading.get_native_id()
        self.acquire_state()
        spool_last = self.spool.last_sequence() if self.spool is not None else None
        try:
            first = self.sequence_state.load(spool_last)
        except StateDirError as e:
            raise self.settings.startup_error("state_dir", e.cause) from None
        try:
            # PUB and stats are XPUBs whose subscriptions are capped (SubscriptionGuard),
            # each owned by a thread (io/xpubthread.py): libzmq's trie walks at the end of
            # a subscriber's connection run there, not on the loop
            pub_sock = self._bind(zmq.XPUB, "pub_port",
                                  {zmq.SNDHWM: s.snd_hwm, **zmq_trio.xpub_options()})
            if s.pub_thread:
                self.pub = ThreadedPub(pub_sock, s.max_subscriptions, name="pub",
                                       hwm=s.snd_hwm)
            else:
                self.pub = zmq_trio.PubSocket(pub_sock, s.max_subscriptions)
            self._sockets.remove(pub_sock)          # closed with self.pub
            self.pipeline = Pipeline(s.device_id, first, self.pub.publish_batch,
                                     fqdn=self.fqdn.encode(), allow_invalid_meta=s.allow_invalid_meta,
                                     compress_method=self.compress_method)
            self.sequence_state.reserve(self.pipeline.seq)
            if self.compress_method:
                self.compressors.start()
            stats_sock = self._bind(zmq.XPUB, "stats_port",
                                    {zmq.SNDHWM: 1000, **zmq_trio.xpub_options()}) \
                if s.stats_port else None
            if stats_sock is not None:
                self.stats_pub = ThreadedPub(stats_sock, s.max_subscriptions, name="stats",
                                             hwm=1000)
                self._sockets.remove(stats_sock)
            # Replies can never outnumber the requests the ROUTER may queue (rcv_hwm), so
            # the reply queue gets the same bound; ROUTER_MANDATORY makes a reply that
            # still cannot be queued (peer gone, queue full) an error we count.
            # MAXMSGSIZE: libzmq disconnects a peer that sends a larger frame (and drops
            # what it had queued) before the frame is buffered -- a memory guard well above
            # max_event_bytes; frames between the two are answered 400 / dropped and counted.
            maxmsg = s.resolved_zmq_max_msg_bytes()
            router = self._bind(zmq.ROUTER, "router_port",
                                {zmq.RCVHWM: s.rcv_hwm, zmq.SNDHWM: s.rcv_hwm,
                                 zmq.ROUTER_MANDATORY: 1, zmq.MAXMSGSIZE: maxmsg}) \
                if s.router_port else None
            pull = self._bind(zmq.PULL, "pull_port", {zmq.RCVHWM: s.rcv_hwm,
                                                      zmq.MAXMSGSIZE: maxmsg}) \
                if s.pull_port else None
            for name, sock in (("pub", pub_sock), ("stats", stats_sock), ("router", router),
                               ("pull", pull)):
                if sock is not None:
                    self.endpoints[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
                    self._watch_peers(name, sock)
            for tp in (self.pub, self.stats_pub):
                if isinstance(tp, ThreadedPub):
                    tp.start()                      # the loop does not touch its XPUB again
            self.ticker = self._make_ticker()
            skipped = self.sequence_state.skipped()
            if skipped is not None:
                # after a crash, before anything can take a number (the inputs start with
                # the tasks below): the restart marker, spooled with this run's first
                # number, names the numbers reserved before the crash and never spooled
                self.ticker.restart_marker(*skipped)

            async with trio.open_nursery() as nursery:
                ingest = trio.CancelScope()

                async def ingest_tasks():
                    with ingest:
                        async with trio.open_nursery() as inner:
                            if router is not None:
                                inner.start_soon(self._ingest, router, True)
                            if pull is not None:
                                inner.start_soon(self._ingest, pull, False)

                # The other binds (metrics, cmdp, samwise) first: if one fails, nothing
                # was read from a client nor sent to an output (a StartupError, exit 2).
                for starter in self._tasks:
                    await starter(self, nursery)
                nursery.start_soon(ingest_tasks)
                self.path.start(nursery)            # the spool, the group commit
                for line in ineffective(s):
                    log.warning("%s", line)
                nursery.start_soon(self.ticker.run)
                if isinstance(self.pub, zmq_trio.PubSocket):
                    nursery.start_soon(poll_subscriptions, self.pub.guard)
                nursery.start_soon(self.lag.run)
                if self.outputs:
                    nursery.start_soon(self._run_outputs)
                self.ready.set()
                log.info("%s", self.ready_line(self.pipeline.seq + 1))   # after a marker
                task_status.started(self)
                await self._shutdown_requested.wait()
                # ---- graceful shutdown: stop reading, flush, persist
                self.stopping = True
                ingest.cancel()
                await self._drain_final(router, pull)
                await self.path.drain(s.shutdown_timeout / 2)
                await self._stop_outputs()
                nursery.cancel_scope.cancel()
        finally:
            self._close()
            self.stopped.set()

    def _watch_peers(self, name: str, sock: zmq.Socket) -> None:
        """Count the socket's peers for the ZAP handler's zmq_max_peers (io/peers.py)."""
        limit = self.peer_limit
        if limit is None:
            return
        guard = self.pub.guard if name == "pub" else self.stats_guard if name == "stats" \
            else None
        failed = None
        plain = ()
        if self.curve is not None:
            plain = self.curve.plain_endpoints.get(name, ())
            if name in self.curve.sockets:
                failed = functools.partial(self.curve.handshake_failed, name)
        limit.watch(name, sock, guard=guard, on_failed=failed, endpoints=plain)

    async def _run_outputs(self) -> None:
        with trio.CancelScope() as scope:
            self._outputs_scope = scope
            async with trio.open_nursery() as nursery:
                for sup in self.outputs:
                    nursery.start_soon(sup.run)
        self._outputs_done.set()

    async def _stop_outputs(self) -> None:
        """Ask outputs to finish what is in flight; cancel what is left after the budget."""
        if not self.outputs:
            return
        graceful = [s for s in self.outputs if hasattr(s.output, "request_shutdown")]
        for sup in self.outputs:
            await sup.stop(0)
        if graceful and len(graceful) == len(self.outputs):
            with trio.move_on_after(self.settings.shutdown_timeout / 3):
                await self._outputs_done.wait()
        if self._outputs_scope is not None:
            self._outputs_scope.cancel()

    def acquire_state(self) -> None:
        """Lock the sequence state and prove it writable, or refuse to start (StartupError)."""
        try:
            self.sequence_state.acquire()
        except StateDirError as e:
            raise self.settings.startup_error("state_dir", e.cause) from None

    _RECOVERED = {"none": "no earlier state", "clean": "after a clean shutdown",
                  "crash": "after a crash: past the reservation", "spool": "after the spool"}

    def ready_line(self, first: int) -> str:
        """The "ready" log line: everything an operator needs to find the relay's parts."""
        s = self.settings
        parts = [", ".join(f"{k}={v}" for k, v in self.endpoints.items())]
        if self.http is not None and self.http.bound_port:
            parts.append(f"metrics http://{s.metrics_ip}:{self.http.bound_port}/metrics")
        else:
            parts.append("metrics endpoint off")
        parts.append(f"state dir {s.resolved_state_dir()} (sequence continues at {first}, "
                     f"{self._RECOVERED.get(self.sequence_state.recovered_from, '?')})")
        spool = s.resolved_spool_dir() if self.spool is not None else None
        parts.append(f"spool {spool}" if spool else "spool off (no output configured)")
        parts.append(f"archive {s.archive_dir}" if s.archive_dir else "archive off")
        names = [sup.name for sup in self.outputs]
        parts.append(f"outputs {', '.join(names)}" if names else "no outputs configured")
        if self.cmdp is not None:
            parts.append(f"cmdp port {getattr(self.cmdp, 'port', s.cmdp_port)}")
        if self.samwise is not None:
            parts.append(f"samwise {', '.join(self.samwise.bound)}")
        parts.append("C socket loops" if zmq_fast.AVAILABLE else
                     f"pyzmq socket loops only: {zmq_fast.WHY_NOT}")
        return f"relay device {s.device_id} ready: " + "; ".join(parts)

    async def ingest_external(self, acc: list[tuple]) -> bool:
        """Stamp, publish and spool messages from an input (Lumberjack/Courier server).

        ``acc`` holds ``(app_env, topic, body, compression, created_ms_8)`` tuples.
        True once they are in the spool (the input then ACKs); False when the relay is
        shutting down (nothing taken: the sender resends).  Waits while the spool is full
        (policy block), like the ZeroMQ ingest.
        """
        path = self.path
        if path.would_block():
            await path.pause()
        if self.stopping or self.pipeline is None:
            return False
        with trio.CancelScope(shield=True):
            p = self.pipeline
            self.batches += 1
            if acc:
                if self.compress_method:
                    idx = p.needs_compression(acc)
                    if idx:
                        await self.compressors.compress(p, acc, idx)
                records = p.commit(acc, now_ms())
                if p.seq >= self.sequence_state.reserved:
                    self.sequence_state.reserve(p.seq, len(records))
                # False: the relay stops with the batch not in the spool; the input must
                # not ACK it (the sender resends to the next relay run)
                return await path.commit(records)
        return True

    def _close(self) -> None:
        p = self.pipeline
        self.compressors.close()
        if self.spool is not None:
            try:
                self.spool.close()          # persists every output's cursor
            except Exception:
                log.exception("closing the spool failed")
        if p is not None:
            self.sequence_state.save_clean(p.seq)
        self.sequence_state.release()
        linger = int(self.settings.shutdown_timeout * 1000)
        threaded = [(tp, ms) for tp, ms in ((self.pub, linger), (self.stats_pub, 0))
                    if isinstance(tp, ThreadedPub)]
        for tp, _ in threaded:
            tp.request_stop()
        deadline = time.monotonic() + XPUB_STOP_SECONDS
        stuck = False
        for tp, ms in threaded:
            # its thread forwards what was published, then the guard (monitor, dups of
            # the subscribers' fds) and the sockets are closed
            stuck |= not tp.close(linger=ms, timeout=max(0.0, deadline - time.monotonic()))
        if isinstance(self.pub, zmq_trio.PubSocket):
            self.pub.close(linger=linger)
        if self.peer_limit is not None:
            self.peer_limit.close()  # the monitors it opened (after the XPUBs' threads)
        for sock in self._sockets:
            try:
                sock.close(linger=0)
            except zmq.ZMQError:
                pass
        if self._own_ctx and not (stuck or xpubthread.abandoned()):
            self.ctx.term()
        log.info("relay stopped at sequence %d", p.seq if p else 0)

    # --------------------------------------------------------------- ingest
    async def _ingest(self, sock: zmq.Socket, is_router: bool) -> None:
        limit = self.settings.batch_size
        max_bytes = self.settings.ingest_max_bytes
        max_event = self.settings.max_event_bytes
        drain = zmq_trio.drain_bytes
        path = self.path
        # drain + stamp (+ -x lz4) + publish + spool records in one C loop
        fused = ingestpass.available(self.compress_method)
        while True:
            if path.would_block():
                # the spool is full (policy "block"), or too many replies wait for the
                # group commit's fdatasync: stop reading; ZeroMQ's HWM pushes back
                await path.pause()
            # bounded in messages and in bytes (ingest_max_bytes + one message): only one
            # batch per input socket is in the process at a time
            if fused:
                r = self._fast_pass(sock, is_router, limit, max_bytes, max_event)
                if r is None:
                    await path.wait_in(sock)
                    continue
                if r.spool is not None or r.replies:
                    # spooled and answered (or handed to the group commit) to the end;
                    # nothing to hand over: a PULL batch without a spool
                    await path.take(sock, r.replies,
                                    encoded=(r.spool, r.stamped, r.spool_seq, r.last_meta))
                if r.leftover:
                    # a message off the fast path and the rest of the batch, in order
                    with trio.CancelScope(shield=True):
                        await self._process(sock, r.leftover, is_router, r.oversize)
                await path.between_passes()
                continue
            batch, _, biggest = drain(sock, limit, max_bytes)
            if not batch:
                await path.wait_in(sock)
                continue
            # A drained batch is processed to the end even when shutdown starts.
            with trio.CancelScope(shield=True):
                await self._process(sock, batch, is_router, biggest > max_event)
            batch = None
            await path.between_passes()

    async def _process(self, sock: zmq.Socket, batch: list[list[bytes]], is_router: bool,
                       oversize: bool = False) -> None:
        p = self.pipeline
        self.batches += 1
        replies: list[list[bytes]] = []
        if oversize:
            batch = p.drop_oversize(batch, is_router, replies, self.settings.max_event_bytes)
        records = None
        if not is_router and not self.compress_method:
            # validate + stamp + publish in one pass (C loop, stamping.py)
            records = acc = p.stamp_pull(batch, now_ms())
        else:
            acc = p.prepare_router(batch, replies) if is_router else p.prepare_pull(batch)
        if acc:
            if self.compress_method:
                idx = p.needs_compression(acc)
                if idx:
                    await self.compressors.compress(p, acc, idx)
            if records is None:
                records = p.commit(acc, now_ms())
            if p.seq >= self.sequence_state.reserved:
                self.sequence_state.reserve(p.seq, len(records))
        await self.path.take(sock, replies, records=records or None)

    def _fast_pass(self, sock: zmq.Socket, is_router: bool, limit: int, max_bytes: int,
                   max_event: int) -> ingestpass.PassResult | None:
        """One batch through the C loop (relay/ingestpass.py): stamped and published (not
        yet spooled nor answered); None when the socket had nothing.  The records are
        encoded numbered from the batch path's next spool seq (-1: no spool, none)."""
        p = self.pipeline
        r = ingestpass.run(sock, self.pub, p, limit, max_bytes, max_event, now_ms(),
                           self.path.next_seq(), is_router, self.compress_method)
        if not r.stamped and not r.leftover:
            return None
        if r.stamped:
            self.batches += 1
            if p.seq >= self.sequence_state.reserved:
                self.sequence_state.reserve(p.seq, r.stamped)
        return r

    spool_write_failures = property(lambda self: self.spool_writes.failures)
    spool_blocked_seconds = property(lambda self: self.spool_writes.blocked_seconds)

    async def _drain_final(self, router, pull) -> None:
        """After ingest stopped: take what is already queued in the sockets, then stop."""
        with trio.move_on_after(self.settings.shutdown_timeout / 2) as scope:
            scope.shield = True
            for sock, is_router in ((router, True), (pull, False)):
                if sock is None:
                    continue
                while True:
                    batch, _, biggest = zmq_trio.drain_bytes(
                        sock, self.settings.batch_size, self.settings.ingest_max_bytes)
                    if not batch:
                        break
                    await self._process(sock, batch, is_router,
                                        biggest > self.settings.max_event_bytes)
                    batch = None

    # --------------------------------------------------------------- ticker
    def _make_ticker(self) -> Ticker:
        s = self.settings
        pub_port = s.pub_port
        if pub_port == 0 and "pub" in self.endpoints:
            pub_port = int(self.endpoints["pub"].rsplit(":", 1)[1])
        return Ticker(pipeline=self.pipeline, publish=self.pub.publish, fqdn=self.fqdn,
                      device_id=s.device_id, pub_port=pub_port,
                      heartbeat_interval=s.heartbeat_interval,
                      stats_interval=s.stats_interval,
                      publish_stats=self.stats_pub.publish if self.stats_pub else None,
                      sequence_state=self.sequence_state,
                      spool_frames=self.path.spool_heartbeats)

    heartbeats = property(lambda self: self.ticker.heartbeats if self.ticker else 0)
    stats_guard = property(lambda self: self.stats_pub.guard if self.stats_pub else None)
    loop_lag = property(lambda self: self.lag.last)
    loop_lag_max = property(lambda self: self.lag.max_ever)

    # ---------------------------------------------------------------- stats
    def readiness_problems(self) -> list[str]:
        """Why the relay is not ready (empty list = ready)."""
        problems = []
        if not self.ready.is_set():
            problems.append("sockets not bound yet")
        if self.stopping:
            problems.append("shutting down")
        for out in self.outputs:
            why = out.readiness_problem() if hasattr(out, "readiness_problem") else None
            if why:
                problems.append(why)
        for tp in (self.pub, self.stats_pub):
            if isinstance(tp, ThreadedPub) and self.ready.is_set() and not self.stopping \
                    and not tp.running:
                problems.append(f"the thread of {tp.name} is not running")
        paused = self.spool.paused_reason() if self.spool is not None else None
        if paused:
            problems.append(paused)             # ingress paused: spool or disk full
        return problems

    def stats(self) -> dict:
        p = self.pipeline
        c = p.counters if p else None
        return {
            "sequence": p.seq if p else 0,
            "msgs_received": c.received if c else 0,
            "bytes_received": c.received_bytes if c else 0,
            "invalid": dict(c.invalid_by_reason) if c else {},
            "pings": c.pings if c else 0,
            "pub_drops": self.pub.drops if self.pub else 0,
            "heartbeats": self.heartbeats,
            "loop_lag": self.loop_lag,
        }

