#!/usr/bin/env bash
# Delivery throughput: reproduces the "Deliveries" figures in docs/benchmarks.md.
#
#   bench/deliveries.sh                # 5,000 events per receiver kind
#   EVENTS=1000 bench/deliveries.sh
#
# The release binary on the replay model, one route delivering over HTTP to a local receiver
# (Python's threading HTTP server): once to a receiver that keeps connections open, once to one
# that closes every connection after its answer without saying so (`Connection: close` absent),
# which is what made pooled connections fail. Events are posted as fast as they are accepted;
# the figure is events delivered per second from the first post to the last delivery, so it
# includes the turns (the replay model answers at once).
set -euo pipefail
cd "$(dirname "$0")/.."
EVENTS=${EVENTS:-5000}
PORT=${PORT:-18795}
RECEIVER_PORT=${RECEIVER_PORT:-18796}
cargo build --release --locked -q
work=$(mktemp -d /var/tmp/agentgate-deliveries.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

cat >"$work/receiver.py" <<'PY'
import http.server, socketserver, sys
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(204)
        self.send_header("content-length", "0")
        self.end_headers()
        if sys.argv[2] == "close":
            self.close_connection = True
    def log_message(self, *args):
        pass
class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 1024
Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
PY

run() {
    local kind=$1
    rm -rf "$work/state"
    cat >"$work/agentgate.toml" <<TOML
state_dir = "$work/state"
[server]
listen = "127.0.0.1:$PORT"
control_socket = "$work/control.sock"
[runtime]
max_concurrent_turns = 64
[model]
backend = "replay"
cassette = "$PWD/examples/triage.cassette.jsonl"
[routes.bench]
path = "/bench"
verify = { scheme = "none" }
deliver = { kind = "http", url = "http://127.0.0.1:$RECEIVER_PORT/results" }
TOML
    python3 "$work/receiver.py" "$RECEIVER_PORT" "$kind" &
    local receiver=$!
    AGENTGATE_LOG=warn "${CARGO_TARGET_DIR:-target}/release/agentgate" serve --config "$work/agentgate.toml" 2>"$work/$kind.log" &
    local daemon=$!
    until curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null; do sleep 0.1; done
    python3 - "$PORT" "$EVENTS" "$work/state/agentgate.db" "$kind" <<'PY'
import json, sqlite3, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
port, events, database, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
def post(n):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/bench", data=json.dumps({"n": n}).encode(),
                                     headers={"content-type": "application/json"})
    urllib.request.urlopen(request).read()
started = time.time()
with ThreadPoolExecutor(8) as pool:
    list(pool.map(post, range(events)))
posted = time.time() - started
connection = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
while connection.execute("SELECT count(*) FROM deliveries WHERE status = 'delivered'").fetchone()[0] < events:
    time.sleep(0.05)
elapsed = time.time() - started
retried = connection.execute("SELECT count(*) FROM deliveries WHERE attempts > 1").fetchone()[0]
print(f"{kind}\t{events}\t{posted:.2f}\t{elapsed:.2f}\t{events / elapsed:.0f}\t{retried}")
PY
    kill "$daemon" "$receiver"
    wait "$daemon" "$receiver" 2>/dev/null || true
}

printf 'receiver\tevents\tposted_s\tall_delivered_s\tdelivered_per_s\tretried\n'
run keepalive
run close
