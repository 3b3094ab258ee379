"""Helpers to run a relay in-process (trio) or as a subprocess, with real sockets."""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

import trio
import zmq

from conftest import free_port
from logjam_relay import config
from logjam_relay.io import zmq_trio
from logjam_relay.relay.service import build


def meta(tag=0xCABD, comp=0, ver=1, dev=0, created=1700000000123, seq=1) -> bytes:
    return struct.pack(">HBBIQQ", tag, comp, ver, dev, created, seq)


def unmeta(frame: bytes):
    return struct.unpack(">HBBIQQ", frame)


def relay_settings(tmp_path, **overrides) -> config.Settings:
    args = {
        "router_port": free_port(), "pull_port": free_port(), "pub_port": free_port(),
        "stats_port": free_port(), "metrics_port": free_port(), "metrics_ip": "127.0.0.1",
        "bind": "127.0.0.1", "state_dir": str(tmp_path / "state"), "fqdn": "vm",
        "heartbeat_interval": 0.2, "stats_interval": 0.2,
    }
    args.update(overrides)
    return config.load(args, environ={})


@dataclass
class Clients:
    ctx: zmq.Context
    settings: config.Settings

    def dealer(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{self.settings.router_port}")
        return s

    def push(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 1000)
        s.connect(f"tcp://127.0.0.1:{self.settings.pull_port}")
        return s

    def sub(self, topic: bytes = b"", port: int | None = None) -> zmq.Socket:
        s = self.ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.SUBSCRIBE, topic)
        s.connect(f"tcp://127.0.0.1:{port or self.settings.pub_port}")
        return s


async def recv(sock: zmq.Socket, timeout: float = 5.0) -> list[bytes]:
    with trio.fail_after(timeout):
        return await zmq_trio.recv_multipart(sock)


async def send(sock: zmq.Socket, frames: list[bytes]) -> None:
    with trio.fail_after(5):
        await zmq_trio.send_multipart(sock, frames)


async def nothing_within(sock: zmq.Socket, seconds: float) -> bool:
    with trio.move_on_after(seconds):
        await zmq_trio.recv_multipart(sock)
        return False
    return True


async def sync_sub(sub: zmq.Socket, timeout: float = 5.0) -> list[bytes]:
    """Wait for the first heartbeat: the subscription is then in place."""
    with trio.fail_after(timeout):
        while True:
            m = await zmq_trio.recv_multipart(sub)
            if m[0] == b"heartbeat":
                return m


async def next_data(sub: zmq.Socket, timeout: float = 5.0) -> list[bytes]:
    """The next published message that is not a heartbeat."""
    with trio.fail_after(timeout):
        while True:
            m = await zmq_trio.recv_multipart(sub)
            if m[0] != b"heartbeat":
                return m


@contextlib.asynccontextmanager
async def running_relay(tmp_path, **overrides):
    settings = relay_settings(tmp_path, **overrides)
    relay = build(settings)
    ctx = zmq.Context()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(relay.run)
            yield relay, Clients(ctx, settings)
            relay.shutdown()
            with trio.fail_after(5):
                await relay.stopped.wait()
    finally:
        ctx.destroy(linger=0)


# ------------------------------------------------------------------ subprocess

def relay_argv(settings: config.Settings, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "logjam_relay",
            "-t", str(settings.router_port), "-p", str(settings.pull_port),
            "-P", str(settings.pub_port), "-s", str(settings.stats_port),
            "-m", str(settings.metrics_port), "-M", "127.0.0.1", "--bind", "127.0.0.1",
            "--state-dir", settings.state_dir, "--fqdn", "vm", "-d", str(settings.device_id),
            "--heartbeat-interval", str(settings.heartbeat_interval), *extra]


def start_process(settings: config.Settings, extra: list[str] = (), log_path=None,
                  env_extra: dict | None = None):
    env = dict(os.environ)
    env.pop("LOGJAM_RELAY_CONFIG", None)
    env.update(env_extra or {})
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(relay_argv(settings, extra), env=env, stdout=out, stderr=out)
    wait_http(settings.metrics_port, proc)
    return proc


def wait_http(port: int, proc=None, timeout: float = 60.0) -> None:
    """Until the relay on ``port`` answers ``/readyz`` 200 (it exited: RuntimeError).  The
    wait is long: on a machine busy with other work a start took over 15 s (two relays of
    tests/test_metrics_docs.py beside two busy loops, load 9); no test measures it."""
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"relay exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("relay did not become ready")


def stop_process(proc, sig=signal.SIGTERM, timeout: float = 10.0) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout)
