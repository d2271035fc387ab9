"""The WebSocket relay inside the memory budget and the socket pool.

Real sidecar processes on loopback, the emulator upstream. A message larger than the upstream's
own frame budget is refused from its frame header (close 1009) without the sidecar reading it:
RSS stays inside the memory budget; relay sessions beyond ``pool.max_sockets_per_identity`` /
``pool.max_sockets_total`` are refused with close 1013 and a message naming the limit, and no
upstream socket is opened for them. Each attack has the legitimate session as its control.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import aiohttp
import orjson
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.serve.relay import RELAY_REFUSED_CODE
from tests.reliability.helpers import user
from tests.security.support import ALICE, BOB, MODEL, relay_turn, start_process
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024
BUDGET = 96 * MIB


def create(text: str) -> dict[str, object]:
    return {"type": "response.create", "model": MODEL, "input": [user(text)]}


async def send_oversize(http: aiohttp.ClientSession, api: str, size: int) -> tuple[int | None, str]:
    """One relay session that sends a ``size``-byte text message; the close it got."""
    url = api.replace("http://", "ws://") + "/v1/responses"
    payload = b'{"type":"response.create","model":"gpt-6.1-sol","input":"' + b"x" * (size - 60) + b'"}'
    async with http.ws_connect(url, headers={"Authorization": f"Bearer {ALICE}"}, max_msg_size=0) as ws:
        # Sent while the answer is read: the sidecar closes before the payload is through.
        sending = asyncio.ensure_future(ws.send_bytes(payload))
        msg = await ws.receive(timeout=30)
        with contextlib.suppress(ConnectionError, aiohttp.ClientError):
            await sending
        assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING), msg
        return ws.close_code, str(msg.extra or "")


async def test_three_relayed_60_mib_messages_are_refused_inside_a_96_mib_budget(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url, env={"UPSHIFT_LIMITS_MEMORY_BYTES": str(BUDGET)})
    sidecar = psutil.Process(proc.proc.pid)
    before = sidecar.memory_info().rss
    frames_before = emulator.stats.ws_frames_received
    peak = before
    sampling = True

    async def sample() -> None:
        nonlocal peak
        while sampling:
            peak = max(peak, sidecar.memory_info().rss)
            await asyncio.sleep(0.005)

    sampler = asyncio.ensure_future(sample())
    try:
        for _ in range(3):
            code, reason = await send_oversize(http, proc.api, 60 * MIB)
            # 1009 "message too big" from the frame header; an app still sending when the
            # sidecar closes may see the close frame lost to the TCP reset (1006): refused.
            assert code in (1009, 1006), (code, reason)
            await asyncio.sleep(0.2)
    finally:
        sampling = False
        await sampler
    assert emulator.stats.ws_frames_received == frames_before, "an oversize message reached the upstream"
    # Nothing of the messages was buffered: far below even one of them, let alone the budget.
    assert peak - before < 16 * MIB, f"RSS grew {(peak - before) / MIB:.0f} MiB"
    # The control: a normal relayed turn in the same process still completes.
    events = await relay_turn(http, proc.api, ALICE, create("hello"))
    assert events[-1]["type"] == "response.completed", events


async def test_relay_sessions_beyond_the_socket_limits_are_refused_with_a_close_code(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    env = {"UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY": "2", "UPSHIFT_POOL_MAX_SOCKETS_TOTAL": "3"}
    proc = await start_process(spawn, emulator.base_url, env=env)
    url = proc.api.replace("http://", "ws://") + "/v1/responses"

    async def connect(key: str) -> aiohttp.ClientWebSocketResponse:
        return await http.ws_connect(url, headers={"Authorization": f"Bearer {key}"})

    async def refused(key: str) -> str:
        opened = emulator.stats.ws_connections["opened"]
        async with http.ws_connect(url, headers={"Authorization": f"Bearer {key}"}) as ws:
            msg = await ws.receive(timeout=10)
            assert msg.type is aiohttp.WSMsgType.CLOSE, msg
            assert ws.close_code == RELAY_REFUSED_CODE, ws.close_code
        assert emulator.stats.ws_connections["opened"] == opened, "an upstream socket was opened"
        return str(msg.extra)

    alice = [await connect(ALICE), await connect(ALICE)]
    # Alice holds her two sockets: her third session is refused, saying which limit.
    assert "pool.max_sockets_per_identity = 2" in await refused(ALICE)
    bob = await connect(BOB)  # Bob's first fits into the total (3) ...
    assert "pool.max_sockets_total = 3" in await refused(BOB)  # ... his second does not
    # The sessions that were admitted work.
    for ws in (*alice, bob):
        await ws.send_str(orjson.dumps(create("hi")).decode())
    for ws in (*alice, bob):
        while True:
            event = orjson.loads((await ws.receive(timeout=15)).data)
            if event["type"] == "response.completed":
                break
    # A closed session frees its slot.
    await alice[0].close()
    await asyncio.sleep(0.2)
    third = await connect(ALICE)
    await third.send_str(orjson.dumps(create("again")).decode())
    while orjson.loads((await third.receive(timeout=15)).data)["type"] != "response.completed":
        pass
    for ws in (alice[1], bob, third):
        await ws.close()


async def test_a_relayed_message_waits_for_memory_and_is_refused_with_an_error_event(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    # A request whose body is still coming holds what arrived (× 4); a relayed
    # message that does not fit beside it waits (unread) limits.memory_wait_seconds, then the app
    # gets the budget's 429 as an error event and the session closes 1013 (a message cannot be
    # skipped unread); nothing went upstream, and a new session is served once memory is free.
    env = {"UPSHIFT_LIMITS_MEMORY_BYTES": str(BUDGET), "UPSHIFT_LIMITS_MEMORY_WAIT_SECONDS": "1"}
    proc = await start_process(spawn, emulator.base_url, env=env)
    async with http.get(proc.admin + "/metrics") as resp:
        samples = {
            s.name + str(s.labels): s.value
            for family in text_string_to_metric_families(await resp.text())
            for s in family.samples
        }
    capacity = samples["upshift_memory_budget_bytes{}"] - samples["upshift_memory_bytes{'kind': 'baseline'}"]
    # Bob's arrived body takes 4 × 80 % of a quarter of what is free, Alice's message 4 × 40 %: one
    # fits beside the other only once Bob is gone.
    bob, alice = int(capacity / 4 * 0.8), int(capacity / 4 * 0.4)
    host, port = proc.api.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    # A body pays as it arrives: Bob sends all of his body but its last byte.
    head = f"POST /v1/responses HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {bob + 1}\r\n"
    writer.write(head.encode() + f"Authorization: Bearer {BOB}\r\n\r\n".encode() + b'{"input": "' + b"x" * (bob - 11))
    await writer.drain()
    await asyncio.sleep(0.5)  # Bob's lease has grown to what arrived
    url = proc.api.replace("http://", "ws://") + "/v1/responses"
    try:
        async with http.ws_connect(url, headers={"Authorization": f"Bearer {ALICE}"}) as ws:
            frames = emulator.stats.ws_frames_received
            await ws.send_str(orjson.dumps(create("y" * alice)).decode())
            event = orjson.loads((await ws.receive(timeout=15)).data)
            assert event["type"] == "error" and event["status"] == 429, event
            assert event["error"]["code"] == "memory_busy", event
            assert emulator.stats.ws_frames_received == frames
            closing = await ws.receive(timeout=15)
            assert closing.type is aiohttp.WSMsgType.CLOSE and closing.data == RELAY_REFUSED_CODE, closing
        writer.close()  # Bob gives up: his memory is free again
        await asyncio.sleep(0.3)
        async with http.ws_connect(url, headers={"Authorization": f"Bearer {ALICE}"}) as ws:
            await ws.send_str(orjson.dumps(create("y" * alice)).decode())
            while (event := orjson.loads((await ws.receive(timeout=15)).data))["type"] != "response.completed":
                assert event["type"] != "error", event
    finally:
        writer.close()


async def test_open_relay_sessions_count_against_the_pools_own_sockets(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    """The pool sees the relays too: with a credential's two sockets taken by relay sessions,
    its HTTP requests open no third upstream socket (they go over plain HTTP); once a session
    closes, the pool opens one again."""
    env = {"UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY": "2", "UPSHIFT_POOL_WAIT_SECONDS": "0.2"}
    proc = await start_process(spawn, emulator.base_url, env=env)
    url = proc.api.replace("http://", "ws://") + "/v1/responses"
    sessions = [await http.ws_connect(url, headers={"Authorization": f"Bearer {ALICE}"}) for _ in range(2)]
    for ws in sessions:  # both sessions opened their upstream sockets
        await ws.send_str(orjson.dumps(create("relay")).decode())
        while orjson.loads((await ws.receive(timeout=15)).data)["type"] != "response.completed":
            pass
    body = {"model": MODEL, "input": [user("over the pool")]}
    headers = {"Authorization": f"Bearer {ALICE}"}
    opened = emulator.stats.ws_connections["opened"]
    async with http.post(proc.api + "/v1/responses", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-upshift-mode"] == "passthrough"
    assert emulator.stats.ws_connections["opened"] == opened  # no socket beyond the limit
    await sessions[0].close()
    await asyncio.sleep(0.2)
    async with http.post(proc.api + "/v1/responses", json=body, headers=headers) as resp:  # the control
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-upshift-mode"] == "full"
    await sessions[1].close()
