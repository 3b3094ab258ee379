#!/bin/sh
# Install the two Prometheus binaries the tests use, `prometheus` and `promtool`, when
# either is missing: taken from Debian's `prometheus` package (downloaded, not installed),
# into /usr/local/bin.  Nothing else: no node-exporter or its collectors (smartmontools,
# nvme-cli, ipmitool... which the package recommends), no web assets, no prometheus user,
# no service enabled or started.  Both binaries are static Go programs (libc only).
# Idempotent: does nothing when both are on PATH.  Called by .ci/run before the test suite
# (tests/test_grafana_prometheus.py: prometheus; tests/test_deploy.py: promtool).
set -eu

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    echo "install-prometheus: $(command -v prometheus) and $(command -v promtool) already installed"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# apt downloads as its sandbox user _apt where root runs it: let _apt write here
if [ "$(id -u)" -eq 0 ] && id _apt >/dev/null 2>&1; then chown _apt "$work"; fi
$SUDO apt-get update -qq
(cd "$work" && apt-get download -qq prometheus)
dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
$SUDO install -m 0755 "$work/root/usr/bin/prometheus" "$work/root/usr/bin/promtool" /usr/local/bin/

for b in prometheus promtool; do
    if ! command -v "$b" >/dev/null 2>&1; then
        echo "install-prometheus: $b is not on PATH after the install (/usr/local/bin?)" >&2
        exit 1
    fi
done
echo "install-prometheus: installed $(prometheus --version 2>&1 | head -n 1) and promtool into /usr/local/bin"
