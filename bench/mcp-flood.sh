#!/usr/bin/env bash
# The daemon's CPU while one stdio MCP server floods it (bench/mcp-spew.py): notifications
# without end, stderr without end, both, messages of 1 MB, lines that are no JSON, or one
# stderr line without end (MODES picks some). For each binary and each flood, the daemon is
# started with the server (its listing process, which no turn needs), given 4 s to settle, and
# its CPU time (user + system) read over the next 10 s. Results: docs/benchmarks.md, "An MCP
# server that floods".
#
#   BINS="/tmp/before/agentgate target/release/agentgate" bench/mcp-flood.sh
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bins=${BINS:-target/release/agentgate}
# Not under /tmp: the server's sandbox has a /tmp of its own.
work=$(mktemp -d /var/tmp/mcp-flood.XXXXXX)
trap 'pkill -f "serve --config $work/agentgate.toml" || true; rm -rf "$work"' EXIT
ticks=$(getconf CLK_TCK)

cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }

for bin in $bins; do
    for mode in ${MODES:-notes stderr both large junk endless}; do
        rm -rf "$work/state"
        cat >"$work/agentgate.toml" <<CONFIG
state_dir = "$work/state"

[server]
listen = "127.0.0.1:39417"
control_socket = "$work/control.sock"

[model]
backend = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "none"

[mcp.flood]
command = ["/usr/bin/python3", "$repo/bench/mcp-spew.py", "$mode"]

[routes.hook]
path = "/hook"
verify = { scheme = "none" }
tools = ["flood.*"]
deliver = { kind = "log" }
CONFIG
        "$bin" serve --config "$work/agentgate.toml" >"$work/daemon.log" 2>&1 &
        daemon=$!
        sleep 4
        before=$(cpu_ticks "$daemon")
        sleep 10
        after=$(cpu_ticks "$daemon")
        kill "$daemon"
        wait "$daemon" || true
        printf '%s\t%s\t%d%% of a core\n' "$bin" "$mode" $(((after - before) * 100 / (10 * ticks)))
    done
done
