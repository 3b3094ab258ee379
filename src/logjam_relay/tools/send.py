"""``logjam-relay send``: send test messages or a ping to a relay (or logjam-device).

Through ROUTER (a DEALER client; ``--sync`` waits for every reply, otherwise the
empty frame is left out and nothing is answered, like the Ruby agent's async
mode) or through PULL (a PUSH client; never answered).
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("-b", "--body", default=None, help="JSON body (default: a small request)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a reply")
    return p


def _body(args, i: int) -> bytes:
    if args.body is not None:
        return args.body.encode()
    return json.dumps({"action": "Send#test", "n": i, "code": 200, "total_time": 1.5,
                       "severity": 1, "started_ms": int(time.time() * 1000)}).encode()


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
        for i in range(1, args.count + 1):
            body = L.compress(_body(args, i), method)
            frames = [app, args.topic.encode(), body,
                      L.encode_meta(method, 0, int(time.time() * 1000), i)]
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
