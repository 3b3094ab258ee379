"""``logjam-relay deadletters list|show|resend``: inspect and re-deliver dead letters.

The dead-letter store (``dead_letter_dir``, default ``<state_dir>/dead-letters``) holds
the events an output could not deliver: ``too_large`` (over ``max_event_bytes``) and
``refused`` (the receiver kept closing the connection before acknowledging them).

  list    one line per letter: id, time, output, reason, stream, size, detail
  show    one letter: its summary and its body (inflated, bounded by --max-event-bytes)
  resend  deliver letters again, to an output URL (lumberjack://... or courier://...,
          as in --output; waits for the receiver's acknowledgement) or into a relay's
          ZeroMQ PULL ingress (tcp://host:9605; the relay stamps a new sequence number).
          Exit status 0 when every selected letter was delivered, 1 otherwise.

The store is read, never changed: a resent letter stays listed (the store is bounded,
the oldest letters go first).  Select letters with --id ID (repeatable), --output and
--reason.  The directory comes from --dir, else from the relay's configuration
(-c FILE, LOGJAM_RELAY_* environment, --state-dir / --dead-letter-dir).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..config.helptext import plain


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="logjam-relay deadletters", description=plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["list", "show", "resend"])
    p.add_argument("--id", dest="ids", action="append", default=[], metavar="ID",
                   help="a letter to show/resend, repeatable (default: all selected by "
                   "--output/--reason)")
    p.add_argument("--dir", default=None, help="dead-letter directory")
    p.add_argument("-c", "--config", default=None, help="the relay's TOML configuration")
    p.add_argument("--state-dir", default=None)
    p.add_argument("--dead-letter-dir", default=None)
    p.add_argument("--output", default=None, help="only letters of this output")
    p.add_argument("--reason", default=None, help="only letters with this reason")
    p.add_argument("--json", action="store_true", help="list: one JSON object per line")
    p.add_argument("--to", default=None, metavar="URL",
                   help="resend: lumberjack://..., courier://... or tcp://host:port (PULL)")
    p.add_argument("--max-event-bytes", default=None,
                   help="resend/show: event size limit (default: the relay's max_event_bytes)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="resend: seconds to wait for the acknowledgements")
    return p


def _settings(args):
    from ..relay.configure import load  # the relay's own check of its configuration
    cli = {}
    if args.config:
        cli["config"] = args.config
    if args.state_dir:
        cli["state_dir"] = args.state_dir
    if args.dead_letter_dir:
        cli["dead_letter_dir"] = args.dead_letter_dir
    if args.max_event_bytes:
        cli["max_event_bytes"] = args.max_event_bytes
    return load(cli)


def _select(directory, args):
    from ..deadletter import read_dead_letters
    ids = set(args.ids)
    for d in read_dead_letters(directory):
        if ids and d.id not in ids:
            continue
        if args.output and d.output != args.output:
            continue
        if args.reason and d.reason != args.reason:
            continue
        yield d


def main(argv: list[str] | None = None, out=None) -> int:
    from ..config import ConfigError
    args = parser().parse_args(argv)
    out = out or sys.stdout
    try:
        settings = _settings(args)
    except ConfigError as e:
        print(f"logjam-relay deadletters: configuration error: {e}", file=sys.stderr)
        return 2
    directory = args.dir or settings.resolved_dead_letter_dir()
    if args.action == "list":
        n = 0
        for d in _select(directory, args):
            n += 1
            s = d.summary()
            if args.json:
                print(json.dumps(s), file=out)
            else:
                when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(d.time_ms / 1000))
                print(f"{d.id}\t{when}\t{d.output}\t{d.reason}\t{s.get('stream', '-')}\t"
                      f"{s['bytes']}\t{d.detail}", file=out)
        if not args.json:
            print(f"# {n} dead letter(s) in {directory}", file=sys.stderr)
        return 0
    if args.action == "show":
        return _show(directory, args, settings, out)
    if not args.to:
        print("logjam-relay deadletters resend: --to URL is required", file=sys.stderr)
        return 2
    letters = list(_select(directory, args))
    if not letters:
        print(f"logjam-relay deadletters resend: no dead letters selected in {directory}",
              file=sys.stderr)
        return 1
    from ..progress import Progress
    try:
        with Progress("deadletters resend", unit="letters", total=len(letters)) as p:
            delivered = resend(letters, args.to, max_event_bytes=settings.max_event_bytes,
                               timeout=args.timeout, relay_host=settings.resolved_fqdn(),
                               progress=p)
    except ValueError as e:
        print(f"logjam-relay deadletters resend: {e}", file=sys.stderr)
        return 2
    print(f"resent {delivered} of {len(letters)} dead letter(s) to {args.to}", file=out)
    return 0 if delivered == len(letters) else 1


def _show(directory, args, settings, out) -> int:
    from ..limits import BadBody, EventTooLarge, inflate_bounded
    n = 0
    for d in _select(directory, args):
        n += 1
        print(json.dumps(d.summary()), file=out)
        if d.kind == 0 and len(d.frames) == 4 and len(d.frames[3]) == 24:
            try:
                body = inflate_bounded(d.frames[3][2], d.frames[2], settings.max_event_bytes)
                print(body.decode("utf-8", "backslashreplace"), file=out)
            except (EventTooLarge, BadBody) as e:
                print(f"# body: {e}", file=out)
    if not n:
        print("no such dead letter", file=sys.stderr)
        return 1
    return 0


def resend(letters, url: str, *, max_event_bytes: int, timeout: float,
           relay_host: str, progress=None) -> int:
    """Deliver ``letters`` to ``url``; returns how many were acknowledged (for tcp://: how
    many were queued to a connected PULL peer; ZeroMQ PUSH has no acknowledgement).
    ``progress``: a :class:`~logjam_relay.progress.Progress`, updated as they go."""
    scheme = url.partition("://")[0].lower()
    if scheme == "tcp":
        return _resend_zmq(letters, url, timeout, progress)
    if scheme not in ("lumberjack", "courier"):
        raise ValueError(f"--to {url!r}: use lumberjack://, courier:// or tcp://")
    import trio

    from ..outputs.supervisor import make_output, parse_outputs
    from ..spool.api import MemorySource

    spec = parse_outputs([url])[0]
    src = MemorySource(name="resend")
    for d in letters:
        src.append(d.frames, kind=d.kind)
    output = make_output(spec, src, relay_host, max_event_bytes=max_event_bytes)

    async def run() -> None:
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(output.run)
                while not src.all_acked:
                    if progress is not None:
                        progress.update(len(letters) - src.stats()["backlog_records"],
                                        note="acknowledged")
                    await trio.sleep(0.02)
                nursery.cancel_scope.cancel()

    trio.run(run)
    if progress is not None:
        progress.update(len(letters) - src.stats()["backlog_records"])
        progress.close()
    acked = len(letters) - src.stats()["backlog_records"]
    # an output acknowledges what it diverts too (too large for --max-event-bytes, or
    # refused again by the receiver): those were not delivered
    diverted = output.stats().get("dead_letters") or {}
    not_sent = sum(diverted.values())
    if not_sent:
        print(f"logjam-relay deadletters resend: {not_sent} letter(s) not delivered: "
              + ", ".join(f"{n} {r}" for r, n in sorted(diverted.items()))
              + (" (raise --max-event-bytes)" if diverted.get("too_large") else ""),
              file=sys.stderr)
    return acked - not_sent


def _resend_zmq(letters, url: str, timeout: float, progress=None) -> int:
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, int(timeout * 1000))
    # queue only to a connection that is up: without it PUSH queues to a pipe whose
    # connection is still being tried, and a relay that is not there "receives" everything
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    n = 0
    try:
        sock.connect(url)
        for d in letters:
            if d.kind != 0 or len(d.frames) != 4:
                continue
            try:
                sock.send_multipart(d.frames)
            except zmq.Again:
                break
            n += 1
            if progress is not None:
                progress.update(n, note="sent")
    finally:
        sock.close()
        ctx.term()
    return n
