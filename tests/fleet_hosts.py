"""Hosts as network namespaces on one bridge, for the fleet test and bench.

Each host is a network namespace with a veth pair into a switch namespace that holds a
bridge; the test process itself gets a leg on the bridge too (``198.18.0.1``), so it
reaches every host by address while each host's processes bind logjam-device's default
ports without colliding with anything else on the machine.  Addresses are taken from
198.18.0.0/24 (RFC 2544's benchmarking range): they exist only inside these namespaces.
A host's link can be taken down and up (``down``/``up``): its peers see a network cut.

Needs root and iproute2 (``ip``); :func:`available` says why not otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess

NET = "198.18.0"


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns does not work here: {r.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


class Hosts:
    """``with Hosts() as h: ip = h.add("edge1"); h.popen("edge1", argv)``."""

    def __init__(self, tag: str | None = None):
        self.tag = tag or f"{os.getpid() % 0xFFFF:04x}"
        self.switch = f"lj{self.tag}sw"
        self.hosts: dict[str, tuple[str, str, str]] = {}   # name -> (netns, if, ip)
        self.procs: list[subprocess.Popen] = []
        #: the hosts whose link is down
        self.cut: set[str] = set()
        self._root_if = f"lj{self.tag}r"

    # ------------------------------------------------------------------ set-up
    def __enter__(self) -> Hosts:
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            _ip("-n", self.switch, "link", "set", "lo", "up")
            # the test process's own leg on the bridge
            _ip("link", "add", self._root_if, "type", "veth", "peer", "name", "sroot",
                "netns", self.switch)
            _ip("addr", "add", f"{NET}.1/24", "dev", self._root_if)
            _ip("link", "set", self._root_if, "up")
            _ip("-n", self.switch, "link", "set", "sroot", "master", "br0")
            _ip("-n", self.switch, "link", "set", "sroot", "up")
        except BaseException:
            self.close()
            raise
        return self

    def add(self, name: str) -> str:
        """A new host on the bridge; returns its address."""
        i = len(self.hosts) + 1
        ns, hif, sif = f"lj{self.tag}{name}", f"h{self.tag}{i}", f"s{self.tag}{i}"
        addr = f"{NET}.{10 + i}"
        _ip("netns", "add", ns)
        self.hosts[name] = (ns, hif, addr)
        _ip("link", "add", hif, "netns", ns, "type", "veth", "peer", "name", sif, "netns",
            self.switch)
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", hif)
        _ip("-n", ns, "link", "set", hif, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "set", sif, "master", "br0")
        _ip("-n", self.switch, "link", "set", sif, "up")
        return addr

    def addr(self, name: str) -> str:
        return self.hosts[name][2]

    # ------------------------------------------------------------------ use
    def popen(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        """``argv`` run on host ``name`` (in its namespace)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.hosts[name][0], *argv], **kw)
        self.procs.append(p)
        return p

    def run(self, name: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.hosts[name][0], *argv], **kw)

    def down(self, name: str) -> None:
        """Cut the host off the network (its link down)."""
        ns, hif, _ = self.hosts[name]
        _ip("-n", ns, "link", "set", hif, "down")
        self.cut.add(name)

    def up(self, name: str) -> None:
        ns, hif, addr = self.hosts[name]
        _ip("-n", ns, "link", "set", hif, "up")
        self.cut.discard(name)

    # ------------------------------------------------------------------ tear-down
    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for ns, _hif, _addr in self.hosts.values():
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self._root_if, check=False)
        _ip("netns", "del", self.switch, check=False)

    def __exit__(self, *exc) -> None:
        self.close()
