#!/usr/bin/env bash
# stop.sh NAME — powers off the namespace booted by boot.sh NAME (SIGKILL of its PID 1 after
# 20 s), then removes its cgroup and state. Signals only the PIDs boot.sh recorded.
set -uo pipefail
NAME=${1:?usage: stop.sh NAME}
STATE=${AGTEST_STATE:-/tmp/agentgate-systemd}/$NAME
[[ -d $STATE ]] || exit 0
PID=$(cat "$STATE/pid" 2>/dev/null || true)
alive() { [[ -n $1 ]] && kill -0 "$1" 2>/dev/null && [[ $(cat "/proc/$1/comm" 2>/dev/null) == systemd ]]; }
if alive "$PID"; then
  kill -s RTMIN+4 "$PID" 2>/dev/null || true
  for _ in $(seq 1 200); do alive "$PID" || break; sleep 0.1; done
  alive "$PID" && { kill -KILL "$PID" 2>/dev/null; sleep 0.5; }
fi
LAUNCHER=$(cat "$STATE/launcher.pid" 2>/dev/null || true)
for _ in $(seq 1 50); do [[ -n $LAUNCHER ]] && kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 0.1; done
CG=$(cat "$STATE/cgroup" 2>/dev/null || true)
[[ -n $CG && -d $CG ]] && find "$CG" -depth -type d -exec rmdir {} + 2>/dev/null
rm -rf "$STATE"
exit 0
