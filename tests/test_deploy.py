"""The deployment files (deploy/, grafana/) and the HTTP endpoints they rely on.

What can be checked without a container runtime or a cluster: the sample configuration
loads and validates (including its commented-out examples), the Kubernetes manifests
parse and agree with the relay configuration they carry, the systemd unit passes
``systemd-analyze verify`` (when available), the Prometheus example passes ``promtool
check config`` (when available), the Dockerfile has the expected shape, the Grafana
provisioning files parse, and /healthz, /readyz and /metrics behave as the probes,
HEALTHCHECK and scrape configs expect.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import trio
import yaml

from logjam_relay import config
from relay_harness import meta, running_relay, send

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
GRAFANA = ROOT / "grafana"
SETTINGS = {f.name for f in config.SETTING_FIELDS}
DEFAULT_PORTS = {"router_port": 9604, "pull_port": 9605, "pub_port": 9606,
                 "stats_port": 9621, "metrics_port": 8082}


# ------------------------------------------------------------------ relay.toml

_COMMENTED = re.compile(r"^# ([a-z_]+) = (.+)$")
_ACTIVE = re.compile(r"^([a-z_]+)\s*=")
_TABLE = re.compile(r"^\[([a-z_]+)\]\s*$")


def _setting_lines(text: str):
    """(line index, setting name, active?) for every setting line, tables resolved."""
    table = ""
    for i, line in enumerate(text.splitlines()):
        if m := _TABLE.match(line):
            table = m.group(1) + "_"
        elif m := _ACTIVE.match(line):
            yield i, table + m.group(1), True
        elif m := _COMMENTED.match(line):
            yield i, table + m.group(1), False


def test_sample_config_loads_and_validates():
    s = config.load(config_file=DEPLOY / "relay.toml", environ={})
    assert s.outputs == [] and s.spool_policy == "block"
    for name, port in DEFAULT_PORTS.items():
        assert getattr(s, name) == port


def test_sample_config_mentions_every_setting():
    lines = list(_setting_lines((DEPLOY / "relay.toml").read_text()))
    mentioned = {name for _, name, _ in lines}
    assert mentioned - SETTINGS == set(), "the sample names settings that do not exist"
    assert SETTINGS - mentioned == set(), "settings missing from deploy/relay.toml"


def test_sample_config_active_values_are_the_defaults():
    """The sample documents the defaults: loading it changes no value."""
    s = config.load(config_file=DEPLOY / "relay.toml", environ={})
    d = config.load(environ={})
    for name in SETTINGS:
        assert getattr(s, name) == getattr(d, name), name


def test_sample_config_commented_examples_load(tmp_path):
    """Uncommenting every commented-out setting (not already set) still validates."""
    text = (DEPLOY / "relay.toml").read_text()
    lines = text.splitlines()
    active = {name for _, name, on in _setting_lines(text) if on}
    uncommented = set()
    for i, name, on in _setting_lines(text):
        if not on and name not in active and name not in uncommented:
            lines[i] = lines[i][2:]
            uncommented.add(name)
    assert {"compress", "fqdn", "state_dir", "spool_dir"} <= uncommented
    f = tmp_path / "relay.toml"
    f.write_text("\n".join(lines) + "\n")
    s = config.load(config_file=f, environ={})
    assert s.compress is not None and s.fqdn and s.state_dir and s.spool_dir


def test_sample_config_passes_check_config():
    r = subprocess.run([sys.executable, "-m", "logjam_relay", "--config",
                        str(DEPLOY / "relay.toml"), "--check-config"],
                       capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items()
                            if not k.startswith("LOGJAM_")})
    assert r.returncode == 0, r.stderr
    assert f"metrics_port = 8082  ({DEPLOY / 'relay.toml'})" in r.stdout


# ------------------------------------------------------------------ kubernetes

def _k8s_docs():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "sidecar.yaml").read_text())
            if d]
    return {d["kind"]: d for d in docs}, docs


def test_kubernetes_manifests_parse():
    by_kind, docs = _k8s_docs()
    assert sorted(by_kind) == ["ConfigMap", "Deployment"] and len(docs) == 2
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"]


def test_kubernetes_configmap_is_a_valid_relay_config(tmp_path):
    by_kind, _ = _k8s_docs()
    f = tmp_path / "relay.toml"
    f.write_text(by_kind["ConfigMap"]["data"]["relay.toml"])
    s = config.load(config_file=f, environ={})
    assert s.metrics_ip == "0.0.0.0", "kubelet probes and Prometheus come from outside"


def test_kubernetes_sidecar_probes_ports_and_annotations(tmp_path):
    by_kind, _ = _k8s_docs()
    f = tmp_path / "relay.toml"
    cm = by_kind["ConfigMap"]
    f.write_text(cm["data"]["relay.toml"])
    s = config.load(config_file=f, environ={})

    dep = by_kind["Deployment"]
    tmpl = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
    ann = tmpl["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == str(s.metrics_port)
    assert ann["prometheus.io/path"] == "/metrics"

    spec = tmpl["spec"]
    containers = spec["containers"] + spec.get("initContainers", [])
    relay = next(c for c in containers if c["name"] == "logjam-relay")
    apps = [c for c in spec["containers"] if c["name"] != "logjam-relay"]
    assert apps, "an application container beside the relay"
    ports = {p["name"]: p["containerPort"] for p in relay["ports"]}
    assert ports == {"router": s.router_port, "pull": s.pull_port, "pub": s.pub_port,
                     "stats": s.stats_port, "metrics": s.metrics_port}
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = relay[probe]["httpGet"]
        assert get["path"] == path
        assert ports.get(get["port"], get["port"]) == s.metrics_port

    # the ConfigMap is mounted where the relay is told to read it
    cfg_arg = relay["args"][relay["args"].index("--config") + 1]
    mounts = {m["name"]: m["mountPath"] for m in relay["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    cfg_vol = next(n for n, v in vols.items()
                   if v.get("configMap", {}).get("name") == cm["metadata"]["name"])
    assert cfg_arg == f"{mounts[cfg_vol]}/relay.toml"
    # the state directory is a writable volume (the root file system is read-only)
    assert relay["securityContext"]["readOnlyRootFilesystem"] is True
    assert s.state_dir in mounts.values()
    if relay in spec.get("initContainers", []):
        assert relay["restartPolicy"] == "Always", "an init container must be a sidecar"


# ------------------------------------------------------------------ systemd

UNIT = DEPLOY / "systemd" / "logjam-relay.service"


def _unit() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_systemd_unit_hardening():
    u = _unit()
    assert u["ExecStart"] == ["/usr/local/bin/logjam-relay --config "
                              "/etc/logjam-relay/relay.toml"]
    assert u["StateDirectory"] == ["logjam-relay"]
    assert u.get("DynamicUser") == ["yes"] or "User" in u
    for key, value in (("ProtectSystem", "strict"), ("NoNewPrivileges", "yes"),
                       ("ProtectHome", "yes"), ("PrivateTmp", "yes"),
                       ("PrivateDevices", "yes"), ("CapabilityBoundingSet", "")):
        assert u.get(key) == [value], key


def test_systemd_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify insists that ExecStart exists: point it at this Python for the check.
    unit = tmp_path / "logjam-relay.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/logjam-relay",
                                             str(Path(sys.executable).resolve())))
    r = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                       timeout=60)
    ours = [ln for ln in (r.stdout + r.stderr).splitlines() if "logjam-relay" in ln]
    assert r.returncode == 0 and not ours, r.stdout + r.stderr


# ------------------------------------------------------------------ Dockerfile

def test_dockerfile_shape():
    text = (DEPLOY / "Dockerfile").read_text()
    # join continuation lines, drop comments
    logical = re.sub(r"\\\n\s*", " ", "\n".join(
        ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    instr = [ln.split(None, 1) for ln in logical.splitlines() if ln.strip()]
    cmds = [i[0].upper() for i in instr]
    args = {}
    for i in instr:
        args.setdefault(i[0].upper(), []).append(i[1] if len(i) > 1 else "")
    # two stages: a build stage that compiles the wheel (with the C socket loops and a
    # check that they are in it), and a runtime stage without a compiler
    assert args["FROM"] == ["python:3.11-slim AS build", "python:3.11-slim"]
    assert any("pip wheel" in a and "_zmqfast" in a for a in args["RUN"])
    assert any("pip install /wheels/" in a and "C: socket loops" in a for a in args["RUN"])
    assert "COPY --from=build /wheels /wheels" in logical
    user = args["USER"][-1].split(":")[0]
    assert user not in ("root", "0")
    assert cmds.index("USER") > max(i for i, c in enumerate(cmds) if c == "RUN")
    exposed = {int(p.split("/")[0]) for a in args["EXPOSE"] for p in a.split()}
    assert exposed == set(DEFAULT_PORTS.values())
    assert "/healthz" in args["HEALTHCHECK"][0]
    assert json.loads(args["ENTRYPOINT"][0]) == ["logjam-relay"]
    # every COPY source exists in the build context (the repository root), except
    # README.md which pyproject.toml requires and the README commit adds
    for a in args["COPY"]:
        if a.startswith("--from="):
            continue
        for src in a.split()[:-1]:
            if not src.startswith("--") and src != "README.md":
                assert (ROOT / src).exists(), src
    # the baked-in configuration is the sample and matches EXPOSE
    assert "COPY deploy/relay.toml /etc/logjam-relay/relay.toml" in logical
    assert json.loads(args["CMD"][0]) == ["--config", "/etc/logjam-relay/relay.toml"]


def test_wheel_contains_the_c_socket_loops_and_they_work(tmp_path):
    """What the image's build stage does: a wheel built from the tree carries
    logjam_relay.io._zmqfast, and installed on its own it drives real sockets."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                        "--wheel-dir", str(wheels), str(ROOT)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (whl,) = wheels.glob("logjam_relay-*.whl")
    import zipfile
    names = zipfile.ZipFile(whl).namelist()
    assert any(n.startswith("logjam_relay/io/_zmqfast") and n.endswith(".so") for n in names)
    zipfile.ZipFile(whl).extractall(site)
    probe = ("import zmq, logjam_relay.io.zmq_fast as f, logjam_relay.io.zmq_trio as t\n"
             "assert f.AVAILABLE, f.WHY_NOT\n"
             "assert f.__file__.startswith(%r), f.__file__\n"
             "c = zmq.Context(); a = c.socket(zmq.PULL); b = c.socket(zmq.PUSH)\n"
             "a.bind('inproc://x'); b.connect('inproc://x')\n"
             "b.send_multipart([b'1', b'2']); a.poll(1000)\n"
             "assert t.drain(a, 10) == [[b'1', b'2']]\n" % str(site))
    env = {k: v for k, v in os.environ.items() if k != "LOGJAM_RELAY_PURE_PYTHON"}
    env["PYTHONPATH"] = str(site)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ Prometheus, Grafana

def test_prometheus_example_config(tmp_path):
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert "logjam-relay" in jobs
    for t in jobs["logjam-relay"]["static_configs"][0]["targets"]:
        assert t.endswith(":8082")
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    r = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and "kubernetes_sd_configs not found" in r.stdout + r.stderr:
        # Debian builds Prometheus without Kubernetes discovery: check the rest.
        cfg["scrape_configs"] = [j for j in cfg["scrape_configs"]
                                 if "kubernetes_sd_configs" not in j]
        f = tmp_path / "prometheus.yml"
        f.write_text(yaml.safe_dump(cfg))
        r = subprocess.run([promtool, "check", "config", str(f)], capture_output=True,
                           text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_grafana_provisioning_files():
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml")
                        .read_text())
    assert ds["apiVersion"] == 1
    (src,) = ds["datasources"]
    assert src["type"] == "prometheus" and src["url"].startswith("http")
    dash = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "logjam-relay.yaml")
                          .read_text())
    assert dash["apiVersion"] == 1
    (prov,) = dash["providers"]
    assert prov["type"] == "file" and prov["options"]["path"].startswith("/")


def test_grafana_dashboard_structure():
    d = json.loads((GRAFANA / "dashboards" / "logjam-relay.json").read_text())
    assert d["uid"] == "logjam-relay" and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in d["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in panels}
    for wanted in ("Ingest rate", "Invalid messages / s by reason", "PUB drops / s",
                   "Output backlog (records)", "Ack latency", "Spool use", "CPU",
                   "Resident memory"):
        assert wanted in titles
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert 'device=~"$device"' in t["expr"], (p["title"], t["expr"])
    # no two panels overlap
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))


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


async def test_readyz_reports_an_output_out_of_budget(tmp_path):
    async with running_relay(tmp_path) as (relay, cl):
        port = cl.settings.metrics_port
        relay.outputs.append(_StuckOutput())
        try:
            status, _, body = await aget(port, "/readyz")
            assert status == 503
            assert b"lumberjack://upstream:5044: not connected" in body
            status, _, _ = await aget(port, "/healthz")
            assert status == 200, "alive while not ready"
        finally:
            relay.outputs.pop()
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
