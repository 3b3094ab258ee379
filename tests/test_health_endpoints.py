"""/healthz, /readyz and /metrics as the deployment's probes, HEALTHCHECK and scrape configs
expect them (logjam-device's metric names, the readiness gate, shutdown, edge cases)."""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import trio

from logjam_relay import config
from relay_harness import meta, running_relay, send

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
GRAFANA = ROOT / "grafana"
SETTINGS = {f.name for f in config.SETTING_FIELDS}
DEFAULT_PORTS = {"router_port": 9604, "pull_port": 9605, "pub_port": 9606,
                 "stats_port": 9621, "metrics_port": 8082}


# ------------------------------------------------------------------ endpoints

#: logjam-device's metric names (logjam-tools device-prometheus-client.cpp).
LOGJAM_DEVICE_METRICS = [
    "logjam:device:msgs_received_total", "logjam:device:msgs_invalid_total",
    "logjam:device:msgs_received_bytes_total", "logjam:device:msgs_compressed_total",
    "logjam:device:msgs_compressed_bytes_total", "logjam:device:cpu_seconds_total",
    "logjam:device:ping_count_total", "logjam:device:ping_count_by_stream_total",
    "logjam:device:broken_meta_count_total",
    "logjam:device:broken_meta_count_by_stream_total", "logjam:device:app_start_time",
]


def _get(port: int, path: str, method: str = "GET") -> tuple[int, dict, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


async def aget(port: int, path: str, method: str = "GET"):
    return await trio.to_thread.run_sync(_get, port, path, method)


class _StuckOutput:
    """An output past its retry budget, as far as readiness is concerned."""

    def readiness_problem(self):
        return "output lumberjack://upstream:5044: not connected for 60 s"


async def test_healthz_readyz_metrics_share_the_port(tmp_path):
    async with running_relay(tmp_path) as (relay, cl):
        port = cl.settings.metrics_port
        assert relay.http.bound_port == port
        status, _, body = await aget(port, "/healthz")
        assert (status, body) == (200, b"ok\n")
        status, _, body = await aget(port, "/readyz")
        assert (status, body) == (200, b"ready\n")
        status, headers, body = await aget(port, "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        text = body.decode()
        for name in LOGJAM_DEVICE_METRICS:
            stem = re.escape(name.removesuffix("_total"))
            # prometheus_client writes counter TYPE lines with or without _total
            assert re.search(rf"^# TYPE {stem}(_total)? ", text, re.M), name
        assert re.search(r'^logjam:device:msgs_received_total\{device="0"\} 0\.0$', text,
                         re.M)


async def test_metrics_count_what_went_through(tmp_path):
    async with running_relay(tmp_path, device_id=7) as (relay, cl):
        push = cl.push()
        await send(push, [b"probe-test", b"logs.probe", b"{}", meta()])
        await send(push, [b"probe-test", b"foo.bar", b"{}", meta()])
        port = cl.settings.metrics_port
        with trio.fail_after(5):
            while relay.pipeline.counters.received + relay.pipeline.counters.invalid < 2:
                await trio.sleep(0.01)
        text = (await aget(port, "/metrics"))[2].decode()
        assert 'logjam:device:msgs_received_total{device="7"} 1.0' in text
        assert 'logjam:device:msgs_invalid_total{device="7"} 1.0' in text
        assert 'logjam_relay_invalid_total{device="7",reason="topic"} 1.0' in text
        assert 'logjam_relay_input_messages_total{device="7",socket="pull"} 2.0' in text


async def test_readyz_reports_an_output_out_of_budget(tmp_path, monkeypatch):
    async with running_relay(tmp_path) as (relay, cl):
        port = cl.settings.metrics_port
        outputs = relay.outputs     # (a tuple, given when the relay was built)
        monkeypatch.setattr(relay, "outputs", (*outputs, _StuckOutput()))
        try:
            status, _, body = await aget(port, "/readyz")
            assert status == 503
            assert b"lumberjack://upstream:5044: not connected" in body
            status, _, _ = await aget(port, "/healthz")
            assert status == 200, "alive while not ready"
        finally:
            monkeypatch.setattr(relay, "outputs", outputs)
        assert (await aget(port, "/readyz"))[0] == 200


@pytest.mark.parametrize("down_after", [0.3, 0.0])
async def test_readyz_output_gate_is_the_setting(tmp_path, down_after):
    """ready_output_down_after: an output that cannot connect makes /readyz fail once it
    has been down that long; 0 = outputs never make the relay unready."""
    from conftest import free_port
    url = f"lumberjack://127.0.0.1:{free_port()}?tls=off&backoff_min=0.05&backoff_max=0.1"
    async with running_relay(tmp_path, outputs=[url],
                             ready_output_down_after=down_after) as (relay, cl):
        port = cl.settings.metrics_port
        (out,) = relay.outputs
        if down_after:
            assert out.retry_budget == down_after
            with trio.fail_after(10):
                while (await aget(port, "/readyz"))[0] == 200:
                    await trio.sleep(0.05)
            status, _, body = await aget(port, "/readyz")
            assert status == 503 and b"not connected" in body, body
        else:
            assert out.retry_budget == float("inf")
            assert out.readiness_problem() is None
            assert (await aget(port, "/readyz"))[0] == 200


async def test_readyz_not_ready_while_shutting_down(tmp_path):
    async with running_relay(tmp_path) as (relay, cl):
        relay.stopping = True          # what shutdown() sets before draining
        try:
            status, _, body = await aget(cl.settings.metrics_port, "/readyz")
            assert status == 503 and b"shutting down" in body
        finally:
            relay.stopping = False


async def test_http_edge_cases(tmp_path):
    async with running_relay(tmp_path) as (relay, cl):
        port = cl.settings.metrics_port
        status, headers, body = await aget(port, "/healthz", "HEAD")
        assert status == 200 and body == b"" and headers["Content-Length"] == "3"
        assert (await aget(port, "/nope"))[0] == 404
        assert (await aget(port, "/metrics", "POST"))[0] == 405
        assert (await aget(port, "/readyz?verbose=1"))[0] == 200


def _dockerfile_healthcheck() -> list[str]:
    text = (DEPLOY / "Dockerfile").read_text()
    logical = re.sub(r"\\\n\s*", " ", "\n".join(
        ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    (hc,) = [ln for ln in logical.splitlines() if ln.startswith("HEALTHCHECK ")]
    return json.loads(hc.split(" CMD ", 1)[1])


async def test_dockerfile_healthcheck_command_probes_healthz(tmp_path):
    """The image's HEALTHCHECK command (run with this Python) passes against a running
    relay and fails when nothing listens."""
    argv = _dockerfile_healthcheck()
    assert argv[0] == "python"
    argv = [sys.executable, *argv[1:]]
    async with running_relay(tmp_path) as (relay, cl):
        env = dict(os.environ, LOGJAM_RELAY_METRICS_PORT=str(cl.settings.metrics_port))
        ok = await trio.run_process(argv, env=env, check=False, capture_stderr=True)
        assert ok.returncode == 0, ok.stderr
    env = dict(os.environ, LOGJAM_RELAY_METRICS_PORT=str(cl.settings.metrics_port))
    down = await trio.run_process(argv, env=env, check=False, capture_stderr=True)
    assert down.returncode != 0
