"""memproxy's MCP server: the memory as tools for MCP clients (docs/mcp.md).

    server.py     /mcp: Streamable HTTP (stateless), authorisation, the SDK's low-level server
    caller.py     the authorised caller, carried from the HTTP request to the handlers
    schemas.py    each tool's description, input and output schemas and annotations
    tools.py      the tools' work on the memory engine, each change through `decide`
    resources.py  the profile and session summaries, read as resources
    stdio.py      `memproxy mcp`: MCP on stdin/stdout, forwarded to a running memproxy

Only this package imports the `mcp` SDK.
"""
