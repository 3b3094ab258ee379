"""The JVM reader of the ``logjam`` format (pipeline/jvm/logjamrelay/spark/*.java) against
the Python decoder (pipeline/decode.py): the same rows, row for row and column for column,
on healthy, malformed, damaged, sliced and pruned reads; streaming and extracted fields
handed to the Python source; the Java constants; the fallback when the jar cannot be built.

One Spark session for the module (``spark``), small archives.  The Python side is computed
in the driver by the Python data source's own reader (``LogjamBatchReader``: the C walk when
built) and by ``decode_segment_py`` (the walk the Java code ports), and where it matters by
``format("logjam_python")`` through Spark.
"""

import collections
import json
import logging
import os
import random
import shutil
import struct
import zlib

import pytest

pa = pytest.importorskip("pyarrow")
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
pytest.importorskip("pyspark")

from conftest import local_spark_session  # noqa: E402
from logjam_relay.pipeline import datasource as ds  # noqa: E402
from logjam_relay.pipeline import decode as dec  # noqa: E402
from logjam_relay.pipeline import jvmreader, sample  # noqa: E402
from logjam_relay.protocols.logjam import MAX_DECOMPRESSED, compress  # noqa: E402
from logjam_relay.spool import segment as fmt  # noqa: E402
from test_pipeline_bodies import ODD_LZ4_BLOCKS  # noqa: E402
from test_pipeline_bodies import varint as _varint  # noqa: E402  (snappy length prefixes)
from zlib_cases import damaged_stream  # noqa: E402

NONE, ZLIB, SNAPPY, LZ4 = 0, 1, 2, 3
COLS = list(dec.BASE_COLUMNS)
CREATED = 1_700_006_220_000


# ============================================================================ helpers

def meta(comp=NONE, device=1, created=CREATED, seq=1, tag=0xCABD, ver=1) -> bytes:
    return sample.META.pack(tag, comp, ver, device, created, seq)


def write_segment(directory, segno: int, records, *, seal: bool = True,
                  first_seq: int = 1000) -> tuple[str, bytes, list[int]]:
    """A segment file of ``(kind, frames)`` records (sealed unless told): its path, bytes
    and the offset of every record (the seal record last, when there is one)."""
    data = bytearray(fmt.encode_header(segno, CREATED, first_seq))
    offsets = []
    for k, rec in enumerate(records):
        offsets.append(len(data))
        data += fmt.encode_records([rec], first_seq + k)
    if seal:
        offsets.append(len(data))
        data += fmt.encode_seal(first_seq + len(records), len(records), len(data), CREATED + 1)
    path = os.path.join(str(directory), fmt.segment_name(segno, True))
    with open(path, "wb") as f:
        f.write(data)
    return path, bytes(data), offsets


def put(directory, segno: int, data: bytes) -> str:
    path = os.path.join(str(directory), fmt.segment_name(segno, True))
    with open(path, "wb") as f:
        f.write(data)
    return path


def recrc(b: bytearray, off: int) -> None:
    """Give the record at ``off`` a valid CRC again (after changing its bytes)."""
    body_len = struct.unpack_from("<I", b, off)[0]
    struct.pack_into("<I", b, off + 4, fmt.crc32(bytes(b[off + 8:off + 8 + body_len])))


def header_crc(b: bytearray) -> None:
    struct.pack_into("<I", b, 36, fmt.crc32(bytes(b[:36])))


def py_rows(d, columns=None, per: int = 0, batch_rows: int = dec.DEFAULT_BATCH_ROWS,
            walk: str = "source") -> list[tuple]:
    """The Python data source's rows, read in the driver: its reader's partitions (slices
    of ``per`` records) and ``read`` (``walk`` "source": decode_slice, the C walk when
    built), or the same partitions through ``decode_segment_py`` ("py")."""
    r = ds.LogjamBatchReader({"path": str(d), "recordsperpartition": str(per),
                              "batchrows": str(batch_rows)},
                             None if columns is None else tuple(columns))
    out = []
    for part in r.partitions():
        if walk == "source":
            batches = r.read(part)
        else:
            batches = _py_slice(part, batch_rows, r.columns)
        for b in batches:
            out.extend(tuple(x.values()) for x in b.to_pylist())
    return out


def _py_slice(part, batch_rows, columns):
    """decode_slice's unreadable-file row around ``decode_segment_py``."""
    try:
        yield from dec.decode_segment_py(part.path, part.segno, part.start, part.stop,
                                         batch_rows, None, columns)
    except OSError as e:
        yield dec._error_batch(part.segno, part.start, "unreadable",
                               {"path": part.path, "message": str(e)}, dec.DecodeStats(),
                               columns or dec.BASE_COLUMNS)


def jvm_df(spark, d, **options):
    rd = spark.read.format("logjam")
    for k, v in options.items():
        rd = rd.option(k, str(v))
    return rd.load(str(d))


def collect(df) -> list[tuple]:
    return [tuple(r) for r in df.collect()]


def _sort_key(names):
    first = [names.index(c) for c in ("segment", "record", "error") if c in names]
    order = first + [i for i in range(len(names)) if i not in first]

    def key(row):
        return tuple((1, 0) if row[i] is None else (0, row[i]) for i in order)
    return key


def assert_same_rows(names, jvm: list[tuple], py: list[tuple], what: str = ""):
    """Equal as sorted lists of row tuples (sort key segment, record, error, the rest)."""
    key = _sort_key(list(names))
    a, b = sorted(jvm, key=key), sorted(py, key=key)
    if a != b:
        ca, cb = collections.Counter(a), collections.Counter(b)
        only_jvm = sorted(ca - cb, key=key)[:6]
        only_py = sorted(cb - ca, key=key)[:6]
        pytest.fail(f"{what}: JVM {len(a)} rows, Python {len(b)} rows; columns {list(names)}"
                    f"\nonly JVM:    {only_jvm}\nonly Python: {only_py}")


def check_against_python(spark, d, per: int = 0, **options) -> list[tuple]:
    """JVM rows of ``d`` (all columns) == the Python source's == decode_segment_py's."""
    opts = dict(options)
    if per:
        opts["recordsPerPartition"] = per
    df = jvm_df(spark, d, **opts)
    assert df.columns == COLS
    jvm = collect(df)
    assert_same_rows(COLS, jvm, py_rows(d, per=per), f"{d} per={per} vs Python source")
    assert_same_rows(COLS, jvm, py_rows(d, per=per, walk="py"),
                     f"{d} per={per} vs decode_segment_py")
    return jvm


def by(rows, col):
    i = COLS.index(col)
    return [r[i] for r in rows]


def as_dicts(rows) -> list[dict]:
    return [dict(zip(COLS, r, strict=True)) for r in rows]


def plan(df) -> str:
    return df._jdf.queryExecution().executedPlan().toString()


# ============================================================================ archives

@pytest.fixture(scope="module")
def spark():
    s = local_spark_session("logjam-relay-jvm-tests")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """Six segments (one per append batch of 500), all four compressions, no bad record."""
    d = tmp_path_factory.mktemp("jvm_healthy")
    msgs = sample.make_messages(3000, seed=5, malformed=False)
    sample.write_archive(d / "spool", d / "archive", msgs, segment_bytes=64 << 10)
    return str(d / "archive"), msgs


def _z(b: bytes) -> bytes:
    return zlib.compress(b)


def _l4(b: bytes, m: int | None = None) -> bytes:
    c = compress(b, LZ4)
    return c if m is None else struct.pack(">I", m) + c[4:]


BAD_UTF8 = [b"\xc3\x28", b"\xc0\x80", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
            b"\xf8\x88\x80\x80\x80", b"\x80", b"ab\xe2\x82", b"\xff", b"ok\xf0\x9f\x98",
            b'{"a":"x"}' + b"\xc3"]
GOOD_TEXT = [b"", b"x", b'{"action":"Orders#index","total_time":12.5}',
             "caf\u00e9 \U0001F600 \u4e2d".encode(), b"\xef\xbf\xbf\xf4\x8f\xbf\xbf",
             bytes(range(32, 127)) * 30]
APP_ENVS = [b"shop-production", b"noenv", b"\xff\xfe", b"caf\xc3-prod", b"app-\xe2\x82",
            b"-", b"", b"a-b-c", b"\xf0\x9f\x98-e", b"\xc3\xa9t\xc3\xa9-pr\xc3\xa9",
            b"a\x00b-c\x00", b"\xe0\x80\x80-\xf8\x88\x80\x80\x80", b"\xf0\x90\x80-\xc2"]
TOPICS = [b"logs.shop.production", b"logs.\xff", b"\xc0\x80", b"", b"t\xe2\x82-x"]
#: UTF-16 surrogates encoded in UTF-8 (ED A0..BF xx): invalid, replaced by U+FFFD
SURROGATES = [b"x-\xed\xa0\x80", b"\xed\xbf\xbf-prod", b"a\xed\xa0-b", b"\xed\xb0\x80"]


def odd_records() -> list[tuple[int, list[bytes]]]:
    """Every kind of record the decoder must turn into a row (or skip): bad metas, frame
    counts, bodies that do not decompress or are not UTF-8, odd app-env / topic bytes,
    other record kinds, extreme meta values."""
    recs: list[tuple[int, list[bytes]]] = []
    seq = 0

    def lj(body, comp=NONE, app_env=b"shop-production", topic=b"logs.shop.production",
           m=None, **kw):
        nonlocal seq
        seq += 1
        recs.append((0, [app_env, topic, body, m if m is not None else
                         meta(comp, seq=seq, device=seq % 3, **kw)]))

    for t in GOOD_TEXT:                               # valid, every method
        for c in (NONE, ZLIB, SNAPPY, LZ4):
            lj(compress(t, c), c)
    recs.append((1, [b"b1", b"120", b"publish"]))      # other kinds between logjam records
    for t in BAD_UTF8:                                # not UTF-8 after decompression
        for c in (NONE, ZLIB, SNAPPY, LZ4):
            lj(compress(t, c), c)
    recs.append((1, []))
    recs.append((7, [b"x"]))
    # bodies that do not decompress (every method), unknown methods
    for c, b in [(ZLIB, b""), (ZLIB, b"\x00not zlib at all"), (ZLIB, _z(b"abc")[:-1]),
                 (ZLIB, zlib.compress(b"x", wbits=31)), (ZLIB, zlib.compress(b"r", wbits=-15)),
                 (ZLIB, _z(b"abc")[:-4] + b"\x00\x00\x00\x00"),
                 (SNAPPY, b""), (SNAPPY, b"\xff\xff\xff\xff\x0fgarbage"), (SNAPPY, b"\x05"),
                 (SNAPPY, b"\x03\x08ab"), (SNAPPY, b"\x04\x04a\x01\x00"),
                 (SNAPPY, b"\x05\x04a\x05\x02"), (SNAPPY, b"\x02\xf0\x00a"),
                 (SNAPPY, b"\x80\x80\x80\x80\x80\x00"), (SNAPPY, b"\x80" * 11 + b"\x00"),
                 (SNAPPY, _varint(MAX_DECOMPRESSED + 1) + b"\x00" * 100),
                 (LZ4, b""), (LZ4, b"\x00\x00"), (LZ4, b"\x00\x00\x00"),
                 (LZ4, b"\x00\x00\x00\x10\x01"), (LZ4, b"\x00\x00\x00\x00"),
                 (LZ4, b"\x00\x00\x00\x00\x00\x00"), (LZ4, b"\x00\x00\x00\x02\x10a"),
                 (LZ4, _l4(b"hello world", 12)), (LZ4, _l4(b"hello world", 10)),
                 (LZ4, _l4(b"a" * 100)[:-1]), (LZ4, struct.pack(">I", MAX_DECOMPRESSED + 1) + b"\x00"),
                 (LZ4, b"\xff\xff\xff\xff\x00"),
                 (9, b"{}"), (4, b"{}"), (255, b"")]:
        lj(b, c)
    # decode although odd: zlib with bytes after the stream, an empty lz4 block, LZ4 blocks
    # no compressor writes (offset 0, matches near the end)
    for c, b in [(ZLIB, _z(b"tail") + b"trailing"), (LZ4, b"\x00\x00\x00\x00\x00"),
                 (LZ4, b"\x00\x00\x00\x01\x10a"),
                 *((LZ4, b) for b in ODD_LZ4_BLOCKS),
                 (SNAPPY, b"\x02\xf0\x01ab\x00")]:
        lj(b, c)
    lj(_z(bytes(MAX_DECOMPRESSED + 1)), ZLIB)          # a zlib bomb: over the limit
    # bad meta frames
    for m in [b"short meta", bytes(24), meta(tag=0xCABE), meta(ver=2), meta(ver=0),
              meta() + b"x", meta()[:23], b"", meta(comp=ZLIB, tag=0xBDCA)[:-1]]:
        lj(b"{}", m=m)
    lj(compress(b'{"swapped":1}', ZLIB), m=meta(ZLIB, tag=0xBDCA, seq=77))  # accepted tag
    # not 4 frames
    for frames in ([b"x-y", b"logs.x.y", b"{}"], [b"a-b", b"t", b"{}", meta(), b"fifth"],
                   [], [b"only-one"], [b"\xff\xfe-x", b"t"], [b"", b"", b"", b"", b"", b""]):
        recs.append((0, frames))
    recs.append((254, [b"kind 254", b"", b"", b""]))
    # odd app-env and topic bytes (invalid UTF-8, no '-', empty)
    for ae in APP_ENVS:
        for t in TOPICS:
            lj(compress(b'{"k":1}', ZLIB), ZLIB, app_env=ae, topic=t)
    # (app-env, topic) pairs with the same bytes run together, split differently
    for _ in range(3):
        for ae, t in ((b"a-b", b"cd"), (b"a-bc", b"d"), (b"a-bcd", b""), (b"", b"a-bcd")):
            lj(b"{}", app_env=ae, topic=t)
        recs.append((0, [b"a-bcd"]))
    # extreme meta values
    lj(b"{}", m=meta(device=0xFFFFFFFF, created=2 ** 64 - 1, seq=2 ** 63))
    lj(b"{}", m=meta(device=0, created=0, seq=0))
    lj(b"{}", m=meta(comp=0, device=2 ** 31, created=2 ** 63 - 1, seq=2 ** 64 - 2))
    return recs


def mutated_records(n: int = 700, seed: int = 9) -> list[tuple[int, list[bytes]]]:
    """Compressed bodies truncated, bit-flipped, cut and extended at random."""
    rng = random.Random(seed)
    words = [b"Orders#index", b"total_time", b"\xc3\xa9", b"{", b"}", b'"', b"12.5", b" ",
             b"aaaaaaaa", b"\xe2\x82\xac"]
    recs = []
    for i in range(n):
        payload = b"".join(rng.choice(words) for _ in range(rng.randint(0, 120)))
        c = (ZLIB, SNAPPY, LZ4, NONE)[i % 4]
        b = bytearray(compress(payload, c))
        op = rng.random()
        if op < 0.25 and b:
            del b[rng.randrange(len(b)):]
        elif op < 0.6 and b:
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op < 0.7:
            b += bytes([rng.randrange(256)])
        elif op < 0.8 and b:
            b.insert(rng.randrange(len(b)), rng.randrange(256))
        # else: intact
        recs.append((0, [b"mut-test", b"logs.mut.test", bytes(b), meta(c, seq=i)]))
    return recs


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    d = tmp_path_factory.mktemp("jvm_odd")
    recs = odd_records()
    write_segment(d, 500, recs)
    write_segment(d, 501, mutated_records())
    n = sum(1 for k, _ in recs if k == 0) + 700
    return str(d), n


#: damaged copies: segno -> the error row expected (None: no error row)
DAMAGED: dict[int, str | None] = {}


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    d = tmp_path_factory.mktemp("jvm_damaged")
    scratch = tmp_path_factory.mktemp("jvm_damaged_base")
    recs = []
    for i in range(40):
        c = i % 4
        recs.append((0, [sample.APP_ENVS[i % 4], b"logs.shop.production",
                         compress(b'{"action":"A#b","n":%d}' % i, c), meta(c, seq=i + 1)]))
        if i % 9 == 4:
            recs.append((1, [b"b1", b"120", b"publish"]))
        if i == 20:
            recs.append((0, [b"three-frames", b"t", b"{}"]))
    _, data, offs = write_segment(scratch, 1, recs)
    n = len(offs) - 1                               # records (the seal is offs[-1])
    mid, seal_off = offs[n // 2], offs[-1]
    three = next(offs[k] for k, (kind, f) in enumerate(recs) if kind == 0 and len(f) == 3)
    samwise = next(offs[k] for k, (kind, _) in enumerate(recs) if kind == 1)
    cases: dict[int, tuple[bytes, str | None]] = {}

    def case(segno, b, expect):
        cases[segno] = (bytes(b), expect)

    def flip(off):
        b = bytearray(data)
        b[off] ^= 0xFF
        return b

    case(600, data, None)                                   # intact
    case(601, flip(mid + 30), "corrupt:crc")               # a flipped byte in a record
    case(602, flip(offs[0] + 25), "corrupt:crc")           # ... in the first record
    case(603, flip(offs[n - 1] + 40), "corrupt:crc")        # ... in the last record
    case(604, flip(seal_off + 30), "corrupt:crc")           # ... in the seal record
    case(605, data[:mid + 25], "corrupt:torn")              # cut inside a record
    case(606, data[:mid + 7], "corrupt:torn")               # ... inside its prefix
    case(607, data[:mid + 30], "corrupt:torn")              # ... inside its frame lengths
    case(608, data[:fmt.HEADER_LEN + 10], "corrupt:torn")   # ... inside the first record
    b = bytearray(data)
    struct.pack_into("<I", b, mid, 5)                       # body_len < 12 + 4n
    case(609, b, "corrupt:bad_length")
    b = bytearray(data)
    struct.pack_into("<I", b, mid, 2 ** 31)                 # body_len > MAX_BODY
    case(610, b, "corrupt:bad_length")
    b = bytearray(data)
    struct.pack_into("<H", b, mid + 10, 0xFFFF)             # frame count too large
    recrc(b, mid)
    case(611, b, "corrupt:bad_length")
    b = bytearray(data)                                     # 4 frame lengths, CRC valid
    la, lt = struct.unpack_from("<II", b, mid + 20)
    struct.pack_into("<II", b, mid + 20, la + 1, lt + 2)
    recrc(b, mid)
    case(612, b, "corrupt:frame_lengths")
    b = bytearray(data)                                     # 3 frame lengths, CRC valid
    struct.pack_into("<I", b, three + 20, struct.unpack_from("<I", b, three + 20)[0] + 1)
    recrc(b, three)
    case(613, b, "corrupt:frame_lengths")
    b = bytearray(data)                                     # same in a kind-1 record:
    struct.pack_into("<I", b, samwise + 20, 99)             # skipped, not looked into
    recrc(b, samwise)
    case(614, b, None)
    case(615, data[:seal_off], "corrupt:no_seal")           # ends cleanly, no seal
    case(616, data[:fmt.HEADER_LEN], "corrupt:no_seal")     # a header only
    case(617, data + b"trailing garbage", None)             # bytes after the seal
    case(618, data[:seal_off] + data[seal_off:] + data[offs[0]:offs[3]], None)
    for segno, magic in ((620, b"XJSPOOL\x00"), (621, b"L'SPOOL\x00"), (622, b"L'S\"OOL\\"),
                         (623, b"\xff\x00\t\n\r\x7f'\x80"), (624, b'"JSPOOL\x00')):
        case(segno, magic + data[8:], "corrupt:bad_magic")
    case(625, data[:fmt.HEADER_LEN - 1], "corrupt:short_header")
    case(626, b"", "corrupt:short_header")
    case(627, data[:8], "corrupt:short_header")
    case(628, flip(20), "corrupt:header_crc")              # created; the seal is valid
    case(629, flip(37), "corrupt:header_crc")              # the CRC itself
    for segno, off, val in ((630, 8, 2), (631, 10, 41), (632, 8, 0)):
        b = bytearray(data)
        struct.pack_into("<H", b, off, val)
        header_crc(b)
        case(segno, b, "corrupt:bad_version")
    b = bytearray(data)
    b[mid + 30] ^= 1
    case(633, b[:seal_off], "corrupt:crc")                  # unsealed and damaged
    _, empty, _ = write_segment(scratch, 2, [])             # sealed, no record
    case(634, empty, None)
    case(635, empty[:20] + bytes([empty[20] ^ 1]) + empty[21:], "corrupt:header_crc")
    DAMAGED.clear()
    for segno, (b, expect) in cases.items():
        put(d, segno, b)
        DAMAGED[segno] = expect
    return str(d), n


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, healthy, odd, damaged):
    """Two healthy segments, the odd records and the damaged copies in one directory."""
    d = tmp_path_factory.mktemp("jvm_mixed")
    for segs in (dec.list_segments(healthy[0])[:2], dec.list_segments(odd[0]),
                 dec.list_segments(damaged[0])):
        for _segno, p in segs:
            shutil.copy(p, d / os.path.basename(p))
    return str(d)


# ============================================================================ tests

def test_jvm_reader_is_the_logjam_format(spark, healthy):
    """The comparisons below are the JVM reader against Python, not Python twice."""
    assert jvmreader.loaded(spark)
    d, _ = healthy
    p = plan(jvm_df(spark, d))
    assert "JVM reader" in p, p
    assert "JVM reader" not in plan(spark.read.format("logjam_python").load(d))
    assert "JVM reader" in plan(jvm_df(spark, d, recordsPerPartition=7).select("record"))


def test_healthy_archive(spark, healthy):
    d, msgs = healthy
    assert len(dec.list_segments(d)) >= 5
    jvm = check_against_python(spark, d)
    assert len(jvm) == len(msgs)
    assert set(by(jvm, "compression")) == {"none", "zlib", "snappy", "lz4"}
    assert set(by(jvm, "error")) == {None}
    assert all(b and b.startswith("{") for b in by(jvm, "body"))
    assert sorted(zip(by(jvm, "device"), by(jvm, "sequence"), strict=True)) == \
        sorted((m.device, m.sequence) for m in msgs)
    # no column asked for at all (count)
    assert jvm_df(spark, d).count() == len(msgs)


def test_odd_records(spark, odd):
    d, n = odd
    jvm = check_against_python(spark, d)
    assert len(jvm) == n                                   # kinds 1, 7, 254: no rows
    errors = collections.Counter(by(jvm, "error"))
    assert errors["meta"] >= 9 and errors["frames"] >= 6
    assert errors["decompress"] >= 30 and errors["utf8"] >= 40
    assert errors[None] >= 100
    rows = as_dicts(jvm)
    seg500 = [r for r in rows if r["segment"] == 500]
    assert {r["compression"] for r in seg500} >= {"none", "zlib", "snappy", "lz4",
                                                   "unknown-9", "unknown-255"}
    assert any(r["app"] == "noenv" and r["env"] == "" for r in seg500)
    assert any("\ufffd" in (r["app"] or "") for r in seg500)
    assert any(r["sequence"] == -(2 ** 63) for r in seg500)   # u64 meta values wrap
    assert any(r["body"] == '{"swapped":1}' for r in seg500)
    mutated = collections.Counter(r["error"] for r in rows if r["segment"] == 501)
    assert mutated[None] > 100 and mutated["decompress"] > 100 and mutated["utf8"] > 5


def test_damaged_segments(spark, damaged):
    d, n = damaged
    jvm = check_against_python(spark, d)
    rows = as_dicts(jvm)
    for segno, expect in DAMAGED.items():
        errs = [r for r in rows
                if r["segment"] == segno and (r["error"] or "").startswith("corrupt")]
        if expect is None:
            assert errs == [], (segno, errs)
            continue
        assert [r["error"] for r in errs] == [expect], (segno, errs)
        info = json.loads(errs[0]["body"])
        assert "offset" in info, (segno, info)
        if expect == "corrupt:no_seal":
            assert "message" in info
    intact = [r for r in rows if r["segment"] == 600]
    assert len(intact) == n - 4                             # 4 kind-1 records: no rows
    crc = next(r for r in rows if r["segment"] == 601 and r["error"] == "corrupt:crc")
    assert json.loads(crc["body"])["records_lost"] > 0 and crc["record"] > 10
    magic = next(r for r in rows if r["segment"] == 622)
    assert "magic" in json.loads(magic["body"])["message"]


def test_app_env_and_topic_with_encoded_surrogates(spark, tmp_path):
    """app-env / topic frames holding UTF-16 surrogates in UTF-8 form: Python's
    ``decode("utf-8", "replace")`` gives one U+FFFD per byte."""
    recs = [(0, [ae, t, b"{}", meta(seq=k)]) for k, (ae, t) in enumerate(
        [(ae, b"logs.x.y") for ae in SURROGATES] + [(b"a-b", t) for t in SURROGATES])]
    recs.append((0, [b"\xed\xa0\x80-frames", b"t", b"x"]))      # the first of 3 frames
    write_segment(tmp_path, 7, recs)
    jvm = check_against_python(spark, tmp_path)
    assert len(jvm) == len(recs)
    assert ("x", "\ufffd" * 3) in {(r[0], r[1]) for r in jvm}


def test_utf8_check_at_every_offset_of_the_8_byte_runs(spark, tmp_path):
    """The UTF-8 check reads ASCII 8 bytes at a time (Bodies.utf8): one non-ASCII
    sequence, valid or not, at every offset of bodies of 1-27 bytes, in the middle of the
    decompressed buffer and at its end -- every row as Python's strict decode has it (a
    body, or error "utf8")."""
    seqs = [b"\xc3\xa9", b"\xe2\x82\xac", b"\xf0\x9f\x98\x80", b"\x80", b"\xc3", b"\xe2\x82",
            b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\xff"]
    recs = []
    for n in range(1, 28):
        for at in range(n + 1):                 # q at offset at, n - at bytes after it
            for q in seqs:
                body = b"a" * at + q + b"b" * (n - at)
                comp = LZ4 if (n + at) % 2 else NONE
                data = compress(body, comp) if comp else body
                recs.append((0, [b"a-b", b"logs.x", data, meta(comp=comp, seq=len(recs))]))
    write_segment(tmp_path, 3, recs)
    jvm = check_against_python(spark, tmp_path)
    errors = collections.Counter(by(jvm, "error"))
    assert len(jvm) == len(recs) and errors["utf8"] > 1000 and errors[None] > 1000


def test_size_limit(spark, tmp_path):
    """Bodies inflating to exactly MAX_DECOMPRESSED bytes decode, one byte more does not."""
    recs = []
    for size in (MAX_DECOMPRESSED, MAX_DECOMPRESSED + 1):
        for c in (ZLIB, SNAPPY, LZ4):
            recs.append((0, [b"a-b", b"logs.a.b", compress(bytes(size), c), meta(c)]))
    write_segment(tmp_path, 1, recs)
    cols = ("record", "error", "compression")
    jvm = collect(jvm_df(spark, tmp_path).select(*cols))
    assert_same_rows(cols, jvm, py_rows(tmp_path, columns=cols), "limit")
    assert_same_rows(cols, jvm, py_rows(tmp_path, columns=cols, walk="py"), "limit (py)")
    assert sorted(r[:2] for r in jvm) == [(0, None), (1, None), (2, None),
                                          (3, "decompress"), (4, "decompress"),
                                          (5, "decompress")]


def _unreadable_archive(d):
    write_segment(d, 1, mutated_records(20))
    # a segment removed between listing and reading (retention), a directory
    os.symlink(os.path.join(str(d), "gone"), os.path.join(str(d), fmt.segment_name(2, True)))
    os.mkdir(os.path.join(str(d), fmt.segment_name(3, True)))


def test_unreadable_segment_rows(spark, tmp_path):
    """An unreadable segment is one ``unreadable`` row (record 0, the path in the body)."""
    _unreadable_archive(tmp_path)

    def strip(rows):                    # the OS error text is compared separately
        out = []
        for r in rows:
            r = list(r)
            if r[COLS.index("error")] == "unreadable":
                info = json.loads(r[COLS.index("body")])
                r[COLS.index("body")] = (sorted(info), info["path"])
            out.append(tuple(r))
        return out
    jvm = collect(jvm_df(spark, tmp_path))
    assert_same_rows(COLS, strip(jvm), strip(py_rows(tmp_path)), "unreadable")
    assert sorted((r[COLS.index("segment")], r[COLS.index("record")]) for r in jvm
                  if r[COLS.index("error")] == "unreadable") == [(2, 0), (3, 0)]


def test_unreadable_segment_message(spark, tmp_path):
    """... and its body's message is the Python reader's."""
    _unreadable_archive(tmp_path)
    check_against_python(spark, tmp_path)


def test_unreadable_segment_sliced(spark, tmp_path):
    """... also with recordsPerPartition (the record count of an unreadable file)."""
    _unreadable_archive(tmp_path)
    check_against_python(spark, tmp_path, per=7)


def test_segment_file_names(spark, tmp_path):
    """Which files are segments: 20 digits and ``.seg`` -- the same for both readers."""
    _, data, _ = write_segment(tmp_path, 1, mutated_records(10))
    for name in ("\u0660" * 19 + "\u0667.seg",                   # Arabic-Indic digits
                 fmt.segment_name(5, True) + "\n", fmt.segment_name(6, True) + ".tmp",
                 fmt.segment_name(7, False), "0" * 19 + ".seg", "0" * 21 + ".seg"):
        with open(os.path.join(str(tmp_path), name), "wb") as f:
            f.write(data)
    jvm = check_against_python(spark, tmp_path)
    assert {r[COLS.index("segment")] for r in jvm} == {1}


@pytest.mark.parametrize("which", ["healthy", "odd", "damaged"])
def test_slices(spark, which, healthy, odd, damaged):
    """recordsPerPartition 7: the rows of the whole read (sealed segments) and, on every
    archive, the Python source's sliced read."""
    d = {"healthy": healthy, "odd": odd, "damaged": damaged}[which][0]
    df = jvm_df(spark, d, recordsPerPartition=7)
    assert df.rdd.getNumPartitions() > 3 * len(dec.list_segments(d))
    sliced = check_against_python(spark, d, per=7)
    whole = collect(jvm_df(spark, d))
    # the same rows as the whole read, damaged files included: a record whose frame
    # lengths do not add up (CRC valid) ends the segment for the slices after it too, and
    # a damaged header is one row (from the slice at record 0), not one per slice
    assert_same_rows(COLS, sliced, whole, "sliced vs whole")
    if which == "damaged":
        seg, rec, err = (COLS.index(c) for c in ("segment", "record", "error"))
        assert not [r for r in sliced if r[seg] == 612 and r[rec] > 21]
        assert [r[err] for r in sliced if r[seg] == 628] == ["corrupt:header_crc"]


def test_unsealed_file_sliced(spark, tmp_path):
    """No seal: the slices come from a scan (valid records + 1), kind-1 records included."""
    recs = []
    for i in range(30):
        recs.append((0, [b"shop-production", b"logs.shop.production",
                         compress(b'{"i":%d}' % i, i % 4), meta(i % 4, seq=i)]))
        if i % 5 == 2:
            recs.append((1, [b"b1", b"120", b"publish"]))
    arch, scratch = tmp_path / "arch", tmp_path / "scratch"
    arch.mkdir()
    scratch.mkdir()
    path, _, _ = write_segment(arch, 3, recs, seal=False)
    _, data, offs = write_segment(scratch, 4, recs, seal=False)
    put(arch, 4, data[:offs[20] + 11])                      # unsealed and torn
    assert dec.record_count(path) == len(recs) + 1
    for per in (7, 1, 0):
        jvm = check_against_python(spark, arch, per=per)
        rows = as_dicts(jvm)
        errs = [(r["segment"], r["record"], r["error"]) for r in rows if r["error"]]
        assert sorted(errs) == [(3, 30, "corrupt:no_seal"), (4, 17, "corrupt:torn")], errs
        assert len(rows) == 30 + 17 + 2


@pytest.mark.parametrize("cols", [("record", "error"), ("device", "segment"), ("body",),
                                  ("error", "app", "compression"), ("record",)])
def test_column_pruning(spark, mixed, cols):
    jvm_df_ = jvm_df(spark, mixed).select(*cols)
    assert "JVM reader" in plan(jvm_df_)
    jvm = collect(jvm_df_)
    assert len(jvm) > 1500
    py_source = collect(spark.read.format("logjam_python").load(mixed).select(*cols))
    assert_same_rows(cols, jvm, py_source, "vs logjam_python")
    assert_same_rows(cols, jvm, py_rows(mixed, columns=cols), "vs pruned Python decoder")
    if "error" in cols:
        errors = {r[cols.index("error")] for r in jvm}
        assert {"meta", "frames", "decompress", "utf8", "corrupt:crc"} <= errors


def test_extracted_fields_are_delegated(spark, mixed):
    schema = "action string, total_time double, record int, segment long"
    df = spark.read.format("logjam").schema(schema).load(mixed)
    assert "JVM reader" not in plan(df)
    got = collect(df)
    want = collect(spark.read.format("logjam_python").schema(schema).load(mixed))
    names = ["action", "total_time", "record", "segment"]
    assert_same_rows(names, got, want, "extracted fields")
    assert sum(1 for r in got if r[0] is not None and r[1] is not None) > 100


def test_batch_rows(spark, mixed):
    jvm = collect(jvm_df(spark, mixed, batchRows=5))
    assert_same_rows(COLS, jvm, py_rows(mixed), "batchRows 5")
    assert_same_rows(COLS, collect(jvm_df(spark, mixed, batchRows=1, recordsPerPartition=7)),
                     py_rows(mixed, per=7), "batchRows 1, recordsPerPartition 7")


def test_stream_is_delegated(spark, mixed, tmp_path):
    sdf = spark.readStream.format("logjam").load(mixed)
    assert sdf.isStreaming
    q = (sdf.writeStream.format("memory").queryName("logjam_jvm_stream")
         .option("checkpointLocation", str(tmp_path / "ckpt"))
         .trigger(availableNow=True).start())
    try:
        assert q.awaitTermination(120)
        assert q.exception() is None
        streamed = collect(spark.sql("select * from logjam_jvm_stream"))
    finally:
        q.stop()
    batch = collect(jvm_df(spark, mixed))
    assert len(batch) > 1500
    # segment 635 (damaged header, a valid seal counting 0 records): the stream plans no
    # partition for a segment of 0 records, so its error row is the batch read's only
    seg = COLS.index("segment")
    assert_same_rows(COLS, streamed, [r for r in batch if r[seg] != 635], "stream vs batch")


def test_constants(spark):
    from logjam_relay.protocols import logjam
    c = spark._jvm.logjamrelay.spark.Constants
    assert c.MAX_DECOMPRESSED == logjam.MAX_DECOMPRESSED
    assert c.MAX_BODY == fmt.MAX_BODY == dec.MAX_BODY
    assert c.DEFAULT_BATCH_ROWS == dec.DEFAULT_BATCH_ROWS
    assert c.HEADER_LEN == fmt.HEADER_LEN
    assert c.SEAL_RECORD_LEN == fmt.SEAL_RECORD_LEN
    assert c.MIN_RECORD == fmt.MIN_RECORD
    assert c.KIND_SEAL == fmt.KIND_SEAL
    assert c.PYTHON_NAME == ds.PYTHON_NAME
    from logjam_relay.pipeline import minutes
    assert (c.MIN_MS, c.MAX_MS) == (minutes.MIN_MS, minutes.MAX_MS)
    edges = [minutes.MIN_MS, minutes.MAX_MS, 59_999, 60_000, -60_001]
    for ms in [-(1 << 63), (1 << 63) - 1] + [e + d for e in edges for d in (-1, 0, 1)]:
        assert c.minute(ms) == minutes.minute_of(ms), ms
        assert c.inRange(ms) == minutes.in_range(ms), ms


def test_no_janino_falls_back(monkeypatch, tmp_path, caplog):
    from logjam_relay.pipeline.jvmcache import spark_jars
    jars = [j for j in spark_jars()
            if not os.path.basename(j).startswith(("janino-", "commons-compiler-"))]
    assert jars
    monkeypatch.setattr(jvmreader, "spark_jars", lambda: jars)
    with caplog.at_level(logging.WARNING, logger="logjam_relay.pipeline.jvmreader"):
        assert jvmreader.ensure_jar(cache_dir=str(tmp_path)) is None
    msgs = [r.getMessage() for r in caplog.records if r.name == jvmreader.log.name]
    assert any("not available" in m and "Janino" in m for m in msgs), msgs
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".jar")]


def test_compile_error_is_build_error(monkeypatch, tmp_path):
    from logjam_relay.pipeline.java import ensure_java
    for k, v in ensure_java().items():
        monkeypatch.setenv(k, v)
    src = tmp_path / "src" / "logjamrelay" / "spark"
    src.mkdir(parents=True)
    bad = src / "Broken.java"
    bad.write_text("package logjamrelay.spark;\nfinal class Broken {\n  int x = ;\n}\n")
    monkeypatch.setattr(jvmreader, "sources", lambda: [str(bad)])
    dest = tmp_path / "out.jar"
    with pytest.raises(jvmreader.BuildError, match="compiler failed"):
        jvmreader.build(str(dest))
    assert not dest.exists()


def test_register_without_the_jvm_reader(monkeypatch):
    """A session whose JVM lacks the reader gets the Python source as ``logjam``; one with
    it, the Python source as ``logjam_python`` (what the JVM provider hands over)."""
    got = []
    real_loaded = jvmreader.loaded

    class Session:
        class dataSource:                               # noqa: N801 (SparkSession's name)
            register = staticmethod(got.append)
    monkeypatch.setattr(jvmreader, "loaded", lambda spark: False)
    ds.register(Session())
    monkeypatch.setattr(jvmreader, "loaded", lambda spark: True)
    ds.register(Session())
    assert [c.name() for c in got] == ["logjam", "logjam_python"]
    assert real_loaded(object()) is False               # no py4j gateway: no JVM reader


def test_segment_too_big_for_the_jvm_reader(spark, healthy):
    """A segment over the JVM reader's limit (one Java array, 2 GiB; lowered here with
    ``jvmMaxSegmentBytes``): the Python source reads the whole scan, same rows."""
    d = healthy[0]
    small = jvm_df(spark, d, jvmMaxSegmentBytes=100)
    assert "JVM reader" not in plan(small)
    assert "JVM reader" in plan(jvm_df(spark, d, jvmMaxSegmentBytes=1 << 30))
    assert_same_rows(COLS, collect(small), py_rows(d), "over the limit")


def _native_status(spark) -> str:
    return spark.sql("SELECT reflect('logjamrelay.spark.NativeInflate', 'status')").first()[0]


def _native_answered(spark) -> int:
    return int(spark.sql("SELECT reflect('logjamrelay.spark.NativeInflate', 'answered')"
                         ).first()[0])


def _native_enabled(spark, on: bool) -> None:
    spark.sql(f"SELECT reflect('logjamrelay.spark.NativeInflate', 'setEnabled', {str(on).lower()})"
              ).collect()


def _agent_body(rng: random.Random, i: int) -> bytes:
    lines = [[rng.randint(0, 5), f"2026-11-27T10:00:{i % 60:02d}.{rng.randint(0, 999999):06d}",
              "Processing by Orders#show as HTML " + "\u00e9x" * rng.randint(0, 30)]
             for _ in range(rng.randint(1, 25))]
    return json.dumps({"action": f"Orders#a{i % 7}", "code": 200, "total_time": i % 97 + 0.5,
                       "started_ms": CREATED + i, "lines": lines},
                      ensure_ascii=False).encode()


def test_native_zlib_path_rows_equal_python_and_inflater(spark, tmp_path):
    """The reader's zlib bodies through the native path (pipeline/_jinflate.c: libdeflate
    behind zlib's rules; tests/test_pipeline_jinflate.py tests it alone): in use where it
    was built and the machine has libdeflate (always under CI), and its rows -- intact
    bodies, bodies damaged after their block header (the guard passes them, libdeflate
    refuses, zlib decides), cut short, extended -- equal the Python decoder's and those of
    the same reader with Inflater alone."""
    have = jvmreader.native_inflate_ready()
    status = _native_status(spark)
    if have:
        assert status.startswith("libdeflate"), status
    elif os.environ.get("CI"):
        pytest.fail(f"the native zlib path must be in use in CI: {status}")
    rng = random.Random(21)
    recs = []
    for i in range(1500):
        op = i % 6                          # intact, damaged, cut short, extended
        b = damaged_stream(rng, zlib.compress(_agent_body(rng, i)), op if op <= 3 else 0)
        recs.append((0, [b"nat-test", b"logs.nat.test", b, meta(ZLIB, seq=i)]))
    # streams of more than 64 KiB go to Inflater (the native buffers stay bounded): one that
    # inflates beyond, one small body with 70 KiB after its stream (ignored, as by zlib)
    big = [zlib.compress(json.dumps({"action": "Big#one", "pad": rng.randbytes(80_000).hex()}
                                    ).encode()),
           zlib.compress(b'{"action":"Big#tail","total_time":1}') + rng.randbytes(70_000)]
    assert all(len(b) > 65536 for b in big)
    recs += [(0, [b"nat-test", b"logs.nat.test", b, meta(ZLIB, seq=1500 + k)])
             for k, b in enumerate(big)]
    write_segment(tmp_path, 1, recs[:700])
    write_segment(tmp_path, 2, recs[700:])
    before = _native_answered(spark)
    fast = check_against_python(spark, tmp_path)
    if have:        # used, not only loaded: it answered for the intact and extended bodies
        assert _native_answered(spark) - before >= 400, (before, _native_answered(spark))
    errors = collections.Counter(by(fast, "error"))
    assert errors[None] > 800 and errors["decompress"] > 300, errors
    assert sum(1 for e, b in zip(by(fast, "error"), by(fast, "body"), strict=True)
               if e is None and '"Big#' in b[:24]) == 2
    try:
        _native_enabled(spark, False)
        assert _native_status(spark).startswith("java.util.zip.Inflater"), _native_status(spark)
        off = _native_answered(spark)
        slow = collect(jvm_df(spark, tmp_path))
        assert _native_answered(spark) == off
    finally:
        _native_enabled(spark, True)
    assert_same_rows(COLS, fast, slow, "native path vs Inflater alone")
