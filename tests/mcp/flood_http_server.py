"""An MCP server on the streamable HTTP transport that sends requests and never reads the
replies, for agentgate's tests: it answers a `tools/call` with an event stream of 200,000 `ping`
requests, and holds every POST that carries a reply open without answering it. Plain JSON-RPC
over Python's own HTTP server, no SDK; one tool, `noop`. With `listing`, it sends the pings on
the session's own stream (the GET) instead, and never answers `tools/list`.

Usage: flood_http_server.py PORT [listing]
"""

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port = int(sys.argv[1])
listing = sys.argv[2:] == ["listing"]
TOOLS = [{"name": "noop", "description": "Does nothing.", "inputSchema": {"type": "object"}}]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, status, body=None, headers=()):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def pings(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for n in range(200_000):
            ping = {"jsonrpc": "2.0", "id": "ping-%d" % n, "method": "ping"}
            self.wfile.write(b"event: message\ndata: " + json.dumps(ping).encode() + b"\n\n")
        self.wfile.flush()
        time.sleep(3600)

    def do_GET(self):
        if listing:
            self.pings()
        else:
            # No stream of its own: everything comes in answer to a POST.
            self.answer(405)

    def do_DELETE(self):
        self.answer(200)

    def do_POST(self):
        message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        method, ident = message.get("method"), message.get("id")
        if method is None:
            # A reply to one of its pings: never answered.
            time.sleep(3600)
        elif ident is None:
            self.answer(202)
        elif method == "initialize":
            result = {
                "protocolVersion": "2025-06-18",
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "flood-http", "version": "1"},
            }
            reply = {"jsonrpc": "2.0", "id": ident, "result": result}
            self.answer(200, reply, [("Mcp-Session-Id", "flood")])
        elif method == "tools/list" and listing:
            time.sleep(3600)
        elif method == "tools/list":
            self.answer(200, {"jsonrpc": "2.0", "id": ident, "result": {"tools": TOOLS}})
        elif method == "tools/call":
            self.pings()
        else:
            error = {"code": -32601, "message": "no such method"}
            self.answer(200, {"jsonrpc": "2.0", "id": ident, "error": error})


server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
server.daemon_threads = True
print(f"listening on 127.0.0.1:{port}", flush=True)
server.serve_forever()
