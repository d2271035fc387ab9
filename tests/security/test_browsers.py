"""No web page can use an injected key. The attacks: a cross-site ``text/plain`` POST with a
foreign ``Origin`` and ``Host`` (billed to the key if answered); a WebSocket opened from a
foreign origin (reading the answer); a preflight relayed with ``access-control-*`` copied back;
DNS rebinding to make it all same-origin. Each attack against a real sidecar (``api_key.source:
env``), refused with an OpenAI-style 403 and nothing forwarded, and the legitimate path beside it."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from tests.exposition import metric
from tests.security.ingress import ALICE, Spawn, answer, body, hostport, metrics, openai_error, raw_request, started
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(60)

INJECTED = {"UPSHIFT_API_KEY_SOURCE": "env", "OPENAI_API_KEY": "sk-injected-security-0123456789"}
EVIL = "https://evil.example"


def _forwarded(emulator: Emulator) -> int:
    """Requests and frames the upstream received, and sockets it was asked to open."""
    stats = emulator.stats
    return sum(stats.requests.values()) + int(stats.snapshot()["ws_frames_received"]) + stats.ws_connections["opened"]


async def test_a_cross_origin_post_is_refused_and_nothing_is_billed(emulator: Emulator, spawn: Spawn) -> None:
    side = await started(spawn, emulator.base_url, **INJECTED)
    async with aiohttp.ClientSession() as http:
        # The control first: an SDK-style request (no Origin, the address it was given).
        async with http.post(
            side.base_url + "/responses", data=body(), headers={"Content-Type": "application/json"}
        ) as ok:
            assert ok.status == 200, await ok.text()
        before = _forwarded(emulator)
        # What a page's fetch(..., {mode: "no-cors", body: "..."}) sends: text/plain, its Origin.
        headers = {"Origin": EVIL, "Content-Type": "text/plain;charset=UTF-8"}
        async with http.post(side.base_url + "/responses", data=body("steal"), headers=headers) as resp:
            assert resp.status == 403
            assert resp.headers["Content-Type"].startswith("application/json")
            assert not any(h.lower().startswith("access-control-") for h in resp.headers)
            openai_error(await resp.read(), "origin_not_allowed")
        # The same for any other API path (a relayed GET /v1/models).
        async with http.get(side.base_url + "/models", headers={"Origin": EVIL}) as resp:
            assert resp.status == 403
    assert _forwarded(emulator) == before, "a browser request reached the upstream"
    assert metric(await metrics(side), "upshift_browser_refusals_total", reason="origin") == 2


async def test_a_cross_origin_websocket_upgrade_is_refused(emulator: Emulator, spawn: Spawn) -> None:
    side = await started(spawn, emulator.base_url, **INJECTED)
    url = side.base_url.replace("http://", "ws://") + "/responses"
    async with aiohttp.ClientSession() as http:
        opened = emulator.stats.ws_connections["opened"]
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with http.ws_connect(url, headers={"Origin": EVIL}):
                raise AssertionError("a foreign origin opened the WebSocket")
        assert refused.value.status == 403
        # The control: a Codex-style client (no Origin) reads its response over the socket.
        async with http.ws_connect(url) as ws:
            await ws.send_str(orjson.dumps({"type": "response.create", "model": "gpt-6.1-sol", "input": "hi"}).decode())
            while (event := orjson.loads((await ws.receive(timeout=10)).data))["type"] != "response.completed":
                assert event["type"] != "error", event
    assert emulator.stats.ws_connections["opened"] == opened + 1  # the control's socket only
    assert metric(await metrics(side), "upshift_browser_refusals_total", reason="origin") == 1


async def test_an_allowed_origin_is_let_through_but_never_granted_cors(emulator: Emulator, spawn: Spawn) -> None:
    side = await started(spawn, emulator.base_url, UPSHIFT_LISTENER_ALLOWED_ORIGINS="https://app.example")
    async with aiohttp.ClientSession() as http:
        headers = {"Origin": "https://app.example", "Authorization": f"Bearer {ALICE}"}
        async with http.post(side.base_url + "/responses", data=body(), headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            assert not any(h.lower().startswith("access-control-") for h in resp.headers)
        async with http.post(side.base_url + "/responses", data=body(), headers={"Origin": EVIL}) as resp:
            assert resp.status == 403


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "attacker.test:80"])
async def test_a_foreign_host_is_refused_on_loopback(emulator: Emulator, spawn: Spawn, host: str) -> None:
    # DNS rebinding: evil.example now resolves to 127.0.0.1, the page is same-origin (no Origin
    # on its GETs) and names its own host.
    side = await started(spawn, emulator.base_url, **INJECTED)
    name, port = hostport(side)
    before = _forwarded(emulator)
    for method, path, payload in [("POST", "/v1/responses", body()), ("GET", "/v1/models", b"")]:
        reader, writer = await _raw(name, port, method, path, host.format(port=port), payload)
        status, _, data = await answer(reader)
        writer.close()
        assert status == 403, data[:200]
        openai_error(data, "host_not_allowed")
    assert _forwarded(emulator) == before
    # The controls: the listen address, localhost:PORT and 127.0.0.1 without a port.
    for good in (f"{name}:{port}", f"localhost:{port}", "127.0.0.1"):
        reader, writer = await _raw(name, port, "POST", "/v1/responses", good, body())
        status, _, data = await answer(reader)
        writer.close()
        assert status == 200, (good, data[:200])


async def test_a_configured_host_name_is_accepted(emulator: Emulator, spawn: Spawn) -> None:
    side = await started(spawn, emulator.base_url, UPSHIFT_LISTENER_ALLOWED_HOSTS="upshift.internal")
    name, port = hostport(side)
    reader, writer = await _raw(name, port, "POST", "/v1/responses", f"upshift.internal:{port}", body())
    status, _, data = await answer(reader)
    writer.close()
    assert status == 200, data[:200]


async def test_a_preflight_is_answered_locally_without_a_grant(emulator: Emulator, spawn: Spawn) -> None:
    side = await started(spawn, emulator.base_url, UPSHIFT_LISTENER_ALLOWED_ORIGINS="https://app.example")
    before = _forwarded(emulator)
    async with aiohttp.ClientSession() as http:
        for origin in ("https://app.example", EVIL, None):
            headers = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
            if origin:
                headers["Origin"] = origin
            async with http.options(side.base_url + "/responses", headers=headers) as resp:
                assert resp.status in (204, 403), resp.status
                assert (resp.status == 403) == (origin == EVIL)
                assert not any(h.lower().startswith("access-control-") for h in resp.headers), dict(resp.headers)
    assert _forwarded(emulator) == before, "a preflight was relayed upstream"


async def test_access_control_headers_of_relayed_answers_are_dropped(emulator: Emulator, spawn: Spawn) -> None:
    # An upstream (or a gateway in front of it) that grants CORS: its grant never reaches a page.
    side = await started(spawn, emulator.base_url, UPSHIFT_MODE="http")
    grant = {"access-control-allow-origin": "*", "access-control-allow-credentials": "true", "x-upstream-mark": "1"}
    emulator.faults.arm("error", status=429, transport="http", headers=grant)
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {ALICE}"}
        async with http.post(side.base_url + "/responses", data=body(), headers=headers) as resp:
            assert resp.status == 429, await resp.text()
            assert resp.headers.get("x-upstream-mark") == "1"  # the control: other headers relayed
            assert not any(h.lower().startswith("access-control-") for h in resp.headers), dict(resp.headers)


async def _raw(name: str, port: int, method: str, path: str, host: str, payload: bytes) -> Any:
    return await raw_request(name, port, host, method=method, path=path, key=ALICE, length=len(payload), first=payload)
