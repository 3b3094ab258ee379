"""A FUSE file system that loses what was not synced, as a power loss does (a test
fixture, like LazyFS): ``python powerloss_fs.py MOUNTPOINT CONTROL_SOCKET [--dirs MODE]``.

Everything lives in memory, in two versions: what processes see (the page cache) and
what would be on the disk after a power loss.  The ``crash`` command (on the control
socket) throws the first away: every file and directory becomes what was made durable.

Durability model (explicit, and the same for every file):

* **file data and size**: durable up to the last ``fsync`` or ``fdatasync`` of that
  file (through any descriptor); both persist data and size, nothing else.  Writes,
  ``ftruncate`` and ``fallocate`` since then are lost by a crash, all of them (a real
  page cache may have written some back; this model takes the worst case).  Sealing
  a segment, an fdatasync of the active one, the cursor log's fdatasync: each makes
  exactly that file's bytes durable.
* **directory entries** (create, mkdir, unlink, rename, link), ``--dirs strict``
  (default): durable only once the directory that holds the entry is fsynced
  (``fsync`` of a descriptor opened on the directory; for a rename, each of the two
  directories for its half).  Nothing else makes an entry durable: not an fsync of the
  file itself (POSIX leaves it to the directory's fsync; ext4 happens to commit it with
  the journal).  A file whose entry was never made durable is gone after a crash with
  its data; an unlink or rename that was not made durable is undone (the old entry
  comes back with the file's durable data).
* ``--dirs immediate``: directory operations are durable at once, as LazyFS (which
  passes them through to the disk underneath and caches only file data) and ext4's
  ordered journal in practice; only file data and size are lost.

Control socket (a Unix stream socket, one JSON request per line, one JSON answer per
line): ``{"op": "crash"}`` -> ``{"lost_bytes": N, "lost_files": [...]}``;
``{"op": "stats"}`` -> ``{"open": N, "unsynced_bytes": N}``.  Crash only when no
process has a file open on the mount (the test waits for ``open`` to be 0).

Mount options: ``direct_io`` (no kernel page cache: reads come here, so after a crash
nobody sees stale data), ``attr_timeout=0,entry_timeout=0,negative_timeout=0`` (no
cached names or sizes), ``hard_remove`` (an unlinked open file keeps working, no
``.fuse_hidden`` files).  Needs ``/dev/fuse``, libfuse3 (Debian ``fuse3``) and mfusepy.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import socket
import stat
import sys
import threading
import time

_ino = itertools.count(2)


class Node:
    __slots__ = ("ino", "mode", "mtime", "entries", "durable_entries", "data", "durable",
                 "dirty_from")

    def __init__(self, mode: int):
        self.ino = next(_ino)
        self.mode = mode
        self.mtime = time.time()
        if stat.S_ISDIR(mode):
            self.entries: dict[str, Node] = {}
            self.durable_entries: dict[str, Node] = {}
        else:
            self.data = bytearray()
            self.durable = bytearray()
            self.dirty_from: int | None = None      # first byte changed since the last sync

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    def touched(self, at: int) -> None:
        self.mtime = time.time()
        if self.dirty_from is None or at < self.dirty_from:
            self.dirty_from = at

    def sync(self) -> None:
        """fsync/fdatasync: data and size become durable (only what changed is copied)."""
        lo = self.dirty_from
        if lo is None:
            return
        lo = min(lo, len(self.durable), len(self.data))
        del self.durable[lo:]
        self.durable += self.data[lo:]
        self.dirty_from = None

    def unsynced(self) -> int:
        return 0 if self.dirty_from is None else max(0, len(self.data) - self.dirty_from)


def _err(code: int):
    from mfusepy import FuseOSError
    return FuseOSError(code)


class PowerLossFS:
    use_ns = True

    def __init__(self, dirs: str = "strict"):
        if dirs not in ("strict", "immediate"):
            raise ValueError(f"dirs must be strict or immediate, not {dirs!r}")
        self.dirs = dirs
        self.root = Node(stat.S_IFDIR | 0o755)
        self._mu = threading.RLock()
        self.handles: dict[int, tuple[Node, bool]] = {}     # fh -> (node, O_APPEND)
        self._fh = itertools.count(1)
        self.crashes = 0

    # -- helpers ------------------------------------------------------------------
    def _lookup(self, path: str) -> Node:
        node = self.root
        for part in path.split("/"):
            if not part:
                continue
            if not node.is_dir or part not in node.entries:
                raise _err(errno.ENOENT)
            node = node.entries[part]
        return node

    def _parent(self, path: str) -> tuple[Node, str]:
        head, name = os.path.split(path.rstrip("/"))
        parent = self._lookup(head or "/")
        if not parent.is_dir:
            raise _err(errno.ENOTDIR)
        return parent, name

    def _changed(self, d: Node) -> None:
        d.mtime = time.time()
        if self.dirs == "immediate":
            d.durable_entries = dict(d.entries)

    def _node(self, path, fh) -> Node:
        if fh is not None and fh in self.handles:
            return self.handles[fh][0]
        if path is None:
            raise _err(errno.EBADF)
        return self._lookup(path)

    def _open(self, node: Node, flags: int) -> int:
        fh = next(self._fh)
        self.handles[fh] = (node, bool(flags & os.O_APPEND))
        return fh

    # -- metadata ------------------------------------------------------------------
    def getattr(self, path, fh=None):
        with self._mu:
            n = self._node(path, fh)
            ns = int(n.mtime * 1e9)
            size = 4096 if n.is_dir else len(n.data)
            return {"st_mode": n.mode, "st_ino": n.ino,
                    "st_nlink": 2 if n.is_dir else 1, "st_size": size,
                    "st_blocks": (size + 511) // 512, "st_blksize": 4096,
                    "st_uid": os.getuid(), "st_gid": os.getgid(),
                    "st_atime": ns, "st_mtime": ns, "st_ctime": ns}

    def access(self, path, amode):
        with self._mu:
            self._lookup(path)
        return 0

    def chmod(self, path, mode):
        with self._mu:
            n = self._lookup(path)
            n.mode = (n.mode & ~0o7777) | (mode & 0o7777)
        return 0

    def chown(self, path, uid, gid):
        return 0

    def utimens(self, path, times=None):
        return 0

    def statfs(self, path):
        blocks = free = 1 << 26                         # 256 GiB of 4 KiB blocks
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": blocks, "f_bfree": free,
                "f_bavail": free, "f_files": 1 << 20, "f_ffree": 1 << 20,
                "f_favail": 1 << 20, "f_namemax": 255}

    # -- directories -----------------------------------------------------------------
    def readdir(self, path, fh):
        with self._mu:
            d = self._lookup(path)
            if not d.is_dir:
                raise _err(errno.ENOTDIR)
            return [".", "..", *d.entries]

    def mkdir(self, path, mode):
        with self._mu:
            parent, name = self._parent(path)
            if name in parent.entries:
                raise _err(errno.EEXIST)
            parent.entries[name] = Node(stat.S_IFDIR | (mode & 0o7777))
            self._changed(parent)
        return 0

    def rmdir(self, path):
        with self._mu:
            parent, name = self._parent(path)
            d = parent.entries.get(name)
            if d is None:
                raise _err(errno.ENOENT)
            if not d.is_dir:
                raise _err(errno.ENOTDIR)
            if d.entries:
                raise _err(errno.ENOTEMPTY)
            del parent.entries[name]
            self._changed(parent)
        return 0

    def fsyncdir(self, path, datasync, fh):
        with self._mu:
            d = self._lookup(path)
            d.durable_entries = dict(d.entries)
        return 0

    # -- names -------------------------------------------------------------------------
    def create(self, path, mode, flags=0):
        with self._mu:
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if node is None:
                node = Node(stat.S_IFREG | (mode & 0o7777))
                parent.entries[name] = node
                self._changed(parent)
            elif flags & os.O_EXCL:
                raise _err(errno.EEXIST)
            return self._open(node, flags)

    def unlink(self, path):
        with self._mu:
            parent, name = self._parent(path)
            if name not in parent.entries:
                raise _err(errno.ENOENT)
            if parent.entries[name].is_dir:
                raise _err(errno.EISDIR)
            del parent.entries[name]
            self._changed(parent)
        return 0

    def rename(self, old, new):
        with self._mu:
            op, oname = self._parent(old)
            np_, nname = self._parent(new)
            node = op.entries.get(oname)
            if node is None:
                raise _err(errno.ENOENT)
            target = np_.entries.get(nname)
            if target is not None and target.is_dir and target.entries:
                raise _err(errno.ENOTEMPTY)
            del op.entries[oname]
            np_.entries[nname] = node
            self._changed(op)
            if np_ is not op:
                self._changed(np_)
        return 0

    def link(self, target, source):
        with self._mu:
            node = self._lookup(source)
            parent, name = self._parent(target)
            if name in parent.entries:
                raise _err(errno.EEXIST)
            parent.entries[name] = node
            self._changed(parent)
        return 0

    # -- files ---------------------------------------------------------------------------
    def open(self, path, flags):
        with self._mu:
            node = self._lookup(path)
            if node.is_dir:
                raise _err(errno.EISDIR)
            return self._open(node, flags)

    def release(self, path, fh):
        with self._mu:
            self.handles.pop(fh, None)
        return 0

    def flush(self, path, fh):
        return 0

    def lock(self, path, fh, cmd, lock):
        return 0            # one process at a time uses the mount: every lock is granted

    def read(self, path, size, offset, fh):
        with self._mu:
            return bytes(self._node(path, fh).data[offset:offset + size])

    def write(self, path, data, offset, fh):
        with self._mu:
            if fh not in self.handles:
                raise _err(errno.EBADF)         # a descriptor from before the crash
            node, append = self.handles[fh]
            buf = node.data
            if append:
                offset = len(buf)
            if offset > len(buf):
                node.touched(len(buf))
                buf.extend(bytes(offset - len(buf)))
            node.touched(offset)
            buf[offset:offset + len(data)] = data
            return len(data)

    def truncate(self, path, length, fh=None):
        with self._mu:
            node = self._node(path, fh)
            old = len(node.data)
            if length < old:
                del node.data[length:]
            elif length > old:
                node.data.extend(bytes(length - old))
            node.touched(min(old, length))
        return 0

    def fallocate(self, path, mode, offset, size, fh):
        if mode != 0:
            raise _err(errno.EOPNOTSUPP)
        with self._mu:
            node = self._node(path, fh)
            end = offset + size
            if end > len(node.data):
                node.touched(len(node.data))
                node.data.extend(bytes(end - len(node.data)))
        return 0

    def fsync(self, path, datasync, fh):
        with self._mu:
            self._node(path, fh).sync()
        return 0

    # -- power loss ----------------------------------------------------------------------
    def crash(self) -> dict:
        """Everything not durable is gone: each directory holds its durable entries, each
        file its durable bytes; files no durable entry reaches are gone."""
        with self._mu:
            lost_bytes = 0
            lost_files = []
            seen: set[int] = set()

            def walk(d: Node, prefix: str) -> None:
                nonlocal lost_bytes
                for name in d.entries:
                    if name not in d.durable_entries:
                        lost_files.append(prefix + name)
                d.entries = dict(d.durable_entries)
                for name, n in d.entries.items():
                    if n.ino in seen:
                        continue
                    seen.add(n.ino)
                    if n.is_dir:
                        walk(n, prefix + name + "/")
                    else:
                        lost_bytes += n.unsynced()
                        n.data = bytearray(n.durable)
                        n.dirty_from = None

            walk(self.root, "/")
            self.handles.clear()
            self.crashes += 1
            return {"lost_bytes": lost_bytes, "lost_files": lost_files}

    def stats(self) -> dict:
        with self._mu:
            unsynced = 0
            stack = [self.root]
            seen = set()
            while stack:
                d = stack.pop()
                for n in d.entries.values():
                    if n.ino in seen:
                        continue
                    seen.add(n.ino)
                    if n.is_dir:
                        stack.append(n)
                    else:
                        unsynced += n.unsynced()
            return {"open": len(self.handles), "unsynced_bytes": unsynced,
                    "crashes": self.crashes}


def serve_control(fs: PowerLossFS, path: str) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)

    def handle(conn):
        with conn, conn.makefile("rwb") as f:
            for line in f:
                req = json.loads(line)
                op = req.get("op")
                if op == "crash":
                    res = fs.crash()
                elif op == "stats":
                    res = fs.stats()
                else:
                    res = {"error": f"unknown op {op!r}"}
                f.write(json.dumps(res).encode() + b"\n")
                f.flush()

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def main(argv: list[str]) -> int:
    import argparse

    import mfusepy
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mountpoint")
    ap.add_argument("control")
    ap.add_argument("--dirs", choices=("strict", "immediate"), default="strict")
    a = ap.parse_args(argv)
    fs = PowerLossFS(a.dirs)
    threading.Thread(target=serve_control, args=(fs, a.control), daemon=True).start()
    mfusepy.FUSE(fs, a.mountpoint, foreground=True, direct_io=True, hard_remove=True,
                 attr_timeout=0, entry_timeout=0, negative_timeout=0, fsname="powerloss")
    return 0


# ---------------------------------------------------------------- for the tests


class Mount:
    """A running :class:`PowerLossFS` on ``mountpoint`` (``start`` / ``crash`` /
    ``stats`` / ``stop``)."""

    def __init__(self, mountpoint, control, dirs: str = "strict"):
        self.mountpoint = str(mountpoint)
        self.control = str(control)
        self.dirs = dirs
        self.proc = None
        self.log = None

    def start(self, log_path, timeout: float = 10.0) -> None:
        """Mount; raises ``RuntimeError(reason)`` when that is not possible here."""
        import subprocess
        os.makedirs(self.mountpoint, exist_ok=True)
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                      self.mountpoint, self.control, "--dirs", self.dirs],
                                     stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + timeout
        while not (os.path.ismount(self.mountpoint) and os.path.exists(self.control)):
            if self.proc.poll() is not None:
                self.log.flush()
                with open(log_path, "rb") as f:
                    tail = f.read().decode(errors="replace").strip().splitlines()[-1:]
                raise RuntimeError(f"the FUSE file system did not mount "
                                   f"(exit {self.proc.returncode}: {' '.join(tail)})")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the FUSE file system did not mount within "
                                   f"{timeout:.0f} s")
            time.sleep(0.05)

    def _ask(self, op: str) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.control)
            s.sendall(json.dumps({"op": op}).encode() + b"\n")
            with s.makefile("rb") as f:
                return json.loads(f.readline())

    def stats(self) -> dict:
        return self._ask("stats")

    def crash(self) -> dict:
        return self._ask("crash")

    def stop(self) -> None:
        import subprocess
        if self.proc is None:
            return
        for cmd in (["fusermount3", "-u", self.mountpoint], ["umount", self.mountpoint],
                    ["umount", "-l", self.mountpoint]):
            if not os.path.ismount(self.mountpoint):
                break
            subprocess.run(cmd, capture_output=True)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if self.log is not None:
            self.log.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
