"""``heartbeats=on|off`` on the Lumberjack and Courier outputs (docs/lumberjack.md,
docs/courier.md): with ``on`` an edge relay forwards its heartbeats (and restart markers)
as ordinary events, in spool order, so that every sequence number of the edge reaches the
central archive; with ``off`` (the default) they are skipped and acknowledged at once.

The C mappings (``_ljencode.encode``/``encode_block``, ``_courierenc.events``) give the
same bytes as the Python ones either way, and a central relay's input maps a forwarded
heartbeat back to stream ``heartbeat``, its ``tcp://`` topic and the body ``{}`` with the
edge's origin spliced in (inputs/mapping.py)."""

import json
import subprocess
import sys

import pytest
import trio

from conftest import require_native
from logjam_relay.inputs.mapping import MappingOptions, json_event, lumberjack_v1
from logjam_relay.io.net import TLSSettings
from logjam_relay.outputs import courier_encode as ce
from logjam_relay.outputs import lumberjack_encode as le
from logjam_relay.outputs import poison
from logjam_relay.outputs.courier import CourierConfig, CourierOutput
from logjam_relay.outputs.courier import parse_url as courier_url
from logjam_relay.outputs.lumberjack import LumberjackConfig, LumberjackOutput
from logjam_relay.outputs.lumberjack import parse_url as lumberjack_url
from logjam_relay.protocols import lumberjack as lj
from logjam_relay.protocols import lumberjack_server as ljs
from logjam_relay.protocols.logjam import encode_meta, heartbeat_frames, restart_marker_frames
from logjam_relay.spool import segment as fmt
from logjam_relay.spool.api import KIND_LOGJAM, KIND_SAMWISE, MemorySource, Position, Record
from peers.courier_receiver import CourierReceiver
from peers.lumberjack_reader import LumberjackReader
from test_recblock import _block, _native, _records

HB = heartbeat_frames("edge-1.example", 9606, 7, 1_700_000_000_005, 3)
MARKER = restart_marker_frames("edge-1.example", 9606, 7, 1_700_000_000_009, 100_006,
                               5, 100_005)


def _msg(seq: int) -> list[bytes]:
    return [b"shop-prod", b"logs.shop.prod", b'{"n":%d}' % seq,
            encode_meta(0, 7, 1_700_000_000_000 + seq, seq)]


def _spool_like() -> list[Record]:
    """An edge's spool: data, heartbeats, a restart marker and a samwise record."""
    frames = [_msg(1), _msg(2), HB, _msg(4), MARKER, _msg(100_007)]
    recs = [Record(Position(0, i), KIND_LOGJAM, f) for i, f in enumerate(frames)]
    recs.insert(3, Record(Position(0, 50), KIND_SAMWISE, [b"b1", b"120", b"publish"]))
    return recs


# ------------------------------------------------------------------------ URLs

def test_url_parameter_defaults_off_and_parses_on():
    assert lumberjack_url("lumberjack://h").heartbeats is False
    assert lumberjack_url("lumberjack://h?heartbeats=on").heartbeats is True
    assert lumberjack_url("lumberjack://h?heartbeats=off").heartbeats is False
    assert courier_url("courier://h:1?tls=off").heartbeats is False
    assert courier_url("courier://h:1?tls=off&heartbeats=on").heartbeats is True
    assert courier_url("courier://h:1?tls=off&heartbeats=no").heartbeats is False


@pytest.mark.parametrize("parse,url,needle", [
    (lumberjack_url, "lumberjack://h?heartbeats=maybe", "'heartbeats': expected on/off"),
    (lumberjack_url, "lumberjack://h?heartbeats=", "'heartbeats': expected on/off"),
    (lumberjack_url, "lumberjack://h?heartbeats=on&heartbeats=off", "'heartbeats' given twice"),
    (courier_url, "courier://h:1?heartbeats=2", "'heartbeats': expected on/off"),
    (courier_url, "courier://h:1?heartbeats=on&heartbeats=on", "'heartbeats' given twice"),
])
def test_url_parameter_errors_name_it(parse, url, needle):
    with pytest.raises(ValueError) as ei:
        parse(url)
    assert needle in str(ei.value)


@pytest.mark.parametrize("url", ["lumberjack://h?heartbeats=sometimes&tls=off",
                                 "courier://h:1?heartbeats=sometimes&tls=off"])
def test_check_config_refuses_a_bad_value_in_one_line(tmp_path, url):
    r = subprocess.run([sys.executable, "-m", "logjam_relay", "--check-config",
                        "--spool-dir", str(tmp_path / "spool"), "--state-dir",
                        str(tmp_path / "state"), "--output", url],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    scheme = url.split(":", 1)[0]
    assert r.stderr.strip().splitlines()[-1] == (
        f"logjam-relay: configuration error: outputs (--output): {scheme} URL: parameter "
        "'heartbeats': expected on/off, got 'sometimes'")


# ----------------------------------------------------- the mappings, C and Python

def _v1_events(frames: bytes, n: int) -> list[dict]:
    c = ljs.ServerConnection()
    c.receive_data(lj.encode_window(frames, n))
    return list(c.next_event().events)


@pytest.mark.parametrize("heartbeats", [False, True])
def test_lumberjack_mapping_c_equals_python(heartbeats):
    require_native(le._ljencode, "logjam_relay.outputs._ljencode")
    recs = _spool_like()
    c = le.EventEncoder("edge-1", heartbeats=heartbeats)
    py = le.EventEncoder("edge-1", heartbeats=heartbeats)
    got = c.encode(recs)
    assert got == py.encode_py(recs)
    assert c.encode_checked(recs)[:2] == py.encode_checked(recs)[:2] == got
    frames, n = got
    assert n == (6 if heartbeats else 4)
    evs = _v1_events(frames, n)
    seqs = [int(e["sequence"]) for e in evs]
    if not heartbeats:
        assert seqs == [1, 2, 4, 100_007]
        assert all(e["app"] != "heartbeat" for e in evs)
        return
    assert seqs == [1, 2, 3, 4, 100_006, 100_007]           # spool order, nothing skipped
    assert evs[2] == {"line": "{}", "app": "heartbeat", "env": "",
                      "topic": "tcp://edge-1.example:9606", "device": "7", "sequence": "3",
                      "created_ms": "1700000000005", "host": "edge-1", "type": "logjam"}
    assert evs[4]["app"] == "heartbeat" and evs[4]["env"] == ""
    assert json.loads(evs[4]["line"]) == {"restart": {"skipped_from": 5,
                                                      "skipped_to": 100_005}}


@pytest.mark.parametrize("heartbeats", [False, True])
def test_lumberjack_mapping_of_blocks_with_heartbeats(heartbeats):
    """A worker's reads (RecordBlock, mapped from the buffer) give the list's and the
    Python mapping's bytes, heartbeats forwarded or skipped."""
    _native()
    for odd in (False, True):
        recs = _records(300, seed=11, odd=odd) + [(KIND_LOGJAM, HB), (KIND_LOGJAM, MARKER)]
        block, _ = _block(fmt.encode_records(recs, first_seq=1))
        lst = block.tolist()
        c = le.EventEncoder("relay", heartbeats=heartbeats)
        py = le.EventEncoder("relay", heartbeats=heartbeats)
        assert c.encode(block) == py.encode_py(lst)
        c2 = le.EventEncoder("relay", 40, heartbeats=heartbeats)
        l2 = le.EventEncoder("relay", 40, heartbeats=heartbeats)
        got, want = c2.encode_checked(block), l2.encode_checked(lst)
        assert got[:2] == want[:2] and list(got[2]) == want[2] and got[3] == want[3]
    hb_only, _ = _block(fmt.encode_records([(KIND_LOGJAM, HB)] * 3, first_seq=1))
    got = le._ljencode.encode_block(hb_only, KIND_LOGJAM, b"", {}, lambda a, t: a + t, -1,
                                    heartbeats)
    assert got[1] == (3 if heartbeats else 0)


@pytest.mark.parametrize("heartbeats", [False, True])
def test_courier_mapping_c_equals_python(heartbeats):
    require_native(ce._courierenc, "logjam_relay.outputs._courierenc")
    recs = _spool_like()
    evs, clean, _total, _longest = ce.record_events(recs, "edge-1", 10_000, heartbeats)
    want = [ce.record_to_event_py(r, "edge-1", 10_000, heartbeats) for r in recs]
    assert evs == want
    assert [ce.record_to_event(r, "edge-1", 10_000, heartbeats) for r in recs] == want
    assert not clean                                       # the samwise record: None
    docs = [json.loads(e) for e in want if e is not None]
    seqs = [d["logjam"]["sequence"] for d in docs]
    if not heartbeats:
        assert seqs == [1, 2, 4, 100_007] and want[2] is None and want[5] is None
        return
    assert seqs == [1, 2, 3, 4, 100_006, 100_007]
    assert docs[2] == {"@timestamp": "2023-11-14T22:13:20.005Z", "app": "heartbeat", "env": "",
                       "topic": "tcp://edge-1.example:9606", "host": "edge-1",
                       "logjam": {"device": 7, "sequence": 3, "created_ms": 1_700_000_000_005},
                       "payload": {}}
    assert docs[4]["payload"] == {"restart": {"skipped_from": 5, "skipped_to": 100_005}}
    # a worker's read (RecordBlock) gives the same
    _native()
    block, _ = _block(fmt.encode_records([(r.kind, r.frames) for r in recs], first_seq=1))
    assert ce.record_events(block, "edge-1", 10_000, heartbeats)[0] == evs


def test_courier_batch_mapping_with_heartbeats_equals_python(monkeypatch):
    require_native(ce._courierenc, "logjam_relay.outputs._courierenc")
    for heartbeats in (False, True):
        cfg = CourierConfig(hosts=(("127.0.0.1", 1),), tls=TLSSettings(enabled=False),
                            hostname="edge-1", heartbeats=heartbeats)
        out = CourierOutput(cfg, None)
        recs = _spool_like()
        got_c = out._map_records(recs)
        with monkeypatch.context() as m:
            import logjam_relay.outputs.courier as co
            m.setattr(co, "record_events", lambda *a: None)
            got_py = out._map_records(recs)
        assert got_c == got_py
        groups, rejected, skipped = got_c
        assert not rejected and skipped == (1 if heartbeats else 3)
        assert sum(len(g[1]) for g in groups) == (6 if heartbeats else 4)


# ---------------------------------------------- what a central relay's input makes

ORIGIN = {"device": 7, "sequence": 3, "created_ms": 1_700_000_000_005, "host": "edge-1"}


def test_a_forwarded_heartbeat_maps_back_to_a_heartbeat_with_its_origin():
    opts = MappingOptions()
    rec = Record(Position(0, 0), KIND_LOGJAM, HB)
    frames, n = le.EventEncoder("edge-1", heartbeats=True).encode([rec])
    (fields,) = _v1_events(frames, n)
    a, t, b, comp, created = lumberjack_v1(fields, "lj", "10.0.0.7:999", opts)
    assert (a, t, comp) == (b"heartbeat", b"tcp://edge-1.example:9606", 0)
    assert b == (b'{"logjam_origin":{"device":7,"sequence":3,"created_ms":1700000000005,'
                 b'"host":"edge-1","input":"lj"}}')
    assert int.from_bytes(created, "big") == 1_700_000_000_005
    cev = ce.record_to_event(rec, "edge-1", heartbeats=True)
    a2, t2, b2, comp2, created2 = json_event(cev, "cr", "10.0.0.7:999", opts)
    assert (a2, t2, comp2, created2) == (a, t, 0, created)
    assert json.loads(b2) == {"logjam_origin": {**ORIGIN, "input": "cr"}}
    # the restart marker keeps its range after the origin
    mrec = Record(Position(0, 1), KIND_LOGJAM, MARKER)
    frames, n = le.EventEncoder("edge-1", heartbeats=True).encode([mrec])
    (fields,) = _v1_events(frames, n)
    a, t, b, _, _ = lumberjack_v1(fields, "lj", "p", opts)
    assert (a, t) == (b"heartbeat", b"tcp://edge-1.example:9606")
    assert json.loads(b) == {"logjam_origin": {**ORIGIN, "sequence": 100_006,
                                               "created_ms": 1_700_000_000_009, "input": "lj"},
                             "restart": {"skipped_from": 5, "skipped_to": 100_005}}
    b2 = json_event(ce.record_to_event(mrec, "edge-1", heartbeats=True), "cr", "p", opts)[2]
    assert json.loads(b2)["restart"] == {"skipped_from": 5, "skipped_to": 100_005}


# ------------------------------------------------------- the outputs, end to end

def _source() -> MemorySource:
    src = MemorySource()
    for r in _spool_like():
        src.append(r.frames, kind=r.kind)
    return src


async def _until(pred, timeout=15.0):
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.01)


@pytest.mark.parametrize("heartbeats", [False, True])
async def test_lumberjack_output_forwards_heartbeats_only_when_on(nursery, heartbeats):
    reader = LumberjackReader()
    await nursery.start(reader.serve)
    src = _source()
    cfg = LumberjackConfig(hosts=(("127.0.0.1", reader.port),), tls=TLSSettings(enabled=False),
                           backoff_min=0.01, backoff_max=0.05, relay_host="edge-1",
                           heartbeats=heartbeats, window=3)
    out = LumberjackOutput(src, cfg)
    nursery.start_soon(out.run)
    await _until(lambda: src.all_acked)
    seqs = [int(e.fields["sequence"]) for e in reader.events]
    assert seqs == ([1, 2, 3, 4, 100_006, 100_007] if heartbeats else [1, 2, 4, 100_007])
    st = out.stats()
    assert st["events_acked"] == len(seqs) and st["skipped_records"] == 7 - len(seqs)


@pytest.mark.parametrize("heartbeats", [False, True])
async def test_courier_output_forwards_heartbeats_only_when_on(nursery, heartbeats):
    rcv = CourierReceiver()
    port = await nursery.start(rcv.serve)
    src = _source()
    cfg = CourierConfig(hosts=(("127.0.0.1", port),), tls=TLSSettings(enabled=False),
                        payload_size=3, backoff_initial=0.01, backoff_max=0.05,
                        hostname="edge-1", heartbeats=heartbeats)
    out = CourierOutput(cfg, src)
    nursery.start_soon(out.run)
    await _until(lambda: src.all_acked)
    seqs = [json.loads(e)["logjam"]["sequence"] for e in rcv.events]
    assert seqs == ([1, 2, 3, 4, 100_006, 100_007] if heartbeats else [1, 2, 4, 100_007])
    assert out.stats()["events_acked"] == len(seqs)


@pytest.mark.parametrize("heartbeats", [False, True])
def test_heartbeats_are_backlog_only_when_forwarded(heartbeats):
    """A disconnected output with nothing in flight acknowledges the heartbeats at its read
    position (not its backlog) -- unless it forwards them: then they wait for the receiver
    like any event."""
    src = MemorySource()
    src.append(HB)
    src.append(MARKER)
    src.append([b"x"], kind=KIND_SAMWISE)
    src.append(_msg(7))
    assert poison.skip_non_events(src, heartbeats) is True
    assert src.stats()["backlog_records"] == (4 if heartbeats else 1)
    assert src.read(1)[0].frames == (HB if heartbeats else _msg(7))
