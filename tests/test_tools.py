"""The operator subcommands `tail` and `send`, against a real relay and a real PUB."""

import io
import json
import re
import threading
import time
import zlib

import trio
import zmq

from conftest import free_port
from logjam_relay.cli import main as cli_main
from logjam_relay.protocols import logjam as L
from logjam_relay.tools.tail import GapTracker
from relay_harness import running_relay, sync_sub


def run_cli(argv):
    out = io.StringIO()
    if argv[0] == "tail":
        from logjam_relay.tools.tail import main
    else:
        from logjam_relay.tools.send import main
    rc = main(argv[1:], out=out)
    return rc, out.getvalue()


async def test_send_sync_ping_and_tail_through_relay(tmp_path):
    async with running_relay(tmp_path, device_id=5) as (relay, cl):
        s = cl.settings
        sub = cl.sub()
        await sync_sub(sub)
        tail_result = {}

        def tail():
            tail_result["v"] = run_cli(["tail", "-c", f"tcp://127.0.0.1:{s.pub_port}",
                                        "-a", "tools-", "-n", "3", "--timeout", "10"])

        t = threading.Thread(target=tail)
        t.start()
        await trio.sleep(0.5)   # let the subscription reach the relay
        for compress in ("zlib", "lz4"):
            rc, out = await trio.to_thread.run_sync(run_cli, [
                "send", "-c", f"tcp://127.0.0.1:{s.router_port}", "--sync", "-x", compress,
                "-a", "tools-test", "-t", "logs.tools", "-b", f'{{"hello":"{compress}"}}',
                *(["--verbatim"] if compress == "lz4" else [])])
            assert rc == 0 and "1 x tools-test 202 Accepted" in out
            # heartbeats (every 0.2 s here) take sequence numbers between the messages, as
            # on a loaded machine: tail subscribed to tools- only must not call them gaps
            await trio.sleep(0.5)
        rc, out = await trio.to_thread.run_sync(run_cli, [
            "send", "--pull", "-c", f"tcp://127.0.0.1:{s.pull_port}", "-n", "1",
            "-a", "tools-test", "-t", "logs.tools", "-b", '{"hello":"pull"}'])
        assert rc == 0
        rc, out = await trio.to_thread.run_sync(run_cli, [
            "send", "-c", f"tcp://127.0.0.1:{s.router_port}", "--ping", "-a", "tools-test"])
        assert out.strip() == "ping 200 OK vm"
        await trio.to_thread.run_sync(t.join, 15)
    rc, out = tail_result["v"]
    lines = out.strip().splitlines()
    assert len(lines) == 3, out
    assert lines[0].startswith("tools-test logs.tools device=5 seq=")
    assert '{"hello":"zlib","started_ms":' in lines[0] and '"request_id":' in lines[0]
    assert "comp=zlib" in lines[0]
    assert lines[1].endswith('{"hello":"lz4"}') and "comp=lz4" in lines[1]
    assert '{"hello":"pull","started_ms":' in lines[2] and "comp=none" in lines[2]
    assert "!!" not in out and "missing" not in out   # no gaps reported under -a


def _sent_bodies(argv: list[str], n: int) -> list[dict]:
    """The bodies that ``send --pull`` with ``argv`` delivers to a PULL socket."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        rc, out = run_cli(["send", "--pull", "-c", f"tcp://127.0.0.1:{port}",
                           "-n", str(n), *argv])
        assert rc == 0, out
        bodies = []
        for _ in range(n):
            assert pull.poll(10_000), f"{len(bodies)} of {n} messages arrived"
            app, topic, body, meta = pull.recv_multipart()
            bodies.append((body, L.decode_meta(meta)))
    finally:
        ctx.destroy(linger=0)
    return bodies


def test_send_stamps_every_message_at_send_time():
    """Each message of one `send` call has its own request_id and its own start time, the
    send time (started_ms equals the meta's created_ms, started_at the same instant), in
    the default body and in a `-b` object, whose own start time and id are replaced;
    `--verbatim` sends `-b` unchanged."""
    from logjam_relay.pipeline.extract import iso_ms
    before = int(time.time() * 1000)
    default = _sent_bodies([], 200)
    template = _sent_bodies(["-b", '{"action":"Mine#x","code":201,"started_ms":1,'
                             '"request_id":"fixed"}'], 50)
    after = int(time.time() * 1000)
    for sent in (default, template):
        dicts = [(json.loads(body), meta) for body, meta in sent]
        assert len({d["request_id"] for d, _ in dicts}) == len(dicts)
        for d, meta in dicts:
            assert re.fullmatch(r"[0-9a-f]{32}", d["request_id"]), d
            assert before <= d["started_ms"] <= after, (before, d, after)
            assert d["started_ms"] == meta.created_ms == iso_ms(d["started_at"]), d
            assert re.search(r"[+-]\d\d:\d\d$", d["started_at"]), d   # explicit offset
    assert [d["n"] for d in map(json.loads, (b for b, _ in default))] == list(range(1, 201))
    # realistic traffic: several actions, codes and times in one call
    dicts = [json.loads(b) for b, _ in default]
    assert len({d["action"] for d in dicts}) > 1 and len({d["code"] for d in dicts}) > 1
    assert len({d["total_time"] for d in dicts}) > 100
    assert {"caller_id", "caller_action", "severity", "host"} <= set(dicts[0])
    assert all(json.loads(b)["action"] == "Mine#x" and json.loads(b)["code"] == 201
               for b, _ in template)
    fixed = '{"action":"Mine#x","started_ms":1}'
    assert [b for b, _ in _sent_bodies(["-b", fixed, "--verbatim"], 3)] == [fixed.encode()] * 3
    assert [b for b, _ in _sent_bodies(["-b", "not json"], 2)] == [b"not json"] * 2


def test_tail_reports_gaps_and_filters_topics():
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    result = {}

    def tail():
        result["v"] = run_cli(["tail", "-c", f"tcp://127.0.0.1:{port}", "-t", "logs",
                               "--timeout", "2"])

    t = threading.Thread(target=tail)
    t.start()
    time.sleep(0.5)
    for seq, topic in ((1, b"logs.a"), (2, b"events.b"), (5, b"logs.c"), (6, b"logs.d")):
        pub.send_multipart([b"gap-test", topic, zlib.compress(b"{}"),
                            L.encode_meta(1, 9, 1700000000000, seq)])
    t.join(10)
    ctx.destroy(linger=0)
    rc, out = result["v"]
    assert rc == 0
    assert "!! GAP device 9: 2 missing (3..4)" in out
    assert "events.b" not in out and "logs.c" in out
    assert "missing by device: 9=2" in out


def test_gap_tracker():
    g = GapTracker()
    assert g.see(1, 10) is None and g.see(1, 11) is None
    assert "GAP" in g.see(1, 13)
    assert "SEQUENCE" in g.see(1, 5)
    assert g.see(2, 1) is None
    assert g.missing == {1: 1}


def test_cli_check_config_and_errors(tmp_path, capsys):
    assert cli_main(["--check-config", "-d", "7", "-x", "lz4"]) == 0
    out = capsys.readouterr().out
    assert "device_id = 7  (flag --device-id)" in out and "compress = lz4  (flag" in out
    assert cli_main(["--check-config", "--compress", "gzip"]) == 2
    err = capsys.readouterr().err
    assert "compress (--compress): must be one of zlib, snappy, lz4, got 'gzip'" in err
