"""Item 2 in a real browser (headless Chromium): with no keys, a page of another origin
cannot write memproxy's memory or chat through it, nor read what the operator's key reaches
even when the upstream answers CORS (issue 37 item 1), and the panel on memproxy's own origin
still works. Both origins are loopback names of the same server (http://localhost:PORT
attacks http://127.0.0.1:PORT), so nothing but memproxy's own checks stands in the way."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningProxy
from tests.support.memory import QUIET, Starter
from tests.support.scripted_upstream import ScriptedUpstream

CHROMIUM = Path("/usr/bin/chromium")

if not CHROMIUM.exists():
    message = f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)

from playwright.sync_api import Browser, Page, sync_playwright  # noqa: E402

pytestmark = pytest.mark.browser

# What a hostile page runs: requests a page may send anywhere without asking first
# (no-cors: the page cannot read the answer, but the request is sent), and one that asks.
ATTACK = """async (target) => {
  const sent = [];
  const attempts = [
    ["/v1/memory/facts", {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
      body: JSON.stringify({text: "Planted by a web page", category: "context"})}],
    ["/v1/memory/import", {method: "POST", mode: "no-cors",
      body: new Blob([JSON.stringify({type: "fact", text: "Imported by a page", category: "context"})])}],
    ["/v1/memory/clear", {method: "POST", mode: "no-cors"}],
    ["/v1/chat/completions", {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
      body: JSON.stringify({model: "gpt-4o-mini", messages: [{role: "user", content: "spend"}]})}],
    ["/v1/memory/facts", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({text: "Planted with a preflight", category: "context"})}],
  ];
  for (const [path, init] of attempts) {
    try { await fetch(target + path, init); sent.push(path); } catch (e) { sent.push("blocked " + path); }
  }
  return sent;
}"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        yield browser
        browser.close()


def page_at(browser: Browser, url: str) -> Page:
    page = browser.new_page()
    page.goto(url)
    return page


def test_a_page_of_another_origin_cannot_write_memory_or_chat(
    browser: Browser, start_proxy: Starter, upstream: ScriptedUpstream,
) -> None:
    proxy: RunningProxy = start_proxy(memory=True, **QUIET)
    own = f"http://127.0.0.1:{proxy.port}"
    with httpx.Client(base_url=own, timeout=60) as http:
        kept = http.post("/v1/memory/facts", json={"text": "Kept fact", "category": "context"})
        assert kept.status_code == 201
        # A page without the panel's CSP (connect-src 'self' would stop the fetches itself).
        hostile = page_at(browser, f"http://localhost:{proxy.port}/healthz")
        sent = hostile.evaluate(ATTACK, own)
        assert "/v1/memory/facts" in sent  # the browser did send the no-cors requests
        texts = [f["text"] for f in http.get("/v1/memory/facts").json()["data"]]
        assert texts == ["Kept fact"]
        assert upstream.history == []
        # The panel's own requests (same origin, JSON, as proxy/ui/js/api.js sends) work.
        panel = page_at(browser, f"{own}/ui/")
        status = panel.evaluate("""async () => (await fetch("/v1/memory/facts", {method: "POST",
            headers: {"Content-Type": "application/json", Accept: "application/json"},
            body: JSON.stringify({text: "Added in the panel", category: "context"})})).status""")
        assert status == 201
        assert "Added in the panel" in [f["text"] for f in http.get("/v1/memory/facts").json()["data"]]


# What a hostile page runs to read: plain GETs, as a page may send them anywhere (issue 37
# item 1: with an upstream that answers CORS, each was readable).
READ = """async (target) => {
  const read = {};
  for (const path of ["/v1/chat/completions", "/v1/chat/completions/chatcmpl-1/messages",
                      "/v1/files", "/v1/models", "/v1/memory/facts"]) {
    try { read[path] = await (await fetch(target + path)).text(); }
    catch (e) { read[path] = "blocked"; }
  }
  return read;
}"""


def test_a_page_of_another_origin_cannot_read_through_an_upstream_that_answers_cors(
    browser: Browser, start_proxy: Starter, upstream: ScriptedUpstream,
) -> None:
    from tests.security.test_cross_origin_reads import cors_upstream

    upstream.respond_with(cors_upstream)
    proxy: RunningProxy = start_proxy(memory=True, upstream_api_key="sk-operator", **QUIET)
    own = f"http://127.0.0.1:{proxy.port}"
    hostile = page_at(browser, f"http://localhost:{proxy.port}/healthz")
    read = hostile.evaluate(READ, own)
    assert set(read.values()) == {"blocked"}, read
    assert upstream.history == []
    # The same reads from memproxy's own origin (the panel's) are answered.
    panel = page_at(browser, f"{own}/ui/")
    mine = panel.evaluate(READ, "")
    assert "chatcmpl-1" in mine["/v1/chat/completions"], mine
