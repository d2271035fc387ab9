"""Three in-process replicas with static peers: requests spread round-robin keep continuing."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.clients.support import (
    MODEL,
    TOOLS,
    Capture,
    _stream_collect,
    record,
    run_loop_async,
    summarize,
    tool_outputs,
)
from tests.clients.support import assert_fidelity as assert_sdk_fidelity
from upshift_emulator import Emulator

from .support import STEPS, assert_fidelity, continued, direct, start_replicas, summary, task_text, tool_loop


async def test_round_robin_over_three_replicas_keeps_continuations(emulator: Emulator) -> None:
    servers, urls = await start_replicas(emulator.base_url, 3)
    try:
        tasks = [task_text(STEPS, f"rr-{i}") for i in range(30)]
        async with aiohttp.ClientSession() as session:
            convs = await asyncio.gather(*(tool_loop(session, urls, t, start=i) for i, t in enumerate(tasks)))
            want = await direct(emulator, session, tasks)
        for conv, ref in zip(convs, want, strict=True):
            assert summary(conv) == summary(ref)
            assert_fidelity(emulator, conv)
        turns = sum(len(c.response_ids) - 1 for c in convs)
        assert sum(continued(emulator, c) for c in convs) == turns
        # about 2/3 of the turns landed on a non-owner and were forwarded
        forwarded = sum(1 for c in convs for o in c.owners if o is not None)
        assert forwarded > turns // 3
    finally:
        for server in servers:
            await server.stop()


async def test_streamed_turns_through_forwards_are_the_upstream_events(emulator: Emulator) -> None:
    """The openai SDK streaming over three replicas, one client per replica, turns spread
    round-robin: every stream is exactly one response with consecutive sequence numbers, the
    answers equal a direct run's, and every later turn is a continuation."""
    servers, urls = await start_replicas(emulator.base_url, 3)
    try:
        capture = Capture()
        clients = [capture.async_client(u + "/v1") for u in urls]
        history: list[Any] = [{"role": "user", "content": task_text(STEPS, "sdk-stream")}]
        ids, contents = [], []
        for turn in range(STEPS + 1):
            stream = await clients[turn % 3].responses.create(model=MODEL, input=history, tools=TOOLS, stream=True)
            async with stream:
                events = [event async for event in stream]
            response_id, output = _stream_collect(events, "stream_items")
            ids.append(response_id)
            contents.append([summarize(o) for o in output])
            history += [o.model_dump(exclude_none=True) for o in output]
            history += tool_outputs(output)
        for client in clients:
            await client.close()
        direct_run = await run_loop_async(capture.async_client(emulator.base_url), task_text(STEPS, "sdk-stream"))
        assert contents == direct_run.contents
        bodies = capture.bodies[: STEPS + 1]
        assert_sdk_fidelity(emulator, bodies, ids)
        assert all(record(emulator, i)["continuation"] for i in ids[1:])
        assert capture.modes[: STEPS + 1] == ["full"] + ["continuation"] * STEPS
    finally:
        for server in servers:
            await server.stop()
