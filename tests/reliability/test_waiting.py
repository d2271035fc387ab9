"""The waiting rule executed end to end: a turn whose lane is busy does not wait on a guess.

Against an upstream whose sockets carry one response each (one socket per key here), a stored
conversation whose lane was given to another conversation, now in flight, has an alternative
it can take at once: an HTTP continuation. Nothing measured says a lane would save anything
against it yet, so the turn does not wait for the lane; the access line and
``upshift_lane_waits_total`` say why.
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
