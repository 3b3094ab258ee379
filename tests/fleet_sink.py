"""A Lumberjack v1 sink on 0.0.0.0:PORT (tests/peers/lumberjack_reader.py, decoding and
acknowledging only): what a central relay is measured against in bench/bench_fleet.py.
Run in a host's namespace; stops on SIGTERM."""

import signal
import sys

import trio

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from peers.lumberjack_reader import LumberjackReader  # noqa: E402


async def main(port: int) -> None:
    r = LumberjackReader(host="0.0.0.0", port=port, keep_windows=False, timeout=60)
    with trio.open_signal_receiver(signal.SIGTERM) as sigs:
        async with trio.open_nursery() as n:
            await n.start(r.serve)

            async def stop():
                async for _ in sigs:
                    n.cancel_scope.cancel()
                    return
            n.start_soon(stop)


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]))
