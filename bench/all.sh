#!/usr/bin/env bash
# Reproduces every figure in docs/benchmarks.md, in one go (about 25 minutes on 2 cores):
#
#   bench/all.sh                 # RUNS=3 by default
#
# 1. durable accept vs Debian's webhook (bench/accept.sh, RUNS runs), instructions per accepted
#    event with and without a deep backlog (bench/instructions.sh), and memory under stalled
#    large bodies (bench/stalled-bodies.py);
# 2. turns: per-step overhead at 1 and 16 concurrent turns, 1,000 concurrent turns on a slow
#    model, time to READY with 100,000 and 1,000,000 stored events, command against MCP tool
#    calls (benches/turns.rs, RUNS runs);
# 3. restarts under load under a real systemd (root only);
# 4. the fault soak with 100 rounds;
# 5. 10,000 pending approvals at idle, and decision-to-turn-end latency (bench/approvals.sh);
# 6. a sandboxed call in a unit of its own against the same sandbox started directly, under a
#    real systemd (bench/tool-units.sh, root only);
# 7. a valid webhook and the daemon's memory under five floods (bench/attack.py);
# 8. `agentgate backup` of a 180 MB database idle and under load (bench/backup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}

echo "== durable accept"
RUNS=$RUNS bench/accept.sh

echo "== instructions per accepted event"
bench/instructions.sh

echo "== stalled large bodies"
for connections in 300 900; do bench/stalled-bodies.py "$connections"; done

echo "== turns"
for run in $(seq 1 "$RUNS"); do
    AGENTGATE_BENCH_CONCURRENCY=1 cargo bench --locked -q --bench turns -- per_step 2>/dev/null | grep '^per_step'
    AGENTGATE_BENCH_CONCURRENCY=16 cargo bench --locked -q --bench turns -- per_step 2>/dev/null | grep '^per_step'
    cargo bench --locked -q --bench turns -- concurrent_turns 2>/dev/null | grep '^concurrent_turns'
    for events in 100000 1000000; do
        AGENTGATE_BENCH_EVENTS=$events cargo bench --locked -q --bench turns -- time_to_ready 2>/dev/null | grep '^time_to_ready'
    done
    tests/mcp/install
    cargo bench --locked -q --bench turns -- tool_calls 2>/dev/null | grep '^tool_calls'
done

echo "== restarts under load (real systemd)"
cargo test --locked -q --test systemd ten_restarts -- --nocapture 2>&1 | grep -E '^restarts:|not run'

echo "== fault soak"
cargo test --locked -q --test soak -- --nocapture 2>&1 | grep -E '^soak:'

echo "== approvals"
bench/approvals.sh

echo "== tool units (real systemd)"
bench/tool-units.sh

echo "== floods"
bench/attack.py

echo "== backup under load"
RUNS=$RUNS bench/backup.sh

echo "== scale-out on PostgreSQL"
RUNS=$RUNS bench/scaleout.sh
