// "What would be injected": the block, its items with sources and scores, tokens vs budget.

import { api } from "./api.js";
import { h, problem, when } from "./dom.js";

const $ = (id) => document.getElementById(id);

export function setupInspector(defaults) {
  $("inspect-budget").value = defaults.memory_budget;
  $("inspect-scope").value = defaults.memory_scope;
  $("inspect").addEventListener("submit", inspect);
}

async function inspect(event) {
  event.preventDefault();
  const body = { query: $("inspect-query").value, scope: $("inspect-scope").value };
  const budget = $("inspect-budget").value;
  if (budget !== "") body.budget = Number(budget);
  const session = $("inspect-session").value.trim();
  if (session) body.session_id = session;
  try {
    show(await api("POST", "/search", { body }));
    problem(null);
  } catch (error) {
    problem(error);
  }
}

function show(result) {
  $("inspect-result").hidden = false;
  $("inspect-tokens").textContent = `${result.tokens} / ${result.budget} tokens` +
    `${result.truncated ? " (truncated)" : ""} · ${result.items.length} items · ${result.recall_ms.toFixed(1)} ms`;
  const meter = $("inspect-meter");
  meter.max = Math.max(1, result.budget);
  meter.value = result.tokens;
  $("inspect-block").textContent = result.block || `Nothing would be injected${result.skipped ? ` (${result.skipped})` : ""}.`;
  $("inspect-items").replaceChildren(...result.items.map((item) => h("li", { class: "item" },
    h("div", { class: "item-head" },
      h("span", { class: "badge" }, item.source),
      h("strong", {}, `score ${item.score.toFixed(3)}`),
      h("span", { class: "muted" }, `${item.speaker || ""} · ${item.session_id || ""} · ${when(item.created_at)}`)),
    h("p", {}, item.text),
    h("p", { class: "signals muted" }, Object.entries(item.signals)
      .map(([name, value]) => `${name} ${Number(value).toFixed(3)}`).join(" · ")))));
}
