"""The relay's batch paths (relay/batchpath.py): one chosen per relay, each numbering the
spool's records through one part."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from spool_helpers import drain, msg, open_spool

from logjam_relay.config import Settings
from logjam_relay.relay.batchpath import GroupCommitted, NoSpool, Replies, Spooled, choose
from logjam_relay.relay.spoolwrite import SpoolWrites
from logjam_relay.spool import segment as fmt
from logjam_relay.spool.errors import SpoolWriteError


def seqs(directory) -> list[int]:
    out = []
    for p in sorted(directory.iterdir()):
        if fmt.parse_segment_name(p.name):
            buf = p.read_bytes()
            out += [r[2] for r in fmt.parse_records(buf, fmt.HEADER_LEN, len(buf), 1 << 20)[0]]
    return out


@pytest.mark.parametrize("fsync,kind", [(None, NoSpool), ("never", Spooled),
                                        ("interval", Spooled), ("batch", GroupCommitted)])
def test_the_path_follows_from_the_spool_and_its_fsync_policy(tmp_path, fsync, kind):
    from logjam_relay.relay.spoolwrite import relay_fsync_policy
    settings = Settings(spool_fsync=fsync or "never")
    sp = open_spool(tmp_path / "s", fsync=relay_fsync_policy(settings)) if fsync else None
    path = choose(sp, SpoolWrites(lambda: False), Replies(), settings)
    assert type(path) is kind
    assert (path.commits is not None) == (kind is GroupCommitted)
    assert path.next_seq() == (-1 if sp is None else sp.next_seq)
    if sp is not None:
        sp.close()


async def test_a_batch_held_for_its_retry_keeps_its_numbers(tmp_path, monkeypatch):
    """Spooled: a C-pass batch numbered from the spool's next seq whose write fails is held
    and retried; the ingest pauses meanwhile, and a heartbeat and an input's batch that
    come meanwhile go in after it, so its numbers stay its own (the spool refuses records
    numbered from another seq) and the spool stays gapless and in order."""
    sp = open_spool(tmp_path / "s", readers=["a"])
    sp.append_batch([msg(0)])
    path = Spooled(sp, SpoolWrites(lambda: False), Replies())
    real = sp.append_encoded
    failures = []

    def fails_once(*args):
        if not failures:
            failures.append(1)
            raise SpoolWriteError("io", "injected")
        return real(*args)
    monkeypatch.setattr(sp, "append_encoded", fails_once)
    batch = [msg(i) for i in range(1, 4)]
    first = path.next_seq()
    data = fmt.encode_logjam_batch(batch, first)
    hb, inp = msg(90), [msg(91), msg(92)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(path.take, None, None, None, (data, 3, first, batch[-1][3]))
        await trio.testing.wait_all_tasks_blocked()
        assert failures and path.would_block()          # held: the ingest pauses
        path.spool_heartbeats(hb)
        nursery.start_soon(path.commit, inp)
    assert not path.would_block()
    recs = drain(sp.reader("a"))
    assert [r.frames for r in recs] == [msg(0), *batch, hb, *inp]
    assert seqs(tmp_path / "s") == list(range(len(recs)))          # gapless, in order
    sp.close()


async def test_the_group_commit_numbers_ahead_of_the_spool(tmp_path):
    """GroupCommitted: the next seq counts the records handed in and not yet written."""
    from logjam_relay.relay.spoolwrite import relay_fsync_policy
    settings = Settings(spool_fsync="batch")
    sp = open_spool(tmp_path / "s", fsync=relay_fsync_policy(settings))
    path = choose(sp, SpoolWrites(lambda: False), Replies(), settings)
    assert path.next_seq() == sp.next_seq == 0
    await path.take(None, None, records=[msg(1), msg(2)])
    assert sp.next_seq == 0 and path.next_seq() == 2
    sp.close()
