"""When the spool calls fdatasync, and who waits for it (:class:`FsyncPolicy`).

One object, given to the spool when it is built (``Spool(fsync=FsyncPolicy(...))``) and
never changed; every part that decides on a sync asks it: the segment writer (appends,
new segments, seals, the state file, the writeback), the readers' cursor logs, the
spool's tick and run loop, and the relay (whether a group commit answers the producers,
and the memory it holds: relay/app.py, relay/memory.py).  ``mode`` is ``spool_fsync``:

* ``"batch"``: every appended batch is on disk before it is answered.  Inline (the
  default), each append fdatasyncs itself, on the event loop; with ``off_loop`` the
  appends do not, and the spool's owner awaits ``Spool.sync_async`` (the fdatasync in the
  sync thread) before it answers (the relay's group commit, relay/groupcommit.py).
* ``"interval"``: at most ``interval_s`` seconds of appends are not on disk.  Inline,
  an append or ``tick`` that finds the interval over fdatasyncs on the loop; with
  ``off_loop``, ``Spool.run`` does it in a worker thread (and the cursor logs' syncs),
  and the appends hand their bytes to the kernel's writeback as they go.
* ``"never"``: no fdatasync of appends, nor of the cursor logs, the state file or a new
  segment's directory entry.  Seals fsync whatever the mode (sealed segments go to the
  archive: docs/spool-format.md).

Segment seals run off the loop (``Spool.run``) only where nothing else syncs on it:
``"never"``, or ``off_loop``.

The relay's spool is built ``off_loop`` (relay/spoolwrite.py); the samwise spool inline:
its endpoint answers a request when ``append`` returns, with no group commit to wait for
an off-loop sync (docs/architecture.md, "Who owns what").
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("batch", "interval", "never")


@dataclass(frozen=True, slots=True)
class FsyncPolicy:
    mode: str = "interval"
    interval_s: float = 1.0
    off_loop: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"spool fsync must be 'batch', 'interval' or 'never', "
                             f"not {self.mode!r}")
        if not self.interval_s >= 0:        # 0: every append (the setting allows it)
            raise ValueError(f"spool fsync interval must be >= 0, not {self.interval_s!r}")

    @property
    def syncs(self) -> bool:
        """The cursor logs, the state file and a new segment's directory entry are synced
        (not under ``"never"``; seals are, whatever the mode)."""
        return self.mode != "never"

    @property
    def owner_syncs_batches(self) -> bool:
        """``"batch"`` off the loop: appends do not sync; the owner awaits
        ``Spool.sync_async`` before it answers (a group commit)."""
        return self.mode == "batch" and self.off_loop

    @property
    def run_syncs_interval(self) -> bool:
        """``"interval"`` off the loop: ``Spool.run`` fdatasyncs, in a worker thread."""
        return self.mode == "interval" and self.off_loop

    @property
    def writeback(self) -> bool:
        """Appends hand their bytes to the kernel's writeback as they go (``"interval"``:
        else the interval's fdatasync writes a second of appends at once)."""
        return self.mode == "interval"

    @property
    def seals_off_loop(self) -> bool:
        """Segment seals may run off the loop (nothing else syncs on it)."""
        return self.mode == "never" or self.off_loop

    def append_syncs(self, since_sync_s: float) -> bool:
        """An append fdatasyncs itself, ``since_sync_s`` after the last fdatasync."""
        if self.off_loop:
            return False
        return self.mode == "batch" or (self.mode == "interval"
                                        and since_sync_s >= self.interval_s)

    def interval_due(self, unsynced: bool, since_sync_s: float) -> bool:
        """``"interval"``: appends are not on disk and the interval is over."""
        return self.mode == "interval" and unsynced and since_sync_s >= self.interval_s

    def tick_syncs_interval(self) -> bool:
        """``Spool.tick`` (on the loop) does the interval fdatasync."""
        return not self.off_loop

    def tick_syncs_cursors(self, since_cursor_sync_s: float) -> bool:
        """``Spool.tick`` fdatasyncs the cursor logs: every tick for ``"batch"``, once an
        interval for ``"interval"`` inline (off the loop ``Spool.run`` does)."""
        return self.mode == "batch" or (self.mode == "interval" and not self.off_loop
                                        and since_cursor_sync_s >= self.interval_s)

    def run_syncs_cursors(self, since_cursor_sync_s: float) -> bool:
        """``Spool.run`` fdatasyncs the cursor logs, in a worker thread."""
        return self.run_syncs_interval and since_cursor_sync_s >= self.interval_s
