"""Out of file descriptors: silent ZeroMQ connections are dropped, new ones refused.

libzmq accepts every connection on a bound socket on its own thread, with no cap: a flood
of idle TCP connections takes every descriptor the process may open, and libzmq then
retries ``accept`` at once, spinning, for as long as more wait -- taking every number that
is freed, before the relay can.  The relay's own files are covered by the fd reserve
(:mod:`logjam_relay.fdreserve`); this guard gives numbers back and keeps libzmq from
taking them.

Every ``period`` seconds (:meth:`FdGuard.run`) it takes back slots of the reserve that were
lost and counts the open descriptors (``/proc/self/fd``, in a worker thread; a count that
fails with ``EMFILE`` means all of them) against the soft ``RLIMIT_NOFILE`` -- every 10th
look only while the descriptor table (``FDSize``) ends below the top ``band`` numbers, which
are then all free.  While fewer than ``band`` are free:

* every TCP connection on a ZeroMQ port (``ports()``: port -> socket name) that has not
  received a single byte in ``silent_after`` seconds is disconnected (``shutdown`` and a
  TCP abort; libzmq sees the connection end and closes its descriptor): a ZeroMQ peer
  sends its greeting at once, so it is not one.  It is checked again on the relay's thread
  right before (the same local port, peer, and nothing received): libzmq may have closed
  it and reused the number meanwhile.  Counted as ``silent``;
* if that did not free ``band`` descriptors, the ZeroMQ listening sockets are *paused*: a
  socket filter that drops every incoming packet is attached to each (``SO_ATTACH_FILTER``;
  connections made before keep working), so new connection attempts go unanswered (the
  peers retry), and the connections already waiting in their accept queues are taken and
  closed through the fd reserve (counted as ``accept``; never below three quarters of the
  reserve, and only while libzmq does not take the numbers first).  libzmq then has nothing left to
  accept and stops spinning.  The filters come off once ``2 x band`` descriptors are free.

Each look first takes back the numbers the reserve lost to libzmq (its accept was quicker
than the relay's open): the connection accepted into such a number came while the relay
was out of descriptors and is dropped (counted as ``accept``), so the number comes free.
Each step is reported in a rate-limited log line.  Peers that did send their greeting are
never dropped here: bounding them is the ZAP handler's job (docs/operations.md, "Open
files").  Linux only (``/proc``, ``TCP_INFO``, socket filters); elsewhere the guard only
refills the reserve.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import stat
import struct
from collections import Counter
from collections.abc import Callable

import trio

from ..fdreserve import RESERVE, FdReserve
from ..ratelimit import RateLimitedLog
from .net import tcp_abort

log = logging.getLogger("logjam_relay.fdguard")

_TCP_ESTABLISHED = 1
_TCP_LISTEN = 10
# struct tcp_info (linux/tcp.h): tcpi_last_data_recv (ms) and tcpi_bytes_received (>= 4.1)
_LAST_DATA_RECV = struct.Struct("=I")
_LAST_DATA_RECV_AT = 52
_BYTES_RECEIVED = struct.Struct("=Q")
_BYTES_RECEIVED_AT = 128
_TCP_INFO_LEN = 136
_SOCKETS = hasattr(socket, "TCP_INFO") and os.path.isdir("/proc/self/fd")


def _drop_all_filter():
    """``SO_ATTACH_FILTER``'s argument for a classic BPF program that drops every packet
    (``ret #0``), or None where ctypes is missing."""
    try:
        import ctypes
    except ImportError:                         # pragma: no cover
        return None

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte),
                    ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    prog = (SockFilter * 1)(SockFilter(0x06, 0, 0, 0))      # BPF_RET | BPF_K, 0
    fprog = SockFprog(1, ctypes.cast(prog, ctypes.POINTER(SockFilter)))
    _keep.append(prog)                          # the kernel reads it at every attach
    return bytes(fprog)


_keep: list = []
_DROP_ALL = _drop_all_filter()
SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
SO_DETACH_FILTER = getattr(socket, "SO_DETACH_FILTER", 27)


def soft_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def table_size() -> int | None:
    """The size of the process's descriptor table (``FDSize``: above the highest open
    descriptor; it never shrinks), or None."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"FDSize:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def open_fds() -> list[int] | None:
    """The open descriptors, or None when listing them needs one more than is left."""
    try:
        return [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return None


def classify(fd: int, ports, silent_ms: int):
    """What ``fd`` is to the guard, never closing it, for a TCP socket on one of ``ports``:
    ``("listener", port, None)``, ``("silent", port, peer)`` for an established connection
    that has received nothing for ``silent_ms`` ms, ``("conn", port, peer)`` for another
    established one, ``("ending", port, None)`` for one that is not established any more;
    None for anything else (a free number, a file, another socket)."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
            return None
        port = s.getsockname()[1]
        if port not in ports:
            return None
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        if len(info) < _TCP_INFO_LEN:
            return None
        if info[0] == _TCP_LISTEN:
            return "listener", port, None
        if info[0] != _TCP_ESTABLISHED:
            return "ending", port, None
        if _BYTES_RECEIVED.unpack_from(info, _BYTES_RECEIVED_AT)[0] or \
                _LAST_DATA_RECV.unpack_from(info, _LAST_DATA_RECV_AT)[0] < silent_ms:
            return "conn", port, s.getpeername()
        return "silent", port, s.getpeername()
    except (OSError, IndexError, TypeError):
        return None
    finally:
        s.detach()


def scan(fds, ports, silent_ms: int) -> list[tuple[str, int, int, object]]:
    """``(kind, fd, port, peer)`` of the listeners and silent connections among ``fds``
    (run in a worker thread)."""
    out = []
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
        except OSError:
            continue
        hit = classify(fd, ports, silent_ms)
        if hit is not None and hit[0] in ("listener", "silent"):
            out.append((hit[0], fd, hit[1], hit[2]))
    return out


def drop(fd: int, port: int, peer, ports, silent_ms: int, kind: str = "silent") -> bool:
    """Disconnect ``fd`` if it still is that connection (of that ``kind``; run on the relay's
    thread)."""
    if classify(fd, ports, silent_ms) != (kind, port, peer):
        return False
    s = socket.socket(fileno=fd)
    try:
        s.shutdown(socket.SHUT_RDWR)
        if tcp_abort is not None:
            tcp_abort(fd)
        return True
    except OSError:
        return False
    finally:
        s.detach()


def set_paused(fd: int, port: int, ports, paused: bool) -> bool:
    """Attach (or detach) the drop-everything filter to ``fd`` if it still is the
    listening socket on ``port``."""
    if _DROP_ALL is None or classify(fd, ports, 0) != ("listener", port, None):
        return False
    s = socket.socket(fileno=fd)
    try:
        if paused:
            s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, _DROP_ALL)
        else:
            s.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
        return True
    except OSError:
        return False
    finally:
        s.detach()


class FdGuard:
    def __init__(self, ports: Callable[[], dict[int, str]], *, reserve: FdReserve = RESERVE,
                 period: float = 0.5, silent_after: float = 1.0, band: int | None = None):
        self.ports = ports
        self.reserve = reserve
        self.period = period
        self.silent_ms = int(silent_after * 1000)
        self._band = band
        self.enabled = _SOCKETS
        self._rlog = RateLimitedLog(log)
        self._paused: dict[int, int] = {}       # listener fd -> port, filter attached
        # figures (exported as metrics)
        self.limit = soft_limit()
        self.open = 0                  # descriptors open at the last count
        self._looks = 0
        self.short = 0                 # looks that found fewer than band free
        self.pauses = 0                # times the ZeroMQ listeners were paused
        self.dropped: Counter[str] = Counter()     # socket name -> silent connections dropped
        self.refused: Counter[str] = Counter()     # socket name -> closed at accept (paused)

    @property
    def band(self) -> int:
        """Free descriptors below which the guard acts."""
        if self._band is not None:
            return self._band
        return max(self.reserve.size + 8, min(self.limit // 16, 1024))

    @property
    def paused(self) -> bool:
        return bool(self._paused)

    def stats(self) -> dict:
        return {"limit": self.limit, "open": self.open, "short": self.short,
                "pauses": self.pauses, "paused": int(self.paused),
                "dropped": dict(self.dropped), "refused": dict(self.refused),
                "reserve": self.reserve.stats()}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                await trio.sleep(self.period)
                await self.check()
        finally:
            self._resume(self.ports())

    async def _free(self) -> tuple[int, list[int] | None]:
        self.limit = soft_limit()
        fds = await trio.to_thread.run_sync(open_fds)
        self.open = self.limit if fds is None else len(fds)
        return self.limit - self.open, fds

    async def check(self) -> None:
        """One look (see the module's doc)."""
        if self.reserve.refill() >= self.reserve.size:
            self.reserve.forget()       # numbers are free again: nothing to take back
        elif self.enabled:
            self._reclaim()
            self.reserve.refill()
        if not self.enabled:
            return
        self._looks += 1
        # listing /proc/self/fd costs ~3 us a descriptor: while the table is below the top
        # band every number there is free, so it is counted only every 10th look
        size = table_size()
        if size is not None and size <= soft_limit() - self.band and not self._paused \
                and self._looks % 10:
            return
        free, fds = await self._free()
        ports = self.ports()
        if self._paused and free >= 2 * self.band:
            self._resume(ports)
            self._rlog.warning("fds_back", "file descriptors free again (%d of %d open): "
                               "ZeroMQ sockets accept connections again", self.open,
                               self.limit)
            return
        if free >= self.band or not ports:
            return
        self.short += 1
        found = await trio.to_thread.run_sync(
            scan, range(self.limit) if fds is None else fds, ports, self.silent_ms)
        dropped: Counter[str] = Counter()
        for i, (kind, fd, port, peer) in enumerate(found):
            if kind == "silent" and drop(fd, port, peer, ports, self.silent_ms):
                dropped[ports[port]] += 1
            if i % 256 == 255:
                await trio.lowlevel.checkpoint()
        self.dropped.update(dropped)
        n = sum(dropped.values())
        if n:
            await trio.sleep(0.05)      # libzmq closes what was dropped
            free, fds = await self._free()
        if free < self.band and not self._paused:
            for kind, fd, port, _ in found:
                if kind == "listener" and set_paused(fd, port, ports, True):
                    self._paused[fd] = port
            if self._paused:
                self.pauses += 1
        refused = await self._drain(ports) if self._paused else Counter()
        self.reserve.refill()
        what = []
        if n:
            what.append(f"dropped {n} connection(s) that sent nothing for "
                        f"{self.silent_ms / 1000:.0f} s ({_names(dropped)})")
        if self._paused:
            what.append("ZeroMQ sockets take no new connections "
                        f"({_names(Counter(ports[p] for p in self._paused.values()))})")
        if refused:
            what.append(f"closed {sum(refused.values())} waiting connection(s) "
                        f"({_names(refused)})")
        self._rlog.warning("out_of_fds", "out of file descriptors (%d of %d open, fd reserve "
                           "%d of %d): %s", self.open, self.limit, self.reserve.held,
                           self.reserve.size, "; ".join(what) or "nothing to drop")

    def _reclaim(self) -> None:
        """The reserve is short and no number is free: the numbers it gave up that libzmq
        took meanwhile (its accept was quicker than the relay's open) hold connections
        accepted while the relay was out of descriptors; they are dropped, so the numbers
        come free again (libzmq may take one once more for the next waiting connection,
        dropped at the next look).  Once the reserve is full the list is forgotten."""
        given = self.reserve.given_up()
        if not given:
            return
        ports = self.ports()
        dropped: Counter[str] = Counter()
        for fd in given:
            hit = classify(fd, ports, 0)
            if hit is None:
                self.reserve.forget(fd)         # free again, or the relay's own
            elif hit[0] in ("conn", "silent") and \
                    drop(fd, hit[1], hit[2], ports, 0, kind=hit[0]):
                dropped[ports[hit[1]]] += 1
        self.refused.update(dropped)

    async def _drain(self, ports) -> Counter[str]:
        """Close the connections waiting in the paused listeners' accept queues."""
        refused: Counter[str] = Counter()
        keep = self.reserve.keep(0.75)          # the spool and a scrape come first
        lost = self.reserve.lost
        for fd, port in list(self._paused.items()):
            name = ports.get(port, str(port))
            for i in range(4096):
                try:
                    if not self.reserve.refuse(fd, keep):
                        break
                except OSError:
                    break
                refused[name] += 1
                if self.reserve.lost != lost:
                    break       # libzmq took the number first: it is still accepting
                if i % 64 == 63:
                    await trio.lowlevel.checkpoint()
            if self.reserve.lost != lost:
                break           # this look; the next one tries again
        self.refused.update(refused)
        return refused

    def _resume(self, ports) -> None:
        for fd, port in self._paused.items():
            set_paused(fd, port, ports, False)
        self._paused.clear()


def _names(c: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
