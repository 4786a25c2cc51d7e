// Sessions: most recently active first; pick one to read its turns or delete it.

import { api } from "./api.js";
import { h, plural, problem, toast, when } from "./dom.js";

const $ = (id) => document.getElementById(id);
const state = { sessions: [], cursor: null };

export function setupSessions() {
  $("more-sessions").addEventListener("click", () => loadSessions({ more: true }));
}

export async function loadSessions({ more = false } = {}) {
  try {
    const page = await api("GET", "/sessions", { query: { limit: 50, cursor: more ? state.cursor : "" } });
    state.sessions = more ? [...state.sessions, ...page.data] : page.data;
    state.cursor = page.next_cursor;
    $("session-list").replaceChildren(...state.sessions.map((s) => h("li", {},
      h("button", { type: "button", class: "session", onclick: () => showSession(s.session_id) },
        h("strong", {}, s.title || s.session_id),
        h("span", { class: "muted" }, `${plural(s.turns, "turn")} · ${when(s.last_active)}`)))));
    if (!state.sessions.length) $("session-list").append(h("li", { class: "empty" }, "No sessions yet."));
    $("more-sessions").hidden = !state.cursor;
    problem(null);
  } catch (error) {
    problem(error);
  }
}

async function showSession(id) {
  const detail = $("session-detail");
  try {
    const turns = [];
    let cursor = "";
    do {
      const page = await api("GET", "/turns", { query: { session_id: id, limit: 500, cursor } });
      turns.push(...page.data);
      cursor = page.next_cursor;
    } while (cursor);
    detail.replaceChildren(
      h("div", { class: "row between" },
        h("h2", {}, id),
        h("button", { type: "button", class: "danger", onclick: () => deleteSession(id) }, "Delete session")),
      h("ol", { class: "turns", "aria-label": `Turns of ${id}` }, turns.map((turn) => h("li", { class: `turn ${turn.role}` },
        h("div", { class: "muted" }, `${turn.name || turn.role} · ${when(turn.created_at)}${turn.incomplete ? " · incomplete" : ""}`),
        h("p", {}, turn.content)))));
    detail.querySelector("h2").focus?.();
  } catch (error) {
    problem(error);
  }
}

async function deleteSession(id) {
  if (!confirm(`Delete session ${id}, its turns and the facts learned only from it?`)) return;
  try {
    const result = await api("DELETE", `/sessions/${encodeURIComponent(id)}`);
    toast(`Deleted ${id}: ${plural(result.removed.turns, "turn")}.`, { seconds: 3 });
    $("session-detail").replaceChildren();
    await loadSessions();
  } catch (error) {
    problem(error);
  }
}
