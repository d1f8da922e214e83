"""A stdio MCP server that floods its client, for bench/mcp-flood.sh: once initialized, it
writes without end, as fast as its pipes take it, `notifications/tools/list_changed` (`notes`),
stderr lines (`stderr`), both (`both`), log notifications of 1,000,000 bytes each, under the
1 MiB bound on a message (`large`), lines that are no JSON (`junk`), or one stderr line without
end (`endless`). Plain JSON-RPC, no SDK.

Usage: mcp-spew.py notes|stderr|both|large|junk|endless
"""

import json, sys, threading
mode = sys.argv[1]
def send(m):
    sys.stdout.write(json.dumps(m) + "\n"); sys.stdout.flush()
def flood():
    note = json.dumps({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}) + "\n"
    err = "spew " * 8 + "\n"
    large = json.dumps({"jsonrpc": "2.0", "method": "notifications/message",
                        "params": {"level": "info", "data": "x" * 999_900}}) + "\n"
    junk = "x\n" * 32768
    endless = "e" * 65536
    while True:
        if mode == "junk":
            sys.stdout.write(junk); sys.stdout.flush()
        if mode == "endless":
            sys.stderr.write(endless); sys.stderr.flush()
        if mode == "large":
            sys.stdout.write(large); sys.stdout.flush()
        if mode in ("notes", "both"):
            sys.stdout.write(note * 64); sys.stdout.flush()
        if mode in ("stderr", "both"):
            sys.stderr.write(err * 64); sys.stderr.flush()
for line in sys.stdin:
    m = json.loads(line); method, ident = m.get("method"), m.get("id")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": ident, "result": {"protocolVersion": m["params"]["protocolVersion"], "capabilities": {"tools": {"listChanged": True}}, "serverInfo": {"name": "spew", "version": "1"}}})
    elif method == "notifications/initialized":
        threading.Thread(target=flood, daemon=True).start()
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": ident, "result": {"tools": [{"name": "noop", "inputSchema": {"type": "object"}}]}})
    elif ident is not None:
        send({"jsonrpc": "2.0", "id": ident, "error": {"code": -32601, "message": "no"}})
