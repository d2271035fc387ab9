"""An Azure OpenAI app (the SDK's ``AzureOpenAI`` client: ``api-key`` header, ``api-version``
query) through the sidecar to the emulator serving Azure's v1 path ``/openai/v1``.

Every turn after the first is a cache-hitting continuation, the model sees exactly the app's
input, and two Azure keys never share a socket or a conversation head.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from openai import AsyncAzureOpenAI, DefaultAsyncHttpxClient

from tests.clients.support import (
    Capture,
    Run,
    assert_continuations,
    assert_fidelity,
    record,
    run_loop_async,
    task_text,
)
from tests.sidecar import Sidecar
from upshift_emulator import Emulator

KEYS = ("azure-key-a", "azure-key-b")
API_VERSION = "2025-04-01-preview"
STEPS = 4


def azure_client(capture: Capture, base_url: str, key: str) -> AsyncAzureOpenAI:
    """What an Azure app builds, with ``base_url`` pointing at the sidecar's ``/v1``."""
    hooks = {"request": [capture._on_request_async], "response": [capture._on_response_async]}
    http = DefaultAsyncHttpxClient(event_hooks=hooks, trust_env=False)
    return AsyncAzureOpenAI(base_url=base_url, api_key=key, api_version=API_VERSION, max_retries=0, http_client=http)


def check(emulator: Emulator, run: Run, capture: Capture) -> None:
    assert run.tool_calls == STEPS
    assert [e.status for e in capture.exchanges] == [200] * len(run.turns)
    assert_continuations(emulator, capture.bodies, run.response_ids, run.output_counts, capture.modes)
    assert_fidelity(emulator, capture.bodies, run.response_ids)


async def test_azure_app_gets_continuations_and_keys_stay_apart() -> None:
    async with Emulator(require_keys=KEYS) as emulator:
        upstream = emulator.url + "/openai/v1"
        async with Sidecar(upstream) as sidecar:
            captures = {key: Capture() for key in KEYS}
            clients = {key: azure_client(captures[key], sidecar.base_url, key) for key in KEYS}
            runs = await asyncio.gather(
                *(run_loop_async(clients[key], task_text(STEPS, key)) for key in KEYS),
            )
            for client in clients.values():
                await client.close()
        for key, run in zip(KEYS, runs, strict=True):
            check(emulator, run, captures[key])
        # Two keys, two partitions: no socket (emulator connection) served both, and every
        # continuation of one key is anchored on that key's own previous response.
        connections: dict[str, set[str]] = defaultdict(set)
        for key, run in zip(KEYS, runs, strict=True):
            for response_id in run.response_ids:
                connections[key].add(str(record(emulator, response_id)["connection_id"]))
            chain = [record(emulator, r)["previous_response_id"] for r in run.response_ids[1:]]
            assert chain == run.response_ids[:-1]
        assert not connections[KEYS[0]] & connections[KEYS[1]]
        stats = emulator.stats
        assert stats.ws_connections["refused"] == 0 and stats.errors["http"] == 0
        assert stats.continuations["ws"] == 2 * STEPS and stats.cache_hits == 2 * STEPS


async def test_azure_app_streaming_turns(emulator: Emulator) -> None:
    """``stream=True`` through ``AzureOpenAI``: same continuation and fidelity checks."""
    async with Sidecar(emulator.url + "/openai/v1") as sidecar:
        capture = Capture()
        client = azure_client(capture, sidecar.base_url, "azure-key-stream")
        run = await run_loop_async(client, task_text(STEPS, "stream"), collect="stream_items")
        await client.close()
    check(emulator, run, capture)
    assert capture.modes == ["full"] + ["continuation"] * STEPS


async def test_azure_websocket_app_through_the_relay() -> None:
    """``AzureOpenAI(...).responses.connect()``: the upgrade carries ``api-key`` and
    ``api-version``; the relay opens its upstream socket on ``/openai/v1/responses`` with both."""
    async with Emulator(require_keys=KEYS) as azure, Sidecar(azure.url + "/openai/v1") as sidecar:
        client = AsyncAzureOpenAI(base_url=sidecar.base_url, api_key=KEYS[0], api_version=API_VERSION, max_retries=0)
        async with client.responses.connect() as conn:
            await conn.response.create(model="gpt-6.1-sol", input="Hello over Azure WebSocket mode.")
            while True:
                event = await asyncio.wait_for(conn.recv(), 5.0)
                if event.type in ("response.completed", "response.failed", "error"):
                    break
        await client.close()
        assert event.type == "response.completed", event
        rec = record(azure, event.response.id)
        assert rec["transport"] == "ws"
