"""Synthetic logjam traffic and archives for tests and benchmarks (no Spark needed).

:func:`make_messages` builds a deterministic list of :class:`Msg` (what a client sends plus
the meta the relay stamps); :func:`write_archive` appends them to a real
:class:`~logjam_relay.spool.spool.Spool` exactly as the relay does (4-frame records
``[app_env, topic, body, meta24]``), seals, and hands every sealed segment to an
:class:`~logjam_relay.outputs.archive.Archive`.
"""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass

from ..protocols.logjam import compress

META = struct.Struct(">HBBIQQ")

APP_ENVS = [b"shop-production", b"my-app-staging", b"api-gw-production", b"billing-preview"]
OTHER_TOPICS = [b"javascript", b"events", b"frontend.page", b"frontend.ajax", b"mobile"]
ACTIONS = ["Orders#index", "Orders#show", "Users#create", "Api::V1::Items#update",
           "Health#ping"]
EXCEPTIONS = ["ActiveRecord::RecordNotFound", "Timeout::Error", "NoMethodError",
              "Redis::CannotConnectError"]
CODES = [200, 200, 200, 201, 204, 301, 302, 304, 400, 401, 404, 422, 500, 502, 503]


@dataclass(slots=True)
class Msg:
    app_env: bytes
    topic: bytes
    payload: bytes          # uncompressed body as the client produced it
    comp: int               # compression method id written into the meta
    body: bytes             # body bytes on the wire (compressed with comp, or garbage)
    device: int
    created_ms: int
    sequence: int

    def meta(self) -> bytes:
        return META.pack(0xCABD, self.comp, 1, self.device, self.created_ms, self.sequence)

    def frames(self) -> list[bytes]:
        return [self.app_env, self.topic, self.body, self.meta()]


def logs_payload(rng: random.Random, started_ms: int) -> dict:
    d: dict = {"action": rng.choice(ACTIONS),
               "total_time": round(rng.lognormvariate(5.0, 1.0), 3),
               "code": rng.choice(CODES), "severity": rng.choice([0, 1, 1, 1, 2, 3, 4, 5]),
               "host": "web-1", "request_id": f"{rng.getrandbits(128):032x}"}
    r = rng.random()
    if r < 0.8:
        d["started_ms"] = started_ms
    elif r < 0.9:
        # ISO-8601 with an explicit offset (what logjam_agent writes)
        import datetime as _dt
        t = _dt.datetime.fromtimestamp(started_ms / 1000, _dt.timezone(_dt.timedelta(hours=2)))
        d["started_at"] = t.isoformat(timespec="milliseconds")
    # else: neither -> the pipeline uses created_ms
    if rng.random() < 0.15:
        d["exceptions"] = rng.sample(EXCEPTIONS, rng.randint(1, 2))
    return d


def make_messages(n: int, *, seed: int = 1, devices=(1, 2), base_ms: int = 1_700_006_220_000,
                  spread_ms: int = 4 * 60_000, logs_share: float = 0.8,
                  compressions=(0, 1, 2, 3), malformed: bool = True,
                  gaps: bool = True) -> list[Msg]:
    """``n`` messages in arrival order.

    ``base_ms`` defaults to 23:57 UTC so that data spans two dates.  With ``gaps``,
    some sequence numbers per device are skipped on purpose, one message is
    duplicated and two are swapped (out of order).  With ``malformed``, a few bodies
    do not decompress / are not JSON / are not UTF-8 / name an unknown compression.
    """
    rng = random.Random(seed)
    seqs = dict.fromkeys(devices, 0)
    out: list[Msg] = []
    for i in range(n):
        dev = devices[i % len(devices)]
        seqs[dev] += 1
        if gaps and rng.random() < 0.01:
            seqs[dev] += rng.randint(1, 3)          # injected loss
        created = base_ms + (i * spread_ms) // max(1, n)
        app_env = APP_ENVS[rng.randrange(len(APP_ENVS))]
        app, _, env = app_env.decode().rpartition("-")
        if rng.random() < logs_share:
            topic = f"logs.{app}.{env}".encode()
            payload = json.dumps(logs_payload(rng, created - rng.randint(0, 3000)),
                                 separators=(",", ":")).encode()
        else:
            topic = rng.choice(OTHER_TOPICS)
            payload = json.dumps({"kind": topic.decode(), "n": i, "page": f"/x/{i % 7}"},
                                 separators=(",", ":")).encode()
        comp = compressions[i % len(compressions)]
        out.append(Msg(app_env, topic, payload, comp, compress(payload, comp), dev, created,
                       seqs[dev]))
    if malformed and n >= 50:
        def bad(idx, body, comp=None):
            m = out[idx]
            m.body = body
            if comp is not None:
                m.comp = comp
            m.payload = b""
        bad(7, b"\x00not zlib at all", 1)                 # decompress error (zlib)
        bad(13, b"\xff\xff\xff\xff\x0fgarbage", 2)         # decompress error (snappy)
        bad(21, b"\x00\x00\x00\x10\x01", 3)                # decompress error (lz4)
        bad(29, b"{this is not json", 0)                   # not JSON
        bad(33, b"\xc3\x28 not utf-8", 0)                  # not UTF-8
        bad(41, b"{}", 9)                                  # unknown compression id
    if gaps and n >= 50:
        # a duplicate and an out-of-order pair
        d = out[25]
        out.insert(30, Msg(d.app_env, d.topic, d.payload, d.comp, d.body, d.device,
                           d.created_ms, d.sequence))
        out[40], out[42] = out[42], out[40]
    return out


def write_archive(spool_dir, archive_dir, messages: list[Msg], *, segment_bytes: int = 1 << 20,
                  batch: int = 500, retention_s: float | None = None):
    """Append ``messages`` to a fresh spool in ``spool_dir`` as the relay does, seal every
    segment into ``archive_dir`` and return the :class:`Archive`."""
    from ..outputs.archive import Archive
    from ..spool.spool import Spool
    archive = Archive(archive_dir, retention_s, fsync=False)
    sp = Spool(spool_dir, readers=[], segment_bytes=segment_bytes, fsync="never",
               max_bytes=max(1 << 30, 8 * segment_bytes), on_seal=archive.on_seal)
    try:
        for k in range(0, len(messages), batch):
            sp.append_batch([m.frames() for m in messages[k:k + batch]])
        sp.seal()
    finally:
        sp.close()
    return archive


def heartbeat(device: int, created_ms: int, sequence: int, host: str = "edge",
              body: bytes = b"{}") -> Msg:
    """A relay's heartbeat record (``protocols/logjam.py`` ``heartbeat_frames``); ``body``:
    ``{}``, or a restart marker's ``{"restart":{"skipped_from":A,"skipped_to":B}}``."""
    return Msg(b"heartbeat", f"tcp://{host}:9606".encode(), body, 0, body, device,
               created_ms, sequence)


def restart_marker(device: int, created_ms: int, sequence: int, skipped_from: int,
                   skipped_to: int, host: str = "edge") -> Msg:
    """The record a relay spools first after a crash (``docs/fleet.md``)."""
    return heartbeat(device, created_ms, sequence, host,
                     b'{"restart":{"skipped_from":%d,"skipped_to":%d}}'
                     % (skipped_from, skipped_to))


def forwarded(m: Msg, host: str, device: int, sequence: int, input_name: str = "lj",
              comp: int = 0) -> Msg:
    """``m`` as a relay with an input archives it after an edge relay on ``host`` forwarded
    it (``inputs/mapping.py``): the decompressed body with the edge's origin as first key,
    stamped with the central relay's ``device`` and ``sequence`` (``comp``: its ``-x``)."""
    from ..inputs.mapping import splice_origin
    head = b'{"logjam_origin":{"device":%d,"sequence":%d,"created_ms":%d,"host":%s,' \
           b'"input":%s}' % (m.device, m.sequence, m.created_ms, json.dumps(host).encode(),
                             json.dumps(input_name).encode())
    body = splice_origin(m.payload, head)
    return Msg(m.app_env, m.topic, body, comp, compress(body, comp), device, m.created_ms,
               sequence)


def edge_stream(n: int, device: int, *, host: str, seed: int = 1, heartbeat_every: int = 50,
                base_ms: int = 1_700_006_220_000, first: int = 1) -> list[Msg]:
    """What an edge relay spools: ``n`` messages of :func:`make_messages` (no malformed
    bodies, no injected gaps) numbered from ``first`` with a heartbeat after every
    ``heartbeat_every`` of them (heartbeats share the numbers, as logjam-device's)."""
    msgs = make_messages(n, seed=seed, devices=(device,), base_ms=base_ms, malformed=False,
                         gaps=False, compressions=(0,))
    out: list[Msg] = []
    seq = first - 1
    for i, m in enumerate(msgs):
        seq += 1
        m.sequence = seq
        out.append(m)
        if heartbeat_every and (i + 1) % heartbeat_every == 0:
            seq += 1
            out.append(heartbeat(device, m.created_ms, seq, host))
    return out


# ------------------------------------------------------------------ `pipeline sample`

def write_sample(output, records: int, *, minutes: int = 60, seed: int = 1,
                 end_ms: int | None = None, segment_bytes: int = 1 << 20) -> dict:
    """``logjam-relay pipeline sample``: an archive of ``records`` messages of made-up
    traffic in the directory ``output`` (created; it must not exist or be empty), spread
    over the ``minutes`` before ``end_ms`` (default: the present minute): the app-envs,
    actions, latencies, exceptions and compressions of :func:`make_messages`, two devices
    with a few numbers missing, one duplicate, a few bodies that do not decode -- every
    kind of figure ``pipeline stats`` and its report show.  The records go through a real
    spool in a temporary directory beside ``output`` (removed), as the relay's archive
    output writes them.  Returns what was written."""
    import os
    import shutil
    import tempfile
    import time as _time
    output = os.path.abspath(os.fspath(output))
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise FileExistsError(f"{output} exists and is not an empty directory")
    if records < 1 or minutes < 1:
        raise ValueError("records and minutes must be at least 1")
    if end_ms is None:
        end_ms = int(_time.time() * 1000) // 60_000 * 60_000 + 60_000
    spread = minutes * 60_000
    anomalies = records >= 51          # the duplicate is one record more
    msgs = make_messages(records - anomalies, seed=seed, base_ms=end_ms - spread,
                         spread_ms=spread, malformed=anomalies, gaps=anomalies)
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    spool = tempfile.mkdtemp(prefix=".sample-spool-", dir=parent)
    try:
        write_archive(spool, output, msgs, segment_bytes=segment_bytes)
    finally:
        shutil.rmtree(spool, ignore_errors=True)
    files = [f for f in os.listdir(output) if not f.startswith(".")]
    return {"output": output, "records": len(msgs), "segments": len(files),
            "bytes": sum(os.path.getsize(os.path.join(output, f)) for f in files),
            "app_envs": len({m.app_env for m in msgs}),
            "devices": len({m.device for m in msgs}),
            "first_ms": msgs[0].created_ms, "last_ms": msgs[-1].created_ms}


def main(a) -> int:
    """``logjam-relay pipeline sample`` (arguments parsed by :mod:`.cli`)."""
    import datetime as _dt
    import sys
    try:
        w = write_sample(a.output, a.records, minutes=a.minutes, seed=a.seed)
    except (OSError, ValueError) as e:
        print(f"logjam-relay pipeline sample: {e}", file=sys.stderr)
        return 2

    def t(ms):
        return _dt.datetime.fromtimestamp(ms / 1000, _dt.UTC).strftime("%Y-%m-%d %H:%M")
    print(f"sample: {w['records']:,} records ({w['app_envs']} app-envs, {w['devices']} "
          f"devices, {t(w['first_ms'])} → {t(w['last_ms'])} UTC) in {w['output']}: "
          f"{w['segments']} segments, {w['bytes']:,} bytes", flush=True)
    print(f"next: logjam-relay pipeline stats --input {w['output']} --output OUT "
          f"--report OUT/report.html", flush=True)
    return 0
