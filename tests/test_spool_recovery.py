"""The durable spool: recovery after crashes and damage, write errors, fsck, cursor relocation."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from logjam_relay.spool import fs as fs_mod
from logjam_relay.spool import segment as fmt
from logjam_relay.spool import spool as spool_mod
from logjam_relay.spool.api import KIND_SAMWISE, Position
from logjam_relay.spool.spool import Spool, SpoolWriteError
from spool_helpers import drain, fill, msg, open_spool, segment_files, seq_of

# ---------------------------------------------------------------------------- recovery

def _closed_spool_with_open_segment(path, n=6):
    sp = open_spool(path, readers=["a"], segment_bytes=1 << 20)
    fill(sp, 0, n, batch=3, size=40)
    sp.close()                      # leaves the active segment as .open
    (open_name,) = segment_files(path)
    assert open_name.endswith(".open")
    return path / open_name


def test_recovery_cuts_torn_tail_at_every_byte_of_last_record(tmp_path):
    src = tmp_path / "src"
    seg = _closed_spool_with_open_segment(src)
    data = seg.read_bytes()
    offs = []
    pos = fmt.HEADER_LEN
    while pos < len(data):
        offs.append(pos)
        pos += fmt.PREFIX_LEN + fmt.PREFIX.unpack_from(data, pos)[0]
    last = offs[-1]
    work = tmp_path / "work"
    for cut in range(last + 1, len(data)):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(src, work)
        with open(work / seg.name, "r+b") as f:
            f.truncate(cut)
        sp = open_spool(work, readers=["a"])
        st = sp.stats()
        assert (st["corrupt_tails_cut"], st["corrupt_bytes_cut"]) == (1, cut - last), cut
        assert [seq_of(r) for r in drain(sp.reader("a"))] == [0, 1, 2, 3, 4]
        assert sp.last_sequence() == 4
        sp.append_batch([msg(100, 40)])          # continues in a fresh segment
        assert [seq_of(r) for r in sp.reader("a").read(10)] == [100]
        sp.close()
    # cut exactly at a record boundary: nothing to cut, the segment is continued
    shutil.rmtree(work)
    shutil.copytree(src, work)
    with open(work / seg.name, "r+b") as f:
        f.truncate(last)
    sp = open_spool(work, readers=["a"])
    assert sp.stats()["corrupt_tails_cut"] == 0
    assert len(drain(sp.reader("a"))) == 5
    sp.close()


def test_recovery_cuts_corrupt_record_in_open_segment(tmp_path):
    seg = _closed_spool_with_open_segment(tmp_path, n=9)
    data = bytearray(seg.read_bytes())
    # corrupt a byte in the body of record #4 (each record is 20+16+68 bytes)
    rec_len = len(data[fmt.HEADER_LEN:]) // 9
    data[fmt.HEADER_LEN + 4 * rec_len + 50] ^= 0xFF
    seg.write_bytes(bytes(data))
    sp = open_spool(tmp_path, readers=["a"])
    assert [seq_of(r) for r in drain(sp.reader("a"))] == [0, 1, 2, 3]   # 5..8 not served
    st = sp.stats()
    assert st["corrupt_tails_cut"] == 1 and st["corrupt_bytes_cut"] == 5 * rec_len
    sp.close()


def test_corrupt_record_in_sealed_segment_is_not_served(tmp_path):
    sp = open_spool(tmp_path, readers=["a", "b"], segment_bytes=4096)
    fill(sp, 0, 60, size=100)
    sp.seal()
    first = sorted(segment_files(tmp_path))[1]            # a middle sealed segment
    with open(tmp_path / first, "rb") as f:
        firstseq = fmt.decode_header(f.read(fmt.HEADER_LEN)).first_seq
    offs = [o for o, _, _ in fmt.iter_records(tmp_path / first)]
    with open(tmp_path / first, "r+b") as f:              # flip a byte inside record #2
        f.seek(offs[2] + 30)
        b = f.read(1)
        f.seek(offs[2] + 30)
        f.write(bytes([b[0] ^ 1]))
    a = sp.reader("a")
    seqs = [seq_of(r) for r in drain(a, batch=7)]
    # only the damaged record is skipped: reading resynchronises on the next record's
    # seq + CRC inside the same segment
    bad = {firstseq + 2}
    assert seqs == [s for s in range(60) if s not in bad]
    st = sp.stats()
    assert st["corrupt_records"] == 1
    assert a.stats()["lost"] == 0                 # counted when the cursor passes it
    a.rewind()                                   # nothing acked: the same records again
    assert [seq_of(r) for r in drain(a)] == seqs
    assert sp.stats()["corrupt_records"] == 1
    a.ack(Position(*a._served and list(a._served)[-1]))
    assert a.stats()["lost"] == 1 and a.stats()["lost_by_reason"] == {"corrupt": 1}
    assert a.stats()["backlog_records"] == 0
    b = sp.reader("b")                           # the other reader skips it too, counted
    recs = drain(b)
    assert [seq_of(r) for r in recs] == seqs
    b.ack(recs[-1].position)
    assert b.stats()["lost"] == 1
    sp.close()


def test_corrupt_sealed_segment_without_resync_loses_the_rest(tmp_path):
    sp = open_spool(tmp_path, readers=["a"], segment_bytes=4096)
    fill(sp, 0, 40, size=100)
    sp.seal()
    name = segment_files(tmp_path)[0]
    offs = [o for o, _, _ in fmt.iter_records(tmp_path / name)]
    size = os.path.getsize(tmp_path / name)
    with open(tmp_path / name, "r+b") as f:    # everything after record 1 overwritten
        f.seek(offs[1])
        f.write(b"\xee" * (size - fmt.SEAL_RECORD_LEN - offs[1]))
    a = sp.reader("a")
    recs = drain(a)
    a.ack(recs[-1].position)
    assert a.stats()["lost"] == len(offs) - 1
    assert a.stats()["backlog_records"] == 0
    assert len(recs) == 40 - (len(offs) - 1)
    sp.close()


def test_crash_without_close_then_reopen(tmp_path):
    sp = open_spool(tmp_path, readers=["a"])
    fill(sp, 0, 123)
    a = sp.reader("a")
    a.ack(a.read(23)[-1].position)
    a.persist()
    # no close(): fds are left open, nothing flushed beyond what append handed to the OS
    sp2 = open_spool(tmp_path, readers=["a"])
    assert [seq_of(r) for r in drain(sp2.reader("a"))] == list(range(23, 123))
    assert sp2.last_sequence() == 122
    fill(sp2, 123, 2)
    assert [seq_of(r) for r in sp2.reader("a").read(10)] == [123, 124]
    sp2.close()


def test_sigkill_during_appends(tmp_path):
    """A real crash: a child appends (fsync=never) and is SIGKILLed mid-stream."""
    code = textwrap.dedent(f"""
        import struct, sys
        from logjam_relay.spool.spool import Spool
        sp = Spool({str(tmp_path)!r}, readers=["a"], segment_bytes=65536, fsync="never")
        i = 0
        while True:
            sp.append_batch([[b"e", b"t", b"x" * 300,
                              struct.pack(">HBBIQQ", 0xCABD, 0, 1, 0, 0, i + k)]
                             for k in range(50)])
            i += 50
            if i == 2000:
                print("ready", flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    sp = open_spool(tmp_path, readers=["a"])
    seqs = [seq_of(r) for r in drain(sp.reader("a"))]
    assert len(seqs) >= 2000 and seqs == list(range(len(seqs)))
    assert sp.last_sequence() == len(seqs) - 1
    sp.close()


def test_segment_age_roll_and_seal_listener(tmp_path):
    now = [1_700_000_000.0]
    sealed = []
    sp = open_spool(tmp_path, readers=["a"], segment_age_s=10, clock=lambda: now[0],
                    on_seal=lambda segno, path: sealed.append((segno, path,
                                                               fmt.read_seal(path))))
    fill(sp, 0, 5)
    sp.tick()
    assert sealed == []
    now[0] += 11
    assert sp.reader("a").stats()["oldest_unacked_age_s"] == pytest.approx(11)
    sp.tick()                                   # idle segment rolled by age
    assert len(sealed) == 1
    segno, path, seal = sealed[0]
    assert path.endswith(".seg") and seal[0] == 5
    os.link(path, tmp_path / "archived.seg")    # what the archive output does
    fill(sp, 5, 5)
    now[0] += 11
    fill(sp, 10, 5)                             # age roll on append
    assert len(sealed) == 2
    a = sp.reader("a")
    a.ack(drain(a)[-1].position)
    sp.seal()
    assert not os.path.exists(path)             # consumed -> deleted; the hard link survives
    assert [f for _, _, f in fmt.iter_records(tmp_path / "archived.seg")] == \
        [msg(i) for i in range(5)]
    sp.close()


def test_last_meta_after_reopen(tmp_path):
    sp = open_spool(tmp_path, readers=[])
    assert sp.last_meta() is None
    fill(sp, 0, 30)
    sp.append_records([(KIND_SAMWISE, [b"not logjam"])])
    sp.close(seal=True)
    sp = open_spool(tmp_path, readers=[])
    assert sp.last_meta() == (0xCABD, 1, 1, 7, 1_700_000_000_029, 29)
    assert sp.last_sequence() == 29
    sp.close()


# ---------------------------------------------------------------------------- errors

def test_write_error_enospc_injected(tmp_path, monkeypatch):
    """Simulated: os.write is replaced by a function that writes part of the data and then
    raises ENOSPC, like a file system running full mid-write."""
    sp = open_spool(tmp_path, readers=["a"])
    fill(sp, 0, 20)
    real = fs_mod._write

    def failing(fd, data):
        real(fd, bytes(data[:100]))           # a partial record reaches the file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fs_mod, "_write", failing)
    for _ in range(3):
        with pytest.raises(SpoolWriteError) as e:
            sp.append_batch([msg(99)])
        assert e.value.reason == "enospc" and e.value.errno == errno.ENOSPC
        assert "No space left on device" in str(e.value) and "disk is full" in str(e.value)
    st = sp.stats()
    # the first failure sealed the segment: the seal failed even with the reserve given
    # back, so it was closed in memory (seal record owed); the next appends fail on the
    # new segment's header
    assert st["write_errors"] == 4 and st["write_errors_by_reason"] == {"enospc": 4}
    assert st["appends"] == 20 and st["disk_full"] == 1 and st["reserve_releases"] == 1
    assert st["deferred_seals"] == 1
    assert sp.paused_reason() == f"disk full (ENOSPC) on {tmp_path}" and sp.would_block()
    monkeypatch.setattr(fs_mod, "_write", real)
    sp.append_batch([msg(20)])
    assert [seq_of(r) for r in drain(sp.reader("a"))] == list(range(21))
    sp.tick()                                            # space again: the seal is written
    assert fmt.read_seal(tmp_path / fmt.segment_name(0, True)) is not None
    sp.close()
    sp = open_spool(tmp_path, readers=["a"])
    assert sp.stats()["corrupt_tails_cut"] == 0          # the partial write was cut at once
    assert len(drain(sp.reader("a"))) == 21
    sp.close()


def test_short_write_of_the_state_file_keeps_the_old_one(tmp_path, monkeypatch):
    """A full disk that takes only part of the state file (a short write, no error):
    the truncated file must not replace the good one (it holds the numbering)."""
    import json
    sp = open_spool(tmp_path, readers=["a"])
    fill(sp, 0, 5)
    sp._save_state()
    good = (tmp_path / spool_mod.STATE_FILE).read_bytes()
    real = fs_mod._write

    def short(fd, data):
        return real(fd, bytes(data[:10])) if len(data) > 10 else 0

    monkeypatch.setattr(fs_mod, "_write", short)
    with pytest.raises(SpoolWriteError) as e:
        sp._save_state()
    assert e.value.reason == "enospc"
    monkeypatch.setattr(fs_mod, "_write", real)
    assert (tmp_path / spool_mod.STATE_FILE).read_bytes() == good
    assert json.loads(good)["next_seq"] == 5
    sp.close()


def test_segments_sealed_by_recovery_reach_the_archive_without_readers(tmp_path):
    """A relay with an archive and no output (a chain's central relay) has a spool without
    readers. After a crash with a torn tail the recovery seals the open segment; it must
    stay until the archive has it (it used to be deleted at once: acknowledged records
    gone from spool and archive)."""
    from logjam_relay.outputs.archive import Archive
    from logjam_relay.spool.segment import iter_records
    sp = Spool(str(tmp_path / "sp"), readers=[], segment_bytes=1 << 20,
               on_seal=lambda n, p: None)
    for i in range(10):
        sp.append(msg(i))
    sp.sync()
    sp._release_lock()                                   # a SIGKILL: no close
    (seg,) = [n for n in os.listdir(tmp_path / "sp") if n.endswith(".open")]
    path = tmp_path / "sp" / seg
    os.truncate(path, os.path.getsize(path) - 3)         # torn in the 10th record
    (tmp_path / "arch").mkdir()
    archive = Archive(str(tmp_path / "arch"), 7 * 86400)
    sp = Spool(str(tmp_path / "sp"), readers=[], segment_bytes=1 << 20,
               on_seal=archive.on_seal)
    assert archive.catch_up(str(tmp_path / "sp")) == 1   # what the relay does at start
    (archived,) = os.listdir(tmp_path / "arch")
    assert len(list(iter_records(str(tmp_path / "arch" / archived)))) == 9
    sp.close()


def test_write_error_directory_replaced_by_file(tmp_path):
    """Real kernel error (we run as root, so EACCES cannot be provoked): the spool
    directory is moved away and a plain file takes its place -> ENOTDIR on the next
    segment creation."""
    d = tmp_path / "spool"
    sp = open_spool(d, readers=["a"], segment_bytes=4096)
    fill(sp, 0, 5)
    sp.seal()
    os.rename(d, tmp_path / "moved")
    d.write_bytes(b"not a directory")
    with pytest.raises(SpoolWriteError) as e:
        sp.append_batch([msg(5)])
    assert e.value.reason == "enotdir"
    assert "creating segment" in str(e.value) and str(d) in str(e.value)
    assert sp.stats()["write_errors_by_reason"] == {"enotdir": 1}
    sp.close()


def test_open_on_a_file_gives_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(SpoolWriteError) as e:
        open_spool(f / "spool")
    assert e.value.reason == "enotdir" and "opening spool directory" in str(e.value)



# ------------------------------------------------------- missing segments, fsck, cursors

def test_cursor_into_a_missing_segment_counts_only_its_rest(tmp_path):
    sp = open_spool(tmp_path, readers=["a", "hold"], segment_bytes=4096)
    fill(sp, 0, 120, size=100)
    sp.seal()
    a = sp.reader("a")
    recs = a.read(1000)
    segs = sorted({r.position.segment for r in recs})
    mid = segs[len(segs) // 2]
    in_mid = [r for r in recs if r.position.segment == mid]
    a.ack(in_mid[2].position)                    # cursor: the 4th record of segment mid
    first_after = seq_of(in_mid[3])
    sp.close()
    os.unlink(tmp_path / fmt.segment_name(mid, True))
    sp = open_spool(tmp_path, readers=["a", "hold"])
    a = sp.reader("a")
    seqs = [seq_of(r) for r in drain(a)]
    rest = len(in_mid) - 3
    assert seqs == list(range(first_after + rest, 120))
    assert a.stats()["lost"] == rest and a.stats()["lost_by_reason"] == {"missing": rest}
    hold = sp.reader("hold")                     # the other reader loses the whole segment
    hrecs = drain(hold)
    got = [seq_of(r) for r in hrecs]
    hold.ack(hrecs[-1].position)                 # counted when its cursor passes the gap
    hold_lost = hold.stats()["lost"]
    assert len(got) + hold_lost == 120 and hold_lost == len(in_mid)
    sp.close()


def test_new_records_after_a_missing_segment_are_never_skipped(tmp_path):
    sp = open_spool(tmp_path, readers=["a"], segment_bytes=4096)
    fill(sp, 0, 150, size=100)
    sp.close(seal=True)
    names = segment_files(tmp_path)
    os.unlink(tmp_path / names[1])
    os.unlink(tmp_path / names[2])
    sp = open_spool(tmp_path, readers=["a"], segment_bytes=4096)
    fill(sp, 150, 20, size=100)
    got = [seq_of(r) for r in drain(sp.reader("a"))]
    assert got[-20:] == list(range(150, 170))
    assert len(segment_files(tmp_path)) == len(names) - 2 + 1   # nothing else deleted
    a = sp.reader("a")
    a.ack(a.read(1)[0].position if False else Position(*list(a._served)[-1]))
    assert a.stats()["lost"] == 150 + 20 - len(got)
    sp.close()


def test_fsck_reports_and_repairs(tmp_path):
    sp = open_spool(tmp_path, readers=["a"], segment_bytes=4096)
    fill(sp, 0, 100, size=100)
    sp.close(seal=True)
    names = segment_files(tmp_path)
    with open(tmp_path / names[1], "r+b") as f:        # damaged header
        f.seek(4)
        f.write(b"\xff\xff")
    os.unlink(tmp_path / names[3])                       # a missing segment
    cmd = [sys.executable, "-m", "logjam_relay", "spool", "fsck", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    assert "header damaged (records intact)" in r.stdout and "gap: seq" in r.stdout
    r = subprocess.run(cmd + ["--repair"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "rewrote the damaged header of segment 1" in r.stdout
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert "header damaged" not in r.stdout and "gap: seq" in r.stdout   # loss stays known
    assert "Traceback" not in r.stderr
    sp = open_spool(tmp_path, readers=["a"], segment_bytes=4096)     # a running relay's lock
    try:
        r = subprocess.run(cmd + ["--repair"], capture_output=True, text=True)
        assert r.returncode == 2 and "in use by another process" in r.stderr, r.stderr
    finally:
        sp.close()


def test_cursor_with_a_bad_offset_is_relocated_by_its_seq(tmp_path):
    from logjam_relay.spool import cursors as curlog
    sp = open_spool(tmp_path, readers=["a"], segment_bytes=4096)
    fill(sp, 0, 80, size=100)
    sp.close(seal=True)
    segno = fmt.parse_segment_name(segment_files(tmp_path)[1])[0]
    curlog.write_entry(str(tmp_path / "cursors"), "a", segno, 10 ** 6, 37)   # past its end
    sp = open_spool(tmp_path, readers=["a"])
    a = sp.reader("a")
    assert [seq_of(r) for r in drain(a)] == list(range(37, 80))
    assert a.stats()["lost"] == 0
    sp.close()
    curlog.write_entry(str(tmp_path / "cursors"), "a", segno + 50, 40, 10 ** 9)  # nonsense
    sp = open_spool(tmp_path, readers=["a"])
    a = sp.reader("a")
    got = [seq_of(r) for r in drain(a)]
    assert got == list(range(got[0], 80)) and a.stats()["lost"] == 0   # duplicates only
    fill(sp, 80, 5, size=100)
    assert [seq_of(r) for r in drain(a)] == list(range(80, 85))      # new records flow
    sp.close()


def test_segment_cut_while_running_loses_only_the_cut_records(tmp_path):
    sp = open_spool(tmp_path, readers=["a"], segment_bytes=4096)
    fill(sp, 0, 60, size=100)
    sp.seal()
    name = segment_files(tmp_path)[1]
    offs = [o for o, _, _ in fmt.iter_records(tmp_path / name)]
    with open(tmp_path / name, "rb") as f:
        first = fmt.decode_header(f.read(fmt.HEADER_LEN)).first_seq
    os.truncate(tmp_path / name, offs[3] + 10)          # records 3.. of it are gone
    a = sp.reader("a")
    recs = drain(a)
    a.ack(recs[-1].position)
    gone = set(range(first + 3, first + len(offs)))
    assert [seq_of(r) for r in recs] == [s for s in range(60) if s not in gone]
    assert a.stats()["lost"] == len(gone) and a.stats()["backlog_records"] == 0
    sp.close()
