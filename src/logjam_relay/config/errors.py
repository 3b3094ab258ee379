"""Configuration and start-up errors: each names the setting, its value and source."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A setting is invalid; the message names it and where it came from."""


class StartupError(Exception):
    """Something start-up needs cannot be had (a port, a directory, a file, a lock).

    Its text is the one line the command prints before it exits with status 2:
    ``pull_port 9605 (default): address already in use (is logjam-device still running?)``
    -- the setting, its value, where the value came from and the likely cause.
    """

    def __init__(self, setting: str, value: Any, source: str, cause: str):
        self.setting, self.value, self.source, self.cause = setting, value, source, cause
        super().__init__(f"{setting} {value} ({source}): {cause}")


def find_exception(exc: BaseException, kinds) -> BaseException | None:
    """The first exception of ``kinds`` in ``exc`` or inside its (nested) exception groups
    (trio wraps what a task raised in an ExceptionGroup)."""
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = find_exception(sub, kinds)
            if found is not None:
                return found
        return None
    return exc if isinstance(exc, kinds) else None
