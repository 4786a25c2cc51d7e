// The MCP TypeScript SDK's client against memproxy's /mcp over Streamable HTTP with a proxy
// key: list the tools, call each memory tool, then the errors. Prints one JSON line for
// tests/test_node_clients.py.  Usage: node mcp.mjs BASE_URL KEY
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [baseURL, key] = process.argv.slice(2);

async function connect(bearer) {
  const client = new Client({ name: "memproxy-node-test", version: "1.0.0" });
  const transport = new StreamableHTTPClientTransport(new URL(`${baseURL}/mcp`), {
    requestInit: { headers: { Authorization: `Bearer ${bearer}` } },
  });
  await client.connect(transport);
  return client;
}

const failure = (error) => ({ name: error.constructor.name, code: error.code ?? null, message: String(error.message) });
const client = await connect(key);
const tools = (await client.listTools()).tools.map((tool) => ({
  name: tool.name, readOnly: tool.annotations?.readOnlyHint ?? null,
  destructive: tool.annotations?.destructiveHint ?? null, hasOutputSchema: Boolean(tool.outputSchema),
}));
const added = (await client.callTool({
  name: "add_memory", arguments: { text: "User's home server runs NixOS on a Raspberry Pi 5.", category: "project" },
})).structuredContent;
const found = (await client.callTool({ name: "search_memory", arguments: { query: "Which OS is on the home server?" } })).structuredContent;
const listed = (await client.callTool({ name: "list_memories", arguments: { limit: 5 } })).structuredContent;
const deleted = (await client.callTool({ name: "delete_memory", arguments: { id: added.id } })).structuredContent;
const after = (await client.callTool({ name: "list_memories", arguments: {} })).structuredContent;
const undone = (await client.callTool({ name: "undo_delete", arguments: { undo_token: deleted.undo_token } })).structuredContent;
const restored = (await client.callTool({ name: "list_memories", arguments: {} })).structuredContent;
const badArguments = await client.callTool({ name: "add_memory", arguments: { text: 5 } });
let unknownTool = null;
try {
  await client.callTool({ name: "drop_tables", arguments: {} });
} catch (error) {
  unknownTool = failure(error);
}
await client.close();
let wrongKey = null;
try {
  await (await connect("key-not-a-real-one")).listTools();
} catch (error) {
  wrongKey = failure(error);
}
console.log(JSON.stringify({
  tools, added, found, listed, deleted, after, undone, restored,
  badArguments: { isError: badArguments.isError ?? false, text: badArguments.content.map((c) => c.text).join(" ") },
  unknownTool, wrongKey,
}));
