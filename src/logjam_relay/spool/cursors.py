"""Durable output cursors: one append-only cursor log per reader.

``cursors/<reader>.cursors`` is a sequence of fixed 32-byte entries, all little-endian::

    0   8  segment number of the first unacknowledged record
    8   8  its byte offset in that segment
    16  8  its spool seq
    24  4  CRC-32 of bytes 0..23
    28  4  b"CUR1"

An acknowledgement appends one entry with one ``write()`` (the kernel has it when
``ack`` returns, so a killed process loses nothing); ``fdatasync`` follows the spool's
fsync policy (see docs/spool-format.md).  The newest valid entry wins: a torn or
damaged tail entry is ignored, so the reader restarts one acknowledgement earlier
(duplicates, never gaps).  When the log passes :data:`COMPACT_ENTRIES` entries it is
rewritten as a single entry (tmp + fsync + rename).  The older ``<reader>.cursor``
JSON files are still read when no log exists.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

from ..fdreserve import RESERVE as _FDS

ENTRY = struct.Struct("<QQQI4s")
ENTRY_LEN = ENTRY.size                 # 32
TAG = b"CUR1"
LOG_SUFFIX = ".cursors"
LEGACY_SUFFIX = ".cursor"
COMPACT_ENTRIES = 4096                 # 128 KiB, then rewritten as one entry
_write = os.write
_fdatasync = getattr(os, "fdatasync", os.fsync)


def encode(segment: int, offset: int, seq: int) -> bytes:
    head = struct.pack("<QQQ", segment, offset, seq)
    return head + struct.pack("<I", zlib.crc32(head)) + TAG


def decode_last(data: bytes) -> tuple[int, int, int] | None:
    """The newest valid entry of a cursor log's bytes (a torn tail is ignored)."""
    n = len(data) // ENTRY_LEN
    for i in range(n - 1, -1, -1):
        seg, off, seq, crc, tag = ENTRY.unpack_from(data, i * ENTRY_LEN)
        if tag == TAG and crc == zlib.crc32(data[i * ENTRY_LEN:i * ENTRY_LEN + 24]):
            return seg, off, seq
    return None


def load(cdir: str, name: str) -> tuple[int, int, int] | None:
    """The persisted cursor of reader ``name`` (log first, then the legacy JSON file).
    Raises ``ValueError`` for a file that exists but holds no valid cursor."""
    path = os.path.join(cdir, name + LOG_SUFFIX)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        data = None
    if data is not None:
        cur = decode_last(data)
        if cur is None and data:
            raise ValueError(f"{path}: no valid cursor entry in {len(data)} bytes")
        if cur is not None:
            return cur
    legacy = os.path.join(cdir, name + LEGACY_SUFFIX)
    try:
        with open(legacy, "rb") as f:
            d = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{legacy}: {e}") from None
    try:
        return int(d["segment"]), int(d["offset"]), int(d["seq"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{legacy}: {e!r}") from None


def names(cdir: str) -> list[str]:
    out = set()
    for fn in os.listdir(cdir):
        for suf in (LOG_SUFFIX, LEGACY_SUFFIX):
            if fn.endswith(suf):
                out.add(fn[:-len(suf)])
    return sorted(out)


def write_entry(cdir: str, name: str, segment: int, offset: int, seq: int) -> None:
    """Append one entry to a cursor log (tools and tests; the spool uses :class:`CursorLog`)."""
    fd = os.open(os.path.join(cdir, name + LOG_SUFFIX),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, encode(segment, offset, seq))
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_dir(path: str) -> None:
    """fsync the directory that holds ``path`` (its entry is then durable)."""
    fd = _FDS.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        _FDS.close(fd)


class CursorLog:
    """The append side of one reader's cursor log.  Raises ``OSError``; the reader
    counts and logs it (a cursor that is not durable only causes duplicates)."""

    def __init__(self, cdir: str, name: str, sync: bool):
        self.path = os.path.join(cdir, name + LOG_SUFFIX)
        self._legacy = os.path.join(cdir, name + LEGACY_SUFFIX)
        self._sync = sync
        self._fd: int | None = None
        self._entries = 0
        self.dirty = False
        self._syncing = 0                       # fdatasyncs running in worker threads
        self.writes = 0
        self.compactions = 0

    def _open(self) -> int:
        if self._fd is None:
            created = self._sync and not os.path.exists(self.path)
            self._fd = _FDS.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                                 0o644)
            self._entries = os.fstat(self._fd).st_size // ENTRY_LEN
            if created:
                _sync_dir(self.path)        # the new log's name is durable too
        return self._fd

    def append(self, segment: int, offset: int, seq: int) -> None:
        if self._entries >= COMPACT_ENTRIES:
            self.compact(segment, offset, seq)
            return
        data = encode(segment, offset, seq)
        fd = self._open()
        if _write(fd, data) != ENTRY_LEN:
            # a short write leaves a torn entry, ignored on load; cut it so the log stays
            # aligned, and report the disk as full (the usual cause)
            try:
                os.ftruncate(fd, self._entries * ENTRY_LEN)
            except OSError:
                pass
            import errno
            raise OSError(errno.ENOSPC, "short write of cursor entry")
        self._entries += 1
        self.writes += 1
        self.dirty = True

    def compact(self, segment: int, offset: int, seq: int) -> None:
        tmp = self.path + ".tmp"
        fd = _FDS.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            if _write(fd, encode(segment, offset, seq)) != ENTRY_LEN:
                import errno
                raise OSError(errno.ENOSPC, "short write of cursor entry")
            if self._sync:
                os.fsync(fd)
        except BaseException:
            _FDS.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _FDS.close(fd)
        os.replace(tmp, self.path)
        if self._sync:
            # the rename too: else a power loss may bring back the old log, whose older
            # cursor may point into a segment deleted since
            _sync_dir(self.path)
        self.close()
        self._open()
        self.writes += 1
        self.compactions += 1
        self.dirty = False
        try:
            os.unlink(self._legacy)
        except OSError:
            pass

    def take_sync(self) -> int | None:
        """For a sync off the event loop: a duplicate of the log's descriptor, which the
        caller fdatasyncs, then closes and reports with :meth:`sync_finished` (a
        compaction meanwhile is harmless: it fsyncs by itself), with the log marked clean
        -- an append meanwhile marks it dirty again.  None when there is nothing to sync:
        nothing written since the last sync and no sync still running (one that runs is
        not durable yet, so a caller that needs durability syncs again)."""
        if not (self.dirty or self._syncing) or self._fd is None:
            return None
        fd = _FDS.dup(self._fd)
        self.dirty = False
        self._syncing += 1
        return fd

    def sync_finished(self, ok: bool) -> None:
        self._syncing -= 1
        if not ok:
            self.dirty = True                   # try again next time

    def sync(self) -> None:
        """fdatasync now when anything written may not be durable yet (also while a
        sync of it runs in a thread: the caller may be about to rely on it)."""
        if (self.dirty or self._syncing) and self._fd is not None:
            _fdatasync(self._fd)
            self.dirty = False

    def close(self) -> None:
        if self._fd is not None:
            _FDS.close(self._fd)
            self._fd = None
