"""--web-config-file (Prometheus exporter-toolkit format): TLS and bcrypt basic auth on the
metrics endpoint, checked with urllib and with the real ``prometheus`` binary."""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import bcrypt
import pytest

from conftest import free_port
from logjam_relay.health.webconfig import WebConfigError, load
from relay_harness import relay_argv, relay_settings, stop_process

PASSWORD = "scrape-pw-7Q"


@pytest.fixture
def web_config(tmp_path, tls_files):
    h = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    p = tmp_path / "web.yml"
    p.write_text("tls_server_config:\n"
                 f"  cert_file: {tls_files['server']}\n"
                 f"  key_file: {tls_files['server']}\n"
                 "  min_version: TLS12\n"
                 "basic_auth_users:\n"
                 f"  prometheus: '{h}'\n")
    return p


def test_load_and_errors(tmp_path, web_config, tls_files):
    cfg = load(str(web_config))
    assert cfg.ssl_context is not None and set(cfg.users) == {"prometheus"}
    good = "Basic " + base64.b64encode(f"prometheus:{PASSWORD}".encode()).decode()
    bad = "Basic " + base64.b64encode(b"prometheus:nope").decode()
    assert cfg.authorize("GET", "/metrics", {"authorization": good})
    assert cfg.authorize("GET", "/metrics", {"authorization": good})        # cached
    assert not cfg.authorize("GET", "/metrics", {"authorization": bad})
    assert not cfg.authorize("GET", "/metrics", {})
    assert not cfg.authorize("GET", "/metrics", {"authorization": "Basic !!!"})
    assert not cfg.authorize("GET", "/metrics", {
        "authorization": "Basic " + base64.b64encode(f"eve:{PASSWORD}".encode()).decode()})
    assert cfg.refused == 4
    for text, what in (
            ("tls_server_config:\n  cert_file: /nope\n  key_file: /nope\n", "cert_file"),
            ("basic_auth_user:\n  a: b\n", "unknown key"),
            ("basic_auth_users:\n  a: plain\n", "basic_auth_users.a"),
            (f"tls_server_config:\n  cert_file: {tls_files['server']}\n  key_file: "
             f"{tls_files['server']}\n  client_auth_type: RequireAndVerifyClientCert\n",
             "client_ca_file"),
            (f"tls_server_config:\n  cert_file: {tls_files['server']}\n  key_file: "
             f"{tls_files['server']}\n  min_version: TLS99\n", "min_version"),
            ("http_server_config:\n  headers: {X: y}\n", "http_server_config"),
            (": : :\n", "YAML")):
        p = tmp_path / "bad.yml"
        p.write_text(text)
        with pytest.raises(WebConfigError, match=what):
            load(str(p))
    r = subprocess.run([sys.executable, "-m", "logjam_relay", "--check-config",
                        "--web-config-file", str(p)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "web_config_file (--web-config-file)" in r.stderr


def _get(url, ctx, auth=None):
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


@pytest.mark.slow
def test_real_prometheus_scrapes_over_tls_with_basic_auth(tmp_path, web_config, tls_files):
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed (.ci/install-prometheus.sh); CI is set")
        pytest.skip("prometheus is not installed (run .ci/install-prometheus.sh)")
    s = relay_settings(tmp_path)
    log = open(tmp_path / "relay.log", "ab")
    relay = subprocess.Popen(relay_argv(s, ["--web-config-file", str(web_config)]),
                             stdout=log, stderr=log)
    prom = None
    try:
        ctx = ssl.create_default_context(cafile=tls_files["ca"])
        base = f"https://localhost:{s.metrics_port}"
        deadline = time.monotonic() + 20
        while True:                      # ready (needs the password, over TLS)
            try:
                if _get(f"{base}/readyz", ctx, f"prometheus:{PASSWORD}")[0] == 200:
                    break
            except OSError:
                pass
            assert relay.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "relay.log").read_text()
            time.sleep(0.1)
        assert _get(f"{base}/metrics", ctx)[0] == 401
        assert _get(f"{base}/metrics", ctx, "prometheus:wrong")[0] == 401
        status, text = _get(f"{base}/metrics", ctx, f"prometheus:{PASSWORD}")
        assert status == 200 and "logjam:device:msgs_received" in text
        with pytest.raises(OSError):      # plain HTTP on the TLS port gets nowhere
            urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=5)

        pport = free_port()
        pw = tmp_path / "pw"
        pw.write_text(PASSWORD)
        cfg = tmp_path / "prometheus.yml"
        job = ("  - job_name: {name}\n    scheme: https\n"
               f"    tls_config:\n      ca_file: {tls_files['ca']}\n"
               "      server_name: localhost\n"
               "    basic_auth:\n      username: prometheus\n      {pw}\n"
               f"    static_configs:\n      - targets: ['127.0.0.1:{s.metrics_port}']\n")
        cfg.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                       "scrape_configs:\n" + job.format(name="relay", pw=f"password_file: {pw}")
                       + job.format(name="relay-wrong-pw", pw="password: wrong"))
        (tmp_path / "tsdb").mkdir()
        plog = open(tmp_path / "prometheus.log", "ab")
        prom = subprocess.Popen([binary, f"--config.file={cfg}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{pport}", "--log.level=warn"],
                                stdout=plog, stderr=plog, cwd=tmp_path)
        api = f"http://127.0.0.1:{pport}/api/v1"
        deadline = time.monotonic() + 30
        health = {}
        while time.monotonic() < deadline:
            assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{api}/targets", timeout=5) as r:
                    targets = json.loads(r.read())["data"]["activeTargets"]
                health = {t["labels"]["job"]: (t["health"], t["lastError"]) for t in targets}
                if health.get("relay", ("",))[0] == "up" and \
                        health.get("relay-wrong-pw", ("",))[0] == "down":
                    break
            except OSError:
                pass
            time.sleep(0.3)
        print(f"prometheus targets: {health}")
        assert health["relay"][0] == "up", health
        assert health["relay-wrong-pw"][0] == "down" and "401" in health["relay-wrong-pw"][1]
        with urllib.request.urlopen(f"{api}/query?query=logjam:device:msgs_received_total",
                                    timeout=5) as r:
            result = json.loads(r.read())["data"]["result"]
        assert [x["metric"]["job"] for x in result] == ["relay"]     # samples from TLS+auth
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        assert stop_process(relay) == 0


async def test_wrong_passwords_do_not_hold_up_a_known_scraper(tmp_path):
    """12 requests with wrong passwords (bcrypt cost 12 each, checked one at a time in a
    worker thread) are in the server when a scraper whose credentials were verified
    before asks: it is answered from the cache while the wrong ones are still being
    checked (an ordering, not a speed claim: the inline check answered them all first)."""
    import socket

    import trio

    from logjam_relay.health.http import HTTPServer

    h = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(12)).decode()
    p = tmp_path / "web.yml"
    p.write_text(f"basic_auth_users:\n  prometheus: '{h}'\n")
    cfg = load(str(p))
    server = HTTPServer({"/metrics": lambda: (200, "text/plain", b"m 1\n")}, "127.0.0.1", 0,
                        threaded=False, authorize=cfg.authorize,
                        authorize_cached=cfg.authorize_cached)

    def raw(auth: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", server.bound_port), timeout=60) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nAuthorization: Basic " +
                      base64.b64encode(auth) + b"\r\n\r\n")
            out = b""
            while chunk := s.recv(4096):
                out += chunk
            return out

    good = f"prometheus:{PASSWORD}".encode()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        assert (await trio.to_thread.run_sync(raw, good)).startswith(b"HTTP/1.1 200")
        bad_replies: list[bytes] = []

        async def bad(i):
            bad_replies.append(await trio.to_thread.run_sync(
                raw, b"prometheus:wrong%d" % i, limiter=trio.CapacityLimiter(1)))

        for i in range(12):
            nursery.start_soon(bad, i)
        with trio.fail_after(30):
            while server.requests < 13:         # all 12 read and waiting for their check
                await trio.sleep(0.01)
        reply = await trio.to_thread.run_sync(raw, good, limiter=trio.CapacityLimiter(1))
        refused_when_answered = server.unauthorized
        with trio.fail_after(120):
            while len(bad_replies) < 12:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"m 1\n")
    assert refused_when_answered < 12, refused_when_answered
    assert all(r.startswith(b"HTTP/1.1 401") for r in bad_replies)
    assert server.unauthorized == 12 and cfg.refused == 12
