"""deploy/Dockerfile built and run for real with podman.

No registry is reachable from the test machines, so the base image is made locally from
Debian packages: ``debootstrap --variant=minbase bookworm`` (what debian:bookworm-slim is
made from) imported with ``podman import``.  It is cached across runs (a tarball under
/var/tmp/logjam-relay-tests, or ``$LOGJAM_RELAY_TEST_DEBIAN_CACHE``, and the image in
podman's store, both keyed by a hash of suite, variant, mirror and debootstrap version), so
only the first run on a machine pays for debootstrap (about a minute); podman's layer cache
keeps the apt-get layers of the build.  (conftest.py keeps the suite's other caches beside
it, in cache-<uid>.)

The image is then built from the repository root exactly as the Dockerfile's header says,
with ``--build-arg BASE=<that image>``, run with its baked-in configuration (the relay with
logjam-device's defaults) and its ports published on loopback; the test sends traffic into
PULL and ROUTER, reads it on PUB, scrapes /metrics, runs the HEALTHCHECK and stops the
container with SIGTERM.

Skips (one line, with the reason) when podman or debootstrap is missing (under CI=true a
failure: ``.ci/run`` installs podman, runc and debootstrap), when not root (debootstrap and
the container network need root here), or when podman cannot start a container on this
machine (the reason names the runtime's error).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import zmq

from conftest import free_port
from relay_harness import meta

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = Path("/var/tmp/logjam-relay-tests")     # the README says so
CACHE = Path(os.environ.get("LOGJAM_RELAY_TEST_DEBIAN_CACHE") or DEFAULT_CACHE)
SUITE, VARIANT = "bookworm", "minbase"
MIRROR = os.environ.get("LOGJAM_RELAY_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
IMAGE = "localhost/logjam-relay:test"
PORTS = {"router": 9604, "pull": 9605, "pub": 9606, "stats": 9621, "metrics": 8082}


def _missing(msg: str):
    """.ci/run installs podman, runc and debootstrap: under CI their absence is a failure."""
    if os.environ.get("CI"):
        pytest.fail(msg + "; CI is set, so this is a failure")
    pytest.skip(msg)


def _run(argv, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def _limits() -> list[str]:
    """Explicit rlimits no higher than ours: podman's defaults (nofile 1048576) need
    CAP_SYS_RESOURCE, which sandboxes and unprivileged CI runners often lack."""
    nofile = min(16384, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    nproc = min(4096, resource.getrlimit(resource.RLIMIT_NPROC)[1])
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def _last_line(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {r.returncode}"


def _base_image() -> str:
    """A Debian bookworm minbase image in podman's store, made from Debian packages."""
    debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    version = _run([debootstrap, "--version"]).stdout.strip() \
        if os.path.exists(debootstrap) else "none"
    key = hashlib.sha256(f"{SUITE} {VARIANT} {MIRROR} {version}".encode()).hexdigest()[:12]
    tag = f"localhost/logjam-relay-debian:{SUITE}-{VARIANT}-{key}"
    if _run(["podman", "image", "exists", tag]).returncode == 0:
        return tag
    tarball = CACHE / f"debian-{SUITE}-{VARIANT}-{key}.tar"
    if not tarball.exists():
        if not os.path.exists(debootstrap):
            _missing("debootstrap is not installed (apt-get install debootstrap)")
        CACHE.mkdir(parents=True, exist_ok=True)
        rootfs = CACHE / f"rootfs-{key}-{os.getpid()}"
        try:
            r = _run([debootstrap, f"--variant={VARIANT}", SUITE, str(rootfs), MIRROR],
                     timeout=1200)
            assert r.returncode == 0, "debootstrap failed: " + r.stdout[-2000:] + r.stderr
            # what debian:*-slim drops: downloaded packages and the apt lists
            for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for p in (rootfs / d).glob("*"):
                    if p.is_file():
                        p.unlink()
            part = tarball.with_suffix(f".{os.getpid()}.part")
            with tarfile.open(part, "w") as tf:
                tf.add(rootfs, arcname=".")
            part.rename(tarball)
        finally:
            shutil.rmtree(rootfs, ignore_errors=True)
    r = _run(["podman", "import", str(tarball), tag])
    assert r.returncode == 0, r.stderr
    return tag


@pytest.fixture(scope="module")
def podman_env():
    """(base image, runtime flags) once podman is known to start a container here."""
    if shutil.which("podman") is None:
        _missing("podman is not installed (apt-get install podman runc)")
    if os.geteuid() != 0:
        pytest.skip("needs root: debootstrap and podman's container network run as root here")
    info = _run(["podman", "info", "--format", "json"], timeout=120)
    if info.returncode != 0:
        pytest.skip(f"podman does not work here: {_last_line(info)}")
    base = _base_image()
    # crun refuses cgroup v1/v2 hybrid hierarchies ("cgroups in hybrid mode not
    # supported"); runc runs there: try the default runtime first, then runc.
    tried = []
    for runtime in ([], ["--runtime", "runc"] if shutil.which("runc") else None):
        if runtime is None:
            continue
        r = _run(["podman", "run", "--rm", *runtime, *_limits(), base, "true"], timeout=120)
        if r.returncode == 0:
            return base, runtime
        tried.append(f"{' '.join(runtime) or 'default runtime'}: {_last_line(r)}")
    pytest.skip("podman cannot start a container here: " + "; ".join(tried))


@pytest.fixture(scope="module")
def image(podman_env):
    base, runtime = podman_env
    # pip in the build stage trusts what pip here trusts (a TLS-inspecting proxy's CA)
    ca = next((c for c in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                           "/etc/ssl/certs/ca-certificates.crt") if c and os.path.isfile(c)),
              None)
    secret = ["--secret", f"id=pip-ca,src={ca}"] if ca else []
    before = _run(["podman", "image", "inspect", "-f", "{{.Id}}", IMAGE]).stdout.strip()
    t0 = time.monotonic()
    # --format docker: the OCI image format has no HEALTHCHECK
    r = _run(["podman", "build", *runtime, *_limits(), *secret, "--pull=never", "--format", "docker",
              "--network", "host",
              "--build-arg", f"BASE={base}", "-f", str(ROOT / "deploy" / "Dockerfile"),
              "-t", IMAGE, str(ROOT)], timeout=1800)
    assert r.returncode == 0, "podman build failed:\n" + r.stdout[-4000:] + r.stderr[-3000:]
    print(f"podman build: {time.monotonic() - t0:.1f} s")
    after = _run(["podman", "image", "inspect", "-f", "{{.Id}}", IMAGE]).stdout.strip()
    if before and before != after:          # our previous image only, not others'
        _run(["podman", "rmi", before], timeout=120)
    return IMAGE, runtime, r.stdout


def test_image_carries_every_c_twin(image):
    """The image's own check requires every C twin; --version in the image lists them."""
    tag, runtime, _ = image
    r = _run(["podman", "run", "--rm", *runtime, *_limits(), tag, "--version"], timeout=120)
    assert r.returncode == 0, r.stderr
    from logjam_relay import _native
    out = " ".join(r.stdout.split())
    for label in _native.EXTENSIONS:
        assert label in out.split("C: ", 1)[1].split(";")[0], (label, out)
    assert "in Python" not in out
    # the Dockerfile's own check, run in the image with the twins switched off, fails
    # naming them (so a build without zlib.h or a compiler cannot pass it)
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    check = re.search(r'python -c "(import sys; from logjam_relay import _native[^"]+)"',
                      text).group(1)
    r = _run(["podman", "run", "--rm", *runtime, *_limits(), "-e",
              "LOGJAM_RELAY_PURE_PYTHON=1", "--entrypoint", "python", tag, "-c", check],
             timeout=120)
    assert r.returncode != 0 and "C twins missing from the image: socket loops" in r.stderr, \
        r.stderr
    # no compiler, runs as the unprivileged user
    r = _run(["podman", "run", "--rm", *runtime, *_limits(), "--entrypoint", "sh", tag, "-c",
              "id -u; command -v gcc cc || echo no-compiler"], timeout=120)
    assert r.stdout.split() == ["10001", "no-compiler"], r.stdout + r.stderr


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_container_relays_traffic_and_stops_cleanly(image):
    tag, runtime, _ = image
    host = {name: free_port() for name in PORTS}
    name = f"logjam-relay-test-{os.getpid()}"
    publish = [a for n, p in PORTS.items() for a in ("-p", f"127.0.0.1:{host[n]}:{p}")]
    r = _run(["podman", "run", "-d", "--name", name, *runtime, *_limits(), *publish, tag],
             timeout=120)
    assert r.returncode == 0, r.stderr
    ctx = zmq.Context()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _get(host["metrics"], "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            state = _run(["podman", "inspect", "-f", "{{.State.Status}}", name]).stdout
            assert "running" in state, _run(["podman", "logs", name]).stderr
            assert time.monotonic() < deadline, "the relay in the container never got ready"
            time.sleep(0.2)

        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(f"tcp://127.0.0.1:{host['pub']}")
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{host['pull']}")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{host['router']}")
        for s in (sub, push, dealer):
            s.setsockopt(zmq.LINGER, 0)

        # the subscription is in place once a probe comes through (heartbeats are 5 s apart)
        probes = 0
        deadline = time.monotonic() + 30
        while True:
            probes += 1
            push.send_multipart([b"probe-test", b"logs.probe", b"{}", meta(seq=probes)])
            if sub.poll(200) and sub.recv_multipart()[0] in (b"probe-test", b"heartbeat"):
                break
            assert time.monotonic() < deadline, "nothing published on PUB"

        n = 2000
        for i in range(n):
            push.send_multipart([b"app-prod", b"logs.app", b'{"i":%d}' % i, meta(seq=i + 1)])
        dealer.send_multipart([b"", b"app-prod", b"logs.app", b'{"i":"router"}',
                               meta(seq=n + 1)])
        assert dealer.poll(10_000), "no reply on ROUTER"
        reply = dealer.recv_multipart()
        assert reply[-1].startswith(b"202"), reply

        got, seqs = [], []
        deadline = time.monotonic() + 30
        while len(got) < n + 1 and time.monotonic() < deadline:
            if not sub.poll(500):
                continue
            m = sub.recv_multipart()
            if m[0] == b"app-prod":
                got.append(m[2])
                seqs.append(int.from_bytes(m[3][-8:], "big"))
        want = [b'{"i":%d}' % i for i in range(n)] + [b'{"i":"router"}']
        lost = len(set(want) - set(got))
        duplicated = len(got) - len(set(got))
        print(f"container: sent {n + 1}, received {len(got)}, lost {lost}, "
              f"duplicated {duplicated}")
        assert (lost, duplicated) == (0, 0)
        assert [g for g in got if g != want[-1]] == want[:n], "PUSH order kept"
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "sequence stamps"

        status, text = _get(host["metrics"], "/metrics")
        assert status == 200
        received = re.search(r'^logjam:device:msgs_received_total\{device="0"\} (\S+)$',
                             text, re.M)
        assert received and float(received.group(1)) == n + 1 + probes, received
        assert re.search(r"^logjam_relay_\w+", text, re.M)

        hc = _run(["podman", "healthcheck", "run", name], timeout=60)
        assert hc.returncode == 0, hc.stdout + hc.stderr

        r = _run(["podman", "stop", "-t", "20", name], timeout=60)
        assert r.returncode == 0, r.stderr
        state = json.loads(_run(["podman", "inspect", name]).stdout)[0]["State"]
        logs = _run(["podman", "logs", name])
        assert state["ExitCode"] == 0, logs.stdout + logs.stderr
        assert "Traceback" not in logs.stdout + logs.stderr
    finally:
        ctx.destroy(linger=0)
        _run(["podman", "rm", "-f", "-t", "0", name], timeout=60)
