"""``logjam-relay`` command line.

``logjam-relay [options]`` runs the relay (the same flags as logjam-device, plus
the relay's own); ``logjam-relay run [options]`` is the same.  Operator tools:
``logjam-relay tail ...`` and ``logjam-relay send ...``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from . import __version__
from .config import ConfigError, add_arguments, load

SUBCOMMANDS = ("run", "tail", "send", "pipeline")


class _JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        d = {"time": self.formatTime(record), "level": record.levelname,
             "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d)


def setup_logging(verbose: int = 0, quiet: bool = False, fmt: str = "text") -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose >= 2 else logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JSONFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s [%(levelname).1s] %(name)s: "
                                               "%(message)s"))
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


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="logjam-relay",
        description="A drop-in logjam-device replacement. Subcommands: run (default), tail, "
                    "send. Settings: TOML file < LOGJAM_RELAY_* environment < flags.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--version", action="version",
                   version=f"logjam-relay {__version__} ({c_parts()})")
    p.add_argument("--check-config", action="store_true",
                   help="validate the configuration, print it and exit")
    add_arguments(p)
    return p


def cmd_run(argv: list[str]) -> int:
    import trio

    from .relay.service import serve

    args = vars(run_parser().parse_args(argv))
    check = args.pop("check_config", False)
    try:
        settings = load(args)
    except ConfigError as e:
        print(f"logjam-relay: configuration error: {e}", file=sys.stderr)
        return 2
    if check:
        for k, v in sorted(vars(settings).items()):
            if k != "sources":
                print(f"{k} = {v!r}  ({settings.sources.get(k, 'default')})")
        return 0
    setup_logging(settings.verbose, settings.quiet, settings.log_format)
    try:
        trio.run(serve, settings)
    except OSError as e:
        logging.getLogger("logjam_relay").error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 0
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
