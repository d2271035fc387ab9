"""``stream_id`` lanes exactly as protocol.md §1.4/§1.6, lane-less upstreams, and the lane fault hooks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import websockets
from websockets.asyncio.client import ClientConnection

from upshift_emulator import Emulator

from .conftest import KEY, TERMINAL, EmulatorFactory

pytestmark = pytest.mark.timeout(30)
Event = dict[str, Any]


@pytest.fixture
async def ws(emulator: Emulator) -> AsyncIterator[ClientConnection]:
    async with websockets.connect(emulator.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}) as conn:
        yield conn


def create(stream_id: str | None = None, **fields: Any) -> str:
    body: dict[str, Any] = {
        "type": "response.create",
        "model": "gpt-6.1-sol",
        "input": "hello",
        "store": False,
        **fields,
    }
    if stream_id is not None:
        body["stream_id"] = stream_id
    return json.dumps(body)


async def recv(conn: ClientConnection) -> Event:
    event: Event = json.loads(await asyncio.wait_for(conn.recv(), 5))
    return event


async def until_terminals(conn: ClientConnection, count: int) -> list[Event]:
    """Every event until ``count`` terminal events (or errors) arrived."""
    events: list[Event] = []
    while count:
        events.append(await recv(conn))
        count -= events[-1]["type"] in TERMINAL
    return events


async def wait_held(emu: Emulator, count: int) -> None:
    for _ in range(250):
        if len(emu.faults.held) >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"only {len(emu.faults.held)} responses held")


async def test_lane_limits_and_errors_are_exact(ws: ClientConnection, emulator: Emulator) -> None:
    for bad in ("", "a b", "x" * 257, 7):
        await ws.send(create(bad))  # type: ignore[arg-type]
        assert await recv(ws) == {
            "type": "error",
            "status": 400,
            "error": {
                "message": "The 'stream_id' field must be a non-empty string with at most 256 characters and may "
                "only contain letters, numbers, underscores, hyphens, and periods.",
                "type": "invalid_request_error",
                "param": "stream_id",
                "code": "invalid_stream_id",
            },
        }
    for index in range(32):
        await ws.send(create(f"lane.{index}"))
    events = await until_terminals(ws, 32)
    assert all(e["stream_id"].startswith("lane.") for e in events)
    await ws.send(create("lane-33"))
    assert await recv(ws) == {
        "type": "error",
        "status": 400,
        "stream_id": "lane-33",
        "error": {
            "message": "This WebSocket connection has reached its maximum number of distinct stream IDs (32). "
            "Reuse an existing stream_id or open a new WebSocket connection.",
            "type": "invalid_request_error",
            "param": "stream_id",
            "code": "websocket_stream_limit_reached",
        },
    }
    await ws.send(create("lane.3"))  # reusing an id still works, and so does the default lane
    await ws.send(create())
    last = await until_terminals(ws, 2)
    assert {e.get("stream_id") for e in last if e["type"] == "response.completed"} == {"lane.3", None}


async def test_sixteen_in_flight_more_queue(ws: ClientConnection, emulator: Emulator) -> None:
    emulator.faults.arm("hold", count=20, after_events=1)
    for index in range(20):
        await ws.send(create(f"s{index}"))
    await wait_held(emulator, 16)
    await asyncio.sleep(0.1)  # nothing more starts while 16 run
    assert len(emulator.faults.held) == 16
    conn_stats = next(iter(emulator.stats.connections.values()))
    assert conn_stats.in_flight == 16 and conn_stats.max_in_flight == 16
    emulator.faults.release()
    await wait_held(emulator, 4)  # the 4 queued ones start and are held in turn
    emulator.faults.release()
    events = await until_terminals(ws, 20)
    assert sum(e["type"] == "response.completed" for e in events) == 20
    assert conn_stats.max_in_flight == 16


async def test_not_found_on_one_lane_while_others_stream(ws: ClientConnection, emulator: Emulator) -> None:
    emulator.faults.arm("hold", count=2, after_events=3, match={"stream_id": ["a", "b"]})
    emulator.faults.arm("miss", match={"stream_id": "c"})
    await ws.send(create("a"))
    await ws.send(create("b"))
    await wait_held(emulator, 2)
    await ws.send(create("c", previous_response_id="resp_parent"))
    error = None
    while error is None:
        event = await recv(ws)
        if event["type"] == "error":
            error = event
    assert error["stream_id"] == "c" and error["error"]["code"] == "previous_response_not_found"
    emulator.faults.release()
    events = await until_terminals(ws, 2)
    assert {e["stream_id"] for e in events if e["type"] == "response.completed"} == {"a", "b"}


@pytest.mark.parametrize("after_events", [0, 4])
async def test_drop_with_several_lanes_in_flight(ws: ClientConnection, emulator: Emulator, after_events: int) -> None:
    emulator.faults.arm("hold", count=3, after_events=after_events)
    for lane in ("a", "b", "c"):
        await ws.send(create(lane))
    await wait_held(emulator, 3)
    assert {h.stream_id for h in emulator.faults.held} == {"a", "b", "c"}
    async with aiohttp.ClientSession() as session:  # the control endpoint does the same as release()
        async with session.post(emulator.url + "/_emulator/faults/release", json={"then": "drop"}) as resp:
            assert (await resp.json())["released"] == 3
    received: list[Event] = []
    with pytest.raises(websockets.ConnectionClosedError) as info:
        while True:
            received.append(await recv(ws))
    assert info.value.rcvd is None  # 1006: no close frame
    assert len(received) == 3 * after_events
    assert emulator.stats.faults_fired["hold"] == 3


async def test_age_limit_on_a_multiplexed_socket(ws: ClientConnection, emulator: Emulator) -> None:
    emulator.faults.arm("hold", count=2, after_events=2, match={"stream_id": ["a", "b"]})
    emulator.faults.arm("age_limit", match={"stream_id": "c"})
    await ws.send(create("a"))
    await ws.send(create("b"))
    await wait_held(emulator, 2)
    await ws.send(create("c"))
    received = []
    with pytest.raises(websockets.ConnectionClosedOK):
        while True:
            received.append(await recv(ws))
    assert received[-1] == {
        "type": "error",
        "status": 400,
        "error": {
            "message": "Responses websocket connection limit reached (60 minutes). "
            "Create a new websocket connection to continue.",
            "type": "invalid_request_error",
            "param": None,
            "code": "websocket_connection_limit_reached",
        },
    }
    assert ws.close_code == 1000
    emulator.faults.clear()


@pytest.mark.parametrize("mode", ["reject", "close"])
async def test_laneless_upstream(make_emulator: EmulatorFactory, mode: str) -> None:
    emu = await make_emulator(ws_stream_ids=mode)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with websockets.connect(emu.ws_url, additional_headers=headers) as conn:
        await conn.send(create("lane-1"))
        if mode == "close":
            with pytest.raises(websockets.ConnectionClosedError):
                await recv(conn)
            assert conn.close_code == 1008
            return
        assert await recv(conn) == {
            "type": "error",
            "status": 400,
            "error": {
                "type": "invalid_request_error",
                "code": "unknown_parameter",
                "message": "Unknown parameter: 'stream_id'.",
                "param": "stream_id",
            },
        }
        await conn.send(create())  # the socket stays open for the default lane
        events = await until_terminals(conn, 1)
        assert events[-1]["type"] == "response.completed" and "stream_id" not in events[-1]


async def test_error_fault_with_misalignment(ws: ClientConnection, emulator: Emulator) -> None:
    misalignment = {
        "error_type": "potentially_unintended_data_transfer",
        "detailed_explanation": "The action would send a file to an unknown host.",
        "review_target": "rev_123",
        "steer": {"message": "Ask the user first."},
    }
    emulator.faults.arm("error", status=400, code="misaligned_action", misalignment=misalignment)
    await ws.send(create("m"))
    event = await recv(ws)
    assert event["stream_id"] == "m" and event["error"]["misalignment"] == misalignment


async def test_hold_over_http_then_fail_or_continue(emulator: Emulator) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        emulator.faults.arm("hold", transport="http", after_events=3, then="fail")
        body = {"model": "gpt-6.1-sol", "input": "hold me", "stream": True}
        request = asyncio.create_task(session.post(emulator.base_url + "/responses", json=body))
        await wait_held(emulator, 1)
        assert emulator.faults.release() == 1
        async with await request as resp:
            text = await resp.text()
        kinds = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert kinds[-1] == "response.failed" and len(kinds) == 4
        emulator.faults.arm("hold", transport="http")
        plain = asyncio.create_task(session.post(emulator.base_url + "/responses", json={**body, "stream": False}))
        await wait_held(emulator, 1)
        emulator.faults.release("continue")
        async with await plain as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "completed"
