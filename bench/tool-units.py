"""Per-call cost of a tool unit (docs/benchmarks.md, "Tool units").

Run inside a booted systemd with agentgate-tool.socket started, as the service's user in a
unit named agentgate.service (the only caller a tool unit admits): python3 tool-units.py CALLS. Makes CALLS calls of /bin/true in the sandbox, once through
/run/agentgate/tool.sock (a unit per call, as the daemon does it) and once by starting bubblewrap
directly (as outside systemd), alternating, and prints the medians and 95th percentiles in ms.
"""
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time

# What the daemon sends: at least the floor a tool unit holds every request to.
CONFINEMENT = {
    "network": False,
    "writable": [],
    "hidden_dirs": ["/etc/agentgate/credentials", "/run/agentgate", "/run/credentials",
                    "/var/lib/agentgate"],
    "hidden_files": ["/run/agentgate/tool.sock"],
}
WRAPPER = ["/usr/bin/bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop",
           "ALL", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
           "--setenv", "HOME", "/tmp", "--tmpfs", "/sys/fs/cgroup", "--tmpfs", "/run", "--chdir", "/",
           "--"]


def through_unit():
    request = json.dumps({"Run": {"program": "/bin/true", "args": [], "env": [], "cwd": None,
                                  "confinement": CONFINEMENT}}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect("/run/agentgate/tool.sock")
        conn.sendall(struct.pack(">I", len(request)) + request)
        # The unit's pipes first (one marker byte and the daemon's three ends), then the answer:
        # closing our ends gives the call an empty stdin and discards its output.
        mark, fds, _, _ = socket.recv_fds(conn, 1, 3)
        assert mark == b"\0" and len(fds) == 3, (mark, fds)
        for fd in fds:
            os.close(fd)
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    reply = json.loads(answer.split(b"\n")[0])
    assert reply == {"Exited": 0}, reply


def direct():
    subprocess.run(WRAPPER + ["/bin/true"], check=True, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL)


def timed(call):
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def main():
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    unit, local = [], []
    for _ in range(calls):
        unit.append(timed(through_unit))
        local.append(timed(direct))
    for name, times in (("unit", unit), ("direct", local)):
        times.sort()
        p95 = times[int(len(times) * 0.95) - 1]
        print(f"{name}: calls {len(times)} median {statistics.median(times):.1f} ms p95 {p95:.1f} ms")


main()
