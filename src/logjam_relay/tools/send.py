"""``logjam-relay send``: send test messages or a ping to a relay (or logjam-device).

Through ROUTER (a DEALER client; ``--sync`` waits for every reply, otherwise the
empty frame is left out and nothing is answered, like the Ruby agent's async
mode) or through PULL (a PUSH client; never answered).

Every message gets its own body, stamped when it is sent: ``started_ms`` and
``started_at`` (the send time, in epoch ms and in ISO-8601 with the local offset)
and a new ``request_id`` (32 hex digits). The default body is a request with the
fields logjam's message format asks for (action, started_at, started_ms,
total_time, code, severity, caller_id, caller_action, request_id) plus host,
process_id, db_time and ``n``, the message's number; action, code and times vary
from message to message. ``-b JSON`` sends an object of your own instead, with
those three fields stamped per message (they replace the object's own);
``--verbatim`` sends ``-b`` byte for byte, and so does any ``-b`` that is not a
JSON object.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import socket
import sys
import time

import zmq

from ..config.helptext import plain
from ..protocols import logjam as L


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="logjam-relay send", description=plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--connect", default=None,
                   help="endpoint (default tcp://127.0.0.1:9604 for ROUTER, :9605 for PULL)")
    p.add_argument("--pull", action="store_true", help="send through PULL (PUSH socket)")
    p.add_argument("-n", "--count", type=int, default=1, help="number of messages")
    p.add_argument("--ping", action="store_true", help="send a ping instead of messages")
    p.add_argument("--sync", action="store_true", help="ask for and wait for every reply")
    p.add_argument("-x", "--compress", choices=["none", "zlib", "snappy", "lz4"],
                   default="none")
    p.add_argument("-a", "--app-env", default="logjam_relay-test")
    p.add_argument("-t", "--topic", default="logs.logjam_relay.test")
    p.add_argument("-b", "--body", default=None,
                   help="a JSON object to send instead of the default request; started_ms, "
                        "started_at and request_id are stamped per message")
    p.add_argument("--verbatim", action="store_true",
                   help="send -b byte for byte, nothing stamped")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a reply")
    return p


ACTIONS = ("Orders#index", "Orders#show", "Users#create", "Api::V1::Items#update",
           "Health#ping")
CODES = (200, 200, 200, 200, 201, 204, 302, 304, 404, 422, 500)


class Bodies:
    """One body per message: the default request, or ``-b``'s object, stamped at send time."""

    def __init__(self, body: str | None, verbatim: bool = False):
        self.rng = random.Random()
        self.tz = _dt.datetime.now().astimezone().tzinfo
        self.fixed: bytes | None = None
        self.template: dict | None = None
        if body is not None:
            try:
                obj = None if verbatim else json.loads(body)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                self.template = obj
            else:
                self.fixed = body.encode()
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.encode = json.JSONEncoder(separators=(",", ":")).encode
        self._second = None
        self._stamp = ("", "")          # started_at of that second: up to the seconds, offset

    def started_at(self, now_ms: int) -> str:
        """``now_ms`` in ISO-8601 with milliseconds and the local offset (one datetime per
        second: the rest is the same string)."""
        second = now_ms // 1000
        if second != self._second:
            iso = _dt.datetime.fromtimestamp(second, self.tz).isoformat(timespec="seconds")
            self._second, self._stamp = second, (iso[:19], iso[19:])
        return f"{self._stamp[0]}.{now_ms % 1000:03d}{self._stamp[1]}"

    def __call__(self, i: int, now_ms: int) -> bytes:
        if self.fixed is not None:
            return self.fixed
        rng = self.rng
        if self.template is not None:
            d = dict(self.template)
        else:
            total = round(rng.lognormvariate(4.0, 1.0), 3)
            code = rng.choice(CODES)
            d = {"action": ACTIONS[rng.randrange(len(ACTIONS))], "code": code,
                 "total_time": total, "db_time": round(total * rng.random() * 0.6, 3),
                 "severity": 3 if code >= 500 else 2 if code >= 400 else 1,
                 "caller_id": "", "caller_action": "", "host": self.host,
                 "process_id": self.pid, "n": i}
        d["started_ms"] = now_ms
        d["started_at"] = self.started_at(now_ms)
        d["request_id"] = f"{rng.getrandbits(128):032x}"
        return self.encode(d).encode()


def main(argv: list[str] | None = None, out=None) -> int:
    args = parser().parse_args(argv)
    out = out or sys.stdout
    method = L.COMPRESSION_BY_NAME[args.compress]
    ep = args.connect or ("tcp://127.0.0.1:9605" if args.pull else "tcp://127.0.0.1:9604")
    if args.pull and (args.sync or args.ping):
        print("send: --sync and --ping need ROUTER (PULL never answers)", file=sys.stderr)
        return 2
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH if args.pull else zmq.DEALER)
    sock.setsockopt(zmq.LINGER, int(args.timeout * 1000))
    sock.connect(ep)
    app = args.app_env.encode()
    rc = 0
    try:
        if args.ping:
            sock.send_multipart([b"", L.PING, app, b"{}", L.encode_meta(0, 0, 0, 0)])
            if not sock.poll(int(args.timeout * 1000)):
                print("no reply", file=out)
                return 1
            print(" ".join(f.decode(errors="replace") for f in sock.recv_multipart()), file=out)
            return 0
        replies = {}
        bodies = Bodies(args.body, args.verbatim)
        for i in range(1, args.count + 1):
            now_ms = int(time.time() * 1000)
            body = L.compress(bodies(i, now_ms), method)
            frames = [app, args.topic.encode(), body, L.encode_meta(method, 0, now_ms, i)]
            if args.sync:
                sock.send_multipart([b"", *frames])
                if not sock.poll(int(args.timeout * 1000)):
                    print(f"message {i}: no reply", file=out)
                    rc = 1
                    break
                r = b" ".join(sock.recv_multipart()).decode(errors="replace")
                replies[r] = replies.get(r, 0) + 1
            else:
                sock.send_multipart(frames)
        print(f"sent {args.count} message(s) to {ep}"
              + (": " + ", ".join(f"{n} x {r}" for r, n in replies.items()) if replies else ""),
              file=out)
    finally:
        ctx.destroy(linger=int(args.timeout * 1000))
    return rc
