"""Progress of long commands: a line on a terminal, nothing when piped.

The class (:mod:`logjam_relay.progress`) with a fake terminal and a fake clock, then the
real commands `logjam-relay spool fsck` and `logjam-relay deadletters resend`, each run
twice: with standard error on a pseudo-terminal (the progress line is drawn, and erased)
and piped (not one byte of it; standard output the same in both runs).  `pipeline stats`
is run both ways in tests/test_pipeline_report.py (it needs Spark).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading

from conftest import free_port
from logjam_relay.progress import ERASE, Progress
from terminal import run_on_terminal

CMD = [sys.executable, "-m", "logjam_relay"]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_progress_on_a_terminal_is_throttled_and_erased():
    term, clock = FakeTerminal(), Clock()
    p = Progress("fsck", total=10, unit="files", stream=term, clock=clock, interval=0.5)
    assert p.enabled
    p.update(1)                                   # the first update is always drawn
    assert term.getvalue() == ERASE + "fsck: 1/10 files (10 %) · 0.0 s"
    clock.t += 0.1
    p.update(2)                                   # within the interval: not drawn
    assert term.getvalue().count(ERASE) == 1
    clock.t += 0.5
    p.update(3, note="segment 3")
    assert term.getvalue().endswith(ERASE + "fsck: 3/10 files (30 %) · 0.6 s · segment 3")
    p.print("a line of output", file=term)        # erases the progress line first
    assert term.getvalue().endswith(ERASE + "a line of output\n")
    p.update(10, note="")
    p.close()
    assert term.getvalue().endswith(ERASE + "fsck: 10/10 files (100 %) · 0.6 s" + ERASE)
    n = len(term.getvalue())
    p.close()                                     # once only
    p.update(11)
    assert len(term.getvalue()) == n


def test_progress_when_piped_writes_nothing():
    out = io.StringIO()                           # isatty() is False
    p = Progress("fsck", total=3, stream=out)
    assert not p.enabled
    for i in range(4):
        p.update(i, note="x")
    p.clear()
    p.close()
    assert out.getvalue() == ""


def test_progress_line_fits_the_terminal(tmp_path):
    import fcntl
    import pty
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 30, 0, 0))
    try:
        with open(slave, "w", closefd=False) as tty:
            p = Progress("a long label", stream=tty)
            p.update(123456, note="a note that is far too long for thirty columns")
            drawn = os.read(master, 4096).decode()
    finally:
        os.close(slave)
        os.close(master)
    line = drawn.split(ERASE)[-1]
    assert len(line) < 30 and line.endswith("…") and line.startswith("a long label: 123,456")


# ------------------------------------------------------------------- spool fsck

def _spool(tmp_path):
    from logjam_relay.spool.spool import Spool
    d = tmp_path / "spool"
    sp = Spool(str(d), readers=["out"], segment_bytes=8192, fsync="never", max_bytes=1 << 30)
    try:
        for _ in range(12):
            sp.append_batch([[b"app-env", b"logs", b"x" * 200, b"m" * 24]] * 50)
        sp.seal()
    finally:
        sp.close()
    return d


def test_spool_fsck_progress_on_a_terminal_only(tmp_path):
    d = _spool(tmp_path)
    files = len(os.listdir(d))
    assert files > 10
    piped = subprocess.run(CMD + ["spool", "fsck", str(d)], capture_output=True)
    assert piped.returncode == 0, piped.stderr
    assert piped.stderr == b""                    # nothing at all on stderr
    rc, out, term = run_on_terminal(CMD + ["spool", "fsck", str(d)])
    assert rc == 0, term
    assert out == piped.stdout                    # the report itself is unchanged
    text = term.decode()
    assert f"spool fsck: {files}/{files} files (100 %)" in text     # the final figures
    assert text.startswith(ERASE) and text.endswith(ERASE)          # drawn, then erased


# ------------------------------------------------------------------- deadletters resend

def test_deadletters_resend_progress_on_a_terminal_only(tmp_path):
    import zmq

    from logjam_relay.deadletter import DeadLetterStore
    st = DeadLetterStore(tmp_path / "dl")
    n = 40
    for i in range(n):
        st.put("lj", "refused", [b"app-env", b"logs", b'{"i":%d}' % i, bytes(24)])
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = free_port()
    pull.bind(f"tcp://127.0.0.1:{port}")
    got: list[list[bytes]] = []
    stop = threading.Event()

    def receive() -> None:
        pull.setsockopt(zmq.RCVTIMEO, 100)
        while not stop.is_set():
            try:
                got.append(pull.recv_multipart())
            except zmq.Again:
                continue

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    cmd = CMD + ["deadletters", "resend", "--dir", str(tmp_path / "dl"),
                 "--to", f"tcp://127.0.0.1:{port}", "--timeout", "30"]
    try:
        piped = subprocess.run(cmd, capture_output=True)
        rc, out, term = run_on_terminal(cmd)
    finally:
        stop.set()
        t.join()
        ctx.destroy(linger=0)
    assert piped.returncode == 0 and rc == 0, (piped.stderr, term)
    assert piped.stderr == b""
    assert out == piped.stdout == f"resent {n} of {n} dead letter(s) to tcp://127.0.0.1:{port}\n".encode()
    text = term.decode()
    assert f"deadletters resend: {n}/{n} letters (100 %)" in text and text.endswith(ERASE)
    assert len(got) == 2 * n
