"""Plain-Python definitions of the four stats tables (the reference the tests compare the
Spark tables with, figure by figure; see ``docs/pipeline.md``)."""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections import defaultdict

from .extract import iso_ms as _iso_ms
from .minutes import minute_of as _minute
from .minutes import request_time

DEFAULT_APDEX_MS = 500.0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _percentile(sorted_vals: list[float], p: float) -> float:
    pos = (len(sorted_vals) - 1) * p
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return sorted_vals[lo]
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _date(minute_ms: int) -> str:
    return _dt.datetime.fromtimestamp(minute_ms / 1000, _dt.UTC).date().isoformat()


def reference_tables(records, apdex_ms: float = DEFAULT_APDEX_MS) -> dict[str, list[dict]]:
    """Plain Python over decoded records in arrival order: dicts with ``app_env`` (str),
    ``topic`` (str), ``body`` (decompressed bytes or None when it could not be decoded),
    ``device``, ``sequence``, ``created_ms`` (None for a broken meta frame).
    Rows use ``minute_ms`` (epoch ms) and ``date`` (ISO string)."""
    req = defaultdict(list)
    exc = defaultdict(int)
    top = defaultdict(int)
    loss_rows: dict = defaultdict(lambda: {"received": 0, "missing": 0, "duplicates": 0,
                                           "out_of_order": 0, "seqs": []})
    seen: dict[int, set] = defaultdict(set)
    maxseq: dict[int, int] = {}
    first_minute: dict[tuple[int, int], int] = {}
    for r in records:
        dev, seq, created = r["device"], r["sequence"], r["created_ms"]
        if dev is not None:
            m = _minute(created)
            lr = loss_rows[(dev, m)]
            lr["received"] += 1
            lr["seqs"].append(seq)
            if seq in seen[dev]:
                lr["duplicates"] += 1
            else:
                seen[dev].add(seq)
                first_minute[(dev, seq)] = m
                if dev in maxseq and seq < maxseq[dev]:
                    lr["out_of_order"] += 1
            maxseq[dev] = max(maxseq.get(dev, seq), seq)
        topic = r["topic"]
        if topic is None or dev is None:
            if topic is not None and not topic.startswith("logs"):
                pass
            if topic is None:
                continue
        if r["app_env"] == "heartbeat":
            continue             # counted in the loss report above, nowhere else
        app, sep, env = r["app_env"].rpartition("-")
        if not sep:
            app, env = r["app_env"], ""
        if not topic.startswith("logs"):
            if created is None:
                continue         # broken meta: no time (the Spark side drops it the same way)
            top[(_minute(created), app, env, topic)] += 1
            continue
        body = r["body"]
        if body is None:
            continue
        try:
            j = json.loads(body)
        except ValueError:
            continue
        if not isinstance(j, dict):
            continue
        started = j.get("started_ms")
        sm = started if _is_int(started) else _iso_ms(j.get("started_at"))
        m = _minute(request_time(sm, created))
        action = j.get("action") if isinstance(j.get("action"), str) else None
        action = "unknown" if action is None else action
        tt = j.get("total_time")
        tt = float(tt) if (_is_int(tt) or isinstance(tt, float)) else None
        code = j.get("code") if _is_int(j.get("code")) else None
        sev = j.get("severity") if _is_int(j.get("severity")) else None
        req[(m, app, env, action)].append((tt, code, sev))
        exs = j.get("exceptions")
        if isinstance(exs, list):
            for e in exs:
                if isinstance(e, str):
                    exc[(m, app, env, action, e)] += 1
    # gaps: between consecutive distinct sequence numbers, counted at the lower one's minute
    for dev, seqs in seen.items():
        s = sorted(seqs)
        for a, b in zip(s, s[1:], strict=False):
            if b - a > 1:
                loss_rows[(dev, first_minute[(dev, a)])]["missing"] += b - a - 1
    t = float(apdex_ms)
    out_req = []
    for (m, app, env, action), vals in req.items():
        tts = sorted(v[0] for v in vals if v[0] is not None)
        row = {"date": _date(m), "minute_ms": m, "app": app, "env": env, "action": action,
               "count": len(vals),
               "total_time_sum": sum(tts) if tts else None,
               "total_time_avg": sum(tts) / len(tts) if tts else None,
               "total_time_max": max(tts) if tts else None,
               "total_time_p50": _percentile(tts, 0.5) if tts else None,
               "total_time_p95": _percentile(tts, 0.95) if tts else None,
               "total_time_p99": _percentile(tts, 0.99) if tts else None,
               "apdex": ((sum(1 for x in tts if x <= t)
                          + 0.5 * sum(1 for x in tts if t < x <= 4 * t)) / len(tts))
               if tts else None}
        for k in (2, 3, 4, 5):
            row[f"http_{k}xx"] = sum(1 for v in vals if v[1] is not None
                                     and k * 100 <= v[1] < k * 100 + 100)
        for k in range(6):
            row[f"severity_{k}"] = sum(1 for v in vals if v[2] == k)
        out_req.append(row)
    out_exc = [{"date": _date(m), "minute_ms": m, "app": app, "env": env, "action": action,
                "exception": e, "count": n} for (m, app, env, action, e), n in exc.items()]
    out_top = [{"date": _date(m), "minute_ms": m, "app": app, "env": env, "topic": tp,
                "count": n} for (m, app, env, tp), n in top.items()]
    out_loss = [{"date": _date(m), "minute_ms": m, "device": dev, "received": v["received"],
                 "missing": v["missing"], "duplicates": v["duplicates"],
                 "out_of_order": v["out_of_order"], "first_sequence": min(v["seqs"]),
                 "last_sequence": max(v["seqs"])}
                for (dev, m), v in loss_rows.items()]
    return {"request_stats": out_req, "exceptions": out_exc, "loss": out_loss,
            "topics": out_top}
