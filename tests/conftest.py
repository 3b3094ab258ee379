import os
import random
import socket
import time

import pytest
import trustme

# The suite's caches live in /var/tmp/logjam-relay-tests and are kept for its next run on
# this machine (the README's "What it costs"): the container test's Debian base
# (test_container.py) and, in cache-<uid>, the suite's $XDG_CACHE_HOME: the JVM class-data
# archive of `pipeline stats` (120-200 MB; the first run of a suite without it is slower,
# it writes one) and the JVM reader's jar -- never the user's ~/.cache.  Where that
# directory cannot be written, a temporary one is used and removed at the end.
SUITE_CACHE = "/var/tmp/logjam-relay-tests"
if not os.environ.get("LOGJAM_RELAY_TEST_CACHE"):
    _cache = os.path.join(SUITE_CACHE, f"cache-{os.getuid()}")
    try:
        os.makedirs(_cache, mode=0o700, exist_ok=True)
        if not os.access(_cache, os.W_OK):
            raise PermissionError(_cache)
    except OSError:
        import atexit
        import shutil
        import tempfile
        _cache = tempfile.mkdtemp(prefix="logjam-relay-test-cache-")
        atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["LOGJAM_RELAY_TEST_CACHE"] = os.environ["XDG_CACHE_HOME"] = _cache


def require_native(mod, name: str):
    """``mod``, an optional C twin (``name`` its module), or skip the test when it is not
    in use: not built, or ``LOGJAM_RELAY_PURE_PYTHON`` set.  With ``CI`` set, a missing
    build is a failure (CI must build every C twin)."""
    from logjam_relay import _native
    if mod is None:
        if _native.PURE_PYTHON:
            pytest.skip(f"{name}: LOGJAM_RELAY_PURE_PYTHON is set")
        if os.environ.get("CI"):
            pytest.fail(f"{name} must be built in CI")
        pytest.skip(f"{name} is not built")
    return mod


_HANDED_OUT: set[int] = set()
_rng = random.Random(os.getpid() ^ time.monotonic_ns())
_PORT_RANGE = (20000, 32767)  # below Linux's ephemeral range (32768-60999): outgoing
                              # connections never take these behind a test's back
# The suite runs in pytest-xdist workers (pyproject.toml: -n 3): each worker hands out
# ports from its own part of the range, so two workers never pick the same port.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw"):
    _n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _part = (_PORT_RANGE[1] - _PORT_RANGE[0] + 1) // max(_n, 1)
    _lo = _PORT_RANGE[0] + int(_WORKER[2:]) * _part
    _PORT_RANGE = (_lo, _lo + _part - 1)

# With -n 3 --dist loadgroup the suite is three work units, one per worker (pyproject.toml):
# * "relay": the tests that share something outside their process (the RabbitMQ broker,
#   which test_samwise_rabbitmq.py stops and starts; logjam-device's default ports
#   9604-9606; the container image) and the rest of the relay's files, one after the other;
# * "spark": the Spark test files with a session in the test process (each module starts
#   its session once), and relay files that share nothing outside their process;
# * "spark-cli": the Spark files that start their own JVMs (a standalone cluster, a Connect
#   server, the command), and such relay files.
# Two Spark units run at once: on two cores a third worker takes the time the other two
# spend waiting (outages, timeouts, JVMs starting): measured on a 2-core machine
# (2026-11-28) the suite took 883 s in two units, 808 s and 681 s in these three.  The
# balance files even the units' sums of test times out (2026-12-04, quiet, a clean clone:
# spark 714, spark-cli 671, relay 659 s, the suite 729 s, before test_output_outage.py,
# about 40 s, went from spark back to relay, as test_powerloss.py did from spark-cli).
SPARK_FILES = {"test_pipeline*.py", "test_segscan.py", "test_progress.py"}
SPARK_CLI_FILES = {"test_pipeline_cluster.py", "test_pipeline_jvmcache.py",
                   "test_pipeline_report.py", "test_pipeline_connect.py", "test_fleet.py"}
# ... and, to even the units out, relay test files that share nothing outside their process
BALANCE_FILES = {"test_loss_accounting.py": "spark", "test_inputs_memory.py": "spark",
                 "test_cmdp_log_flood.py": "spark"}
#: files run last in their unit (pytest_collection_modifyitems)
LAST_FILES = {"test_container.py"}

#: the JIT of the JVMs the tests start for themselves (the in-process sessions, a Connect
#: server, a standalone cluster's master, workers and executors, streaming drivers): C1
#: only.  They are short-lived and handle a few thousand records; on two cores C2's
#: compiler threads cost more CPU than they save (a local session's start and first job:
#: 21 s of CPU with C2, 13-14 s without, measured on the CI machine).  What the JVM
#: computes is the same; the command's own choice for a local batch run is
#: pipeline/cli.py local_batch_jvm_options.
TEST_JIT = "-XX:TieredStopAtLevel=1"


def local_spark_session(app_name: str):
    """The in-process SparkSession of a test module (test_pipeline, _jvm, _sql): the
    command's own ``make_session`` on ``local[2]``, small shuffles, a C1-only driver."""
    from logjam_relay.pipeline.cli import make_session
    return make_session("local[2]", app_name,
                        {"spark.sql.shuffle.partitions": "4", "spark.default.parallelism": "2",
                         "spark.driver.extraJavaOptions": TEST_JIT})


# A worker that dies of a signal (a segfault, an abort() in libzmq) is reported by xdist
# as "crashed" and its fault handler's traceback is lost among the other output.  Each
# worker's fault handler writes into a file of the run's own directory instead, and the
# controller prints the non-empty ones at the end, beside the failures.
_FAULT_DIR_ENV = "LOGJAM_RELAY_TEST_FAULT_DIR"
_fault_file = None


@pytest.hookimpl(trylast=True)            # after pytest's faulthandler plugin enabled it
def pytest_configure(config):
    global _fault_file
    import faulthandler
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        if getattr(config.option, "numprocesses", None) and _FAULT_DIR_ENV not in os.environ:
            import tempfile
            os.environ[_FAULT_DIR_ENV] = tempfile.mkdtemp(prefix="logjam-relay-test-faults-")
            config._logjam_fault_dir = os.environ[_FAULT_DIR_ENV]
        return
    d = os.environ.get(_FAULT_DIR_ENV)
    if d and os.path.isdir(d):
        _fault_file = open(os.path.join(d, f"{worker}-{os.getpid()}.txt"), "w")
        faulthandler.enable(file=_fault_file, all_threads=True)


def pytest_terminal_summary(terminalreporter, config):
    d = getattr(config, "_logjam_fault_dir", None)
    if not d or not os.path.isdir(d):
        return
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), errors="replace") as fh:
            text = fh.read()
        if text.strip():
            terminalreporter.section(f"fault handler of worker {name[:-4]}", red=True)
            terminalreporter.write(_fault_summary(text))


def _fault_summary(text: str) -> str:
    """The fault's line and each thread's stack down to the first frame of pytest's own
    machinery (pytest, pluggy, execnet), at most 12 frames a thread."""
    out, frames = [], 0
    skipping = False
    for ln in text.splitlines():
        if ln.startswith(("Thread 0x", "Current thread")) or not ln.startswith("  "):
            if ln.strip():
                out.append(ln)
            skipping, frames = False, 0
        elif not skipping:
            if any(m in ln for m in ("/_pytest/", "/pluggy/", "/execnet/")) or frames == 12:
                skipping = True
                out.append("  ...")
            else:
                out.append(ln)
                frames += 1
    return "\n".join(out) + "\n"


def pytest_unconfigure(config):
    d = getattr(config, "_logjam_fault_dir", None)
    if d:
        import shutil
        shutil.rmtree(d, ignore_errors=True)
        os.environ.pop(_FAULT_DIR_ENV, None)


# tryfirst: xdist's worker turns the marks into the node ids' "@group" suffix in its own
# pytest_collection_modifyitems, which must see them
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    import fnmatch
    for item in items:
        name = item.path.name
        if name in SPARK_CLI_FILES:
            group = "spark-cli"
        elif any(fnmatch.fnmatch(name, p) for p in SPARK_FILES):
            group = "spark"
        else:
            group = BALANCE_FILES.get(name, "relay")
        item.add_marker(pytest.mark.xdist_group(group))
    # the container test last in its unit: on a new machine .ci/run makes its image in the
    # background meanwhile (tests/container_image.py)
    items.sort(key=lambda item: item.path.name in LAST_FILES)


def free_port() -> int:
    """A TCP port free right now on every interface, never handed out before in this
    process, and kept from anyone else who looks for a free port until a server of the
    test binds it.

    Ports come from below the kernel's ephemeral range, so neither a second call nor a
    client connection made meanwhile can get the same number (the kernel's own bind-to-0
    does hand the same port out twice in a row).  A port that was only found free would be
    free for anyone until the relay binds it: another program on the machine (another
    test suite's relay, a server picking a random port) could take it in between, and the
    relay would exit 2 with "address already in use".  So the port is left in TIME_WAIT
    (:func:`_hold`): for the next 60 s the kernel refuses it to a ``bind`` without
    ``SO_REUSEADDR`` -- how every free-port check, this one included, probes a port --
    while the relay's listeners (libzmq, trio, the JVM's server sockets: all set
    ``SO_REUSEADDR``) bind it as if it were free."""
    for _ in range(1000):
        port = _rng.randint(*_PORT_RANGE)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        try:
            _hold(port)
        except OSError:
            continue                    # taken between the check and the hold: next one
        return port
    raise RuntimeError("no free TCP port found in {}-{}".format(*_PORT_RANGE))


def _hold(port: int) -> None:
    """Leave ``port`` in TIME_WAIT on 127.0.0.1: listen on it (``SO_REUSEADDR``, as the
    relay's listeners set it), connect, and close the accepted side first -- the side that
    closes first keeps the connection in TIME_WAIT, bound to ``port``.  No descriptor stays
    open."""
    with socket.socket() as lsn:
        lsn.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsn.bind(("127.0.0.1", port))
        lsn.listen(1)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as cli:
            srv, _ = lsn.accept()
            srv.close()                 # first: TIME_WAIT is on this side, on ``port``
            cli.recv(1)                 # its FIN arrived: the client's close ends cleanly


@pytest.fixture
def port_factory():
    return free_port


@pytest.fixture(scope="session")
def tls_ca():
    """A throw-away CA (trustme) with a server certificate for localhost/127.0.0.1."""
    return trustme.CA()


@pytest.fixture(scope="session")
def tls_files(tls_ca, tmp_path_factory):
    """Paths: ca.pem, server.pem (cert+key), client.pem (cert+key)."""
    d = tmp_path_factory.mktemp("tls")
    ca = d / "ca.pem"
    tls_ca.cert_pem.write_to_path(str(ca))
    server = tls_ca.issue_cert("localhost", "127.0.0.1")
    srv = d / "server.pem"
    server.private_key_and_cert_chain_pem.write_to_path(str(srv))
    client = tls_ca.issue_cert("relay-client")
    cli = d / "client.pem"
    client.private_key_and_cert_chain_pem.write_to_path(str(cli))
    return {"ca": str(ca), "server": str(srv), "client": str(cli)}


@pytest.fixture(autouse=True)
def _fresh_rate_limits():
    """Module-level rate-limited logs start each test with a full burst: a test that waits
    for a warning must not find it spent by an earlier test in the same process."""
    import sys
    for mod, names in (("logjam_relay.relay.stamping", ("log", "_relay_log")),
                       ("logjam_relay.relay.app", ("rlog",)),
                       ("logjam_relay.relay.ticker", ("rlog",)),
                       ("logjam_relay.relay.spoolwrite", ("rlog",))):
        m = sys.modules.get(mod)
        for n in names:
            limiter = getattr(m, n, None) if m is not None else None
            if limiter is not None and hasattr(limiter, "_windows"):
                limiter._windows.clear()
    yield
