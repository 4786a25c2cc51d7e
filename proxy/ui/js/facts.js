// Facts: cards grouped by category, inline edit, pin, delete with undo, filters, clear all.

import { api } from "./api.js";
import { h, plural, problem, toast, when } from "./dom.js";

export const CATEGORIES = ["identity", "preference", "project", "relationship", "context", "todo", "decision"];
const DELETE_UNDO_SECONDS = 4;

const state = { facts: [], cursor: null, pendingDeletes: new Map(), filterTimer: null };
const $ = (id) => document.getElementById(id);

export function setupFacts() {
  for (const select of [$("new-category"), $("filter-category")]) {
    for (const name of CATEGORIES) select.append(h("option", { value: name }, name));
  }
  $("new-category").value = "preference";
  $("add-fact").addEventListener("submit", addFact);
  $("filter-q").addEventListener("input", () => {
    clearTimeout(state.filterTimer);
    state.filterTimer = setTimeout(loadFacts, 250);
  });
  $("filter-category").addEventListener("change", loadFacts);
  $("filter-pinned").addEventListener("change", loadFacts);
  $("more-facts").addEventListener("click", () => loadFacts({ more: true }));
  $("clear-all").addEventListener("click", confirmClear);
  // Leaving the page inside an undo window: the delete still happens.
  addEventListener("pagehide", () => {
    for (const id of state.pendingDeletes.keys()) api("DELETE", `/facts/${id}`, { keepalive: true });
  });
}

export async function loadFacts({ more = false } = {}) {
  try {
    const page = await api("GET", "/facts", { query: {
      q: $("filter-q").value.trim(), category: $("filter-category").value,
      pinned: $("filter-pinned").checked ? "true" : "", limit: 100,
      cursor: more ? state.cursor : "",
    } });
    state.facts = more ? [...state.facts, ...page.data] : page.data;
    state.cursor = page.next_cursor;
    problem(null);
    render();
    await refreshCounts();
  } catch (error) {
    problem(error);
  }
}

function visible() {
  return state.facts.filter((fact) => !state.pendingDeletes.has(fact.id));
}

function render() {
  const groups = $("groups");
  groups.replaceChildren();
  const facts = visible();
  for (const category of CATEGORIES) {
    const members = facts.filter((fact) => fact.category === category);
    if (!members.length) continue;
    const heading = `group-${category}`;
    groups.append(h("section", { class: "group", "aria-labelledby": heading, dataset: { category } },
      h("h2", { id: heading }, `${category} `, h("span", { class: "muted" }, `(${members.length})`)),
      h("ul", { class: "cards" }, members.map(card))));
  }
  if (!facts.length) groups.append(h("p", { class: "empty" }, "Nothing remembered here yet."));
  $("more-facts").hidden = !state.cursor;
}

function card(fact) {
  const percent = Math.round(fact.confidence * 100);
  const bar = h("span", { class: "fill" });
  bar.style.width = `${percent}%`;
  const text = h("p", { class: "text" }, fact.text);
  const node = h("li", { class: `card${fact.pinned ? " pinned" : ""}`, dataset: { id: fact.id } },
    text,
    h("div", { class: "confidence", role: "meter", "aria-label": `Confidence ${percent}%`,
      "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": percent }, bar),
    h("div", { class: "meta" },
      h("span", { class: "muted" }, `${percent}% · seen ${plural(fact.mentions, "time")} · ${when(fact.last_seen)}${fact.version > 1 ? ` · v${fact.version}` : ""}`),
      h("span", { class: "actions" },
        h("button", { type: "button", class: "pin", "aria-pressed": fact.pinned ? "true" : "false",
          "aria-label": `${fact.pinned ? "Unpin" : "Pin"}: ${fact.text}`, onclick: () => pin(fact) },
          fact.pinned ? "Pinned" : "Pin"),
        h("button", { type: "button", class: "edit", "aria-label": `Edit: ${fact.text}`,
          onclick: () => edit(fact, node, text) }, "Edit"),
        h("button", { type: "button", class: "delete", "aria-label": `Delete: ${fact.text}`,
          onclick: () => remove(fact) }, "Delete"))));
  return node;
}

async function addFact(event) {
  event.preventDefault();
  const input = $("new-text");
  try {
    await api("POST", "/facts", { body: { text: input.value, category: $("new-category").value } });
    input.value = "";
    toast("Fact added.", { seconds: 2 });
    await loadFacts();
  } catch (error) {
    problem(error);
  }
}

function edit(fact, node, text) {
  const field = h("input", { type: "text", class: "edit-text", value: fact.text, maxlength: 1000,
    "aria-label": "Edit fact text (Enter saves, Escape cancels)" });
  const hint = h("span", { class: "muted hint" }, "Enter saves · Escape cancels");
  const cancel = () => { field.replaceWith(text); hint.remove(); node.querySelector(".edit").focus(); };
  field.addEventListener("keydown", async (event) => {
    if (event.key === "Escape") { event.preventDefault(); cancel(); }
    if (event.key !== "Enter") return;
    event.preventDefault();
    if (field.value.trim() === fact.text) { cancel(); return; }
    try {
      await api("PATCH", `/facts/${fact.id}`, { body: { text: field.value } });
      toast("Fact updated; the old version is kept in its history.", { seconds: 2 });
      await loadFacts();
    } catch (error) {
      problem(error);
    }
  });
  text.replaceWith(field);
  field.after(hint);
  field.focus();
  field.select();
}

async function pin(fact) {
  try {
    await api("POST", `/facts/${fact.id}/${fact.pinned ? "unpin" : "pin"}`);
    await loadFacts();
  } catch (error) {
    problem(error);
  }
}

function remove(fact) {
  // Hidden now, deleted when the undo toast runs out.
  const commit = async () => {
    if (!state.pendingDeletes.delete(fact.id)) return;
    try {
      await api("DELETE", `/facts/${fact.id}`);
      state.facts = state.facts.filter((f) => f.id !== fact.id);
      await refreshCounts();
    } catch (error) {
      problem(error);
      render();
    }
  };
  const handle = toast(`Deleted “${fact.text}”.`, {
    action: "Undo", seconds: DELETE_UNDO_SECONDS, onExpire: commit,
    onAction: () => { state.pendingDeletes.delete(fact.id); render(); },
  });
  state.pendingDeletes.set(fact.id, handle);
  render();
}

async function refreshCounts() {
  const stats = await api("GET", "/stats");
  const counts = stats.counts;
  $("fact-count").textContent = `${plural(counts.facts, "fact")} · ${plural(counts.turns, "turn")} in ${plural(counts.sessions, "session")}`;
  const total = counts.facts + counts.turns + counts.summaries;
  $("clear-all").textContent = `Clear all (${plural(counts.facts, "fact")}, ${plural(counts.turns, "turn")})…`;
  $("clear-all").disabled = total === 0 && !counts.profile;
  return stats;
}

async function confirmClear() {
  const stats = await refreshCounts();
  const c = stats.counts;
  $("confirm-text").textContent =
    `This removes ${plural(c.facts, "fact")}, ${plural(c.turns, "turn")} in ${plural(c.sessions, "session")}` +
    `${c.summaries ? `, ${plural(c.summaries, "summary")}` : ""}${c.profile ? " and your profile" : ""}. ` +
    `You can undo it for ${stats.limits.clear_undo_seconds} seconds.`;
  const dialog = $("confirm-clear");
  dialog.returnValue = "";
  dialog.addEventListener("close", async () => {
    if (dialog.returnValue === "clear") await clearAll();
  }, { once: true });
  dialog.showModal();
}

async function clearAll() {
  try {
    const receipt = await api("POST", "/clear");
    await loadFacts();
    showUndoBar(receipt);
  } catch (error) {
    problem(error);
  }
}

function showUndoBar(receipt) {
  const bar = $("undo-bar");
  const r = receipt.removed;
  const label = h("span", {}, `Cleared ${plural(r.facts, "fact")}, ${plural(r.turns, "turn")} and ${plural(r.sessions, "session")}.`);
  const left = h("span", { class: "muted countdown" });
  const undo = h("button", { type: "button", id: "undo-clear" }, "Undo");
  bar.replaceChildren(label, left, undo);
  bar.hidden = false;
  const tick = () => {
    const seconds = Math.max(0, Math.ceil(receipt.expires_at - Date.now() / 1000));
    left.textContent = `${seconds}s to undo`;
    if (seconds <= 0) finish("Memory cleared for good.");
  };
  const timer = setInterval(tick, 250);
  const finish = (message) => {
    clearInterval(timer);
    bar.replaceChildren(h("span", {}, message));
    setTimeout(() => { bar.hidden = true; }, 3000);
  };
  undo.addEventListener("click", async () => {
    undo.disabled = true;
    try {
      await api("POST", "/clear/undo", { body: { undo_token: receipt.undo_token } });
      finish("Everything is back.");
      await loadFacts();
    } catch (error) {
      finish(error.message);
    }
  });
  tick();
  undo.focus();
}
