"""Reliable outputs: build them from URLs and keep them running.

Each configured output URL becomes one :class:`OutputSupervisor` in the relay's
nursery.  The supervisor owns the output's spool reader; when the output task
crashes (an exception that is not cancellation) it is logged, counted and
restarted after an exponential backoff with jitter, from the output's
acknowledged cursor (``reader.rewind()``), without disturbing the relay or the
other outputs.  Network errors never reach the supervisor: the outputs
reconnect internally; a crash here means a bug or a resource error.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs

import trio

from ..config import ConfigError, Settings
from ..fdreserve import out_of_fds
from ..ratelimit import RateLimitedLog

log = logging.getLogger("logjam_relay.outputs")

_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class OutputSpec:
    name: str           # stable: the spool cursor is stored under this name
    scheme: str
    url: str


def output_name(url: str) -> str:
    """The ``name=`` query parameter, else ``<scheme>-<hosts>`` (stable across reorderings)."""
    scheme, _, rest = url.partition("://")
    netloc, _, query = rest.partition("?")
    given = parse_qs(query).get("name")
    if given:
        name = given[-1]
        if _NAME_CHARS.search(name):
            raise ValueError(f"output {url!r}: name {name!r} may only use A-Z a-z 0-9 _ . -")
        return name
    hosts = _NAME_CHARS.sub("_", netloc.rstrip("/")).strip("_")
    return f"{scheme.lower()}-{hosts}"[:100]


def parse_outputs(urls: list[str]) -> list[OutputSpec]:
    """Validate output URLs (without connecting); raises ValueError naming the bad URL."""
    specs = []
    seen: set[str] = set()
    for url in urls:
        scheme = url.partition("://")[0].lower()
        if scheme == "lumberjack":
            from .lumberjack import parse_url
        elif scheme == "courier":
            from .courier import parse_url
        else:
            raise ValueError(f"output {url!r}: unknown scheme {scheme!r} "
                             "(use lumberjack:// or courier://)")
        parse_url(url)   # validates every parameter, with messages naming it
        name = output_name(url)
        if name in seen:
            raise ValueError(f"output {url!r}: two outputs are named {name!r}; "
                             "add name=... to one of them")
        seen.add(name)
        specs.append(OutputSpec(name, scheme, url))
    return specs


def check_settings(s: Settings) -> None:
    """The output URLs, parsed at start: a ConfigError names the setting and its source."""
    if s.outputs:
        try:
            parse_outputs(s.outputs)
        except ValueError as e:
            raise ConfigError(f"outputs ({s.sources.get('outputs', 'default')}): {e}") from None


def make_output(spec: OutputSpec, reader, relay_host: str, *, dead_letters=None,
                max_event_bytes: int | None = None):
    """The output for ``spec``; ``dead_letters`` is the relay's
    :class:`~logjam_relay.deadletter.DeadLetterStore` (events over ``max_event_bytes``
    and events the receiver keeps refusing go there)."""
    if spec.scheme == "lumberjack":
        from .lumberjack import DEFAULT_MAX_EVENT_BYTES, LumberjackOutput, parse_url
        cfg = parse_url(spec.url)
        cfg = dataclasses.replace(cfg, name=spec.name)
        if "relay_host=" not in spec.url:
            cfg = dataclasses.replace(cfg, relay_host=relay_host)
        return LumberjackOutput(reader, cfg, dead_letters=dead_letters,
                                max_event_bytes=max_event_bytes or DEFAULT_MAX_EVENT_BYTES)
    if spec.scheme == "courier":
        from .courier import CourierOutput, parse_url
        cfg = parse_url(spec.url)
        cfg = dataclasses.replace(cfg, name=spec.name)
        if "hostname=" not in spec.url:
            cfg = dataclasses.replace(cfg, hostname=relay_host)
        if max_event_bytes:
            cfg = dataclasses.replace(cfg, max_event_bytes=min(cfg.max_event_bytes,
                                                               max_event_bytes))
        return CourierOutput(cfg, reader, dead_letters=dead_letters)
    raise ValueError(f"unknown output scheme {spec.scheme!r}")  # pragma: no cover


#: the longest wait between starts of an output that could not start for want of file
#: descriptors (s): that lasts only as long as the shortage, and a try costs a failed
#: socketpair -- the crash backoff (up to ``backoff_max``) left an output stopped for up to
#: a minute after descriptors were free again
FD_RETRY_MAX = 1.0


class OutputSupervisor:
    """Runs one output; restarts it with backoff when it crashes (briefly, and without
    growing the crash backoff, when it could not start for want of file descriptors)."""

    def __init__(self, spec: OutputSpec, reader, factory: Callable[[], object], *,
                 backoff_min: float = 0.5, backoff_max: float = 60.0,
                 retry_budget: float = 60.0):
        self.spec = spec
        self.name = spec.name
        self.reader = reader
        self.factory = factory
        self.backoff_min = backoff_min
        self.backoff_max = backoff_max
        self.retry_budget = retry_budget
        self.output = None
        self.crashes = 0
        self.starts = 0
        self.last_error = ""
        self.started_at = time.monotonic()
        self._stop = False
        self._rlog = RateLimitedLog(log)

    async def run(self) -> None:
        failures = fd_failures = 0
        while not self._stop:
            self.output = self.factory()
            self.starts += 1
            t0 = time.monotonic()
            try:
                await self.output.run()
                if self._stop:
                    return
                failures = fd_failures = 0   # a normal return without a stop request: start again
            except (KeyboardInterrupt, trio.Cancelled):
                raise
            except Exception as e:  # a crashed output must not take the relay down
                self.crashes += 1
                self.last_error = f"{type(e).__name__}: {e}"
                if time.monotonic() - t0 > 60:
                    failures = 0
                if out_of_fds(e):           # starting it needs descriptors: no traceback
                    fd_failures += 1
                    delay = min(FD_RETRY_MAX, self.backoff_min * 2 ** min(fd_failures - 1, 8))
                    delay *= random.uniform(0.5, 1.0)
                    self._rlog.error("emfile", "output %s could not start (%d so far): %s; "
                                     "retrying in %.1fs", self.name, self.crashes, e, delay)
                else:
                    fd_failures = 0
                    failures += 1
                    delay = min(self.backoff_max, self.backoff_min * 2 ** (failures - 1))
                    delay *= random.uniform(0.5, 1.0)
                    log.exception("output %s crashed (%d so far); restarting in %.1fs",
                                  self.name, self.crashes, delay)
                await trio.sleep(delay)
            try:
                self.reader.rewind()
            except Exception:  # pragma: no cover - rewinding a reader does not fail
                log.exception("output %s: rewind failed", self.name)

    async def stop(self, timeout: float) -> None:
        """Graceful stop: let the output finish what is in flight (if it can), then cancel."""
        self._stop = True
        out = self.output
        if out is not None and hasattr(out, "request_shutdown"):
            out.request_shutdown()

    def stats(self) -> dict:
        d = dict(self.output.stats()) if self.output is not None else {}
        try:
            r = self.reader.stats()
        except Exception:  # pragma: no cover
            r = {}
        d["spool"] = r
        d["crashes"] = self.crashes
        d["starts"] = self.starts
        return d

    def readiness_problem(self) -> str | None:
        """Not ready when the output has never connected within its retry budget."""
        st = self.output.stats() if self.output is not None else {}
        if st.get("connected"):
            self.started_at = time.monotonic()
            return None
        if time.monotonic() - self.started_at > self.retry_budget:
            return f"output {self.name} not connected for more than {self.retry_budget:.0f}s"
        return None
