"""Fault hooks, armed in process and over ``POST /_emulator/faults``."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
import websockets
from openai import AsyncOpenAI

from upshift_emulator import NOT_FOUND_SHAPES, Emulator

from .conftest import KEY, final_response, read_turn, recv_json

pytestmark = pytest.mark.timeout(30)


async def test_http_error_429_keeps_headers(emulator: Emulator, client: AsyncOpenAI) -> None:
    emulator.faults.arm("error", status=429, headers={"retry-after": "2", "x-ratelimit-remaining-requests": "0"})
    with pytest.raises(openai.RateLimitError) as info:
        await client.responses.create(model="gpt-6.1-sol", input="x")
    assert info.value.response.headers["retry-after"] == "2"
    assert info.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert info.value.code == "rate_limit_exceeded"
    assert (await client.responses.create(model="gpt-6.1-sol", input="x")).status == "completed"
    assert emulator.stats.faults_fired == {"error": 1}


async def test_ws_error_429_headers_inside_error(emulator: Emulator, client: AsyncOpenAI) -> None:
    emulator.faults.arm("error", status=429, transport="ws", headers={"retry-after": "2"}, code="rate_limit_exceeded")
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="x")
        event = await recv_json(conn)
        assert event["type"] == "error" and event["status"] == 429
        assert event["error"]["headers"] == {"retry-after": "2"}
        assert event["error"]["code"] == "rate_limit_exceeded"
        await conn.response.create(model="gpt-6.1-sol", input="x")
        assert final_response(await read_turn(conn))["status"] == "completed"


@pytest.mark.parametrize("status,exc", [(500, openai.InternalServerError), (401, openai.AuthenticationError)])
async def test_http_error_statuses(emulator: Emulator, client: AsyncOpenAI, status: int, exc: type[Exception]) -> None:
    emulator.faults.arm("error", status=status, transport="http")
    with pytest.raises(exc):
        await client.responses.create(model="gpt-6.1-sol", input="x")


async def test_ws_drop_after_k_events(emulator: Emulator, client: AsyncOpenAI) -> None:
    emulator.faults.arm("drop", after_events=3)
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="x")
        received = []
        with pytest.raises(websockets.ConnectionClosedError) as info:
            while True:
                received.append(await recv_json(conn))
    assert len(received) == 3
    assert info.value.rcvd is None  # no close frame: abnormal closure (1006)


async def test_ws_close_1011(emulator: Emulator, client: AsyncOpenAI) -> None:
    emulator.faults.arm("close", close_code=1011, after_events=1)
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="x")
        assert (await recv_json(conn))["type"] == "response.created"
        with pytest.raises(websockets.ConnectionClosedError) as info:
            await conn.recv()
    assert info.value.rcvd is not None and info.value.rcvd.code == 1011


async def test_http_stream_drop(emulator: Emulator, client: AsyncOpenAI) -> None:
    emulator.faults.arm("drop", after_events=2, transport="http")
    stream = await client.responses.create(model="gpt-6.1-sol", input="x", stream=True)
    seen = []
    with pytest.raises(Exception) as info:
        async for event in stream:
            seen.append(event.type)
    assert not isinstance(info.value, AssertionError)
    assert seen == ["response.created", "response.in_progress"]


async def test_fail_mid_generation(emulator: Emulator, client: AsyncOpenAI) -> None:
    emulator.faults.arm("fail", after_events=3)
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="x")
        events = await read_turn(conn)
    assert [e["type"] for e in events][-1] == "response.failed"
    assert events[-1]["sequence_number"] == 3
    assert events[-1]["response"]["error"]["code"] == "server_error"
    emulator.faults.arm("fail")
    with pytest.raises(openai.InternalServerError):
        await client.responses.create(model="gpt-6.1-sol", input="x")
    assert emulator.stats.responses["failed"] == 2


async def test_refuse_upgrade_426(emulator: Emulator, client: AsyncOpenAI) -> None:
    emulator.faults.arm("refuse_upgrade", status=426)
    with pytest.raises(websockets.InvalidStatus) as info:
        async with client.responses.connect():
            pass
    assert info.value.response.status_code == 426
    assert emulator.stats.ws_connections["refused"] == 1
    async with client.responses.connect() as conn:  # one refusal only
        await conn.response.create(model="gpt-6.1-sol", input="x")
        assert final_response(await read_turn(conn))["status"] == "completed"


async def test_delay_and_match(emulator: Emulator, client: AsyncOpenAI) -> None:
    # A delay well above what a busy CI runner adds to an undelayed call (the SDK's first
    # connection included), so the two calls are told apart by the match alone.
    emulator.faults.arm("delay", seconds=1.0, match={"previous_response_id_present": True})
    started = time.monotonic()
    first = await client.responses.create(model="gpt-6.1-sol", input="x")
    assert time.monotonic() - started < 0.9
    started = time.monotonic()
    await client.responses.create(model="gpt-6.1-sol", input="y", previous_response_id=first.id)
    assert time.monotonic() - started >= 1.0


@pytest.mark.parametrize("shape", NOT_FOUND_SHAPES)
async def test_not_found_shapes(emulator: Emulator, client: AsyncOpenAI, shape: str) -> None:
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="a", store=False)
        first = final_response(await read_turn(conn))
        emulator.faults.arm("miss", shape=shape)
        await conn.response.create(model="gpt-6.1-sol", input="b", store=False, previous_response_id=first["id"])
        events = await read_turn(conn)
    last = events[-1]
    if shape == "response_failed":
        assert [e["type"] for e in events] == ["response.created", "response.failed"]
        assert last["response"]["error"]["code"] == "previous_response_not_found"
        return
    assert last["type"] == "error"
    code = last.get("code") or (last.get("error") or {}).get("code")
    message = last.get("message") or last["error"]["message"]
    expected_code = {"parameterless": None, "renamed": "codex_previous_response_stale"}.get(
        shape, "previous_response_not_found"
    )
    assert code == expected_code
    assert message in (f"Previous response with id '{first['id']}' not found.", "Invalid `previous_response_id`.")
    assert ("status" in last) == (shape not in ("alpha", "flat"))
    assert ("error" in last) == (shape in ("nested", "no_type", "alpha", "parameterless", "renamed"))


async def test_control_endpoints(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with aiohttp.ClientSession() as session:
        spec = {"kind": "error", "status": 429, "headers": {"retry-after": "1"}, "transport": "http", "count": 2}
        async with session.post(emulator.url + "/_emulator/faults", json=spec) as resp:
            assert resp.status == 200
            [armed] = (await resp.json())["armed"]
        async with session.post(emulator.url + "/_emulator/faults", json={"kind": "nope"}) as resp:
            assert resp.status == 400
        for _ in range(2):
            with pytest.raises(openai.RateLimitError):
                await client.responses.create(model="gpt-6.1-sol", input="x")
        ok = await client.responses.create(model="gpt-6.1-sol", input="x")
        async with session.get(emulator.url + "/_emulator/faults") as resp:
            assert (await resp.json())["faults"] == []
        async with session.get(emulator.url + f"/_emulator/responses/{ok.id}") as resp:
            record = await resp.json()
        assert record["id"] == ok.id and record["transport"] == "http" and len(record["context_digest"]) == 64
        async with session.get(emulator.url + "/_emulator/stats") as resp:
            stats = await resp.json()
        assert stats["requests"]["http"] == 3 and stats["faults_fired"] == {"error": 2}
        async with session.post(emulator.url + "/_emulator/latency", json={"ttft_ms": 5}) as resp:
            assert (await resp.json())["ttft_ms"] == 5.0
        async with session.post(emulator.url + "/_emulator/reset") as resp:
            assert resp.status == 200
        async with session.get(emulator.url + "/_emulator/stats") as resp:
            assert (await resp.json())["requests"]["http"] == 0
    assert armed["kind"] == "error" and emulator.record(ok.id) is None


async def test_fault_armed_from_another_thread(emulator: Emulator, client: AsyncOpenAI) -> None:
    await asyncio.to_thread(emulator.faults.arm, "error", status=503)
    with pytest.raises(openai.InternalServerError) as info:
        await client.responses.create(model="gpt-6.1-sol", input="x")
    assert info.value.status_code == 503


async def test_ws_bytes_received_counts_frames(emulator: Emulator) -> None:
    frame = json.dumps({"type": "response.create", "model": "gpt-6.1-sol", "input": "count me"})
    async with websockets.connect(emulator.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        await ws.send(frame)
        while json.loads(await ws.recv())["type"] != "response.completed":
            pass
    assert emulator.stats.bytes_received["ws"] == len(frame.encode())
    assert emulator.stats.bytes_received["http"] == 0
