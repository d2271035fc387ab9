"""Identity that cannot be misconfigured, and one credential value per header.

A configuration whose ``identity.headers`` leaves out a credential header the upstream accepts
(``Authorization``, ``api-key``, ``api_key.header``) is refused at startup: with it, apps with
different keys in that header would share one identity (sockets, heads, response ids). A request
that sends a credential header twice gets a 400 and nothing is forwarded: the identity would hash
one value while the HTTP relay forwards both, and the upstream may pick the other.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict

from tests.reliability.helpers import MODEL, Reply, assert_openai_error, user
from tests.security.support import ALICE, BOB, start_process
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({"UPSHIFT_IDENTITY_HEADERS": ""}, "missing Authorization, api-key"),
        ({"UPSHIFT_IDENTITY_HEADERS": "Authorization,OpenAI-Project"}, "missing api-key"),
        ({"UPSHIFT_API_KEY_HEADER": "x-gateway-key"}, "missing x-gateway-key"),
    ],
)
async def test_an_identity_without_every_credential_header_is_refused_at_startup(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], env: dict[str, str], missing: str
) -> None:
    proc = spawn(emulator.base_url, env=env)
    assert await proc.wait() == 1
    assert missing in proc.logs() and "identity.headers" in proc.logs()


async def test_the_default_and_a_complete_list_start(emulator: Emulator, spawn: Callable[..., SidecarProcess]) -> None:
    env = {"UPSHIFT_IDENTITY_HEADERS": "authorization,API-KEY,x-gateway-key", "UPSHIFT_API_KEY_HEADER": "x-gateway-key"}
    proc = await start_process(spawn, emulator.base_url, env=env)
    assert proc.proc.poll() is None


def twice(name: str, first: str, second: str) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json"})
    headers.add(name, first)
    headers.add(name, second)
    return headers


async def send(
    http: aiohttp.ClientSession, method: str, url: str, headers: CIMultiDict[str], body: bytes | None
) -> Reply:
    async with http.request(method, url, headers=headers, data=body) as resp:
        return Reply(resp.status, resp.headers, await resp.read())


@pytest.mark.parametrize("header", ["Authorization", "api-key", "OpenAI-Project"])
async def test_a_credential_header_sent_twice_gets_400_and_nothing_is_forwarded(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession, header: str
) -> None:
    proc = await start_process(spawn, emulator.base_url)
    value = lambda key: f"Bearer {key}" if header == "Authorization" else key  # noqa: E731
    body = orjson.dumps({"model": MODEL, "input": [user("hello")]})
    before = emulator.stats.snapshot()["requests"]
    headers = twice(header, value(ALICE), value(BOB))
    if header != "Authorization":
        headers["Authorization"] = f"Bearer {ALICE}"
    reply = await send(http, "POST", proc.api + "/v1/responses", headers, body)
    error = assert_openai_error(reply, 400, "invalid_request_error")
    assert error["message"] == f"The credential header '{header}' was sent more than once."
    assert_openai_error(await send(http, "GET", proc.api + "/v1/responses/resp_x", headers, None), 400)
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await http.ws_connect(proc.api.replace("http://", "ws://") + "/v1/responses", headers=headers)
    assert info.value.status == 400
    assert emulator.stats.snapshot()["requests"] == before, "something was forwarded"
    # The control: the same request with the header once goes through.
    once: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json", "Authorization": f"Bearer {ALICE}"})
    once[header] = value(ALICE)
    assert (await send(http, "POST", proc.api + "/v1/responses", once, body)).status == 200
