// Building DOM nodes without innerHTML: text is always text, never markup.

export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "class") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function when(seconds) {
  if (!seconds) return "";
  return new Date(seconds * 1000).toLocaleString(undefined, {
    year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit",
  });
}

export function plural(count, word) {
  return `${count} ${word}${count === 1 ? "" : "s"}`;
}

export function toast(message, { action, onAction, seconds = 4, onExpire } = {}) {
  const box = document.getElementById("toasts");
  let settled = false;
  const settle = (fn) => { if (!settled) { settled = true; node.remove(); fn?.(); } };
  const node = h("div", { class: "toast", role: "status" },
    h("span", {}, message),
    action ? h("button", { type: "button", onclick: () => settle(onAction) }, action) : null);
  box.append(node);
  setTimeout(() => settle(onExpire), seconds * 1000);
  return { node, dismiss: () => settle(onExpire) };
}

export function problem(error) {
  const node = document.getElementById("problem");
  if (!error) { node.hidden = true; node.textContent = ""; return; }
  node.textContent = error.status === 401 || error.status === 403
    ? `${error.message} — enter a proxy key above.`
    : error.message;
  node.hidden = false;
}
