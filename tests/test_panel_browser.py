"""The memory panel (/ui) in headless Chromium against a real running proxy with keys on.

Screenshots go to artifacts/ui-*.png; docs/panel.png is a copy of ui-panel.png. Chromium comes from Debian (`.ci/run` installs it);
without it this test fails under CI and is skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ROOT, RunningProxy
from tests.support.jobs import wait_for_jobs
from tests.support.memory import QUIET, Starter

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "artifacts"
KEY = "panel-key-000001"
KIM = {"Authorization": f"Bearer {KEY}"}
ADMIN = "panel-admin-00001"

if not CHROMIUM.exists():
    message = f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)

from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        yield browser
        browser.close()


@pytest.fixture
def panel_proxy(start_proxy: Starter) -> RunningProxy:
    proxy = start_proxy(memory=True, api_keys=f"{KEY}:kim", **QUIET)
    with httpx.Client(base_url=f"{proxy.url}/v1", headers=KIM, timeout=60) as http:
        for text, category in [
            ("Prefers TypeScript for new services", "preference"),
            ("Works on the billing service at Acme", "project"),
            ("Lives in Lisbon", "identity"),
            ("Decided to move CI to GitHub Actions", "decision"),
        ]:
            assert http.post("/memory/facts", json={"text": text, "category": category}).status_code == 201
        for session, text in [("deploy", "Our deploy pipeline uses ArgoCD and Helm charts."),
                              ("standup", "Standup moved to 9:30 on Mondays.")]:
            response = http.post("/chat/completions", headers={"X-Memory-Session-Id": session},
                                 json={"model": "gpt-4o", "messages": [{"role": "user", "content": text}]})
            assert response.status_code == 200
            wait_for_jobs(proxy)
    return proxy


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"ui-{name}.png"), full_page=True)


def open_panel(browser: Browser, proxy: RunningProxy, width: int = 1100, key: str = KEY) -> Page:
    page = browser.new_page(viewport={"width": width, "height": 900})
    errors: list[Any] = []
    page.on("pageerror", lambda error: errors.append(error))
    page.goto(f"{proxy.url}/ui")
    expect(page.locator("#problem")).to_contain_text("enter a proxy key")  # keys are on
    page.get_by_label("Proxy key").fill(key)
    page.get_by_role("button", name="Use").click()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    expect(page.locator("#problem")).to_be_hidden()
    page.errors = errors  # type: ignore[attr-defined]
    return page


def facts_api(proxy: RunningProxy) -> list[dict[str, Any]]:
    facts: list[dict[str, Any]] = httpx.get(f"{proxy.url}/v1/memory/facts", headers=KIM).json()["data"]
    return facts


def card(page: Page, text: str) -> Any:
    return page.locator(".card", has=page.locator(".text", has_text=text))


def test_manage_facts_in_the_panel(browser: Browser, panel_proxy: RunningProxy) -> None:
    page = open_panel(browser, panel_proxy)
    assert page.evaluate("sessionStorage.getItem('memproxy.key')") == KEY
    expect(page.locator(".card")).to_have_count(4)
    expect(page.locator("section[data-category=project] h2")).to_have_text("project (1)")
    bar = card(page, "Lives in Lisbon").get_by_role("meter")
    expect(bar).to_have_attribute("aria-valuenow", "60")

    page.get_by_label("New fact").fill("Drinks oolong tea")
    page.get_by_label("Category").select_option("preference")
    page.get_by_role("button", name="Add", exact=True).click()
    expect(card(page, "Drinks oolong tea")).to_be_visible()
    expect(page.locator("section[data-category=preference] h2")).to_have_text("preference (2)")
    shot(page, "facts")

    page.get_by_role("button", name="Edit: Drinks oolong tea").click()
    editor = page.get_by_label("Edit fact text (Enter saves, Escape cancels)")
    expect(editor).to_be_focused()
    editor.fill("Drinks something else")
    editor.press("Escape")
    expect(card(page, "Drinks oolong tea")).to_be_visible()
    page.get_by_role("button", name="Edit: Drinks oolong tea").click()
    editor.fill("Drinks green tea")
    shot(page, "edit")
    editor.press("Enter")
    expect(card(page, "Drinks green tea")).to_be_visible()
    edited = next(f for f in facts_api(panel_proxy) if f["text"] == "Drinks green tea")
    assert edited["version"] == 2

    page.get_by_role("button", name="Pin: Drinks green tea").click()
    unpin = page.get_by_role("button", name="Unpin: Drinks green tea")
    expect(unpin).to_have_attribute("aria-pressed", "true")
    expect(card(page, "Drinks green tea")).to_have_class("card pinned")
    assert next(f for f in facts_api(panel_proxy) if f["id"] == edited["id"])["pinned"]
    expect(page.locator(".toast")).to_have_count(0, timeout=5000)
    shot(page, "panel")  # docs/memory-api.md's picture (docs/panel.png is a copy)

    page.get_by_role("button", name="Delete: Drinks green tea").click()
    expect(card(page, "Drinks green tea")).to_have_count(0)
    toast = page.locator(".toast", has_text="Deleted")
    expect(toast).to_be_visible()
    shot(page, "undo-toast")
    toast.get_by_role("button", name="Undo").click()
    expect(card(page, "Drinks green tea")).to_be_visible()
    time.sleep(4.5)  # past the toast: undone means never deleted
    assert any(f["id"] == edited["id"] for f in facts_api(panel_proxy))

    page.get_by_role("button", name="Delete: Drinks green tea").click()
    expect(page.locator(".toast", has_text="Deleted")).to_be_hidden(timeout=8000)
    _until(lambda: not any(f["id"] == edited["id"] for f in facts_api(panel_proxy)))
    expect(card(page, "Drinks green tea")).to_have_count(0)

    page.get_by_label("Search facts").fill("billing")
    expect(page.locator(".card")).to_have_count(1)
    page.get_by_label("Search facts").fill("")
    page.get_by_label("Show").select_option("identity")
    expect(page.locator(".card")).to_have_count(1)
    expect(page.locator(".card .text")).to_have_text("Lives in Lisbon")
    page.get_by_label("Show").select_option("")
    expect(page.locator(".card")).to_have_count(4)
    assert page.errors == []  # type: ignore[attr-defined]


def test_inspector_sessions_metrics_and_clear_all(browser: Browser, panel_proxy: RunningProxy) -> None:
    page = open_panel(browser, panel_proxy)
    page.get_by_role("tab", name="Inspector").click()
    page.get_by_label("Query").fill("how do we deploy with helm?")
    expect(page.get_by_label("Budget (tokens)")).to_have_value("1000")
    page.get_by_role("button", name="Show what would be injected").click()
    expect(page.locator("#inspect-items li").first).to_contain_text("ArgoCD")
    expect(page.locator("#inspect-tokens")).to_contain_text("/ 1000 tokens")
    expect(page.locator("#inspect-block")).to_contain_text("<memory>")
    expect(page.locator("#inspect-items li .badge").first).to_have_text("turn")
    expect(page.locator("#inspect-items li .signals").first).to_contain_text("dense")
    tokens = int(page.locator("#inspect-tokens").inner_text().split(" /")[0])
    assert page.locator("#inspect-meter").evaluate("m => m.value") == tokens > 0
    shot(page, "inspector")

    page.get_by_role("tab", name="Sessions").click()
    page.get_by_role("button", name="Standup moved to 9:30 on Mondays.").click()
    expect(page.locator(".turn")).to_have_count(2)
    expect(page.locator(".turn.user p")).to_have_text("Standup moved to 9:30 on Mondays.")
    shot(page, "sessions")

    page.get_by_role("tab", name="Metrics").click()
    expect(page.locator("#chart-latency svg circle")).to_have_count(2)
    expect(page.locator("#metrics-summary")).to_contain_text("requests")
    shot(page, "metrics")

    page.get_by_role("tab", name="Facts").click()
    stats = httpx.get(f"{panel_proxy.url}/v1/memory/stats", headers=KIM).json()["counts"]
    assert (stats["facts"], stats["turns"], stats["sessions"]) == (4, 4, 2)
    clear = page.get_by_role("button", name="Clear all (4 facts, 4 turns)…")
    clear.click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text("This removes 4 facts, 4 turns in 2 sessions.")
    expect(dialog).to_contain_text("undo it for 60 seconds")
    dialog.get_by_role("button", name="Clear all").click()
    undo_bar = page.locator("#undo-bar")
    expect(undo_bar).to_contain_text("Cleared 4 facts, 4 turns and 2 sessions.")
    expect(page.locator(".card")).to_have_count(0)
    expect(page.locator("#fact-count")).to_have_text("0 facts · 0 turns in 0 sessions")
    shot(page, "clear-undo")
    undo_bar.get_by_role("button", name="Undo").click()
    expect(undo_bar).to_contain_text("Everything is back.")
    expect(page.locator(".card")).to_have_count(4)
    wait_for_jobs(panel_proxy)
    after = httpx.get(f"{panel_proxy.url}/v1/memory/stats", headers=KIM).json()["counts"]
    assert (after["facts"], after["turns"], after["sessions"]) == (4, 4, 2)
    assert page.errors == []  # type: ignore[attr-defined]


def test_panel_fits_360_pixels_and_labels_every_control(browser: Browser, panel_proxy: RunningProxy) -> None:
    page = open_panel(browser, panel_proxy, width=360)
    expect(page.locator(".card")).to_have_count(4)
    assert page.evaluate("document.documentElement.scrollWidth") <= 360
    unlabeled = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea, button')]
        .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label')
                      && !el.textContent.trim())
        .map(el => el.outerHTML)""")
    assert unlabeled == []
    for tab in ("Inspector", "Sessions", "Metrics"):
        page.get_by_role("tab", name=tab).click()
        assert page.evaluate("document.documentElement.scrollWidth") <= 360, tab
    page.get_by_role("tab", name="Facts").click()
    shot(page, "mobile")
    headers = httpx.get(f"{panel_proxy.url}/ui/").headers
    assert "default-src 'self'" in headers["content-security-policy"]
    assert httpx.get(f"{panel_proxy.url}/ui", follow_redirects=False).status_code == 308


def test_usage_view_for_the_admin_only(browser: Browser, start_proxy: Starter) -> None:
    proxy = start_proxy(memory=True, api_keys=f"{KEY}:kim", admin_key=ADMIN, **QUIET)
    with httpx.Client(base_url=f"{proxy.url}/v1", headers=KIM, timeout=60) as http:
        for text in ("one", "two"):
            assert http.post("/chat/completions", json={
                "model": "gpt-4o", "messages": [{"role": "user", "content": text}]}).status_code == 200
    kims = open_panel(browser, proxy)
    kims.get_by_role("tab", name="Usage").click()
    expect(kims.locator("#usage-note")).to_contain_text("admin key only")
    expect(kims.locator("#usage-table tr")).to_have_count(0)
    page = open_panel(browser, proxy, key=ADMIN)
    page.get_by_role("tab", name="Usage").click()
    body = page.locator("#usage-table tbody tr")
    expect(body).to_have_count(1)
    expect(body.first).to_contain_text("kim")
    expect(page.locator("#usage-totals")).to_contain_text("Requests2")
    page.get_by_label("Rows").select_option("key")
    expect(page.locator("#usage-table thead")).to_contain_text("Key")
    expect(body.first).to_contain_text("env-")
    shot(page, "usage")
    page.set_viewport_size({"width": 360, "height": 800})
    assert page.evaluate("document.documentElement.scrollWidth") <= 360
    assert page.errors == []  # type: ignore[attr-defined]


def _until(check: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.1)


def test_the_admin_makes_and_revokes_a_key_in_the_panel(
    browser: Browser, start_proxy: Starter,
) -> None:
    admin_key = "panel-admin-0001"
    proxy = start_proxy(memory=True, api_keys=f"{KEY}:kim", admin_key=admin_key, **QUIET)
    page = open_panel(browser, proxy)
    page.on("dialog", lambda dialog: dialog.accept())
    page.get_by_role("tab", name="Keys").click()
    expect(page.locator("#problem")).to_contain_text("admin key only")  # kim's key is no admin
    page.get_by_label("Proxy key").fill(admin_key)
    page.get_by_role("button", name="Use").click()
    expect(page.locator("#key-list .card")).to_have_count(1)
    expect(page.locator("#key-list .card")).to_contain_text("MEMPROXY_API_KEYS")

    page.locator("#view-keys").get_by_label("User").fill("lee")
    page.get_by_label("Requests/min").fill("30")
    page.get_by_role("button", name="Make key").click()
    secret_box = page.locator("#secret-box")
    expect(secret_box).to_be_visible()
    secret = page.locator("#new-secret").inner_text()
    assert secret.startswith("mp-")
    expect(page.locator("#key-list .card")).to_have_count(2)
    shot(page, "keys")
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    bearer = {"Authorization": f"Bearer {secret}"}
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=chat, headers=bearer,
                      timeout=30).status_code == 200
    page.get_by_role("button", name="Done").click()
    expect(secret_box).to_be_hidden()
    assert secret not in page.content()  # shown once, then gone from the page

    key_id = page.locator("#key-list .card.active[data-id^=key_]").get_attribute("data-id")
    page.get_by_role("button", name=f"Revoke: {key_id}").click()
    expect(page.locator(f"#key-list .card[data-id='{key_id}'] .badge")).to_have_text("revoked")
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=chat, headers=bearer,
                      timeout=30).status_code == 401
    assert page.errors == []  # type: ignore[attr-defined]
