#!/usr/bin/env bash
# The daemon's CPU while a tool floods its output: reproduces "A tool that floods its output" in
# docs/benchmarks.md.
#
#   bench/tool-flood.sh                                  # this checkout's release build
#   BINS="/tmp/before/agentgate target/release/agentgate" bench/tool-flood.sh
#
# For each binary: the gateway in a fresh directory, with a `command` model that calls the tool
# `flood` (`/usr/bin/yes`, `sandbox = "none"`, timeout FLOOD_SECONDS, default 10) once and then
# answers; one webhook; the daemon's CPU time (user + system, from /proc) from the POST to the
# event's end. `yes` writes as fast as the daemon reads, so the figure is what reading a flood
# past the 64 KiB cap costs the daemon.
set -euo pipefail
cd "$(dirname "$0")/.."
BINS=${BINS:-$PWD/target/release/agentgate}
FLOOD_SECONDS=${FLOOD_SECONDS:-10}
PORT=${PORT:-18977}
[ -x target/release/agentgate ] || cargo build --release --locked -q
work=$(mktemp -d /tmp/agentgate-tool-flood.XXXXXX)
pid=""
trap '[[ -n $pid ]] && kill -9 "$pid" 2>/dev/null; rm -rf "$work"' EXIT
cat >"$work/model.py" <<'PY'
import json, sys
request = json.load(sys.stdin)
messages = request["messages"] if isinstance(request, dict) else request
if any(m.get("role") == "tool" for m in messages):
    print(json.dumps({"role": "assistant", "content": "done"}))
else:
    call = {"id": "c1", "type": "function", "function": {"name": "flood", "arguments": "{}"}}
    print(json.dumps({"role": "assistant", "content": None, "tool_calls": [call]}))
PY
for bin in $BINS; do
  dir=$(mktemp -d "$work/run.XXXX")
  cat >"$dir/agentgate.toml" <<TOML
state_dir = "$dir/state"
[server]
listen = "127.0.0.1:$PORT"
control_socket = "$dir/control.sock"
[model]
backend = "command"
command = ["/usr/bin/python3", "$work/model.py"]
[tools.flood]
description = "Writes y lines without end"
command = ["/usr/bin/yes"]
parameters = { type = "object", properties = {} }
timeout = "${FLOOD_SECONDS}s"
sandbox = "none"
[routes.r]
path = "/r"
verify = { scheme = "none" }
tools = ["flood"]
TOML
  "$bin" serve --config "$dir/agentgate.toml" 2>"$dir/log" &
  pid=$!
  until curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null; do
    kill -0 "$pid" 2>/dev/null || { cat "$dir/log" >&2; exit 1; }
    sleep 0.1
  done
  ticks() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
  before=$(ticks)
  id=$(curl -fs -H 'content-type: application/json' -d '{}' "http://127.0.0.1:$PORT/r" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["event_id"])')
  status=queued
  while [[ $status == queued || $status == running ]]; do
    sleep 0.2
    status=$("$bin" events show "$id" --json --config "$dir/agentgate.toml" |
      python3 -c 'import json, sys; print(json.load(sys.stdin)["status"])')
  done
  after=$(ticks)
  echo "$bin: daemon CPU $(( (after - before) * 1000 / $(getconf CLK_TCK) )) ms over a ${FLOOD_SECONDS} s flood; the event ended $status"
  kill "$pid"
  wait "$pid" 2>/dev/null || true
done
