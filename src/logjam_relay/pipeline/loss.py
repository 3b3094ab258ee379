"""The loss report, incrementally: per device, what has been seen so far, in numpy.

One implementation serves both modes: the batch pipeline runs :meth:`DeviceLoss.update`
once per device over all its records (a grouped Arrow function on the executors), the
streaming pipeline keeps one :class:`LossState` between micro-batches and feeds it only the
records of each committed batch, so the loss table is never rebuilt from all records.

Definitions (``docs/pipeline.md``, same as :func:`.reference.reference_tables`), per
device, records in arrival order ``(segment, record)``; rows per minute of ``created_ms``:
``received``; ``duplicates`` (number seen before); ``out_of_order`` (first arrival of a
number below one seen before); ``missing`` (numbers absent between consecutive distinct
numbers, counted at the minute of the first arrival of the lower one); ``first_sequence``,
``last_sequence``; ``skipped`` (numbers a relay declared it never used: the restart marker
after a crash, :meth:`DeviceLoss.declare`; they are neither received nor missing).

State per device: the distinct numbers seen, as sorted disjoint runs ``[lo, hi]`` with the
first-arrival minute of ``hi`` (the only one a gap is ever counted at), so it grows with the
number of gaps, not of records; plus the per-minute counters.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .minutes import minutes_of

ROW_FIELDS = ("received", "duplicates", "out_of_order", "first_sequence", "last_sequence",
              "skipped")
OUT_SCHEMA = pa.schema([
    ("device", pa.int64()), ("minute_ms", pa.int64()), ("received", pa.int64()),
    ("missing", pa.int64()), ("duplicates", pa.int64()), ("out_of_order", pa.int64()),
    ("first_sequence", pa.int64()), ("last_sequence", pa.int64()), ("skipped", pa.int64()),
])
OUT_DDL = ("device long, minute_ms long, received long, missing long, duplicates long, "
           "out_of_order long, first_sequence long, last_sequence long, skipped long")
_NONE = np.iinfo(np.int64).max
_E = np.empty(0, dtype=np.int64)


class DeviceLoss:
    __slots__ = ("lo", "hi", "hm", "rows")

    def __init__(self):
        self.lo = self.hi = self.hm = _E          # runs of distinct numbers
        self.rows: dict[int, list[int]] = {}      # minute -> received, dup, ooo, first,
        #                                           last, skipped

    def missing(self) -> dict[int, int]:
        """minute -> numbers missing after the runs ending in that minute."""
        if len(self.lo) < 2:
            return {}
        gaps = self.lo[1:] - self.hi[:-1] - 1
        out: dict[int, int] = {}
        for m, g in zip(self.hm[:-1].tolist(), gaps.tolist(), strict=True):
            out[m] = out.get(m, 0) + g
        return out

    def gaps(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The missing numbers as ranges: ``(first, last, minute)`` int64 arrays, one entry
        per gap between the runs seen (``minute``: where :meth:`missing` counts it)."""
        if len(self.lo) < 2:
            return _E, _E, _E
        return self.hi[:-1] + 1, self.lo[1:] - 1, self.hm[:-1].copy()

    def declare(self, lo: int, hi: int, minute: int) -> int:
        """Numbers ``lo .. hi`` that the relay declared it never used (its restart marker
        after a crash, ``docs/fleet.md``): they join the runs seen, so they are not missing,
        and the part not seen before is counted as ``skipped`` at ``minute``.  Returns that
        count."""
        if hi < lo:
            return 0
        # the pieces of [lo, hi] that no run covers yet
        pieces_lo, pieces_hi = [], []
        at = lo
        if len(self.lo):
            k = int(np.searchsorted(self.hi, lo, side="left"))
            while at <= hi and k < len(self.lo):
                a, b = int(self.lo[k]), int(self.hi[k])
                if a > hi:
                    break
                if a > at:
                    pieces_lo.append(at)
                    pieces_hi.append(a - 1)
                at = max(at, b + 1)
                k += 1
        if at <= hi:
            pieces_lo.append(at)
            pieces_hi.append(hi)
        if not pieces_lo:
            return 0
        plo = np.array(pieces_lo, dtype=np.int64)
        phi = np.array(pieces_hi, dtype=np.int64)
        lo_all = np.concatenate([self.lo, plo])
        hi_all = np.concatenate([self.hi, phi])
        hm_all = np.concatenate([self.hm, np.full(len(plo), minute, dtype=np.int64)])
        o = np.argsort(lo_all, kind="stable")
        self._join_runs(lo_all[o], hi_all[o], hm_all[o])
        n = int((phi - plo + 1).sum())
        r = self.rows.get(minute)
        if r is None:
            self.rows[minute] = [0, 0, 0, _NONE, -_NONE - 1, n]
        else:
            r[5] += n
        return n

    def update(self, seq: np.ndarray, minute: np.ndarray, track: bool = True,
               dups: list | None = None) -> set[int]:
        """Add records (arrays in arrival order); return the minutes whose row changed
        (with ``track``; else only the minutes of the records).  ``dups``: a list that gets
        the boolean mask of the records whose number was seen before (the copies that
        :mod:`.origin` leaves out of the tables)."""
        n = len(seq)
        if n == 0:
            return set()
        seq = np.asarray(seq, dtype=np.int64)
        minute = np.asarray(minute, dtype=np.int64)
        before = self.missing() if track else {}
        # seen before this batch?
        if len(self.lo):
            k = np.searchsorted(self.lo, seq, side="right") - 1
            in_old = (k >= 0) & (seq <= self.hi[np.maximum(k, 0)])
            old_max = int(self.hi[-1])
        else:
            in_old = np.zeros(n, dtype=bool)
            old_max = None
        # ... or earlier in this batch (first arrival of each number)
        by = np.argsort(seq, kind="stable")
        s = seq[by]
        first = np.ones(n, dtype=bool)
        first[1:] = s[1:] != s[:-1]
        first_in_batch = np.zeros(n, dtype=bool)
        first_in_batch[by[first]] = True
        dup = in_old | ~first_in_batch
        if dups is not None:
            dups.append(dup)
        # out of order: a new number below the highest seen before it
        runmax = np.maximum.accumulate(seq)
        prev = np.empty(n, dtype=np.int64)
        prev[1:] = runmax[:-1]
        has_prev = np.ones(n, dtype=bool)
        if old_max is None:
            has_prev[0] = False
            prev[0] = 0
        else:
            prev[0] = old_max
            prev = np.maximum(prev, old_max)
        ooo = ~dup & has_prev & (seq < prev)
        # merge the new distinct numbers into the runs
        new = ~dup
        lo = np.concatenate([self.lo, seq[new]])
        hi = np.concatenate([self.hi, seq[new]])
        hm = np.concatenate([self.hm, minute[new]])
        o = np.argsort(lo, kind="stable")
        self._join_runs(lo[o], hi[o], hm[o])
        # per-minute counters
        mins, inv = np.unique(minute, return_inverse=True)
        self._add_rows(mins, inv, np.bincount(inv), np.bincount(inv, weights=dup),
                       np.bincount(inv, weights=ooo), seq, seq)
        changed = set(mins.tolist())
        if track:
            after = self.missing()
            changed.update(m for m in set(before) | set(after)
                           if before.get(m) != after.get(m))
        return changed

    def update_runs(self, lo: np.ndarray, count: np.ndarray, minute: np.ndarray) -> None:
        """As :meth:`update` (``track`` False) of the records that the runs expand to, in
        arrival order: run ``i`` is the numbers ``lo[i] .. lo[i] + count[i] - 1``, one
        after the other, all in minute ``minute[i]`` (:class:`LossRuns` of the JVM
        reader).  The usual case -- every number above all seen before -- costs per run,
        not per record; anything else (duplicates, numbers out of order) is expanded and
        goes through :meth:`update`."""
        if len(lo) == 0:
            return
        lo = np.asarray(lo, dtype=np.int64)
        count = np.asarray(count, dtype=np.int64)
        minute = np.asarray(minute, dtype=np.int64)
        hi = lo + (count - 1)
        rising = bool((lo[1:] > hi[:-1]).all()) and (not len(self.lo) or lo[0] > self.hi[-1])
        if not rising or bool((hi < lo).any()):
            total = int(count.sum())
            starts = np.repeat(np.cumsum(count) - count, count)
            seq = np.repeat(lo, count) + (np.arange(total, dtype=np.int64) - starts)
            self.update(seq, np.repeat(minute, count), False)
            return
        # no duplicates, nothing out of order: the runs join the seen numbers as they are
        self._join_runs(np.concatenate([self.lo, lo]), np.concatenate([self.hi, hi]),
                        np.concatenate([self.hm, minute]))
        mins, inv = np.unique(minute, return_inverse=True)
        none = np.zeros(len(mins), dtype=np.int64)
        self._add_rows(mins, inv, np.bincount(inv, weights=count), none, none, lo, hi)

    def _join_runs(self, lo: np.ndarray, hi: np.ndarray, hm: np.ndarray) -> None:
        """The state's runs from runs sorted by ``lo`` (disjoint): adjacent ones joined,
        each keeping the first-arrival minute of its ``hi``."""
        brk = np.ones(len(lo), dtype=bool)
        brk[1:] = lo[1:] != hi[:-1] + 1
        starts = np.flatnonzero(brk)
        ends = np.append(starts[1:], len(lo)) - 1
        self.lo, self.hi, self.hm = lo[starts], hi[ends], hm[ends]

    def _add_rows(self, mins, inv, cnt, dups, ooos, first, last) -> None:
        """Add to the rows of minutes ``mins`` (``inv``: each record's or run's index in
        ``mins``) the counts per minute and the lowest ``first`` / highest ``last``."""
        fst = np.full(len(mins), np.iinfo(np.int64).max, dtype=np.int64)
        lst = np.full(len(mins), np.iinfo(np.int64).min, dtype=np.int64)
        np.minimum.at(fst, inv, first)
        np.maximum.at(lst, inv, last)
        rows = self.rows
        for m, c, d, q, f, la in zip(mins.tolist(), np.asarray(cnt, np.int64).tolist(),
                                     np.asarray(dups, np.int64).tolist(),
                                     np.asarray(ooos, np.int64).tolist(), fst.tolist(),
                                     lst.tolist(), strict=True):
            r = rows.get(m)
            if r is None:
                rows[m] = [c, d, q, f, la, 0]
            else:
                r[0] += c
                r[1] += d
                r[2] += q
                r[3] = min(r[3], f)
                r[4] = max(r[4], la)

    def table(self, device: int, minutes=None) -> dict[str, list]:
        miss = self.missing()
        out: dict[str, list] = {f.name: [] for f in OUT_SCHEMA}
        for m in sorted(self.rows if minutes is None else minutes):
            r = self.rows.get(m)
            if r is None:
                continue
            out["device"].append(device)
            out["minute_ms"].append(m)
            out["received"].append(r[0])
            out["missing"].append(miss.get(m, 0))
            out["duplicates"].append(r[1])
            out["out_of_order"].append(r[2])
            out["first_sequence"].append(r[3] if r[0] else None)
            out["last_sequence"].append(r[4] if r[0] else None)
            out["skipped"].append(r[5])
        return out


def state_arrays(d: DeviceLoss, key: str) -> dict[str, np.ndarray]:
    """``d``'s runs and rows as the arrays ``KEY_runs`` and ``KEY_rows`` of a ``.npz``
    state file (:func:`write_npz`, :func:`read_state`)."""
    return {f"{key}_runs": np.stack([d.lo, d.hi, d.hm]) if len(d.lo) else
            np.empty((3, 0), dtype=np.int64),
            f"{key}_rows": np.array([[m, *r] for m, r in sorted(d.rows.items())],
                                    dtype=np.int64).reshape(-1, 1 + len(ROW_FIELDS))}


def read_state(z, key: str) -> DeviceLoss:
    """The :class:`DeviceLoss` that :func:`state_arrays` saved under ``key``."""
    d = DeviceLoss()
    runs = z[f"{key}_runs"]
    d.lo, d.hi, d.hm = (runs[0].copy(), runs[1].copy(), runs[2].copy())
    # (a state saved before ``skipped`` existed has one column less)
    d.rows = {int(r[0]): ([int(x) for x in r[1:]] + [0])[:len(ROW_FIELDS)]
              for r in z[f"{key}_rows"]}
    return d


def write_npz(path: str, arrays: dict) -> None:
    """``arrays`` into the ``.npz`` file ``path``, replaced atomically once synced."""
    import os
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def parse_runs(blob: bytes) -> dict[int, list[tuple]]:
    """The entries of ``LossRuns.take`` (little-endian int64s: count, then per entry its
    length and the entry ``segment, start, stop, ended, overflow, records, devices, then
    per device: device, runs, (lo, count, minute) per run``) by segment:
    ``{segment: [(start, stop, ended, overflow, [(device, lo, count, minute), ...])]}``
    with numpy arrays for lo, count, minute.  A malformed blob raises ValueError."""
    a = np.frombuffer(blob, dtype="<i8")
    if len(a) == 0:
        return {}
    out: dict[int, list[tuple]] = {}
    n, k = int(a[0]), 1
    for _ in range(n):
        ln = int(a[k])
        e = a[k + 1:k + 1 + ln]
        k += 1 + ln
        if ln < 7 or len(e) != ln:
            raise ValueError("loss runs: truncated entry")
        segno, start, stop, ended, over, _records, ndev = (int(x) for x in e[:7])
        devs = []
        j = 7
        for _ in range(ndev):
            dev, nr = int(e[j]), int(e[j + 1])
            t = e[j + 2:j + 2 + 3 * nr]
            if len(t) != 3 * nr:
                raise ValueError("loss runs: truncated device")
            t = t.reshape(-1, 3)
            if nr and int(t[:, 1].min()) < 1:
                raise ValueError("loss runs: a run of no records")
            devs.append((dev, t[:, 0], t[:, 1], t[:, 2]))
            j += 2 + 3 * nr
        if j != ln:
            raise ValueError("loss runs: entry length mismatch")
        out.setdefault(segno, []).append((start, stop, bool(ended), bool(over), devs))
    if k != len(a):
        raise ValueError("loss runs: trailing data")
    return out


def covered(entries) -> list[tuple] | None:
    """The runs of one segment's entries (:func:`parse_runs`) in arrival order, per device
    ``(device, lo, count, minute)`` with a device's runs of consecutive slices joined;
    None unless the slices start at record 0, each starts where the one before stopped,
    none overflowed and the last one reached the end of the segment."""
    if not entries:
        return None
    entries = sorted(entries, key=lambda e: e[0])
    at = 0
    for i, (start, stop, ended, over, _d) in enumerate(entries):
        if over or start != at:
            return None
        if i == len(entries) - 1:
            if not ended:
                return None
        elif ended or stop < 0:
            return None      # a slice that ended the segment, then more slices: odd
        at = stop
    if len(entries) == 1:
        return entries[0][4]
    per: dict[int, list] = {}
    for *_x, devs in entries:
        for dev, lo, cnt, mn in devs:
            per.setdefault(dev, []).append((lo, cnt, mn))
    return [(dev, np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
             np.concatenate([p[2] for p in parts])) for dev, parts in per.items()]


def arrival_order(segment, record) -> np.ndarray:
    return np.lexsort((np.asarray(record), np.asarray(segment)))


class LossState:
    """All devices, for the streaming pipeline; saved as one ``.npz`` file."""

    def __init__(self):
        self.devices: dict[int, DeviceLoss] = {}

    def update(self, device, sequence, segment, record, minute_ms,
               track: bool = True) -> dict[int, set[int]]:
        """Records of one committed micro-batch (any order: sorted here by arrival);
        returns device -> changed minutes."""
        device = np.asarray(device, dtype=np.int64)
        o = arrival_order(segment, record)
        device, seq, minute = device[o], np.asarray(sequence)[o], np.asarray(minute_ms)[o]
        changed = {}
        for dev in np.unique(device).tolist():
            sel = device == dev
            d = self.devices.setdefault(dev, DeviceLoss())
            changed[dev] = d.update(seq[sel], minute[sel], track)
        return changed

    def add_archive(self, input_dir: str) -> dict[str, int]:
        """Batch mode: every segment of an archive directory, in number order, meta frames
        only (bodies are not decompressed); returns the decode counters.  The walk is
        :func:`.decode.meta_arrays` (in C when built): per segment, three int64 arrays
        of the records in arrival order, exactly the rows :func:`.decode.decode_segment`
        gives with a device and a created_ms (damaged records and the rest of a damaged
        segment are skipped as there)."""
        from .decode import DecodeStats, list_segments, meta_arrays
        st = DecodeStats()
        for _segno, path in list_segments(input_dir):
            try:
                dev, seq, created = meta_arrays(path, st)
            except OSError:
                continue      # vanished/unreadable: the scan reports it as a row
            self.add_ordered(dev, seq, minutes_of(created))
        return {"records": st.records, "bad_records": st.bad_records}

    def add_archive_runs(self, input_dir: str, blob: bytes) -> dict[str, int]:
        """Batch mode, as :meth:`add_archive`, from the runs the JVM reader gathered while
        it aggregated the requests (``blob``: ``LossRuns.take``, see :func:`parse_runs`):
        the archive is not read again.  A segment the runs do not cover whole (a partition
        with too many runs, slices that do not join up, a segment the scan did not see) is
        walked here as :meth:`add_archive` walks it.  Returns ``segments`` (from runs) and
        ``walked`` (read here)."""
        from .decode import DecodeStats, list_segments, meta_arrays
        by_seg = parse_runs(blob)
        st = DecodeStats()
        used = walked = 0
        for segno, path in list_segments(input_dir):
            devices = covered(by_seg.get(segno, ()))
            if devices is not None:
                for dev, lo, cnt, mn in devices:
                    self.devices.setdefault(dev, DeviceLoss()).update_runs(lo, cnt, mn)
                used += 1
                continue
            walked += 1
            try:
                dev, seq, created = meta_arrays(path, st)
            except OSError:
                continue      # vanished/unreadable: the scan reports it as a row
            self.add_ordered(dev, seq, minutes_of(created))
        return {"segments": used, "walked": walked}

    def add_ordered(self, device, sequence, minute_ms) -> None:
        """Records already in arrival order (one segment's, in record order): as
        :meth:`update` with ``track`` False, without the sort by arrival."""
        n = len(device)
        if n == 0:
            return
        device = np.asarray(device, dtype=np.int64)
        sequence = np.asarray(sequence, dtype=np.int64)
        minute_ms = np.asarray(minute_ms, dtype=np.int64)
        devs = self.devices
        d0 = int(device[0])
        if device[-1] == d0 and (device == d0).all():
            devs.setdefault(d0, DeviceLoss()).update(sequence, minute_ms, False)
            return
        # group by device, keeping the arrival order inside each (stable sort)
        o = np.argsort(device, kind="stable")
        dsorted = device[o]
        cut = np.flatnonzero(dsorted[1:] != dsorted[:-1]) + 1
        starts = np.concatenate(([0], cut))
        ends = np.concatenate((cut, [n]))
        seq_o, min_o = sequence[o], minute_ms[o]
        for dev, a, z in zip(dsorted[starts].tolist(), starts.tolist(), ends.tolist(),
                             strict=True):
            devs.setdefault(dev, DeviceLoss()).update(seq_o[a:z], min_o[a:z], False)

    def table(self, minutes_by_device=None) -> pa.Table:
        parts = [pa.table(d.table(dev, None if minutes_by_device is None
                                  else minutes_by_device.get(dev, ())), schema=OUT_SCHEMA)
                 for dev, d in sorted(self.devices.items())]
        return pa.concat_tables(parts) if parts else OUT_SCHEMA.empty_table()

    def save(self, path: str, batch: int) -> None:
        arrays = {"batch": np.array([batch], dtype=np.int64)}
        for dev, d in self.devices.items():
            arrays.update(state_arrays(d, str(dev)))
        write_npz(path, arrays)

    @classmethod
    def load(cls, path: str) -> tuple[LossState, int]:
        """(state, last batch included); an empty state and -1 when there is none."""
        st = cls()
        try:
            z = np.load(path)
        except FileNotFoundError:
            return st, -1
        with z:
            batch = int(z["batch"][0])
            for key in z.files:
                if not key.endswith("_runs"):
                    continue
                dev = int(key[:-5])
                st.devices[dev] = read_state(z, str(dev))
        return st, batch
