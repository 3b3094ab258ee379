"""Run a relay as a service: the relay, its HTTP endpoint and signal handling."""

from __future__ import annotations

import functools
import logging
import os
import signal

import trio
import zmq

from ..config import Settings, find_exception
from ..health.http import HTTPServer
from ..health.metrics import make_registry, metrics_handler
from ..redact import redact_text
from .app import Relay, RelayParts, bind_cause
from .configure import check_settings
from .memory import samwise_rcv_hwm
from .sequence import SequenceState, StateDirError
from .spoolwrite import relay_fsync_policy, samwise_fsync_policy

log = logging.getLogger("logjam_relay.service")


def _why(e: BaseException) -> str:
    return (getattr(e, "strerror", None) or str(e)).lower()


def writable_dir(settings: Settings, name: str, path, purpose: str) -> None:
    """Create ``path`` and prove a file can be written and synced in it, or refuse to start.

    A spool or archive that cannot be written would silently drop a guarantee, so
    this is a :class:`StartupError` naming the setting, not a log line.
    """
    probe = os.path.join(path, f".probe-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise settings.startup_error(name, f"cannot write in it ({_why(e)}): {purpose}",
                                     value=path) from None


def check_output_tls(settings: Settings, specs) -> None:
    """Load every output's TLS files now: a missing CA or key is a start-up error."""
    import ssl
    for spec in specs:
        if spec.scheme == "lumberjack":
            from ..outputs.lumberjack import parse_url
        else:
            from ..outputs.courier import parse_url
        tls = getattr(parse_url(spec.url), "tls", None)
        if tls is None or not tls.enabled:
            continue
        for what in ("ca", "cert", "key"):
            path = getattr(tls, what, None)
            if path and not os.access(path, os.R_OK):
                cause = "no such file" if not os.path.exists(path) else "not readable"
                raise settings.startup_error(
                    "outputs", f"TLS {what} file {path}: {cause}", value=spec.url)
        try:
            tls.client_context()
        except (OSError, ssl.SSLError, ValueError) as e:
            raise settings.startup_error("outputs", f"TLS files cannot be loaded: {e}",
                                         value=spec.url) from None


def spool_and_outputs(settings: Settings, fqdn: str) -> dict:
    """The spool (when an output or a spool directory is configured), the archive, the
    dead-letter store and the outputs: :class:`RelayParts` fields."""
    spool_dir = settings.resolved_spool_dir()
    if spool_dir is None:
        return {}
    from ..outputs.supervisor import OutputSupervisor, make_output, parse_outputs
    from ..spool.spool import Spool, SpoolError, SpoolLockedError

    specs = parse_outputs(settings.outputs)
    check_output_tls(settings, specs)
    spool_setting = "spool_dir" if settings.spool_dir else "state_dir"
    writable_dir(settings, spool_setting, str(spool_dir),
                 "accepted messages could not be spooled")
    archive = None
    if settings.archive_dir:
        from ..outputs.archive import Archive
        writable_dir(settings, "archive_dir", settings.archive_dir,
                     "sealed segments could not be archived")
        archive = Archive(settings.archive_dir, settings.archive_retention)
    try:
        spool = Spool(spool_dir, readers=[s.name for s in specs],
                      segment_bytes=settings.spool_segment_bytes,
                      segment_age_s=settings.archive_seal_after,
                      on_seal=archive.on_seal if archive is not None else None,
                      max_bytes=settings.spool_max_bytes, policy=settings.spool_policy,
                      fsync=relay_fsync_policy(settings))
    except SpoolLockedError:
        raise settings.startup_error(spool_setting, "spool locked: in use by another relay "
                                     "(give each relay its own spool_dir)",
                                     value=spool_dir) from None
    except SpoolError as e:
        raise settings.startup_error(spool_setting, f"cannot open the spool: {e}",
                                     value=spool_dir) from None
    parts: dict = {"spool": spool, "archive": archive, "tasks": ()}
    if archive is not None:
        # segments sealed during the spool's own recovery were not announced: take them now
        archive.catch_up(spool_dir)

        async def start_archive(relay, nursery):
            nursery.start_soon(archive.run)
        parts["tasks"] = (start_archive,)
    dead_letters = None
    if specs:
        from ..deadletter import DeadLetterStore
        writable_dir(settings, "dead_letter_dir", str(settings.resolved_dead_letter_dir()),
                     "undeliverable events could not be kept")
        dead_letters = DeadLetterStore(settings.resolved_dead_letter_dir(),
                                       settings.dead_letter_max_bytes)
    parts["dead_letters"] = dead_letters
    outputs = []
    for spec in specs:
        reader = spool.reader(spec.name)
        if settings.output_isolation == "process":   # off the ingest thread (outputs/worker.py)
            from ..outputs.worker import isolated_factory
            factory = isolated_factory(spec, reader, fqdn, dead_letters=dead_letters,
                                       max_event_bytes=settings.max_event_bytes)
        else:
            factory = functools.partial(make_output, spec, reader, fqdn,
                                        dead_letters=dead_letters,
                                        max_event_bytes=settings.max_event_bytes)
        outputs.append(OutputSupervisor(
            spec, reader, factory,
            retry_budget=settings.ready_output_down_after or float("inf")))
    from ..units import human_size
    log.info("spool %s (%s, max %s, fsync %s) with outputs: %s", spool_dir,
             settings.spool_policy, human_size(settings.spool_max_bytes), settings.spool_fsync,
             ", ".join(s.name for s in specs) or "none configured (archive only)")
    parts["outputs"] = tuple(outputs)
    return parts


def inputs_part(settings: Settings) -> dict:
    """Lumberjack/Courier listeners in the relay's nursery (docs/inputs.md): each is
    built with the relay it hands its events to."""
    if not settings.inputs:
        return {}
    import ssl

    from ..inputs import make_input, parse_inputs
    specs = parse_inputs(settings.inputs, max_event_bytes=settings.max_event_bytes)

    def make_inputs(relay):
        inputs = []
        for url, spec in zip(settings.inputs, specs, strict=True):
            try:
                inputs.append(make_input(spec, relay))
            except (OSError, ssl.SSLError, ValueError) as e:    # the server's TLS files
                raise settings.startup_error("inputs", f"TLS files cannot be loaded: {e}",
                                             value=redact_text(url)) from None
        return tuple(inputs)

    async def start_inputs(relay, nursery):
        for url, inp in zip(settings.inputs, relay.inputs, strict=True):
            try:
                port = await nursery.start(inp.run)
            except OSError as e:
                raise settings.startup_error("inputs", bind_cause(
                    f"{inp.spec.host}:{inp.spec.port}", e), value=redact_text(url)) from None
            relay.endpoints[f"input_{inp.name}"] = f"{inp.spec.scheme}://{inp.spec.host}:{port}"
    return {"make_inputs": make_inputs, "tasks": (start_inputs,)}


def make_curve(settings: Settings):
    """ZeroMQ CURVE (docs/security.md); off (None) unless curve_secret_key.  Its ZAP checks
    run in the relay's ZAP handler (peers_part)."""
    if not settings.curve_secret_key:
        return None
    from ..io.curve import Curve, parse_plain_endpoints
    curve = Curve(settings.curve_secret_key, settings.curve_allow_dir, settings.curve_sockets,
                  parse_plain_endpoints(settings.curve_plain_endpoints))
    log.info("CURVE on %s (server key %s), %d client key(s) allowed from %s%s",
             ", ".join(settings.curve_sockets), curve.public.decode(), len(curve.allow.keys),
             settings.curve_allow_dir,
             f"; plain endpoints {settings.curve_plain_endpoints}"
             if settings.curve_plain_endpoints else "")
    return curve


def peers_part(settings: Settings, ctx: zmq.Context, curve) -> dict:
    """The ZAP handler, bound before any relay socket: zmq_max_peers on every ZeroMQ socket
    and the XPUBs' admission while connection ends are expensive (io/peers.py), then the
    CURVE check."""
    from ..io.peers import PeerLimit, ZapServer
    limit = PeerLimit(settings.zmq_max_peers)
    zap = ZapServer(limit, curve)
    sock = zap.open(ctx)

    async def start_zap(relay, nursery):
        nursery.start_soon(zap.serve)
    return {"peer_limit": limit, "sockets": (sock,), "tasks": (start_zap,)}


def cmdp_part(settings: Settings) -> dict:
    """CMDP STAT/LOG topics on an XPUB, announced through CHIRP (off unless cmdp_port)."""
    if not settings.cmdp_port:
        return {}
    from ..health.cmdp import CMDPConfig, CMDPSender, ProcessStats, RelayStatsProvider

    cfg = CMDPConfig(cmdp_port=settings.cmdp_port, cmdp_name=settings.cmdp_name,
                     chirp_group=settings.chirp_group, chirp_interface=settings.chirp_interface,
                     cmdp_bind=settings.bind, max_subscriptions=settings.max_subscriptions)

    def make_cmdp(relay):
        def outputs():
            out = {}
            for sup in relay.outputs:
                st = sup.stats()
                sp = st.get("spool", {})
                out[sup.name] = {
                    "backlog": sp.get("backlog_records", 0),
                    "lost": sp.get("lost", 0),  # spool records this output will never send
                    "acked": st.get("events_acked", 0),
                    "resends": st.get("events_resent", 0),
                    "reconnects": st.get("reconnects",
                                         max(0, st.get("connect_attempts", 1) - 1)),
                    "ack_rtt": st.get("window_rtt_last_seconds",
                                      st.get("payload_rtt_last_seconds", 0.0)),
                    "dead_letters": sum(st.get("dead_letters", {}).values()),
                }
            return out

        lag = relay.lag             # the relay's own probe (it runs in the relay's nursery)
        provider = RelayStatsProvider(relay=relay.stats, outputs=outputs,
                                      process=ProcessStats(), loop_lag=lag)
        # the relay's context: its ZAP handler (zmq_max_peers) serves that context only
        sender = CMDPSender(cfg, provider, context=relay.ctx)
        sender.peer_limit = relay.peer_limit
        return sender

    async def start_cmdp(relay, nursery):
        sender = relay.cmdp

        async def run_cmdp(task_status=trio.TASK_STATUS_IGNORED):
            sender.install_log_handler("logjam_relay")
            try:
                await sender.run(task_status=task_status)
            finally:
                sender.remove_log_handler("logjam_relay")

        try:
            await nursery.start(run_cmdp)
        except BaseException as e:
            z = find_exception(e, zmq.ZMQError)
            if z is None:
                raise
            raise settings.startup_error("cmdp_port", bind_cause(sender.endpoint, z)) from None
    return {"make_cmdp": make_cmdp, "tasks": (start_cmdp,)}


def samwise_part(settings: Settings, ctx: zmq.Context, peer_limit) -> dict:
    """The samd-compatible endpoint with its own spool and one output per broker."""
    if not settings.samwise:
        return {}
    from ..samwise.config import SamwiseConfig
    from ..samwise.endpoint import SamwiseService
    from ..spool.spool import Spool

    cfg = SamwiseConfig.from_args(settings.samwise, settings.amqp_brokers,
                                  handoff_after=settings.samwise_handoff_after,
                                  publish_delay=settings.samwise_publish_delay,
                                  rpc_max_concurrent=settings.samwise_rpc_max_concurrent,
                                  rpc_max_queued=settings.samwise_rpc_max_queued,
                                  rpc_allow=tuple(settings.samwise_rpc_allow))
    spool_dir = str(settings.resolved_samwise_spool_dir())
    from ..spool.spool import SpoolError
    spool_setting = "samwise_spool_dir" if settings.samwise_spool_dir else "state_dir"
    writable_dir(settings, spool_setting, spool_dir, "accepted samwise requests could not be "
                 "spooled")
    try:
        spool = Spool(spool_dir, readers=cfg.reader_names(),
                      segment_bytes=settings.spool_segment_bytes,
                      max_bytes=settings.spool_max_bytes, policy=settings.spool_policy,
                      fsync=samwise_fsync_policy(settings))
    except SpoolError as e:
        raise settings.startup_error(spool_setting, f"cannot open the samwise spool: {e}",
                                     value=spool_dir) from None
    # with zmq_max_peers its handshakes go through the relay's ZAP handler, which serves
    # the relay's context only; otherwise it keeps an I/O thread of its own
    service = SamwiseService(cfg, store=spool,
                             zmq_context=ctx if settings.zmq_max_peers else None)
    service.max_msg_bytes = settings.resolved_zmq_max_msg_bytes()
    service.max_batch_bytes = settings.ingest_max_bytes
    service.rcv_hwm = samwise_rcv_hwm(settings)
    service.peer_limit = peer_limit

    async def run_samwise(task_status=trio.TASK_STATUS_IGNORED):
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(spool.run)
                await nursery.start(service.run)
                task_status.started()
        finally:
            spool.close()

    async def start_samwise(relay, nursery):
        try:
            await nursery.start(run_samwise)
        except BaseException as e:
            z = find_exception(e, zmq.ZMQError)
            if z is None:
                raise
            # endpoints bind in order: the first one not bound is the one that failed
            failed = cfg.endpoints[min(len(service.bound), len(cfg.endpoints) - 1)]
            raise settings.startup_error("samwise", bind_cause(failed, z),
                                         value=failed) from None
    log.info("samwise endpoint on %s, brokers %s, spool %s", ", ".join(cfg.endpoints),
             ", ".join(b.name for b in cfg.brokers), spool_dir)
    return {"samwise": service, "tasks": (start_samwise,)}


def zmq_ports(relay: Relay) -> dict[int, str]:
    """The TCP ports the relay's ZeroMQ sockets are bound to -> the socket's name."""
    eps: list[tuple[str, str]] = [(k, v) for k, v in relay.endpoints.items()
                                  if not k.startswith("input_")]
    if relay.cmdp is not None and getattr(relay.cmdp, "port", None):
        eps.append(("cmdp", f"tcp://*:{relay.cmdp.port}"))
    if relay.samwise is not None:
        eps += [("samwise", ep) for ep in relay.samwise.bound]
    if relay.curve is not None:
        for name, plain in relay.curve.plain_endpoints.items():
            eps += [(f"{name}_plain", ep) for ep in plain]
    out: dict[int, str] = {}
    for name, ep in eps:
        if ep.startswith("tcp://"):
            try:
                out[int(ep.rsplit(":", 1)[1])] = name
            except ValueError:
                pass
    return out


def fd_guard_part() -> dict:
    """The fd reserve (taken now, while descriptors are free) and the guard that drops
    silent ZeroMQ connections when the process runs out of them (docs/operations.md,
    "Open files")."""
    from ..fdreserve import RESERVE
    from ..io.fdguard import FdGuard
    RESERVE.fill()

    def make_fd_guard(relay):
        return FdGuard(lambda: zmq_ports(relay))

    async def start_guard(relay, nursery):
        await nursery.start(relay.fd_guard.run)
    return {"make_fd_guard": make_fd_guard, "tasks": (start_guard,)}


def metrics_and_http_parts(settings: Settings) -> dict:
    """/metrics (the relay's collector and the extra ones of its parts), /healthz and
    /readyz; the HTTP server only with a metrics_port."""
    def make_metrics(relay):
        registry, collector = make_registry(relay)
        if relay.inputs:
            from ..inputs.base import InputsCollector
            collector.extra.append(InputsCollector(relay, relay.inputs))
        if relay.peer_limit is not None:
            limit, device = relay.peer_limit, str(settings.device_id)

            class _PeerMetrics:
                def collect(self):
                    return limit.collect(device)
            collector.extra.append(_PeerMetrics())
        if relay.curve is not None:
            dev = str(settings.device_id)
            curve = relay.curve

            class _CurveMetrics:
                def collect(self):
                    return curve.collect(dev)
            collector.extra.append(_CurveMetrics())
        return registry, collector

    parts: dict = {"make_metrics": make_metrics}
    if not settings.metrics_port:
        return parts
    web = None
    if settings.web_config_file:            # TLS + basic auth (health/webconfig.py)
        from ..health.webconfig import load as load_web_config
        web = load_web_config(settings.web_config_file)

    def make_http(relay):
        def healthz():
            return 200, "text/plain", b"ok\n"

        def readyz():
            problems = relay.readiness_problems()
            if problems:
                return 503, "text/plain", ("\n".join(problems) + "\n").encode()
            return 200, "text/plain", b"ready\n"

        return HTTPServer({"/metrics": metrics_handler(relay.metrics_registry),
                           "/healthz": healthz, "/readyz": readyz},
                          settings.metrics_ip, settings.metrics_port,
                          max_connections=settings.metrics_max_connections,
                          header_timeout=settings.metrics_header_timeout,
                          ssl_context=web.ssl_context if web else None,
                          authorize=web.authorize if web and web.users else None,
                          authorize_cached=web.authorize_cached if web and web.users
                          else None)

    async def start_http(relay, nursery):
        try:
            await nursery.start(relay.http.run)
        except BaseException as e:
            err = find_exception(e, OSError)
            if err is None:
                raise
            raise settings.startup_error("metrics_port", bind_cause(
                f"{settings.metrics_ip}:{settings.metrics_port}", err)) from None
    return parts | {"make_http": make_http, "tasks": (start_http,)}


def build(settings: Settings) -> Relay:
    """Create a relay with everything the settings ask for, built whole from its parts."""
    from ..redact import install_log_redaction
    install_log_redaction()             # no password in any log line or CMDP LOG record
    check_settings(settings)            # each subsystem's values (a ConfigError names one)
    state = SequenceState(settings.resolved_state_dir()
                          / f"sequence-device-{settings.device_id}.json", settings.device_id)
    # the sequence state first: a second relay on the same state dir stops here, before
    # it touches the spool
    try:
        state.acquire()
    except StateDirError as e:
        raise settings.startup_error("state_dir", e.cause) from None
    fqdn = settings.resolved_fqdn()
    ctx = None
    spool = None
    try:
        fd_guard = fd_guard_part()
        spooled = spool_and_outputs(settings, fqdn)
        spool = spooled.get("spool")
        inputs = inputs_part(settings)
        curve = make_curve(settings)
        ctx = zmq.Context(io_threads=settings.io_threads)
        peers = peers_part(settings, ctx, curve)
        cmdp = cmdp_part(settings)
        samwise = samwise_part(settings, ctx, peers["peer_limit"])
        web = metrics_and_http_parts(settings)
        # the tasks start in this order, before the ingest (a bind that fails stops the
        # start before anything was read from a client)
        pieces = (fd_guard, spooled, inputs, peers, cmdp, samwise, web)
        tasks = tuple(t for piece in pieces for t in piece.get("tasks", ()))
        fields = {k: v for piece in pieces for k, v in piece.items() if k != "tasks"}
        return Relay(settings, RelayParts(sequence_state=state, ctx=ctx, fqdn=fqdn,
                                          curve=curve, tasks=tasks, **fields))
    except BaseException:
        state.release()
        if spool is not None:
            spool.close()
        if ctx is not None:
            ctx.destroy(linger=0)
        raise


async def serve(settings: Settings, *, handle_signals: bool = True,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    relay = build(settings)
    async with trio.open_nursery() as nursery:
        if handle_signals:
            nursery.start_soon(_signals, relay)
        await nursery.start(relay.run)
        task_status.started(relay)
        await _wait_stopped(relay)
        nursery.cancel_scope.cancel()


async def _wait_stopped(relay: Relay) -> None:
    await relay.stopped.wait()


async def _signals(relay: Relay) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
        async for sig in sigs:
            log.info("received %s: shutting down", signal.Signals(sig).name)
            relay.shutdown()
            return
