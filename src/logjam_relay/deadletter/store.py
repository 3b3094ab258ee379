"""Dead-letter store: what an output could not deliver, with the reason, on disk.

A directory of files in the spool's segment format (``spool/segment.py``: the
same 40-byte header, the same CRC-checked records), named
``<20-digit number>.open`` while written and ``.seg`` once sealed.  Each dead
letter is ONE record whose kind is the original record's kind and whose frames
are ``[meta, *original frames]``; ``meta`` is a small JSON object::

    {"output": "lumberjack-h_5044", "reason": "too_large", "detail": "...",
     "time_ms": 1700000000123, "position": [segment, offset]}

Reasons (the ``reason`` label of ``logjam_relay_dead_letters_total``):

* ``too_large`` -- the event (decompressed body) is larger than ``max_event_bytes``;
* ``refused``   -- the receiver closed the connection before acknowledging it,
  several times in a row, and bisecting the window isolated it.

The store is bounded by ``max_bytes`` (``dead_letter_max_bytes``): files are
rotated at ``max_bytes / 8`` and the oldest files are deleted when the total
would exceed the budget; the records they held are counted as ``dropped``.  A
letter larger than the whole budget is not written (counted as dropped too).

A letter that cannot be written (disk full, I/O error) is logged as an error and
counted in ``write_errors`` (``logjam_relay_dead_letter_write_errors_total``): the output
does not stop for it.

Writes are rare (one per poison event), synchronous and fsynced; outputs call
:meth:`DeadLetterStore.put` through ``trio.to_thread.run_sync``.  A relay that
restarts never appends to an old file (a torn tail stays readable up to the tear);
it starts a new one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..fdreserve import RESERVE as _FDS
from ..spool import segment as seg

log = logging.getLogger("logjam_relay.deadletter")

REASONS = ("too_large", "refused")


@dataclass(frozen=True, slots=True)
class DeadLetter:
    id: str                 # "<file number>:<offset>", stable
    output: str
    reason: str
    detail: str
    time_ms: int
    position: tuple[int, int] | None   # spool position of the original record
    kind: int
    frames: list[bytes]

    def summary(self) -> dict:
        d = {"id": self.id, "output": self.output, "reason": self.reason,
             "detail": self.detail, "time_ms": self.time_ms, "kind": self.kind,
             "frames": len(self.frames), "bytes": sum(len(f) for f in self.frames)}
        if self.position is not None:
            d["position"] = list(self.position)
        if self.kind == seg.KIND_LOGJAM and len(self.frames) >= 2:
            d["stream"] = self.frames[0].decode("utf-8", "replace")
            d["topic"] = self.frames[1].decode("utf-8", "replace")
        return d


def _files(directory: Path) -> list[tuple[int, Path]]:
    out = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        parsed = seg.parse_segment_name(name)
        if parsed is not None:
            out.append((parsed[0], directory / name))
    out.sort()
    return out


class DeadLetterStore:
    """Append-only, size-bounded store of dead letters (thread-safe)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = 1024**3):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.file_bytes = max(max_bytes // 8, 64 * 1024)
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        files = _files(self.directory)
        #: (number, path, size) of every file, oldest first
        self._files: list[list] = [[n, p, p.stat().st_size] for n, p in files]
        self._next_no = (files[-1][0] + 1) if files else 1
        self._fh = None
        self._cur: list | None = None
        self._seq = 0
        # counters since start: (output, reason) -> letters stored
        self.counts: dict[tuple[str, str], int] = {}
        self.dropped = 0                 # letters deleted (oldest first) or not written
        self.write_errors = 0

    # ------------------------------------------------------------------ stats
    @property
    def bytes(self) -> int:
        return sum(f[2] for f in self._files)

    def stats(self) -> dict:
        return {"bytes": self.bytes, "max_bytes": self.max_bytes, "files": len(self._files),
                "dropped": self.dropped, "write_errors": self.write_errors,
                "letters": {f"{o}/{r}": n for (o, r), n in self.counts.items()}}

    def count_for(self, output: str) -> dict[str, int]:
        return {r: n for (o, r), n in self.counts.items() if o == output}

    # ------------------------------------------------------------------ write
    def put(self, output: str, reason: str, frames: Sequence[bytes], *, kind: int = 0,
            detail: str = "", position: tuple[int, int] | None = None) -> str | None:
        """Store one dead letter; returns its id (None if it could not be written).

        Counted under (output, reason) either way: the event left the output.
        """
        meta = {"output": output, "reason": reason, "detail": detail[:500],
                "time_ms": int(time.time() * 1000)}
        if position is not None:
            meta["position"] = [int(position[0]), int(position[1])]
        frames = [json.dumps(meta, separators=(",", ":")).encode(), *map(bytes, frames)]
        key = (output, reason)
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            try:
                return self._append(kind, frames)
            except (OSError, ValueError) as e:   # disk full, I/O error; a record too large
                self.write_errors += 1
                log.error("dead-letter store %s: cannot write a %s letter of %s: %s",
                          self.directory, reason, output, e)
                return None

    def _append(self, kind: int, frames: list[bytes]) -> str | None:
        rec = seg.encode_records([(kind, frames)], self._seq)
        if seg.HEADER_LEN + len(rec) > self.max_bytes:
            self.dropped += 1
            log.warning("dead-letter store %s: a %d-byte letter is larger than "
                        "dead_letter_max_bytes (%d): not stored", self.directory, len(rec),
                        self.max_bytes)
            return None
        if self._cur is not None and self._cur[2] + len(rec) > self.file_bytes \
                and self._cur[2] > seg.HEADER_LEN:
            self._seal()
        # make room: oldest files first (never the one being written)
        while self._files and self.bytes + len(rec) + (0 if self._cur else seg.HEADER_LEN) \
                > self.max_bytes:
            victim = self._files[0]
            if victim is self._cur:
                self._seal()
                continue
            self._drop(victim)
        if self._cur is None:
            self._open()
        off = self._cur[2]
        self._fh.write(rec)
        self._fh.flush()
        os.fdatasync(self._fh.fileno())
        self._cur[2] += len(rec)
        self._seq += 1
        return f"{self._cur[0]}:{off}"

    def _open(self) -> None:
        no = self._next_no
        self._next_no += 1
        path = self.directory / seg.segment_name(no, sealed=False)
        # from the fd reserve when the relay is out of descriptors (fdreserve.py)
        fh = os.fdopen(_FDS.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                 0o644), "wb", closefd=False)
        fh.write(seg.encode_header(no, int(time.time() * 1000), 0))
        fh.flush()
        self._fh = fh
        self._seq = 0
        self._cur = [no, path, seg.HEADER_LEN]
        self._files.append(self._cur)

    def _seal(self) -> None:
        cur, fh = self._cur, self._fh
        self._cur = self._fh = None
        if cur is None:
            return
        data_end = cur[2]
        seal = seg.encode_seal(self._seq, self._seq, data_end, int(time.time() * 1000))
        try:
            fh.write(seal)
            fh.flush()
            os.fdatasync(fh.fileno())
        finally:
            _close(fh)
        sealed = cur[1].with_name(seg.segment_name(cur[0], sealed=True))
        os.rename(cur[1], sealed)
        cur[1] = sealed
        cur[2] = data_end + len(seal)

    def _drop(self, victim: list) -> None:
        n = 0
        try:
            for _ in seg.iter_records(victim[1], allow_torn_tail=True):
                n += 1
        except (seg.SegmentError, OSError):
            pass
        try:
            os.unlink(victim[1])
        except FileNotFoundError:
            pass
        except OSError as e:       # not ours to delete (a directory, no permission):
            log.warning("dead-letter store %s: cannot delete %s (%s): no longer counted",
                        self.directory, victim[1].name, e)
        self._files.remove(victim)
        self.dropped += n
        log.warning("dead-letter store %s full (%d bytes): deleted %s with %d letter(s)",
                    self.directory, self.max_bytes, victim[1].name, n)

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                _close(self._fh)
                self._fh = None
                self._cur = None


def _close(fh) -> None:
    """Close a file opened with ``closefd=False``: its descriptor goes back to the fd
    reserve if that is short."""
    fd = fh.fileno()
    try:
        fh.close()
    finally:
        _FDS.close(fd)


def _decode(no: int, off: int, kind: int, frames: list[bytes]) -> DeadLetter:
    """A letter from its record; a meta frame that is not what the store writes (a file
    written by something else, or a CRC that matched by chance) gives ``?`` fields."""
    try:
        meta = json.loads(frames[0])
    except (ValueError, IndexError):
        meta = None
    if not isinstance(meta, dict):
        meta = {}
    pos = meta.get("position")
    if not (isinstance(pos, list) and len(pos) == 2 and all(type(x) is int for x in pos)):
        pos = None
    t = meta.get("time_ms")
    return DeadLetter(id=f"{no}:{off}", output=str(meta.get("output", "?")),
                      reason=str(meta.get("reason", "?")), detail=str(meta.get("detail", "")),
                      time_ms=t if type(t) is int and t >= 0 else 0,
                      position=tuple(pos) if pos else None,
                      kind=kind, frames=list(frames[1:]))


#: how far past a damaged record the reader looks for the next intact one
RESYNC_WINDOW = 16 * 1024 * 1024


def _records(path: Path) -> Iterator[tuple[int, int, list]]:
    """``(offset, kind, frames)`` of every intact record of one store file.  A damaged
    record (CRC, structure) is skipped: the next intact one is found by its sequence number
    (the store numbers the records of each file from 0, as the spool does), within
    :data:`RESYNC_WINDOW` bytes; a torn tail ends the file."""
    start, seq = 0, 0
    while True:
        try:
            for off, kind, frames in seg.iter_records(path, start, allow_torn_tail=True):
                seq += 1
                yield off, kind, frames
            return
        except seg.SegmentError as e:
            if e.offset < seg.HEADER_LEN:           # the header itself: nothing to resync to
                log.warning("dead-letter file %s: %s (file skipped)", path, e)
                return
            with open(path, "rb") as f:
                f.seek(e.offset)
                buf = f.read(RESYNC_WINDOW)
            found = seg.resync(buf, e.offset, e.offset, seq, seq + 1 + 1024)
            if found is None:
                log.warning("dead-letter file %s: %s (rest of the file skipped)", path, e)
                return
            log.warning("dead-letter file %s: %s (damaged record skipped)", path, e)
            start, seq = found


def read_dead_letters(directory: str | os.PathLike) -> Iterator[DeadLetter]:
    """Every dead letter in ``directory``, oldest first.  Never stopped by a damaged file:
    torn tails end a file, damaged records are skipped (logged), unreadable files too."""
    for no, path in _files(Path(directory)):
        try:
            for off, kind, frames in _records(path):
                yield _decode(no, off, kind, [bytes(f) for f in frames])
        except FileNotFoundError:
            continue
        except OSError as e:                        # a directory, no permission, I/O error
            log.warning("dead-letter file %s: %s (skipped)", path, e)
