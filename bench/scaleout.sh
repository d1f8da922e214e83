#!/usr/bin/env bash
# Scale-out benchmark: reproduces the "Scale-out on PostgreSQL" figures in docs/benchmarks.md.
#
#   bench/scaleout.sh                       # 3 runs of 20 s per node count, then failover runs
#   RUNS=1 PHASE_SECONDS=10 bench/scaleout.sh
#
# 1. Accepted webhooks/s with 1, 2 and 3 nodes sharing one local PostgreSQL 15 (fsync on,
#    synchronous_commit on, default settings). A load balancer's round robin is modelled by one
#    wrk per node (2 threads, 64 connections split evenly), so the total offered concurrency is
#    the same for every node count; the figure is the sum of the nodes' rates. Every accepted
#    event also runs as a turn (the replay model), as in production.
# 2. Failover time, kill -9 to the resumed turn's first model call, for several lease_ttl values:
#    tests/scaleout.rs's kill -9 scenario, run with SCALEOUT_LEASE_TTL set, which prints it.
# 3. One node with a deep backlog: accepted webhooks/s and the node's CPU per accepted event
#    with an empty queue and with BACKLOG (100,000) queued events written into the database
#    beforehand, and the node's CPU share at rest with that backlog. The node's model never
#    answers and runs one turn at a time, so that accepted events stay queued (as in
#    bench/accept.sh). BACKLOG_ONLY=1 runs this part alone.
# Needs: wrk, PostgreSQL 15 server binaries (installed with apt-get if missing). Runs as root
# (the server runs as the postgres user) or as an ordinary user.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
PHASE_SECONDS=${PHASE_SECONDS:-20}
PG_PORT=${PG_PORT:-15432}
BASE_PORT=${BASE_PORT:-18800}
LEASES=${LEASES:-"1s 2s 5s 10s"}
BACKLOG=${BACKLOG:-100000}
IDLE_SECONDS=${IDLE_SECONDS:-10}

command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }
[ -x /usr/lib/postgresql/15/bin/pg_ctl ] || apt-get install -y -qq postgresql-15 postgresql-client-15 >/dev/null
PG_BIN=/usr/lib/postgresql/15/bin
cargo build --release --locked -q

work=$(mktemp -d /var/tmp/agentgate-scaleout.XXXXXX)
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
cleanup() {
    pkill -f "$work/node" 2>/dev/null || true
    as_pg "$PG_BIN/pg_ctl" -D "$work/pg" -m immediate -w stop >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
chmod 755 "$work"
mkdir "$work/pg"
[ "$(id -u)" = 0 ] && chown postgres:postgres "$work/pg"
as_pg "$PG_BIN/initdb" -D "$work/pg" -U agentgate --auth=trust -E UTF8 >/dev/null
as_pg "$PG_BIN/pg_ctl" -D "$work/pg" -l "$work/pg/server.log" -w start \
    -o "-c listen_addresses=127.0.0.1 -c port=$PG_PORT -c unix_socket_directories=$work/pg -c max_connections=300" >/dev/null
psql_() { psql -h 127.0.0.1 -p "$PG_PORT" -U agentgate -At "$@"; }
echo "postgres://agentgate@127.0.0.1:$PG_PORT/agentgate" > "$work/pg-url"

body='{"session_hint": "bench", "pad": "'$(head -c 900 /dev/zero | tr '\0' x)'"}'
cat > "$work/post.lua" <<LUA
wrk.method = "POST"
wrk.body = '$body'
wrk.headers["Content-Type"] = "application/json"
LUA

start_node() { # index
    local dir="$work/node$1"
    mkdir -p "$dir"
    cat > "$dir/agentgate.toml" <<TOML
state_dir = "$dir/state"
[server]
listen = "127.0.0.1:$((BASE_PORT + $1))"
control_socket = "$dir/control.sock"
[store]
backend = "postgres"
url = { file = "$work/pg-url" }
node = "node-$1"
[routes.bench]
path = "/hooks/bench"
verify = { scheme = "none" }
${NODE_CONFIG:-}
TOML
    ./target/release/agentgate serve --config "$dir/agentgate.toml" 2>"$dir/agentgate.log" &
    node_pid=$!
    until curl -fs "http://127.0.0.1:$((BASE_PORT + $1))/readyz" >/dev/null; do
        kill -0 "$node_pid" 2>/dev/null || { cat "$dir/agentgate.log" >&2; exit 1; }
        sleep 0.05
    done
}

stop_nodes() {
    pkill -TERM -f "$work/node" || true
    while pgrep -f "$work/node" >/dev/null; do sleep 0.1; done
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# One node under the load of part 1 alone: "accepted/s CPU-µs-per-accepted-event".
backlog_load() {
    local before after accepted_before accepted_after
    accepted_before=$(psql_ -d agentgate -c "SELECT count(*) FROM events")
    before=$(cpu_ticks "$node_pid")
    wrk -t2 -c64 -d"${PHASE_SECONDS}s" -s "$work/post.lua" "http://127.0.0.1:$BASE_PORT/hooks/bench" > "$work/wrk.txt"
    after=$(cpu_ticks "$node_pid")
    accepted_after=$(psql_ -d agentgate -c "SELECT count(*) FROM events")
    awk -v n=$((accepted_after - accepted_before)) -v t=$((after - before)) -v hz="$(getconf CLK_TCK)" \
        '/Requests\/sec/ {printf "%d %d", $2, (n > 0 ? t / hz * 1e6 / n : 0)}' "$work/wrk.txt"
}
deep_backlog() {
    printf '\nrun\taccepts_per_s_empty\tcpu_us_per_event_empty\taccepts_per_s_%s_queued\tcpu_us_per_event_queued\tidle_cpu_pct_with_backlog\n' "$BACKLOG"
    printf '#!/bin/sh\nexec sleep 100000\n' > "$work/never-answers"
    chmod 755 "$work/never-answers"
    local payload empty deep before idle
    payload=$(printf '%s' "$body" | od -An -tx1 -v | tr -d ' \n')
    for run in $(seq 1 "$RUNS"); do
        psql_ -d postgres -c "DROP DATABASE IF EXISTS agentgate" >/dev/null
        psql_ -d postgres -c "CREATE DATABASE agentgate" >/dev/null
        NODE_CONFIG=$'[runtime]\nmax_queued_events = 100000000\nmax_concurrent_turns = 1\ndrain_timeout = "1s"\n[model]\nbackend = "command"\ncommand = ["'"$work"$'/never-answers"]\nrequest_timeout = "3600s"'
        NODE_CONFIG=$NODE_CONFIG start_node 0
        empty=$(backlog_load)
        stop_nodes
        # A fresh database, its schema made by a node's start, then the backlog.
        rm -rf "$work/node0"
        psql_ -d postgres -c "DROP DATABASE agentgate" >/dev/null
        psql_ -d postgres -c "CREATE DATABASE agentgate" >/dev/null
        NODE_CONFIG=$NODE_CONFIG start_node 0
        stop_nodes
        psql_ -d agentgate -q <<SQL
BEGIN;
INSERT INTO events (id, route, session_key, event_type, headers, payload, received_at, status, updated_at)
SELECT 'backlog-' || i, 'bench', 'bench:backlog-' || i, '', '{"content-type":"application/json"}',
       decode('$payload', 'hex'), (extract(epoch FROM now()) * 1000)::bigint, 'queued',
       (extract(epoch FROM now()) * 1000)::bigint
FROM generate_series(1, $BACKLOG) AS i;
INSERT INTO sessions (key, route, state, created_at, updated_at)
SELECT session_key, route, 'idle', received_at, received_at FROM events WHERE id LIKE 'backlog-%';
COMMIT;
ANALYZE;
SQL
        NODE_CONFIG=$NODE_CONFIG start_node 0
        before=$(cpu_ticks "$node_pid")
        sleep "$IDLE_SECONDS"
        idle=$(awk -v t=$(($(cpu_ticks "$node_pid") - before)) -v hz="$(getconf CLK_TCK)" -v s="$IDLE_SECONDS" \
            'BEGIN {printf "%.1f", t / hz / s * 100}')
        deep=$(backlog_load)
        printf '%s\t%s\t%s\t%s\n' "$run" "${empty// /$'\t'}" "${deep// /$'\t'}" "$idle"
        stop_nodes
        rm -rf "$work"/node* "$work"/wrk*.txt
    done
}
if [ "${BACKLOG_ONLY:-0}" = 1 ]; then
    deep_backlog
    exit 0
fi

printf 'run\tnodes\taccepts_per_s\tnon_2xx\n'
for run in $(seq 1 "$RUNS"); do
    for nodes in 1 2 3; do
        psql_ -d postgres -c "DROP DATABASE IF EXISTS agentgate" >/dev/null
        psql_ -d postgres -c "CREATE DATABASE agentgate" >/dev/null
        for index in $(seq 0 $((nodes - 1))); do start_node "$index"; done
        connections=$((64 / nodes))
        for index in $(seq 0 $((nodes - 1))); do
            wrk -t2 -c"$connections" -d"${PHASE_SECONDS}s" -s "$work/post.lua" \
                "http://127.0.0.1:$((BASE_PORT + index))/hooks/bench" > "$work/wrk$index.txt" &
        done
        wait $(jobs -p | tail -n "$nodes")
        total=$(cat "$work"/wrk*.txt | awk '/Requests\/sec/ {s += $2} END {print int(s)}')
        errors=$(cat "$work"/wrk*.txt | awk '/Non-2xx/ {s += $NF} END {print s + 0}')
        printf '%s\t%s\t%s\t%s\n' "$run" "$nodes" "$total" "$errors"
        pkill -TERM -f "$work/node" || true
        while pgrep -f "$work/node" >/dev/null; do sleep 0.1; done
        rm -rf "$work"/node* "$work"/wrk*.txt
    done
done

printf '\nlease_ttl\trun\tfailover_s\n'
for lease in $LEASES; do
    for run in $(seq 1 "$RUNS"); do
        seconds=$(SCALEOUT_LEASE_TTL=$lease cargo test --release --locked -q --test scaleout \
            a_killed_nodes_turn -- --nocapture 2>&1 | awk '/^failover after kill -9/ {print $NF}')
        printf '%s\t%s\t%s\n' "$lease" "$run" "$seconds"
    done
done

deep_backlog
