"""Lumberjack and Courier inputs: other relays (or Beats, log-courier) send into this one.

``--input lumberjack://0.0.0.0:5044?tls=on&cert=...&key=...`` and
``--input courier://0.0.0.0:5043?tls=off``.  Each input is a TCP/TLS listener in the
relay's nursery; the protocol work is in the sans-IO cores
(:mod:`logjam_relay.protocols.lumberjack_server`, :mod:`logjam_relay.protocols.courier_server`),
the event mapping in :mod:`.mapping`.  A window (Lumberjack) or payload (Courier) is
acknowledged only after the relay stamped, published and spooled its events
(:meth:`logjam_relay.relay.app.Relay.ingest_external`): at-least-once across a chain.
See ``docs/inputs.md``.
"""

from __future__ import annotations

from .spec import (  # noqa: F401
    DEFAULT_PORTS,
    InputSpec,
    check_settings,
    parse_input,
    parse_inputs,
)


def make_input(spec: InputSpec, relay):
    if spec.scheme == "lumberjack":
        from .lumberjack import LumberjackInput
        return LumberjackInput(spec, relay)
    from .courier import CourierInput
    return CourierInput(spec, relay)
