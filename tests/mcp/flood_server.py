"""A stdio MCP server that floods its client, for agentgate's tests: once initialized, it says
without end that its tools changed (`notifications/tools/list_changed`, the same tools every
time) and writes to stderr without end. Plain JSON-RPC on stdin and stdout, no SDK.

Usage: flood_server.py LISTINGS_FILE [pages | wide | deep | pings | schema | schemas]
(each `tools/list` request appends its time there; with `pages`, it floods nothing but lists
its tools in pages without end, each naming a next one; with `wide`, it floods nothing but
answers every call with one line of 400,000 empty text blocks, 10 MB, below the MCP SDK's own
line limit of 16 MiB; with `deep`, it floods nothing but sends, before it answers a call, a
log notification of 1,700 objects nested 100 deep, under 1 MiB; with `pings`, it floods nothing
but answers a call with 200,000 `ping` requests, and reads nothing more; with `schema`, it
floods nothing but lists a tool whose input schema has 20,000 properties, under 1 MiB; with
`schemas`, it floods nothing but lists four pages, each a tool whose schema has 9,000)
"""

import json
import sys
import threading
import time

listings = sys.argv[1]
endless_pages = sys.argv[2:] == ["pages"]
wide = sys.argv[2:] == ["wide"]
deep = sys.argv[2:] == ["deep"]
pings = sys.argv[2:] == ["pings"]
schema = sys.argv[2:] == ["schema"]
schemas = sys.argv[2:] == ["schemas"]
lock = threading.Lock()


def send(message):
    with lock:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def flood():
    while True:
        send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        sys.stderr.write("flood " * 8 + "\n")
        sys.stderr.flush()
        time.sleep(0.0005)


TOOLS = [{"name": "noop", "description": "Does nothing.", "inputSchema": {"type": "object"}}]

for line in sys.stdin:
    message = json.loads(line)
    method, ident = message.get("method"), message.get("id")
    if method == "initialize":
        result = {
            "protocolVersion": message["params"]["protocolVersion"],
            "capabilities": {"tools": {"listChanged": True}},
            "serverInfo": {"name": "flood", "version": "1"},
        }
        send({"jsonrpc": "2.0", "id": ident, "result": result})
    elif method == "notifications/initialized":
        if not (endless_pages or wide or deep or pings or schema or schemas):
            threading.Thread(target=flood, daemon=True).start()
    elif method == "tools/list":
        with open(listings, "a", encoding="utf-8") as out:
            out.write("%f\n" % time.time())
        result = {"tools": TOOLS}
        if endless_pages:
            cursor = int((message.get("params") or {}).get("cursor") or 0)
            result = {"tools": [dict(TOOLS[0], name="noop%d" % cursor)], "nextCursor": str(cursor + 1)}
        if schemas:
            cursor = int((message.get("params") or {}).get("cursor") or 0)
            properties = {"p%d" % n: {"type": "string"} for n in range(9_000)}
            tool = dict(TOOLS[0], name="noop%d" % cursor, inputSchema={"type": "object", "properties": properties})
            result = {"tools": [tool], "nextCursor": str(cursor + 1) if cursor < 3 else None}
        if schema:
            properties = {"p%d" % n: {"type": "string"} for n in range(20_000)}
            result = {"tools": [dict(TOOLS[0], inputSchema={"type": "object", "properties": properties})]}
        send({"jsonrpc": "2.0", "id": ident, "result": result})
    elif method == "tools/call" and wide:
        blocks = [{"type": "text", "text": ""}] * 400_000
        send({"jsonrpc": "2.0", "id": ident, "result": {"content": blocks}})
    elif method == "tools/call" and deep:
        nested = 0
        for _ in range(100):
            nested = {"": nested}
        data = [nested] * 1_700
        send({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": data}})
        send({"jsonrpc": "2.0", "id": ident, "result": {"content": [{"type": "text", "text": "deep"}]}})
    elif method == "tools/call" and pings:
        for n in range(200_000):
            send({"jsonrpc": "2.0", "id": "ping-%d" % n, "method": "ping"})
        time.sleep(3600)
    elif ident is not None:
        error = {"code": -32601, "message": "no such method"}
        send({"jsonrpc": "2.0", "id": ident, "error": error})
