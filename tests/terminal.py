"""Run a command with its standard error on a pseudo-terminal (what a person at a terminal
has) and its standard output on a pipe: for the tests of progress lines (tests/test_progress.py,
tests/test_pipeline_report.py)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import termios
import threading


def run_on_terminal(cmd, *, env=None, cwd=None, timeout: float = 600, cols: int = 160,
                    rows: int = 40) -> tuple[int, bytes, bytes]:
    """(exit status, stdout, what was written to the terminal) of ``cmd``."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    try:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=slave, env=env, cwd=cwd)
    finally:
        os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                b = os.read(master, 65536)
            except OSError:         # EIO: every holder of the terminal has closed it
                return
            if not b:
                return
            chunks.append(b)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    finally:
        t.join(timeout=30)
        os.close(master)
    return p.returncode, out, b"".join(chunks)
