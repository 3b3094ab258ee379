"""A model file system for the spool's :class:`~logjam_relay.spool.fs.Filesystem` seam.

It keeps, per file, what reads see (``data``) and what a power loss keeps (``synced``:
the data at the last fsync/fdatasync), and per directory the names a power loss keeps
(those present at the last fsync of the directory).  :meth:`ModelFS.crash` returns the
file system a power loss leaves behind: unsynced data and unsynced names are gone, or,
with ``torn``, a prefix of each file's unsynced tail survives (a torn write).  Writes can
be made to fail (:meth:`ModelFS.fail_writes`): a short write, then ENOSPC.

Only the spool's segment directory is modelled; the cursor logs (``cursors.py``, not on
the seam) live in the real directory of the same name, which :meth:`makedirs` creates.
"""

from __future__ import annotations

import errno
import io
import os
from dataclasses import dataclass, field

from logjam_relay.spool.fs import Filesystem


@dataclass
class Inode:
    data: bytearray = field(default_factory=bytearray)
    synced: bytes = b""


@dataclass
class Handle:
    path: str
    inode: Inode
    flags: int
    pos: int = 0


class ModelFS(Filesystem):
    def __init__(self, capacity: int = 1 << 30) -> None:
        self.names: dict[str, Inode] = {}           # path -> inode (what is visible now)
        self.durable: dict[str, Inode] = {}         # path -> inode (what a crash keeps)
        self.dirs: set[str] = set()
        self.handles: dict[int, Handle] = {}
        self.capacity = capacity
        self._next_fd = 1_000_000
        self._fail_after: int | None = None         # bytes left before writes fail
        self.locked: set[str] = set()
        self.syncs = 0

    # -- the crash ------------------------------------------------------------
    def crash(self, torn: int = 0) -> ModelFS:
        """The file system after a power loss: every durable name with its synced data,
        plus the first ``torn`` bytes of its unsynced tail (if it only grew)."""
        after = ModelFS(self.capacity)
        after.dirs = set(self.dirs)
        copies: dict[int, Inode] = {}
        for path, ino in self.durable.items():
            if id(ino) not in copies:
                data = bytes(ino.synced)
                if torn and ino.data[:len(data)] == data:
                    data = bytes(ino.data[:len(data) + torn])
                copies[id(ino)] = Inode(bytearray(data), data)
            after.names[path] = after.durable[path] = copies[id(ino)]
        return after

    def fail_writes(self, after_bytes: int | None) -> None:
        """Writes succeed for ``after_bytes`` more bytes (the last one short), then fail
        with ENOSPC; None: no more failures."""
        self._fail_after = after_bytes

    def file(self, path: str) -> bytes:
        return bytes(self.names[path].data)

    # -- descriptors ------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        path = os.fspath(path)
        if flags & os.O_DIRECTORY:
            if path not in self.dirs:
                raise FileNotFoundError(errno.ENOENT, "no such directory", path)
            ino = None
        else:
            ino = self.names.get(path)
            if ino is None:
                if not flags & os.O_CREAT:
                    raise FileNotFoundError(errno.ENOENT, "no such file", path)
                if os.path.dirname(path) not in self.dirs:
                    raise FileNotFoundError(errno.ENOENT, "no such directory", path)
                ino = self.names[path] = Inode()
            elif flags & os.O_CREAT and flags & os.O_EXCL:
                raise FileExistsError(errno.EEXIST, "file exists", path)
            if flags & os.O_TRUNC:
                del ino.data[:]
        fd = self._next_fd
        self._next_fd += 1
        self.handles[fd] = Handle(path, ino, flags)
        return fd

    def dup(self, fd: int) -> int:
        h = self.handles[fd]
        new = self._next_fd
        self._next_fd += 1
        self.handles[new] = Handle(h.path, h.inode, h.flags, h.pos)
        return new

    def close(self, fd: int) -> None:
        h = self.handles.pop(fd)
        self.locked.discard(h.path)

    def _h(self, fd: int) -> Handle:
        try:
            return self.handles[fd]
        except KeyError:
            raise OSError(errno.EBADF, "bad file descriptor") from None

    # -- data -------------------------------------------------------------------
    def used(self) -> int:
        return sum(len(i.data) for i in {id(i): i for i in self.names.values()}.values())

    def write(self, fd: int, data) -> int:
        h = self._h(fd)
        data = bytes(data)
        if self._fail_after is not None:
            if self._fail_after <= 0:
                raise OSError(errno.ENOSPC, "No space left on device (model)")
            data = data[:self._fail_after]
            self._fail_after -= len(data)
        if self.used() + len(data) > self.capacity:
            raise OSError(errno.ENOSPC, "No space left on device (model)")
        ino = h.inode
        pos = len(ino.data) if h.flags & os.O_APPEND else h.pos
        if pos > len(ino.data):
            ino.data.extend(bytes(pos - len(ino.data)))
        ino.data[pos:pos + len(data)] = data
        h.pos = pos + len(data)
        return len(data)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return bytes(self._h(fd).inode.data[offset:offset + size])

    def fsync(self, fd: int) -> None:
        h = self._h(fd)
        self.syncs += 1
        if h.inode is None:                       # a directory
            self._sync_names(h.path)
        else:
            h.inode.synced = bytes(h.inode.data)

    fdatasync = fsync

    def ftruncate(self, fd: int, size: int) -> None:
        ino = self._h(fd).inode
        if size < len(ino.data):
            del ino.data[size:]
        else:
            ino.data.extend(bytes(size - len(ino.data)))

    def fsize(self, fd: int) -> int:
        return len(self._h(fd).inode.data)

    def start_writeback(self, fd: int, offset: int, size: int) -> None:
        """The model has no page cache to write early: only fdatasync makes data
        durable, as on the real one."""

    def fallocate(self, fd: int, offset: int, size: int) -> None:
        ino = self._h(fd).inode
        if offset + size > len(ino.data):
            if self.used() + offset + size - len(ino.data) > self.capacity:
                raise OSError(errno.ENOSPC, "No space left on device (model)")
            ino.data.extend(bytes(offset + size - len(ino.data)))

    def lock(self, fd: int) -> None:
        path = self._h(fd).path
        if path in self.locked:
            raise BlockingIOError(errno.EAGAIN, "locked")
        self.locked.add(path)

    # -- names ------------------------------------------------------------------
    def _sync_names(self, d: str) -> None:
        for path in [p for p in self.durable if os.path.dirname(p) == d]:
            del self.durable[path]
        for path, ino in self.names.items():
            if os.path.dirname(path) == d:
                self.durable[path] = ino

    def replace(self, src: str, dst: str) -> None:
        if src not in self.names:
            raise FileNotFoundError(errno.ENOENT, "no such file", src)
        self.names[dst] = self.names.pop(src)

    def unlink(self, path: str) -> None:
        if path not in self.names:
            raise FileNotFoundError(errno.ENOENT, "no such file", path)
        del self.names[path]

    def listdir(self, path: str) -> list[str]:
        if path not in self.dirs:
            raise FileNotFoundError(errno.ENOENT, "no such directory", path)
        out = {os.path.basename(p) for p in self.names if os.path.dirname(p) == path}
        out |= {os.path.basename(d) for d in self.dirs if os.path.dirname(d) == path}
        return sorted(out)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)          # the real one: the cursor logs live there
        while path and path not in self.dirs:
            self.dirs.add(path)
            path = os.path.dirname(path)

    def exists(self, path: str) -> bool:
        return path in self.names or path in self.dirs

    def getsize(self, path: str) -> int:
        if path not in self.names:
            raise FileNotFoundError(errno.ENOENT, "no such file", path)
        return len(self.names[path].data)

    def disk_bytes(self, path: str) -> int:
        return self.capacity

    def sync_dir(self, path: str) -> None:
        fd = self.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self.fsync(fd)
        finally:
            self.close(fd)

    # -- whole files --------------------------------------------------------------
    def open_file(self, path: str):
        if path not in self.names:
            raise FileNotFoundError(errno.ENOENT, "no such file", path)
        return io.BytesIO(bytes(self.names[path].data))
