"""``logjam-relay tail``: watch a relay's (or logjam-device's) PUB stream.

Prints one line per message: time, app-env, topic, device, sequence, created
time and the decompressed JSON body; reports sequence gaps per device.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from dataclasses import dataclass, field

import zmq

from ..config.helptext import plain
from ..protocols import logjam as L


@dataclass
class GapTracker:
    """Per-device sequence tracking: gaps, duplicates / restarts."""

    last: dict[int, int] = field(default_factory=dict)
    missing: dict[int, int] = field(default_factory=dict)

    def see(self, device: int, seq: int) -> str | None:
        prev = self.last.get(device)
        self.last[device] = seq
        if prev is None:
            return None
        if seq == prev + 1:
            return None
        if seq > prev + 1:
            n = seq - prev - 1
            self.missing[device] = self.missing.get(device, 0) + n
            return f"GAP device {device}: {n} missing ({prev + 1}..{seq - 1})"
        return f"SEQUENCE device {device}: {seq} after {prev} (restart, duplicate or reorder)"


def format_message(frames: list[bytes], show_body: bool = True) -> tuple[str, int, int] | None:
    if len(frames) != 4 or L.meta_problem(frames[3]):
        return None
    app_env, topic, body, meta = frames
    m = L.decode_meta(meta)
    created = dt.datetime.fromtimestamp(m.created_ms / 1000, dt.UTC).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")
    line = (f"{app_env.decode(errors='replace')} {topic.decode(errors='replace')} "
            f"device={m.device} seq={m.sequence} created={created} "
            f"comp={L.COMPRESSION_NAMES.get(m.compression, m.compression)}")
    if show_body:
        try:
            text = L.decompress(body, m.compression).decode("utf-8", "replace")
        except L.LogjamError as e:
            text = f"<undecodable body: {e}>"
        line += " " + text
    return line, m.device, m.sequence


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="logjam-relay tail", description=plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--connect", action="append", dest="connect_list",
                   help="PUB endpoint (default tcp://127.0.0.1:9606); repeatable")
    p.add_argument("-a", "--app-env", action="append", default=[],
                   help="only streams starting with this prefix (subscription); repeatable. "
                        "A device numbers every message and heartbeat it publishes, so with "
                        "this filter the numbers skip what was not subscribed to: no gaps are "
                        "reported then")
    p.add_argument("-t", "--topic", action="append", default=[],
                   help="only topics starting with this prefix; repeatable")
    p.add_argument("-n", "--count", type=int, default=0, help="stop after N messages")
    p.add_argument("--no-body", action="store_true", help="do not print bodies")
    p.add_argument("--heartbeats", action="store_true", help="print heartbeats too")
    p.add_argument("--timeout", type=float, default=0,
                   help="stop after this many seconds without a message (0 = never)")
    return p


def main(argv: list[str] | None = None, out=None) -> int:
    args = parser().parse_args(argv)
    out = out or sys.stdout
    endpoints = args.connect_list or ["tcp://127.0.0.1:9606"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    for prefix in args.app_env or [""]:
        sub.setsockopt(zmq.SUBSCRIBE, prefix.encode())
    if args.heartbeats and args.app_env:
        sub.setsockopt(zmq.SUBSCRIBE, L.HEARTBEAT)
    for ep in endpoints:
        sub.connect(ep)
    topics = tuple(t.encode() for t in args.topic)
    # gaps only where every message of a device is seen: a subscription to some streams
    # skips the sequence numbers of the others and of the heartbeats
    gaps = GapTracker() if not args.app_env else None
    shown = 0
    try:
        while not args.count or shown < args.count:
            if args.timeout and not sub.poll(int(args.timeout * 1000)):
                break
            frames = sub.recv_multipart()
            res = format_message(frames, not args.no_body)
            if res is None:
                print(f"(not a logjam message: {len(frames)} frames)", file=out)
                continue
            line, device, seq = res
            gap = gaps.see(device, seq) if gaps is not None else None
            if gap:
                print(f"!! {gap}", file=out)
            if frames[0] == L.HEARTBEAT:
                if args.heartbeats:
                    print(line, file=out)
                continue
            if topics and not frames[1].startswith(topics):
                continue
            print(line, file=out, flush=True)
            shown += 1
    except KeyboardInterrupt:
        pass
    finally:
        ctx.destroy(linger=0)
    if gaps is not None and gaps.missing:
        print("missing by device: " + ", ".join(f"{d}={n}" for d, n in
                                                 sorted(gaps.missing.items())), file=out)
    return 0
