"""Credentials, query strings and path prefixes: what forms an identity, what travels on the
upgrade and on the HTTP relay, and where they go (a capturing upstream on 127.0.0.1)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy.config import ApiKeySettings, IdentitySettings, Settings, merge_query, upstream_ws_url
from proxy.intake.identity import identify, request_identity
from proxy.intake.keys import KeySource
from tests.clients.support import TOOLS, Capture, task_text, tool_outputs
from tests.sidecar import Sidecar
from upshift_emulator import Emulator

UP = "https://example.openai.azure.com/openai/v1"


def _headers(**values: str) -> CIMultiDict[str]:
    return CIMultiDict({name.replace("_", "-"): value for name, value in values.items()})


def test_default_headers_cover_openai_and_azure() -> None:
    base = identify(_headers(api_key="k1"), upstream=UP, authorization=None)
    assert base.headers == (("api-key", "k1"),)
    assert base != identify(_headers(api_key="k2"), upstream=UP, authorization=None)
    for name in ("Authorization", "OpenAI-Organization", "OpenAI-Project", "OpenAI-Beta"):
        other = identify(CIMultiDict({"api-key": "k1", name: "x"}), upstream=UP, authorization=None)
        assert other != base, name


def test_per_turn_metadata_never_splits_an_identity() -> None:
    app = {"Authorization": "Bearer a", "x-codex-turn-metadata": '{"turn":1}', "x-request-id": "r1"}
    one = identify(CIMultiDict(app), upstream=UP, authorization="Bearer a")
    later = {**app, "x-codex-turn-metadata": '{"turn":2}', "x-request-id": "r2", "User-Agent": "other"}
    two = identify(CIMultiDict(later), upstream=UP, authorization="Bearer a")
    assert one == two and one.headers == two.headers == (("Authorization", "Bearer a"),)


def test_a_gateway_header_is_a_credential_when_configured() -> None:
    gateway = ("Authorization", "x-litellm-api-key")
    a = identify(_headers(x_litellm_api_key="g1"), upstream=UP, authorization=None, credential_headers=gateway)
    b = identify(_headers(x_litellm_api_key="g2"), upstream=UP, authorization=None, credential_headers=gateway)
    assert a != b and a.headers == (("x-litellm-api-key", "g1"),)
    # not listed: neither hashed nor sent
    c = identify(_headers(x_litellm_api_key="g1"), upstream=UP, authorization=None)
    d = identify(_headers(x_litellm_api_key="g2"), upstream=UP, authorization=None)
    assert c == d and c.headers == ()


def test_injected_key_into_api_key_replaces_the_app_placeholders() -> None:
    app = _headers(api_key="tenant-1", Authorization="Bearer placeholder", OpenAI_Project="p")
    one = identify(app, upstream=UP, authorization="Bearer sk-real", key_header="api-key")
    assert dict(one.headers) == {"api-key": "sk-real", "OpenAI-Project": "p"}
    other = identify(_headers(api_key="tenant-2"), upstream=UP, authorization="Bearer sk-real", key_header="api-key")
    assert other != one, "tenants behind one injected key stay apart"
    bearer = identify(app, upstream=UP, authorization="Bearer sk-real", key_header="Authorization")
    assert dict(bearer.headers) == {"Authorization": "Bearer sk-real", "OpenAI-Project": "p"}
    assert bearer != one
    assert "sk-real" not in repr(one)


def test_request_identity_follows_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UPSHIFT_TEST_PROVIDER_KEY", "sk-injected")
    settings = Settings(
        upstream=UP,
        api_key=ApiKeySettings(source="env", env="UPSHIFT_TEST_PROVIDER_KEY", header="api-key"),
    )
    keys = KeySource(settings.api_key)
    identity = request_identity(_headers(api_key="dummy"), "api-version=2025-04-01-preview", settings, keys)
    assert identity.headers == (("api-key", "sk-injected"),)
    assert identity.ws_url == "wss://example.openai.azure.com/openai/v1/responses?api-version=2025-04-01-preview"
    narrowed = dataclasses.replace(settings, identity=IdentitySettings(headers=("OpenAI-Project",)))
    assert request_identity(_headers(api_key="a"), "", narrowed, keys) == request_identity(
        _headers(api_key="b"), "", narrowed, keys
    )


def test_query_string_is_part_of_the_identity_and_the_url() -> None:
    a = identify(_headers(api_key="k"), upstream=UP, authorization=None, query="api-version=1")
    b = identify(_headers(api_key="k"), upstream=UP, authorization=None, query="api-version=2")
    assert a != b
    assert a.ws_url.endswith("/openai/v1/responses?api-version=1")


@pytest.mark.parametrize(
    ("upstream", "query", "want"),
    [
        ("https://api.openai.com/v1", "", "wss://api.openai.com/v1/responses"),
        ("https://api.openai.com/v1/", "", "wss://api.openai.com/v1/responses"),
        ("http://127.0.0.1:1/openai/v1", "api-version=x", "ws://127.0.0.1:1/openai/v1/responses?api-version=x"),
        ("https://gw/openai/v1?tenant=t%201", "a=1", "wss://gw/openai/v1/responses?tenant=t%201&a=1"),
        ("https://gw/v1?api-version=base", "api-version=app&b=2", "wss://gw/v1/responses?api-version=base&b=2"),
        ("wss://gw/v1", "", "wss://gw/v1/responses"),
    ],
)
def test_upstream_ws_url(upstream: str, query: str, want: str) -> None:
    assert upstream_ws_url(upstream, query) == want
    assert Settings(upstream=upstream).ws_url == upstream_ws_url(upstream, "")


def test_merge_query_keeps_encoding() -> None:
    assert merge_query("", "a=%2F&b") == "a=%2F&b"
    assert merge_query("x=1", "") == "x=1"
    assert merge_query("x=1&y", "x=2&y=3&z=%20") == "x=1&y&z=%20"


# -- through the sidecar to a capturing upstream ------------------------------------------------


@dataclasses.dataclass
class Seen:
    method: str
    path_qs: str
    headers: CIMultiDict[str]
    upgrade: bool


@pytest.fixture
async def capture() -> AsyncIterator[tuple[str, list[Seen]]]:
    """An upstream on 127.0.0.1 that records every request; upgrades get 426 (the sidecar then
    uses HTTP), HTTP requests a small JSON answer."""
    seen: list[Seen] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        upgrade = request.headers.get("Upgrade", "").lower() == "websocket"
        seen.append(Seen(request.method, request.path_qs, CIMultiDict(request.headers), upgrade))
        if upgrade:
            return web.json_response({"error": {"message": "use HTTP", "type": "x", "code": None}}, status=426)
        await request.read()
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


async def _post(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> aiohttp.ClientResponse:
    body = {"model": "gpt-6.1-sol", "input": "hi"}
    async with session.post(url, json=body, headers=headers) as response:
        await response.read()
        return response


async def test_prefix_query_and_credentials_on_both_transports(capture: tuple[str, list[Seen]]) -> None:
    base, seen = capture
    app_headers = {"api-key": "azure-key-1", "x-codex-turn-metadata": "t1", "Cookie": "c=1"}
    async with Sidecar(base + "/openai/v1?tenant=t%201") as sc, aiohttp.ClientSession() as session:
        url = sc.base_url + "/responses?api-version=2025-04-01-preview"
        response = await _post(session, url, app_headers)
        assert response.headers["x-upshift-mode"] == "passthrough"
        async with session.get(sc.base_url + "/models?limit=2", headers=app_headers) as models:
            assert models.status == 200
    upgrade, post, get = seen
    assert upgrade.upgrade and upgrade.path_qs == "/openai/v1/responses?tenant=t%201&api-version=2025-04-01-preview"
    assert upgrade.headers["api-key"] == "azure-key-1"
    for name in ("Authorization", "x-codex-turn-metadata", "Cookie"):
        assert name not in upgrade.headers, name
    assert post.method == "POST" and post.path_qs == "/openai/v1/responses?tenant=t%201&api-version=2025-04-01-preview"
    assert post.headers["api-key"] == "azure-key-1" and "Cookie" not in post.headers
    assert get.path_qs == "/openai/v1/models?tenant=t%201&limit=2"


async def test_injected_azure_key_on_both_transports(
    capture: tuple[str, list[Seen]], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, seen = capture
    monkeypatch.setenv("UPSHIFT_TEST_AZURE_KEY", "sk-azure-real")
    api_key: dict[str, Any] = {"source": "env", "env": "UPSHIFT_TEST_AZURE_KEY", "header": "api-key"}
    async with Sidecar(base + "/openai/v1", api_key=api_key) as sc, aiohttp.ClientSession() as session:
        headers = {"api-key": "placeholder", "Authorization": "Bearer placeholder"}
        await _post(session, sc.base_url + "/responses?api-version=v", headers)
    upgrade, post = seen
    for request in (upgrade, post):
        assert request.headers["api-key"] == "sk-azure-real"
        assert "Authorization" not in request.headers
        assert request.path_qs == "/openai/v1/responses?api-version=v"


async def test_changing_turn_metadata_keeps_the_continuation(emulator: Emulator) -> None:
    """Codex-like apps send a different ``x-codex-turn-metadata`` every turn: same identity,
    same socket, so every later turn is still a continuation."""
    async with Sidecar(emulator.base_url) as sidecar:
        capture = Capture()
        client = capture.async_client(sidecar.base_url)
        history: list[Any] = [{"role": "user", "content": task_text(2, "metadata")}]
        for turn in range(3):
            extra = {"x-codex-turn-metadata": json.dumps({"turn": turn, "sandbox": "workspace-write"})}
            response = await client.responses.create(
                model="gpt-6.1-sol", input=history, tools=TOOLS, extra_headers=extra
            )
            history += [*response.output, *tool_outputs(response.output)]
        await client.close()
    assert capture.modes == ["full", "continuation", "continuation"]
    assert emulator.stats.ws_connections["opened"] <= 2  # the first socket, perhaps a spare
