"""Plain HTTP relay: every other ``/v1`` path, and the requests WebSocket mode cannot carry."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from openai import AsyncOpenAI, NotFoundError

from bench.ports import free_port
from tests.conftest import SidecarFactory
from tests.sidecar import Sidecar
from upshift_emulator import Emulator

KEY = "sk-test"


def client(sidecar: Sidecar, key: str = KEY) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=sidecar.base_url, api_key=key, max_retries=0)


async def test_models(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    raw = await client(sidecar).models.with_raw_response.list()
    assert raw.headers["x-upshift-mode"] == "passthrough" and raw.headers["x-request-id"].startswith("req_")
    assert "gpt-6.1-sol" in [m.id for m in raw.parse().data]
    assert (await client(sidecar).models.retrieve("gpt-6.1-sol")).id == "gpt-6.1-sol"


async def test_chat_completions_and_embeddings(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    c = client(sidecar)
    completion = await c.chat.completions.create(model="gpt-4.1", messages=[{"role": "user", "content": "hi"}])
    assert completion.choices[0].message.content
    chunks = [
        chunk
        async for chunk in await c.chat.completions.create(
            model="gpt-4.1", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    ]
    assert chunks
    vectors = await c.embeddings.create(model="text-embedding-3-small", input=["a", "b"])
    assert len(vectors.data) == 2
    assert emulator.stats.other_requests["embeddings"] == 1


async def test_files_multipart_streams_through(stack: tuple[Emulator, Sidecar]) -> None:
    _, sidecar = stack
    payload = b"line\n" * 50_000
    uploaded = await client(sidecar).files.create(file=("data.jsonl", payload), purpose="batch")
    assert uploaded.bytes == len(payload) and uploaded.filename == "data.jsonl"


async def test_background_goes_over_http_and_get_delete_by_id(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    c = client(sidecar)
    raw = await c.responses.with_raw_response.create(model="gpt-6.1-sol", input="hi", background=True)
    assert raw.headers["x-upshift-mode"] == "passthrough"
    queued = raw.parse()
    assert queued.status in ("queued", "in_progress")
    for _ in range(50):
        found = await c.responses.retrieve(queued.id)
        if found.status == "completed":
            break
        await asyncio.sleep(0.02)
    assert found.status == "completed"
    deleted = await c.responses.delete(queued.id)
    assert deleted is None or True  # the SDK returns None for delete
    with pytest.raises(NotFoundError):
        await c.responses.retrieve(queued.id)
    assert emulator.stats.ws_connections["opened"] == 0


async def test_conversation_goes_over_http(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    c = client(sidecar)
    conversation = await c.conversations.create()
    raw = await c.responses.with_raw_response.create(model="gpt-6.1-sol", input="hi", conversation=conversation.id)
    assert raw.headers["x-upshift-mode"] == "passthrough" and raw.parse().status == "completed"
    assert emulator.stats.requests["http"] == 1 and emulator.stats.ws_connections["opened"] == 0


async def test_oversize_request_goes_over_http(emulator: Emulator, make_sidecar: SidecarFactory) -> None:
    sidecar = await make_sidecar(limits={"ws_frame_budget_bytes": 2000})
    raw = await client(sidecar).responses.with_raw_response.create(model="gpt-6.1-sol", input="x" * 5000)
    assert raw.headers["x-upshift-mode"] == "passthrough" and raw.parse().status == "completed"


async def test_streamed_responses_over_http_are_not_buffered(emulator: Emulator, make_sidecar: SidecarFactory) -> None:
    sidecar = await make_sidecar(mode="http")
    stream = await client(sidecar).responses.create(model="gpt-6.1-sol", input="hi", stream=True)
    types = [event.type async for event in stream]
    assert types[0] == "response.created" and types[-1] == "response.completed"


async def test_hop_by_hop_and_cookies_are_not_forwarded(stack: tuple[Emulator, Sidecar]) -> None:
    _, sidecar = stack
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {KEY}", "Cookie": "a=b", "Connection": "keep-alive, X-Drop", "X-Drop": "1"}
        async with http.get(sidecar.base_url + "/models", headers=headers) as resp:
            assert resp.status == 200
            assert "Set-Cookie" not in resp.headers
            assert resp.headers["x-upshift-mode"] == "passthrough"


async def test_upstream_errors_pass_through_as_is(stack: tuple[Emulator, Sidecar]) -> None:
    _, sidecar = stack
    async with aiohttp.ClientSession() as http:
        async with http.get(
            sidecar.base_url + "/responses/resp_missing", headers={"Authorization": f"Bearer {KEY}"}
        ) as r:
            assert r.status == 404
            assert (await r.json())["error"]["type"] == "invalid_request_error"


async def test_unknown_paths_outside_v1_are_404(stack: tuple[Emulator, Sidecar]) -> None:
    _, sidecar = stack
    async with aiohttp.ClientSession() as http:
        async with http.get(sidecar.url + "/nothing") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/models", "/responses"])
async def test_upstream_refused_is_502(path: str) -> None:
    async with Sidecar(f"http://127.0.0.1:{free_port()}/v1") as sidecar:
        async with aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {KEY}"}
            if path == "/models":
                resp = await http.get(sidecar.base_url + path, headers=headers)
            else:
                resp = await http.post(
                    sidecar.base_url + path, json={"model": "gpt-6.1-sol", "input": "hi"}, headers=headers
                )
            assert resp.status == 502
            body = await resp.json()
            assert body["error"]["code"] == "upstream_unavailable"
            assert resp.headers["x-request-id"].startswith("req_")


async def test_configured_key_replaces_the_apps(
    emulator: Emulator, make_sidecar: SidecarFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPSHIFT_TEST_KEY", "sk-real")
    sidecar = await make_sidecar(api_key={"source": "env", "env": "UPSHIFT_TEST_KEY"})
    # The emulator rejects keys starting with sk-bad: the app's placeholder never reaches it.
    models = await client(sidecar, "sk-bad-placeholder").models.list()
    assert models.data
    response = await client(sidecar, "sk-bad-placeholder").responses.create(model="gpt-6.1-sol", input="hi")
    assert response.status == "completed"
