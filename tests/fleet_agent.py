"""An application's agent on an edge host (run in the host's namespace by
tests/fleet_scenario.py): logjam requests to the local relay (ROUTER on 127.0.0.1:9604),
one at a time, each at its own scheduled time, as a real agent sends each request when it
ends.  Runs until the file ``--stop`` exists, then ``--after`` seconds more; writes what
happened as JSON to ``--out``: the request ids answered ``202 Accepted``, those without a
reply within ``--timeout`` (the relay was killed or blocked), the refused count, and each
202's latency from its scheduled send time and its wall-clock time."""

import argparse
import json
import os
import struct
import time

import zmq

META = struct.Struct(">HBBIQQ")


def body(edge: str, i: int, now_ms: int) -> bytes:
    return json.dumps({"action": f"Fleet#{edge}", "started_ms": now_ms,
                       "total_time": 10.0 + (i % 50), "code": 200 if i % 17 else 500,
                       "severity": 1, "request_id": f"{edge}-{i:07d}"},
                      separators=(",", ":")).encode()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--edge", required=True)
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--stop", required=True)
    ap.add_argument("--after", type=float, default=3.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=9604)
    a = ap.parse_args()
    ctx = zmq.Context()

    def dealer():
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{a.port}")
        return s
    sock = dealer()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    answered, unknown, latencies, at = [], [], [], []
    refused = 0
    period = 1.0 / a.rate
    t0 = time.monotonic()
    stop_at = None
    i = 0
    while stop_at is None or time.monotonic() < stop_at:
        if stop_at is None and os.path.exists(a.stop):
            stop_at = time.monotonic() + a.after
        due = t0 + i * period
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        rid = f"{a.edge}-{i:07d}"
        now_ms = int(time.time() * 1000)
        sock.send_multipart([b"", b"fleet-production", b"logs.fleet.production",
                             body(a.edge, i, now_ms), META.pack(0xCABD, 0, 1, 0, now_ms, 0)])
        if dict(poller.poll(a.timeout * 1000)).get(sock):
            r = sock.recv_multipart()
            if r[-1] == b"202 Accepted":
                answered.append(rid)
                latencies.append(round(time.monotonic() - max(due, t0), 6))
                at.append(round(time.time(), 6))
            else:
                refused += 1
        else:
            unknown.append(rid)
            poller.unregister(sock)
            sock.close(linger=0)            # a late reply must not answer the next one
            sock = dealer()
            poller.register(sock, zmq.POLLIN)
        i += 1
    sock.close(linger=0)
    ctx.term()
    tmp = a.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"edge": a.edge, "sent": i, "answered": answered, "unknown": unknown,
                   "refused": refused, "latencies": latencies, "answered_at": at}, fh)
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
