#!/usr/bin/env bash
# Daemon CPU per accepted event as instructions (callgrind), which a busy machine does not
# change: reproduces the "Instructions per accepted event" figures in docs/benchmarks.md.
#
#   bench/instructions.sh                                  # this checkout's release build
#   BINS="/tmp/before/agentgate ./target/release/agentgate" bench/instructions.sh
#   EVENTS=1000 IDLE_SECONDS=5 bench/instructions.sh
#
# The accept path on its own, as bench/accept.sh sets it up (a `verify = none` route, a model
# that never answers, `max_concurrent_turns = 1`, SQLite with synchronous=FULL). For each build:
#   1. idle RSS one second after start (no valgrind);
#   2. under `valgrind --tool=callgrind`, on an empty queue: the instructions per second at rest
#      for IDLE_SECONDS; then the counters are zeroed, EVENTS webhooks are posted over
#      CONNECTIONS keep-alive connections, and the daemon's instructions (every thread, user
#      space) are divided by the 2xx answers;
#   3. the same with BACKLOG queued events (one per session) written into its database before
#      it starts: first the instructions per second at rest for IDLE_SECONDS, then per event,
#      also net of the at-rest rate over the phase's length.
# User-space instructions only: the kernel's share (fdatasync, page copies) is not counted.
# Needs: valgrind, sqlite3, python3.
set -euo pipefail
cd "$(dirname "$0")/.."
EVENTS=${EVENTS:-2000}
CONNECTIONS=${CONNECTIONS:-16}
IDLE_SECONDS=${IDLE_SECONDS:-10}
BACKLOG=${BACKLOG:-100000}
PORT=${PORT:-18797}

if [ -z "${BINS:-}" ]; then
    cargo build --release --locked -q
    BINS=./target/release/agentgate
fi
work=$(mktemp -d /var/tmp/agentgate-instructions.XXXXXX)
pid=
cleanup() {
    if [ -n "$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT
. bench/accept-setup.sh
accept_setup "$work" "$PORT"
# Posts $EVENTS webhooks over $CONNECTIONS keep-alive connections; prints the 2xx answers.
cat > "$work/post.py" <<'PY'
import http.client, sys, threading
port, events, connections, body = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), open(sys.argv[4], "rb").read()
accepted = [0] * connections
def post(slot):
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    for _ in range(events // connections):
        client.request("POST", "/hooks/bench", body, {"Content-Type": "application/json"})
        response = client.getresponse()
        response.read()
        accepted[slot] += 200 <= response.status < 300
threads = [threading.Thread(target=post, args=(slot,)) for slot in range(connections)]
for thread in threads: thread.start()
for thread in threads: thread.join()
print(sum(accepted))
PY

start() { # binary [valgrind]
    if [ -n "${2:-}" ]; then
        valgrind --tool=callgrind --callgrind-out-file="$work/callgrind.%p" \
            "$1" serve --config "$work/agentgate.toml" 2>"$work/agentgate.log" &
    else
        "$1" serve --config "$work/agentgate.toml" 2>"$work/agentgate.log" &
    fi
    pid=$!
    until curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null; do sleep 0.2; done
}
stop() { kill -TERM "$pid"; wait "$pid" || true; pid=; }
# The instructions counted since the last zeroing: dumps them and reads the dump's total.
instructions() {
    callgrind_control -d "$pid" >/dev/null 2>&1
    local dump
    dump=$(ls -t "$work"/callgrind."$pid".* | head -1)
    awk '/^(summary|totals):/ {print $2; exit}' "$dump"
    rm -f "$work"/callgrind."$pid".*
}
zero() { callgrind_control -z "$pid" >/dev/null 2>&1; }
per_event() { # [instructions per second at rest] -> "accepted instructions-per-event net"
    local accepted total started elapsed_ms
    zero
    started=$(date +%s%N)
    accepted=$(python3 "$work/post.py" "$PORT" "$EVENTS" "$CONNECTIONS" "$work/body.json")
    total=$(instructions)
    elapsed_ms=$(( ($(date +%s%N) - started) / 1000000 ))
    accepted=$((accepted > 0 ? accepted : 1))
    # Net: less what the daemon spends at rest over the phase (valgrind stretches the phase
    # about fiftyfold, and with it the share of the once-a-second work).
    echo "$accepted $((total / accepted)) $(( (total - ${1:-0} * elapsed_ms / 1000) / accepted ))"
}

printf 'build\tidle_rss_kib\tidle_instructions_per_s\taccepted\tinstructions_per_event\tbacklog_accepted\tbacklog_instructions_per_event\tnet_of_rest\tbacklog_idle_instructions_per_s\n'
for bin in $BINS; do
    rm -rf "$work/state"
    start "$bin"
    sleep 1
    rss=$(awk '/VmRSS/ {print $2}' "/proc/$pid/status")
    stop

    rm -rf "$work/state"
    start "$bin" valgrind
    sleep 2
    zero
    sleep "$IDLE_SECONDS"
    empty_idle=$(( $(instructions) / IDLE_SECONDS ))
    read -r accepted empty _ < <(per_event)
    stop

    rm -rf "$work/state"
    start "$bin"
    stop
    sqlite3 "$work/state/agentgate.db" < "$work/backlog.sql"
    start "$bin" valgrind
    sleep 2
    zero
    sleep "$IDLE_SECONDS"
    idle=$(( $(instructions) / IDLE_SECONDS ))
    read -r backlog_accepted backlog backlog_net < <(per_event "$idle")
    stop
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$bin" "$rss" "$empty_idle" "$accepted" "$empty" \
        "$backlog_accepted" "$backlog" "$backlog_net" "$idle"
done
