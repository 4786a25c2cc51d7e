// The memory panel: access (key and user in sessionStorage), tabs, and each view's loader.

import { access, api } from "./api.js";
import { problem } from "./dom.js";
import { loadFacts, setupFacts } from "./facts.js";
import { setupInspector } from "./inspector.js";
import { loadKeys, setupKeys } from "./keys.js";
import { loadMetrics, setupMetrics } from "./metrics.js";
import { loadSessions, setupSessions } from "./sessions.js";
import { loadUsage, setupUsage } from "./usage.js";

const $ = (id) => document.getElementById(id);
const loaders = {
  facts: loadFacts, inspector: async () => {}, sessions: loadSessions, metrics: loadMetrics,
  keys: loadKeys, usage: loadUsage,
};

function select(name) {
  for (const tab of document.querySelectorAll("[role=tab]")) {
    const chosen = tab.id === `tab-${name}`;
    tab.setAttribute("aria-selected", String(chosen));
    tab.tabIndex = chosen ? 0 : -1;
    $(tab.getAttribute("aria-controls")).hidden = !chosen;
  }
  return loaders[name]();
}

function setupTabs() {
  const tabs = [...document.querySelectorAll("[role=tab]")];
  tabs.forEach((tab, index) => {
    tab.addEventListener("click", () => select(tab.id.slice(4)));
    tab.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (!step) return;
      const next = tabs[(index + step + tabs.length) % tabs.length];
      next.focus();
      select(next.id.slice(4));
    });
  });
}

async function start() {
  $("key").value = access.key;
  $("user").value = access.user;
  $("access").addEventListener("submit", async (event) => {
    event.preventDefault();
    access.save($("key").value.trim(), $("user").value.trim());
    await boot();
  });
  setupTabs();
  setupFacts();
  setupSessions();
  setupMetrics();
  setupKeys();
  setupUsage();
  await boot();
}

let inspectorReady = false;

async function boot() {
  try {
    const stats = await api("GET", "/stats");
    if (!inspectorReady) { setupInspector(stats.limits); inspectorReady = true; }
    problem(null);
    const current = document.querySelector("[role=tab][aria-selected=true]").id.slice(4);
    await select(current);
    document.body.dataset.ready = "true";
  } catch (error) {
    problem(error);
    document.body.dataset.ready = "error";
  }
}

start();
