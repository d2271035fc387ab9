"""The upstream clients follow no redirect: a key in any header (``api_key.header: api-key``)
never reaches another origin. A 3xx answer to the WebSocket upgrade is a refused upgrade (the
turn goes over HTTP); a 3xx answer to an HTTP request is relayed to the app as it is."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest

from tests.loopback import LoopbackServer
from tests.security.ingress import MODEL, started
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(90)

INJECTED = "sk-injected-REDIRECT-0123456789"


class Collector(LoopbackServer):
    """Another origin: records every request head it is sent, answers 404."""

    def __init__(self) -> None:
        super().__init__()
        self.heads: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.heads.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _env() -> dict[str, str]:
    return {
        "UPSHIFT_API_KEY_SOURCE": "env",
        "UPSHIFT_API_KEY_ENV": "REDIRECT_TEST_KEY",
        "REDIRECT_TEST_KEY": INJECTED,
        "UPSHIFT_API_KEY_HEADER": "api-key",
    }


async def _post(side: SidecarProcess, text: str) -> tuple[int, dict[str, str], bytes]:
    body = {"model": MODEL, "input": [{"role": "user", "content": text}], "store": False}
    headers = {"Authorization": "Bearer sk-placeholder-app-0123456789"}
    async with aiohttp.ClientSession() as http:
        async with http.post(side.base_url + "/responses", json=body, headers=headers, allow_redirects=False) as resp:
            return resp.status, dict(resp.headers), await resp.read()


async def test_a_redirected_upgrade_is_not_followed_and_the_turn_goes_over_http(
    emulator: Emulator, spawn: Callable[..., SidecarProcess]
) -> None:
    side = await started(spawn, emulator.base_url, **_env())
    async with Collector() as other:
        # The attack: the upstream (or whatever answers on its address) redirects the upgrade to
        # another origin, which received the injected key in api-key.
        location = f"ws://127.0.0.1:{other.port}/v1/responses"
        emulator.faults.arm("refuse_upgrade", status=307, headers={"Location": location}, count=100)
        status, headers, data = await _post(side, "hello")
        assert other.heads == [], other.heads
        # The control: the app is answered, over HTTP, with the key sent to the upstream only.
        assert status == 200, data
        assert emulator.stats.ws_connections["refused"] >= 1
        assert headers["x-upshift-mode"] == "passthrough", headers
        # An app's own WebSocket, relayed: the upgrade is refused to it, never redirected.
        url = side.api.replace("http://", "ws://") + "/v1/responses"
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(url, headers={"Authorization": "Bearer sk-placeholder-app-0123456789"})
        assert refused.value.status == 426 and "location" not in {k.lower() for k in refused.value.headers or {}}
        assert other.heads == [], other.heads


async def test_a_redirect_of_an_http_request_is_relayed_not_followed(
    emulator: Emulator, spawn: Callable[..., SidecarProcess]
) -> None:
    side = await started(spawn, emulator.base_url, **_env(), UPSHIFT_MODE="http")
    async with Collector() as other:
        location = f"http://127.0.0.1:{other.port}/v1/responses"
        emulator.faults.arm("error", status=307, headers={"Location": location})
        status, headers, _ = await _post(side, "hello")
        assert other.heads == [], other.heads
        assert status == 307 and headers["Location"] == location  # the app decides, with its own key
        # The control: the next request is served.
        status, _, data = await _post(side, "again")
        assert status == 200, data
