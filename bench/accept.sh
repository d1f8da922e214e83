#!/usr/bin/env bash
# Accept-path benchmark: reproduces the "Durable accept" figures in docs/benchmarks.md.
#
#   bench/accept.sh                 # 3 runs of 30 s per phase
#   RUNS=1 PHASE_SECONDS=10 bench/accept.sh
#   EXTRA_CONFIG=$'[telemetry]\notlp_endpoint = "http://127.0.0.1:9"' bench/accept.sh
#                                   # appended to the daemon's config: here, traces on, sent to
#                                   # a closed port (a dead collector)
#
# Per run, on a fresh state directory, with fsync on (synchronous=FULL):
#   1. idle RSS after start;
#   2. closed-loop throughput: wrk, 2 threads, 64 connections, 1 KiB signed JSON bodies;
#   3. fdatasync per accepted event: strace -c on the daemon during 10 s of the same load;
#   4. latency at a fixed 1,000 requests/s (open loop, benches/loadgen.rs);
#   5. the peer, Debian's `webhook` (adnanh/webhook), under the same wrk load: answering without
#      writing anything, and answering after an fsync'd append of the payload.
# Needs: wrk, webhook, strace, sqlite3, python3 (the script installs them with apt-get if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
PHASE_SECONDS=${PHASE_SECONDS:-30}
PORT=${PORT:-18787}
PEER_PORT=${PEER_PORT:-18788}

for tool in wrk webhook strace sqlite3; do
    command -v "$tool" >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk webhook strace sqlite3 >/dev/null; break; }
done
# BIN=path measures another build (another commit's binary) with the same script and load.
if [ -z "${BIN:-}" ]; then
    cargo build --release --locked -q
    BIN=./target/release/agentgate
fi
cargo bench --locked -q --bench loadgen --no-run 2>/dev/null
loadgen() { cargo bench --locked -q --bench loadgen -- "$@"; }

work=$(mktemp -d /var/tmp/agentgate-bench.XXXXXX)
trap 'pkill -f "$work" 2>/dev/null || true; rm -rf "$work"' EXIT
python3 - "$work" <<'PY'
import hmac, hashlib, json, sys
work = sys.argv[1]
body = json.dumps({"action": "opened", "issue": {"number": 7}, "pad": "x" * 950})
signature = "sha256=" + hmac.new(b"bench-secret", body.encode(), hashlib.sha256).hexdigest()
open(f"{work}/body.json", "w").write(body)
open(f"{work}/signature", "w").write(signature)
open(f"{work}/post.lua", "w").write(
    'wrk.method = "POST"\nwrk.body = %s\nwrk.headers["Content-Type"] = "application/json"\n'
    'wrk.headers["X-Signature"] = "%s"\n' % (json.dumps(body), signature))
PY
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

# Successful (2xx) answers per second: a refusal is not an accepted webhook.
wrk_rate() {
    wrk -t2 -c64 -d"$1"s -s "$work/post.lua" "$2" | awk '
        / requests in / {total = $1; secs = $4; sub(/s,?$/, "", secs)}
        /Non-2xx/ {refused = $NF; print "NON2XX " $0 > "/dev/stderr"}
        END {if (secs > 0) print int((total - refused) / secs); else print 0}'
}
rss_kib() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
count_events() { sqlite3 "$work/state/agentgate.db" "SELECT count(*) FROM events"; }

printf 'run\tidle_rss_kib\taccepts_per_s\tfdatasync_per_event\tp50_ms\tp99_ms\tp999_ms\tpeer_nowrite_per_s\tpeer_durable_per_s\n'
start_agentgate() {
    rm -rf "$work/state"
    cat > "$work/agentgate.toml" <<TOML
state_dir = "$work/state"
[server]
listen = "127.0.0.1:$PORT"
# The accept path is measured, not the backlog limit: a 10 s burst at full speed queues more
# than the default 100,000 events.
[runtime]
max_queued_events = 100000000
[routes.bench]
path = "/hooks/bench"
verify = { scheme = "hmac-sha256", secret = "bench-secret" }
${EXTRA_CONFIG:-}
TOML
    "$BIN" serve --config "$work/agentgate.toml" 2>"$work/agentgate.log" &
    pid=$!
    until curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null; do sleep 0.05; done
}
stop_agentgate() { kill -TERM "$pid"; wait "$pid" || true; }

for run in $(seq 1 "$RUNS"); do
    # Each phase starts from an empty state directory. Every accepted event also runs as a turn
    # (the default replay model), as it would in production.
    start_agentgate
    sleep 1
    idle_rss=$(rss_kib "$pid")
    accepts=$(wrk_rate "$PHASE_SECONDS" "http://127.0.0.1:$PORT/hooks/bench")
    stop_agentgate

    start_agentgate
    before=$(count_events)
    strace -f -c -e trace=fdatasync,fsync -o "$work/strace.txt" -p "$pid" &
    tracer=$!
    sleep 0.5
    wrk_rate 10 "http://127.0.0.1:$PORT/hooks/bench" >/dev/null
    kill -INT "$tracer"; wait "$tracer" 2>/dev/null || true
    after=$(count_events)
    syncs=$(awk '$NF ~ /^(fdatasync|fsync)$/ {s += $4} END {print s + 0}' "$work/strace.txt")
    per_event=$(python3 -c "print(f'{$syncs / max(1, $after - $before):.4f}')")
    stop_agentgate

    start_agentgate
    latency=$(loadgen --addr "127.0.0.1:$PORT" --path /hooks/bench --body "$work/body.json" \
        --header "x-signature: $(cat "$work/signature")" --rate 1000 --connections 64 --seconds "$PHASE_SECONDS")
    read -r p50 p99 p999 < <(python3 -c "import json,sys; d=json.loads(sys.argv[1]); print(d['p50_ms'], d['p99_ms'], d['p999_ms'])" "$latency")
    stop_agentgate

    # A fresh peer process per phase: "nowrite" leaves its /bin/true spawns running after the
    # answers, which would otherwise slow the next phase.
    peer_run() {
        webhook -hooks "$work/hooks.json" -ip 127.0.0.1 -port "$PEER_PORT" >/dev/null 2>&1 &
        local peer=$!
        until curl -fs -o /dev/null "http://127.0.0.1:$PEER_PORT/"; do sleep 0.05; done
        wrk_rate "$PHASE_SECONDS" "http://127.0.0.1:$PEER_PORT/hooks/$1"
        kill "$peer"; wait "$peer" 2>/dev/null || true
        sleep 2
    }
    peer_nowrite=$(peer_run nowrite)
    peer_durable=$(peer_run durable)

    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$run" "$idle_rss" "$accepts" "$per_event" "$p50" "$p99" "$p999" "$peer_nowrite" "$peer_durable"
done
