"""The relay's whole configuration: the settings, then the check each subsystem owns.

``config.load`` (the configuration layer) reads the sources (defaults < TOML file <
environment < flags), converts the values and checks what the settings table alone can
tell (ports, sizes).  It knows nothing of the subsystems: the values a subsystem owns
are checked by that subsystem's ``check_settings(settings)``, listed in :data:`CHECKS`
and run here, in the composition root: by ``logjam-relay`` (and ``--check-config``)
right after loading, and by :func:`logjam_relay.relay.service.build` for a relay built
in-process.  Each raises a :class:`~logjam_relay.config.ConfigError` whose text is the
one line ``setting (source): cause`` that the command prints.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .. import config
from ..config import Settings
from ..health import cmdp, webconfig
from ..inputs import spec as inputs
from ..io import curve
from ..outputs import supervisor as outputs
from ..samwise import config as samwise

#: the subsystems' checks, in the order they run (the first error stops start-up)
CHECKS = (
    samwise.check_settings,         # samwise_rpc_allow, samwise, amqp_brokers
    outputs.check_settings,         # outputs
    curve.check_settings,           # curve_secret_key, curve_allow_dir, curve_sockets, ...
    webconfig.check_settings,       # web_config_file
    inputs.check_settings,          # inputs
)


def check_settings(settings: Settings) -> None:
    """Run every subsystem's check; the first ConfigError stops start-up."""
    for check in CHECKS:
        check(settings)


def load(args: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
         config_file: str | os.PathLike | None = None) -> Settings:
    """:func:`logjam_relay.config.load`, then :func:`check_settings`."""
    settings = config.load(args, environ=environ, config_file=config_file)
    check_settings(settings)
    return settings


def subsystem_values(settings: Settings) -> dict[str, Any]:
    """What a subsystem makes of an unset setting (``--check-config`` prints it beside the
    settings' own ``resolved_*`` values): the CMDP sender's name."""
    out: dict[str, Any] = {}
    try:
        out["cmdp_name"] = cmdp.canonical_name(settings.cmdp_name)
    except ValueError:
        pass                        # an invalid name stops start-up (CMDPConfig.validate)
    return out
