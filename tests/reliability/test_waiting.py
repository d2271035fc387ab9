"""The waiting rule executed end to end: a turn whose lane is busy does not wait on a guess.

Against an upstream whose sockets carry one response each (one socket per key here), a stored
conversation whose lane was given to another conversation, now in flight, has an alternative
it can take at once: an HTTP continuation. Nothing measured says a lane would save anything
against it yet, so the turn does not wait for the lane; the access line and
``upshift_lane_waits_total`` say why.

A new conversation while the key's sockets grow (one in its handshake) waits for that lane only
while its next turn continued in memory is measured to save more than the wait: against an
upstream that charges nothing for a rebuilt context, it goes over HTTP at once rather than
waiting for the handshake.
"""

from __future__ import annotations

import asyncio
import io
import logging

import aiohttp
import orjson

from proxy.observe.log import ACCESS_LOGGER, JsonFormatter
from tests.reliability.conftest import EmulatorFactory, SidecarFor
from tests.reliability.helpers import Conversation, metric
from upshift_emulator import LatencyModel


async def test_a_stored_turn_whose_lane_is_busy_is_continued_over_http_at_once(
    make_emulator: EmulatorFactory, sidecar_for: SidecarFor
) -> None:
    not_worth = metric("upshift_lane_waits_total", outcome="wait_not_worth_it")
    continued = metric("upshift_http_continuations_total", sent="continuation")
    buffer, logger = io.StringIO(), logging.getLogger(ACCESS_LOGGER)
    handler, level = logging.StreamHandler(buffer), logger.level
    handler.setFormatter(JsonFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        await _run(make_emulator, sidecar_for, not_worth, continued)
        await asyncio.sleep(0.05)  # the last line is written after the answer
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [orjson.loads(line) for line in buffer.getvalue().splitlines() if line.strip()]
    (line,) = [line for line in lines if line.get("transport") == "http"]
    assert (line["mode"], line["wait"]) == ("continuation", "wait_not_worth_it"), line
    assert line["wait_ms"] < line["added_ms"] + 1, line


async def _run(make_emulator: EmulatorFactory, sidecar_for: SidecarFor, not_worth: float, continued: float) -> None:
    emu = await make_emulator(ws_stream_ids="reject", latency=LatencyModel(ttft_ms=300))
    sc = await sidecar_for(emu.base_url, pool={"max_sockets_per_identity": 1, "lanes_per_socket": 1})
    async with aiohttp.ClientSession(trust_env=False) as http:
        a = Conversation(http, sc.base_url, emu, name="a", store=True)
        b = Conversation(http, sc.base_url, emu, name="b", store=True)
        await a.turn()  # on the only socket; its head stays there
        other = asyncio.ensure_future(b.turn())  # takes that socket's only lane (a's head detached)
        while not any(c.in_flight for c in emu.stats.connections.values()):  # b's response runs upstream
            await asyncio.sleep(0.01)
        reply = await a.send("a turn 1")
        record = a.accept(reply)  # the oracle: the model saw exactly a's history
        await other
    assert reply.headers["x-upshift-mode"] == "continuation" and record["continuation"] is True
    assert metric("upshift_http_continuations_total", sent="continuation") == continued + 1
    assert metric("upshift_lane_waits_total", outcome="wait_not_worth_it") == not_worth + 1


async def test_a_new_conversation_does_not_wait_for_a_handshake_longer_than_its_lane_saves(
    make_emulator: EmulatorFactory, sidecar_for: SidecarFor
) -> None:
    buffer, logger = io.StringIO(), logging.getLogger(ACCESS_LOGGER)
    handler, level = logging.StreamHandler(buffer), logger.level
    handler.setFormatter(JsonFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    # Sockets carry one response each (no lanes); a new socket's handshake takes 0.6 s; a
    # rebuilt context costs nothing, so a continuation saves nothing against a full send.
    emu = await make_emulator(ws_stream_ids="reject", latency=LatencyModel(ttft_ms=300, connect_ms=600))
    sc = await sidecar_for(emu.base_url, pool={"max_sockets_per_identity": 2, "lanes_per_socket": 1})
    try:
        async with aiohttp.ClientSession(trust_env=False) as http:
            a = Conversation(http, sc.base_url, emu, name="a", store=True)
            b = Conversation(http, sc.base_url, emu, name="b", store=True)
            c = Conversation(http, sc.base_url, emu, name="c", store=True)
            await a.turn()  # socket 1; a full send measured
            await a.turn()  # a continuation measured
            busy = asyncio.ensure_future(a.turn())  # socket 1 carries a's response
            while not any(conn.in_flight for conn in emu.stats.connections.values()):
                await asyncio.sleep(0.01)
            opening = asyncio.ensure_future(b.turn())  # socket 2 opens for b (the key's last)
            await asyncio.sleep(0.2)  # its handshake under way: the key's lanes are growing
            reply = await c.send("c turn 0")
            c.accept(reply)  # the oracle: the model saw exactly c's history
            await asyncio.gather(busy, opening)
        await asyncio.sleep(0.05)  # the last line is written after the answer
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert reply.headers["x-upshift-mode"] == "passthrough"
    lines = [orjson.loads(line) for line in buffer.getvalue().splitlines() if line.strip()]
    (line,) = [line for line in lines if line.get("request_id") == reply.headers.get("x-request-id")]
    assert line["wait"] in ("wait_not_worth_it", "wait_expired"), line
    assert line["wait_ms"] < 150, line  # not the handshake's 0.6 s (pool.wait_seconds: 1 s)
