#!/usr/bin/env bash
# The README's two operator steps, verbatim, on a fresh minimal Debian 12 image, as root
# and as a user with sudo.  Not part of the test suite: it downloads Debian packages and the
# relay's dependencies from PyPI (a few minutes).  Needs root, podman (runc) and debootstrap
# (what .ci/run installs) and the developer's venv (.venv/dev): the base image is the one
# tests/test_container.py makes (debootstrap --variant=minbase bookworm, cached in
# /var/tmp/logjam-relay-tests and podman's store).
#
#   bash .ci/fresh-debian.sh [root|user]...        (default: both)
#
# In a new container of that image, for each mode:
#   root: the prerequisite line (from the README, as written) in a root shell; then the
#         clone (git clone of a bundle of HEAD) and `./run-relay` (as written);
#   user: as root, first what "a user with sudo" means (apt-get install sudo, a user `op`
#         with NOPASSWD sudo); then as `op`: the prerequisite line, the clone, `./run-relay`.
# `./run-relay` runs in the background; the check is that it installs, starts, and answers
# GET /metrics on 8082 with logjam-device's families, that `./run-relay send --ping` gets its
# pong, then that it stops on SIGTERM with status 0 and logs `relay stopped at sequence N`.
# The container shares the host's network (PyPI, the Debian mirror): logjam-device's ports
# 9604-9606, 9621 and 8082 must be free on the host.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
modes=("$@")
[ "${#modes[@]}" -gt 0 ] || modes=(root user)

log() { printf '[fresh-debian] %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { log "needs root (podman's network and debootstrap)"; exit 2; }
for p in 9604 9605 9606 9621 8082; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
        log "port $p is in use on this host: the relay in the container needs it"; exit 2
    fi
done

# the README's prerequisite line, as written
prereq=$(.venv/dev/bin/python - <<'EOF'
import re
text = open("README.md").read()
setup = text.split("## Set-up on a fresh machine", 1)[1].split("**Operator", 1)[0]
print([ln[4:] for ln in setup.splitlines() if ln.startswith("    ")][0])
EOF
)
log "prerequisite line: $prereq"

base=$(cd tests && "$ROOT/.venv/dev/bin/python" -c '
import test_container
print(test_container._base_image())')
log "base image: $base"
# explicit rlimits no higher than ours, as tests/test_container.py does (podman's default
# nofile 1048576 needs CAP_SYS_RESOURCE); the default runtime, else runc
nofile=$(ulimit -Hn); [ "$nofile" = unlimited ] || [ "$nofile" -gt 16384 ] && nofile=16384
nproc=$(ulimit -Hu); [ "$nproc" = unlimited ] || [ "$nproc" -gt 4096 ] && nproc=4096
limits=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")
runtime=()
if ! podman run --rm "${limits[@]}" "$base" true >/dev/null 2>&1; then runtime=(--runtime runc); fi

work=$(mktemp -d /var/tmp/logjam-relay-fresh-XXXXXX)
trap 'rm -rf "$work"' EXIT
git bundle create "$work/logjam-relay.bundle" HEAD >/dev/null 2>&1
chmod 755 "$work"; chmod 644 "$work/logjam-relay.bundle"
# pip behind this machine's TLS-inspecting proxy, if any, trusts what the host trusts
ca=()
for c in "${PIP_CERT:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
    if [ -n "$c" ] && [ -f "$c" ]; then ca=(-v "$c:/host-ca.pem:ro" -e PIP_CERT=/host-ca.pem); break; fi
done

# what runs in the container: $1 = the prerequisite line; as whoever runs it
cat > "$work/operator.sh" <<'EOF'
set -eu
cd "$HOME"
echo "--- $(id -un): the prerequisite line"
sh -c "$1"
echo "--- $(id -un): clone, ./run-relay"
git clone -q /fresh/logjam-relay.bundle logjam-relay
cd logjam-relay
start=$(date +%s)
./run-relay > "$HOME/relay.log" 2>&1 &
pid=$!
ok=""
for _ in $(seq 1 900); do
    if python3 - <<'PY' 2>/dev/null
import urllib.request, sys
t = urllib.request.urlopen("http://127.0.0.1:8082/metrics", timeout=2).read().decode()
sys.exit(0 if "logjam:device:msgs_received_total" in t else 1)
PY
    then ok=1; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 1
done
echo "--- relay log:"; cat "$HOME/relay.log"
[ -n "$ok" ] || { echo "FAILED: no /metrics from ./run-relay"; exit 1; }
echo "--- /metrics answered $(( $(date +%s) - start )) s after ./run-relay (install included)"
python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:8082/metrics").read().decode().count("\n"), "lines of /metrics")'
# the README: "./run-relay SUBCOMMAND ... runs the operator tools"
echo "--- ./run-relay send --ping: $(./run-relay send --ping)"
./run-relay send --ping | grep -q '^ping 200 OK ' || { echo "FAILED: no pong"; exit 1; }
kill -TERM $pid          # run-relay execs logjam-relay: the same process
wait $pid && rc=0 || rc=$?
echo "--- ./run-relay exited with $rc after SIGTERM: $(grep -o 'relay stopped at sequence [0-9]*' "$HOME/relay.log")"
du -sh .venv/relay
[ "$rc" = 0 ]
# the README's Stop: "logs `relay stopped at sequence N`"
grep -q 'relay stopped at sequence [0-9]' "$HOME/relay.log" || { echo "FAILED: no stop line"; exit 1; }
EOF

status=0
for mode in "${modes[@]}"; do
    log "=== $mode"
    if [ "$mode" = root ]; then
        cmd='sh /fresh/operator.sh "$PREREQ"'
    else
        cmd='set -e; apt-get update -qq && apt-get install -y -qq sudo passwd >/dev/null
             useradd -m -s /bin/bash op && echo "op ALL=(ALL) NOPASSWD:ALL" > /etc/sudoers.d/op
             command -v sudo
             sudo -u op -H env PIP_CERT="${PIP_CERT:-}" sh /fresh/operator.sh "$PREREQ"'
    fi
    if podman run --rm "${runtime[@]}" "${limits[@]}" --network host "${ca[@]}" -v "$work:/fresh:ro" \
            -e PREREQ="$prereq" "$base" \
            bash -c "$cmd"; then
        log "=== $mode: OK"
    else
        log "=== $mode: FAILED"; status=1
    fi
done
exit $status
