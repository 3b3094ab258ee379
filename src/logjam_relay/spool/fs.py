"""The spool's file system seam: every file operation of the writer, the readers, the space
budget and the recovery goes through a :class:`Filesystem`.

:data:`OS` is the real one.  Every descriptor it opens, duplicates or closes goes through
the fd reserve (``fdreserve.RESERVE``), so that the spool keeps working when the process
runs out of descriptors.  Tests hand a :class:`Spool` a model file system instead
(``tests/model_fs.py``: torn writes, data not yet synced lost on a crash), or patch
:data:`_write` / :data:`_fdatasync` here to inject failures in one place.

Reading a segment's content in bulk (``segment.scan_segment``, ``salvage_segment``,
``read_seal``, ``iter_with_seq``) goes through :meth:`Filesystem.open_file`, a file
object.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import io
import os

from ..fdreserve import RESERVE as _FDS

# indirection so tests can inject write/sync failures without patching the os module
_write = os.write
_fdatasync = getattr(os, "fdatasync", os.fsync)
_OS_FDATASYNC = _fdatasync


def _sync_file_range():
    """Linux ``sync_file_range`` (not in the os module), or None."""
    try:
        import ctypes
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
SYNC_FILE_RANGE_WRITE = 2


class Filesystem:
    """The file operations the spool needs, on the real file system.  Raises ``OSError``
    as the ``os`` functions do."""

    # -- descriptors (all through the fd reserve) ---------------------------------
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return _FDS.open(path, flags, mode)

    def dup(self, fd: int) -> int:
        return _FDS.dup(fd)

    def close(self, fd: int) -> None:
        _FDS.close(fd)

    # -- data ---------------------------------------------------------------------
    def write(self, fd: int, data) -> int:
        return _write(fd, data)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        _fdatasync(fd)

    @property
    def native_fdatasync(self) -> bool:
        """True when a sync may bypass :meth:`fdatasync` (the C thread of
        ``syncthread.py`` calls the system's own): this is the real file system and no
        test replaced its fdatasync."""
        return type(self).fdatasync is Filesystem.fdatasync and _fdatasync is _OS_FDATASYNC

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fsize(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def fallocate(self, fd: int, offset: int, size: int) -> None:
        os.posix_fallocate(fd, offset, size)

    def start_writeback(self, fd: int, offset: int, size: int) -> None:
        """Start writing a range of the file to disk, without waiting and without any
        promise (``sync_file_range(SYNC_FILE_RANGE_WRITE)``; nothing where it is missing):
        the next fdatasync then finds little left to write.  Durability still comes
        only from fdatasync."""
        if _SYNC_FILE_RANGE is not None:
            _SYNC_FILE_RANGE(fd, offset, size, SYNC_FILE_RANGE_WRITE)   # advisory: rc ignored

    def lock(self, fd: int) -> None:
        """An exclusive, non-blocking lock on the whole file (``OSError`` if held)."""
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    # -- names --------------------------------------------------------------------
    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def getsize(self, path: str) -> int:
        return os.path.getsize(path)

    def disk_bytes(self, path: str) -> int:
        """Size of the file system that holds ``path`` (0 if unknown)."""
        try:
            st = os.statvfs(path)
        except OSError:
            return 0
        return st.f_blocks * st.f_frsize

    def sync_dir(self, path: str) -> None:
        """fsync the directory ``path`` (the names in it are then durable)."""
        fd = self.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.fsync(fd)
        finally:
            self.close(fd)

    # -- whole files --------------------------------------------------------------
    def open_file(self, path: str):
        """A binary file object to read ``path`` (for the segment scans); its descriptor
        comes from, and goes back through, the fd reserve."""
        fd = self.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _ReserveFile(fd, "rb", closefd=False)
        except BaseException:
            self.close(fd)
            raise

    def read_file(self, path: str) -> bytes:
        with self.open_file(path) as f:
            return f.read()


class _ReserveFile(io.FileIO):
    """A read-only file object whose descriptor is closed through the fd reserve."""

    def close(self) -> None:
        if not self.closed:
            fd = self.fileno()
            super().close()                      # closefd=False: the descriptor stays
            _FDS.close(fd)


#: the real file system
OS = Filesystem()


def write_all(fs: Filesystem, fd: int, data, what: str) -> None:
    """write() until done; a short write is retried, so that a full disk surfaces as
    the ENOSPC of the next call (not as a made-up EIO)."""
    view = memoryview(data)
    done = 0
    while done < len(data):
        w = fs.write(fd, view[done:])
        if w <= 0:
            raise OSError(_errno.ENOSPC, f"short write of {what}")
        done += w


def unlink_quiet(path: str, fs: Filesystem = OS) -> None:
    try:
        fs.unlink(path)
    except OSError:
        pass


def truncate_file(fs: Filesystem, path: str, size: int, sync: bool) -> None:
    """Cut the file ``path`` to ``size`` bytes (and fsync it if ``sync``)."""
    fd = fs.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        fs.ftruncate(fd, size)
        if sync:
            fs.fsync(fd)
    finally:
        fs.close(fd)
