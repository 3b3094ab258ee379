"""Secrets never printed: --check-config, log lines, CMDP LOG records; credentials from files."""

import logging
import subprocess
import sys

import pytest
import trio
import zmq
from constellation.core.message.cmdp1 import CMDP1LogMessage, CMDP1Message

from conftest import free_port
from logjam_relay import config
from logjam_relay.io import zmq_trio
from logjam_relay.redact import (
    install_log_redaction,
    redact_exceptions,
    redact_setting,
    redact_text,
)
from logjam_relay.samwise.config import parse_broker
from relay_harness import running_relay

logging.addLevelName(logging.ERROR, "ERROR")  # undo constellation's global rename
logging.setLoggerClass(logging.Logger)

PW = "s3cretpw-Zq7"


def _cli(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "logjam_relay", *args], capture_output=True,
                          text=True, timeout=timeout, env={"PATH": "/usr/bin:/bin"})


def test_redact_text_and_settings():
    assert redact_text(f"a=amqp://guest:{PW}@h:5672/%2F") == "a=amqp://guest:***@h:5672/%2F"
    assert redact_text(f"['x=amqps://u:p@ss{PW}@h/v']") == "['x=amqps://u:***@h/v']"
    assert redact_text(f"courier://h:1?tls=on&token={PW}&a=1") == \
        "courier://h:1?tls=on&token=***&a=1"
    assert redact_text("mail me at a@b.c, a=b") == "mail me at a@b.c, a=b"
    assert redact_setting("amqp_password", PW) == "***"
    assert redact_setting("amqp_brokers_file", "/etc/x") == "/etc/x"
    assert redact_setting("amqp_brokers", [f"a=amqp://u:{PW}@h"]) == ["a=amqp://u:***@h"]


def test_check_config_prints_no_password(tmp_path):
    r = _cli("--check-config", "--samwise", f"tcp://127.0.0.1:{free_port()}",
             "--amqp-broker", f"a=amqp://guest:{PW}@127.0.0.1:5672/%2F",
             "--state-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert PW not in r.stdout + r.stderr
    assert "amqp://guest:***@127.0.0.1:5672/%2F" in r.stdout


def test_config_error_prints_no_password(tmp_path):
    # a bad broker name: the error message quotes the argument, password masked
    r = _cli("--check-config", "--samwise", f"tcp://127.0.0.1:{free_port()}",
             "--amqp-broker", f"bad name=amqp://guest:{PW}@127.0.0.1:5672/%2F")
    assert r.returncode == 2
    assert "broker name" in r.stderr and "***" in r.stderr
    assert PW not in r.stdout + r.stderr


def test_brokers_file_and_password_file(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text(PW + "\n")
    bf = tmp_path / "brokers"
    bf.write_text(f"# brokers\nb1=amqp://relay@127.0.0.1:5672/%2F?password_file={pw}\n\n"
                  f"b2=amqp://guest:{PW}@127.0.0.1:5673/v\n")
    s = config.load({"samwise": [f"tcp://127.0.0.1:{free_port()}"],
                     "amqp_brokers_file": str(bf)}, environ={})
    assert [b.split("=")[0] for b in s.amqp_brokers] == ["b1", "b2"]
    b = parse_broker(s.amqp_brokers[0])
    assert (b.user, b.password, b.host) == ("relay", PW, "127.0.0.1")
    assert PW not in repr(b)
    with pytest.raises(ValueError, match="password_file"):
        parse_broker(f"x=amqp://u:p@h/?password_file={pw}")        # both given
    with pytest.raises(ValueError, match="password_file .*No such file"):
        parse_broker(f"x=amqp://u@h/?password_file={tmp_path}/missing")
    with pytest.raises(config.ConfigError, match="amqp_brokers_file .*No such file"):
        config.load({"amqp_brokers_file": str(tmp_path / "nope")}, environ={})
    # through the command: --check-config shows the file setting, never the password
    r = _cli("--check-config", "--samwise", f"tcp://127.0.0.1:{free_port()}",
             "--amqp-brokers-file", str(bf))
    assert r.returncode == 0, r.stderr
    assert PW not in r.stdout and "b2=amqp://guest:***@" in r.stdout


def test_relay_log_lines_show_no_password(tmp_path):
    """A real relay whose broker refuses the (wrong) password logs the failure, masked."""
    ports = [free_port() for _ in range(5)]
    p = subprocess.Popen(
        [sys.executable, "-m", "logjam_relay", "-v", "--bind", "127.0.0.1",
         "-t", str(ports[0]), "-p", str(ports[1]), "-P", str(ports[2]), "-s", str(ports[3]),
         "-m", "0", "--state-dir", str(tmp_path), "--samwise", f"tcp://127.0.0.1:{ports[4]}",
         "--amqp-broker", f"bad=amqp://guest:{PW}@127.0.0.1:5672/%2F"],
        stderr=subprocess.PIPE, text=True)
    try:
        import time
        time.sleep(3)       # a few connection attempts with backoff
    finally:
        p.terminate()
        err = p.communicate(timeout=15)[1]
    assert "ready" in err, err
    # the broker's refusal of the password was logged (the path under test) ...
    assert "samwise broker bad: refused" in err and "ACCESS_REFUSED" in err, err
    assert PW not in err                # ... the password never


async def test_cmdp_log_records_are_redacted(tmp_path):
    install_log_redaction()
    port = free_port()
    async with running_relay(tmp_path, cmdp_port=port, cmdp_name="relay.sec",
                             chirp_interface="127.0.0.1"):
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"LOG/")
        sub.connect(f"tcp://127.0.0.1:{port}")
        try:
            lg = logging.getLogger("logjam_relay.outputs.test")
            with trio.fail_after(10):
                while True:
                    lg.warning("cannot reach %s", f"amqp://guest:{PW}@10.0.0.1/")
                    with trio.move_on_after(0.3):
                        frames = await zmq_trio.recv_multipart(sub)
                        m = CMDP1LogMessage.from_cmdp_message(CMDP1Message.disassemble(frames))
                        if "cannot reach" in m.log_message:
                            break
            assert m.log_message == "cannot reach amqp://guest:***@10.0.0.1/"
        finally:
            ctx.destroy(linger=0)


def test_tracebacks_are_redacted_too():
    f = redact_exceptions(logging.Formatter("%(message)s"))
    try:
        raise ConnectionError(f"cannot connect to amqp://guest:{PW}@10.0.0.1/")
    except ConnectionError:
        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    out = f.format(rec)
    assert "amqp://guest:***@10.0.0.1/" in out and PW not in out


def test_a_record_logged_while_formatting_another_neither_recurses_nor_leaks():
    """The redacting factory formats a record's message when it is created; an argument
    whose __str__ logs would make it recurse until RecursionError.  The inner record keeps
    only its format string (redacted), the outer one is formatted once."""
    install_log_redaction()
    seen: list[tuple[str, object]] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.name, record.msg))

    calls = []

    class Loud:
        def __str__(self):
            calls.append(1)
            logging.getLogger("secrets.inner").warning(
                f"loud amqp://guest:{PW}@10.0.0.1/ %s", self)
            return "loud"

    lg = logging.getLogger("secrets")
    h = Keep()
    lg.addHandler(h)
    old = lg.propagate
    lg.propagate = False
    try:
        logging.getLogger("secrets.outer").warning("value %s", Loud())
    finally:
        lg.removeHandler(h)
        lg.propagate = old
    assert len(calls) == 1
    assert seen == [("secrets.inner", "loud amqp://guest:***@10.0.0.1/ %s"),
                    ("secrets.outer", "value loud")]
