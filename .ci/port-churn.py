#!/usr/bin/env python3
"""Other servers on the machine, for the loaded gate (.ci/run-loaded): keeps about
``--servers`` listening TCP sockets open at any time, each for 1-5 s, as other programs'
servers would take them:

* most bind port 0 (the kernel picks one in its ephemeral range, 32768-60999 on Linux);
* the rest do what another test suite's free-port helper does: probe a random port in
  20000-60999 with a plain bind (no SO_REUSEADDR), and when that succeeds, close the probe
  and bind the server to it with SO_REUSEADDR, as servers do.

Runs until killed."""

import argparse
import random
import socket
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", type=int, default=40)
    ap.add_argument("--random-share", type=float, default=0.3)
    a = ap.parse_args()
    rng = random.Random()
    held: list[tuple[float, socket.socket]] = []
    while True:
        now = time.monotonic()
        for until, s in [h for h in held if h[0] <= now]:
            s.close()
        held = [h for h in held if h[0] > now]
        while len(held) < a.servers:
            port = 0
            if rng.random() < a.random_share:
                port = rng.randint(20000, 60999)
                with socket.socket() as probe:
                    try:
                        probe.bind(("0.0.0.0", port))
                    except OSError:
                        continue
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
                s.listen(8)
            except OSError:
                s.close()
                continue
            held.append((now + rng.uniform(1.0, 5.0), s))
        time.sleep(0.05)


if __name__ == "__main__":
    main()
