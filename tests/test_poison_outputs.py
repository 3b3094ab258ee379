"""Poison events never block an output: dead letters, bisection, bounded inflating.

In-process, against the in-repo readers on loopback (the real-command variants are in
tests/test_relay_poison.py).
"""

from __future__ import annotations

import json
import zlib

import pytest
import trio

from logjam_relay.deadletter import DeadLetterStore, read_dead_letters
from logjam_relay.io.net import TLSSettings
from logjam_relay.limits import BadBody, EventTooLarge, inflate_bounded
from logjam_relay.outputs.courier import CourierConfig, CourierOutput
from logjam_relay.outputs.lumberjack import LumberjackConfig, LumberjackOutput
from logjam_relay.protocols.logjam import compress, encode_meta
from logjam_relay.spool.api import MemorySource
from peers.courier_receiver import CourierReceiver
from peers.lumberjack_reader import LumberjackReader

POISON = b"POISON"
LIMIT = 64 * 1024


def good(i: int) -> bytes:
    return json.dumps({"i": i, "msg": "fine"}).encode()


def rec(body: bytes, i: int, comp: int = 0) -> list[bytes]:
    return [b"app-prod", b"logs.app", body, encode_meta(comp, 1, 1_700_000_000_000 + i, i + 1)]


def bomb(size: int) -> bytes:
    return zlib.compress(b"\0" * size, 9)


async def run_until_acked(nursery, out, src, timeout=20.0):
    cs = trio.CancelScope()

    async def runner():
        with cs:
            await out.run()
    nursery.start_soon(runner)
    with trio.fail_after(timeout):
        while not src.all_acked:
            await trio.sleep(0.01)
    cs.cancel()


def lj_out(port, src, store, **kw):
    cfg = LumberjackConfig(hosts=(("127.0.0.1", port),), tls=TLSSettings(enabled=False),
                           backoff_min=0.01, backoff_max=0.05, name="lj", **kw)
    return LumberjackOutput(src, cfg, dead_letters=store, max_event_bytes=LIMIT)


def co_out(port, src, store, **kw):
    kw.setdefault("payload_size", 50)
    cfg = CourierConfig(hosts=(("127.0.0.1", port),), tls=TLSSettings(enabled=False),
                        backoff_initial=0.01, backoff_max=0.05, network_timeout=5.0,
                        max_event_bytes=LIMIT, name="co", **kw)
    return CourierOutput(cfg, src, dead_letters=store)


# ------------------------------------------------------------------ inflate_bounded

def test_inflate_bounded_every_codec():
    body = b'{"a":"' + b"x" * 1000 + b'"}'
    for codec in (0, 1, 2, 3, "zlib", "snappy", "lz4", "none"):
        num = codec if isinstance(codec, int) else {"none": 0, "zlib": 1, "snappy": 2,
                                                      "lz4": 3}[codec]
        assert inflate_bounded(codec, compress(body, num), 2000) == body
        with pytest.raises(EventTooLarge):
            inflate_bounded(codec, compress(body, num), 1000)
    import gzip

    import lz4.frame
    assert inflate_bounded("gzip", gzip.compress(body), 2000) == body
    assert inflate_bounded("lz4frame", lz4.frame.compress(body), 2000) == body
    with pytest.raises(EventTooLarge):
        inflate_bounded("lz4frame", lz4.frame.compress(body), 100)
    with pytest.raises(EventTooLarge):
        inflate_bounded("gzip", gzip.compress(body), 100)
    for codec, junk in ((1, b"not zlib"), (3, b"\0\0\0\x10\x01"), (2, b"\x0a\xff\xff\xff"),
                        (9, b"x"), ("lz4frame", b"nope")):
        with pytest.raises(BadBody):
            inflate_bounded(codec, junk, 1 << 20)
    # a lying lz4 length prefix is refused before anything is allocated
    with pytest.raises(EventTooLarge):
        inflate_bounded(3, b"\x7f\xff\xff\xff" + b"\0" * 10, 1 << 20)


def test_zlib_bomb_costs_the_limit_not_the_bomb():
    import resource
    b = bomb(200 * 1024 * 1024)                   # 200 MiB of zeros in ~200 KB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(EventTooLarge):
        inflate_bounded("zlib", b, 1024 * 1024)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 50 * 1024, f"peak RSS grew {grown_kib} KiB inflating a bomb"


# ------------------------------------------------------------------ dead-letter store

def test_store_is_bounded_and_counts_what_it_drops(tmp_path):
    st = DeadLetterStore(tmp_path / "dl", max_bytes=100_000)
    for i in range(60):
        st.put("o", "too_large", rec(b"y" * 4000, i), position=(1, i), detail=f"#{i}")
    letters = list(read_dead_letters(tmp_path / "dl"))
    assert st.bytes <= 100_000
    assert st.dropped + len(letters) == 60 and st.dropped > 0
    assert letters[-1].detail == "#59"
    assert letters[-1].position == (1, 59) and letters[-1].reason == "too_large"
    assert st.count_for("o") == {"too_large": 60}
    st.close()
    # a restart appends to a new file; the old letters stay readable
    st2 = DeadLetterStore(tmp_path / "dl", max_bytes=100_000)
    st2.put("o", "refused", rec(b"z", 1))
    after = list(read_dead_letters(tmp_path / "dl"))
    assert after[-1].reason == "refused" and len(after) == len(letters) + 1


# ------------------------------------------------------------------ Lumberjack

@pytest.mark.parametrize("where", [0, 37, 100])
async def test_lumberjack_refused_event_is_bisected_out(nursery, tmp_path, where):
    store = DeadLetterStore(tmp_path / "dl")
    src = MemorySource()
    for i in range(101):
        src.append(rec(POISON if i == where else good(i), i))
    reader = LumberjackReader(refuse=lambda ev: ev.fields.get("line") == "POISON")
    await nursery.start(reader.serve)
    out = lj_out(reader.port, src, store, window=64, pipeline=4)
    if where == 100:
        # the refused event is the last one: it is diverted once something behind it is
        # acknowledged, so more traffic arrives later
        async def later():
            await trio.sleep(1.0)
            src.append(rec(good(101), 101))
        nursery.start_soon(later)
    await run_until_acked(nursery, out, src)
    lines = [e.fields["line"] for e in reader.events]
    assert POISON.decode() not in lines
    assert sorted(json.loads(x)["i"] for x in lines) == \
        [i for i in range(102 if where == 100 else 101) if i != where]
    letters = list(read_dead_letters(tmp_path / "dl"))
    assert [(d.reason, d.frames[2], d.output) for d in letters] == [("refused", POISON, "lj")]
    assert out.stats()["dead_letters"] == {"refused": 1}


@pytest.mark.parametrize("kind", ["lumberjack", "courier"])
async def test_receiver_refusing_everything_fills_no_dead_letters(nursery, tmp_path, kind):
    """A receiver that refuses every window/payload (a proxy without a backend) is retried,
    never bisected into the dead-letter store."""
    store = DeadLetterStore(tmp_path / "dl")
    src = MemorySource()
    for i in range(20):
        src.append(rec(good(i), i))
    if kind == "lumberjack":
        peer = LumberjackReader(refuse=lambda ev: True)
        await nursery.start(peer.serve)
        out = lj_out(peer.port, src, store, window=8)
    else:
        peer = CourierReceiver(refuse=lambda ev: True)
        await nursery.start(peer.serve)
        out = co_out(peer.port, src, store, payload_size=8)
    with trio.move_on_after(4):
        await out.run()
    assert out.refusals >= 8
    assert list(read_dead_letters(tmp_path / "dl")) == []
    assert not src.all_acked and src.stats()["backlog_records"] == 20


async def test_lumberjack_over_limit_events_are_dead_lettered(nursery, tmp_path):
    store = DeadLetterStore(tmp_path / "dl")
    src = MemorySource()
    for i in range(30):
        if i == 5:
            src.append(rec(b"p" * (LIMIT + 1), i))                      # plain, too large
        elif i == 9:
            src.append(rec(bomb(60 * 1024 * 1024), i, comp=1))         # 60 MiB zlib bomb
        elif i == 12:
            src.append(rec(b"\x7f\xff\xff\xff" + b"\0" * 20, i, comp=3))   # lying lz4 prefix
        else:
            src.append(rec(compress(good(i), i % 4), i, comp=i % 4))
    reader = LumberjackReader()
    await nursery.start(reader.serve)
    out = lj_out(reader.port, src, store, window=10, compression=0)
    await run_until_acked(nursery, out, src)
    got = sorted(json.loads(e.fields["line"])["i"] for e in reader.events)
    assert got == [i for i in range(30) if i not in (5, 9, 12)]
    letters = list(read_dead_letters(tmp_path / "dl"))
    assert [(d.reason, d.position[1]) for d in letters] == \
        [("too_large", 5), ("too_large", 9), ("too_large", 12)]
    assert out.stats()["dead_letters"] == {"too_large": 3}


# ------------------------------------------------------------------ Courier

@pytest.mark.parametrize("where", [0, 77])
async def test_courier_refused_event_is_bisected_out(nursery, tmp_path, where):
    store = DeadLetterStore(tmp_path / "dl")
    src = MemorySource()
    for i in range(101):
        src.append(rec(b'{"poison":1}' if i == where else good(i), i))
    rcv = CourierReceiver(refuse=lambda ev: b'"poison"' in ev, ack_chunk=7)
    await nursery.start(rcv.serve)
    out = co_out(rcv.port, src, store)
    await run_until_acked(nursery, out, src)
    got = [json.loads(e)["payload"] for e in rcv.events]
    assert all("poison" not in g for g in got)
    assert sorted(set(g["i"] for g in got)) == [i for i in range(101) if i != where]
    letters = list(read_dead_letters(tmp_path / "dl"))
    assert [(d.reason, d.position[1]) for d in letters] == [("refused", where)]
    assert out.stats()["dead_letters"] == {"refused": 1}


async def test_courier_over_limit_events_are_dead_lettered_off_the_loop(nursery, tmp_path):
    store = DeadLetterStore(tmp_path / "dl")
    src = MemorySource()
    for i in range(40):
        if i in (3, 4):
            src.append(rec(bomb(60 * 1024 * 1024), i, comp=1))
        elif i == 20:
            src.append(rec(b'"' + b"q" * LIMIT + b'"', i))
        else:
            src.append(rec(good(i), i))
    rcv = CourierReceiver()
    await nursery.start(rcv.serve)
    out = co_out(rcv.port, src, store, payload_size=10)
    await run_until_acked(nursery, out, src)
    got = sorted(json.loads(e)["payload"]["i"] for e in rcv.events)
    assert got == [i for i in range(40) if i not in (3, 4, 20)]
    letters = list(read_dead_letters(tmp_path / "dl"))
    assert sorted(d.position[1] for d in letters) == [3, 4, 20]
    assert {d.reason for d in letters} == {"too_large"}


async def test_courier_partial_ack_moves_the_spool_cursor_inside_a_payload(nursery, tmp_path):
    src = MemorySource()
    for i in range(100):
        src.append(rec(good(i), i))
    release = trio.Event()
    seen = 0

    async def sink(nonce, part):
        nonlocal seen
        seen += len(part)
        if seen > 30:
            await release.wait()
    rcv = CourierReceiver(ack_chunk=10, sink=sink)
    await nursery.start(rcv.serve)
    out = co_out(rcv.port, src, None, payload_size=100)
    cs = trio.CancelScope()

    async def runner():
        with cs:
            await out.run()
    nursery.start_soon(runner)
    with trio.fail_after(10):
        while not src.acked_positions or src.acked_positions[-1].offset < 29:
            await trio.sleep(0.01)
    # the payload of 100 is not complete, yet the cursor is inside it
    assert src._acked == 30 and out.stats()["partial_acks"] >= 1
    release.set()
    with trio.fail_after(10):
        while not src.all_acked:
            await trio.sleep(0.01)
    cs.cancel()


# ------------------------------------------------------------------ settings, CMDP, CLI

def test_max_event_bytes_and_dead_letter_settings_are_validated():
    from logjam_relay import config
    s = config.load({}, environ={})
    assert s.max_event_bytes == 10 * 1024 * 1024 and s.dead_letter_max_bytes == 1024 ** 3
    s = config.load({}, environ={"LOGJAM_RELAY_MAX_EVENT_BYTES": "1MiB",
                                 "LOGJAM_RELAY_DEAD_LETTER_DIR": "/x/dl"})
    assert s.max_event_bytes == 1024 * 1024 and str(s.resolved_dead_letter_dir()) == "/x/dl"
    with pytest.raises(config.ConfigError, match=r"max_event_bytes \(--max-event-bytes\): "
                                                 r"must be between 1KiB and 1GiB"):
        config.load({"max_event_bytes": "100"}, environ={})
    with pytest.raises(config.ConfigError, match=r"dead_letter_max_bytes "
                                                 r"\(--dead-letter-max-bytes\): must be "
                                                 r">= max_event_bytes"):
        config.load({"dead_letter_max_bytes": "1MiB"}, environ={})


def test_cmdp_stat_carries_dead_letters():
    from logjam_relay.health.cmdp import RelayStatsProvider
    p = RelayStatsProvider(lambda: {}, lambda: {"lj": {"dead_letters": 3}})
    assert p()["OUTPUT_LJ_DEAD_LETTERS"].value == 3


def test_deadletters_list_and_show_commands(tmp_path, capsys):
    from logjam_relay.tools.deadletters import main
    st = DeadLetterStore(tmp_path / "dl")
    st.put("lj", "too_large", rec(compress(b'{"big":1}', 1), 7, comp=1), detail="over")
    st.put("co", "refused", rec(b'{"r":1}', 8), position=(3, 99))
    assert main(["list", "--dir", str(tmp_path / "dl")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "\tlj\ttoo_large\tapp-prod\t" in out[0] and out[1].endswith("\t")
    assert main(["list", "--dir", str(tmp_path / "dl"), "--json", "--reason", "refused"]) == 0
    (only,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert only["output"] == "co" and only["position"] == [3, 99]
    assert main(["show", "--dir", str(tmp_path / "dl"), "--id", out[0].split("\t")[0]]) == 0
    shown = capsys.readouterr().out
    assert '{"big":1}' in shown                          # inflated for display
    assert main(["show", "--dir", str(tmp_path / "dl"), "--id", "99:1"]) == 1
    assert main(["resend", "--dir", str(tmp_path / "dl")]) == 2       # --to is required


def test_deadletters_resend_into_a_relay_pull_port(tmp_path):
    import zmq

    from conftest import free_port
    from logjam_relay.tools.deadletters import resend
    st = DeadLetterStore(tmp_path / "dl")
    for i in range(3):
        st.put("lj", "refused", rec(good(i), i))
    letters = list(read_dead_letters(tmp_path / "dl"))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = free_port()
    pull.bind(f"tcp://127.0.0.1:{port}")
    try:
        assert resend(letters, f"tcp://127.0.0.1:{port}", max_event_bytes=LIMIT, timeout=5,
                      relay_host="h") == 3
        pull.setsockopt(zmq.RCVTIMEO, 5000)
        got = [pull.recv_multipart() for _ in range(3)]
        assert got == [rec(good(i), i) for i in range(3)]
        # nobody listening: nothing is reported as sent
        assert resend(letters, f"tcp://127.0.0.1:{free_port()}", max_event_bytes=LIMIT,
                      timeout=1, relay_host="h") == 0
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("kind", ["lumberjack", "courier"])
async def test_receiver_size_limit_below_ours_is_found_and_diverted(nursery, tmp_path, kind):
    """An event under max_event_bytes but over the receiver's own limit: refused, bisected
    out, dead-lettered; the rest flows."""
    store = DeadLetterStore(tmp_path / "dl")
    src = MemorySource()
    for i in range(60):
        src.append(rec(json.dumps({"i": i, "pad": "z" * (5000 if i == 23 else 10)}).encode(), i))
    if kind == "lumberjack":
        peer = LumberjackReader(max_event_bytes=2000)
        await nursery.start(peer.serve)
        out = lj_out(peer.port, src, store, window=16)
    else:
        peer = CourierReceiver(max_event_bytes=2000)
        await nursery.start(peer.serve)
        out = co_out(peer.port, src, store, payload_size=16)
    await run_until_acked(nursery, out, src)
    events = [e.fields["line"] for e in peer.events] if kind == "lumberjack" else \
        [json.dumps(json.loads(e)["payload"]) for e in peer.events]
    assert sorted({json.loads(x)["i"] for x in events}) == [i for i in range(60) if i != 23]
    (letter,) = read_dead_letters(tmp_path / "dl")
    assert letter.reason == "refused" and letter.position[1] == 23 and peer.refused >= 6


def test_letter_larger_than_the_budget_is_counted_not_raised(tmp_path):
    st = DeadLetterStore(tmp_path / "dl", max_bytes=10_000)
    assert st.put("o", "too_large", [b"x" * 20_000]) is None      # larger than the budget
    assert st.dropped == 1 and st.count_for("o") == {"too_large": 1}
    assert st.put("o", "too_large", [b"x" * 2_000]) is not None
    assert len(list(read_dead_letters(tmp_path / "dl"))) == 1


def test_damaged_store_files_never_stop_list_or_the_relay_store(tmp_path):
    """A torn tail, a flipped byte inside a letter, a garbage file and a directory with a
    store file's name: `deadletters list` (the real command) still lists every intact
    letter and exits 0, and the relay's store still opens and writes."""
    import os
    import subprocess
    import sys

    from logjam_relay.spool import segment as seg
    dl = tmp_path / "dl"
    st = DeadLetterStore(dl, max_bytes=8 * 1024 * 1024)
    for i in range(5):
        st.put("o", "refused", rec(good(i), i), position=(1, i), detail=f"#{i}")
    st._seal()                                  # file 1: sealed, 5 letters
    for i in range(5, 8):
        st.put("o", "refused", rec(good(i), i), position=(1, i), detail=f"#{i}")
    st.close()                                  # file 2: open, 3 letters
    f1, f2 = sorted(p for p in dl.iterdir())
    ids = [d.id for d in read_dead_letters(dl)]
    assert len(ids) == 8
    # flip a byte inside the body of letter #2 (file 1), tear the last letter of file 2
    off2 = int(ids[2].split(":")[1])
    b = bytearray(f1.read_bytes())
    b[off2 + 30] ^= 0x40
    f1.write_bytes(bytes(b))
    with open(f2, "r+b") as f:
        f.truncate(os.path.getsize(f2) - 7)
    (dl / seg.segment_name(3, sealed=True)).write_bytes(b"\x00garbage" * 10)
    (dl / seg.segment_name(4, sealed=False)).write_bytes(b"")
    (dl / seg.segment_name(5, sealed=True)).mkdir()

    r = subprocess.run([sys.executable, "-m", "logjam_relay", "deadletters", "list", "--dir",
                        str(dl), "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    got = [json.loads(x)["detail"] for x in r.stdout.splitlines()]
    # the damaged letter is skipped, the ones after it in the same file are found again
    assert got == ["#0", "#1", "#3", "#4", "#5", "#6"], (got, r.stderr)
    assert "damaged record skipped" in r.stderr

    st2 = DeadLetterStore(dl, max_bytes=8 * 1024 * 1024)
    assert st2.put("o", "too_large", rec(good(99), 99), detail="#99") is not None
    st2.close()
    assert [d.detail for d in read_dead_letters(dl)][-1] == "#99"


def test_letters_with_odd_meta_are_listed_not_raised(tmp_path):
    """A record that is intact but whose meta frame is not the store's (JSON list, wrong
    types, no JSON at all) is listed with '?' fields."""
    from logjam_relay.spool import segment as seg
    dl = tmp_path / "dl"
    dl.mkdir()
    metas = [b"[1,2]", b'{"time_ms":"x","position":["a",1],"output":3}', b"\xff\xfe", b"null"]
    data = seg.encode_header(1, 0, 0) + b"".join(
        seg.encode_records([(0, [m, b"s", b"t", b"{}", encode_meta(0, 1, 1, 1)])], i)
        for i, m in enumerate(metas))
    (dl / seg.segment_name(1, sealed=False)).write_bytes(data)
    letters = list(read_dead_letters(dl))
    assert [(d.reason, d.time_ms, d.position) for d in letters] == [("?", 0, None)] * 4
    assert letters[1].output == "3"
    assert all(d.summary()["stream"] == "s" for d in letters)


async def test_resend_counts_letters_the_output_diverts_again_as_not_delivered(
        nursery, tmp_path, capsys):
    """`resend` must not report a letter as delivered when the output diverted it again
    (still over --max-event-bytes): the output acknowledges it to its source all the same."""
    from conftest import free_port
    from logjam_relay.tools.deadletters import resend
    st = DeadLetterStore(tmp_path / "dl")
    st.put("lj", "too_large", rec(b'"' + b"x" * 5000 + b'"', 0))
    st.put("lj", "refused", rec(good(1), 1))
    letters = list(read_dead_letters(tmp_path / "dl"))
    port = free_port()
    peer = LumberjackReader(port=port)
    await nursery.start(peer.serve)
    n = await trio.to_thread.run_sync(lambda: resend(
        letters, f"lumberjack://127.0.0.1:{port}?tls=off", max_event_bytes=1024, timeout=10,
        relay_host="h"))
    assert n == 1 and len(peer.events) == 1
    assert "1 too_large (raise --max-event-bytes)" in capsys.readouterr().err
    n = await trio.to_thread.run_sync(lambda: resend(
        letters[:1], f"lumberjack://127.0.0.1:{port}?tls=off", max_event_bytes=8192,
        timeout=10, relay_host="h"))
    assert n == 1 and len(peer.events) == 2


async def test_lumberjack_window_is_cut_at_window_bytes(nursery, tmp_path):
    """`window_bytes` bounds a window in bytes: 40 plain events of 30 KB with window=100 and
    window_bytes=64KiB go in windows of at most 3 events (the window ends after the record
    that reaches the cap), all delivered once and in order; the URL parameter is parsed."""
    from logjam_relay.outputs.lumberjack import parse_url
    assert parse_url("lumberjack://h?window_bytes=64KiB").window_bytes == 65536
    for bad in ("window_bytes=1000", "window_bytes=lots"):
        with pytest.raises(ValueError, match="window_bytes"):
            parse_url(f"lumberjack://h?{bad}")
    src = MemorySource()
    for i in range(40):
        src.append(rec(json.dumps({"i": i, "pad": "p" * 30_000}).encode(), i))
    reader = LumberjackReader()
    await nursery.start(reader.serve)
    out = lj_out(reader.port, src, None, window=100, window_bytes=64 * 1024)
    await run_until_acked(nursery, out, src)
    sizes = [len(w.events) for w in reader.windows]
    assert [json.loads(e.fields["line"])["i"] for e in reader.events] == list(range(40))
    assert max(sizes) == 3 and sum(sizes) == 40, sizes
    assert out.windows_cut >= 13
    # without the cap (the default: 4 x max_event_bytes = 256 KiB here) windows hold 9
    src2 = MemorySource()
    for i in range(40):
        src2.append(rec(json.dumps({"i": i, "pad": "p" * 30_000}).encode(), i))
    reader2 = LumberjackReader()
    await nursery.start(reader2.serve)
    out2 = lj_out(reader2.port, src2, None, window=100)
    await run_until_acked(nursery, out2, src2)
    assert max(len(w.events) for w in reader2.windows) == 9


def test_full_store_with_an_undeletable_file_still_writes(tmp_path):
    """The oldest "file" is a directory with a store file's name: making room skips it
    (logged), it does not turn every later letter into a write error."""
    from logjam_relay.spool import segment as seg
    dl = tmp_path / "dl"
    dl.mkdir()
    (dl / seg.segment_name(1, sealed=True)).mkdir()
    st = DeadLetterStore(dl, max_bytes=100_000)
    for i in range(60):
        st.put("o", "too_large", rec(b"y" * 4000, i), detail=f"#{i}")
    assert st.write_errors == 0 and st.bytes <= 100_000
    assert [d.detail for d in read_dead_letters(dl)][-1] == "#59"
