"""WebSocket-native apps through the sidecar: ``client.responses.connect()`` relayed frame by frame."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from openai import AsyncOpenAI
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError, InvalidStatus

from bench.ports import free_port
from proxy.serve.relay import sendable_code
from tests.sidecar import Sidecar
from upshift_emulator import Emulator

KEY = "sk-test"


async def next_terminal(conn: Any) -> Any:
    async for event in conn:
        if event.type in ("response.completed", "response.failed", "response.incomplete", "error"):
            return event
    raise AssertionError("connection ended without a terminal event")


async def test_three_turn_chain_over_connect(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    client = AsyncOpenAI(base_url=sidecar.base_url, api_key=KEY, max_retries=0)
    previous: str | None = None
    async with client.responses.connect() as conn:
        for turn in range(3):
            await conn.response.create(
                model="gpt-6.1-sol", input=f"turn {turn}", previous_response_id=previous, store=False
            )
            event = await next_terminal(conn)
            assert event.type == "response.completed", event
            assert event.response.previous_response_id == previous
            previous = event.response.id
    assert emulator.stats.requests["ws"] == 3 and emulator.stats.cache_hits == 2
    assert emulator.stats.ws_connections["opened"] == 1
    assert sidecar.pool.count() == 0  # relays never use the pool


@pytest.mark.parametrize("status", [401, 403, 426])
async def test_refused_upstream_upgrade_answers_the_same_status(stack: tuple[Emulator, Sidecar], status: int) -> None:
    emulator, sidecar = stack
    emulator.faults.arm("refuse_upgrade", status=status)
    with pytest.raises(InvalidStatus) as info:
        async with connect(
            sidecar.url.replace("http", "ws") + "/v1/responses", additional_headers={"Authorization": f"Bearer {KEY}"}
        ):
            pass
    assert info.value.response.status_code == status


async def test_unreachable_upstream_answers_426() -> None:
    port = free_port()
    async with Sidecar(f"http://127.0.0.1:{port}/v1") as sidecar:
        with pytest.raises(InvalidStatus) as info:
            async with connect(sidecar.url.replace("http", "ws") + "/v1/responses"):
                pass
        assert info.value.response.status_code == 426


async def test_upstream_close_code_reaches_the_app(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    emulator.faults.arm("close", after_events=2, close_code=1011)
    async with connect(
        sidecar.url.replace("http", "ws") + "/v1/responses", additional_headers={"Authorization": f"Bearer {KEY}"}
    ) as ws:
        await ws.send('{"type":"response.create","model":"gpt-6.1-sol","input":"hi"}')
        with pytest.raises(ConnectionClosedError) as info:
            while True:
                await ws.recv()
        assert info.value.rcvd is not None and info.value.rcvd.code == 1011


async def test_app_close_code_reaches_the_upstream(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    async with connect(
        sidecar.url.replace("http", "ws") + "/v1/responses", additional_headers={"Authorization": f"Bearer {KEY}"}
    ) as ws:
        await ws.send('{"type":"response.create","model":"gpt-6.1-sol","input":"hi"}')
        while b"response.completed" not in (await ws.recv(decode=False)):
            pass
        await ws.close(4000, "app done")
    for _ in range(50):
        codes = [c.close_code for c in emulator.stats.connections.values()]
        if codes and codes[0] is not None:
            break
        await asyncio.sleep(0.02)
    assert codes == [4000]


@pytest.mark.parametrize(
    ("code", "sent"), [(None, 1000), (1000, 1000), (1005, 1000), (1006, 1011), (1011, 1011), (4001, 4001), (999, 1011)]
)
def test_sendable_close_codes(code: int | None, sent: int) -> None:
    assert sendable_code(code) == sent
