"""The incremental loss state (pipeline/loss.py) and the stream reader's refusal of
segments that appear below its position.  No Spark session needed."""

import os
import shutil

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from logjam_relay.pipeline import sample, stats  # noqa: E402
from logjam_relay.pipeline.datasource import LateSegment, LogjamStreamReader  # noqa: E402
from logjam_relay.pipeline.loss import LossState  # noqa: E402
from spool_helpers import damage_segments  # noqa: E402


def ref_loss(msgs):
    recs = [{"app_env": m.app_env.decode(), "topic": m.topic.decode(), "body": None,
             "device": m.device, "sequence": m.sequence, "created_ms": m.created_ms}
            for m in msgs]
    return {(r["device"], r["minute_ms"]): r for r in stats.reference_tables(recs)["loss"]}


def state_rows(state):
    t = state.table().to_pylist()
    return {(r["device"], r["minute_ms"]): r for r in t}


@pytest.mark.parametrize("chunks", [1, 7, 97])
def test_incremental_equals_whole(tmp_path, chunks):
    msgs = sample.make_messages(3000, seed=9, devices=(1, 2, 3))
    # more disorder: a late block of old numbers and repeated duplicates
    msgs += [msgs[i] for i in range(100, 160, 3)]
    n = len(msgs)
    dev = np.array([m.device for m in msgs])
    seq = np.array([m.sequence for m in msgs])
    created = np.array([m.created_ms for m in msgs])
    minute = created - created % 60000
    bounds = sorted({0, n, *np.linspace(0, n, chunks + 1).astype(int).tolist()})
    path = str(tmp_path / "state.npz")
    state = LossState()
    changed_all = {}
    for b, (a, z) in enumerate(zip(bounds, bounds[1:], strict=False)):
        # arrival order = (segment, record): one "segment" per chunk, shuffled inside it
        rec = np.arange(a, z)
        perm = np.random.default_rng(b).permutation(z - a)
        changed = state.update(dev[a:z][perm], seq[a:z][perm], np.full(z - a, b),
                               rec[perm], minute[a:z][perm])
        for d, ms in changed.items():
            changed_all.setdefault(d, set()).update(ms)
        state.save(path, b)                  # and back, as after a restart
        state, last = LossState.load(path)
        assert last == b
    want = ref_loss(msgs)
    got = state_rows(state)
    assert got.keys() == want.keys()
    for k, w in want.items():
        for col in ("received", "missing", "duplicates", "out_of_order", "first_sequence",
                    "last_sequence"):
            assert got[k][col] == w[col], (k, col, got[k][col], w[col])
    assert sum(r["missing"] for r in got.values()) > 0
    assert {(d, m) for d, ms in changed_all.items() for m in ms} == set(want)


def test_filled_gap_changes_an_old_minute():
    """A late number filling a gap changes the `missing` of the minute where the gap
    started: the changed minutes say so (the streaming pipeline rewrites that date)."""
    s = LossState()
    s.update([1, 1], [1, 5], [0, 0], [0, 1], [0, 60000])
    assert state_rows(s)[(1, 0)]["missing"] == 3
    changed = s.update([1], [3], [1], [0], [120000])
    assert changed == {1: {0, 120000}}
    rows = state_rows(s)
    assert rows[(1, 0)]["missing"] == 1 and rows[(1, 120000)]["missing"] == 1
    assert rows[(1, 120000)]["out_of_order"] == 1


def test_stream_reader_refuses_a_late_segment(tmp_path):
    msgs = sample.make_messages(2000, seed=4)
    sample.write_archive(tmp_path / "spool", tmp_path / "a", msgs, segment_bytes=64 << 10)
    names = sorted(os.listdir(tmp_path / "a"))
    assert len(names) >= 3
    held = tmp_path / names[1]
    shutil.move(tmp_path / "a" / names[1], held)      # segment 2 arrives late
    r = LogjamStreamReader({"path": str(tmp_path / "a")})
    end = r.latestOffset(r.initialOffset(), r.getDefaultReadLimit())
    assert int(end["segment"]) > int(names[1].split(".")[0])
    assert r.latestOffset(end, r.getDefaultReadLimit()) == end     # nothing new: fine
    shutil.move(held, tmp_path / "a" / names[1])
    r2 = LogjamStreamReader({"path": str(tmp_path / "a")})         # e.g. after a restart
    with pytest.raises(LateSegment, match="late segment: 1 segment"):
        r2.latestOffset(end, r2.getDefaultReadLimit())


def test_archive_walk_equals_reference_with_damage(tmp_path, monkeypatch):
    """LossState.add_archive (the C meta walk, decode.meta_arrays) over several segments,
    some damaged (torn, a flipped bit, a bad header, one gone): the reference loss of the
    records the Python decoder gives, and the same state as the walk over decoded
    batches (the fallback without the C walk)."""
    from logjam_relay.pipeline import decode as ds
    msgs = sample.make_messages(6000, seed=12, devices=(1, 2, 3, 4, 5))
    msgs += [msgs[i] for i in range(4000, 4300, 7)]           # late duplicates
    arch = tmp_path / "a"
    sample.write_archive(tmp_path / "spool", arch, msgs, segment_bytes=64 << 10)
    segs = ds.list_segments(str(arch))
    assert len(segs) >= 8
    damage_segments(segs)
    os.remove(segs[6][1])                                         # listed, then gone
    listed = list(segs)
    monkeypatch.setattr(ds, "list_segments", lambda _d: list(listed))

    states = {}
    for name, in_c, decode in (("c", True, None), ("batches", False, None),
                               ("python", False, ds.decode_segment_py)):
        if in_c and not ds.META_WALK_IN_C:
            continue
        monkeypatch.setattr(ds, "META_WALK_IN_C", in_c)
        if decode is not None:
            monkeypatch.setattr(ds, "decode_segment", decode)
        s = LossState()
        counts = s.add_archive(str(arch))
        states[name] = (counts, state_rows(s))
    first = next(iter(states.values()))
    for v in states.values():
        assert v == first
    counts, got = first
    assert counts["bad_records"] == 3               # one error row per damaged segment

    # the reference: every record the Python decoder gives, in (segment, record) order
    recs = []
    for segno, path in listed:
        try:
            for bt in ds.decode_segment_py(path, segno, columns=("device", "sequence",
                                                                 "created_ms")):
                for r in bt.to_pylist():
                    if r["device"] is not None:
                        recs.append({"app_env": "a-b", "topic": "x", "body": None, **r})
        except OSError:
            continue
    assert 0 < len(recs) < len(msgs)
    want = {(r["device"], r["minute_ms"]): r for r in stats.reference_tables(recs)["loss"]}
    assert got.keys() == want.keys()
    for k, w in want.items():
        for col in ("received", "missing", "duplicates", "out_of_order", "first_sequence",
                    "last_sequence"):
            assert got[k][col] == w[col], (k, col, got[k][col], w[col])


@pytest.mark.parametrize("devices", [1, 2, 9])
def test_add_ordered_equals_update(devices):
    """add_ordered (the archive walk's: records already in arrival order, split by device
    with a stable sort) gives the state update gives (which sorts by arrival first)."""
    rng = np.random.default_rng(devices)
    a, b = LossState(), LossState()
    seqs = {}
    for part in range(5):
        n = int(rng.integers(0, 400))
        dev = rng.integers(1, devices + 1, n)
        seq = np.empty(n, dtype=np.int64)
        for i, d in enumerate(dev.tolist()):          # mostly rising, some gaps and repeats
            seqs[d] = seqs.get(d, 0) + int(rng.choice([1, 1, 1, 2, 5, 0, -3]))
            seq[i] = seqs[d]
        minute = (np.arange(n) // 50 + part * 10) * 60000
        a.add_ordered(dev, seq, minute)
        b.update(dev, seq, np.full(n, part), np.arange(n), minute, track=False)
    assert state_rows(a) == state_rows(b) and state_rows(a)


def _expand(lo, cnt):
    return np.concatenate([np.arange(a, a + c, dtype=np.int64) for a, c in zip(lo, cnt, strict=True)]) \
        if len(lo) else np.empty(0, dtype=np.int64)


def _device_state(d):
    return (d.lo.tolist(), d.hi.tolist(), d.hm.tolist(), sorted(d.rows.items()))


@pytest.mark.parametrize("seed", range(6))
def test_update_runs_equals_update_of_the_expanded_records(seed):
    """DeviceLoss.update_runs (the jvm engine's runs: per device, consecutive numbers in
    one minute) leaves the state update leaves given the records the runs stand for: in
    the fast path (every number above all seen before, gaps between runs and runs that
    join) and in the expanded one (duplicates, numbers below the highest, overlaps with
    earlier batches)."""
    from logjam_relay.pipeline.loss import DeviceLoss
    rng = np.random.default_rng(seed)
    a, b = DeviceLoss(), DeviceLoss()
    top = 0
    fast = slow = 0
    for batch in range(12):
        k = int(rng.integers(0, 40))
        lo, cnt, mn = [], [], []
        minute = batch * 60000
        disorder = rng.random() < 0.4
        for _ in range(k):
            c = int(rng.integers(1, 9))
            if disorder and rng.random() < 0.3:
                start = int(rng.integers(max(1, top - 50), top + 5))    # repeats, late
            else:
                start = top + int(rng.choice([1, 1, 1, 2, 4]))              # rising, gaps
            lo.append(start)
            cnt.append(c)
            top = max(top, start + c - 1)
            if rng.random() < 0.3:
                minute += 60000
            mn.append(minute)
        lo, cnt, mn = (np.array(x, dtype=np.int64) for x in (lo, cnt, mn))
        hi = lo + cnt - 1
        rising = len(lo) == 0 or (bool((lo[1:] > hi[:-1]).all())
                                  and (not len(a.lo) or lo[0] > a.hi[-1]))
        fast += rising and len(lo) > 0
        slow += not rising
        a.update_runs(lo, cnt, mn)
        b.update(_expand(lo, cnt), np.repeat(mn, cnt), False)
        assert _device_state(a) == _device_state(b), batch
    assert fast and slow            # both paths were taken
    assert any(r[1] for r in a.rows.values()) and any(r[2] for r in a.rows.values())


def _entry(segno, start, stop, ended, over, devs):
    body = [segno, start, stop, int(ended), int(over), 0, len(devs)]
    for dev, runs in devs:
        body += [dev, len(runs)] + [x for r in runs for x in r]
    return body


def _blob(entries):
    out = [len(entries)]
    for e in entries:
        out += [len(e)] + e
    return np.array(out, dtype="<i8").tobytes()


def test_parse_runs_and_what_covers_a_segment():
    from logjam_relay.pipeline.loss import covered, parse_runs
    blob = _blob([
        _entry(3, 0, -1, True, False, [(1, [(10, 5, 60000)]), (2, [(1, 2, 0), (7, 1, 0)])]),
        _entry(4, 100, 200, True, False, [(1, [(300, 1, 0)])]),
        _entry(4, 0, 100, False, False, [(1, [(200, 100, 0)]), (9, [(5, 5, 0)])]),
        _entry(5, 0, 100, False, False, []),                 # stopped at its end: no last
        _entry(6, 0, -1, True, True, []),                    # overflow
        _entry(7, 0, 50, False, False, []), _entry(7, 60, -1, True, False, [])])   # hole
    by = parse_runs(blob)
    assert sorted(by) == [3, 4, 5, 6, 7]
    d3 = covered(by[3])
    assert [(d, lo.tolist(), c.tolist(), m.tolist()) for d, lo, c, m in d3] == [
        (1, [10], [5], [60000]), (2, [1, 7], [2, 1], [0, 0])]
    d4 = {d: (lo.tolist(), c.tolist()) for d, lo, c, _m in covered(by[4])}
    assert d4 == {1: ([200, 300], [100, 1]), 9: ([5], [5])}     # slices in record order
    assert covered(by[5]) is None and covered(by[6]) is None and covered(by[7]) is None
    assert covered(()) is None and parse_runs(b"") == {}
    for bad in (blob[:-8], blob + b"\0" * 8, _blob([[1, 2, 3]]),
                _blob([_entry(1, 0, -1, True, False, [(1, [(5, 0, 0)])])]),     # 0 records
                _blob([_entry(1, 0, -1, True, False, [(1, [(1, 1, 0)])])[:-1]])):
        with pytest.raises(ValueError):
            parse_runs(bad)
