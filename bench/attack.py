#!/usr/bin/env python3
"""Floods by unauthenticated clients: the "Floods" figures in docs/benchmarks.md.

    bench/attack.py                      # every flood, against target/release/agentgate
    bench/attack.py idle-h2c keepalive   # some of them
    BIN=/path/to/agentgate bench/attack.py

For each flood, starts `agentgate serve` (BIN) on its default limits with one route on loopback
and `metrics_listen`, opens the flood, then sends a valid webhook on a fresh connection and
times its answer, reads the daemon's resident memory during the flood and 5 s after the flood's
connections are closed. Floods:

- idle-h2c: 4,100 connections that send the HTTP/2 preface and an empty SETTINGS frame, then
  nothing;
- keepalive: 4,096 HTTP/1.1 connections that each send one GET /healthz, then stay idle;
- metrics: 2,100 idle connections to metrics_listen;
- h2-streams: 50 HTTP/2 connections that each open as many streams as they are allowed (up to
  200) and send 16 KiB of each stream's body, without ending any;
- tiny-chunks: 200 HTTP/1.1 connections that send a chunked body one byte per chunk (1,000
  chunks each), without ending it;
- one-address: 4,096 keep-alive connections from one address (the others come from SOURCES
  loopback addresses, 64 by default, as a crowd would).
"""
import os
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import time

BINARY = os.environ.get("BIN", "target/release/agentgate")
PORT, METRICS_PORT = 18795, 18796
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind, flags, stream, payload):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def hpack_literal(index, value):
    """A header with an indexed name and a literal value, without indexing (RFC 7541 6.2.2):
    the name's index as a 4-bit prefixed integer (5.1)."""
    name = bytes([index]) if index < 15 else bytes([15, index - 15])
    return name + bytes([len(value)]) + value


# :method POST, :scheme http, :path /hook, :authority, content-type (static 31) application/json
HEADERS = (b"\x83\x86" + hpack_literal(4, b"/hook") + hpack_literal(1, b"127.0.0.1")
           + hpack_literal(31, b"application/json"))


def start(work):
    with open(f"{work}/agentgate.toml", "w") as config:
        config.write(f"""state_dir = "{work}/state"
[server]
listen = "127.0.0.1:{PORT}"
control_socket = "{work}/control.sock"
metrics_listen = "127.0.0.1:{METRICS_PORT}"
[model]
backend = "replay"
[routes.hook]
path = "/hook"
verify = {{ scheme = "none" }}
""")
    daemon = subprocess.Popen([BINARY, "serve", "--config", f"{work}/agentgate.toml"],
                              stderr=subprocess.DEVNULL)
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", METRICS_PORT), timeout=1).close()
            socket.create_connection(("127.0.0.1", PORT), timeout=1).close()
            return daemon
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the daemon did not start")


def rss_mib(daemon):
    with open(f"/proc/{daemon.pid}/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))


def webhook():
    """The seconds a valid webhook took to be answered (None: no answer within 60 s), and its code."""
    started = time.time()
    try:
        with socket.create_connection(("127.0.0.1", PORT), timeout=60) as conn:
            body = b'{"valid":true}'
            conn.sendall(b"POST /hook HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            answer = conn.recv(64)
        return time.time() - started, answer[9:12].decode(errors="replace")
    except OSError:
        return None, "none"


SOURCES = int(os.environ.get("SOURCES", "64"))
_next_source = 0


def connect(port):
    """A connection from the next of SOURCES loopback addresses (127.0.0.2 on), as a crowd of
    clients connects: one address holds at most server.max_connections_per_peer (256)."""
    global _next_source
    conn = socket.socket()
    conn.setblocking(True)
    conn.bind((f"127.0.0.{2 + _next_source % SOURCES}", 0))
    _next_source += 1
    conn.connect(("127.0.0.1", port))
    return conn


def one_address():
    """4,096 keep-alive connections from one address: past 256 it gets no more."""
    conns = []
    for _ in range(4096):
        try:
            conn = socket.create_connection(("127.0.0.1", PORT), timeout=5)
            conn.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            if not conn.recv(256):
                conn.close()
                continue
            conns.append(conn)
        except OSError:
            continue
    return conns


def idle_h2c():
    conns = []
    for _ in range(4100):
        conn = connect(PORT)
        conn.sendall(PREFACE + frame(4, 0, 0, b""))
        conns.append(conn)
    return conns


def keepalive():
    conns = []
    for _ in range(4096):
        try:
            conn = connect(PORT)
            conn.settimeout(5)
            conn.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            conn.recv(256)
            conns.append(conn)
        except OSError:
            break
    return conns


def metrics():
    return [connect(METRICS_PORT) for _ in range(2100)]


def h2_streams():
    conns = []
    chunk = b"x" * 16384
    for _ in range(50):
        conn = connect(PORT)
        conn.sendall(PREFACE + frame(4, 0, 0, b""))
        # The server's SETTINGS and window update: how much it lets a client send.
        conn.settimeout(0.5)
        try:
            conn.recv(65536)
        except OSError:
            pass
        conn.settimeout(None)
        conn.setblocking(False)
        for stream in range(1, 401, 2):
            try:
                conn.sendall(frame(1, 0x4, stream, HEADERS) + frame(0, 0, stream, chunk))
            except OSError:
                break
        conn.setblocking(True)
        conns.append(conn)
    return conns


def tiny_chunks():
    conns = []
    for _ in range(200):
        conn = connect(PORT)
        conn.sendall(b"POST /hook HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"transfer-encoding: chunked\r\n\r\n" + b"1\r\n \r\n" * 1000)
        conns.append(conn)
    return conns


FLOODS = {"idle-h2c": idle_h2c, "keepalive": keepalive, "metrics": metrics,
          "h2-streams": h2_streams, "tiny-chunks": tiny_chunks, "one-address": one_address}


def run(name):
    work = tempfile.mkdtemp(prefix="agentgate-attack.")
    daemon = start(work)
    try:
        before = rss_mib(daemon)
        conns = FLOODS[name]()
        time.sleep(1)
        during = rss_mib(daemon)
        took, code = webhook()
        for conn in conns:
            conn.close()
        time.sleep(5)
        after = rss_mib(daemon)
        answered = f"{took:.3f} s" if took is not None else "no answer in 60 s"
        print(f"{name}: {len(conns)} connections; valid webhook {code} in {answered}; "
              f"RSS {before} MiB before, {during} MiB during, {after} MiB 5 s after")
    finally:
        daemon.terminate()
        daemon.wait()


for flood in sys.argv[1:] or FLOODS:
    run(flood)
