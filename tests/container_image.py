"""The container test's image (tests/test_container.py), made here so that ``.ci/run`` can
make it ahead, beside the suite:

    python3 tests/container_image.py        # base image + deploy/Dockerfile built, cached

On a new machine the base image (``debootstrap``) and the image's ``apt-get`` and ``pip``
layers are most of three minutes, on the critical path of the test unit that runs the
container test.  ``.ci/run`` starts this script in the background before the suite (as
root, with podman installed); the test's own build then finds everything in podman's
caches.  Both take the same lock file while they make the base image and while they build,
so the test waits for a build in progress instead of doing it twice.  Nothing here is
trusted: whatever this script leaves undone or failed, the test does again itself and
reports.

The base image is made locally from Debian packages: ``debootstrap --variant=minbase
bookworm`` (what debian:bookworm-slim is made from) imported with ``podman import``.  It is
cached across runs (a tarball under /var/tmp/logjam-relay-tests, or
``$LOGJAM_RELAY_TEST_DEBIAN_CACHE``, and the image in podman's store, both keyed by a hash
of suite, variant, mirror and debootstrap version); podman's layer cache keeps the
``apt-get`` layers of the build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = Path("/var/tmp/logjam-relay-tests")     # the README says so
CACHE = Path(os.environ.get("LOGJAM_RELAY_TEST_DEBIAN_CACHE") or DEFAULT_CACHE)
SUITE, VARIANT = "bookworm", "minbase"
MIRROR = os.environ.get("LOGJAM_RELAY_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
IMAGE = "localhost/logjam-relay:test"


class Missing(Exception):
    """A tool the image needs is not installed (the test skips, or fails under CI)."""


def run(argv, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def limits() -> list[str]:
    """Explicit rlimits no higher than ours: podman's defaults (nofile 1048576) need
    CAP_SYS_RESOURCE, which sandboxes and unprivileged CI runners often lack."""
    nofile = min(16384, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    nproc = min(4096, resource.getrlimit(resource.RLIMIT_NPROC)[1])
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def last_line(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {r.returncode}"


@contextlib.contextmanager
def locked(name: str):
    """An exclusive lock on CACHE/<name>.lock, held for the block (the prewarm and the
    test never make the same thing at once)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def base_image() -> str:
    """A Debian bookworm minbase image in podman's store, made from Debian packages."""
    debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    version = run([debootstrap, "--version"]).stdout.strip() \
        if os.path.exists(debootstrap) else "none"
    key = hashlib.sha256(f"{SUITE} {VARIANT} {MIRROR} {version}".encode()).hexdigest()[:12]
    tag = f"localhost/logjam-relay-debian:{SUITE}-{VARIANT}-{key}"
    with locked(f"base-{key}"):
        if run(["podman", "image", "exists", tag]).returncode == 0:
            return tag
        tarball = CACHE / f"debian-{SUITE}-{VARIANT}-{key}.tar"
        if not tarball.exists():
            if not os.path.exists(debootstrap):
                raise Missing("debootstrap is not installed (apt-get install debootstrap)")
            rootfs = CACHE / f"rootfs-{key}-{os.getpid()}"
            try:
                r = run([debootstrap, f"--variant={VARIANT}", SUITE, str(rootfs), MIRROR],
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
        r = run(["podman", "import", str(tarball), tag])
        assert r.returncode == 0, r.stderr
    return tag


def runtime_for(base: str) -> tuple[list[str] | None, list[str]]:
    """The runtime flags podman starts a container with here (None: none works), and what
    each try said.  crun refuses cgroup v1/v2 hybrid hierarchies ("cgroups in hybrid mode
    not supported"); runc runs there: the default runtime first, then runc."""
    tried = []
    for runtime in ([], ["--runtime", "runc"] if shutil.which("runc") else None):
        if runtime is None:
            continue
        r = run(["podman", "run", "--rm", *runtime, *limits(), base, "true"], timeout=120)
        if r.returncode == 0:
            return runtime, tried
        tried.append(f"{' '.join(runtime) or 'default runtime'}: {last_line(r)}")
    return None, tried


def build(base: str, runtime: list[str]) -> subprocess.CompletedProcess:
    """deploy/Dockerfile built from the repository root as its header says, tagged
    :data:`IMAGE` (the previous image of that tag removed)."""
    # pip in the build stage trusts what pip here trusts (a TLS-inspecting proxy's CA)
    ca = next((c for c in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                           "/etc/ssl/certs/ca-certificates.crt") if c and os.path.isfile(c)),
              None)
    secret = ["--secret", f"id=pip-ca,src={ca}"] if ca else []
    with locked("build"):
        before = run(["podman", "image", "inspect", "-f", "{{.Id}}", IMAGE]).stdout.strip()
        # --format docker: the OCI image format has no HEALTHCHECK
        r = run(["podman", "build", *runtime, *limits(), *secret, "--pull=never",
                 "--format", "docker", "--network", "host",
                 "--build-arg", f"BASE={base}", "-f", str(ROOT / "deploy" / "Dockerfile"),
                 "-t", IMAGE, str(ROOT)], timeout=1800)
        after = run(["podman", "image", "inspect", "-f", "{{.Id}}", IMAGE]).stdout.strip()
        if r.returncode == 0 and before and before != after:   # our previous image only
            run(["podman", "rmi", before], timeout=120)
    return r


def prewarm() -> int:
    """Make the base image and build the image once (``.ci/run``, in the background); what
    fails is said on stderr and left to the test."""
    t0 = time.monotonic()
    if shutil.which("podman") is None or os.geteuid() != 0:
        print("container prewarm: not root or no podman: nothing to do", file=sys.stderr)
        return 0
    try:
        base = base_image()
    except (Missing, AssertionError, OSError, subprocess.SubprocessError) as e:
        print(f"container prewarm: base image: {e}", file=sys.stderr)
        return 1
    runtime, tried = runtime_for(base)
    if runtime is None:
        print("container prewarm: podman cannot start a container: " + "; ".join(tried),
              file=sys.stderr)
        return 1
    r = build(base, runtime)
    print(f"container prewarm: build {'ok' if r.returncode == 0 else 'FAILED'} "
          f"({last_line(r)}); {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0 if r.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(prewarm())
