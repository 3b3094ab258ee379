"""The C body decoder (pipeline/_bodies.c: zlib, snappy raw, lz4 block, UTF-8 check)
against the Python path (pipeline/bodies.py: zlib / cramjam / python-lz4, Arrow's UTF-8
validation): crafted and random bodies, truncated and mutated ones, bombs and huge declared
sizes, and whole segments through both decoders.  No Spark needed."""

import json
import random
import struct
import zlib

import pytest

np = pytest.importorskip("numpy")
pa = pytest.importorskip("pyarrow")
lz4_block = pytest.importorskip("lz4.block")
cramjam = pytest.importorskip("cramjam")

from conftest import require_native  # noqa: E402
from logjam_relay.pipeline import bodies as bd  # noqa: E402
from logjam_relay.pipeline import decode as dec  # noqa: E402
from logjam_relay.pipeline import sample  # noqa: E402
from logjam_relay.pipeline.stats import SCAN_DDL  # noqa: E402
from logjam_relay.protocols.logjam import MAX_DECOMPRESSED  # noqa: E402
from zlib_cases import damaged_stream  # noqa: E402

NONE, ZLIB, SNAPPY, LZ4 = 0, 1, 2, 3


@pytest.fixture(autouse=True)
def native():
    require_native(bd._bodies_c, "logjam_relay.pipeline._bodies")


def z(b: bytes) -> bytes:
    return zlib.compress(b)


def sn(b: bytes) -> bytes:
    return bytes(cramjam.snappy.compress_raw(b))


def l4(b: bytes, m: int | None = None) -> bytes:
    return struct.pack(">I", len(b) if m is None else m) + lz4_block.compress(b, store_size=False)


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


#: lz4 blocks (with the 4-byte length) no compressor writes -- offset 0, matches into the
#: last bytes -- that LZ4_decompress_safe still decodes (or refuses) its own way
ODD_LZ4_BLOCKS = [
    b"\x00\x00\x00\x18\x80abcdefgh\x00\x00\xc0" + b"x" * 12,
    b"\x00\x00\x00\x18\x80abcdefgh\x08\x00\xc0" + b"x" * 12,
    b"\x00\x00\x00\x0c\x80abcdefgh\x08\x00\x00",
    b"\x00\x00\x00\x0d\x80abcdefgh\x08\x00\x10z",
    b"\x00\x00\x00\x20\x8fabcdefgh\x08\x00\x05\x00",
    b"\x00\x00\x00\x14\x4fabcd\x04\x00\x01\x00",
]


def python_rows(buf: bytes, rows: np.ndarray) -> tuple[list, dict]:
    """The Python loop of decode.py: bodies (or None) and errors."""
    mv = memoryview(buf)
    out, errors = [], {}
    for i, (_p, code, _m, r, lb) in enumerate(rows.tolist()):
        if code == -1:
            errors[i] = "meta"
        elif code == -2:
            errors[i] = "frames"
        elif code == 0:
            out.append(buf[r:r + lb])
            continue
        else:
            try:
                out.append(bd.decompress_body(buf, mv, r, r + lb, code))
                continue
            except Exception:
                errors[i] = "decompress"
        out.append(None)
    return out, errors


def compare(cases: list[tuple[int, bytes]]):
    """Both paths over one batch of (code, body) rows (code -1/-2: bad meta/frames)."""
    buf = bytearray(b"H" * 16)
    rows = []
    for code, body in cases:
        rows.append((0, code, 0, len(buf), len(body)))
        buf += body
        buf += b"\x00\x01\x02\x03"          # what follows a body in a segment: the meta
    buf = bytes(buf)
    rows = np.array(rows, dtype=np.int64).reshape(-1, 5)
    err_c: dict = {}
    col_c = bd.batch_bodies(buf, rows.tobytes(), 0, len(rows), err_c)
    bodies, err_p = python_rows(buf, rows)
    col_p = bd.string_array(bodies, err_p)
    col_c.validate(full=True)
    assert err_c == err_p, [(i, cases[i][0], cases[i][1][:40], err_c.get(i), err_p.get(i))
                            for i in set(err_c) ^ set(err_p) or
                            [k for k in err_c if err_c[k] != err_p.get(k)]][:5]
    a, b = col_c.to_pylist(), col_p.to_pylist()
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x == y, (i, cases[i][0], cases[i][1][:40])
    return err_c


TEXT = [b"", b"x", b'{"action":"Orders#index","total_time":12.5}', "caf\u00e9 \U0001F600".encode(),
        bytes(range(32, 127)) * 40, b"a" * 100_000, "\u00e9\u4e2d".encode() * 5000]
BAD_UTF8 = [b"\xc3\x28", b"\xc0\x80", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
            b"\xf8\x88\x80\x80\x80", b"\x80", b"ab\xe2\x82", b"\xff", b"ok\xf0\x9f\x98",
            b"x" * 20 + b"\xc3", b"\xef\xbf\xbf\xf4\x8f\xbf\xbf"]     # last two: edge / valid


def test_valid_bodies_every_method():
    cases = []
    for t in TEXT:
        cases += [(NONE, t), (ZLIB, z(t)), (SNAPPY, sn(t)), (LZ4, l4(t))]
    errs = compare(cases)
    assert errs == {}


def test_utf8_checked_after_decompression():
    cases = []
    for t in BAD_UTF8:
        for c, f in ((NONE, bytes), (ZLIB, z), (SNAPPY, sn), (LZ4, l4)):
            cases.append((c, f(t)))
    errs = compare(cases)
    assert set(errs.values()) == {"utf8"} and len(errs) >= 4 * 10


def test_bad_meta_frames_unknown_method_and_garbage():
    cases = [(-1, b"x"), (-2, b""), (9, b"{}"), (255, b""),
             (ZLIB, b""), (ZLIB, b"\x00not zlib at all"), (ZLIB, z(b"abc")[:-1]),
             (ZLIB, z(b"abc") + b"trailing"), (ZLIB, zlib.compress(b"x", wbits=31)),
             (ZLIB, zlib.compress(b"raw", wbits=-15)),
             (SNAPPY, b""), (SNAPPY, b"\xff\xff\xff\xff\x0fgarbage"), (SNAPPY, b"\x05"),
             (SNAPPY, b"\x03\x08ab"), (SNAPPY, b"\x04\x04a\x01\x00"),       # offset 0
             (SNAPPY, b"\x05\x04a\x05\x02"),                                 # offset > out
             (SNAPPY, b"\x02\xf0\x00a"), (SNAPPY, b"\x02\xf0\x01ab\x00"),    # 61+ literal
             (SNAPPY, b"\x80\x80\x80\x80\x80\x00"),                          # 6-byte varint
             (SNAPPY, b"\x81\x80\x80\x80\x80\x00a"),
             (SNAPPY, b"\x80" * 11 + b"\x00"),
             (LZ4, b""), (LZ4, b"\x00\x00\x00"), (LZ4, b"\x00\x00\x00\x10\x01"),
             (LZ4, b"\x00\x00\x00\x00\x00"), (LZ4, b"\x00\x00\x00\x00"),
             (LZ4, b"\x00\x00\x00\x00\x00\x00"), (LZ4, b"\x00\x00\x00\x01\x10a"),
             (LZ4, b"\x00\x00\x00\x02\x10a"), (LZ4, l4(b"hello world", 12)),
             (LZ4, l4(b"hello world", 10)), (LZ4, l4(b"a" * 100)[:-1]),
             # offset 0 and matches into the last bytes: blocks no compressor writes
             *((LZ4, b) for b in ODD_LZ4_BLOCKS)]
    errs = compare(cases)
    assert errs[0] == "meta" and errs[1] == "frames" and errs[2] == "decompress"


def test_truncations_and_mutations_random():
    rng = random.Random(5)
    base = [t for t in TEXT if len(t) < 5000] + [
        sample_body(rng) for _ in range(30)]
    cases = []
    for t in base:
        for c, f in ((ZLIB, z), (SNAPPY, sn), (LZ4, l4)):
            good = f(t)
            for cut in sorted({0, 1, 2, 3, 4, 5, len(good) // 2, len(good) - 1}):
                if cut < len(good):
                    cases.append((c, good[:cut]))
            for _ in range(12):
                b = bytearray(good)
                for _k in range(rng.randint(1, 3)):
                    op = rng.random()
                    p = rng.randrange(len(b)) if b else 0
                    if op < 0.6 and b:
                        b[p] = rng.randrange(256)
                    elif op < 0.8:
                        b[p:p] = bytes([rng.randrange(256)])
                    elif b:
                        del b[p]
                cases.append((c, bytes(b)))
    for _ in range(600):
        cases.append((rng.choice((ZLIB, SNAPPY, LZ4, NONE)),
                      bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))))
    for k in range(0, len(cases), 500):
        compare(cases[k:k + 500])


def sample_body(rng: random.Random) -> bytes:
    words = [b"Orders#index", b"total_time", b"\xc3\xa9", b"{", b"}", b'"', b"12.5", b" "]
    return b"".join(rng.choice(words) for _ in range(rng.randint(1, 200)))


def test_limit_bombs_and_declared_sizes(monkeypatch):
    """The limit as the Python path applies it (with a small limit: the same code paths)."""
    lim = 100_000
    monkeypatch.setattr(bd, "MAX_DECOMPRESSED", lim)
    monkeypatch.setattr(bd, "_SMALL_ZLIB", lim // 1100)
    monkeypatch.setattr(bd, "_SMALL_SNAPPY", lim // 64)
    rnd = random.Random(3).randbytes
    cases = []
    for size in (lim - 1, lim, lim + 1, 10 * lim):
        for payload in (b"a" * size, rnd(size // 2).hex().encode()[:size]):
            cases += [(ZLIB, z(payload)), (SNAPPY, sn(payload)), (LZ4, l4(payload))]
    cases += [(SNAPPY, varint(lim + 1) + b"\x00"), (SNAPPY, varint(2 ** 32 - 1) + b"\x00"),
              (SNAPPY, varint(2 ** 33) + b"\x00"), (SNAPPY, varint(lim) + sn(b"a" * 10)[1:]),
              (LZ4, struct.pack(">I", lim + 1) + b"\x00"), (LZ4, b"\xff\xff\xff\xff\x00"),
              (LZ4, struct.pack(">I", lim) + b"\x10a")]
    errs = compare(cases)
    assert errs and set(errs.values()) == {"decompress"}


def test_real_limit_bomb():
    """A 64 MiB + 1 byte zlib body (65 KB on the wire) is refused for its row only."""
    bomb = z(bytes(MAX_DECOMPRESSED + 1))
    errs = compare([(ZLIB, bomb), (NONE, b"ok"), (LZ4, struct.pack(">I", MAX_DECOMPRESSED + 1)
                                                   + b"\x00"),
                    (SNAPPY, varint(MAX_DECOMPRESSED + 1) + b"\x00" * 100)])
    assert errs == {0: "decompress", 2: "decompress", 3: "decompress"}


def _agent_body(rng: random.Random, i: int) -> bytes:
    """A logjam agent's request body of 300 B to 6 KB (what zlib writes a dynamic block for)."""
    lines = [[rng.randint(0, 5), f"2026-11-27T10:00:{i % 60:02d}.{rng.randint(0, 999999):06d}",
              "Processing by Orders#show as HTML " + "\u00e9x" * rng.randint(0, 30)
              + rng.randbytes(rng.randint(0, 40)).hex()]
             for _ in range(rng.randint(1, 30))]
    return json.dumps({"action": f"Orders#show{i % 7}", "total_time": rng.random() * 900,
                       "code": rng.choice((200, 302, 404, 500)), "lines": lines,
                       "request_id": rng.randbytes(16).hex()}).encode()


def test_fast_zlib_path_same_rows_and_used():
    """zlib bodies through libdeflate where it and zlib agree (_fastinflate.h, the guard
    the JVM reader's path uses too; tests/test_pipeline_jinflate.py tests it alone):
    intact, damaged after the block header (the guard admits them, libdeflate refuses,
    zlib decides), cut short and extended bodies, at zlib levels 1, 6 and 9 and two
    windows: the rows equal the Python path's, and the same decoder's with zlib alone;
    the path is used where libdeflate is installed (always under CI)."""
    import os
    on, before = bd._bodies_c.fast_zlib()
    if not on:
        if os.environ.get("CI"):
            pytest.fail("libdeflate must be installed under CI (the fast zlib path)")
        pytest.skip("no libdeflate on this machine: zlib alone")
    rng = random.Random(29)
    cases = []
    for i in range(1500):
        body = _agent_body(rng, i)
        c = zlib.compressobj(rng.choice((1, 6, 9)), zlib.DEFLATED, rng.choice((15, 12)))
        cases.append((ZLIB, damaged_stream(rng, c.compress(body) + c.flush(), i % 6)))
    cases += [(ZLIB, z(bytes(70_000))), (ZLIB, z(rng.randbytes(70_000)))]    # over 64 KiB
    errs = compare(cases)
    on_errs, after = errs, bd._bodies_c.fast_zlib()[1]
    assert after - before >= 400, (before, after)      # used, not only loaded
    assert 300 < len(on_errs) < 1200, len(on_errs)
    try:
        assert bd._bodies_c.fast_zlib(False) == (False, after)
        off_errs = compare(cases)
        assert bd._bodies_c.fast_zlib()[1] == after
    finally:
        bd._bodies_c.fast_zlib(True)
    assert on_errs == off_errs


def test_fast_zlib_path_small_limit(monkeypatch):
    """A decompression limit under the fast path's 64 KiB: bodies that inflate to the limit
    less one, the limit and one more go the Python path's way, with the fast path and
    without (where it is in use it answers the first two)."""
    lim = 2000
    monkeypatch.setattr(bd, "MAX_DECOMPRESSED", lim)
    monkeypatch.setattr(bd, "_SMALL_ZLIB", 1)
    rng = random.Random(8)
    cases = []
    for size in (lim - 1, lim, lim + 1):
        body = json.dumps({"pad": rng.randbytes(2000).hex()}).encode()[:size]
        assert len(body) == size
        cases.append((ZLIB, z(body)))
    on, before = bd._bodies_c.fast_zlib()
    errs = compare(cases)
    assert errs == {2: "decompress"}, errs
    if on:
        assert bd._bodies_c.fast_zlib()[1] - before == 2
    try:
        bd._bodies_c.fast_zlib(False)
        assert compare(cases) == errs
    finally:
        bd._bodies_c.fast_zlib(True)


def test_fast_zlib_path_in_version_and_switch():
    """``--version`` says which zlib path the pipeline's decoders have, and
    LOGJAM_RELAY_NATIVE_INFLATE=0 (read at import) turns the fast one off."""
    import os
    import subprocess
    import sys
    on = bd._bodies_c.fast_zlib()[0]
    if not on and os.environ.get("CI"):
        pytest.fail("libdeflate must be installed under CI (the fast zlib path)")
    for env, want in (({}, on), ({"LOGJAM_RELAY_NATIVE_INFLATE": "0"}, False)):
        r = subprocess.run([sys.executable, "-m", "logjam_relay", "--version"],
                           capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, **env))
        assert r.returncode == 0, r.stderr
        text = ("zlib bodies: libdeflate where zlib agrees" if want else
                "zlib bodies: zlib alone (no libdeflate found, or LOGJAM_RELAY_NATIVE_INFLATE=0)")
        assert text in r.stdout, (env, r.stdout)


def test_rows_out_of_range_refused():
    rows = np.zeros((3, 5), dtype=np.int64).tobytes()
    with pytest.raises(ValueError):
        bd._bodies_c.bodies(b"x", rows, 2, 2, 10)
    # a row pointing outside the buffer is a decompress error, never a read past it
    rows = np.array([[0, 0, 0, 5, 100], [0, 1, 0, -1, 3]], dtype=np.int64).tobytes()
    offs, data, status = bd._bodies_c.bodies(b"0123456789", rows, 0, 2, 10)
    assert list(status) == [3, 3] and data == b""


def make_segment(tmp_path, msgs):
    sample.write_archive(str(tmp_path / "spool"), str(tmp_path / "arch"), msgs,
                         segment_bytes=64 << 20)
    (segno, path), = dec.list_segments(str(tmp_path / "arch"))
    return segno, path


@pytest.mark.parametrize("columns", [None, [c.split()[0] for c in SCAN_DDL.split(", ")],
                                     ["body", "error", "record"]])
def test_segments_c_and_python_equal(tmp_path, columns):
    require_native(dec._segscan, "logjam_relay.spool._segscan")
    rng = random.Random(11)
    msgs = sample.make_messages(3000, malformed=True, gaps=True)
    for i in range(0, len(msgs), 7):        # damage bodies in every method
        m = msgs[i]
        b = bytearray(m.body)
        choice = rng.random()
        if choice < 0.3 and b:
            del b[rng.randrange(len(b)):]
        elif choice < 0.6 and b:
            b[rng.randrange(len(b))] ^= 0xFF
        elif choice < 0.8:
            b += b"\xc3"
        else:
            m.comp = rng.choice((0, 1, 2, 3, 7))
        m.body = bytes(b)
    segno, path = make_segment(tmp_path, msgs)
    out = []
    for fn in (dec._decode_segment_c, dec.decode_segment_py):
        st = dec.DecodeStats()
        batches = list(fn(path, segno, 0, None, 512, st, columns))
        out.append((pa.Table.from_batches(batches), st))
    (tc, sc), (tp, sp) = out
    assert tc.equals(tp)
    assert sc == sp
    if columns is None or "error" in columns:
        errors = set(tc.column("error").to_pylist())
        assert {"decompress", "utf8"} <= errors


_RSS_SCRIPT = r"""
import resource, struct, sys, zlib
import numpy as np
from logjam_relay.pipeline import bodies as bd
from logjam_relay.protocols.logjam import MAX_DECOMPRESSED
native = sys.argv[1] == "c"
assert (bd._bodies_c is not None) == native, "the path asked for is not the one in use"
bombs = int(sys.argv[2])
zbomb = zlib.compress(bytes(MAX_DECOMPRESSED + 1))
cases = []
for i in range(bombs):
    cases += [(1, zbomb), (0, b'{"ok": %d}' % i), (3, struct.pack(">I", MAX_DECOMPRESSED) + b"\x00")]
buf = bytearray(b"H" * 16)
rows = []
for code, body in cases:
    rows.append((0, code, 0, len(buf), len(body)))
    buf += body + b"\x00\x01\x02\x03"
buf = bytes(buf)
rows = np.array(rows, dtype=np.int64).reshape(-1, 5).tobytes()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
errors = {}
if native:
    col = bd.batch_bodies(buf, rows, 0, len(cases), errors)
else:                                   # decode.py's loop without the extension
    mv, out = memoryview(buf), []
    for i, (_p, code, _m, r, lb) in enumerate(np.frombuffer(rows, np.int64).reshape(-1, 5).tolist()):
        try:
            out.append(bd.decompress_body(buf, mv, r, r + lb, code) if code else buf[r:r + lb])
        except Exception:
            errors[i] = "decompress"
            out.append(None)
    col = bd.string_array(out, errors)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert sorted(errors) == [i for i in range(len(cases)) if i % 3 != 1], errors
assert col.to_pylist()[1::3] == ['{"ok": %d}' % i for i in range(bombs)]
print("grew_kib", peak - before, "limit_kib", MAX_DECOMPRESSED // 1024)
"""


@pytest.mark.parametrize("path", ["c", "python"])
def test_a_batch_of_bombs_costs_one_limit_of_memory_not_one_per_bomb(path, tmp_path):
    """Peak RSS of a real process decoding one batch with 12 zlib bombs (64 MiB + 1 each
    once inflated, 65 KB on the wire) and 12 lz4 bodies declaring 64 MiB: each is refused
    for its row, and the batch's peak grows by at most three limits, not by 12: the
    native path (GIL released, its own buffers) and the Python path alike.  Measured here:
    the C path 63 MiB (one limit: the inflate buffer of the bomb in hand), the Python path
    127 MiB (zlib's output grows by copying); 12 retained bombs would be 768 MiB."""
    import os
    import subprocess
    import sys
    env = dict(os.environ)
    if path == "python":
        env["LOGJAM_RELAY_PURE_PYTHON"] = "1"
    else:
        env.pop("LOGJAM_RELAY_PURE_PYTHON", None)
    r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, path, "12"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    grew, limit = (int(x) for x in r.stdout.split()[1::2])
    assert grew <= 3 * limit, f"{path}: the batch's peak RSS grew by {grew} KiB"
