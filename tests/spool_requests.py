"""Shared by the spool fault tests: numbered requests on one DEALER, the 202-answered set."""

from __future__ import annotations

import trio
import zmq

from logjam_relay.io import zmq_trio
from relay_harness import meta


async def send_requests(ctx, settings, numbers, body: bytes, app: bytes) -> set[int]:
    """Send ``body % n`` for each of ``numbers`` (stream ``app``, topic ``logs.<app>``),
    pipelined in steps of 250 within the socket HWMs; the numbers answered 202."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{settings.router_port}")
    numbers = list(numbers)
    accepted: set[int] = set()
    stream, topic = app + b"-test", b"logs." + app
    try:
        with trio.fail_after(60):
            for k in range(0, len(numbers), 250):
                chunk = numbers[k:k + 250]
                for n in chunk:
                    await zmq_trio.send_multipart(dealer, [b"", stream, topic, body % n, meta()])
                for n in chunk:            # DEALER replies come back in request order
                    r = await zmq_trio.recv_multipart(dealer)
                    if r[-1] == b"202 Accepted":
                        accepted.add(n)
    finally:
        dealer.close()
    return accepted
