// Keys (the admin key only): list the proxy keys, make one (its secret shown once), revoke.
// Talks to /v1/admin/keys with the key typed above; another key gets the API's 403.

import { access, ApiError } from "./api.js";
import { h, problem, toast, when } from "./dom.js";

const $ = (id) => document.getElementById(id);

async function admin(method, path, body) {
  const headers = { Accept: "application/json" };
  if (access.key) headers.Authorization = `Bearer ${access.key}`;
  if (body) headers["Content-Type"] = "application/json";
  const response = await fetch(`/v1/admin${path}`, { method, headers, body: body ? JSON.stringify(body) : undefined });
  const data = await response.json().catch(() => null);
  if (!response.ok) throw new ApiError(response.status, data?.error);
  return data;
}

export function setupKeys() {
  $("create-key").addEventListener("submit", createKey);
  $("secret-done").addEventListener("click", () => {
    $("new-secret").textContent = "";
    $("secret-box").hidden = true;
  });
}

export async function loadKeys() {
  try {
    const { data } = await admin("GET", "/keys");
    $("key-list").replaceChildren(...data.map(keyCard));
    if (!data.length) $("key-list").append(h("li", { class: "empty" }, "No keys yet."));
    problem(null);
  } catch (error) {
    $("key-list").replaceChildren();
    problem(error);
  }
}

function keyCard(key) {
  const bound = [key.user ? `user ${key.user}` : "no user",
    key.org ? `org ${key.org}${key.org_writer ? " (writer)" : ""}` : null].filter(Boolean).join(" · ");
  const limits = [key.rate_limit ? `${key.rate_limit}/min` : null,
    key.token_quota !== null ? `${key.token_quota} tokens/month` : null,
    key.expires_at ? `expires ${when(key.expires_at)}` : null].filter(Boolean).join(" · ");
  const revocable = key.source === "database" && key.status !== "revoked";
  return h("li", { class: `card key ${key.status}`, dataset: { id: key.id } },
    h("div", { class: "meta" },
      h("strong", {}, key.prefix ? `${key.prefix}…` : key.id),
      h("span", { class: "badge" }, key.source === "env" ? "MEMPROXY_API_KEYS" : key.status)),
    h("p", { class: "text" }, bound),
    limits ? h("p", { class: "muted hint" }, limits) : null,
    h("div", { class: "meta" },
      h("span", { class: "muted" }, key.last_used_at ? `last used ${when(key.last_used_at)}` : key.id),
      revocable ? h("button", { type: "button", class: "danger", "aria-label": `Revoke: ${key.id}`,
        onclick: () => revokeKey(key) }, "Revoke") : null));
}

async function createKey(event) {
  event.preventDefault();
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  const expires = $("key-expires").value;
  const body = {
    user: $("key-user").value.trim() || null,
    org: $("key-org").value.trim() || undefined,
    org_writer: $("key-org-writer").checked || undefined,
    rate_limit: number("key-rate"),
    token_quota: number("key-quota"),
    expires_at: expires ? Date.parse(`${expires}T00:00:00Z`) / 1000 : undefined,
  };
  try {
    const made = await admin("POST", "/keys", body);
    $("new-secret").textContent = made.key;
    $("secret-box").hidden = false;
    $("create-key").reset();
    await loadKeys();
  } catch (error) {
    problem(error);
  }
}

async function revokeKey(key) {
  if (!confirm(`Revoke ${key.prefix || key.id}? Requests with it are refused within seconds.`)) return;
  try {
    await admin("DELETE", `/keys/${encodeURIComponent(key.id)}`);
    toast(`Revoked ${key.prefix || key.id}.`, { seconds: 3 });
    await loadKeys();
  } catch (error) {
    problem(error);
  }
}
