#!/usr/bin/env bash
# Approvals: reproduces the "Approvals" figures in docs/benchmarks.md.
#
#   bench/approvals.sh               # 10,000 pending approvals, 60 s idle, 20 decisions
#   PENDING=1000 IDLE_SECONDS=20 bench/approvals.sh
#
# The release binary on the bundled replay model, whose first reply calls `disk_usage`, here a
# tool with approval = true (and sandbox = "none", so the figure is agentgate's own). Every event
# is its own session, so each one leaves a pending approval:
#   1. RSS and CPU time over IDLE_SECONDS of idling, with no pending approval and with PENDING;
#   2. the time from a decision (POST /v1/approvals/{id}/approve on the control socket) to the
#      turn's end committed (the approved call run and the replay's answer), for DECISIONS
#      requests, decided one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
PENDING=${PENDING:-10000}
IDLE_SECONDS=${IDLE_SECONDS:-60}
DECISIONS=${DECISIONS:-20}
PORT=${PORT:-18797}
cargo build --release --locked -q
work=$(mktemp -d /var/tmp/agentgate-approvals.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

cat >"$work/agentgate.toml" <<TOML
state_dir = "$work/state"

[server]
listen = "127.0.0.1:$PORT"
control_socket = "$work/control.sock"

[runtime]
approval_timeout = "24h"
max_queued_events = 1000000

[model]
backend = "replay"

[tools.disk_usage]
description = "Show disk usage"
command = ["/bin/df", "-h"]
approval = true
sandbox = "none"

[routes.ops]
path = "/hooks/ops"
verify = { scheme = "none" }
tools = ["disk_usage"]
deliver = { kind = "log" }
TOML

./target/release/agentgate serve --config "$work/agentgate.toml" 2>"$work/daemon.log" &
daemon=$!
python3 - "$work" "$PORT" "$daemon" "$PENDING" "$IDLE_SECONDS" "$DECISIONS" <<'PY'
import http.client, json, socket, sys, time

work, port, pid, pending, idle, decisions = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *map(int, sys.argv[4:])
ticks = 100  # USER_HZ


class Control(http.client.HTTPConnection):
    def __init__(self):
        super().__init__("control")

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(f"{work}/control.sock")


def control(method, path):
    connection = Control()
    connection.request(method, path, body=b"" if method == "POST" else None)
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response.status, json.loads(body or b"null")


def wait(what, condition, limit=600):
    deadline = time.time() + limit
    while time.time() < deadline:
        try:
            if condition():
                return
        except OSError:
            pass
        time.sleep(0.05)
    sys.exit(f"timed out waiting for {what}")


def rss_kib():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])


def cpu_seconds():
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / ticks


def idle_cost(label):
    time.sleep(2)
    before = cpu_seconds()
    time.sleep(idle)
    used = cpu_seconds() - before
    print(f"idle {label}: rss {rss_kib() / 1024:.1f} MiB, cpu {used:.3f} s in {idle} s "
          f"({100 * used / idle:.3f} %)")


def pending_count():
    return control("GET", "/v1/status")[1]["approvals"]["pending"]


wait("the daemon", lambda: control("GET", "/v1/status")[0] == 200)
idle_cost("with 0 pending approvals")
web = http.client.HTTPConnection("127.0.0.1", port)
started = time.time()
events = []
for n in range(pending):
    web.request("POST", "/hooks/ops", body=json.dumps({"n": n}),
                headers={"Content-Type": "application/json"})
    response = web.getresponse()
    events.append(json.loads(response.read())["event_id"])
wait("every approval to be pending", lambda: pending_count() == pending)
print(f"{pending} events accepted and paused on their approval in {time.time() - started:.1f} s")
idle_cost(f"with {pending} pending approvals")

approvals = control("GET", "/v1/approvals")[1]["approvals"][:decisions]
latencies = []
for approval in approvals:
    event = approval["event_id"]
    decided = time.time()
    status, _ = control("POST", f"/v1/approvals/{approval['id']}/approve")
    assert status == 200, status
    while control("GET", f"/v1/events/{event}")[1]["status"] != "completed":
        time.sleep(0.002)
    latencies.append((time.time() - decided) * 1000)
latencies.sort()
print(f"decision to completed turn, {len(latencies)} decisions: "
      f"median {latencies[len(latencies) // 2]:.0f} ms, max {latencies[-1]:.0f} ms")
PY
