#!/usr/bin/env python3
"""Stalled large bodies: the "Stalled large bodies" figures in docs/benchmarks.md.

    bench/stalled-bodies.py [CONNECTIONS] [BODY_BYTES]     # default 300 connections, 1,000,000 bytes
    BIN=/path/to/agentgate bench/stalled-bodies.py 900     # another build

Starts `agentgate serve` (BIN, default target/release/agentgate) with one `github` route on
loopback, opens CONNECTIONS connections that each send the headers with a made-up signature and
BODY_BYTES bytes of a body one byte longer, then stop. Prints the daemon's resident memory
before and during the attack, the answer to a valid small webhook sent meanwhile and how long
it took, and the memory once the attackers have gone.
"""
import hashlib, hmac, json, os, resource, socket, subprocess, sys, tempfile, time

connections = int(sys.argv[1]) if len(sys.argv) > 1 else 300
size = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
binary = os.environ.get("BIN", "target/release/agentgate")
secret, port = b"bench-secret", 18790
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

work = tempfile.mkdtemp(prefix="agentgate-stalled.")
with open(f"{work}/agentgate.toml", "w") as config:
    config.write(f"""state_dir = "{work}/state"
[server]
listen = "127.0.0.1:{port}"
control_socket = "{work}/control.sock"
[model]
backend = "replay"
[routes.github]
path = "/hooks/github"
verify = {{ scheme = "github", secret = {{ env = "BENCH_SECRET" }} }}
""")
daemon = subprocess.Popen([binary, "serve", "--config", f"{work}/agentgate.toml"],
                          env={**os.environ, "BENCH_SECRET": secret.decode()},
                          stderr=subprocess.DEVNULL)

def rss_mib():
    with open(f"/proc/{daemon.pid}/status") as status:
        return next(int(l.split()[1]) // 1024 for l in status if l.startswith("VmRSS"))

for _ in range(100):
    try:
        socket.create_connection(("127.0.0.1", port)).close()
        break
    except OSError:
        time.sleep(0.1)
try:
    print(f"RSS at start: {rss_mib()} MiB")
    head = ("POST /hooks/github HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            "x-github-event: issues\r\nx-hub-signature-256: sha256=00\r\n"
            f"content-length: {size + 1}\r\n\r\n").encode()
    stalled = []
    for _ in range(connections):
        attacker = socket.create_connection(("127.0.0.1", port))
        attacker.sendall(head + b"{" + b" " * (size - 1))
        stalled.append(attacker)
    time.sleep(2)
    print(f"RSS with {connections} stalled bodies of {size} bytes: {rss_mib()} MiB")
    payload = json.dumps({"action": "opened", "issue": {"number": 1}}).encode()
    signature = "sha256=" + hmac.new(secret, payload, hashlib.sha256).hexdigest()
    started = time.time()
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall((f"POST /hooks/github HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    f"x-github-event: issues\r\nx-github-delivery: bench-{time.time_ns()}\r\n"
                    f"x-hub-signature-256: {signature}\r\ncontent-length: {len(payload)}\r\n"
                    "connection: close\r\n\r\n").encode() + payload)
    status = client.recv(200).split(b"\r\n")[0].decode()
    print(f"valid webhook: {status} in {(time.time() - started) * 1000:.1f} ms")
    for attacker in stalled:
        attacker.close()
    time.sleep(1)
    print(f"RSS after the attackers left: {rss_mib()} MiB")
finally:
    daemon.terminate()
    daemon.wait()
    subprocess.run(["rm", "-rf", work])
