#!/usr/bin/env bash
# Per-call cost of running a sandboxed call in a unit of its own (agentgate-tool@.service)
# against starting the same bubblewrap sandbox directly, under a real systemd (the test
# harness's namespace; root only). Results: docs/benchmarks.md, "Tool units".
#
#   CALLS=200 bench/tool-units.sh      (BIN: the agentgate binary, release by default)
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=${BIN:-$REPO/target/release/agentgate}
CALLS=${CALLS:-200}
NAME=bench-units-$$
STATE=$(mktemp -d /var/tmp/bench-units.XXXXXX)
export AGTEST_STATE=$STATE AGTEST_SHARE="$REPO:$(dirname "$BIN")"
"$REPO/tests/systemd/boot.sh" "$NAME" > /dev/null
trap '"$REPO/tests/systemd/stop.sh" "$NAME" > /dev/null 2>&1 || true; rm -rf "$STATE"' EXIT
ns() { "$REPO/tests/systemd/ns.sh" "$NAME" sh -c "$1"; }
ns "set -e
install -m 0755 $BIN /usr/bin/agentgate
install -m 0644 $REPO/packaging/agentgate.sysusers /usr/lib/sysusers.d/agentgate.conf
systemd-sysusers agentgate.conf
install -m 0644 $REPO/systemd/agentgate-tool.socket '$REPO/systemd/agentgate-tool@.service' /etc/systemd/system/
install -D -m 0640 -g _agentgate $REPO/packaging/agentgate.toml /etc/agentgate/agentgate.toml
systemctl daemon-reload
systemctl start agentgate-tool.socket"
# As the service's user in a unit named agentgate.service (a tool unit admits no other caller),
# with a /proc of its own (a shell entered from outside, under the harness's covered /proc, may
# not mount a fresh one).
ns "systemd-run --quiet --wait --pipe --unit=agentgate.service --uid=_agentgate --gid=_agentgate -p WorkingDirectory=/ -p ProtectProc=invisible -p PrivateMounts=yes python3 $REPO/bench/tool-units.py $CALLS"
