"""An MCP server on the streamable HTTP transport, for agentgate's tests.

Usage: http_server.py PORT TOKEN CALLS_FILE

Every request must carry `X-Test-Token: TOKEN` (agentgate sends it from a secret), else 401.
The `grow` tool adds a tool and sends `notifications/tools/list_changed`. The `shout` tool
upper-cases its text (and `wide` answers with 2 MiB of it); each `shout` call appends the idempotency key agentgate put in
the request's `_meta`, and the text, to CALLS_FILE, so a test can see what arrived, and the
`traceparent` of the `_meta` and of the HTTP request's header (each "-" when absent) to
CALLS_FILE.trace.
"""

import sys

import uvicorn
from mcp.server.mcpserver import Context, MCPServer

port, token, calls_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
server = MCPServer("agentgate-test-http")


@server.tool()
def shout(text: str, ctx: Context) -> str:
    """Upper-cases the text."""
    meta = ctx.request_context.meta
    key = None
    if meta is not None:
        extra = meta.model_dump() if hasattr(meta, "model_dump") else dict(meta)
        key = extra.get("agentgate/tool_call_id")
        traceparent = extra.get("traceparent") or "-"
    else:
        traceparent = "-"
    with open(calls_file, "a", encoding="utf-8") as calls:
        calls.write(f"{key} {text}\n")
    request = ctx.request_context.request
    header = request.headers.get("traceparent", "-") if request is not None else "-"
    with open(calls_file + ".trace", "a", encoding="utf-8") as traces:
        traces.write(f"{traceparent} {header}\n")
    return text.upper()


@server.tool()
async def grow(name: str, ctx: Context) -> str:
    """Adds a tool called NAME, and tells the client that the tool list changed."""

    def added() -> str:
        return f"{name} was added at run time"

    server.add_tool(added, name=name, description="A tool added at run time")
    # The notification as protocol versions before 2026-07-28 send it, to the session; and to
    # `subscriptions/listen` subscribers, as later ones do.
    await ctx.session.send_tool_list_changed()
    await ctx.notify_tools_changed()
    return f"added {name}"


@server.tool()
def wide() -> str:
    """Answers with 2 MiB of text, more than agentgate reads of one MCP message."""
    return "x" * (2 * 1024 * 1024)


app = server.streamable_http_app()


async def require_token(scope, receive, send):
    if scope["type"] == "http":
        headers = dict(scope["headers"])
        if headers.get(b"x-test-token", b"").decode() != token:
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b"missing token"})
            return
    await app(scope, receive, send)


print(f"listening on 127.0.0.1:{port}", flush=True)
uvicorn.run(require_token, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
