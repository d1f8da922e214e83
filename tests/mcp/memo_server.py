"""An MCP server on stdio that remembers, for agentgate's tests of per-session processes.

Usage: memo_server.py

`remember` keeps a value in the process; `recall` returns what this process was given, or
"nothing". A process shared by two sessions would hand one session's value to the other.
"""

from mcp.server.mcpserver import MCPServer

server = MCPServer("agentgate-test-memo")
remembered: list[str] = []


@server.tool()
def remember(value: str) -> str:
    """Keeps the value for a later recall."""
    remembered.append(value)
    return f"remembered {len(remembered)}"


@server.tool()
def recall() -> str:
    """What was remembered, or "nothing"."""
    return ", ".join(remembered) or "nothing"


server.run()
