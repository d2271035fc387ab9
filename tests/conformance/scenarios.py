"""Scenarios that make the emulator emit every kind of payload it can: each returns what it received.

A scenario is ``async (emulator) -> list[Payload]``; a payload is ``(what, obj)`` with ``what`` one of
``response`` / ``error`` (HTTP JSON), ``sse`` (raw SSE bytes), ``ws`` (a WebSocket server frame), and
for what the scenario itself sent when it is meant to be valid: ``create`` (an HTTP body), ``client``
(a WebSocket client frame).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import websockets
from websockets.asyncio.client import ClientConnection

from upshift_emulator import Emulator

JSON = Any
Payload = tuple[str, JSON]
Scenario = Callable[[Emulator], Awaitable[list[Payload]]]
HEADERS = {"Authorization": "Bearer sk-test"}
TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})
TOOLS = [
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        "strict": False,
    }
]
COMPACT = {"context_management": [{"type": "compaction", "compact_threshold": 1000}]}
CACHE = {"prompt_cache_options": {"ttl": "12h", "comparison_response_id": "resp_abc"}}
REASONING = {"reasoning": {"effort": "low", "summary": "auto"}, "include": ["reasoning.encrypted_content"]}
BODIES: dict[str, dict[str, JSON]] = {
    "text": {"model": "gpt-6.1-sol", "input": "hello", "instructions": "be brief", "metadata": {"k": "v"}},
    "function_call": {"model": "gpt-6.1-sol", "input": "steps=2 parallel=2", "tools": TOOLS},
    "reasoning": {"model": "gpt-6.1-sol", "input": "steps=1 think", "tools": TOOLS, **REASONING},
    "incomplete": {"model": "gpt-6.1-sol", "input": "x" * 400, "max_output_tokens": 16},
    "compaction": {"model": "gpt-6.1-sol", "input": "y" * 4200, **COMPACT},
    "prompt_cache": {"model": "gpt-6.1-sol", "input": "cache", **CACHE},
    "prewarm": {"model": "gpt-6.1-sol", "input": "warm", "prompt_cache_options": {"prewarm": True}},
}  # fmt: skip


async def _post(session: aiohttp.ClientSession, emu: Emulator, body: JSON, path: str = "/responses") -> Payload:
    async with session.post(emu.base_url + path, json=body) as resp:
        if body.get("stream") is True and resp.status == 200:
            return "sse", await resp.read()
        data = await resp.json()
        return ("response" if resp.status == 200 else "error"), data


async def http_json(emu: Emulator) -> list[Payload]:
    """Every body as a plain JSON response, plus retrieve / background / cancel."""
    out: list[Payload] = []
    async with aiohttp.ClientSession(headers=HEADERS) as session:
        for body in BODIES.values():
            out.append(("create", body))
            out.append(await _post(session, emu, body))
        first = out[1][1]
        async with session.get(f"{emu.base_url}/responses/{first['id']}") as resp:
            out.append(("response", await resp.json()))
        out.append(
            await _post(session, emu, {"model": "gpt-6.1-sol", "input": "more", "previous_response_id": first["id"]})
        )
        queued = await _post(session, emu, {"model": "gpt-6.1-sol", "input": "later", "background": True})
        out.append(queued)
        async with session.post(f"{emu.base_url}/responses/{queued[1]['id']}/cancel") as resp:
            out.append(("response", await resp.json()))
        emu.faults.arm("fail", transport="http")
        out.append(await _post(session, emu, BODIES["text"]))  # 500 with the failure as an error body
    return out


async def http_sse(emu: Emulator) -> list[Payload]:
    """Every body streamed, with and without obfuscation, and a mid-stream failure."""
    out: list[Payload] = []
    async with aiohttp.ClientSession(headers=HEADERS) as session:
        for body in BODIES.values():
            out.append(("create", {**body, "stream": True}))
            out.append(await _post(session, emu, {**body, "stream": True}))
        plain = {**BODIES["function_call"], "stream": True, "stream_options": {"include_obfuscation": False}}
        out.append(await _post(session, emu, plain))
        emu.faults.arm("fail", transport="http", after_events=3)
        out.append(await _post(session, emu, {**BODIES["text"], "stream": True}))
    return out


async def http_errors(emu: Emulator) -> list[Payload]:
    """HTTP error bodies: validation, auth, not found, method, fault statuses with headers."""
    out: list[Payload] = []
    async with aiohttp.ClientSession(headers=HEADERS) as session:
        for body in (
            {"model": "gpt-6.1-sol", "input": "x", "bogus": 1},
            {"input": "x"},
            {"model": "gpt-6.1-sol", "input": "x", "previous_response_id": "resp_missing"},
            {"model": "gpt-6.1-sol", "input": "x", "max_output_tokens": 2},
            {"model": "gpt-6.1-sol", "input": "x", "prompt_cache_options": {"ttl": "1d"}},
        ):
            out.append(await _post(session, emu, body))
        emu.faults.arm("error", status=429, transport="http", headers={"retry-after": "1"})
        out.append(await _post(session, emu, BODIES["text"]))
        async with session.get(emu.base_url + "/responses/resp_nope") as resp:
            out.append(("error", await resp.json()))
        async with session.get(emu.base_url + "/responses") as resp:
            out.append(("error", await resp.json()))
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-bad-key-123456"}) as bad:
        out.append(await _post(bad, emu, BODIES["text"]))
    out.extend(await refused_upgrades(emu))
    return out


async def refused_upgrades(emu: Emulator) -> list[Payload]:
    """Bodies of refused WebSocket upgrades: a ``refuse_upgrade`` fault (426) and the per-key cap (429)."""
    out: list[Payload] = []
    emu.faults.arm("refuse_upgrade")
    capped = Emulator(ws_max_connections_per_key=1)
    await capped.start()
    try:
        for target in (emu, capped):
            async with websockets.connect(capped.ws_url, additional_headers=HEADERS):
                try:
                    async with websockets.connect(target.ws_url, additional_headers=HEADERS):
                        raise AssertionError("the upgrade was not refused")
                except websockets.InvalidStatus as refused:
                    out.append(("error", json.loads(refused.response.body)))
    finally:
        await capped.stop()
    return out


async def recv(conn: ClientConnection) -> JSON:
    return json.loads(await asyncio.wait_for(conn.recv(), 5))


async def turn(
    conn: ClientConnection, out: list[Payload], frame: JSON, terminals: int = 1, valid: bool = True
) -> list[JSON]:
    """Send one frame (recorded as ``client`` when ``valid``), collect frames until ``terminals`` terminals."""
    if valid:
        out.append(("client", frame))
    await conn.send(json.dumps(frame))
    events: list[JSON] = []
    while terminals:
        events.append(await recv(conn))
        out.append(("ws", events[-1]))
        terminals -= events[-1]["type"] in TERMINAL
    return events


def create(body: JSON, **extra: JSON) -> JSON:
    return {"type": "response.create", **body, **extra}


async def ws_turns(emu: Emulator) -> list[Payload]:
    """Every body over WebSocket, on the default lane and on named lanes; a chain; generate:false."""
    out: list[Payload] = []
    async with websockets.connect(emu.ws_url, additional_headers=HEADERS) as conn:
        for name, body in BODIES.items():
            await turn(conn, out, create(body, store=False))
            await turn(conn, out, create(body, stream_id=f"lane.{name}"))
        first = await turn(conn, out, create(BODIES["text"], generate=False))
        await turn(conn, out, create(BODIES["text"], previous_response_id=first[-1]["response"]["id"]))
        emu.faults.arm("fail", transport="ws", after_events=4)
        await turn(conn, out, create(BODIES["text"], stream_id="failing"))
    return out


async def ws_errors(emu: Emulator) -> list[Payload]:
    """WebSocket error frames: lanes, cache, limits, validation, faults."""
    out: list[Payload] = []
    async with websockets.connect(emu.ws_url, additional_headers=HEADERS) as conn:
        text = BODIES["text"]
        await turn(conn, out, create(text, stream_id=""), valid=False)
        await turn(conn, out, create(text, store=False, previous_response_id="resp_gone"))
        await turn(conn, out, create(text, store=False, previous_response_id="resp_gone", stream_id="l1"))
        await turn(conn, out, create(text, background=True))
        await turn(conn, out, create({"model": "gpt-6.1-sol", "input": "x", "bogus": True}), valid=False)
        await turn(conn, out, {"type": "response.cancel"}, valid=False)
        await conn.send("{not json")
        out.append(("ws", await recv(conn)))
        emu.faults.arm("error", status=429, transport="ws", headers={"retry-after": "2"})
        await turn(conn, out, create(text))
        misalignment = {"error_type": "other", "detailed_explanation": "why", "review_target": None}
        emu.faults.arm("error", status=400, transport="ws", code="misaligned", misalignment=misalignment)
        await turn(conn, out, create(text, stream_id="m"))
        for index in range(32):
            await turn(conn, out, create(text, stream_id=f"n{index}"))
        await turn(conn, out, create(text, stream_id="one-too-many"))
        emu.faults.arm("age_limit")
        await turn(conn, out, create(text))
    laneless = Emulator(ws_stream_ids="reject")
    await laneless.start()
    try:
        async with websockets.connect(laneless.ws_url, additional_headers=HEADERS) as conn:
            await turn(conn, out, create(text, stream_id="x"))
    finally:
        await laneless.stop()
    return out


async def _held(emu: Emulator, count: int) -> None:
    for _ in range(250):
        if len(emu.faults.held) >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("not held")


async def ws_steering(emu: Emulator) -> list[Payload]:
    """Steering: failed (default gate and gated), accepted → steered → successor, pending."""
    out: list[Payload] = []
    async with websockets.connect(emu.ws_url, additional_headers=HEADERS) as conn:
        await turn(conn, out, {"type": "response.steer", "previous_response_id": "resp_x", "input": "hi"}, 0)
        out.append(("ws", await recv(conn)))
    gated = Emulator(steer_models=("*",))
    await gated.start()
    try:
        async with websockets.connect(gated.ws_url, additional_headers=HEADERS) as conn:
            for lane, body in ((None, BODIES["text"]), ("tools", BODIES["function_call"])):
                gated.faults.arm("hold", after_events=3)
                frame = create(body) if lane is None else create(body, stream_id=lane)
                out.append(("client", frame))
                await conn.send(json.dumps(frame))
                created = await recv(conn)
                out.append(("ws", created))
                await _held(gated, 1)
                steer = {"type": "response.steer", "previous_response_id": created["response"]["id"], "input": "go"}
                out.append(("client", steer))
                await conn.send(json.dumps(steer))
                # The events sent before the hold, then response.steer.accepted (the target is
                # held until the accept is read: released earlier, the rest of the response
                # could be sent before the server reads the steer).
                while True:
                    out.append(("ws", await recv(conn)))
                    if out[-1][1]["type"] == "response.steer.accepted":
                        break
                gated.faults.release()
                terminals = 2 if lane is None else 1
                while terminals:
                    out.append(("ws", await recv(conn)))
                    terminals -= out[-1][1]["type"] in TERMINAL
            out.append(("ws", await recv(conn)))  # response.steer.pending after the tool turn
            bad = {"type": "response.steer", "previous_response_id": "resp_nope", "input": []}
            await conn.send(json.dumps(bad))
            out.append(("ws", await recv(conn)))
    finally:
        await gated.stop()
    return out


SCENARIOS: dict[str, Scenario] = {
    "http_json": http_json,
    "http_sse": http_sse,
    "http_errors": http_errors,
    "ws_turns": ws_turns,
    "ws_errors": ws_errors,
    "ws_steering": ws_steering,
}
