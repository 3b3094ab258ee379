"""Prometheus export of the relay's plain counters, at scrape time.

logjam-device's families are kept exactly (``logjam:device:*``,
``logjam:msgbus:sequence`` and prometheus-cpp's ``exposer_*``: names, types, help
texts, label sets, counting rules) so existing dashboards and alerts keep working
(tests/test_device_metrics.py); the relay's own metrics are ``logjam_relay_*``.
Components keep ints on the hot path; this collector turns them into metric
families only when Prometheus asks.
"""

from __future__ import annotations

import os
import resource
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from .cpu import ThreadCpu


def _counter(name, doc, labels=("device",)):
    return CounterMetricFamily(name, doc, labels=list(labels))


def _gauge(name, doc, labels=("device",)):
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _one(kind, name: str, doc: str, labels: list[str], value):
    """A metric family with a single sample."""
    m = kind(name, doc)
    m.add_metric(labels, value)
    return m


def _histogram(name: str, doc: str, labels: list[str], st: dict) -> HistogramMetricFamily:
    """A histogram from ``{"buckets": {upper bound: cumulative count}, "sum": s}``."""
    h = HistogramMetricFamily(name, doc, labels=["device"])
    h.add_metric(labels, [(repr(le) if le != float("inf") else "+Inf", n)
                          for le, n in st["buckets"].items()], st["sum"])
    return h


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RelayCollector:
    """Collects from a :class:`logjam_relay.relay.app.Relay` and its parts."""

    def __init__(self, relay):
        self.relay = relay
        self.extra: list = []      # more collectors: objects with collect() -> families
        self.thread_cpu = ThreadCpu()

    def _cpu(self) -> dict[str, float]:
        """``logjam:device:cpu_seconds_total`` by ``thread`` (health/cpu.py): main and
        compressorN as logjam-device's, then the relay's other threads and processes."""
        r = self.relay
        named = {getattr(r, "loop_thread_id", None) or os.getpid(): "main"}
        pool = getattr(r, "compressors", None)
        names = pool.names if pool is not None else \
            [f"compressor{i}" for i in range(r.settings.compressors)]
        tids = pool.tids if pool is not None else [0] * len(names)
        zero = {}
        for name, tid in zip(names, tids, strict=True):
            if tid:
                named[tid] = name
            else:
                zero[name] = 0.0            # not running (no -x): none used
        http = getattr(r, "http", None)
        if http is not None and getattr(http, "thread_id", None):
            named[http.thread_id] = "metrics_http"
        workers = {}
        for sup in r.outputs:
            pid = sup.stats().get("worker_pid")
            if pid is not None:
                workers[sup.name] = pid
        return zero | self.thread_cpu.sample(named, workers)

    def _exposer(self):
        """prometheus-cpp's own families, as logjam-device serves them (no labels)."""
        http = getattr(self.relay, "http", None)
        if http is None or not hasattr(http, "scrape_stats"):
            return
        st = http.scrape_stats.snapshot()
        yield _one(CounterMetricFamily, "exposer_transferred_bytes",
                   "Transferred bytes to metrics services", [], st["bytes"])
        yield _one(CounterMetricFamily, "exposer_scrapes", "Number of times metrics were "
                   "scraped", [], st["scrapes"])
        m = Metric("exposer_request_latencies", "Latencies of serving scrape requests, in "
                   "microseconds", "summary")
        m.add_sample("exposer_request_latencies_count", {}, st["latency_count"])
        m.add_sample("exposer_request_latencies_sum", {}, st["latency_sum"])
        for q, v in st["quantiles"].items():
            m.add_sample("exposer_request_latencies", {"quantile": str(q)}, v)
        yield m

    def collect(self):
        r = self.relay
        p = r.pipeline
        if p is None:
            return
        c = p.counters
        d = str(r.settings.device_id)
        dl = [d]

        # ---- logjam-device's families: names, types, help texts and labels as
        # logjam-device 0.21.4 serves them (device-prometheus-client.cpp, measured in
        # shared/specs/reference/logjam-device.md)
        yield from self._exposer()
        yield _one(_counter, "logjam:device:msgs_received",
                   "How many logjam messages has this device received", dl, c.received)
        yield _one(_counter, "logjam:device:msgs_invalid",
                   "How many broken logjam messages have reached this device", dl, c.invalid)
        yield _one(_counter, "logjam:device:msgs_received_bytes",
                   "How many bytes of logjam messages has this device received",
                   dl, c.received_bytes)
        yield _one(_counter, "logjam:device:msgs_compressed",
                   "How many logjam messages has this device compressed", dl, c.compressed)
        yield _one(_counter, "logjam:device:msgs_compressed_bytes",
                   "How many bytes of logjam messages has this device compressed",
                   dl, c.compressed_bytes)
        m = _counter("logjam:device:cpu_seconds",
                     "Sum of user and system CPU usage per thread", ("device", "thread"))
        for thread, seconds in self._cpu().items():
            m.add_metric([d, thread], seconds)
        yield m
        yield _one(_counter, "logjam:device:ping_count",
                   "How many ping requests this device has processed", dl, c.pings)
        m = _counter("logjam:device:ping_count_by_stream",
                     "How many ping requests this device has processed for a given stream",
                     ("device", "stream"))
        for stream, n in c.pings_by_stream.items():
            m.add_metric([d, stream], n)
        yield m
        yield _one(_counter, "logjam:device:broken_meta_count",
                   "How many requests with broken meta information this device has "
                   "processed", dl, c.broken_meta)
        m = _counter("logjam:device:broken_meta_count_by_stream",
                     "How many requests with broken meta information this device has "
                     "processed for a given stream", ("device", "stream"))
        for stream, n in c.broken_meta_by_stream.items():
            m.add_metric([d, stream], n)
        yield m
        # prometheus-cpp's SetToCurrentTime: whole seconds
        yield _one(_gauge, "logjam:device:app_start_time", "Timestamp when the device started",
                   dl, int(r.start_time))
        m = _gauge("logjam:msgbus:sequence", "Current sequence number for the given logjam "
                   "device", ("device", "app"))
        m.add_metric([d, "logjam-device"], p.seq)
        yield m
        yield _one(_gauge, "logjam:device:msgs_received_max_bytes",
                   "Size of the largest messge recived by this device", dl,
                   c.max_bytes_last_second)

        # ---- the relay's own
        m = _counter("logjam_relay_messages", "messages by socket and outcome",
                     ("device", "outcome"))
        m.add_metric([d, "accepted"], c.received)
        m.add_metric([d, "invalid"], c.invalid)
        m.add_metric([d, "ping"], c.pings)
        m.add_metric([d, "legacy"], c.legacy)
        yield m
        m = _counter("logjam_relay_input_messages", "messages read by input socket",
                     ("device", "socket"))
        m.add_metric([d, "router"], c.router)
        m.add_metric([d, "pull"], c.pull)
        yield m
        m = _counter("logjam_relay_invalid", "invalid messages by reason", ("device", "reason"))
        for reason, n in c.invalid_by_reason.items():
            m.add_metric([d, reason], n)
        yield m
        m = _counter("logjam_relay_replies", "replies sent on ROUTER", ("device", "status"))
        m.add_metric([d, "202"], c.replies_202)
        m.add_metric([d, "400"], c.replies_400)
        m.add_metric([d, "200"], c.pings - c.bad_pings)
        yield m
        yield _one(_counter, "logjam_relay_reply_drops", "ROUTER replies that could not be queued",
                   dl, r.reply_drops)
        http = getattr(r, "http", None)
        if http is not None and hasattr(http, "stats"):
            hs = http.stats()
            m = _counter("logjam_relay_http_connections", "metrics endpoint connections by "
                         "outcome (evicted: closed at the connection cap while still sending "
                         "the request; rejected: cap full of busy ones; timeout: request not "
                         "complete within metrics_header_timeout)", ("device", "outcome"))
            for outcome, key in (("accepted", "connections"), ("evicted", "evicted"),
                                 ("rejected", "rejected"), ("timeout", "timeouts"),
                                 ("bad_request", "bad_requests"),
                                 ("unauthorized", "unauthorized")):
                m.add_metric([d, outcome], hs.get(key, 0))
            yield m
            yield _one(_gauge, "logjam_relay_http_open_connections",
                       "connections open on the metrics endpoint", dl, hs["open_connections"])
            yield _one(_counter, "logjam_relay_http_loop_timeouts", "requests the relay's "
                       "event loop did not answer in time (stale /metrics or 503)", dl,
                       hs["loop_timeouts"])
        yield from self._fds(d, http)
        yield _one(_counter, "logjam_relay_published", "messages published on PUB (incl. heartbeats)",
                   dl, r.pub.published if r.pub else 0)
        yield _one(_counter, "logjam_relay_pub_drops", "messages a PUB subscriber missed: its queue was at "
                   "the HWM, or the hand-over to PUB's thread was full (every subscriber)",
                   dl, r.pub.drops if r.pub else 0)
        yield _one(_gauge, "logjam_relay_pub_subscriptions", "distinct topics subscribed on PUB",
                   dl, len(r.pub.subscriptions) if r.pub else 0)
        guards = [(n, g) for n, g in (("pub", r.pub.guard if r.pub else None),
                                      ("stats", getattr(r, "stats_guard", None)),
                                      ("cmdp", r.cmdp.pub.guard if r.cmdp is not None and
                                       r.cmdp.pub is not None else None)) if g is not None]
        m = _gauge("logjam_relay_subscriptions", "subscriptions held (connection, topic), "
                   "capped by max_subscriptions", ("device", "socket"))
        for n, g in guards:
            m.add_metric([d, n], g.entries)
        yield m
        m = _gauge("logjam_relay_subscriptions_peak", "the most subscriptions held at once "
                   "since start (the peak of logjam_relay_subscriptions)", ("device", "socket"))
        for n, g in guards:
            m.add_metric([d, n], g.peak)
        yield m
        m = _counter("logjam_relay_subscriptions_refused", "subscriptions refused over "
                     "max_subscriptions", ("device", "socket"))
        for n, g in guards:
            m.add_metric([d, n], g.refused)
        yield m
        m = _counter("logjam_relay_subscription_peers_disconnected", "subscribers "
                     "disconnected for going over max_subscriptions", ("device", "socket"))
        for n, g in guards:
            m.add_metric([d, n], g.disconnected)
        yield m
        yield _one(_counter, "logjam_relay_heartbeats", "heartbeats published", dl, r.heartbeats)
        yield _one(_counter, "logjam_relay_batches", "batches drained from input sockets",
                   dl, r.batches)
        yield _one(_gauge, "logjam_relay_loop_lag_seconds", "event loop lag (last 100 ms probe)",
                   dl, r.loop_lag)
        yield _one(_gauge, "logjam_relay_loop_lag_max_seconds", "largest event loop lag seen",
                   dl, r.loop_lag_max)
        yield _one(_gauge, "logjam_relay_resident_memory_bytes", "resident set size",
                   dl, rss_bytes())
        yield _one(_gauge, "logjam_relay_up_seconds", "seconds since start",
                   dl, time.time() - r.start_time)
        yield from self._outputs_and_spool(d)
        if r.samwise is not None:
            yield from self._samwise(d, r.samwise)
        for extra in self.extra:
            yield from extra.collect()

    def _fds(self, d: str, http):
        """File descriptors: the count, the reserve, connections refused for want of them."""
        guard = getattr(self.relay, "fd_guard", None)
        if guard is None:
            return
        st = guard.stats()
        res = st["reserve"]
        dl = [d]
        yield _one(_gauge, "logjam_relay_open_fds", "file descriptors open (at the fd "
                   "guard's last count: every 0.5 s near the limit, every 5 s below)", dl,
                   st["open"])
        yield _one(_gauge, "logjam_relay_max_fds", "the soft RLIMIT_NOFILE", dl, st["limit"])
        yield _one(_gauge, "logjam_relay_fd_reserve", "descriptors held in reserve for the "
                   "relay's own files", dl, res["held"])
        yield _one(_counter, "logjam_relay_fd_reserve_used", "descriptors the relay took "
                   "from its reserve because the process was out of them", dl, res["used"])
        yield _one(_counter, "logjam_relay_fd_reserve_lost", "reserve descriptors another "
                   "thread took between close and open (taken back once free)", dl,
                   res["lost"])
        yield _one(_counter, "logjam_relay_fd_short", "looks of the fd guard (every 0.5 s) "
                   "that found fewer free descriptors than it keeps", dl, st["short"])
        yield _one(_gauge, "logjam_relay_fd_paused", "1 while the ZeroMQ sockets take no "
                   "new connections because the relay is out of file descriptors", dl,
                   st["paused"])
        m = _counter("logjam_relay_fd_refused_connections", "connections refused for want "
                     "of file descriptors, by listener and reason (silent: a ZeroMQ "
                     "connection that sent nothing, dropped; accept: closed at accept)",
                     ("device", "listener", "reason"))
        names = set(guard.ports().values()) | set(st["dropped"]) | set(st["refused"])
        for name in sorted(names):
            m.add_metric([d, name, "silent"], st["dropped"].get(name, 0))
            m.add_metric([d, name, "accept"], st["refused"].get(name, 0))
        if http is not None and hasattr(http, "stats"):
            m.add_metric([d, "metrics", "accept"], http.stats().get("out_of_fds", 0))
        for inp in getattr(self.relay, "inputs", None) or ():
            m.add_metric([d, f"input_{inp.name}", "accept"], getattr(inp, "out_of_fds", 0))
        yield m

    def _outputs_and_spool(self, d: str):
        r = self.relay
        if r.spool is None:
            return
        lb = ("device", "output")
        fams = {
            "sent": _counter("logjam_relay_output_events_sent", "events written upstream", lb),
            "acked": _counter("logjam_relay_output_events_acked", "events acknowledged", lb),
            "resent": _counter("logjam_relay_output_events_resent", "events sent again", lb),
            "reconnects": _counter("logjam_relay_output_reconnects",
                                   "connection attempts after the first", lb),
            "failures": _counter("logjam_relay_output_connect_failures",
                                 "failed connection attempts", lb),
            "crashes": _counter("logjam_relay_output_crashes",
                                "output task crashes (restarted with backoff)", lb),
            "connected": _gauge("logjam_relay_output_connected", "1 when connected", lb),
            "backlog": _gauge("logjam_relay_output_backlog_records",
                              "spooled records not yet acknowledged", lb),
            "backlog_bytes": _gauge("logjam_relay_output_backlog_bytes",
                                    "spooled bytes not yet acknowledged", lb),
            "rtt": _gauge("logjam_relay_output_ack_rtt_seconds",
                          "last window/payload round trip (send to ack)", lb),
            "age": _gauge("logjam_relay_output_oldest_unacked_age_seconds",
                          "age of the oldest unacknowledged record (segment granularity)", lb),
            "lost": _counter("logjam_relay_spool_lost_records",
                             "spooled records this output will never deliver, by reason "
                             "(dropped, disk_full, corrupt, truncated, missing)",
                             lb + ("reason",)),
            "dead": _counter("logjam_relay_dead_letters",
                             "events diverted to the dead-letter store, by reason "
                             "(too_large, refused)", lb + ("reason",)),
        }
        for sup in r.outputs:
            st = sup.stats()
            sp = st.get("spool", {})
            lbl = [d, sup.name]
            attempts = st.get("connect_attempts", st.get("connections", 0) +
                              st.get("reconnects", 0))
            reconnects = st.get("reconnects", max(0, attempts - 1))
            fams["sent"].add_metric(lbl, st.get("events_sent", 0))
            fams["acked"].add_metric(lbl, st.get("events_acked", 0))
            fams["resent"].add_metric(lbl, st.get("events_resent", 0))
            fams["reconnects"].add_metric(lbl, reconnects)
            fams["failures"].add_metric(lbl, st.get("connect_failures", 0))
            fams["crashes"].add_metric(lbl, st.get("crashes", 0))
            fams["connected"].add_metric(lbl, st.get("connected", 0))
            fams["backlog"].add_metric(lbl, sp.get("backlog_records", 0))
            fams["backlog_bytes"].add_metric(lbl, sp.get("backlog_bytes", 0))
            fams["rtt"].add_metric(lbl, st.get("window_rtt_last_seconds",
                                               st.get("payload_rtt_last_seconds", 0.0)))
            fams["age"].add_metric(lbl, sp.get("oldest_unacked_age_s", 0.0))
            by_reason = sp.get("lost_by_reason", {})
            for reason in sorted({"dropped", "disk_full", "corrupt", "truncated", "missing",
                                  *by_reason}):
                fams["lost"].add_metric(lbl + [reason], by_reason.get(reason, 0))
            dead = st.get("dead_letters", {})
            for reason in sorted({"too_large", "refused", *dead}):
                fams["dead"].add_metric(lbl + [reason], dead.get(reason, 0))
        yield from fams.values()
        store = getattr(r, "dead_letters", None)
        if store is not None:
            ds = store.stats()
            yield _one(_gauge, "logjam_relay_dead_letter_store_bytes",
                       "bytes the dead-letter store uses on disk", [d], ds["bytes"])
            yield _one(_counter, "logjam_relay_dead_letters_dropped",
                       "dead letters deleted (oldest first) because the store was full",
                       [d], ds["dropped"])
            yield _one(_counter, "logjam_relay_dead_letter_write_errors",
                       "dead letters that could not be written (disk full, I/O error)",
                       [d], ds["write_errors"])

        st = r.spool.stats()
        dl = [d]
        for name, key, doc, kind in (
                ("logjam_relay_spool_bytes", "bytes", "bytes the spool uses on disk", _gauge),
                ("logjam_relay_spool_max_bytes", "max_bytes", "disk budget of the spool", _gauge),
                ("logjam_relay_spool_segments", "segments", "segment files", _gauge),
                ("logjam_relay_spool_full", "full", "1 when the spool is at max_bytes", _gauge),
                ("logjam_relay_spool_appended_records", "appends", "records appended", _counter),
                ("logjam_relay_spool_appended_bytes", "bytes_appended", "bytes appended",
                 _counter),
                ("logjam_relay_spool_fsyncs", "fsyncs", "fsync calls", _counter),
                ("logjam_relay_spool_write_errors", "write_errors", "failed writes", _counter),
                ("logjam_relay_spool_corrupt_records", "corrupt_records",
                 "corrupt records found while reading", _counter),
                ("logjam_relay_spool_corrupt_tails_cut", "corrupt_tails_cut",
                 "torn or corrupt segment tails cut at start", _counter),
                ("logjam_relay_spool_dropped_segments", "dropped_segments",
                 "segments deleted by drop_oldest", _counter),
                ("logjam_relay_spool_dropped_heartbeats", "dropped_heartbeats",
                 "the relay's heartbeat records deleted with dropped segments (no events: "
                 "not in the lost records)", _counter),
                ("logjam_relay_spool_paused", "paused",
                 "1 while ingress is paused (spool full or disk full)", _gauge),
                ("logjam_relay_spool_disk_full", "disk_full",
                 "1 while the spool's disk is full (ENOSPC)", _gauge),
                ("logjam_relay_spool_cursor_writes", "cursor_writes",
                 "acknowledgements appended to the cursor logs", _counter)):
            m = kind(name, doc)
            m.add_metric(dl, st.get(key, 0))
            yield m
        times = st.get("sync_seconds")
        if times is not None:
            yield _histogram("logjam_relay_spool_fdatasync_seconds",
                             "time of the fdatasyncs of appended records (what a 202 under "
                             "spool_fsync=batch waits for at least)", dl, times)
        yield _one(_counter, "logjam_relay_spool_blocked_seconds", "time ingress was paused because the spool was full",
                   dl, r.spool_blocked_seconds + r.spool.blocked_in_progress())
        commits = getattr(r, "commits", None)
        if commits is not None:
            yield from self._group_commit(dl, commits.stats())

    @staticmethod
    def _group_commit(dl: list[str], gc: dict):
        """spool_fsync=batch: the group commit's rounds, waiting replies and their wait."""
        for name, key, doc, kind in (
                ("logjam_relay_group_commit_rounds", "rounds",
                 "fdatasyncs after which replies were sent (spool_fsync=batch)", _counter),
                ("logjam_relay_group_commit_replies", "released",
                 "replies sent after the fdatasync that covers their records", _counter),
                ("logjam_relay_group_commit_waiting_replies", "pending",
                 "replies waiting for an fdatasync", _gauge),
                ("logjam_relay_group_commit_waiting_records", "pending_records",
                 "records handed to the group commit, not yet on disk", _gauge),
                ("logjam_relay_group_commit_failures", "sync_failures",
                 "failed writes or fdatasyncs of the rounds (retried; replies held)", _counter),
                ("logjam_relay_group_commit_withheld", "withheld",
                 "202s never sent: their records were not on disk when the relay stopped",
                 _counter)):
            m = kind(name, doc)
            m.add_metric(dl, gc.get(key, 0))
            yield m
        yield _histogram("logjam_relay_group_commit_wait_seconds",
                         "how long a batch's replies waited in the group commit for the "
                         "fdatasync that covers them (handed in -> sent)", dl,
                         gc["wait_seconds"])


    @staticmethod
    def _samwise(d: str, svc):
        """The samwise endpoint: requests, per-broker publishes, confirms, backlog."""
        st = svc.stats()
        dl = [d]
        m = _counter("logjam_relay_samwise_requests", "samwise requests by action and outcome",
                     ("device", "action", "outcome"))
        for (action, outcome), n in sorted(svc.requests.items()):
            m.add_metric([d, action, outcome], n)
        yield m
        for name, key, doc, kind in (
                ("logjam_relay_samwise_accepted", "accepted",
                 "publish requests accepted into the samwise spool", _counter),
                ("logjam_relay_samwise_delivered", "delivered",
                 "publish requests confirmed by as many brokers as they asked for", _counter),
                ("logjam_relay_samwise_reply_drops", "replies_dropped",
                 "replies that could not be sent", _counter),
                ("logjam_relay_samwise_spool_errors", "spool_errors",
                 "batches refused because the samwise spool failed or was full", _counter),
                ("logjam_relay_samwise_backlog_records", "backlog_records",
                 "spooled records not yet settled, summed over brokers", _gauge),
                ("logjam_relay_samwise_rpc_connections", "rpc_connections",
                 "AMQP connections open for rpc calls (at most samwise_rpc_max_concurrent)",
                 _gauge),
                ("logjam_relay_samwise_rpc_waiting", "rpc_waiting",
                 "rpc calls waiting for a connection slot", _gauge),
                ("logjam_relay_samwise_rpc_connections_peak", "rpc_connections_peak",
                 "most AMQP connections open for rpc calls at once since start "
                 "(at most samwise_rpc_max_concurrent)", _gauge)):
            yield _one(kind, name, doc, dl, st.get(key, 0))
        lb = ("device", "broker")
        fams = {
            "connected": _gauge("logjam_relay_samwise_broker_connected", "1 when connected", lb),
            "inflight": _gauge("logjam_relay_samwise_broker_inflight",
                               "publishes waiting for a confirm", lb),
            "backlog": _gauge("logjam_relay_samwise_broker_backlog_records",
                              "spooled records this broker has not settled", lb),
            "sent": _counter("logjam_relay_samwise_broker_sent", "publishes sent", lb),
            "disconnects": _counter("logjam_relay_samwise_broker_disconnects",
                                    "connections lost", lb),
            "handed_off": _counter("logjam_relay_samwise_handed_off",
                                   "waiting messages handed to other brokers while down", lb),
            "bad_records": _counter("logjam_relay_samwise_bad_records",
                                    "unreadable spool records dropped", lb),
        }
        results = _counter("logjam_relay_samwise_publishes", "publishes by broker and result "
                           "(ack, nack, returned, no_exchange)", ("device", "broker", "result"))
        amqp_errors = _counter("logjam_relay_samwise_amqp_errors", "malformed or unexpected "
                               "AMQP input from a broker (the connection was dropped), by "
                               "reason", ("device", "broker", "reason"))
        latency = SummaryMetricFamily("logjam_relay_samwise_confirm_latency_seconds",
                                      "publish to publisher-confirm latency", labels=list(lb))
        latency_max = _gauge("logjam_relay_samwise_confirm_latency_max_seconds",
                             "largest publish to confirm latency seen", lb)
        for name, b in st.get("brokers", {}).items():
            lbl = [d, name]
            fams["connected"].add_metric(lbl, b.get("connected", 0))
            fams["inflight"].add_metric(lbl, b.get("inflight", 0))
            fams["backlog"].add_metric(lbl, b.get("reader", {}).get("backlog_records", 0))
            for key in ("sent", "disconnects", "handed_off", "bad_records"):
                fams[key].add_metric(lbl, b.get(key, 0))
            for result, n in sorted(b.get("results", {}).items()):
                results.add_metric([d, name, result], n)
            for reason, n in sorted(b.get("amqp_errors", {}).items()):
                amqp_errors.add_metric([d, name, reason], n)
            latency.add_metric(lbl, b.get("confirm_latency_seconds_count", 0),
                               b.get("confirm_latency_seconds_sum", 0.0))
            latency_max.add_metric(lbl, b.get("confirm_latency_seconds_max", 0.0))
        yield from fams.values()
        yield results
        yield amqp_errors
        yield latency
        yield latency_max
        spool_stats = getattr(svc.store, "stats", None)
        if spool_stats is not None:
            sp = spool_stats()
            yield _one(_gauge, "logjam_relay_samwise_spool_bytes",
                       "bytes the samwise spool uses on disk", dl, sp.get("bytes", 0))
            yield _one(_gauge, "logjam_relay_samwise_spool_segments",
                       "segment files of the samwise spool", dl, sp.get("segments", 0))


def make_registry(relay) -> tuple[CollectorRegistry, RelayCollector]:
    reg = CollectorRegistry(auto_describe=False)
    col = RelayCollector(relay)
    reg.register(col)
    return reg, col


def metrics_handler(registry: CollectorRegistry):
    def handler():
        return 200, CONTENT_TYPE_LATEST, generate_latest(registry)
    return handler
