"""Three in-process replicas with static peers: requests spread round-robin keep continuing."""

from __future__ import annotations

import asyncio

import aiohttp

from proxy.emulator import Emulator

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
