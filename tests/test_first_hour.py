"""The first hour of a new operator (issue 23 §2): what the README tells them to type, what
``--help`` and ``--check-config`` show, and how the commands behave around it.

Each test takes the commands from the README (or the docs) as written, where it can, and
runs them: the prerequisite line (with stand-ins for apt-get and sudo), ``run-relay``'s
extras (with a stand-in python3), the operator tools in a newcomer's order against a real
relay, every subcommand into a pipe whose reader is gone, and the log lines of the relay and
its output workers in both formats.  The README's two commands on a fresh Debian image are
tried by ``.ci/fresh-debian.sh`` (not part of the suite: it downloads from PyPI).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from logjam_relay import cli, config
from logjam_relay.config import helptext
from logjam_relay.config.settings import RESOLVED
from logjam_relay.units import duration, size
from relay_harness import relay_settings, start_process, stop_process

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGJAM_RELAY_")
           or k in ("LOGJAM_RELAY_PURE_PYTHON", "LOGJAM_RELAY_TEST_CACHE")}
    env.update(extra)
    return env


def _cli(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "logjam_relay", *args], capture_output=True,
                          text=True, timeout=120, env=kw.pop("env", None) or _env(), **kw)


def _section(title: str) -> str:
    return README.split(title, 1)[1].split("\n## ", 1)[0]


def _code_lines(text: str) -> list[str]:
    return [ln[4:] for ln in text.splitlines() if ln.startswith("    ")]


# ------------------------------------------------------------------ 1. prerequisites

def _prerequisite_line() -> str:
    setup = _section("## Set-up on a fresh machine")
    return _code_lines(setup.split("**Operator", 1)[0])[0]


@pytest.mark.parametrize("sudo", [False, True], ids=["root-without-sudo", "user-with-sudo"])
def test_prerequisite_line_works_as_root_and_as_a_user(tmp_path, sudo):
    """The README's line, run by sh with stand-ins: where there is no sudo (a root shell of
    a minimal image) apt-get is called directly, where there is one it goes through sudo;
    either way the package lists are updated first, then the packages installed."""
    line = _prerequisite_line()
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "apt-get $*" >> {calls}\n')
    if sudo:
        (bin_dir / "sudo").write_text(f'#!/bin/sh\necho "sudo" >> {calls}\nexec "$@"\n')
    for p in bin_dir.iterdir():
        p.chmod(0o755)
    # only the stand-ins on PATH (and no real sudo): `command -v sudo` finds what we made
    r = subprocess.run(["/bin/sh", "-c", line], env={"PATH": str(bin_dir)},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    got = calls.read_text().splitlines()
    want_install = ("apt-get install -y git ca-certificates python3 python3-venv python3-dev "
                    "gcc zlib1g-dev libdeflate0")
    if sudo:
        assert got == ["sudo", "apt-get update", "sudo", want_install], got
    else:
        assert got == ["apt-get update", want_install], got
    assert not line.startswith("sudo ")


# ------------------------------------------------------------------ 2. extras

#: what a newcomer sees without scrolling: a terminal's screen, or the top of the page
FIRST_SCREEN = 50


def test_readme_first_screen_has_the_durable_quick_start_the_exposure_and_the_stop():
    """Within the README's first screen: the two commands, a durable start (an output and
    its spool) as a command, that the relay listens on every interface with no
    authentication (and how to close that), and how to stop it."""
    head = "\n".join(README.splitlines()[:FIRST_SCREEN])
    code = _code_lines(head)
    assert any(ln == "./run-relay" for ln in code), code
    assert any(ln.startswith("./run-relay --output ") and "--spool-" in ln for ln in code), code
    flat = " ".join(head.split())
    assert "no authentication" in flat and "--curve-secret-key" in flat
    assert "Ctrl-C" in flat
    assert "spool off (no output configured)" in flat


def test_readme_durable_quick_start_runs_as_written(tmp_path):
    """The README's durable quick start line, as written (the test relay's ports and a state
    dir of its own added): the ready line says what the README quotes (the state dir
    swapped), and while the receiver cannot be reached a message is answered 202 and waits
    in the spool, in `logjam_relay_output_backlog_records` as the README says."""
    setup = _section("## Set-up on a fresh machine")
    quick = setup.split("**Durable quick start", 1)[1]
    line = next(ln for ln in _code_lines(quick) if ln.startswith("./run-relay "))
    quoted = re.search(r"The ready line now says `([^`]+)`", " ".join(quick.split()))[1]
    settings = relay_settings(tmp_path)
    state = settings.state_dir
    log = tmp_path / "relay.log"
    relay = start_process(settings, shlex.split(line)[1:], log_path=log)
    try:
        ready = next(ln for ln in log.read_text().splitlines() if " ready: " in ln)
        assert quoted.replace("/root/.local/state/logjam-relay", state) in ready, (quoted, ready)
        import zmq

        from logjam_relay.protocols import logjam as L
        ctx = zmq.Context()
        try:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://127.0.0.1:{settings.router_port}")
            dealer.send_multipart([b"", b"myapp-prod", b"logs.myapp.prod", b"{}",
                                   L.encode_meta(0, 0, int(time.time() * 1000), 1)])
            assert dealer.poll(30_000), "no reply"
            reply = b" ".join(dealer.recv_multipart())
            assert b"202 Accepted" in reply, reply
        finally:
            ctx.destroy(linger=0)
        deadline = time.monotonic() + 30
        while _metric(settings.metrics_port, "logjam_relay_output_backlog_records") < 1:
            assert time.monotonic() < deadline, "the message is not in the output's backlog"
            time.sleep(0.1)
    finally:
        stop_process(relay)


def test_pipeline_without_the_spark_extra_is_one_line():
    """In the operator's venv (no pyspark): one line naming the extra and the command that
    installs it, status 2, no traceback."""
    code = ("import sys; sys.modules['pyspark'] = None\n"
            "from logjam_relay.cli import main\n"
            "sys.exit(main(['pipeline', 'stats', '--input', sys.argv[1], '--output', "
            "sys.argv[2]]))")
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "tests"), "/nonexistent/out"],
                       capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "'spark' extra" in lines[0] and "pyspark" in lines[0]
    command = lines[0].split("install it with: ", 1)[1]
    assert "[spark]" in command and ("pip install" in command or "RELAY_EXTRAS=spark" in command)


def test_spark_install_command_names_run_relay_in_its_venv(tmp_path, monkeypatch):
    """In run-relay's venv the one line names run-relay's way (which keeps the extra for
    reinstalls); elsewhere pip with the source the package was installed from."""
    clone = tmp_path / "clone"
    (clone / ".venv" / "relay").mkdir(parents=True)
    (clone / "run-relay").write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "prefix", str(clone / ".venv" / "relay"))
    assert cli.spark_install_command() == f"RELAY_EXTRAS=spark {clone / 'run-relay'} --version"
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "elsewhere"))
    assert cli.spark_install_command().startswith(f"{sys.executable} -m pip install '")
    assert cli.spark_install_command().endswith("[spark]'")


def _fake_python(bin_dir: Path, log: Path) -> None:
    """A python3 whose `-m venv DIR` makes a venv of stand-ins: pip logs its arguments,
    logjam-relay echoes its own."""
    py = bin_dir / "python3"
    py.write_text(f"""#!/bin/sh
[ "$1 $2" = "-m venv" ] || exit 1
mkdir -p "$3/bin"
printf '#!/bin/sh\\necho "pip $*" >> {log}\\n' > "$3/bin/pip"
printf '#!/bin/sh\\necho "logjam-relay $*"\\n' > "$3/bin/logjam-relay"
chmod 755 "$3/bin/pip" "$3/bin/logjam-relay"
""")
    py.chmod(0o755)


def test_run_relay_keeps_the_extras_it_was_given(tmp_path):
    """`RELAY_EXTRAS=spark ./run-relay` installs the extra, and the documented reinstall
    (`rm -rf .venv/relay && ./run-relay`) installs it again without being told."""
    clone = tmp_path / "clone"
    clone.mkdir()
    shutil.copy2(ROOT / "run-relay", clone / "run-relay")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "pip.log"
    _fake_python(bin_dir, log)
    path = f"{bin_dir}:/usr/bin:/bin"

    def run(*args, **env):
        r = subprocess.run(["./run-relay", *args], cwd=clone, capture_output=True, text=True,
                           timeout=60, env={"PATH": path, **env})
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    def pip_calls():
        calls = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return calls

    base = f"pip install --quiet --disable-pip-version-check {clone}"
    assert run("-d", "7") == "logjam-relay -d 7"
    assert pip_calls() == [base], "the plain install: no extras, not editable"
    assert run() == "logjam-relay" and pip_calls() == [], "installed once"
    run("--version", RELAY_EXTRAS="spark")
    assert pip_calls() == [base + "[spark]"], "added to the existing venv"
    run()
    assert pip_calls() == [], "kept, not installed again"
    shutil.rmtree(clone / ".venv" / "relay")                   # the documented reinstall
    run()
    assert pip_calls() == [base + "[spark]"], "the reinstall dropped the extra"
    run(RELAY_EXTRAS="")
    shutil.rmtree(clone / ".venv" / "relay")
    run()
    assert pip_calls() == [base], "RELAY_EXTRAS= records no extras"
    r = subprocess.run(["./run-relay"], cwd=clone, capture_output=True, text=True,
                       timeout=60, env={"PATH": path, "RELAY_EXTRAS": "spark;rm -rf /"})
    assert r.returncode == 2 and "RELAY_EXTRAS" in r.stderr


# ------------------------------------------------------------------ 3. systemd

def test_readme_systemd_points_to_an_install_that_makes_what_the_unit_runs():
    """The unit's ExecStart binary and configuration, and its Documentation= files, are each
    made by a line of docs/operations.md's block, which the README points to; the README has
    no shorter form that skips them."""
    deploy = _section("## Deploy")
    item = next(b for b in deploy.split("\n* ") if "systemd" in b)
    assert "docs/operations.md#systemd" in item
    assert "systemctl enable" not in item.split("docs/operations.md#systemd")[0] or \
        "install -m 0644" not in item, "a short form that skips the binary and the config"
    ops = (ROOT / "docs" / "operations.md").read_text()
    block = ops.split("## systemd", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [ln for ln in block.splitlines() if ln.strip()]
    unit = (ROOT / "deploy" / "systemd" / "logjam-relay.service").read_text()
    exec_start = re.search(r"^ExecStart=(\S+) --config (\S+)$", unit, re.M)
    needed = [exec_start.group(1), exec_start.group(2), "/etc/systemd/system/"]
    needed += [d[len("file://"):].rsplit("/", 1)[0] for d in
               re.findall(r"^Documentation=(\S+)$", unit, re.M)]
    enable = next(i for i, ln in enumerate(lines) if "systemctl enable" in ln)
    for path in needed:
        makers = [i for i, ln in enumerate(lines) if path in ln and
                  ln.split()[0] in ("install", "ln", "python3", "mkdir")]
        assert makers and makers[0] < enable, f"nothing before `systemctl enable` makes {path}"
    # the binary the link points to is the one the venv line installs
    venv = re.search(r"python3 -m venv (\S+)", block).group(1)
    assert f"ln -sf {venv}/bin/logjam-relay {exec_start.group(1)}" in block
    assert "deploy/relay.toml" in next(ln for ln in lines if exec_start.group(2) in ln)


# ------------------------------------------------------------------ 4. defaults shown

def _help_entries(text: str) -> dict[str, str]:
    """--help: the long flag of each option -> its help text on one line."""
    out, flag = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        m = re.match(r"^  (-\S.*?)(?:  +(\S.*))?$", line)
        if m:
            flag = [f.split()[0] for f in m.group(1).split(", ")][-1]
            out[flag] = m.group(2) or ""
        elif flag and line.startswith("    "):
            out[flag] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in out.items()}


def _parse_shown(name: str, text: str):
    """A value as --check-config shows it, read back with the setting's own converter."""
    f = config.BY_NAME[name]
    conv = f.metadata["conv"]
    if text == "off":
        return None
    if text == "none":
        return []
    if conv is size or conv is duration:
        return conv(text)           # as printed: "40 MiB", "5 min" are valid values
    if f.metadata["metavar"] == "SECONDS":
        return duration(text)
    if name in RESOLVED and name.endswith("_dir"):
        return Path(text)
    return conv(text)


def test_help_shows_every_default():
    """Every option's help ends with its default: the value of the settings table (as an
    operator reads it) or, where the table's default stands for something else, what it
    stands for (``zmq_max_msg_bytes``: 40 MiB)."""
    entries = _help_entries(_cli("--help").stdout)
    defaults = config.Settings()
    for f in config.SETTING_FIELDS:
        text = entries[f.metadata["flags"][-1]]
        found = re.findall(r"\(default:? ([^)]*)\)", text)
        assert len(found) == 1, (f.name, text)
        if helptext.has_default_text(f.metadata["help"]):
            continue                # the help says what an unset value stands for
        shown = helptext.display_value(f.name, f.default_factory())
        assert found[0].split(", which is ")[0] == shown, (f.name, found[0], shown)
        if f.name in RESOLVED:
            assert found[0].endswith(
                "which is " + helptext.display_value(f.name, defaults.effective(f.name)))
    assert "(default: 10 MiB)" in entries["--max-event-bytes"]
    assert "40 MiB" in entries["--zmq-max-msg-bytes"]


@pytest.mark.parametrize("args", [[], ["--max-event-bytes", "1MiB", "--output",
                                      "lumberjack://h:5044?tls=off", "--cmdp-name", "r1"]],
                         ids=["defaults", "derived"])
def test_check_config_shows_what_the_relay_runs_with(tmp_path, args):
    """Each line of --check-config, read back through the setting's converter, is the value
    the relay runs with (the ``resolved_*`` method for a derived default): nothing shows a
    stand-in such as ``zmq_max_msg_bytes = 0 B``."""
    args = [*args, "--state-dir", str(tmp_path / "state")]
    r = _cli("--check-config", *args)
    assert r.returncode == 0, r.stderr
    lines = dict(ln.split(" = ", 1) for ln in r.stdout.splitlines())
    assert list(lines) == [f.name for f in config.SETTING_FIELDS]
    from logjam_relay.relay import configure
    parsed = {k: v for k, v in vars(cli.run_parser().parse_args(args)).items()
              if k != "check_config"}
    s = configure.load(parsed, environ={})
    extra = configure.subsystem_values(s)
    for name, line in lines.items():
        value, source = line.rsplit("  (", 1)
        assert source.rstrip(")") == s.source_label(name), (name, line)
        resolved = value.endswith(" (resolved)")
        value = value.removesuffix(" (resolved)")
        want = extra[name] if name in extra else s.effective(name)
        if name == "spool_dir" and want is None:
            assert value.startswith("off ("), line
            continue
        if value.startswith("unset: "):
            assert getattr(s, name) is None and name not in RESOLVED, line
            continue
        if name == "fqdn" or name == "cmdp_name":
            assert value == want, line
        else:
            assert _parse_shown(name, value) == want, (name, line, want)
        if resolved:
            assert getattr(s, name) in (None, 0) or name == "cmdp_name", line
    if args[0] == "--max-event-bytes":
        assert lines["zmq_max_msg_bytes"].startswith("4 MiB (resolved)")
    else:
        assert lines["zmq_max_msg_bytes"].startswith("40 MiB (resolved)")


# ------------------------------------------------------------------ 5. container cache

def test_container_base_is_cached_where_the_readme_says():
    """The README says where the suite's caches are kept between runs: the container
    test's Debian base, and conftest.py's cache of the JVM class archive beside it."""
    import conftest
    import container_image
    assert conftest.SUITE_CACHE == str(container_image.DEFAULT_CACHE)
    assert "`cache-<uid>`" in README
    if os.access(conftest.SUITE_CACHE, os.W_OK):
        assert os.environ["XDG_CACHE_HOME"] == \
            os.path.join(conftest.SUITE_CACHE, f"cache-{os.getuid()}")
    assert "LOGJAM_RELAY_TEST_DEBIAN_CACHE" not in os.environ or container_image.CACHE != \
        container_image.DEFAULT_CACHE
    assert f"`{container_image.DEFAULT_CACHE}`" in README
    if "LOGJAM_RELAY_TEST_DEBIAN_CACHE" not in os.environ:
        assert container_image.CACHE == container_image.DEFAULT_CACHE, \
            "the suite moved the Debian base's cache somewhere else"


# ------------------------------------------------------------------ 6. keygen

def test_main_help_says_what_keygen_makes():
    out = _cli("--help").stdout
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("keygen "))
    assert "CURVE key pair" in line and "certificate" not in line
    sub = _cli("keygen", "--help").stdout
    assert "CURVE key pair" in sub


# ------------------------------------------------------------------ 7. broken pipe

def _into_closed_pipe(argv, timeout=60, before_wait=None) -> tuple[int, str]:
    """Run ``logjam-relay ARGV`` with stdout a pipe whose reader has gone."""
    r, w = os.pipe()
    os.close(r)
    p = subprocess.Popen([sys.executable, "-m", "logjam_relay", *argv], stdout=w,
                         stderr=subprocess.PIPE, env=_env())
    os.close(w)
    if before_wait is not None:
        before_wait()
    try:
        _, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, err.decode(errors="replace")


def test_every_subcommand_exits_quietly_when_its_reader_goes_away(tmp_path):
    from logjam_relay.deadletter.store import DeadLetterStore
    from relay_harness import meta
    dl = DeadLetterStore(tmp_path / "dl")
    letter = dl.put("lj", "too_large", [b"app-env", b"logs", b"{}", meta()])
    dl.close()
    (tmp_path / "spool").mkdir()
    settings = relay_settings(tmp_path)
    relay = start_process(settings)
    router = f"tcp://127.0.0.1:{settings.router_port}"
    runs = {
        "run": ["--check-config"],
        "spool": ["spool", "fsck", str(tmp_path / "spool")],
        "deadletters": ["deadletters", "list", "--dir", str(tmp_path / "dl")],
        "deadletters show": ["deadletters", "show", "--dir", str(tmp_path / "dl"), "--id",
                             str(letter)],
        "keygen": ["keygen", str(tmp_path / "keys"), "relay"],
        "pipeline": ["pipeline", "package", str(tmp_path / "pkg.zip")],
        "send": ["send", "-c", router, "--sync", "-n", "3"],
        "tail": ["tail", "-c", f"tcp://127.0.0.1:{settings.pub_port}"],
    }
    assert {k.split()[0] for k in runs} == set(cli.SUBCOMMANDS)

    import threading
    stop_feeding = threading.Event()

    def feed_tail():            # tail prints (and finds its reader gone) once data flows
        while not stop_feeding.wait(0.2):
            subprocess.run([sys.executable, "-m", "logjam_relay", "send", "-c", router],
                           capture_output=True, timeout=60, env=_env())

    feeder = threading.Thread(target=feed_tail, daemon=True)
    try:
        for name, argv in runs.items():
            rc, err = _into_closed_pipe(argv, before_wait=feeder.start if name == "tail"
                                        else None)
            assert "Traceback" not in err and "Exception ignored" not in err, (name, err)
            assert rc == cli.EXIT_READER_GONE, (name, rc, err)
    finally:
        stop_feeding.set()
        if feeder.is_alive():
            feeder.join(60)
        stop_process(relay)


# ------------------------------------------------------------------ 8. log format

_TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \[[DIWEC]\] logjam_relay[\w.]*: ")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_relay_and_output_workers_log_in_one_format(tmp_path, fmt, port_factory):
    """The relay and its output worker processes (output_isolation=process) write every line
    in the configured format: a worker's failed connection to a dead receiver is logged
    like the relay's own lines."""
    settings = relay_settings(tmp_path)
    log = tmp_path / "relay.log"
    dead = port_factory()
    relay = start_process(settings, ["--log-format", fmt, "--output",
                                     f"lumberjack://127.0.0.1:{dead}?tls=off&name=lj"],
                          log_path=log)
    try:
        deadline = time.monotonic() + 30
        while b"connect to 127.0.0.1" not in log.read_bytes():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        stop_process(relay)
    lines = log.read_text().splitlines()
    assert lines
    worker_lines = 0
    for line in lines:
        if fmt == "json":
            d = json.loads(line)
            assert set(d) >= {"time", "level", "logger", "message"}, line
            worker_lines += d.get("worker") == "lj"
        else:
            assert _TEXT_LINE.match(line), line
            assert "worker]" not in line, line
    if fmt == "json":
        assert worker_lines, "no line from the output worker"
    connect = [ln for ln in lines if "connect to 127.0.0.1" in ln]
    assert connect, lines


# ------------------------------------------------------------------ 9. operator tools

def _readme_tool_lines() -> list[str]:
    tools = _section("## Operator tools")
    first = tools.split("The other tools:", 1)[0]
    return [ln.split("  #", 1)[0].strip() for ln in _code_lines(first)]


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_readme_operator_tools_work_together_in_a_newcomers_order(tmp_path):
    """The README's first tool lines, as written (only logjam-device's ports swapped for
    the test relay's), in their order: `tail` shows every message the `send` lines send."""
    lines = _readme_tool_lines()
    assert [ln.split()[:2] for ln in lines] == [["logjam-relay", "tail"]] + \
        [["logjam-relay", "send"]] * 3, lines
    settings = relay_settings(tmp_path)
    ports = {"9604": settings.router_port, "9605": settings.pull_port,
             "9606": settings.pub_port}

    def argv(line: str) -> list[str]:
        words = shlex.split(line)[1:]
        words = [re.sub(r":(9604|9605|9606)\b", lambda m: f":{ports[m.group(1)]}", w)
                 for w in words]
        if words[0] == "send" and "-c" not in words:      # the default: ROUTER 9604
            words += ["-c", f"tcp://127.0.0.1:{settings.router_port}"]
        return [sys.executable, "-m", "logjam_relay", *words]

    relay = start_process(settings, log_path=tmp_path / "relay.log")
    # the child's own descriptor: a reader's seek on a shared one would move where the
    # child writes (one file description, one offset) and overwrite lines
    out = open(tmp_path / "tail.out", "wb")
    tail = subprocess.Popen(argv(lines[0]), stdout=out, stderr=subprocess.STDOUT, env=_env())
    try:
        deadline = time.monotonic() + 30
        while _metric(settings.metrics_port, "logjam_relay_pub_subscriptions") < 1:
            assert tail.poll() is None and time.monotonic() < deadline, "tail never subscribed"
            time.sleep(0.05)
        replies = []
        for line in lines[1:]:
            r = subprocess.run(argv(line), capture_output=True, text=True, timeout=60,
                               env=_env())
            assert r.returncode == 0, (line, r.stdout, r.stderr)
            replies.append(r.stdout.strip())
        assert replies[0].endswith(": 10 x myapp-prod 202 Accepted"), replies
        assert replies[1] == "ping 200 OK vm", replies
        deadline = time.monotonic() + 30
        while True:
            shown = [ln for ln in (tmp_path / "tail.out").read_text().splitlines()
                     if ln.startswith("myapp-prod logs")]
            if len(shown) >= 1010 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{settings.metrics_port}/metrics",
                                    timeout=5) as r:      # for the message when it fails
            counts = [ln for ln in r.read().decode().splitlines() if re.match(
                r"logjam_relay_(messages|invalid|published|pub_drops|input_messages)", ln)]
    finally:
        tail.terminate()
        tail.wait(10)
        out.close()
        stop_process(relay)
    if len(shown) != 1010:      # what the relay counted and which sequence numbers are missing
        seqs = sorted(int(m.group(1)) for ln in shown if (m := re.search(r" seq=(\d+) ", ln)))
        print("\n".join(counts), "\nseqs shown:", seqs[:3], "...", seqs[-3:], "missing:",
              sorted(set(range(seqs[0], seqs[-1] + 1)) - set(seqs)) if seqs else None,
              "\nrelay log:", (tmp_path / "relay.log").read_text()[-3000:])
    assert len(shown) == 1010, f"tail showed {len(shown)} of 1010"
    assert sum("comp=lz4" in ln for ln in shown) == 10
    # each message a request of its own, as the README says: its own request_id, action,
    # code and times
    bodies = [json.loads(ln[ln.index("{"):]) for ln in shown]
    assert len({b["request_id"] for b in bodies}) == 1010, shown[:2]
    assert len({b["action"] for b in bodies}) > 1 and len({b["code"] for b in bodies}) > 1
    assert len({b["started_ms"] for b in bodies}) > 1


# ------------------------------------------------------------------ 10. settings table

def test_readme_settings_table_names_every_setting_and_only_settings():
    table = _section("### Configuration").split("| setting (flag) |", 1)[1]
    rows = [ln for ln in table.splitlines() if ln.startswith("| `")]
    named, flags = set(), set()
    for row in rows:
        first = row.split(" | ", 1)[0]
        named |= set(re.findall(r"`([a-z_]+)`", first))
        flags |= set(re.findall(r"`(-[-\w.]+)", first))
    known = {f.name for f in config.SETTING_FIELDS}
    assert known - named == set(), "settings missing from the README table"
    assert named - known == set(), "the README table names what is not a setting"
    all_flags = {fl for f in config.SETTING_FIELDS for fl in f.metadata["flags"]}
    assert flags - all_flags == set(), "flags in the README table that --help does not know"


# ------------------------------------------------------------------ what .ci/run costs

def test_readme_names_what_ci_run_installs():
    """Every package `.ci/run` installs is named in the README's cost paragraph, and the
    Prometheus script installs no package (only the two binaries it takes out of one)."""
    ci = (ROOT / ".ci" / "run").read_text()
    packages = {p for line in re.findall(r"^\s*apt_install (.+)$", ci, re.M)
                for p in line.split()}
    assert {"podman", "rabbitmq-server", "gcc"} <= packages
    cost = _section("## Set-up on a fresh machine").split("What it costs.", 1)[1]
    cost = cost.split("What some tests need", 1)[0]
    named = set(re.findall(r"[a-z0-9][a-z0-9.+-]+", cost))
    assert packages - named == set(), "installed by .ci/run, not named in the README"
    prom = (ROOT / ".ci" / "install-prometheus.sh").read_text()
    commands = [ln for ln in prom.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert not [ln for ln in commands if "apt-get install" in ln or "systemctl" in ln]
    assert any("apt-get download" in ln for ln in commands)
    assert "TODO-LEAD" in cost or re.search(r"\d+ min", cost), "the suite's time"
