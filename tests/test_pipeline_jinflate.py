"""The JVM reader's fast zlib path (``pipeline/_jinflate.c``): libdeflate behind a guard
that admits only the streams on which libdeflate and zlib agree.  Whatever the fast path
answers must be zlib's answer (Python's ``zlib.decompress``, the reference's and the
Python engine's rule; ``java.util.zip.Inflater`` is the same zlib): on zlib's own output
at every level, strategy and window, on mutated, truncated and extended streams, and on
streams written by hand with exactly the features libdeflate accepts and zlib does not
(these the guard must refuse; libdeflate alone is shown to accept them, so the test
would fail without the guard).  The library is called through ctypes, the same
functions the JVM calls.
"""

from __future__ import annotations

import ctypes
import heapq
import json
import os
import random
import zlib

import pytest

from logjam_relay.pipeline import jvmreader

CAP = 1 << 16


@pytest.fixture(scope="module")
def lib():
    path = jvmreader.native_library()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("logjam_relay.pipeline._jinflate must be built in CI")
        pytest.skip("logjam_relay.pipeline._jinflate is not built")
    so = ctypes.CDLL(path)
    so.ljr_inflate_available.restype = ctypes.c_int
    if not so.ljr_inflate_available():
        if os.environ.get("CI"):
            pytest.fail("libdeflate.so.0 is missing (apt-get install libdeflate0)")
        pytest.skip("libdeflate.so.0 is missing (apt-get install libdeflate0)")
    so.ljr_inflate_open.restype = ctypes.c_void_p
    so.ljr_inflate_guard.restype = ctypes.c_int
    so.ljr_inflate_guard.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    so.ljr_inflate.restype = ctypes.c_int32
    so.ljr_inflate.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32,
                               ctypes.c_void_p, ctypes.c_int32]
    so.ljr_inflate_close.argtypes = [ctypes.c_void_p]
    d = so.ljr_inflate_open()
    out = ctypes.create_string_buffer(CAP)
    yield so, d, out
    so.ljr_inflate_close(d)


def fast(lib, data: bytes) -> bytes | None:
    so, d, out = lib
    n = so.ljr_inflate(d, data, len(data), out, CAP)
    return None if n < 0 else out.raw[:n]


def zlib_verdict(data: bytes) -> bytes | None:
    """Python's zlib.decompress (bytes after the stream ignored): the output, or None."""
    try:
        return zlib.decompress(data)
    except zlib.error:
        return None


def libdeflate_alone(lib, data: bytes) -> bytes | None:
    """libdeflate without the guard (to show what the guard is for)."""
    f = ctypes.CDLL("libdeflate.so.0")
    f.libdeflate_alloc_decompressor.restype = ctypes.c_void_p
    f.libdeflate_zlib_decompress_ex.argtypes = [
        ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    f.libdeflate_free_decompressor.argtypes = [ctypes.c_void_p]
    d = f.libdeflate_alloc_decompressor()
    out = ctypes.create_string_buffer(CAP)
    used, got = ctypes.c_size_t(), ctypes.c_size_t()
    try:
        r = f.libdeflate_zlib_decompress_ex(d, data, len(data), out, CAP,
                                            ctypes.byref(used), ctypes.byref(got))
        return out.raw[:got.value] if r == 0 else None
    finally:
        f.libdeflate_free_decompressor(d)


def agree(lib, data: bytes) -> bool:
    """The fast path's answer is zlib's (or it asks zlib); True when it answered."""
    got = fast(lib, data)
    if got is not None:
        assert got == zlib_verdict(data), data.hex()
    return got is not None


def bodies(rng: random.Random, k: int) -> list[bytes]:
    """JSON bodies shaped like the logjam agents' (as the bench's): 200 B to ~8 KB."""
    out = []
    for i in range(k):
        lines = [[rng.randint(0, 5), f"2026-11-27T10:{i % 60:02d}:00.{rng.randint(0, 999999):06d}",
                  f"Processing by Ctl{rng.randint(1, 40)}#act{rng.randint(1, 9)} as JSON "
                  + "x" * rng.randint(0, 60)] for _ in range(rng.randint(0, 40))]
        out.append(json.dumps({
            "action": f"Ctl{rng.randint(1, 40)}#act{rng.randint(1, 9)}",
            "code": rng.choice([200, 200, 200, 302, 404, 500]),
            "started_ms": 1_790_000_000_000 + rng.randint(0, 10 ** 7),
            "total_time": round(rng.expovariate(1 / 80), 3),
            "db_time": round(rng.random() * 30, 3), "db_calls": rng.randint(0, 40),
            "request_info": {"method": "GET", "url": f"/x/{rng.randint(0, 10 ** 6)}",
                             "headers": {"User-Agent": "Mozilla/5.0", "Accept": "*/*"}},
            "lines": lines,
        }).encode())
    return out


def test_zlib_output_is_taken_by_the_fast_path(lib):
    """What zlib writes -- every level, strategy and window, small and large bodies --
    decompresses to zlib's output; the usual case (level 6, a body of a few hundred bytes
    or more) is taken by the fast path, not left to zlib."""
    rng = random.Random(1)
    taken = total = 0
    typical = typical_taken = 0
    for body in bodies(rng, 300) + [b"", b"{}", b"a" * 70000, os.urandom(3000)]:
        for level in (0, 1, 6, 9):
            for strategy in (zlib.Z_DEFAULT_STRATEGY, zlib.Z_FILTERED, zlib.Z_HUFFMAN_ONLY,
                             zlib.Z_RLE, zlib.Z_FIXED):
                for wbits in (9, 12, 15):
                    c = zlib.compressobj(level, zlib.DEFLATED, wbits, 8, strategy)
                    data = c.compress(body) + c.flush()
                    total += 1
                    if agree(lib, data):
                        taken += 1
                    if (level, strategy, wbits) == (6, zlib.Z_DEFAULT_STRATEGY, 15) \
                            and 400 <= len(body) <= 16000:
                        typical += 1
                        typical_taken += fast(lib, data) is not None
    assert typical >= 200
    # (zlib writes a static block where that is shorter: a few small bodies go to zlib)
    assert typical_taken >= typical * 0.95, (typical_taken, typical)
    assert taken > total // 3, (taken, total)


def test_mutated_truncated_and_extended_streams_agree_with_zlib(lib):
    rng = random.Random(2)
    sources = [zlib.compress(b) for b in bodies(rng, 200)]
    answered = 0
    for k in range(40000):
        data = bytearray(rng.choice(sources))
        how = k % 5
        if how == 0:                                # a bit flipped in the headers
            i = rng.randrange(min(len(data), 48))
            data[i] ^= 1 << rng.randrange(8)
        elif how == 1:                              # a bit anywhere
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        elif how == 2:                              # a byte anywhere, several times
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif how == 3:                              # cut short
            del data[rng.randrange(len(data)):]
        else:                                       # bytes after the stream
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        answered += agree(lib, bytes(data))
    # the bit flips after the block header and the extensions leave most streams whole
    # or caught by the checksum: the fast path answers many of them itself
    assert answered > 4000, answered


# --- streams written by hand: one dynamic block with chosen codes ----------------------

class Bits:
    def __init__(self):
        self.acc = 0
        self.n = 0

    def put(self, v: int, k: int) -> None:
        self.acc |= (v & ((1 << k) - 1)) << self.n
        self.n += k

    def huff(self, code: int, length: int) -> None:
        self.put(int(f"{code:0{length}b}"[::-1], 2) if length else 0, length)

    def bytes(self) -> bytes:
        return self.acc.to_bytes((self.n + 7) // 8, "little")


def canonical(lens: list[int]) -> list[int]:
    codes, code, count = [0] * len(lens), 0, [0] * 16
    for x in lens:
        count[x] += 1
    count[0] = 0
    nxt = [0] * 16
    for b in range(1, 16):
        code = (code + count[b - 1]) << 1
        nxt[b] = code
    for s, x in enumerate(lens):
        if x:
            codes[s] = nxt[x]
            nxt[x] += 1
    return codes


def huffman_lengths(freq: dict[int, int], n: int, limit: int) -> list[int]:
    lens = [0] * n
    heap = [(f, i, [s]) for i, (s, f) in enumerate(sorted(freq.items()))]
    heapq.heapify(heap)
    if len(heap) == 1:
        lens[heap[0][2][0]] = 1
        return lens
    k = len(heap)
    while len(heap) > 1:
        f1, _, a = heapq.heappop(heap)
        f2, _, b = heapq.heappop(heap)
        for s in a + b:
            lens[s] += 1
        heapq.heappush(heap, (f1 + f2, k, a + b))
        k += 1
    assert max(lens) <= limit
    return lens


LEN_BASE = [3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83,
            99, 115, 131, 163, 195, 227, 258]
LEN_EXTRA = [0] * 8 + [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4 + [5] * 4 + [0]
DIST_BASE = [1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769,
             1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577]
DIST_EXTRA = [0, 0, 0, 0] + [i // 2 for i in range(2, 28)]
ORDER = [16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15]


def stream(items, litlen: list[int], dist: list[int], *, cl_items=None, pre=None,
           hlit=None, hdist=None, adler_of: bytes = b"") -> bytes:
    """A zlib stream of one final dynamic block.  ``items``: ('lit', byte), ('len', sym,
    extra), ('dist', sym, extra), ('eob',); ``litlen``/``dist``: the code lengths;
    ``cl_items``: the code-length symbols as written ((sym, extra bits, value) ...;
    default: every length literally); ``pre``: the code-length code's lengths;
    ``adler_of``: the data whose Adler-32 ends the stream."""
    w = Bits()
    w.put(0x78, 8)
    w.put(0x9C, 8)
    w.put(1, 1)
    w.put(2, 2)
    w.put((len(litlen) - 257) if hlit is None else hlit, 5)
    w.put((len(dist) - 1) if hdist is None else hdist, 5)
    if cl_items is None:
        cl_items = [(x, 0, 0) for x in litlen + dist]
    if pre is None:
        freq: dict[int, int] = {}
        for s, _k, _v in cl_items:
            freq[s] = freq.get(s, 0) + 1
        pre = huffman_lengths(freq, 19, 7)
    w.put(15, 4)
    for s in ORDER:
        w.put(pre[s], 3)
    pcodes = canonical(pre)
    for s, k, v in cl_items:
        w.huff(pcodes[s], pre[s])
        if k:
            w.put(v, k)
    lcodes, dcodes = canonical(litlen), canonical(dist)
    for it in items:
        if it[0] == "lit":
            w.huff(lcodes[it[1]], litlen[it[1]])
        elif it[0] == "len":
            w.huff(lcodes[it[1]], litlen[it[1]])
            if it[1] - 257 < len(LEN_EXTRA) and LEN_EXTRA[it[1] - 257]:
                w.put(it[2], LEN_EXTRA[it[1] - 257])
        elif it[0] == "dist":
            w.huff(dcodes[it[1]], dist[it[1]])
            extra = DIST_EXTRA[it[1]] if it[1] < 30 else 13
            if extra:
                w.put(it[2], extra)
        elif it[0] == "raw":
            w.put(it[1], it[2])
        else:
            w.huff(lcodes[256], litlen[256])
    body = w.bytes()
    return body + zlib.adler32(adler_of).to_bytes(4, "big")


def flat(n: int, used: dict[int, int]) -> list[int]:
    """Complete code lengths over ``n`` symbols giving ``used`` (symbol: weight) codes."""
    return huffman_lengths(used, n, 15)


def base_case():
    """A valid stream: 'abcabcabc' as literals and one match, complete codes."""
    lit = flat(286, {ord("a"): 3, ord("b"): 3, ord("c"): 3, 256: 1, 257: 1, 258: 1})
    dist = flat(30, {0: 1, 2: 1})
    items = [("lit", ord("a")), ("lit", ord("b")), ("lit", ord("c")), ("len", 258, 0),
             ("dist", 2, 0), ("eob",)]
    return items, lit, dist, b"abcabcabcabc"[:7]


def test_hand_written_stream_is_valid_and_taken(lib):
    items, lit, dist, data = base_case()
    s = stream(items, lit, dist, adler_of=data)
    assert zlib.decompress(s) == data
    assert fast(lib, s) == data


@pytest.mark.parametrize("case", [
    "287_litlen_codes", "31_distance_codes", "litlen_symbol_286", "distance_symbol_30",
    "repeat_past_the_end", "one_length_1_litlen_code", "empty_distance_code_used",
    "one_length_1_code_length_code", "static_block_symbol_286", "non_final_block",
])
def test_what_libdeflate_takes_and_zlib_refuses_is_refused(lib, case):
    """Each stream uses one feature libdeflate accepts and zlib refuses (or decodes
    otherwise).  zlib refuses it; the guard refuses it (zlib is asked); and where
    libdeflate alone accepts it, that is shown too."""
    items, lit, dist, data = base_case()
    kw = {}
    if case == "287_litlen_codes":
        lit = flat(287, {ord("a"): 3, ord("b"): 3, ord("c"): 3, 256: 1, 257: 1, 258: 1,
                         286: 1})
    elif case == "31_distance_codes":
        dist = flat(31, {0: 1, 2: 1, 30: 1})
    elif case == "litlen_symbol_286":
        lit = flat(288, {ord("a"): 3, ord("b"): 3, ord("c"): 3, 256: 1, 257: 1, 286: 1})
        # libdeflate reads symbol 286 as a match of 258 bytes
        items = [("lit", ord("a")), ("lit", ord("b")), ("lit", ord("c")), ("len", 286, 0),
                 ("dist", 2, 0), ("eob",)]
        data = b"abc" + (b"abc" * 86)[:258]
    elif case == "distance_symbol_30":
        # libdeflate reads distance symbol 30 as an offset of 24577 (13 extra bits)
        dist = flat(32, {0: 1, 30: 1})
        items = [("lit", ord("a"))] + [("len", 285, 0), ("dist", 0, 0)] * 100 \
            + [("len", 285, 0), ("dist", 30, 0), ("eob",)]
        lit = flat(286, {ord("a"): 1, 256: 1, 285: 1})
        data = b"a" * (1 + 258 * 101)
    elif case == "repeat_past_the_end":
        # the last distance length written as "repeat zero 11-138 times" running past
        # the end (zlib: invalid bit length repeat; libdeflate ignores the overrun)
        cl = [(x, 0, 0) for x in lit + dist[:-1]] + [(18, 7, 20)]
        assert dist[-1] == 0
        kw["cl_items"] = cl
    elif case == "one_length_1_litlen_code":
        # the only literal/length code is the end of block's, of length 1: zlib reads
        # codeword 0 (and refuses 1), libdeflate reads both as the end of block
        lit = [0] * 257
        lit[256] = 1
        items, data = [("raw", 1, 1)], b""
    elif case == "empty_distance_code_used":
        dist = [0]
        items = [("lit", ord("a")), ("len", 258, 0), ("dist", 0, 0), ("eob",)]
        data = b"aaaaa"
    elif case == "one_length_1_code_length_code":
        # a code-length code of one length-1 codeword (libdeflate takes it, zlib does
        # not): it can only give every length the same value, here 0 (no end of block:
        # neither decodes the stream, but the guard must not pass it on either)
        pre = [0] * 19
        pre[0] = 1
        lit, dist = [0] * 257, [0]
        kw["cl_items"] = [(0, 0, 0)] * 258
        kw["pre"] = pre
        items, data = [], b""
    if case in ("static_block_symbol_286", "non_final_block"):
        w = Bits()
        w.put(0x78, 8)
        w.put(0x9C, 8)
        if case == "static_block_symbol_286":
            w.put(1, 1)
            w.put(1, 2)                         # static Huffman
            w.huff(0b00110000 + ord("a"), 8)    # literal 'a' (8-bit codes from 0x30)
            w.huff(0b11000000 + (286 - 280), 8)  # symbol 286: 11000110
            w.huff(0, 5)                         # distance symbol 0: offset 1
            w.huff(0, 7)                         # end of block: 0000000
            data = b"a" * 259
        else:
            w.put(0, 1)
            w.put(1, 2)
            w.huff(0b00110000 + ord("a"), 8)
            w.huff(0, 7)
            w.put(1, 1)
            w.put(1, 2)
            w.huff(0, 7)
            data = b"a"
        s = w.bytes() + zlib.adler32(data).to_bytes(4, "big")
    else:
        s = stream(items, lit, dist, adler_of=data, **kw)
    assert not lib[0].ljr_inflate_guard(s, len(s))
    assert fast(lib, s) is None
    alone = libdeflate_alone(lib, s)
    if case == "non_final_block":
        assert zlib_verdict(s) == data          # zlib takes it: it is simply left to zlib
    else:
        assert zlib_verdict(s) is None, case
    if case in ("287_litlen_codes", "31_distance_codes", "litlen_symbol_286",
                "distance_symbol_30", "repeat_past_the_end", "static_block_symbol_286",
                "one_length_1_litlen_code"):
        assert alone is not None, f"libdeflate alone refused {case}: the case is not shown"


def test_guard_rejects_nothing_zlib_would_not_decode_alike(lib):
    """Random dynamic-block headers (random code lengths, complete or not) with a short
    body: where the fast path answers, zlib gives the same bytes."""
    rng = random.Random(3)
    answered = 0
    for _ in range(3000):
        used = {s: rng.randint(1, 9) for s in rng.sample(range(256), rng.randint(1, 30))}
        used[256] = 1
        lit = flat(257 + rng.randint(0, 29), used)
        dist = flat(2 + rng.randint(0, 28), {0: 1, 1: 1})
        syms = rng.sample(sorted(s for s in used if s < 256), min(5, len(used) - 1))
        data = bytes(syms)
        items = [("lit", s) for s in syms] + [("eob",)]
        if rng.random() < 0.3:                          # damage a code length
            i = rng.randrange(len(lit))
            lit[i] = rng.randint(0, 15)
        s = stream(items, lit, dist, adler_of=data)
        answered += agree(lib, s)
    assert answered > 1000, answered
