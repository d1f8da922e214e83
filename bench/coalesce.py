#!/usr/bin/env python3
"""A burst with and without `coalesce`: the "Coalescing" figures in docs/benchmarks.md.

    bench/coalesce.py                    # against target/release/agentgate
    EVENTS=1000 SECONDS=10 SESSIONS=10 LATENCY=0.5 bench/coalesce.py

Sends EVENTS webhooks spread evenly over SECONDS to SESSIONS sessions of one route, once with
`coalesce = "30s"` and once without, against a stub OpenAI-compatible model on loopback that
answers each request after LATENCY seconds and reports usage (prompt tokens: the request's
bytes / 4; 20 completion tokens). Waits until every event has ended, then prints the turns run,
the model requests, the tokens spent and the time from the first webhook to the last end.
"""
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

BINARY = os.environ.get("BIN", "target/release/agentgate")
EVENTS = int(os.environ.get("EVENTS", "1000"))
SECONDS = float(os.environ.get("SECONDS", "10"))
SESSIONS = int(os.environ.get("SESSIONS", "10"))
LATENCY = float(os.environ.get("LATENCY", "0.5"))
PORT, MODEL_PORT = 18797, 18798


class Model(http.server.BaseHTTPRequestHandler):
    """Chat Completions: one answer, after LATENCY, with usage."""

    requests = 0
    prompt_tokens = 0
    lock = threading.Lock()

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        prompt = len(body) // 4
        with Model.lock:
            Model.requests += 1
            Model.prompt_tokens += prompt
        time.sleep(LATENCY)
        answer = json.dumps({
            "id": "bench", "object": "chat.completion", "model": "bench",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "Noted: the disk is full."}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 20,
                      "total_tokens": prompt + 20},
        }).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def start(work, coalesce):
    with open(f"{work}/agentgate.toml", "w") as config:
        config.write(f"""state_dir = "{work}/state"
[server]
listen = "127.0.0.1:{PORT}"
control_socket = "{work}/control.sock"
[runtime]
max_concurrent_turns = 4
[model]
backend = "openai"
base_url = "http://127.0.0.1:{MODEL_PORT}/v1"
model = "bench"
[routes.alerts]
path = "/alerts"
verify = {{ scheme = "none" }}
session = "{{{{ payload.group }}}}"
{'coalesce = "30s"' if coalesce else ''}
""")
    daemon = subprocess.Popen([BINARY, "serve", "--config", f"{work}/agentgate.toml"],
                              stderr=subprocess.DEVNULL)
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", PORT), timeout=1).close()
            return daemon
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the daemon did not start")


def post(n):
    body = json.dumps({"group": f"group-{n % SESSIONS}", "alert": f"disk full, notice {n}"})
    request = urllib.request.Request(f"http://127.0.0.1:{PORT}/alerts", data=body.encode(),
                                      headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 202, answer.status


def status(work):
    out = subprocess.run([BINARY, "status", "--json", "--config", f"{work}/agentgate.toml"],
                         capture_output=True, check=True).stdout
    return json.loads(out)


def run(coalesce):
    Model.requests = Model.prompt_tokens = 0
    with tempfile.TemporaryDirectory(dir="/var/tmp") as work:
        daemon = start(work, coalesce)
        try:
            began = time.time()
            for n in range(EVENTS):
                wait = began + n * SECONDS / EVENTS - time.time()
                if wait > 0:
                    time.sleep(wait)
                post(n)
            while True:
                by_status = status(work)["events"]["by_status"]
                if not any(by_status.get(s, 0) for s in ("queued", "running", "joined")):
                    break
                time.sleep(0.2)
            took = time.time() - began
            turns = subprocess.run(
                ["sqlite3", f"{work}/state/agentgate.db", "SELECT count(*) FROM turns"],
                capture_output=True, text=True).stdout.strip()
        finally:
            daemon.terminate()
            daemon.wait()
    tokens = Model.prompt_tokens + 20 * Model.requests
    label = 'coalesce = "30s"' if coalesce else "no coalesce"
    print(f"{label:>18}: {EVENTS} events, {turns} turns, {Model.requests} model requests, "
          f"{tokens} tokens ({Model.prompt_tokens} prompt), all ended {took:.1f} s after the first")


def main():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", MODEL_PORT), Model)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for coalesce in (False, True):
        run(coalesce)
    server.shutdown()


if __name__ == "__main__":
    sys.exit(main())
