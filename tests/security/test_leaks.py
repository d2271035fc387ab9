"""Secrets in URLs stay out of logs and answers, ``x-upshift-owner`` does not tell apps the pod
URL, and a cleartext upstream gets a warning. A canary secret in the upstream URL's query
and in the egress proxy's password never appears in an answer, a log line or
``--print-config``; the owner header says only that an upshift answered unless ``debug``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import aiohttp
import orjson
import pytest

from proxy.config import Settings
from proxy.intake.keys import KeySource
from proxy.redact import redact_url, redact_urls
from proxy.upstream.passthrough import Passthrough
from tests.security.ingress import ALICE, Spawn, body, started
from tests.sidecar import ROOT
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(90)

QUERY_CANARY = "CANARYQ7f3e9a1b"
PROXY_CANARY = "CANARYP5d2c8e4f"
USER_CANARY = "sk-CANARYU0a1b2c3d4e5f"


def test_redact_url_hides_userinfo_and_query_values_but_keeps_the_rest() -> None:
    url = f"https://{USER_CANARY}@r.example/openai/v1?api-version=2025-01-01&api-key={QUERY_CANARY}&sig=x#f"
    assert redact_url(url) == "https://***@r.example/openai/v1?api-version=2025-01-01&api-key=***&sig=***#f"
    assert redact_url(f"http://user:{PROXY_CANARY}@127.0.0.1:3128") == "http://user:***@127.0.0.1:3128"
    assert redact_url("https://api.openai.com/v1") == "https://api.openai.com/v1"  # nothing to hide
    assert redact_url("http://[::1:bad") == "<url>"
    text = f"cannot reach wss://h.example/v1/responses?api-key={QUERY_CANARY} (refused)"
    assert QUERY_CANARY not in redact_urls(text) and "wss://h.example/v1/responses?api-key=***" in redact_urls(text)


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UPSHIFT_", "OPENAI_"))}
    env.update(extra)
    return env


def test_print_config_and_config_errors_never_show_url_secrets() -> None:
    upstream = f"https://r.example/openai/v1?api-version=1&api-key={QUERY_CANARY}"
    proxy = f"http://user:{PROXY_CANARY}@127.0.0.1:3128"
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "--upstream", upstream, "--print-config"],
        cwd=ROOT,
        env=_child_env(UPSHIFT_EGRESS_PROXY=proxy),
        capture_output=True,
        timeout=30,
        check=True,
    )
    printed = out.stdout.decode() + out.stderr.decode()
    assert "api-version=1" in printed and "user:***@127.0.0.1:3128" in printed  # the rest is shown
    for canary in (QUERY_CANARY, PROXY_CANARY):
        assert canary not in printed, printed
    bad = subprocess.run(
        [sys.executable, "-m", "proxy", "--upstream", f"ftp://r.example/?api-key={QUERY_CANARY}", "--print-config"],
        cwd=ROOT,
        env=_child_env(),
        capture_output=True,
        timeout=30,
    )
    assert bad.returncode == 1
    assert QUERY_CANARY not in (bad.stdout + bad.stderr).decode()


async def _traffic(base_url: str) -> list[str]:
    """Every kind of answer an app can get (ok, relayed, errors, a WebSocket), as text."""
    seen: list[str] = []
    headers = {"Authorization": f"Bearer {ALICE}"}
    async with aiohttp.ClientSession() as http:
        for method, path, data in [
            ("POST", "/responses", body()),
            ("POST", "/responses", body(background=True)),
            ("POST", "/responses", b'{"model": "gpt-6.1-sol", "input": '),
            ("GET", "/models", None),
            ("GET", "/nope/../../etc", None),
        ]:
            async with http.request(method, base_url + path, data=data, headers=headers) as resp:
                seen.append(f"{resp.status} {dict(resp.headers)} {await resp.text()}")
        url = base_url.replace("http://", "ws://") + "/responses"
        try:
            async with http.ws_connect(url, headers=headers) as ws:
                await ws.send_str(
                    orjson.dumps({"type": "response.create", "model": "gpt-6.1-sol", "input": "hi"}).decode()
                )
                for _ in range(50):
                    msg = await ws.receive(timeout=10)
                    seen.append(str(msg.data))
                    if msg.type != aiohttp.WSMsgType.TEXT or '"response.completed"' in str(msg.data):
                        break
        except aiohttp.WSServerHandshakeError as exc:
            seen.append(f"{exc.status} {exc.message} {exc.headers}")
    return seen


async def test_an_upstream_query_secret_never_reaches_an_answer_or_a_log(emulator: Emulator, spawn: Spawn) -> None:
    side = await started(spawn, emulator.base_url + f"?api-key={QUERY_CANARY}", "--log-level", "debug")
    answers = await _traffic(side.base_url)
    assert any(a.startswith("200 ") for a in answers), answers  # the control: it serves
    emulator.faults.arm("error", status=500, transport="http", message="upstream broke")
    answers += await _traffic(side.base_url)
    await side.terminate()
    for text in [*answers, side.logs()]:
        assert QUERY_CANARY not in text, text[:2000]
    assert "api-key=***" in side.logs()  # the startup line names the upstream, redacted


async def test_an_egress_proxy_password_never_reaches_an_answer_or_a_log(emulator: Emulator, spawn: Spawn) -> None:
    # A proxy that is not there: every upstream call fails through it, on every error path.
    proxy = f"http://user:{PROXY_CANARY}@127.0.0.1:9"
    side = await started(
        spawn, emulator.base_url + f"?api-key={QUERY_CANARY}", "--log-level", "debug", UPSHIFT_EGRESS_PROXY=proxy
    )
    answers = await _traffic(side.base_url)
    assert any(a.startswith("502 ") for a in answers), answers
    await side.terminate()
    for text in [*answers, side.logs()]:
        for canary in (QUERY_CANARY, PROXY_CANARY):
            assert canary not in text, text[:2000]


@pytest.mark.parametrize("debug", [False, True])
async def test_the_owner_header_names_the_pod_only_in_debug(emulator: Emulator, spawn: Spawn, debug: bool) -> None:
    self_url = "http://127.0.0.1:1"
    args = ("--log-level", "debug") if debug else ()
    side = await started(spawn, emulator.base_url, *args, UPSHIFT_CLUSTER_SELF_URL=self_url)
    # The answer to a forwarded request (what a replica relays back to the app) ...
    headers = {"Authorization": f"Bearer {ALICE}", "x-upshift-forwarded": "replica;hop1;"}
    async with aiohttp.ClientSession() as http:
        async with http.post(side.base_url + "/responses", data=body(), headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            owner = resp.headers.get("x-upshift-owner")
    # ... says an upshift answered (the forwarder needs no more), the pod URL only in debug.
    assert owner == (self_url if debug else "1")


@pytest.mark.parametrize(
    ("upstream", "warned"),
    [
        ("http://192.0.2.10/v1", True),
        ("ws://gateway.internal:8080/v1", True),
        ("http://127.0.0.1:8080/v1", False),
        ("http://localhost:8080/v1", False),
        ("https://api.openai.com/v1", False),
    ],
)
async def test_a_cleartext_upstream_off_this_machine_is_warned_at_startup(
    caplog: pytest.LogCaptureFixture, upstream: str, warned: bool
) -> None:
    settings = Settings(upstream=upstream)
    relay = Passthrough(settings, KeySource(settings.api_key))
    with caplog.at_level(logging.WARNING, logger="proxy.upstream.passthrough"):
        await relay.start()  # opens a client session only: nothing is sent anywhere
        await relay.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "unencrypted" in r.getMessage()]
    assert bool(warnings) == warned, [r.getMessage() for r in caplog.records]
