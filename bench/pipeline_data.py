"""Realistic, deterministic data for ``bench/bench_pipeline.py``: an archive of logjam
records and the same records as JSON lines, written in one streaming pass (10M records
never sit in memory).

    python bench/pipeline_data.py --records 1000000 --out DIR

What it looks like (a mix, so that the bench is not tuned to one shape):

* 7 apps in 1-3 environments each (13 ``app-env`` streams, uneven traffic), 4 devices;
* 82 % ``logs.APP.ENV`` requests with the fields logjam agents send: ``action`` (30-60
  controller actions per app, Zipf-like), ``started_at`` (ISO-8601 with offset, ms) and
  ``started_ms`` (85 %; 10 % only ``started_at``; 5 % neither), ``total_time`` and the
  ``*_time``/``*_calls`` breakdown, ``code``, ``severity``, ``host``, ``ip``,
  ``process_id``, ``request_id``, ``user_id``, ``caller_id``, ``allocated_*``,
  ``request_info`` (method, url, headers, query parameters) and ``lines`` (log lines with
  quotes and escapes); ``exceptions`` in ~4 % (1-2 names); body sizes from about 200 B to
  4 KB (most 400 B-1.5 KB);
* the other 18 %: ``javascript``, ``events``, ``frontend.page``, ``frontend.ajax``,
  ``mobile`` topics and ``heartbeat`` records;
* compressions mixed: none 10 %, zlib 30 %, snappy 30 %, lz4 30 %;
* 2 hours of traffic across midnight UTC (two dates); about 0.5 % of sequence numbers
  skipped per device (loss), one duplicate and one out-of-order pair.

The JSON lines (the plain job's input) carry app, env, topic, device, sequence, created_ms
and the body as a nested object, exactly the records of the archive.  Same ``--seed``,
same bytes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

APPS = [("shop", ("production", "staging", "preview"), 30),
        ("billing", ("production", "staging"), 8),
        ("api-gw", ("production",), 25), ("search", ("production", "staging"), 12),
        ("accounts", ("production", "staging"), 9), ("cms", ("production",), 4),
        ("reports", ("production", "staging"), 3)]
OTHER_TOPICS = ["javascript", "events", "frontend.page", "frontend.ajax", "mobile"]
EXCEPTIONS = ["ActiveRecord::RecordNotFound", "Timeout::Error", "NoMethodError",
              "Redis::CannotConnectError", "ActionController::RoutingError",
              "Net::ReadTimeout", "JSON::ParserError", "ActiveRecord::StatementInvalid"]
CODES = [200] * 30 + [201, 204, 204, 301, 302, 302, 304, 304, 400, 401, 403, 404, 404, 422,
                      429, 500, 502, 503]
SEVERITIES = [0, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4, 5]
CONTROLLERS = ["Orders", "Users", "Items", "Carts", "Sessions", "Payments", "Invoices",
               "Search", "Products", "Reviews", "Admin::Users", "Api::V1::Items",
               "Api::V2::Orders", "Health", "Webhooks", "Reports", "Exports", "Pages"]
VERBS = ["index", "show", "create", "update", "destroy", "new", "edit", "search", "ping"]
COMPRESSIONS = [0] + [1] * 3 + [2] * 3 + [3] * 3
DEVICES = (1, 2, 3, 4)
VERSION = 1                 # of the data: bump when the generator's output changes
BASE_MS = 1_700_006_400_000 - 60 * 60_000       # 23:00 UTC: two hours across midnight
SPREAD_MS = 2 * 60 * 60_000
TZ = [_dt.timezone(_dt.timedelta(hours=h)) for h in (0, 1, 2, -5)]


def _streams(rng: random.Random):
    out = []
    for app, envs, weight in APPS:
        n_actions = rng.randint(30, 60)
        acts = sorted({f"{rng.choice(CONTROLLERS)}#{rng.choice(VERBS)}"
                       for _ in range(n_actions * 2)})
        acts = acts[:n_actions]
        rng.shuffle(acts)                   # popularity (below) not in name order
        for k, env in enumerate(envs):
            out.append((app, env, weight / (1 + 3 * k), acts))
    return out


class Generator:
    """Records in arrival order, deterministic for a seed."""

    def __init__(self, n: int, seed: int = 7):
        from logjam_relay.protocols.logjam import compress
        self.compress = compress
        self.n = n
        self.rng = random.Random(seed)
        self.streams = _streams(self.rng)
        self.weights = [w for *_x, w, _a in self.streams]
        self.cum = []
        c = 0.0
        for w in self.weights:
            c += w
            self.cum.append(c)
        self.seed = seed
        # log line texts (with quotes, so the bodies have escapes)
        self.lines = [
            'Started GET "/orders/%d" for 10.0.%d.%d',
            'Processing by %s as HTML',
            '  Parameters: {"id"=>"%d", "locale"=>"de"}',
            'User Load (0.%dms)  SELECT "users".* FROM "users" WHERE "users"."id" = $1 LIMIT 1',
            'Rendered layouts/_header.html.erb (Duration: %d.1ms | Allocations: %d)',
            'Cache read: views/orders/%d-20231114\\t(hit)',
            'Completed %d OK in %dms (Views: 12.3ms | ActiveRecord: 4.5ms)',
        ]
        self.tails = [self._tails(self.rng, app, acts) for app, _e, _w, acts in self.streams]

    def _tails(self, rng, app, acts) -> list[str]:
        """Pre-serialized JSON tails of one app's bodies (request_info, lines, ...): the
        varying per-request fields are formatted per record, the bulk comes from here."""
        out = []
        for _ in range(512):
            parts = [f'"host":"{app}-web-{rng.randint(1, 12):02d}"',
                     f'"ip":"10.{rng.randint(0, 9)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"',
                     f'"process_id":{rng.randint(1000, 65000)}',
                     f'"db_calls":{rng.randint(0, 40)}', f'"gc_time":{round(rng.random() * 5, 3)}',
                     f'"allocated_objects":{rng.randint(1000, 400000)}',
                     f'"allocated_bytes":{rng.randint(100000, 40000000)}']
            if rng.random() < 0.6:
                parts.append(f'"user_id":{rng.randint(1, 2_000_000)}')
            if rng.random() < 0.3:
                parts.append(f'"caller_id":"{rng.choice(self.streams)[0]}-production-'
                             f'{rng.getrandbits(64):016x}","caller_action":"{rng.choice(acts)}"')
            size = rng.random()
            if size >= 0.15:
                a = rng.choice(acts)
                hdr = {"Accept": "text/html,application/xhtml+xml", "User-Agent":
                       "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) "
                       "Chrome/119.0 Safari/537.36", "Accept-Language": "de-DE,de;q=0.9,en;q=0.8"}
                if size > 0.6:
                    sid = f"{rng.getrandbits(256):064x}"
                    hdr["Cookie"] = "_session_id=" + sid * rng.randint(1, 3)
                ri = {"method": rng.choice(["GET", "GET", "GET", "POST", "PUT"]),
                      "url": f"/{a.split('#')[0].lower()}/{rng.randint(1, 99999)}"
                             f"?page={rng.randint(1, 9)}",
                      "headers": hdr, "query_parameters": {"page": str(rng.randint(1, 9))}}
                nl = 1 + int(rng.expovariate(1 / (3 if size < 0.9 else 12)))
                lines = []
                for k in range(min(nl, 30)):
                    tpl = self.lines[k % len(self.lines)]
                    txt = tpl % tuple(rng.randint(1, 999) for _ in range(tpl.count("%d"))) \
                        if "%s" not in tpl else tpl % a
                    lines.append([rng.choice(SEVERITIES), 1700000000000 + k, txt])
                parts.append('"request_info":' + json.dumps(ri, separators=(",", ":")))
                parts.append('"lines":' + json.dumps(lines, separators=(",", ":")))
            out.append(",".join(parts))
        return out

    def _logs_body(self, rng, app, env, acts, tails, created: int, i: int) -> bytes:
        x = rng.getrandbits(64)
        # skewed action popularity (a few hot actions, a long tail)
        a = acts[int(len(acts) * rng.random() ** 2.5)]
        started = created - (x & 4095) % 3000
        x >>= 12
        tt = round(rng.lognormvariate(4.3, 1.1), 3)
        r = (x & 1023) / 1024
        x >>= 10
        head = f'{{"action":"{a}"'
        if r < 0.95:
            t = _dt.datetime.fromtimestamp(started / 1000, TZ[i % len(TZ)])
            head += f',"started_at":"{t.isoformat(timespec="milliseconds")}"'
        if r < 0.85:
            head += f',"started_ms":{started}'
        head += (f',"total_time":{tt!r},"code":{CODES[x % len(CODES)]},'
                 f'"severity":{SEVERITIES[(x >> 6) % len(SEVERITIES)]},'
                 f'"request_id":"{rng.getrandbits(128):032x}",'
                 f'"db_time":{round(tt * ((x >> 10) & 255) / 640, 3)!r},'
                 f'"view_time":{round(tt * ((x >> 18) & 255) / 850, 3)!r},')
        if (x >> 26) % 25 == 0:
            head += '"exceptions":' + json.dumps(rng.sample(EXCEPTIONS, 1 + (x >> 31) % 2)) + ","
        return (head + tails[(x >> 33) % len(tails)] + "}").encode()

    def chunk(self, start: int, stop: int) -> list[tuple]:
        """Records [start, stop) as (app_env, topic, wire body, comp, device, created_ms,
        sequence step, json head, body); each chunk has its own random stream (seeded by
        the seed and ``start``), so chunks can be made in parallel and still give the same
        bytes."""
        rng = random.Random(self.seed * 1_000_003 + start)
        comp = self.compress
        n = self.n
        out = []
        for i in range(start, stop):
            dev = DEVICES[i % len(DEVICES)]
            step = 1 + (rng.randint(1, 3) if rng.random() < 0.005 else 0)    # injected loss
            created = BASE_MS + (i * SPREAD_MS) // max(1, n)
            x = rng.random() * self.cum[-1]
            k = 0
            while self.cum[k] < x:
                k += 1
            app, env, _w, acts = self.streams[k]
            r = rng.random()
            if r < 0.82:
                topic = f"logs.{app}.{env}"
                body = self._logs_body(rng, app, env, acts, self.tails[k], created, i)
            elif r < 0.83:
                app, env, topic = "heartbeat", "", "heartbeat"
                body = b'{"host":"relay-1"}'
            else:
                topic = rng.choice(OTHER_TOPICS)
                body = (f'{{"kind":"{topic}","n":{i},"page":"/x/{i % 97}",'
                        f'"ua":"Mozilla/5.0","t":{created}}}').encode()
            c = COMPRESSIONS[i % 10]
            head = f'{{"app":"{app}","env":"{env}","topic":"{topic}","device":{dev},'
            out.append((f"{app}-{env}" if env else app, topic, comp(body, c), c, dev, created,
                        step, head, body))
        return out


_GEN: Generator | None = None


def _chunk(args):
    n, seed, start, stop = args
    global _GEN
    if _GEN is None or _GEN.n != n or _GEN.seed != seed:
        _GEN = Generator(n, seed)
    return _GEN.chunk(start, stop)


def write(n: int, out: str, seed: int = 7, segment_bytes: int = 64 << 20,
          batch: int = 2000) -> dict:
    """Write ``out``/archive and ``out``/json (one file per ~500k records); returns the
    figures (records, bytes)."""
    import struct

    from logjam_relay.outputs.archive import Archive
    from logjam_relay.spool.spool import Spool
    meta = struct.Struct(">HBBIQQ")
    archive_dir = os.path.join(out, "archive")
    json_dir = os.path.join(out, "json")
    os.makedirs(json_dir, exist_ok=True)
    archive = Archive(archive_dir, None, fsync=False)
    sp = Spool(os.path.join(out, "spool"), readers=[], segment_bytes=segment_bytes,
               fsync="never", max_bytes=max(1 << 30, 8 * segment_bytes),
               on_seal=archive.on_seal)
    from multiprocessing import Pool
    step = 50_000
    jobs = [(n, seed, k, min(n, k + step)) for k in range(0, n, step)]
    seqs = dict.fromkeys(DEVICES, 0)
    count = body_bytes = 0
    min_b, max_b = 1 << 30, 0
    part = 0
    fh = open(os.path.join(json_dir, f"{part:05d}.json"), "w")
    try:
        with Pool(max(1, min(2, os.cpu_count() or 1))) as pool:
            for recs in pool.imap(_chunk, jobs):
                rows = []
                for app_env, topic, wire, c, dev, created, stp, head, body in recs:
                    seqs[dev] += stp
                    rows.append((app_env, topic, wire, c, dev, created, seqs[dev], head, body))
                if count == 0 and len(rows) > 45:
                    rows.insert(31, rows[25])                   # a duplicate
                    rows[40], rows[41] = rows[41], rows[40]     # an out-of-order pair
                frames, lines = [], []
                for app_env, topic, wire, c, dev, created, seq, head, body in rows:
                    frames.append([app_env.encode(), topic.encode(), wire,
                                   meta.pack(0xCABD, c, 1, dev, created, seq)])
                    lines.append(f'{head}"sequence":{seq},"created_ms":{created},'
                                 f'"body":{body.decode()}}}\n')
                    lb = len(body)
                    body_bytes += lb
                    if topic.startswith("logs"):
                        min_b, max_b = min(min_b, lb), max(max_b, lb)
                for k in range(0, len(frames), batch):
                    sp.append_batch(frames[k:k + batch])
                fh.writelines(lines)
                count += len(rows)
                if count >= (part + 1) * 500_000:
                    fh.close()
                    part += 1
                    fh = open(os.path.join(json_dir, f"{part:05d}.json"), "w")
        sp.seal()
    finally:
        sp.close()
        fh.close()
    import shutil
    shutil.rmtree(os.path.join(out, "spool"), ignore_errors=True)
    info = {"generator": VERSION, "requested": n, "records": count, "seed": seed,
            "body_bytes": body_bytes,
            "logs_body_min": min_b, "logs_body_max": max_b}
    with open(os.path.join(out, "data.json"), "w") as f:
        json.dump(info, f)
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t = time.perf_counter()
    info = write(a.records, a.out, a.seed)
    print(json.dumps(info), f"{time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
