"""Per-key WebSocket connection cap and the network-distance model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest
import websockets

from upshift_emulator import Emulator, LatencyModel
from upshift_emulator.__main__ import build_parser, config_from_args

from .conftest import KEY, ClientFactory, EmulatorFactory, final_response, read_turn

pytestmark = pytest.mark.timeout(30)


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_cap_refuses_the_next_upgrade_with_429(make_emulator: EmulatorFactory) -> None:
    emu = await make_emulator(ws_max_connections_per_key=2, ws_connection_retry_after_s=3)
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(2):
            await stack.enter_async_context(websockets.connect(emu.ws_url, additional_headers=_auth()))
        with pytest.raises(websockets.InvalidStatus) as info:
            await websockets.connect(emu.ws_url, additional_headers=_auth())
        response = info.value.response
        assert response.status_code == 429
        assert response.headers["retry-after"] == "3"
        body = json.loads(response.body)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "rate_limit_exceeded" and "limit 2" in body["error"]["message"]
        # another key is not affected
        other = await stack.enter_async_context(websockets.connect(emu.ws_url, additional_headers=_auth("sk-other")))
        assert other.protocol.state.name == "OPEN"
    stats = emu.stats
    key = next(k for k in stats.keys.values() if k.peak_open == 2)
    assert key.refused == 1 and key.opened == 2
    assert len(key.attempts_at) == 3 and key.refused_at == key.attempts_at[2:]  # when, for retry-after tests
    assert stats.ws_connections["refused_cap"] == 1 and stats.ws_connections["refused"] == 1
    async with aiohttp.ClientSession() as session:
        async with session.get(emu.url + "/_emulator/stats") as resp:
            snapshot = await resp.json()
    assert sorted((k["peak_open"], k["refused"]) for k in snapshot["keys"].values()) == [(1, 0), (2, 1)]


async def test_cap_frees_a_slot_when_a_socket_closes(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator(ws_max_connections_per_key=1)
    client = sdk(emu)
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="one")
        assert final_response(await read_turn(conn))["status"] == "completed"
        with pytest.raises(websockets.InvalidStatus):
            await websockets.connect(emu.ws_url, additional_headers=_auth())
    for _ in range(100):  # the server notices the close asynchronously
        if all(k.open == 0 for k in emu.stats.keys.values()):
            break
        await asyncio.sleep(0.02)
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="two")
        assert final_response(await read_turn(conn))["status"] == "completed"
    assert emu.stats.ws_connections["refused_cap"] == 1


async def test_cap_cli_and_config() -> None:
    args = build_parser().parse_args(
        [
            "--ws-max-connections-per-key",
            "32",
            "--ws-connection-retry-after",
            "2",
            "--rtt-ms",
            "30",
            "--connect-ms",
            "60",
        ]
    )
    config = config_from_args(args)
    assert config.ws_max_connections_per_key == 32 and config.ws_connection_retry_after_s == 2
    assert config.latency.rtt_ms == 30 and config.latency.connect_ms == 60
    emu = Emulator(ws_max_connections_per_key=3)
    assert emu.config.ws_max_connections_per_key == 3


async def test_connect_delay_only_on_new_http_connections(make_emulator: EmulatorFactory) -> None:
    emu = await make_emulator(latency=LatencyModel(connect_ms=200.0))
    body = {"model": "gpt-6.1-sol", "input": "hi"}
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        for _ in range(3):  # one kept-alive connection
            async with session.post(emu.base_url + "/responses", json=body, headers=_auth()) as resp:
                assert resp.status == 200
        elapsed = time.monotonic() - started
    assert elapsed >= 0.2
    assert emu.stats.network["new_connections"] == 1 and emu.stats.network["connect_delays"] == 1
    async with aiohttp.ClientSession() as other:
        async with other.post(emu.base_url + "/responses", json=body, headers=_auth()) as resp:
            assert resp.status == 200
    assert emu.stats.network["connect_delays"] == 2


async def test_rtt_delays_every_message_both_ways(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator(latency=LatencyModel(rtt_ms=100.0, connect_ms=50.0))
    client = sdk(emu)
    started = time.monotonic()
    await client.responses.create(model="gpt-6.1-sol", input="http")
    assert time.monotonic() - started >= 0.1  # one round trip at least
    network = dict(emu.stats.network)
    assert network["inbound_delays"] == 1 and network["outbound_delays"] == 1
    async with client.responses.connect() as conn:
        started = time.monotonic()
        await conn.response.create(model="gpt-6.1-sol", input="ws")
        events = await read_turn(conn)
        assert time.monotonic() - started >= 0.1  # frame in, then the events out
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        await conn.response.create(
            model="gpt-6.1-sol", input="again", previous_response_id=events[-1]["response"]["id"]
        )
        second = await read_turn(conn)
    after = emu.stats.network
    # upgrade request + 2 frames in; 101 + every event out
    assert after["inbound_delays"] - network["inbound_delays"] == 3
    assert after["outbound_delays"] - network["outbound_delays"] == 1 + len(events) + len(second)
    assert after["connect_delays"] == 2  # the SDK's HTTP connection, then the WebSocket's own
