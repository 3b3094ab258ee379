"""Archive output: sealed spool segments are linked/copied into an archive with retention."""

import errno
import os
import struct

import trio

from logjam_relay.outputs import archive as archive_mod
from logjam_relay.outputs.archive import Archive, archived_segments
from logjam_relay.spool import segment as fmt
from logjam_relay.spool.spool import Spool


def meta(seq: int) -> bytes:
    return struct.pack(">HBBIQQ", 0xCABD, 0, 1, 7, 1_700_000_000_000 + seq, seq)


def msgs(start: int, n: int) -> list[list[bytes]]:
    return [[b"app-prod", b"logs.app.prod", b"x" * 200, meta(i)] for i in range(start, start + n)]


def spool(path, archive, **kw):
    kw.setdefault("segment_bytes", 8192)
    return Spool(path, readers=["r"], fsync="never", on_seal=archive.on_seal, **kw)


def seqs_in(path) -> list[int]:
    return [struct.unpack(">HBBIQQ", fr[3])[5] for _, _, fr in fmt.iter_records(path)]


def test_sealed_segments_are_linked_and_survive_spool_deletion(tmp_path):
    ar = Archive(tmp_path / "archive", retention_s=3600)
    sp = spool(tmp_path / "spool", ar)
    for k in range(0, 200, 20):
        sp.append_batch(msgs(k, 20))
    sp.seal()
    segs = archived_segments(ar.directory)
    assert len(segs) >= 3
    assert ar.linked == len(segs) and ar.copied == 0 and ar.errors == 0
    # the archive holds the same inode as the spool (hard link), complete and sealed
    for _segno, path in segs:
        assert fmt.read_seal(path) is not None
        assert os.stat(path).st_nlink == 2
    # the reader acknowledges everything: the spool deletes its segments
    r = sp.reader("r")
    while True:
        got = r.read(1000)
        if not got:
            break
        r.ack(got[-1].position)
    sp.tick()
    sp.close()
    assert not [f for f in os.listdir(tmp_path / "spool") if f.endswith(".seg")]
    allseq = [s for _, p in archived_segments(ar.directory) for s in seqs_in(p)]
    assert allseq == list(range(200))
    assert not [f for f in os.listdir(ar.directory) if f.endswith(".tmp")]


def test_copy_fallback_when_link_fails(tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(errno.EXDEV, "cross-device link")
    monkeypatch.setattr(archive_mod.os, "link", no_link)
    ar = Archive(tmp_path / "archive", retention_s=None)
    sp = spool(tmp_path / "spool", ar)
    sp.append_batch(msgs(0, 30))
    sp.seal()
    sp.close()
    (segno, path), = archived_segments(ar.directory)
    assert ar.copied == 1 and ar.linked == 0
    src = os.path.join(tmp_path / "spool", fmt.segment_name(segno, True))
    assert open(path, "rb").read() == open(src, "rb").read()
    assert os.stat(path).st_ino != os.stat(src).st_ino
    assert int(os.stat(path).st_mtime) == int(os.stat(src).st_mtime)   # retention from seal
    assert seqs_in(path) == list(range(30))


def test_failed_handover_is_counted_and_retried(tmp_path, monkeypatch):
    calls = {"n": 0}
    real_link = os.link

    def flaky(src, dst):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_link(src, dst)
    monkeypatch.setattr(archive_mod.os, "link", flaky)
    ar = Archive(tmp_path / "archive", retention_s=None)
    sp = spool(tmp_path / "spool", ar)
    sp.append_batch(msgs(0, 10))
    sp.seal()                               # the listener fails, the spool carries on
    assert ar.errors == 1 and ar.stats()["pending"] == 1
    assert archived_segments(ar.directory) == []
    ar.retry_pending()
    assert len(archived_segments(ar.directory)) == 1 and ar.stats()["pending"] == 0
    sp.close()


def test_rearchiving_is_idempotent_and_catch_up_finds_unannounced(tmp_path):
    ar = Archive(tmp_path / "archive", retention_s=None)
    sp = Spool(tmp_path / "spool", readers=["r"], fsync="never", segment_bytes=8192)
    for k in range(0, 100, 20):
        sp.append_batch(msgs(k, 20))
    sp.seal()
    sp.close()
    n = len(archived_segments(tmp_path / "spool"))
    assert ar.catch_up(tmp_path / "spool") == n
    assert ar.catch_up(tmp_path / "spool") == 0
    segno, path = archived_segments(tmp_path / "spool")[0]
    assert ar.on_seal(segno, path) and ar.already_present >= 1
    assert len(archived_segments(ar.directory)) == n


def test_catch_up_skips_files_without_seal(tmp_path):
    src = tmp_path / "spool"
    src.mkdir()
    bad = src / fmt.segment_name(5, True)
    bad.write_bytes(fmt.encode_header(5, 0, 0) + b"\x00" * 10)
    ar = Archive(tmp_path / "archive")
    assert ar.catch_up(src) == 0
    assert archived_segments(ar.directory) == []


def test_prune_by_retention(tmp_path):
    now = [1_000_000.0]
    ar = Archive(tmp_path / "archive", retention_s=100, clock=lambda: now[0])
    sp = spool(tmp_path / "spool", ar)
    for k in range(0, 120, 20):
        sp.append_batch(msgs(k, 20))
    sp.seal()
    sp.close()
    segs = archived_segments(ar.directory)
    assert len(segs) >= 3
    # segment i sealed at time 1000 + 10*i
    for i, (_, p) in enumerate(segs):
        os.utime(p, (1000 + 10 * i, 1000 + 10 * i))
    stale = os.path.join(ar.directory, ".00000000000000000099.seg.tmp")
    open(stale, "wb").close()
    os.utime(stale, (0, 0))
    assert ar.prune(now=1000 + 10 * 1 + 100) == 2          # segments 0 and 1 are older
    assert [s for s, _ in archived_segments(ar.directory)] == [s for s, _ in segs[2:]]
    assert not os.path.exists(stale)
    assert ar.prune(now=10**9) == len(segs) - 2
    assert ar.stats()["pruned"] == len(segs) and ar.stats()["segments"] == 0


def test_no_retention_keeps_everything(tmp_path):
    ar = Archive(tmp_path / "archive", retention_s=0)
    sp = spool(tmp_path / "spool", ar)
    sp.append_batch(msgs(0, 10))
    sp.seal()
    sp.close()
    assert ar.prune(now=10**12) == 0
    assert len(archived_segments(ar.directory)) == 1


async def test_run_prunes_periodically(tmp_path):
    now = [10_000.0]
    ar = Archive(tmp_path / "archive", retention_s=50, clock=lambda: now[0])
    sp = spool(tmp_path / "spool", ar)
    sp.append_batch(msgs(0, 10))
    sp.seal()
    sp.close()
    (_, p), = archived_segments(ar.directory)
    os.utime(p, (9_000, 9_000))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ar.run, 0.01)
        with trio.fail_after(5):
            while archived_segments(ar.directory):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert ar.pruned == 1
