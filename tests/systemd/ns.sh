#!/usr/bin/env bash
# ns.sh NAME CMD... — runs CMD inside the namespace booted by boot.sh NAME.
set -euo pipefail
NAME=${1:?usage: ns.sh NAME CMD...}; shift
STATE=${AGTEST_STATE:-/tmp/agentgate-systemd}/$NAME
PID=$(cat "$STATE/pid")
exec nsenter -t "$PID" -m -p -u -i -- env -i TERM=dumb LANG=C.UTF-8 SYSTEMD_PAGER= SYSTEMD_COLORS=0 \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
