// Usage (the admin key only): requests, tokens and errors per day, key and user, from
// GET /v1/admin/usage, as a table with the range's totals.

import { ApiError, api } from "./api.js";
import { h } from "./dom.js";

const $ = (id) => document.getElementById(id);
const COUNTERS = ["requests", "input_tokens", "output_tokens", "memory_tokens", "errors"];
const NAMES = ["Requests", "Input", "Output", "Memory", "Errors"];

function today() {
  return new Date().toISOString().slice(0, 10); // UTC, as the server counts days
}

export function setupUsage() {
  $("usage-to").value = today();
  $("usage-from").value = today().slice(0, 8) + "01";
  $("usage-form").addEventListener("submit", (event) => { event.preventDefault(); loadUsage(); });
  $("usage-by").addEventListener("change", loadUsage);
}

export async function loadUsage() {
  const by = $("usage-by").value;
  const query = { from: $("usage-from").value, to: $("usage-to").value };
  const note = $("usage-note");
  try {
    const report = await api("GET", "/usage", { query, base: "/v1/admin" });
    const rows = by === "key" ? report.by_key : by === "user" ? report.by_user : report.data;
    const firsts = by === "key" ? ["Key"] : by === "user" ? ["User"] : ["Day", "Key", "User"];
    const cells = (row) => (by === "key" ? [row.key_id] : by === "user" ? [row.user_id || "–"]
      : [row.day, row.key_id, row.user_id || "–"]);
    $("usage-table").replaceChildren(
      h("thead", {}, h("tr", {}, [...firsts.map((name) => h("th", { scope: "col" }, name)), ...NAMES.map((name) => h("th", { scope: "col", class: "number" }, name))])),
      h("tbody", {}, rows.map((row) => h("tr", {},
        cells(row).map((cell) => h("td", {}, cell)),
        COUNTERS.map((name) => h("td", { class: "number" }, String(row[name]))))),
      ),
    );
    $("usage-totals").replaceChildren(...COUNTERS.flatMap((name, i) => [
      h("dt", {}, NAMES[i]), h("dd", {}, String(report.totals[name])),
    ]));
    note.textContent = rows.length ? (report.has_more ? "More rows than shown: the totals count them all." : "")
      : "No usage in this range.";
  } catch (error) {
    $("usage-table").replaceChildren();
    $("usage-totals").replaceChildren();
    // The view's own message: the rest of the panel works with any key.
    note.textContent = error instanceof ApiError && (error.status === 401 || error.status === 403)
      ? "Usage is shown to the admin key only: enter MEMPROXY_ADMIN_KEY above."
      : error.message;
  }
}
