#!/usr/bin/env bash
# Where the daemon's CPU goes while it accepts: reproduces "Where the daemon's CPU goes under
# load" in docs/benchmarks.md.
#
#   bench/accept-profile.sh                 # builds a release binary with line tables first
#   BIN=/path/to/agentgate bench/accept-profile.sh
#
# The accept path of bench/accept.sh (a `verify = none` route, a model that never answers, so
# events stay queued; durable as always), under wrk (2 threads, 64 connections) for 20 s, with
# perf sampling the daemon (1,999 Hz, DWARF call graphs) for 8 s of it. Prints the daemon's CPU
# per accepted event over the whole load (perf's own cost included, so higher than
# bench/accept.sh's), the share of each thread, each library, and the functions with the most
# samples of their own and in total. perf.data stays in $OUT (default /var/tmp/agentgate-profile)
# for `perf report -i`.
# Needs: perf (linux-perf), wrk, python3.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-18797}
OUT=${OUT:-/var/tmp/agentgate-profile}
if [ -z "${BIN:-}" ]; then
    CARGO_PROFILE_RELEASE_DEBUG=line-tables-only cargo build --release --locked -q --target-dir target/profile
    BIN=target/profile/release/agentgate
fi
mkdir -p "$OUT"
work=$(mktemp -d /var/tmp/agentgate-profile-run.XXXXXX)
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT
. bench/accept-setup.sh
accept_setup "$work" "$PORT"
"$BIN" serve --config "$work/agentgate.toml" >"$work/serve.log" 2>&1 &
pid=$!
until grep -q "accepting" "$work/serve.log"; do sleep 0.1; done
url=http://127.0.0.1:$PORT/hooks/bench
wrk -t2 -c64 -d3s -s "$work/post.lua" "$url" >/dev/null
cpu() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
before=$(cpu)
wrk -t2 -c64 -d20s -s "$work/post.lua" "$url" >"$work/wrk.txt" &
load=$!
sleep 3
perf record -q -F 1999 --call-graph dwarf,32768 -p "$pid" -o "$OUT/perf.data" -- sleep 8 2>/dev/null
wait "$load"
after=$(cpu)
requests=$(grep -oP '[0-9]+(?= requests in)' "$work/wrk.txt")
ticks=$(getconf CLK_TCK)
python3 -c "print('accepted/s %s, daemon CPU per accepted event %.0f us (perf running for 8 of 20 s)' % ('$(grep -oP '(?<=Requests/sec:)\s*[0-9.]+' "$work/wrk.txt" | tr -d ' ')', ($after - $before) / $ticks / $requests * 1e6))"
report() { perf report -i "$OUT/perf.data" --stdio --no-call-graph "$@" 2>/dev/null | grep -v '^#' | grep -v '^$'; }
echo "== by thread"; report --no-children --sort comm | head -5
echo "== by library"; report --no-children --sort dso | head -8
echo "== own samples"; report --no-children --sort sym | head -25
echo "== with callees"; report --children --sort sym | grep -v 'inlined)' | head -60
