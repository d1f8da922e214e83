#!/usr/bin/env bash
# Accept-path benchmark: reproduces the "Durable accept" figures in docs/benchmarks.md.
#
#   bench/accept.sh                                   # this checkout's release build, 3 runs
#   BINS="/tmp/before/agentgate ./target/release/agentgate" bench/accept.sh
#                                                     # builds side by side: each run measures
#                                                     # every build in turn, then the peer
#   RUNS=1 PHASE_SECONDS=5 IDLE_SECONDS=10 bench/accept.sh
#   EXTRA_CONFIG=$'[telemetry]\notlp_endpoint = "http://127.0.0.1:9"' bench/accept.sh
#                                                     # appended to the daemon's config
#
# The accept path on its own: a `verify = none` route on loopback, `deliver = log`, a command
# model that never answers and `max_concurrent_turns = 1`, so that accepted events stay queued
# (turns are measured by benches/turns.rs). Durable as always: SQLite with synchronous=FULL, and
# a 2xx only once the commit that holds the event returned. Per run, for each build, every phase
# on a fresh state directory:
#   1. idle RSS one second after start;
#   2. empty queue: wrk (2 threads, 64 connections, PHASE_SECONDS, 1 KiB JSON bodies): 2xx
#      answers per second, and the daemon's CPU time (user + system, /proc/PID/stat) per
#      accepted event;
#   3. the ceiling: GET /healthz under the same wrk load, against the same daemon;
#   4. deep backlog: 100,000 queued events (one per session, as the load makes them) written
#      into the stopped daemon's database in one transaction; the daemon at rest for
#      IDLE_SECONDS (its CPU share of one core), then the load of phase 2;
#   5. fdatasync per accepted event: strace -c on the daemon during 10 s of the same load;
#   6. latency at a fixed 1,000 requests/s (open loop, benches/loadgen.rs);
# and once per run the peer, Debian's `webhook` (adnanh/webhook), under the load of phase 2:
# answering without writing anything, and answering after an fsync'd append of the payload.
# Needs: wrk, webhook, strace, sqlite3, python3 (installed with apt-get if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
PHASE_SECONDS=${PHASE_SECONDS:-10}
IDLE_SECONDS=${IDLE_SECONDS:-20}
BACKLOG=${BACKLOG:-100000}
PORT=${PORT:-18787}
PEER_PORT=${PEER_PORT:-18788}

for tool in wrk webhook strace sqlite3; do
    command -v "$tool" >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk webhook strace sqlite3 >/dev/null; break; }
done
if [ -z "${BINS:-}" ]; then
    cargo build --release --locked -q
    BINS=./target/release/agentgate
fi
cargo bench --locked -q --bench loadgen --no-run 2>/dev/null
loadgen() { cargo bench --locked -q --bench loadgen -- "$@"; }

work=$(mktemp -d /var/tmp/agentgate-bench.XXXXXX)
trap 'pkill -f "$work" 2>/dev/null || true; rm -rf "$work"' EXIT
. bench/accept-setup.sh
accept_setup "$work" "$PORT"
cat > "$work/hooks.json" <<JSON
[
  {"id": "nowrite", "execute-command": "/bin/true", "response-message": "ok"},
  {"id": "durable", "execute-command": "$work/durable.sh", "include-command-output-in-response": true,
   "pass-arguments-to-command": [{"source": "entire-payload"}]}
]
JSON
cat > "$work/durable.sh" <<SH
#!/bin/sh
printf '%s\n' "\$1" >> "$work/peer.log" && sync "$work/peer.log" && echo ok
SH
chmod +x "$work/durable.sh"

# Successful (2xx) answers per second of a wrk run of $1 seconds against URL $2 (a refusal is
# not an accepted webhook); $3: the wrk script, if any.
wrk_rate() {
    wrk -t2 -c64 -d"$1"s ${3:+-s "$3"} "$2" | awk '
        / requests in / {total = $1; secs = $4; sub(/s,?$/, "", secs)}
        /Non-2xx/ {refused = $NF; print "NON2XX " $0 > "/dev/stderr"}
        END {if (secs > 0) print int((total - refused) / secs); else print 0}'
}
rss_kib() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
# CPU time (user + system) of a process, in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
ticks_per_second=$(getconf CLK_TCK)
count_events() { sqlite3 "$work/state/agentgate.db" "SELECT count(*) FROM events"; }

start_agentgate() { # binary
    "$1" serve --config "$work/agentgate.toml" 2>"$work/agentgate.log" &
    pid=$!
    until curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null; do sleep 0.05; done
}
stop_agentgate() { kill -TERM "$pid"; wait "$pid" || true; }

# The load of phase 2 against the running daemon: "accepted/s µs-per-event".
accept_load() {
    local before_ticks before_events after_ticks after_events rate
    before_events=$(count_events)
    before_ticks=$(cpu_ticks "$pid")
    rate=$(wrk_rate "$PHASE_SECONDS" "http://127.0.0.1:$PORT/hooks/bench" "$work/post.lua")
    after_ticks=$(cpu_ticks "$pid")
    after_events=$(count_events)
    python3 -c "print($rate, round(($after_ticks - $before_ticks) / $ticks_per_second * 1e6 / max(1, $after_events - $before_events)))"
}

measure() { # binary -> one line of figures
    local bin=$1 idle_rss empty health idle_ticks backlog syncs before after per_event latency
    rm -rf "$work/state"
    start_agentgate "$bin"
    sleep 1
    idle_rss=$(rss_kib "$pid")
    empty=$(accept_load)
    health=$(wrk_rate "$PHASE_SECONDS" "http://127.0.0.1:$PORT/healthz")
    stop_agentgate

    rm -rf "$work/state"
    start_agentgate "$bin"
    stop_agentgate
    sqlite3 "$work/state/agentgate.db" < "$work/backlog.sql"
    start_agentgate "$bin"
    sleep 3
    idle_ticks=$(cpu_ticks "$pid")
    sleep "$IDLE_SECONDS"
    idle_ticks=$(( $(cpu_ticks "$pid") - idle_ticks ))
    backlog=$(accept_load)
    stop_agentgate

    rm -rf "$work/state"
    start_agentgate "$bin"
    before=$(count_events)
    strace -f -c -e trace=fdatasync,fsync -o "$work/strace.txt" -p "$pid" &
    local tracer=$!
    sleep 0.5
    wrk_rate 10 "http://127.0.0.1:$PORT/hooks/bench" "$work/post.lua" >/dev/null
    kill -INT "$tracer"; wait "$tracer" 2>/dev/null || true
    after=$(count_events)
    syncs=$(awk '$NF ~ /^(fdatasync|fsync)$/ {s += $4} END {print s + 0}' "$work/strace.txt")
    per_event=$(python3 -c "print(f'{$syncs / max(1, $after - $before):.4f}')")
    stop_agentgate

    rm -rf "$work/state"
    start_agentgate "$bin"
    latency=$(loadgen --addr "127.0.0.1:$PORT" --path /hooks/bench --body "$work/body.json" \
        --rate 1000 --connections 64 --seconds "$PHASE_SECONDS")
    stop_agentgate
    python3 - "$empty" "$backlog" "$health" "$idle_ticks" "$idle_rss" "$per_event" "$latency" <<PY
import json, sys
empty, backlog = (s.split() for s in sys.argv[1:3])
health, idle_ticks, idle_rss, per_event, latency = sys.argv[3:8]
latency = json.loads(latency)
idle_share = int(idle_ticks) / $ticks_per_second / $IDLE_SECONDS * 100
print("\t".join(map(str, [empty[0], empty[1], backlog[0], backlog[1], health,
    f"{int(empty[0]) / int(health):.2f}", f"{idle_share:.1f}", idle_rss, per_event,
    latency["p50_ms"], latency["p99_ms"]])))
PY
}

# A fresh peer process per phase: "nowrite" leaves its /bin/true spawns running after the
# answers, which would otherwise slow the next phase.
peer_run() {
    webhook -hooks "$work/hooks.json" -ip 127.0.0.1 -port "$PEER_PORT" >/dev/null 2>&1 &
    local peer=$!
    until curl -fs -o /dev/null "http://127.0.0.1:$PEER_PORT/"; do sleep 0.05; done
    wrk_rate "$PHASE_SECONDS" "http://127.0.0.1:$PEER_PORT/hooks/$1" "$work/post.lua"
    kill "$peer"; wait "$peer" 2>/dev/null || true
    sleep 2
}

printf 'run\tbuild\taccepts_per_s\tcpu_us_per_event\tbacklog_accepts_per_s\tbacklog_cpu_us_per_event\thealthz_per_s\tratio_to_healthz\tidle_cpu_pct_with_backlog\tidle_rss_kib\tfdatasync_per_event\tp50_ms\tp99_ms\n'
for run in $(seq 1 "$RUNS"); do
    for bin in $BINS; do
        printf '%s\t%s\t%s\n' "$run" "$bin" "$(measure "$bin")"
    done
    printf '%s\tpeer webhook: without writing %s/s, after an fsync'"'"'d append %s/s\n' \
        "$run" "$(peer_run nowrite)" "$(peer_run durable)"
done
