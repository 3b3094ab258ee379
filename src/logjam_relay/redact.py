"""Secrets never printed: redaction for ``--check-config``, log lines and CMDP LOG records.

* :func:`redact_text` replaces the password of every ``scheme://user:password@host`` URL
  and the value of ``password=`` / ``secret=`` / ``token=`` query parameters with ``***``;
* :func:`redact_setting` does that for one setting's value and prints settings whose name
  says they hold a secret (``*password*``, ``*token*``, not ``*_file``) as ``***``;
* :func:`install_log_redaction` installs a log-record factory that formats each record's
  message once and redacts it, so every handler (stderr, JSON, the CMDP LOG handler) sees
  the redacted text.  Idempotent.

Credentials should come from files (``amqp_brokers_file``, ``password_file=`` in a broker
URL) rather than the command line, which ``ps`` shows; see ``docs/security.md``.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

MASK = "***"

# scheme://user:password@  ->  scheme://user:***@
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s'\"]*):(?P<pw>[^\s'\"/]*)@")
# ?password=...&  or  &secret=...
_QUERY_SECRET = re.compile(r"(?P<head>[?&;](?:password|passwd|pass|secret|token|api_key)=)"
                           r"(?P<pw>[^&\s'\"]*)", re.I)
_SECRET_NAME = re.compile(r"password|passwd|token|secret_value", re.I)


def redact_text(text: str) -> str:
    """``text`` with URL passwords and secret query parameters replaced by ``***``."""
    if "@" not in text and "=" not in text:
        return text
    text = _URL_PASSWORD.sub(lambda m: f"{m.group('head')}:{MASK}@", text)
    return _QUERY_SECRET.sub(lambda m: m.group("head") + MASK, text)


def _redact_any(v: Any) -> Any:
    if isinstance(v, str):
        return redact_text(v)
    if isinstance(v, list):
        return [_redact_any(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_redact_any(x) for x in v)
    if isinstance(v, dict):
        return {k: _redact_any(x) for k, x in v.items()}
    return v


def redact_setting(name: str, value: Any) -> Any:
    """The value of setting ``name`` as it may be printed."""
    if value and _SECRET_NAME.search(name) and not name.endswith(("_file", "_dir")):
        return MASK
    return _redact_any(value)


_installed = False


def install_log_redaction() -> None:
    """Redact every log record created from now on (all loggers, all handlers)."""
    global _installed
    if _installed:
        return
    _installed = True
    old = logging.getLogRecordFactory()

    busy = threading.local()

    def factory(*args, **kwargs):
        record = old(*args, **kwargs)
        if getattr(busy, "on", False):
            # created while an argument of another record is formatted (its __str__ logs):
            # formatting this one too would recurse; its format string alone, redacted
            record.msg = redact_text(str(record.msg))
            record.args = None
            return record
        busy.on = True
        try:
            msg = record.getMessage()
        except Exception:       # a broken format string: leave it to the handler
            return record
        finally:
            busy.on = False
        red = redact_text(msg)
        if red is not msg or record.args:
            record.msg = red
            record.args = None
        return record

    logging.setLogRecordFactory(factory)


def redact_exceptions(formatter: logging.Formatter) -> logging.Formatter:
    """Make ``formatter`` redact the tracebacks it formats too (the record factory only sees
    the message; an exception's text may quote a URL with its password)."""
    orig = formatter.formatException
    formatter.formatException = lambda ei: redact_text(orig(ei))     # type: ignore[method-assign]
    return formatter
