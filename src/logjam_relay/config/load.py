"""Loading: defaults < TOML file < environment < command line, then the checks between
settings of the table (ports, sizes).  The values a subsystem owns (output and input URLs,
samwise brokers, CURVE keys, the web config) are checked by that subsystem's
``check_settings``, which the composition root runs (``logjam_relay.relay.configure``)."""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError
from .helptext import default_text, has_default_text
from .settings import BY_NAME, SETTING_FIELDS, Settings

# LOGJAM_RELAY_* variables that are legitimately not settings (read elsewhere); any other
# LOGJAM_RELAY_* name is a misspelt setting and stops start-up like an unknown TOML key.
#: the environment's names that are not settings: the config file, and the switches of the
#: C paths (all C twins; the fast zlib path of the bodies; the spool's sync thread)
NON_SETTING_ENV = frozenset({"LOGJAM_RELAY_CONFIG", "LOGJAM_RELAY_PURE_PYTHON",
                             "LOGJAM_RELAY_NATIVE_INFLATE", "LOGJAM_RELAY_SYNC_THREAD"})
NON_SETTING_ENV_PREFIX = "LOGJAM_RELAY_TEST_"   # the test suite's own knobs


def _did_you_mean(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _check_unknown_env(environ: Mapping[str, str]) -> None:
    known = {e for f in SETTING_FIELDS for e in _env_names(f)} | NON_SETTING_ENV
    for name in sorted(environ):
        if (name.startswith("LOGJAM_RELAY_") and name not in known
                and not name.startswith(NON_SETTING_ENV_PREFIX)):
            # compare what follows the prefix, which every candidate shares
            tails = {k[13:]: k for k in known if k.startswith("LOGJAM_RELAY_")}
            close = difflib.get_close_matches(name[13:], list(tails), n=1, cutoff=0.6)
            hint = f" (did you mean {tails[close[0]]}?)" if close else ""
            raise ConfigError(f"{name} (environment): unknown setting{hint}")


def _env_names(f) -> tuple[str, ...]:
    return ("LOGJAM_RELAY_" + f.name.upper(),) + f.metadata["env"]


def _flatten_toml(data: Mapping[str, Any], path: str, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        name = f"{prefix}{k}".replace("-", "_")
        if isinstance(v, dict):
            out.update(_flatten_toml(v, path, name + "_"))
        else:
            out[name] = v
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every setting's flags to ``parser`` (defaults suppressed: only given flags count)."""
    parser.add_argument("-c", "--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="TOML configuration file (also LOGJAM_RELAY_CONFIG)")
    defaults = Settings()
    for f in SETTING_FIELDS:
        md = f.metadata
        text = md["help"]
        if not has_default_text(text):  # some texts already say what the default resolves to
            text += f" (default: {default_text(defaults, f.name)})"
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS,
                              "help": text.replace("%", "%%")}
        if md["action"]:
            kw["action"] = md["action"]
        if md["metavar"]:
            kw["metavar"] = md["metavar"]
        parser.add_argument(*md["flags"], **kw)


def load(args: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
         config_file: str | os.PathLike | None = None) -> Settings:
    """Build validated :class:`Settings` from command-line values, environment and TOML."""
    environ = os.environ if environ is None else environ
    args = dict(args or {})
    raw: dict[str, tuple[Any, str]] = {}

    path = args.pop("config", None) or config_file or environ.get("LOGJAM_RELAY_CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: {e}") from None
        for name, v in _flatten_toml(data, str(path)).items():
            if name not in BY_NAME:
                raise ConfigError(f"{name} ({path}): unknown setting"
                                  f"{_did_you_mean(name, BY_NAME)}")
            raw[name] = (v, str(path))

    for f in SETTING_FIELDS:
        for env in _env_names(f):
            if env in environ:
                raw[f.name] = (environ[env], env)
                break
    _check_unknown_env(environ)

    for name, v in args.items():
        if name in BY_NAME and v is not None:
            flag = BY_NAME[name].metadata["flags"][-1]
            raw[name] = (v, flag)

    s = Settings()
    for name, (v, src) in raw.items():
        conv = BY_NAME[name].metadata["conv"]
        try:
            value = conv(v)
        except ValueError as e:
            raise ConfigError(f"{name} ({src}): {e}") from None
        setattr(s, name, value)
        s.sources[name] = src
    _read_brokers_file(s)
    _check(s)
    return s


def _read_brokers_file(s: Settings) -> None:
    """Append the brokers of ``amqp_brokers_file`` (one NAME=URL a line) to amqp_brokers."""
    if not s.amqp_brokers_file:
        return
    src = s.sources.get("amqp_brokers_file", "default")
    try:
        with open(s.amqp_brokers_file, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as e:
        raise ConfigError(f"amqp_brokers_file ({src}): {s.amqp_brokers_file}: "
                          f"{e.strerror}") from None
    s.amqp_brokers = list(s.amqp_brokers) + [ln.strip() for ln in lines
                                              if ln.strip() and not ln.lstrip().startswith("#")]
    if "amqp_brokers" not in s.sources:     # all of them from the file: name it as the source
        s.sources["amqp_brokers"] = s.amqp_brokers_file


def ineffective(s: Settings) -> list[str]:
    """Settings that are valid but do nothing in this configuration, one line each: the
    relay logs them as warnings at start and ``--check-config`` prints them (a value an
    operator set and that does nothing should not pass unnoticed)."""
    out = []
    if s.spool_fsync_batch_delay > 0 and not (
            s.resolved_spool_dir() is not None and s.spool_fsync == "batch"):
        out.append(f"spool_fsync_batch_delay ({s.source_label('spool_fsync_batch_delay')}) "
                   f"= {s.spool_fsync_batch_delay:g}s has no effect: it spaces the group "
                   "commit's rounds, which run only with a spool and spool_fsync = "
                   "\"batch\" (here: "
                   + (f"spool_fsync = \"{s.spool_fsync}\"" if s.resolved_spool_dir() is not None
                      else "no spool_dir") + ")")
    return out


def _check(s: Settings) -> None:
    ports = {n: getattr(s, n) for n in ("pull_port", "router_port", "pub_port", "stats_port",
                                        "metrics_port", "cmdp_port")}
    seen: dict[int, str] = {}
    for name, p in ports.items():
        if p and p in seen:
            raise ConfigError(f"{name} ({s.sources.get(name, 'default')}): port {p} is already "
                              f"used by {seen[p]}")
        if p:
            seen[p] = name
    if not s.pub_port:
        raise ConfigError("pub_port: the PUB port cannot be off")
    if s.spool_max_bytes < 4 * 4096:        # the spool needs room for 4 segments
        raise ConfigError(f"spool_max_bytes ({s.sources.get('spool_max_bytes', 'default')}): "
                          f"must be >= 16KiB, got {s.spool_max_bytes}")
    if not 1024 <= s.max_event_bytes <= 1024**3:
        raise ConfigError(f"max_event_bytes ({s.sources.get('max_event_bytes', 'default')}): "
                          f"must be between 1KiB and 1GiB, got {s.max_event_bytes}")
    if s.dead_letter_max_bytes < s.max_event_bytes:
        src = s.sources.get("dead_letter_max_bytes", "default")
        raise ConfigError(f"dead_letter_max_bytes ({src}): "
                          f"must be >= max_event_bytes ({s.max_event_bytes}), "
                          f"got {s.dead_letter_max_bytes}")
    if s.zmq_max_msg_bytes and s.zmq_max_msg_bytes <= s.max_event_bytes:
        raise ConfigError(f"zmq_max_msg_bytes ({s.source_label('zmq_max_msg_bytes')}): must be "
                          f"> max_event_bytes ({s.max_event_bytes}) -- it disconnects the "
                          f"peer, so it is a memory guard above the event limit, got "
                          f"{s.zmq_max_msg_bytes}")
    if s.spool_fsync_batch_delay > 0.1:
        raise ConfigError(f"spool_fsync_batch_delay ({s.source_label('spool_fsync_batch_delay')}):"
                          f" must be at most 100ms (every 202 waits for it), got "
                          f"{s.spool_fsync_batch_delay:g} s")
    if s.ingest_max_bytes < 64 * 1024:
        raise ConfigError(f"ingest_max_bytes ({s.source_label('ingest_max_bytes')}): must be "
                          f">= 64KiB, got {s.ingest_max_bytes}")
    if not s.pull_port and not s.router_port:
        raise ConfigError("pull_port/router_port: at least one input port must be on")
