"""Run a relay as a service: the relay, its HTTP endpoint and signal handling."""

from __future__ import annotations

import logging
import signal

import trio

from ..config import Settings
from ..health.http import HTTPServer
from ..health.metrics import make_registry, metrics_handler
from .app import Relay

log = logging.getLogger("logjam_relay.service")


def attach_spool_and_outputs(relay: Relay, settings: Settings) -> None:
    """Open the spool (when an output or a spool directory is configured) and the outputs."""
    spool_dir = settings.resolved_spool_dir()
    if spool_dir is None:
        return
    from ..outputs.supervisor import OutputSupervisor, make_output, parse_outputs
    from ..spool.spool import Spool

    specs = parse_outputs(settings.outputs)
    archive = None
    if settings.archive_dir:
        from ..outputs.archive import Archive
        archive = Archive(settings.archive_dir, settings.archive_retention)
    spool = Spool(spool_dir, readers=[s.name for s in specs],
                  segment_bytes=settings.spool_segment_bytes,
                  segment_age_s=settings.archive_seal_after,
                  on_seal=archive.on_seal if archive is not None else None,
                  max_bytes=settings.spool_max_bytes, policy=settings.spool_policy,
                  fsync=settings.spool_fsync, fsync_interval_s=settings.spool_fsync_interval)
    spool.defer_batch_sync = settings.spool_fsync == "batch"   # fdatasync off the event loop
    relay.spool = spool
    if archive is not None:
        # segments sealed during the spool's own recovery were not announced: take them now
        archive.catch_up(spool_dir)
        relay.archive = archive

        async def start_archive(nursery):
            nursery.start_soon(archive.run)
        relay.add_task(start_archive)
    for spec in specs:
        reader = spool.reader(spec.name)
        relay.outputs.append(OutputSupervisor(
            spec, reader, lambda spec=spec, reader=reader: make_output(spec, reader,
                                                                       relay.fqdn)))
    log.info("spool %s (%s, max %d bytes, fsync %s) with outputs: %s", spool_dir,
             settings.spool_policy, settings.spool_max_bytes, settings.spool_fsync,
             ", ".join(s.name for s in specs) or "none")


def attach_cmdp(relay: Relay, settings: Settings) -> None:
    """CMDP STAT/LOG topics on an XPUB, announced through CHIRP (off unless cmdp_port)."""
    if not settings.cmdp_port:
        return
    from ..health.cmdp import CMDPConfig, CMDPSender, LoopLag, ProcessStats, RelayStatsProvider

    cfg = CMDPConfig(cmdp_port=settings.cmdp_port, cmdp_name=settings.cmdp_name,
                     chirp_group=settings.chirp_group, chirp_interface=settings.chirp_interface,
                     cmdp_bind=settings.bind)

    def outputs():
        out = {}
        for sup in relay.outputs:
            st = sup.stats()
            sp = st.get("spool", {})
            out[sup.name] = {
                "backlog": sp.get("backlog_records", 0),
                "acked": st.get("events_acked", 0),
                "resends": st.get("events_resent", 0),
                "reconnects": st.get("reconnects", max(0, st.get("connect_attempts", 1) - 1)),
                "ack_rtt": st.get("window_rtt_last_seconds",
                                  st.get("payload_rtt_last_seconds", 0.0)),
            }
        return out

    lag = LoopLag()
    provider = RelayStatsProvider(relay=relay.stats, outputs=outputs, process=ProcessStats(),
                                  loop_lag=lag)
    sender = CMDPSender(cfg, provider)
    relay.cmdp = sender

    async def run_cmdp(task_status=trio.TASK_STATUS_IGNORED):
        sender.install_log_handler("logjam_relay")
        try:
            await sender.run(task_status=task_status)
        finally:
            sender.remove_log_handler("logjam_relay")

    async def start_cmdp(nursery):
        nursery.start_soon(lag.run)
        await nursery.start(run_cmdp)
    relay.add_task(start_cmdp)


def attach_samwise(relay: Relay, settings: Settings) -> None:
    """The samd-compatible endpoint with its own spool and one output per broker."""
    if not settings.samwise:
        return
    from ..samwise.config import SamwiseConfig
    from ..samwise.endpoint import SamwiseService
    from ..spool.spool import Spool

    cfg = SamwiseConfig.from_args(settings.samwise, settings.amqp_brokers,
                                  handoff_after=settings.samwise_handoff_after)
    spool_dir = settings.samwise_spool_dir or str(settings.resolved_state_dir() /
                                                  "samwise-spool")
    spool = Spool(spool_dir, readers=cfg.reader_names(),
                  segment_bytes=settings.spool_segment_bytes,
                  max_bytes=settings.spool_max_bytes, policy=settings.spool_policy,
                  fsync=settings.spool_fsync, fsync_interval_s=settings.spool_fsync_interval)
    service = SamwiseService(cfg, store=spool)
    relay.samwise = service

    async def run_samwise(task_status=trio.TASK_STATUS_IGNORED):
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(spool.run)
                await nursery.start(service.run)
                task_status.started()
        finally:
            spool.close()

    async def start_samwise(nursery):
        await nursery.start(run_samwise)
    relay.add_task(start_samwise)
    log.info("samwise endpoint on %s, brokers %s, spool %s", ", ".join(cfg.endpoints),
             ", ".join(b.name for b in cfg.brokers), spool_dir)


def build(settings: Settings) -> Relay:
    """Create a relay with everything the settings ask for attached."""
    relay = Relay(settings)
    attach_spool_and_outputs(relay, settings)
    attach_cmdp(relay, settings)
    attach_samwise(relay, settings)
    registry, collector = make_registry(relay)
    relay.metrics_registry = registry
    relay.metrics_collector = collector

    def healthz():
        return 200, "text/plain", b"ok\n"

    def readyz():
        problems = relay.readiness_problems()
        if problems:
            return 503, "text/plain", ("\n".join(problems) + "\n").encode()
        return 200, "text/plain", b"ready\n"

    if settings.metrics_port:
        http = HTTPServer({"/metrics": metrics_handler(registry), "/healthz": healthz,
                           "/readyz": readyz}, settings.metrics_ip, settings.metrics_port)
        relay.http = http

        async def start_http(nursery):
            await nursery.start(http.run)
        relay.add_task(start_http)
    return relay


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
