"""One spelling of every path, and the owner's own reads whatever their query string.

The attacks: ``/v1/responses//ID``, ``/v1//responses/ID`` and ``/v1/files/..;/responses/ID``
matched no id route, so they went to the ``/v1`` catch-all unchecked, carrying the injected key
(a front end that merges slashes or honours ``;`` parameters would serve Alice's response to
Bob). And the false refusal: the query string was part of the identity, so Alice's own
``GET /v1/responses/{id}?stream=true&starting_after=N`` (the SDK's background-stream resume)
got 404. Both against a real sidecar process behind an injected key, the emulator upstream.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
import openai
import pytest
from yarl import URL

from tests.clients.support import Capture
from tests.reliability.helpers import Reply, assert_openai_error, auth
from tests.security.ingress import answer, hostport, openai_error, raw_request
from tests.security.support import ALICE, BOB, MODEL, Tenant, injected_env, start_process
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(120)

SECRET = "ALICE-SECRET-canonical-41d"


@pytest.fixture
async def sidecar(emulator: Emulator, spawn: Callable[..., SidecarProcess]) -> SidecarProcess:
    return await start_process(spawn, emulator.base_url, env=injected_env())


async def raw_get(http: aiohttp.ClientSession, api: str, path: str, key: str) -> Reply:
    """``GET`` with the path exactly as written (no client-side normalisation)."""
    async with http.get(URL(api + path, encoded=True), headers=auth(key), allow_redirects=False) as resp:
        return Reply(resp.status, resp.headers, await resp.read())


async def background(alice: Tenant, api: str) -> str:
    created = await alice.create(api, SECRET, background=True, store=True)
    rid = str(created["id"])
    for _ in range(100):  # the background response finishes on its own
        if (await alice.get(api, rid)).json.get("status") == "completed":
            return rid
    raise AssertionError("the background response never completed")


@pytest.mark.parametrize(
    "template",
    [
        "/v1/responses//{rid}",
        "/v1//responses/{rid}",
        "/v1/files/..;/responses/{rid}",
        "/v1/responses;x=1/{rid}",
        "/v1/files/%2e%2e/responses/{rid}",
        "/v1/files%2F..%2Fresponses/{rid}",
        "/v1/responses/{rid}/",
    ],
)
async def test_a_path_variant_is_refused_before_it_is_routed(
    sidecar: SidecarProcess, http: aiohttp.ClientSession, template: str
) -> None:
    alice = Tenant(ALICE, http)
    rid = await background(alice, sidecar.api)
    path = template.format(rid=rid)
    for key in (BOB, ALICE):  # no spelling but the canonical one, for anyone
        reply = await raw_get(http, sidecar.api, path, key)
        error = assert_openai_error(reply, 400, "invalid_request_error")
        assert error["message"].startswith(f"Invalid URL (GET {path}): the path has "), error
        assert "x-upshift-mode" not in reply.headers, reply.headers  # answered here, never forwarded
        assert SECRET.encode() not in reply.raw
    # The controls: the canonical path is Alice's, and Bob's gets the owner check's 404; a
    # percent-encoded letter is the same path to the router, the owner check and the upstream.
    assert (await raw_get(http, sidecar.api, f"/v1/responses/{rid}", ALICE)).status == 200
    assert (await raw_get(http, sidecar.api, f"/v1/%72esponses/{rid}", ALICE)).status == 200
    for path in (f"/v1/responses/{rid}", f"/v1/%72esponses/{rid}"):
        error = assert_openai_error(await raw_get(http, sidecar.api, path, BOB), 404)
        assert error["message"] == f"Response with id '{rid}' not found.", error


async def test_the_owner_resumes_its_background_stream_with_the_sdk(
    sidecar: SidecarProcess, http: aiohttp.ClientSession
) -> None:
    alice = Tenant(ALICE, http)
    rid = await background(alice, sidecar.api)
    capture = Capture()
    own = capture.async_client(sidecar.api + "/v1", api_key=ALICE)
    other = capture.async_client(sidecar.api + "/v1", api_key=BOB)
    try:
        stream = await own.responses.retrieve(rid, stream=True, starting_after=2)
        events = [event async for event in stream]
        assert events, "no event after the resume point"
        assert events[0].sequence_number == 3, events[0]
        assert events[-1].type == "response.completed" and events[-1].response.id == rid, events[-1]
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text, events
        # ?include[]= is a read of Alice's own too.
        included = await own.responses.retrieve(rid, include=["message.output_text.logprobs"])
        assert included.id == rid
        # Bob gets the upstream's own 404 for an unknown id, with or without a query string.
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(rid, stream=True, starting_after=2)
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(rid, include=["message.output_text.logprobs"])
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(rid)
    finally:
        await own.close()
        await other.close()
    # A query string of Bob's own invention does not make Alice's id his either.
    reply = await raw_get(http, sidecar.api, f"/v1/responses/{rid}?stream=false&x={MODEL}", BOB)
    assert_openai_error(reply, 404)


async def test_an_absolute_form_target_is_refused(sidecar: SidecarProcess, http: aiohttp.ClientSession) -> None:
    # "GET http://host/v1/responses/ID" is routed by its path, but was relayed by its whole text.
    alice = Tenant(ALICE, http)
    rid = await background(alice, sidecar.api)
    name, port = hostport(sidecar)
    for key in (BOB, ALICE):
        reader, writer = await raw_request(
            name, port, f"{name}:{port}", method="GET", path=f"{sidecar.api}/v1/responses/{rid}", key=key
        )
        try:
            status, headers, data = await answer(reader)
        finally:
            writer.close()
        assert status == 400 and "x-upshift-mode" not in headers, (status, headers, data[:200])
        error = openai_error(data, "invalid_request_error")
        assert error["message"].endswith("the path has an absolute-form target."), error
        assert SECRET.encode() not in data
