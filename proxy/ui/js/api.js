// The memory API (/v1/memory) with the key and user the person typed in (sessionStorage).

const BASE = "/v1/memory";

export class ApiError extends Error {
  constructor(status, error) {
    super(error?.message || `HTTP ${status}`);
    this.status = status;
    this.code = error?.code || null;
    this.param = error?.param || null;
  }
}

export const access = {
  get key() { return sessionStorage.getItem("memproxy.key") || ""; },
  get user() { return sessionStorage.getItem("memproxy.user") || ""; },
  save(key, user) {
    sessionStorage.setItem("memproxy.key", key);
    sessionStorage.setItem("memproxy.user", user);
  },
};

function headers(extra = {}) {
  const out = { Accept: "application/json", ...extra };
  if (access.key) out.Authorization = `Bearer ${access.key}`;
  if (access.user) out["X-Memory-User-Id"] = access.user;
  return out;
}

// `base`: the admin API's /v1/admin for the usage view; the memory API's otherwise.
export async function api(method, path, { body, query, keepalive = false, base = BASE } = {}) {
  const url = new URL(base + path, location.origin);
  for (const [name, value] of Object.entries(query || {})) {
    if (value !== undefined && value !== null && value !== "") url.searchParams.set(name, value);
  }
  const init = { method, headers: headers(body ? { "Content-Type": "application/json" } : {}), keepalive };
  if (body) init.body = JSON.stringify(body);
  const response = await fetch(url, init);
  const data = await response.json().catch(() => null);
  if (!response.ok) throw new ApiError(response.status, data?.error);
  return data;
}
