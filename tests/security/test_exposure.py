"""Who can reach a running memproxy (issue 37 item 12 and its "also seen" points; issue 39
item 9).

- An open relay: bound beyond loopback with an upstream key and no proxy keys, anyone on the
  network chats on the operator's key. `memproxy serve` refuses to start so unless
  MEMPROXY_OPEN_RELAY=on, and the ready line says it.
- The ready line warns for the quietly wrong shapes and names the auth mode, tracing, the
  Anthropic upstream and the routes; learning is not "ok" when it has no key.
- X-Forwarded-For is trusted only from MEMPROXY_TRUSTED_PROXIES (uvicorn trusted 127.0.0.1):
  a client could otherwise name its own address (a fresh rate-limit bucket per request, or
  127.0.0.1 and loopback's memory).
- /metrics and /readyz's details answer remote clients only with the metrics or admin key
  once any key is configured.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from config import Route
from tests.conftest import ROOT, RunningProxy
from tests.support.memory import QUIET, Starter, assert_error
from tests.support.processes import memproxy_env
from tests.support.scripted_upstream import ScriptedUpstream

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello"}]}


def serve_exit(tmp_path: Path, upstream: ScriptedUpstream, **settings: str) -> tuple[int, str]:
    """Run `memproxy serve` with `settings`; it must exit by itself (exit code, output).

    The port is held (bound, never listening) by this test, so a server that did not refuse
    could not listen on it either, and would exit too."""
    env = {**memproxy_env(upstream.base_url, **settings), "MEMPROXY_DATA_DIR": str(tmp_path / "d")}
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        port = str(held.getsockname()[1])
        done = subprocess.run([sys.executable, "-m", "proxy", "serve", "--port", port], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120, check=False)
    return done.returncode, done.stdout + done.stderr


# Each shape starts a server process: the fast lane runs the first, the full suite them all.
@pytest.mark.parametrize("shape", [
    {"host": "0.0.0.0", "upstream_api_key": "sk-operator"},
    *(pytest.param(shape, marks=pytest.mark.process) for shape in [
        {"host": "::", "upstream_api_key": "sk-operator"},
        {"host": "10.1.2.3", "upstream_api_key": "sk-operator"},
        {"host": "memproxy.internal", "upstream_api_key": "sk-operator"},
        {"host": "0.0.0.0", "anthropic_api_key": "sk-ant-operator"},
        {"host": "0.0.0.0", "upstream_api_key": "sk-operator", "admin_key": "admin-key-000001"},
        {"host": "0.0.0.0", "upstream_api_key": "sk-operator", "open_relay": "off"},
    ]),
])
def test_serve_refuses_to_start_an_open_relay(
    tmp_path: Path, upstream: ScriptedUpstream, shape: dict[str, str],
) -> None:
    code, output = serve_exit(tmp_path, upstream, **shape)
    assert code == 2, output
    assert "open relay" in output and "MEMPROXY_OPEN_RELAY=on" in output, output
    assert "MEMPROXY_API_KEYS" in output and "sk-operator" not in output
    assert "Traceback" not in output
    assert upstream.history == []


def ready_line(capfd: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """The "memproxy ready" log line the proxy wrote."""
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines()
             if line.startswith("{")]
    return next(line for line in lines if line["msg"] == "memproxy ready")


def test_an_intended_open_relay_starts_and_says_so(
    start_proxy: Starter, capfd: pytest.CaptureFixture[str],
) -> None:
    # The test server listens on 127.0.0.1 whatever the settings say; the settings are
    # what the ready line reads.
    start_proxy(host="0.0.0.0", upstream_api_key="sk-operator", open_relay=True,
                log_level="info")
    ready = ready_line(capfd)
    assert ready["level"] == "warning"
    assert any("open relay" in warning for warning in ready["warnings"]), ready
    assert any("memory is off for every client not on this machine" in warning
               for warning in ready["warnings"]), ready
    assert ready["auth"].startswith("no keys required")
    assert "sk-operator" not in json.dumps(ready)


def test_the_ready_line_names_access_and_routes_and_warns_of_a_keyless_upstream(
    start_proxy: Starter, capfd: pytest.CaptureFixture[str],
) -> None:
    start_proxy(memory=True, auth="keys", log_level="info", upstream_base_url="https://api.example.com/v1",
                extract_every=5, anthropic_base_url="https://api.anthropic.example",
                routes=(Route("claude-*", provider="anthropic"),))
    ready = ready_line(capfd)
    assert ready["auth"] == "keys (stored keys)"
    assert ready["tracing"] == "off"
    assert ready["anthropic_upstream"] == "https://api.anthropic.example"
    assert ready["routes"] == ["claude-*"]
    assert ready["learning"] != "ok" and "MEMPROXY_LEARNING_API_KEY" in ready["learning"]
    assert any("MEMPROXY_UPSTREAM_API_KEY is unset" in w for w in ready["warnings"]), ready
    assert ready["level"] == "warning"


def test_a_plain_local_start_warns_of_nothing(
    start_proxy: Starter, capfd: pytest.CaptureFixture[str],
) -> None:
    start_proxy(log_level="info", upstream_api_key="sk-operator")
    ready = ready_line(capfd)
    assert ready["level"] == "info" and "warnings" not in ready
    assert ready["anthropic_upstream"] == "via litellm on the model's route"


# -- forwarding headers ---------------------------------------------------------------------


def test_a_client_cannot_name_its_own_address(
    start_proxy: Starter, upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy(rate_limit=2, rate_limit_burst=2)
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        statuses = [
            http.post("/v1/chat/completions", json=CHAT, headers={
                "X-Forwarded-For": f"198.51.100.{n}", "authorization": f"Bearer sk-rotated-{n}"})
            .status_code
            for n in range(6)
        ]
    assert statuses.count(429) >= 4, statuses  # one address: one bucket


def test_a_relayed_loopback_connection_is_not_the_local_user(start_proxy: Starter) -> None:
    proxy = start_proxy(memory=True, **QUIET)
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        for forwarded in ({"X-Forwarded-For": "127.0.0.1"}, {"Forwarded": "for=127.0.0.1"},
                          {"X-Real-IP": "127.0.0.1"}, {"X-Forwarded-For": "203.0.113.9"}):
            assert_error(http.get("/v1/memory/facts", headers=forwarded), 403)
        assert http.get("/v1/memory/facts").status_code == 200


def test_named_trusted_proxies_give_the_client_address(start_proxy: Starter) -> None:
    proxy = start_proxy(memory=True, trusted_proxies="127.0.0.1", **QUIET)
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        assert_error(http.get("/v1/memory/facts", headers={"X-Forwarded-For": "203.0.113.9"}), 403)
        assert http.get("/v1/memory/facts", headers={"X-Forwarded-For": "127.0.0.1"}).status_code == 200
        assert http.get("/v1/memory/facts").status_code == 200


# -- /metrics and /readyz ---------------------------------------------------------------------

REMOTE = {"X-Forwarded-For": "203.0.113.9"}  # relayed by a proxy on this machine: not local


@pytest.mark.parametrize("keys", [{"auth": "keys"}, {"api_keys": "edge-key-0004"},
                                  {"admin_key": "admin-key-000002"},
                                  {"api_keys": "edge-key-0004", "admin_key": "admin-key-000002"}])
def test_metrics_and_readyz_details_need_a_key_from_afar(
    start_proxy: Starter, keys: dict[str, str],
) -> None:
    proxy = start_proxy(memory=True, **keys, **QUIET)
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        for headers in (REMOTE, {**REMOTE, "authorization": "Bearer edge-key-0004"},
                        {**REMOTE, "authorization": "Bearer wrong-key-0001"}):
            refused = http.get("/metrics", headers=headers)
            assert refused.status_code in (401, 403), refused.text
            assert "memproxy_requests_total" not in refused.text
            ready = http.get("/readyz", headers=headers)
            assert ready.status_code == 200 and ready.json() == {"status": "ok"}
        assert http.get("/healthz", headers=REMOTE).json() == {"status": "ok"}
        if "admin_key" in keys:
            admin = {**REMOTE, "authorization": "Bearer admin-key-000002"}
            assert "memproxy_requests_total" in http.get("/metrics", headers=admin).text
            assert "parts" in http.get("/readyz", headers=admin).json()
        # A client on this machine, as a local Prometheus or curl.
        assert http.get("/metrics").status_code == 200
        assert "parts" in http.get("/readyz").json()


def test_a_metrics_key_reads_metrics(start_proxy: Callable[..., RunningProxy]) -> None:
    proxy = start_proxy(api_keys="edge-key-0005", metrics_key="metrics-key-0001")
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        good = {**REMOTE, "authorization": "Bearer metrics-key-0001"}
        assert http.get("/metrics", headers=good).status_code == 200
        assert_error(http.get("/metrics", headers=REMOTE), 401)
        # The metrics key is no proxy key.
        assert_error(http.post("/v1/chat/completions", json=CHAT, headers=good), 401)


def test_metrics_takes_either_operator_secret_and_no_other(
    start_proxy: Callable[..., RunningProxy],
) -> None:
    # Each configured secret is compared (the metrics key and the admin key); a near miss of
    # either, or a proxy key, is a wrong key.
    proxy = start_proxy(api_keys="edge-key-0005", metrics_key="metrics-key-0001",
                        admin_key="admin-key-000001")
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        for secret in ("metrics-key-0001", "admin-key-000001"):
            ok = http.get("/metrics", headers={**REMOTE, "authorization": f"Bearer {secret}"})
            assert ok.status_code == 200
        for wrong in ("metrics-key-0002", "admin-key-000001x", "edge-key-0005"):
            refused = http.get("/metrics", headers={**REMOTE, "authorization": f"Bearer {wrong}"})
            assert_error(refused, 401)
            assert refused.json()["error"]["message"] == "incorrect API key provided"


def test_without_any_key_metrics_stay_open(start_proxy: Callable[..., RunningProxy]) -> None:
    proxy = start_proxy()
    assert httpx.get(f"{proxy.url}/metrics", headers=REMOTE, timeout=30).status_code == 200
