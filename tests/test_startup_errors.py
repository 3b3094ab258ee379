"""Start-up failures through the real command: one line on stderr, exit 2, no traceback.

Every bind (router, pull, pub, stats, metrics, cmdp, samwise) and every resource start-up
needs (state dir, spool dir, archive dir, TLS files, broker URLs, the state lock, the
environment) is broken on purpose; the relay must refuse with one line that names the
setting, its value, where the value came from and the likely cause.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import free_port
from relay_harness import relay_settings, start_process, stop_process

#: a guard against a relay that never exits, not a bound under test (the relay exits in
#: well under 1 s on a quiet machine; beside two busy loops with the machine at load 16-18
#: its Python start alone went over 10 s, the guard's earlier value)
EXIT_WAIT = 60


def base_argv(tmp_path, ports: dict | None = None) -> list[str]:
    p = {"-t": free_port(), "-p": free_port(), "-P": free_port(), "-s": free_port(),
         "-m": free_port()}
    p.update(ports or {})
    argv = [sys.executable, "-m", "logjam_relay", "--bind", "127.0.0.1", "-M", "127.0.0.1",
            "--fqdn", "vm", "--state-dir", str(tmp_path / "state")]
    for flag, port in p.items():
        argv += [flag, str(port)]
    return argv


def run_failing(argv: list[str], env_extra: dict | None = None) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGJAM_RELAY_")
           or k == "LOGJAM_RELAY_PURE_PYTHON"}
    env.update(env_extra or {})
    t0 = time.monotonic()
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=EXIT_WAIT)
    elapsed = time.monotonic() - t0
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    print(f"exit 2 after {elapsed:.2f} s: {lines[0]}")
    return lines[0], elapsed


def assert_names(line: str, *parts: str) -> None:
    for part in parts:
        assert part in line, (part, line)


@pytest.fixture
def busy_port():
    """A port held by a plain listening TCP socket (as a running logjam-device would)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize("setting,flag", [
    ("router_port", "-t"), ("pull_port", "-p"), ("pub_port", "-P"), ("stats_port", "-s"),
    ("metrics_port", "-m"), ("cmdp_port", "--cmdp-port"),
])
def test_port_in_use(tmp_path, busy_port, setting, flag):
    argv = base_argv(tmp_path)
    if flag.startswith("--"):
        argv += [flag, str(busy_port)]
    else:
        argv[argv.index(flag, 3) + 1] = str(busy_port)
    line, _ = run_failing(argv)
    long_flag = {"-t": "--router-port", "-p": "--pull-port", "-P": "--pub-port",
                 "-s": "--stats-port", "-m": "--metrics-port"}.get(flag, flag)
    assert_names(line, f"{setting} {busy_port} (flag {long_flag})", "address already in use",
                 "still running?")
    # nothing half-started: the other ports were released again
    for other in ("-t", "-p", "-P", "-s", "-m"):
        if other != flag:
            with socket.socket() as s:
                # SO_REUSEADDR as the relay's listeners: free_port() left the port in
                # TIME_WAIT (conftest.py), which only a listener still there conflicts with
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", int(argv[argv.index(other, 3) + 1])))
                s.listen()


def test_port_in_use_zmq_and_env_source(tmp_path):
    """A ZeroMQ socket on the port (logjam-device itself), the value from the environment."""
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = free_port()
    sock.bind(f"tcp://127.0.0.1:{port}")
    try:
        argv = base_argv(tmp_path)
        i = argv.index("-p", 3)
        del argv[i:i + 2]
        line, _ = run_failing(argv, {"LOGJAM_RELAY_PULL_PORT": str(port)})
        assert_names(line, f"pull_port {port} (env LOGJAM_RELAY_PULL_PORT)",
                     "address already in use")
    finally:
        sock.close()
        ctx.term()


def test_port_in_use_file_source(tmp_path, busy_port):
    toml = tmp_path / "relay.toml"
    toml.write_text(f"pub_port = {busy_port}\n")
    argv = base_argv(tmp_path)
    i = argv.index("-P", 3)
    del argv[i:i + 2]
    line, _ = run_failing(argv + ["--config", str(toml)])
    assert_names(line, f"pub_port {busy_port} (file {toml})", "address already in use")


def test_samwise_port_in_use(tmp_path, busy_port):
    ep = f"tcp://127.0.0.1:{busy_port}"
    line, _ = run_failing(base_argv(tmp_path) + [
        "--samwise", ep, "--amqp-broker", "a=amqp://guest:guest@127.0.0.1:1/"])
    assert_names(line, f"samwise {ep} (flag --samwise)", "address already in use")


def _under_a_file(tmp_path, name):
    (tmp_path / "plainfile").write_text("x")
    return str(tmp_path / "plainfile" / name)


def _immutable_dir(tmp_path, name):
    """A directory nobody may write in, even root (chattr +i); skips where unsupported."""
    d = tmp_path / name
    d.mkdir()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(d)],
                                                        capture_output=True).returncode:
        pytest.skip("chattr +i is not supported here (the path-under-a-file case still runs)")
    return str(d)


@pytest.fixture
def cleanup_immutable(tmp_path):
    yield
    for p in tmp_path.iterdir():
        subprocess.run(["chattr", "-i", str(p)], capture_output=True)


@pytest.mark.parametrize("how", ["under_a_file", "immutable"])
def test_state_dir_unwritable(tmp_path, how, cleanup_immutable):
    d = _under_a_file(tmp_path, "state") if how == "under_a_file" else \
        _immutable_dir(tmp_path, "state")
    argv = base_argv(tmp_path)
    argv[argv.index("--state-dir") + 1] = d
    line, _ = run_failing(argv)
    assert_names(line, f"state_dir {d} (flag --state-dir)", "sequence")
    if how == "immutable":
        assert os.listdir(d) == []          # nothing written, nothing half-created


@pytest.mark.parametrize("how", ["under_a_file", "immutable"])
def test_spool_dir_unwritable(tmp_path, how, cleanup_immutable):
    d = _under_a_file(tmp_path, "spool") if how == "under_a_file" else \
        _immutable_dir(tmp_path, "spool")
    line, _ = run_failing(base_argv(tmp_path) + [
        "--spool-dir", d, "--output", "lumberjack://127.0.0.1:1?tls=off"])
    assert_names(line, f"spool_dir {d} (flag --spool-dir)", "cannot write",
                 "could not be spooled")


def test_archive_dir_unwritable(tmp_path):
    d = _under_a_file(tmp_path, "archive")
    line, _ = run_failing(base_argv(tmp_path) + ["--archive-dir", d])
    assert_names(line, f"archive_dir {d} (flag --archive-dir)", "cannot write")


@pytest.mark.parametrize("param", ["ca", "cert"])
def test_missing_tls_file(tmp_path, param):
    missing = str(tmp_path / f"no-{param}.pem")
    extra = f"&key={tmp_path / 'no-key.pem'}" if param == "cert" else ""
    url = f"lumberjack://127.0.0.1:5044?{param}={missing}{extra}"
    line, _ = run_failing(base_argv(tmp_path) + ["--output", url])
    assert_names(line, f"outputs {url} (flag --output)", f"TLS {param} file {missing}",
                 "no such file")


def test_bad_broker_url(tmp_path):
    line, _ = run_failing(base_argv(tmp_path) + [
        "--samwise", f"tcp://127.0.0.1:{free_port()}", "--amqp-broker", "a=amqp://u:secret@[::1"])
    assert_names(line, "amqp_brokers (flag --amqp-broker)", "bad URL")
    assert "secret" not in line


def test_misspelt_environment_variable(tmp_path):
    line, _ = run_failing(base_argv(tmp_path), {"LOGJAM_RELAY_SPOOL_MAX_BYTE": "1GiB"})
    assert_names(line, "LOGJAM_RELAY_SPOOL_MAX_BYTE", "unknown setting",
                 "did you mean LOGJAM_RELAY_SPOOL_MAX_BYTES?")


def test_second_relay_on_the_same_state_dir_refuses(tmp_path):
    settings = relay_settings(tmp_path, device_id=3)
    first = start_process(settings, log_path=tmp_path / "first.log")
    try:
        state_file = tmp_path / "state" / "sequence-device-3.json"
        before = state_file.read_bytes()
        argv = base_argv(tmp_path) + ["-d", "3"]
        line, _ = run_failing(argv)
        assert_names(line, f"state_dir {tmp_path / 'state'} (flag --state-dir)",
                     "locked by another relay with device_id 3", f"pid {first.pid}")
        assert state_file.read_bytes() == before        # the second one wrote nothing
        # another device id on the same state dir is fine: the lock is per device
        other = relay_settings(tmp_path, device_id=4)
        second = start_process(other, log_path=tmp_path / "second.log")
        assert stop_process(second) == 0
    finally:
        assert stop_process(first) == 0


def test_lock_is_released_when_the_holder_dies(tmp_path):
    import signal
    settings = relay_settings(tmp_path, device_id=5)
    first = start_process(settings)
    stop_process(first, signal.SIGKILL)
    again = start_process(relay_settings(tmp_path, device_id=5))
    assert stop_process(again) == 0


def test_dead_letter_dir_unwritable(tmp_path):
    d = _under_a_file(tmp_path, "dead")
    line, _ = run_failing(base_argv(tmp_path) + [
        "--dead-letter-dir", d, "--output", "lumberjack://127.0.0.1:1?tls=off"])
    assert_names(line, f"dead_letter_dir {d} (flag --dead-letter-dir)", "cannot write")


@pytest.mark.parametrize("scheme", ["lumberjack", "courier"])
def test_input_port_in_use(tmp_path, busy_port, scheme):
    url = f"{scheme}://127.0.0.1:{busy_port}?tls=off"
    line, _ = run_failing(base_argv(tmp_path) + ["--spool-dir", str(tmp_path / "spool"),
                                                 "--input", url])
    assert_names(line, f"inputs {url} (flag --input)", "address already in use",
                 "still running?")


@pytest.mark.parametrize("content", [b'{"device": 0, "sequence": 12', b"\x00" * 64,
                                     b'{"device": 0, "sequence": "many"}', b"[1, 2]"])
def test_unreadable_sequence_state_refuses_to_start(tmp_path, content):
    """The next number is unknown: starting at 1 could reuse numbers importers have seen."""
    state = tmp_path / "state"
    state.mkdir()
    f = state / "sequence-device-0.json"
    f.write_bytes(content)
    line, _ = run_failing(base_argv(tmp_path))
    assert_names(line, f"state_dir {state} (flag --state-dir)", "sequence-device-0.json",
                 "unreadable", "move the file aside")
    assert f.read_bytes() == content                # left as it was for the operator


def test_input_with_a_tls_file_that_is_not_pem(tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    url = f"courier://127.0.0.1:{free_port()}?cert={bad}&key={bad}"
    line, _ = run_failing(base_argv(tmp_path) + ["--spool-dir", str(tmp_path / "spool"),
                                                 "--input", url])
    assert_names(line, f"inputs {url} (flag --input)", "TLS files cannot be loaded")


def test_free_port_is_kept_from_other_port_pickers_until_the_relay_binds_it():
    """The tests' ports (conftest.free_port) cannot be taken between the test choosing one
    and the relay binding it: another program probing the port with a plain bind (how a
    free-port check works, another test suite's included) is refused, while the relay's
    listeners -- libzmq and trio, both SO_REUSEADDR -- bind it.  Before, the port was
    only checked and released: anything could take it in between ("relay exited with 2",
    samwise's bind: address already in use)."""
    import trio
    import zmq
    for addr in ("0.0.0.0", "127.0.0.1"):
        port = free_port()
        with socket.socket() as s, pytest.raises(OSError) as ei:
            s.bind((addr, port))
        assert ei.value.errno == errno.EADDRINUSE
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://127.0.0.1:{free_port()}")
        sock.close()
    finally:
        ctx.term()

    async def listen():
        port = free_port()
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        assert listeners[0].socket.getsockname()[1] == port
        for lst in listeners:
            await lst.aclose()
    trio.run(listen)
