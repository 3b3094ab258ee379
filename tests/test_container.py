"""deploy/Dockerfile built and run for real with podman.

No registry is reachable from the test machines, so the base image is made locally from
Debian packages (``tests/container_image.py``: ``debootstrap --variant=minbase bookworm``,
cached under /var/tmp/logjam-relay-tests and in podman's store).  Only the first run on a
machine pays for debootstrap and the build's apt-get and pip layers (about three minutes);
``.ci/run`` starts ``tests/container_image.py`` in the background before the suite, and this
module runs last in its work unit (conftest.py), so that on a new machine the test finds
them made.  (conftest.py keeps the suite's other caches beside it, in cache-<uid>.)

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

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request

import pytest
import zmq

import container_image as ci
from conftest import free_port
from relay_harness import meta

pytestmark = pytest.mark.slow

ROOT = ci.ROOT
IMAGE = ci.IMAGE
PORTS = {"router": 9604, "pull": 9605, "pub": 9606, "stats": 9621, "metrics": 8082}
_run, _limits = ci.run, ci.limits


def _missing(msg: str):
    """.ci/run installs podman, runc and debootstrap: under CI their absence is a failure."""
    if os.environ.get("CI"):
        pytest.fail(msg + "; CI is set, so this is a failure")
    pytest.skip(msg)


@pytest.fixture(scope="module")
def podman_env():
    """(base image, runtime flags) once podman is known to start a container here."""
    if shutil.which("podman") is None:
        _missing("podman is not installed (apt-get install podman runc)")
    if os.geteuid() != 0:
        pytest.skip("needs root: debootstrap and podman's container network run as root here")
    info = _run(["podman", "info", "--format", "json"], timeout=120)
    if info.returncode != 0:
        pytest.skip(f"podman does not work here: {ci.last_line(info)}")
    try:
        base = ci.base_image()
    except ci.Missing as e:
        _missing(str(e))
    runtime, tried = ci.runtime_for(base)
    if runtime is None:
        pytest.skip("podman cannot start a container here: " + "; ".join(tried))
    return base, runtime


@pytest.fixture(scope="module")
def image(podman_env):
    base, runtime = podman_env
    t0 = time.monotonic()
    r = ci.build(base, runtime)
    assert r.returncode == 0, "podman build failed:\n" + r.stdout[-4000:] + r.stderr[-3000:]
    print(f"podman build: {time.monotonic() - t0:.1f} s")
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
