"""``logjam-relay spool fsck DIR [--repair]``: check a spool directory offline.

Reports every segment (sealed/open, seq range, damaged header, damaged records and the
seq ranges they cost, torn tails), the seq ranges that are not on disk at all, and each
output's cursor.  ``--repair`` takes the spool's lock (so never while a relay runs on
the directory) and makes permanent what a relay would do at start: torn ``.open``
tails cut, unreadable segments moved aside as ``*.corrupt``, open segments sealed,
damaged headers rewritten (into a new file renamed over the old name, so that hard
links in the archive keep the old inode), invalid cursors relocated, cursor logs
compacted.  Records are never invented or dropped: damaged records stay counted.

Exit status: 0 clean (or repaired), 1 problems found, 2 the check could not run.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import cursors as curlog
from . import segment as fmt
from .recovery import CURSOR_DIR, iter_with_seq


def scan_damage(path: str, limit: int, first_seq: int, end_seq: int) -> list[tuple]:
    """Damaged stretches of a segment: ``(offset, seq_lo, seq_hi, resume_offset|None)``."""
    out = []
    pos = fmt.HEADER_LEN
    seq = first_seq
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        chunk = fmt.READ_CHUNK
        while pos < limit:
            buf = os.pread(fd, min(chunk, limit - pos), pos)
            if not buf:
                break
            recs, used, status = fmt.parse_records(buf, 0, len(buf), 1 << 62, pos)
            if recs:
                seq = recs[-1][2] + 1
            if status == "seal":
                break
            if isinstance(status, fmt.SegmentError):
                bad = pos + used
                window = os.pread(fd, min(limit - bad, 8 << 20), bad)
                found = fmt.resync(window, bad, bad, seq, end_seq)
                if found is None:
                    out.append((bad, seq, end_seq, None))
                    break
                out.append((bad, seq, found[1], found[0]))
                pos, seq = found
                continue
            if used == 0:
                if status == "partial" and len(buf) >= chunk:
                    chunk = fmt.PREFIX_LEN + fmt.PREFIX.unpack_from(buf, 0)[0]
                    continue
                if status == "partial":
                    out.append((pos, seq, end_seq, None))
                break
            pos += used
    return out


def check(directory: str, progress=None) -> tuple[list[str], int]:
    """Report lines and the number of problems, without changing anything;
    ``progress(files_done, files, name)`` is called before each file."""
    lines: list[str] = []
    problems = 0
    names = sorted(os.listdir(directory))
    segs = []
    for i, fn in enumerate(names):
        if progress is not None:
            progress(i, len(names), fn)
        parsed = fmt.parse_segment_name(fn)
        if parsed is None:
            if fn.endswith(".corrupt"):
                lines.append(f"  {fn}: moved aside earlier (unreadable)")
            continue
        segno, sealed = parsed
        path = os.path.join(directory, fn)
        res = fmt.salvage_segment(path, segno)
        kind = "sealed" if sealed else "open"
        if res.header is None:
            problems += 1
            lines.append(f"  {fn}: {kind}, {res.file_size} bytes, NO readable record "
                         f"({res.error}): all its records are lost")
            continue
        h = res.header
        notes = []
        if res.error == "header":
            problems += 1
            notes.append("header damaged (records intact)")
        last_seq = h.first_seq + res.records
        seal = fmt.read_seal(path) if sealed else None
        end_seq = last_seq
        limit = res.valid_end
        if seal is not None and res.error not in (None, "header"):
            end_seq = h.first_seq + seal[0]
            limit = seal[1]
        readable = res.records
        if res.sealed or seal is not None:
            dmg = scan_damage(path, limit, h.first_seq, end_seq)
            readable = end_seq - h.first_seq - sum(hi - lo for _, lo, hi, _ in dmg)
            for off, lo, hi, resume in dmg:
                problems += 1
                notes.append(f"damaged at offset {off}: seq {lo}..{hi - 1} unreadable"
                             + (f", intact again at offset {resume}" if resume else
                                ", the rest of the segment"))
        elif sealed:
            problems += 1
            notes.append(f"seal missing or invalid ({res.error} at offset {res.error_offset}):"
                         f" {res.cut_bytes} bytes after seq {last_seq - 1} unreadable")
        elif res.cut_bytes and res.error != "header":
            problems += 1
            notes.append(f"torn tail: {res.cut_bytes} bytes after offset {res.valid_end}")
        lines.append(f"  {fn}: {kind}, seq {h.first_seq}..{end_seq - 1} "
                     f"({readable} readable records)" +
                     ("; " + "; ".join(notes) if notes else ": ok"))
        segs.append((segno, h.first_seq, end_seq))
    if progress is not None:
        progress(len(names), len(names), "")
    for (a_no, _a_lo, a_hi), (b_no, b_lo, _b_hi) in zip(segs, segs[1:], strict=False):
        if b_lo > a_hi:
            problems += 1
            lines.append(f"  gap: seq {a_hi}..{b_lo - 1} not on disk (between segments "
                         f"{a_no} and {b_no})")
    cdir = os.path.join(directory, CURSOR_DIR)
    if os.path.isdir(cdir):
        for name in curlog.names(cdir):
            try:
                cur = curlog.load(cdir, name)
            except (OSError, ValueError) as e:
                problems += 1
                lines.append(f"  cursor {name}: unreadable ({e})")
                continue
            if cur is None:
                continue
            segno, off, seq = cur
            ok = _cursor_ok(directory, segs, segno, off, seq)
            if not ok:
                problems += 1
            lines.append(f"  cursor {name}: segment {segno} offset {off} seq {seq}: "
                         + ("ok" if ok else "does not point at a record"))
    head = (f"spool {directory}: {len(segs)} segments"
            + (f", seq {segs[0][1]}..{segs[-1][2] - 1}" if segs else "")
            + f", {problems} problem{'s' if problems != 1 else ''}")
    return [head] + lines, problems


def _cursor_ok(directory, segs, segno, off, seq) -> bool:
    known = {s[0]: s for s in segs}
    if segno not in known:
        # a segment that is gone (acknowledged and deleted, or lost): fine if it lies
        # between what is on disk
        return not segs or segno <= segs[-1][0] + 1
    _, lo, hi = known[segno]
    if off == fmt.HEADER_LEN:
        return seq == lo
    path = os.path.join(directory, fmt.segment_name(segno, True))
    if not os.path.exists(path):
        path = os.path.join(directory, fmt.segment_name(segno, False))
    last_end = None
    try:
        for r in iter_with_seq(path, os.path.getsize(path)):
            if r[0] == off:
                return r[2] == seq
            last_end = r[4]
    except (fmt.SegmentError, OSError):
        return False
    return seq == hi and last_end == off          # at the end of its segment


def repair(directory: str) -> list[str]:
    """Open the spool (recovery) with every output that has a cursor, fix damaged
    headers, compact the cursor logs, close.  Returns what was done."""
    from .spool import Spool
    done = []
    cdir = os.path.join(directory, CURSOR_DIR)
    readers = curlog.names(cdir) if os.path.isdir(cdir) else []
    sp = Spool(directory, readers=readers, fsync="batch", max_bytes=1 << 62)
    try:
        for seg in list(sp.ledger.segs.values()):
            try:
                fmt.read_header(seg.path)
                continue
            except fmt.SegmentError:
                pass
            if seg is sp.writer.active:
                sp.seal()
            _rewrite_header(seg.path, seg.segno, seg.created_ms, seg.first_seq)
            done.append(f"rewrote the damaged header of segment {seg.segno}")
        for r in sp.readers.values():
            r.compact_cursor_log()
            if r.lost:
                done.append(f"output {r.name}: {r.lost} records not on disk counted as lost "
                            f"({', '.join(f'{k} {v}' for k, v in r.lost_by_reason.items())})")
        done.append(f"recovered: {sp.corrupt_tails_cut} damaged tails/files handled")
    finally:
        sp.close()
    return done


def _rewrite_header(path: str, segno: int, created_ms: int, first_seq: int) -> None:
    tmp = path + ".tmp"
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        dst.write(fmt.encode_header(segno, created_ms, first_seq))
        src.seek(fmt.HEADER_LEN)
        while True:
            b = src.read(8 << 20)
            if not b:
                break
            dst.write(b)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="logjam-relay spool",
                                 description="offline tools for a spool directory")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fsck", help="check a spool directory (and --repair it)")
    f.add_argument("dir")
    f.add_argument("--repair", action="store_true",
                   help="make permanent what the relay's recovery does (takes the lock)")
    args = ap.parse_args(argv)
    d = args.dir
    if not os.path.isdir(d):
        print(f"spool fsck: {d}: not a directory", file=sys.stderr)
        return 2
    from ..progress import Progress
    try:
        with Progress("spool fsck", unit="files") as p:     # on a terminal only
            lines, problems = check(d, lambda i, n, fn: p.update(i, total=n, note=fn))
    except OSError as e:
        print(f"spool fsck: {d}: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if not args.repair:
        return 1 if problems else 0
    from .errors import SpoolError
    try:
        for line in repair(d):
            print("repair: " + line)
    except SpoolError as e:
        print(f"spool fsck --repair: {e}", file=sys.stderr)
        return 2
    lines, problems = check(d)
    print("after repair: " + lines[0])
    return 0
