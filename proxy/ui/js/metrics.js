// Metrics: recall latency and injected tokens per request over time, as inline SVG charts.

import { api } from "./api.js";
import { h, problem } from "./dom.js";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

export function setupMetrics() {
  $("metrics-range").addEventListener("change", loadMetrics);
}

export async function loadMetrics() {
  const until = Date.now() / 1000 + 1;
  const since = until - Number($("metrics-range").value);
  try {
    const result = await api("GET", "/metrics", { query: { since, until, limit: 5000 } });
    const s = result.summary;
    $("metrics-summary").replaceChildren(...[
      ["requests", s.requests], ["recall p50", ms(s.recall_ms_p50)], ["recall p95", ms(s.recall_ms_p95)],
      ["tokens (mean)", s.injected_tokens_mean ?? "–"], ["truncated", s.truncated], ["errors", s.errors],
    ].flatMap(([name, value]) => [h("dt", {}, name), h("dd", {}, String(value))]));
    // The x axis spans the requests themselves (the range's ends when there are few).
    const times = result.data.map((row) => row.created_at);
    const start = times.length > 1 ? times[0] : since;
    const end = times.length > 1 ? times[times.length - 1] : until;
    chart($("chart-latency"), result.data, "recall_ms", start, end, "ms");
    chart($("chart-tokens"), result.data, "injected_tokens", start, end, "tokens");
    problem(null);
  } catch (error) {
    problem(error);
  }
}

function ms(value) {
  return value === null || value === undefined ? "–" : `${value.toFixed(1)} ms`;
}

function clock(seconds) {
  return new Date(seconds * 1000).toLocaleString(undefined, { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  return node;
}

function chart(box, rows, field, since, until, unit) {
  const points = rows.filter((row) => row[field] !== null && row[field] !== undefined);
  const width = 600, height = 170, pad = 28;
  const max = Math.max(1, ...points.map((row) => row[field]));
  const span = Math.max(until - since, 1e-3);
  const x = (t) => pad + 6 + ((t - since) / span) * (width - pad - 16);
  const y = (v) => height - pad - (v / max) * (height - pad - 8);
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", class: "plot",
    "aria-label": `${points.length} requests; highest ${Math.round(max)} ${unit}` });
  root.append(svg("line", { x1: pad, y1: y(0), x2: width - 4, y2: y(0), class: "axis" }));
  root.append(svg("line", { x1: pad, y1: y(0), x2: pad, y2: y(max), class: "axis" }));
  const top = svg("text", { x: 2, y: y(max) + 4, class: "tick" });
  top.textContent = String(Math.round(max));
  const zero = svg("text", { x: 2, y: y(0) + 4, class: "tick" });
  zero.textContent = "0";
  const first = svg("text", { x: pad, y: height - 2, class: "tick" });
  first.textContent = clock(since);
  const last = svg("text", { x: width - 4, y: height - 2, class: "tick", "text-anchor": "end" });
  last.textContent = clock(until);
  root.append(top, zero, first, last);
  if (points.length) {
    root.append(svg("polyline", { class: "line",
      points: points.map((row) => `${x(row.created_at).toFixed(1)},${y(row[field]).toFixed(1)}`).join(" ") }));
    for (const row of points) {
      const dot = svg("circle", { cx: x(row.created_at).toFixed(1), cy: y(row[field]).toFixed(1), r: 2.5, class: "dot" });
      const title = svg("title");
      title.textContent = `${new Date(row.created_at * 1000).toLocaleString()}: ${row[field]} ${unit}`;
      dot.append(title);
      root.append(dot);
    }
  }
  box.replaceChildren(points.length ? root : h("p", { class: "empty" }, "No requests in this range."));
}
