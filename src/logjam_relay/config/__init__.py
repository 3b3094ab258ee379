"""One configuration: defaults < TOML file < environment < command line.

Every setting has one canonical flat name (``spool_max_bytes``).  It is written

* in TOML either flat (``spool_max_bytes = "10GiB"``) or in a table
  (``[spool]`` / ``max_bytes = "10GiB"``),
* in the environment as ``LOGJAM_RELAY_SPOOL_MAX_BYTES`` (logjam-device's
  ``LOGJAM_RCV_HWM`` and ``LOGJAM_SND_HWM`` are honoured too),
* on the command line as ``--spool-max-bytes`` (plus logjam-device's short
  flags, e.g. ``-d 7``).

Values are validated at start; an error names the setting and where it came
from, e.g. ``spool_policy (LOGJAM_RELAY_SPOOL_POLICY): must be one of block,
drop_oldest, got 'keep'``.

The package: ``errors`` (ConfigError, StartupError), ``convert`` (value converters; the
units themselves are ``logjam_relay.units``), ``settings`` (the ``Settings`` table),
``load`` (sources and the checks between settings), ``helptext`` (values as operators
read them, for ``--help`` and ``--check-config``), ``logformat`` (the ``log_format`` of
every process: the relay and its output workers).
"""

from __future__ import annotations

from .convert import (  # noqa: F401
    boolean,
    choice,
    duration,
    integer,
    number,
    opt_string,
    port,
    size,
    string,
    string_list,
)
from .errors import (  # noqa: F401
    ConfigError,
    StartupError,
    find_exception,
)
from .load import (  # noqa: F401
    NON_SETTING_ENV,
    NON_SETTING_ENV_PREFIX,
    add_arguments,
    ineffective,
    load,
)
from .settings import (  # noqa: F401
    BY_NAME,
    SETTING_FIELDS,
    Settings,
    default_fqdn,
    opt,
)
