// openai-node's Responses API against memproxy: a create, a raw stream continuing it by
// previous_response_id, and the stream helper. Prints one JSON line for
// tests/test_node_clients.py.  Usage: node responses.mjs BASE_URL USER_ID FIRST SECOND
import OpenAI from "openai";

const [baseURL, userId, first, second] = process.argv.slice(2);
const client = new OpenAI({
  baseURL, apiKey: "sk-node", maxRetries: 0, defaultHeaders: { "X-Memory-User-Id": userId },
});

const created = await client.responses.create({ model: "gpt-4o-mini", input: first });
let streamed = "";
const stream = await client.responses.create({
  model: "gpt-4o-mini", input: [{ role: "user", content: second }], stream: true,
  previous_response_id: created.id,
});
for await (const event of stream) {
  if (event.type === "response.output_text.delta") streamed += event.delta;
}
const helper = client.responses.stream({ model: "gpt-4o-mini", input: second });
const final = await helper.finalResponse();
console.log(JSON.stringify({ id: created.id, created: created.output_text, streamed, final: final.output_text }));
