#!/usr/bin/env bash
# boot.sh NAME — boots the host's systemd as PID 1 of a private PID/mount/UTS/IPC/cgroup namespace
# on a copy-on-write overlay of /, for agentgate's unit tests on machines whose PID 1 is not
# systemd. Prints systemd's host PID once the manager is running (or degraded).
#
#   AGTEST_STATE=/tmp/agentgate-systemd   where NAME/{pid,launcher.pid,cgroup,console.log} live
#   AGTEST_SHARE=dir1:dir2                host directories bind-mounted at the same path inside
#
# Nothing written inside reaches the host: the root is an overlay with a tmpfs upper layer, and
# /run, /tmp and the journal are private tmpfs mounts.
set -euo pipefail
NAME=${1:?usage: boot.sh NAME}
[[ $NAME =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "boot.sh: bad name $NAME" >&2; exit 2; }
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STATE=${AGTEST_STATE:-/tmp/agentgate-systemd}/$NAME
[[ $EUID -eq 0 ]] || { echo "boot.sh: needs root" >&2; exit 2; }
[[ -x /lib/systemd/systemd ]] || { echo "boot.sh: systemd is not installed" >&2; exit 2; }
rm -rf "$STATE"; mkdir -p "$STATE"

# A cgroup2 subtree of our own, so concurrent instances never share system.slice cgroups.
if [[ $(stat -fc %T /sys/fs/cgroup) == cgroup2fs ]]; then CGROOT=/sys/fs/cgroup
elif [[ $(stat -fc %T /sys/fs/cgroup/unified 2>/dev/null) == cgroup2fs ]]; then CGROOT=/sys/fs/cgroup/unified
else echo "boot.sh: no cgroup2 hierarchy" >&2; exit 2; fi
CG=$CGROOT/agtest-$NAME
[[ -d $CG ]] && find "$CG" -depth -type d -exec rmdir {} + 2>/dev/null || true
mkdir -p "$CG"; echo "$CG" > "$STATE/cgroup"

setsid bash -c '
  echo $$ > "$1/cgroup.procs"
  exec unshare --pid --fork --mount --uts --ipc --cgroup --propagation private --mount-proc "$2/inner.sh" "$3" "$4"
' agtest-launch "$CG" "$HERE" "$STATE" "$NAME" </dev/null >"$STATE/console.log" 2>&1 &
LAUNCHER=$!
echo "$LAUNCHER" > "$STATE/launcher.pid"

PID=
for _ in $(seq 1 100); do
  kill -0 "$LAUNCHER" 2>/dev/null || { echo "boot.sh: launcher died:" >&2; cat "$STATE/console.log" >&2; exit 1; }
  kids=$(cat "/proc/$LAUNCHER/task/$LAUNCHER/children" 2>/dev/null || true)
  if [[ -n ${kids// /} ]]; then
    PID=${kids%% *}
    [[ $(cat "/proc/$PID/comm" 2>/dev/null) == systemd ]] && break
  fi
  sleep 0.1
done
[[ -n $PID && $(cat "/proc/$PID/comm" 2>/dev/null) == systemd ]] || {
  echo "boot.sh: systemd did not start:" >&2; cat "$STATE/console.log" >&2; exit 1; }
echo "$PID" > "$STATE/pid"

deadline=$(( $(date +%s) + 90 ))
while (( $(date +%s) < deadline )); do
  state=$(timeout 5 nsenter -t "$PID" -m -p -u -i -- systemctl is-system-running 2>/dev/null || true)
  case $state in running|degraded) echo "$PID"; exit 0;; esac
  kill -0 "$PID" 2>/dev/null || { echo "boot.sh: systemd exited:" >&2; cat "$STATE/console.log" >&2; exit 1; }
  sleep 0.2
done
echo "boot.sh: systemd did not reach running" >&2; tail -n 40 "$STATE/console.log" >&2; exit 1
