"""What an operator meets: the metrics endpoint under a slowloris, the open-file limit,
log lines that clients cannot forge, --help, --check-config and JSON log times."""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import zmq

from logjam_relay import cli, config
from logjam_relay.config import logformat
from logjam_relay.ratelimit import RateLimitedLog, safe
from relay_harness import meta, relay_argv, relay_settings, stop_process, wait_http


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith("LOGJAM_RELAY_")
            or k == "LOGJAM_RELAY_PURE_PYTHON"}


def _start(settings, extra=(), soft_nofile: int | None = None, log_path=None):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def lower():
        if soft_nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft_nofile, hard))

    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(relay_argv(settings, list(extra)), env=_env(), stdout=out,
                            stderr=out, preexec_fn=lower)
    wait_http(settings.metrics_port, proc)
    return proc


def _soft_nofile(pid: int) -> tuple[str, str]:
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError("no open-file limit in /proc")


def _get(port: int, path: str, timeout: float = 10):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.status, r.read()


# ------------------------------------------------------------------ HTTP / fds

@pytest.mark.slow
def test_metrics_answers_under_3000_half_open_connections(tmp_path):
    """The issue's case: 3,000 half-open connections against a relay started with a soft
    open-file limit of 1,024; /metrics still answers (the timeout is a generous bound on
    the wait, not a speed claim), the limit was raised, the cap held the fds down."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4000:
        pytest.skip(f"hard open-file limit {hard} is too low for 3,000 connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))     # this test's own fds
    settings = relay_settings(tmp_path)
    proc = _start(settings, ["--metrics-max-connections", "64"], soft_nofile=1024,
                  log_path=tmp_path / "relay.log")
    socks = []
    try:
        rsoft, rhard = _soft_nofile(proc.pid)
        assert rsoft == rhard and rsoft != "1024", (rsoft, rhard)
        for _ in range(3000):
            s = socket.create_connection(("127.0.0.1", settings.metrics_port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")      # never finished
            socks.append(s)
        t0 = time.monotonic()
        status, body = _get(settings.metrics_port, "/metrics", timeout=5)
        answered = time.monotonic() - t0
        assert status == 200 and b"logjam_relay" in body
        status, _ = _get(settings.metrics_port, "/readyz", timeout=5)
        assert status == 200
        status, body = _get(settings.metrics_port, "/metrics", timeout=5)
        fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        assert fds < 64 + 200, fds           # the cap, not the 3,000 connections
        evicted = re.search(rb'logjam_relay_http_connections_total\{device="0",'
                            rb'outcome="evicted"\} (\d+)', body)
        assert evicted and int(evicted.group(1)) >= 3000 - 64, body[-2000:]
        print(f"slowloris: 3000 half-open connections; /metrics answered 200 in "
              f"{answered:.2f} s; relay fds {fds}; evicted {evicted.group(1).decode()}; "
              f"open-file limit {rsoft}/{rhard} (started with 1024)")
    finally:
        for s in socks:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert stop_process(proc) == 0


def test_header_timeout_closes_a_slow_request(tmp_path):
    settings = relay_settings(tmp_path)
    proc = _start(settings, ["--metrics-header-timeout", "300ms"])
    try:
        s = socket.create_connection(("127.0.0.1", settings.metrics_port), timeout=10)
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        # the server closes it (EOF) instead of waiting for the rest forever
        assert s.recv(100) == b""
        s.close()
        status, _ = _get(settings.metrics_port, "/healthz")
        assert status == 200
    finally:
        assert stop_process(proc) == 0


def test_metrics_answer_during_a_zeromq_flood(tmp_path):
    """PUSH clients flood the relay while /metrics is scraped: every scrape answers 200
    (generous timeout on each request; no speed claim)."""
    settings = relay_settings(tmp_path)
    proc = _start(settings)
    stop = threading.Event()
    sent = [0]

    def flood():
        ctx = zmq.Context()
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 10000)
        s.connect(f"tcp://127.0.0.1:{settings.pull_port}")
        msg = [b"app-env", b"topic", b"{}" * 50, meta()]
        while not stop.is_set():
            for _ in range(1000):
                try:
                    s.send_multipart(msg, zmq.NOBLOCK)
                    sent[0] += 1
                except zmq.Again:
                    break
        s.close()
        ctx.term()

    threads = [threading.Thread(target=flood) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        for _ in range(5):
            status, body = _get(settings.metrics_port, "/metrics", timeout=10)
            assert status == 200 and b"logjam_relay" in body
        assert sent[0] > 0
    finally:
        stop.set()
        for t in threads:
            t.join()
        assert stop_process(proc) == 0


# ------------------------------------------------------------------- logging

def test_safe_escapes_client_bytes():
    forged = b"app\n2026-01-01 00:00:00 [E] forged line\x1b[2J\xff"
    out = safe(forged)
    assert "\n" not in out and "\x1b" not in out
    assert out == "app\\x0a2026-01-01 00:00:00 [E] forged line\\x1b[2J\\xff"
    long = safe(b"x" * 10_000)
    assert len(long) < 300 and long.endswith("(10000 bytes)")
    assert safe("caf\u00e9 \u2028") == "caf\u00e9 \\u2028"


def test_rate_limited_log_escapes_arguments(caplog):
    rlog = RateLimitedLog(logging.getLogger("logjam_relay.test"))
    with caplog.at_level(logging.WARNING, logger="logjam_relay.test"):
        rlog.warning("bad_stream", "bad stream %s from %s", b"a\nb\r\x07", "c\nd")
    assert caplog.messages == ["bad stream a\\x0ab\\x0d\\x07 from c\\x0ad"]


def test_text_log_lines_cannot_be_forged():
    """Through the real formatter: one record is one line, whatever the message holds."""
    fmt = logformat.TextFormatter()
    rec = logging.LogRecord("logjam_relay.x", logging.WARNING, __file__, 1, "topic %s",
                            ("x\n2026 [E] forged\x1b]0;",), None)
    text = fmt.format(rec)
    assert "\n" not in text and "\x1b" not in text and "x\\x0a2026 [E] forged" in text
    try:
        raise ValueError("boom")
    except ValueError:
        rec.exc_info = sys.exc_info()
    assert "Traceback" in fmt.format(rec)       # tracebacks keep their lines


def test_json_log_time_is_iso8601_utc_ms():
    rec = logging.LogRecord("logjam_relay.x", logging.INFO, __file__, 1, "hello %s",
                            ("a\nb",), None)
    rec.created = 1700000000.1234
    d = json.loads(logformat.JSONFormatter().format(rec))
    assert d["time"] == "2023-11-14T22:13:20.123Z"
    assert d["message"] == "hello a\nb"          # JSON escapes it: still one line
    assert "\n" not in logformat.JSONFormatter().format(rec)


def test_json_logs_of_the_real_command(tmp_path):
    settings = relay_settings(tmp_path)
    log_path = tmp_path / "relay.log"
    proc = _start(settings, ["--log-format", "json"], log_path=log_path)
    assert stop_process(proc) == 0
    lines = [json.loads(ln) for ln in log_path.read_text().splitlines()]
    assert lines
    for d in lines:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", d["time"]), d
    ready = [d["message"] for d in lines if " ready: " in d["message"]]
    assert len(ready) == 1
    line = ready[0]
    assert f"metrics http://127.0.0.1:{settings.metrics_port}/metrics" in line
    assert f"state dir {tmp_path / 'state'}" in line
    assert "spool off (no output configured)" in line and "archive off" in line
    assert "no outputs configured" in line
    assert not re.search(r"\bnone\b", line), line


def test_ready_line_names_spool_archive_and_outputs(tmp_path):
    settings = relay_settings(tmp_path)
    log_path = tmp_path / "relay.log"
    arch = tmp_path / "archive"
    proc = _start(settings, ["--output", "lumberjack://127.0.0.1:1?tls=off&name=lj",
                             "--archive-dir", str(arch)], log_path=log_path)
    assert stop_process(proc) == 0
    ready = [ln for ln in log_path.read_text().splitlines() if " ready: " in ln]
    assert len(ready) == 1
    line = ready[0]
    assert f"spool {tmp_path / 'state' / 'spool'}" in line
    assert f"archive {arch}" in line and "outputs lj" in line


# --------------------------------------------------------------- help, config

def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "logjam_relay", *args], capture_output=True,
                          text=True, timeout=60, env=env or _env())


def test_help_lists_every_subcommand_and_every_default():
    out = _run("--help").stdout
    for sub in cli.SUBCOMMANDS:
        assert re.search(rf"^\s+{sub}\b", out, re.M), sub
    for f in config.SETTING_FIELDS:
        flag = f.metadata["flags"][-1]
        m = re.search(rf"{re.escape(flag)}(?: [A-Z|_a-z=]+)?\n?\s+(.*?)(?=\n  -|\Z)", out, re.S)
        assert m, flag
        assert "default" in m.group(1), (flag, m.group(1))
    assert "(default: 10 GiB)" in " ".join(out.split())       # spool_max_bytes, human units


@pytest.mark.parametrize("sub", [s for s in cli.SUBCOMMANDS if s != "run"])
def test_sub_help_has_no_rest_markup(sub):
    r = _run(sub, "--help")
    if sub == "pipeline" and r.returncode == 2 and "spark" in r.stderr:
        pytest.skip("the spark extra is not installed")
    assert r.returncode == 0, r.stderr
    assert "``" not in r.stdout and ":func:" not in r.stdout


def test_check_config_prints_effective_values(tmp_path):
    env = _env()
    env["LOGJAM_RELAY_SPOOL_MAX_BYTES"] = "2GiB"
    r = _run("--check-config", "--output", "lumberjack://h:5044?tls=off",
             "--state-dir", str(tmp_path / "st"), "--spool-fsync-interval", "250ms", env=env)
    assert r.returncode == 0, r.stderr
    values = {}
    for line in r.stdout.splitlines():
        name, _, rest = line.partition(" = ")
        values[name] = rest
    assert values["state_dir"] == f"{tmp_path / 'st'}  (flag --state-dir)"
    assert values["spool_dir"].startswith(f"{tmp_path / 'st' / 'spool'} (resolved)")
    assert values["spool_max_bytes"] == "2 GiB  (env LOGJAM_RELAY_SPOOL_MAX_BYTES)"
    assert values["spool_segment_bytes"] == "64 MiB  (default)"
    assert values["spool_fsync_interval"] == "250 ms  (flag --spool-fsync-interval)"
    assert values["heartbeat_interval"] == "5 s  (default)"
    assert values["archive_retention"] == "7 d  (default)"
    assert values["fqdn"].endswith("(resolved)  (default)") and "None" not in r.stdout
    assert values["outputs"] == "lumberjack://h:5044?tls=off  (flag --output)"


def test_check_config_warns_of_a_setting_that_does_nothing(tmp_path):
    """A valid setting that does nothing in this configuration (spool_fsync_batch_delay
    without a spool or without spool_fsync = "batch") is the same one-line warning in
    --check-config (stderr, status 0, the values as usual) as at the relay's start."""
    env = _env()
    env["LOGJAM_RELAY_SPOOL_FSYNC_BATCH_DELAY"] = "2ms"
    r = _run("--check-config", "--state-dir", str(tmp_path / "st"), env=env)
    assert r.returncode == 0, r.stderr
    assert "spool_fsync_batch_delay = 2 ms  (env LOGJAM_RELAY_SPOOL_FSYNC_BATCH_DELAY)" \
        in r.stdout.splitlines()
    assert r.stderr.splitlines() == [
        "logjam-relay: warning: spool_fsync_batch_delay (env "
        "LOGJAM_RELAY_SPOOL_FSYNC_BATCH_DELAY) = 0.002s has no effect: it spaces the group "
        "commit's rounds, which run only with a spool and spool_fsync = \"batch\" (here: "
        "no spool_dir)"], r.stderr
    r = _run("--check-config", "--spool-dir", str(tmp_path / "sp"), "--spool-fsync",
             "interval", env=env)
    assert r.returncode == 0 and r.stderr.strip().endswith(
        '(here: spool_fsync = "interval")'), r.stderr
    r = _run("--check-config", "--spool-dir", str(tmp_path / "sp"), "--spool-fsync", "batch",
             env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_client_bytes_cannot_forge_relay_log_lines(tmp_path):
    """A client-chosen stream name with a newline, a fake log line and terminal escapes
    reaches the relay's log escaped, on the line of the record that quotes it."""
    settings = relay_settings(tmp_path)
    log_path = tmp_path / "relay.log"
    proc = _start(settings, log_path=log_path)
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 2000)
        s.connect(f"tcp://127.0.0.1:{settings.pull_port}")
        forged = b"app-env\n2026-01-01 00:00:00,000 [E] logjam_relay: FORGED\x1b[2J\x07"
        s.send_multipart([forged, b"topic"])           # two frames: invalid, logged
        s.close()
        deadline = time.monotonic() + 10
        while b"invalid message" not in log_path.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        ctx.term()
        assert stop_process(proc) == 0
    raw = log_path.read_bytes()
    assert b"invalid message" in raw
    assert b"\x1b" not in raw and b"\x07" not in raw
    for line in raw.decode().splitlines():
        assert not line.startswith("2026-01-01"), line        # no forged line of its own
    assert "app-env\\x0a2026-01-01 00:00:00,000 [E] logjam_relay: FORGED\\x1b[2J\\x07" in \
        raw.decode()


# ------------------------------------------------------- HTTP server hooks

async def test_http_server_tls_and_auth_hooks(tls_files):
    """The hooks the exporter web-config plugs into: an SSLContext and an auth check."""
    import base64
    import ssl

    import trio

    from logjam_relay.health.http import HTTPServer
    from logjam_relay.io.net import server_context

    seen = []

    def authorize(method, path, headers):
        seen.append((method, path))
        return headers.get("authorization") == "Basic " + base64.b64encode(b"u:p").decode()

    server = HTTPServer({"/metrics": lambda: (200, "text/plain", b"m 1\n")}, "127.0.0.1", 0,
                        ssl_context=server_context(tls_files["server"]), authorize=authorize)
    ctx = ssl.create_default_context(cafile=tls_files["ca"])

    def get(auth):
        req = urllib.request.Request(f"https://127.0.0.1:{server.bound_port}/metrics")
        if auth:
            req.add_header("Authorization", "Basic " + base64.b64encode(auth).decode())
        try:
            with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("WWW-Authenticate")

    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        assert await trio.to_thread.run_sync(get, b"u:p") == (200, b"m 1\n")
        status, challenge = await trio.to_thread.run_sync(get, b"u:wrong")
        assert status == 401 and challenge.startswith("Basic")
        nursery.cancel_scope.cancel()
    assert server.unauthorized == 1 and seen == [("GET", "/metrics")] * 2


async def test_http_server_answers_503_when_the_relay_loop_is_stuck():
    """A handler the relay's loop cannot run in time: /healthz says so, /metrics is stale."""
    import trio

    from logjam_relay.health.http import HTTPServer

    calls = []

    def metrics():
        calls.append(1)
        return 200, "text/plain", b"m %d\n" % len(calls)

    server = HTTPServer({"/metrics": metrics, "/healthz": lambda: (200, "text/plain", b"ok\n")},
                        "127.0.0.1", 0, loop_timeout=0.3)

    def get(path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.bound_port}{path}",
                                        timeout=10) as r:
                return r.status, r.read(), r.headers.get("X-Stale-Seconds")
        except urllib.error.HTTPError as e:
            return e.code, e.read(), None

    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        assert await trio.to_thread.run_sync(get, "/metrics") == (200, b"m 1\n", None)
        # block the relay's loop (this one) while the server thread asks it for answers
        pending = []
        worker = threading.Thread(target=lambda: pending.extend([get("/healthz"),
                                                                 get("/metrics")]))
        worker.start()
        time.sleep(1.5)                     # deliberately blocking the event loop
        await trio.to_thread.run_sync(worker.join)
        healthz, stale = pending
        assert healthz[0] == 503 and b"event loop not responding" in healthz[1]
        assert stale[0] == 200 and stale[1] == b"m 1\n" and stale[2] is not None
        nursery.cancel_scope.cancel()
    assert server.loop_timeouts == 2
