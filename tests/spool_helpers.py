"""Helpers shared by the spool tests: logjam messages with a meta frame, a small spool."""

import os
import struct

from logjam_relay.spool import segment as fmt
from logjam_relay.spool.spool import Spool


def meta(seq: int) -> bytes:
    return struct.pack(">HBBIQQ", 0xCABD, 1, 1, 7, 1_700_000_000_000 + seq, seq)


def msg(i: int, size: int = 300) -> list[bytes]:
    return [b"myapp-production", b"logs.web", i.to_bytes(4, "big") * (size // 4), meta(i)]


def seq_of(rec) -> int:
    return struct.unpack(">HBBIQQ", rec.frames[3])[5]


def drain(reader, batch=1000) -> list:
    out = []
    while True:
        got = reader.read(batch)
        if not got:
            return out
        out.extend(got)


def open_spool(path, readers=("a", "b"), **kw):
    kw.setdefault("segment_bytes", 16 * 1024)
    kw.setdefault("max_bytes", 64 << 20)
    kw.setdefault("fsync", "never")
    return Spool(path, readers=list(readers), **kw)


def segment_files(path):
    return sorted(f for f in os.listdir(path) if fmt.parse_segment_name(f))


def fill(sp, start, n, batch=10, size=300):
    for k in range(start, start + n, batch):
        sp.append_batch([msg(i, size) for i in range(k, min(k + batch, start + n))])


def spooled_records(dirs) -> list[list[bytes]]:
    """The frames of every logjam record in the spool (and archive) directories ``dirs``,
    segment by segment (a segment in two directories is read once); a torn tail (a relay
    that was SIGKILLed) ends its segment."""
    segs: dict[int, str] = {}
    for d in dirs:
        for name in os.listdir(d) if os.path.isdir(d) else ():
            p = fmt.parse_segment_name(name)
            if p is not None and (p[0] not in segs or p[1]):
                segs[p[0]] = os.path.join(d, name)
    out = []
    for segno in sorted(segs):
        for _off, kind, frames in fmt.iter_records(segs[segno], allow_torn_tail=True):
            if kind == 0:
                out.append(frames)
    return out


def damage_segments(segs) -> None:
    """Damage three segments of ``segs`` (``[(segno, path), ...]``, at least 6) as a disk
    or a bad copy would: the second torn in half, a bit flipped a third into the fourth,
    the sixth's header broken."""
    data = open(segs[1][1], "rb").read()
    open(segs[1][1], "wb").write(data[:len(data) // 2])
    b = bytearray(open(segs[3][1], "rb").read())
    b[len(b) // 3] ^= 4
    open(segs[3][1], "wb").write(b)
    b = bytearray(open(segs[5][1], "rb").read())
    b[2] ^= 1
    open(segs[5][1], "wb").write(b)
