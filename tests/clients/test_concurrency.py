"""20 concurrent conversations through one sidecar, each with its own task and ≥ 3 tool calls."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.sidecar import Sidecar
from upshift_emulator import Emulator

from .support import (
    MODEL,
    TOOLS,
    Capture,
    Run,
    assert_continuations,
    assert_fidelity,
    record,
    run_loop_async,
    summarize,
    task_text,
    tool_outputs,
)

CONVERSATIONS = 20
STEPS = 3


async def one(base_url: str, index: int, collect: str) -> tuple[Run, Capture]:
    capture = Capture()
    async with capture.async_client(base_url) as client:
        run = await run_loop_async(client, task_text(STEPS, f"conversation #{index}"), collect=collect)
    return run, capture


async def test_twenty_concurrent_conversations(emulator: Emulator, sidecar: Sidecar) -> None:
    collects = ["create", "stream_items", "stream_helper", "stream_completed"]
    through = await asyncio.gather(
        *(one(sidecar.base_url, i, collects[i % len(collects)]) for i in range(CONVERSATIONS))
    )
    direct = await asyncio.gather(*(one(emulator.base_url, i, "create") for i in range(CONVERSATIONS)))

    finals = set()
    for index, ((run, capture), (direct_run, _)) in enumerate(zip(through, direct, strict=True)):
        assert run.tool_calls == STEPS and len(run.turns) == STEPS + 1, index
        assert run.contents == direct_run.contents, f"conversation {index} got another answer"
        assert_continuations(emulator, capture.bodies, run.response_ids, run.output_counts, capture.modes)
        assert_fidelity(emulator, capture.bodies, run.response_ids)
        finals.add(run.final_text)
    assert len(finals) == CONVERSATIONS  # each its own answer
    # one response in flight per upstream socket, never more (spare sockets may have none)
    connections = emulator.stats.connections.values()
    assert all(c.max_in_flight <= 1 for c in connections)
    assert sum(c.requests for c in connections) == CONVERSATIONS * (STEPS + 1)
    assert sum(c.cache_hits for c in connections) == CONVERSATIONS * STEPS
    assert emulator.stats.misses["ws"] == 0 and emulator.stats.hydrations["ws"] == 0


Chain = tuple[list[str], Capture, list[list[tuple[Any, ...]]]]


async def forks(base_url: str) -> tuple[str, Capture, list[Chain]]:
    """One shared turn, then 4 sub-agents (own clients, same key) fork from it at once."""
    capture = Capture()
    async with capture.async_client(base_url) as client:
        root = [{"role": "user", "content": "Shared preparation: steps=1."}]
        first = await client.responses.create(model=MODEL, input=root, tools=TOOLS)
    shared = [*root, *[o.model_dump(exclude_none=True) for o in first.output], *tool_outputs(first.output)]

    async def sibling(index: int) -> Chain:
        own = Capture()
        history = [*shared, {"role": "user", "content": f"Sub-agent {index}: reply_bytes=60"}]
        ids, contents = [], []
        async with own.async_client(base_url) as client:
            for turn in range(3):
                response = await client.responses.create(model=MODEL, input=history, tools=TOOLS)
                ids.append(response.id)
                contents.append([summarize(o) for o in response.output])
                history += [*response.output, {"role": "user", "content": f"Sub-agent {index}, go on ({turn})."}]
        return ids, own, contents

    return first.id, capture, list(await asyncio.gather(*(sibling(i) for i in range(4))))


async def test_concurrent_siblings_of_one_head(emulator: Emulator, sidecar: Sidecar) -> None:
    """Forks (parallel sub-agents sharing a prefix) sent at once: at most one takes the shared
    head, the others go in full on other sockets; every sibling then continues its own chain."""
    first_id, first_capture, chains = await forks(sidecar.base_url)
    _, _, direct_chains = await forks(emulator.base_url)

    first_wave = [record(emulator, ids[0]) for ids, _, _ in chains]
    assert sum(r["continuation"] for r in first_wave) <= 1
    assert all(r["previous_response_id"] in (None, first_id) for r in first_wave)
    for index, ((ids, capture, contents), (_, _, direct_contents)) in enumerate(
        zip(chains, direct_chains, strict=True)
    ):
        # each sub-agent got its own answers, the ones a direct run gets
        assert contents == direct_contents
        assert f"Echo: 'Sub-agent {index}, go on (1).'" in contents[-1][0][2]
        assert_fidelity(emulator, capture.bodies, ids)
        for prev, later in zip(ids, ids[1:], strict=False):
            rec = record(emulator, later)
            assert rec["continuation"] is True and rec["cache_hit"] is True, rec
            assert rec["previous_response_id"] == prev
    assert_fidelity(emulator, first_capture.bodies, [first_id])
    assert all(c.max_in_flight <= 1 for c in emulator.stats.connections.values())
