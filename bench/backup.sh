#!/usr/bin/env bash
# `agentgate backup` while the daemon writes: reproduces "Backup under load" in docs/benchmarks.md.
#
#   bench/backup.sh                          # a 180 MB database, 3 backups per phase
#   SIZE_MB=50 RUNS=1 bench/backup.sh
#   BACKUP_BIN=/path/to/older/agentgate bench/backup.sh
#                                            # the backups made by another build (another
#                                            # commit's binary), the daemon and load the same
#
# One daemon (this build, the replay model, fsync on) on a fresh state directory is filled to
# SIZE_MB with 64 KiB webhooks, whose turns then run. Then, per phase, RUNS backups, each timed:
#   idle    nothing arrives and no turn runs;
#   load    wrk posts 1 KiB webhooks on 64 connections throughout (every one a commit, and a turn
#           that commits its steps), as while a backlog drains under new webhooks.
# A backup that takes longer than TIMEOUT seconds is stopped and reported as ">TIMEOUT".
# Needs: wrk, sqlite3, curl, python3.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE_MB=${SIZE_MB:-180}
RUNS=${RUNS:-3}
TIMEOUT=${TIMEOUT:-300}
PORT=${PORT:-18797}

for tool in wrk sqlite3; do
    command -v "$tool" >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk sqlite3 >/dev/null; break; }
done
if [ -z "${BIN:-}" ]; then
    cargo build --release --locked -q
    BIN=./target/release/agentgate
fi
BACKUP_BIN=${BACKUP_BIN:-$BIN}

work=$(mktemp -d /var/tmp/agentgate-bench.XXXXXX)
trap 'pkill -f "$work" 2>/dev/null || true; rm -rf "$work"' EXIT
python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
for name, pad in (("big", 64 * 1024), ("small", 950)):
    body = json.dumps({"session": "bench-%s" % name, "pad": "x" * pad})
    open(f"{work}/{name}.lua", "w").write(
        'counter = 0\nrequest = function()\n  counter = counter + 1\n'
        '  local body = string.gsub(%s, "bench%%-", "s" .. (counter %% 500) .. "-")\n'
        '  return wrk.format("POST", nil, {["Content-Type"] = "application/json"}, body)\nend\n'
        % json.dumps(body))
PY
cat > "$work/agentgate.toml" <<TOML
state_dir = "$work/state"
[server]
listen = "127.0.0.1:$PORT"
[runtime]
max_queued_events = 100000000
[routes.bench]
path = "/hooks/bench"
verify = { scheme = "none" }
session = "{{ payload.session }}"
TOML
"$BIN" serve --config "$work/agentgate.toml" 2>"$work/agentgate.log" &
daemon=$!
until curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null; do sleep 0.05; done

database_mb() { echo $(( $(stat -c %s "$work/state/agentgate.db") / 1048576 )); }
queued() {
    "$BIN" status --json --config "$work/agentgate.toml" |
        python3 -c 'import json,sys; s=json.load(sys.stdin)["events"]["by_status"]; print(s.get("queued",0)+s.get("running",0))'
}
while [ "$(database_mb)" -lt "$SIZE_MB" ]; do
    wrk -t2 -c16 -d5s -s "$work/big.lua" "http://127.0.0.1:$PORT/hooks/bench" >/dev/null
done
until [ "$(queued)" -eq 0 ]; do sleep 1; done
echo "database: $(database_mb) MB, $(sqlite3 "$work/state/agentgate.db" "SELECT count(*) FROM events") events"

# Seconds one backup takes (">TIMEOUT" when stopped), checked by PRAGMA quick_check.
backup_seconds() {
    local target="$work/backup-$1"
    local start end
    start=$(date +%s.%N)
    if ! timeout "$TIMEOUT" "$BACKUP_BIN" backup "$target" --config "$work/agentgate.toml" >/dev/null 2>&1; then
        echo ">$TIMEOUT"; rm -rf "$target"; return
    fi
    end=$(date +%s.%N)
    [ "$(sqlite3 "$target/agentgate.db" 'PRAGMA quick_check')" = ok ] || { echo "backup $target is corrupt" >&2; exit 1; }
    rm -rf "$target"
    python3 -c "print(f'{$end - $start:.2f}')"
}

printf 'phase\trun\tseconds\tevents_accepted_meanwhile\n'
for run in $(seq 1 "$RUNS"); do
    printf 'idle\t%s\t%s\t0\n' "$run" "$(backup_seconds "idle-$run")"
done
wrk -t2 -c64 -d3600s -s "$work/small.lua" "http://127.0.0.1:$PORT/hooks/bench" >/dev/null &
load=$!
sleep 2
for run in $(seq 1 "$RUNS"); do
    before=$(sqlite3 "$work/state/agentgate.db" 'SELECT count(*) FROM events')
    seconds=$(backup_seconds "load-$run")
    after=$(sqlite3 "$work/state/agentgate.db" 'SELECT count(*) FROM events')
    printf 'load\t%s\t%s\t%s\n' "$run" "$seconds" "$((after - before))"
done
kill "$load"; wait "$load" 2>/dev/null || true
kill -TERM "$daemon"; wait "$daemon" || true
