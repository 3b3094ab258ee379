"""``logjam-relay`` command line.

``logjam-relay [options]`` runs the relay (the same flags as logjam-device, plus
the relay's own); ``logjam-relay run [options]`` is the same.  Operator tools:
``logjam-relay tail ...`` and ``logjam-relay send ...``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import time

from . import __version__
from .config import ConfigError, StartupError, add_arguments, find_exception
from .config.helptext import display_value, effective_values
from .ratelimit import escape_controls
from .redact import install_log_redaction, redact_exceptions, redact_setting, redact_text

SUBCOMMANDS = ("run", "tail", "send", "pipeline", "spool", "deadletters", "keygen")

# One line per subcommand for --help; a subcommand in SUBCOMMANDS without a line here is
# still listed (the list is built from SUBCOMMANDS, so new ones show up by themselves).
SUBCOMMAND_HELP = {
    "run": "run the relay (the default when no subcommand is given)",
    "tail": "print what a relay publishes on its PUB port",
    "send": "send logjam messages to a relay",
    "pipeline": "Spark pipelines over the relay's archive (needs the 'spark' extra)",
    "spool": "spool fsck DIR [--repair]: check (and repair) a spool directory",
    "deadletters": "list and re-send dead letters",
    "keygen": "generate keys and certificates",
}


def subcommand_list() -> str:
    return "\n".join(f"  {name:<12} {SUBCOMMAND_HELP.get(name, '')}".rstrip()
                     for name in SUBCOMMANDS)


def iso_time(created: float) -> str:
    """ISO-8601 UTC with milliseconds: 2026-11-22T21:09:31.123Z."""
    t = datetime.datetime.fromtimestamp(created, datetime.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


class _JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        # json.dumps escapes every control character: no line can be forged
        d = {"time": iso_time(record.created), "level": record.levelname,
             "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d)


class _TextFormatter(logging.Formatter):
    """One record, one line: control characters in the message (client-chosen bytes that
    reached it) are escaped as \\xNN, so nobody can forge a line or send terminal escapes."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


class _StartupBuffer(logging.Handler):
    """Holds log records until the relay is ready (then replays them), so that a start-up
    failure is the one line it prints.  After ``max_hold`` seconds records pass through,
    so a slow start (a long spool recovery) is not silent."""

    def __init__(self, target: logging.Handler, max_hold: float = 5.0):
        super().__init__(logging.NOTSET)
        self.target = target
        self.records: list[logging.LogRecord] = []
        self.deadline = time.monotonic() + max_hold
        self.live = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.live and time.monotonic() > self.deadline:
            self.go_live()
        if self.live:
            self.target.handle(record)
        else:
            self.records.append(record)

    def go_live(self) -> None:      # (not "release": logging.Handler has one, its lock)
        """Replay what was held and log live from now on."""
        self.live = True
        held, self.records = self.records, []
        for r in held:
            self.target.handle(r)
        root = logging.getLogger()
        if self in root.handlers:
            root.handlers[root.handlers.index(self)] = self.target

    def discard(self) -> None:
        self.records = []
        self.live = True


def setup_logging(verbose: int = 0, quiet: bool = False, fmt: str = "text") -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose >= 2 else logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JSONFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s [%(levelname).1s] %(name)s: "
                                            "%(message)s"))
    install_log_redaction()
    redact_exceptions(handler.formatter)        # tracebacks too
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def c_parts() -> str:
    """Which optional C extensions this installation has (the rest runs in Python)."""
    from . import _native
    from .io import zmq_fast
    parts = {label: _native.load(mod) is not None for label, mod in _native.EXTENSIONS.items()}
    parts["socket loops"] = zmq_fast.AVAILABLE
    on = [k for k, v in parts.items() if v]
    off = [k for k, v in parts.items() if not v]
    text = "C: " + (", ".join(on) if on else "none")
    if off:
        text += "; in Python: " + ", ".join(off)
    if not zmq_fast.AVAILABLE:
        text += f" ({zmq_fast.WHY_NOT})"
    return text


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (a relay holds a socket per client and
    per metrics connection; 1024 is a common soft default).  Returns (old, new) soft limit."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        # an unlimited hard limit still stops at the kernel's nr_open (1048576 by default)
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        if soft == resource.RLIM_INFINITY or soft >= target:
            return soft, soft
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        logging.getLogger("logjam_relay").info("open-file limit raised from %d to %d",
                                               soft, target)
        return soft, target
    except (ImportError, ValueError, OSError) as e:
        logging.getLogger("logjam_relay").warning("cannot raise the open-file limit: %s", e)
        return -1, -1


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="logjam-relay",
        usage="logjam-relay [SUBCOMMAND] [options]",
        description="A drop-in logjam-device replacement.\n\nsubcommands "
                    "(logjam-relay SUBCOMMAND --help for each):\n" + subcommand_list() +
                    "\n\nSettings: TOML file < LOGJAM_RELAY_* environment < flags; every "
                    "option below shows its default.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version",
                   version=f"logjam-relay {__version__} ({c_parts()})")
    p.add_argument("--check-config", action="store_true",
                   help="validate the configuration, print the effective values (with "
                        "where each came from) and exit")
    add_arguments(p)
    return p


def cmd_run(argv: list[str]) -> int:
    import trio

    from .relay.configure import load
    from .relay.service import serve

    args = vars(run_parser().parse_args(argv))
    check = args.pop("check_config", False)
    try:
        settings = load(args)
    except ConfigError as e:
        print(f"logjam-relay: configuration error: {redact_text(str(e))}", file=sys.stderr)
        return 2
    if check:
        for k, shown, source in effective_values(settings):
            v = getattr(settings, k)
            red = redact_setting(k, v)          # secrets print as ***
            if red != v:
                shown = display_value(k, red)
            print(f"{k} = {shown}  ({source})")
        return 0
    setup_logging(settings.verbose, settings.quiet, settings.log_format)
    root = logging.getLogger()
    buffer = _StartupBuffer(root.handlers[0])
    root.handlers[:] = [buffer]
    raise_open_file_limit()
    ready = False

    async def run_service():
        nonlocal ready
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, settings)
            ready = True
            buffer.go_live()
            from .gc_tuning import tune_gc
            tune_gc()       # start-up done: the garbage collector off the hot path

    try:
        trio.run(run_service)
    except KeyboardInterrupt:
        return 0
    except BaseException as e:          # noqa: BLE001 -- reported, never a traceback at start
        found = find_exception(e, (StartupError, ConfigError))
        if found is None and not ready:
            # not foreseen, but still one line: the innermost error, named by its type
            leaf = find_exception(e, (Exception,)) or e
            found = StartupError("start-up", type(leaf).__name__, "unexpected",
                                 str(leaf) or repr(leaf))
        if found is None:
            if isinstance(e, SystemExit):
                raise
            buffer.go_live()
            logging.getLogger("logjam_relay").critical("relay failed", exc_info=e)
            return 1
        if ready:
            buffer.go_live()
            logging.getLogger("logjam_relay").critical("relay stopped: %s", found)
            return 1
        if settings.verbose:                # -v: what the aborted start logged, and why
            buffer.go_live()
            logging.getLogger("logjam_relay").debug("start-up failed", exc_info=e)
        else:
            buffer.discard()
        print(f"logjam-relay: cannot start: {redact_text(escape_controls(str(found)))}",
              file=sys.stderr)
        return 2
    finally:
        if not buffer.live:
            buffer.go_live()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sub = argv[0] if argv and argv[0] in SUBCOMMANDS else "run"
    if argv and argv[0] == sub:
        argv = argv[1:]
    if sub == "run":
        return cmd_run(argv)
    if sub == "tail":
        from .tools.tail import main as tail_main
        return tail_main(argv)
    if sub == "send":
        from .tools.send import main as send_main
        return send_main(argv)
    if sub == "spool":
        from .spool.fsck import main as spool_main
        return spool_main(argv)
    if sub == "deadletters":
        from .tools.deadletters import main as deadletters_main
        return deadletters_main(argv)
    if sub == "keygen":
        from .tools.keygen import main as keygen_main
        return keygen_main(argv)
    if sub == "pipeline":
        try:
            from .pipeline.cli import main as pipeline_main
        except ImportError as e:
            print(f"logjam-relay pipeline: {e} (install the 'spark' extra)", file=sys.stderr)
            return 2
        return pipeline_main(argv)
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
