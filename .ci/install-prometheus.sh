#!/bin/sh
# Install the Prometheus server (Debian package `prometheus`) when it is missing.
# Idempotent: does nothing when a `prometheus` binary is already on PATH.
# Called by .ci/run before the test suite (tests/test_grafana_prometheus.py needs it).
set -eu

if command -v prometheus >/dev/null 2>&1; then
    echo "install-prometheus: $(command -v prometheus) already installed"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

# The package's maintainer scripts would start a system-wide Prometheus on :9090
# (where an init system or invoke-rc.d runs). Tests start their own instance on an
# ephemeral port, so forbid service starts during the install unless the machine
# already has a policy of its own.
POLICY=/usr/sbin/policy-rc.d
ADDED_POLICY=""
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod 755 "$POLICY"
    ADDED_POLICY=1
fi
cleanup() { if [ -n "$ADDED_POLICY" ]; then $SUDO rm -f "$POLICY"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y prometheus

if ! command -v prometheus >/dev/null 2>&1; then
    echo "install-prometheus: prometheus is not on PATH after the install" >&2
    exit 1
fi
echo "install-prometheus: installed $(command -v prometheus)"
