"""The C segment walk of the Spark data source (spool/_segscan.c) gives exactly the
batches and counts of the Python walk, on good, malformed and damaged segments."""

import os
import random

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from conftest import require_native  # noqa: E402
from logjam_relay.outputs.archive import Archive  # noqa: E402
from logjam_relay.pipeline import decode as ds  # noqa: E402
from logjam_relay.pipeline import sample  # noqa: E402
from logjam_relay.spool import segment as fmt  # noqa: E402
from logjam_relay.spool.api import KIND_SAMWISE  # noqa: E402
from logjam_relay.spool.spool import Spool  # noqa: E402


@pytest.fixture(scope="module")
def segment(tmp_path_factory):
    require_native(ds._segscan, "logjam_relay.spool._segscan")
    d = tmp_path_factory.mktemp("segscan")
    msgs = sample.make_messages(3000, malformed=True, gaps=True)
    archive = Archive(str(d / "archive"), None, fsync=False)
    sp = Spool(str(d / "spool"), readers=[], segment_bytes=64 << 20, fsync="never",
               on_seal=archive.on_seal)
    try:
        for k in range(0, len(msgs), 250):
            sp.append_batch([m.frames() for m in msgs[k:k + 250]])
            # records the data source must skip or report: another kind, wrong frame counts
            sp.append_records([(KIND_SAMWISE, [b"b1", b"120", b"publish"]),
                               (0, [b"only-two", b"frames"]), (0, []),
                               (0, [b"a-b", b"logs", b"{}", b"short meta"]),
                               (0, [b"ab-c", b"x", b"{}", bytes(24)])])
        sp.seal()
    finally:
        sp.close()
    (segno, path), = ds.list_segments(str(d / "archive"))
    return segno, path


def frame_lengths_off(data: bytes, off: int) -> bytes:
    """``data`` with the record at ``off``'s first frame length one too long, its CRC
    fixed: only the check that the frame lengths add up finds it."""
    b = bytearray(data)
    body_len = int.from_bytes(b[off:off + 4], "little")
    first = int.from_bytes(b[off + 20:off + 24], "little")
    b[off + 20:off + 24] = (first + 1).to_bytes(4, "little")
    b[off + 4:off + 8] = fmt.crc32(bytes(b[off + 8:off + 8 + body_len])).to_bytes(4, "little")
    return bytes(b)


def both(path, segno, start=0, stop=None, batch_rows=700):
    out = []
    for fn in (ds._decode_segment_c, ds.decode_segment_py):
        st = ds.DecodeStats()
        batches = list(fn(path, segno, start, stop, batch_rows, st))
        out.append((pa.Table.from_batches(batches, schema=ds.ARROW_SCHEMA), st))
    (tc, sc), (tp, sp_) = out
    assert tc.num_rows == tp.num_rows
    assert tc.to_pylist() == tp.to_pylist()
    assert sc == sp_
    return tc, sc


def test_whole_segment_and_slices_match(segment):
    segno, path = segment
    table, st = both(path, segno)
    errors = {e for e in table.column("error").to_pylist() if e}
    assert {"frames", "meta", "decompress"} <= errors          # the odd records are there
    assert st.skipped_kinds >= 12 and st.corrupt == 0             # 12 samwise records
    n = table.num_rows
    for start, stop in ((0, 1), (5, 900), (n - 3, None), (n, None), (100, 100)):
        both(path, segno, start, stop, batch_rows=64)


def test_damaged_copies_match(segment, tmp_path):
    segno, path = segment
    data = open(path, "rb").read()
    offsets = [off for off, *_ in fmt.iter_records(path)]
    rng = random.Random(7)
    copy = tmp_path / os.path.basename(path)
    cases = [data[:fmt.HEADER_LEN - 1], data[:fmt.HEADER_LEN], data[:-1], data[:-30]]
    for off in rng.sample(offsets, 6):
        cases += [data[:off + k] for k in (1, 7, 8, 19, 20, 21, 40)]
    for _ in range(25):                                      # flipped bytes anywhere
        b = bytearray(data)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        cases.append(bytes(b))
    b = bytearray(data)                                      # a huge body length
    b[offsets[3]:offsets[3] + 4] = (2 ** 31).to_bytes(4, "little")
    cases.append(bytes(b))
    cases.append(frame_lengths_off(data, offsets[40]))
    reasons = set()
    for case in cases:
        copy.write_bytes(case)
        table, st = both(str(copy), segno)
        reasons |= {e for e in table.column("error").to_pylist() if e and e.startswith("corrupt")}
    assert {"corrupt:torn", "corrupt:crc", "corrupt:bad_length",
            "corrupt:frame_lengths"} <= reasons, reasons


# ------------------------------------------------------------ the loss table's meta walk

def meta_both(path, chunks=(1 << 20,)):
    """decode.meta_arrays (the C scan_meta, reading ``chunks`` bytes at a time) and its
    reference from decode_segment_py: the same arrays and counters."""
    np = pytest.importorskip("numpy")
    if not ds.META_WALK_IN_C:
        require_native(None, "logjam_relay.spool._segscan (scan_meta)")
    out = []
    for fn in ([lambda p, st, c=c: ds.meta_arrays(p, st, chunk=c) for c in chunks] +
               [lambda p, st: ds.meta_arrays_py(p, st, decode=ds.decode_segment_py)]):
        st = ds.DecodeStats()
        out.append((fn(path, st), st))
    ap, sp_ = out[-1]
    for ac, sc in out[:-1]:
        for c, p in zip(ac, ap, strict=True):
            assert c.dtype == np.int64 and p.dtype == np.int64
            assert np.array_equal(c, p)
        assert sc == sp_
    return ap, sp_


def test_meta_walk_matches_decode(segment):
    segno, path = segment
    # the C walk's window slides over records that straddle its reads, or grows to hold
    # a record longer than a read
    (dev, seq, created), st = meta_both(path, chunks=(1, 20, 37, 700, 4096, 1 << 20))
    table, _ = both(path, segno)
    good = [r for r in table.to_pylist() if r["device"] is not None]
    assert len(dev) == len(good) > 2000 and st.bad_records > 0
    assert dev.tolist() == [r["device"] for r in good]
    assert seq.tolist() == [r["sequence"] for r in good]
    assert created.tolist() == [r["created_ms"] for r in good]


def test_meta_walk_damaged_copies_match(segment, tmp_path):
    """Torn, truncated, flipped-bit copies: the C meta walk stops and skips exactly where
    the Python walk does (same arrays, same counters)."""
    segno, path = segment
    data = open(path, "rb").read()
    offsets = [off for off, *_ in fmt.iter_records(path)]
    rng = random.Random(11)
    copy = tmp_path / os.path.basename(path)
    cases = [b"", data[:fmt.HEADER_LEN - 1], data[:fmt.HEADER_LEN], data[:-1], data[:-30]]
    for off in rng.sample(offsets, 6):
        cases += [data[:off + k] for k in (0, 1, 7, 8, 19, 20, 21, 40)]
    for _ in range(40):                                      # flipped bytes anywhere
        b = bytearray(data)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        cases.append(bytes(b))
    for k in range(3):                        # a damaged meta frame (the last), CRC fixed
        b = bytearray(data)
        off = offsets[50 + k]
        body_len = int.from_bytes(b[off:off + 4], "little")
        b[off + 8 + body_len - 24 + (0, 3, 5)[k]] ^= 0xFF    # tag, version, device
        b[off + 4:off + 8] = fmt.crc32(bytes(b[off + 8:off + 8 + body_len])).to_bytes(
            4, "little")
        cases.append(bytes(b))
    b = bytearray(data)                                      # a huge body length
    b[offsets[3]:offsets[3] + 4] = (2 ** 31).to_bytes(4, "little")
    cases.append(bytes(b))
    cases.append(frame_lengths_off(data, offsets[40]))
    full, _ = meta_both(path)
    corrupt = shorter = 0
    for case in cases:
        copy.write_bytes(case)
        arrays, st = meta_both(str(copy), chunks=(64, 1 << 20))
        corrupt += st.corrupt
        shorter += len(arrays[0]) < len(full[0])
    assert corrupt > 20 and shorter > 20


def test_meta_walk_unreadable(tmp_path):
    with pytest.raises(OSError):
        ds.meta_arrays(str(tmp_path / "missing.seg"))
    with pytest.raises(OSError):
        ds.meta_arrays_py(str(tmp_path / "missing.seg"))


def test_meta_walk_file_shorter_than_told(segment, tmp_path):
    """A file that ends before the size scan_meta was given (truncated during the walk)
    is walked as the shorter file: no hang, no read past its end."""
    segno, path = segment
    data = open(path, "rb").read()
    copy = tmp_path / "short.seg"
    for cut in (30, 1, len(data) // 2, len(data) - fmt.HEADER_LEN - 5):
        copy.write_bytes(data[:len(data) - cut])
        with open(copy, "rb", buffering=0) as f:
            for chunk in (64, 1 << 20):
                told = ds._segscan.scan_meta(f.fileno(), fmt.HEADER_LEN, len(data), chunk)
                true = ds._segscan.scan_meta(f.fileno(), fmt.HEADER_LEN, len(data) - cut,
                                             chunk)
                assert told == true and told[6] in ("torn", "no_seal")
