"""``--workers 3`` hands the app's connection to the worker owning its conversation (SCM_RIGHTS):
one SDK client per conversation reaches the owner directly from its second turn on."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import psutil
import pytest

from proxy.cluster import WorkerPlacement
from proxy.config import ListenerSettings, Settings, ShutdownSettings
from proxy.emulator import Emulator
from proxy.server import Server
from tests.clients.support import MODEL, TOOLS, Capture, assert_fidelity, run_loop_async, task_text
from tests.sidecar import SidecarProcess

from .support import HEADERS, KEY, STEPS, free_ports, owner_of, wait_ready
from .test_workers import Samples, metrics, start_workers

CONVERSATIONS = 200
WORKERS = ("worker-0", "worker-1", "worker-2")


def total(seen: Samples, name: str, **labels: str) -> float:
    return sum(v for ls, v in seen.get(name, []) if all(ls.get(k) == want for k, want in labels.items()))


def handoffs(seen: Samples, outcome: str) -> float:
    return total(seen, "upshift_handoffs_total", outcome=outcome)


def forwards(seen: Samples) -> float:
    return total(seen, "upshift_forwards_total")


async def test_one_sdk_client_per_conversation_lands_on_its_owner_after_turn_one(
    emulator: Emulator, spawn: Callable[..., SidecarProcess]
) -> None:
    proc = await start_workers(spawn, emulator.base_url)
    tasks = [task_text(STEPS, f"handoff-conv-{i}") for i in range(CONVERSATIONS)]
    first_done = 0
    all_first = asyncio.Event()
    snapshot: Samples = {}

    async with aiohttp.ClientSession() as session:

        async def barrier(turn: int) -> None:
            # Every conversation's first turn completes, the metrics are read, then the rest run.
            nonlocal first_done, snapshot
            if turn != 1:
                return
            first_done += 1
            if first_done == CONVERSATIONS:
                snapshot = await metrics(proc, session)
                all_first.set()
            await all_first.wait()

        captures = [Capture() for _ in tasks]
        clients = [c.async_client(proc.base_url, api_key=KEY) for c in captures]
        runs = await asyncio.gather(
            *(run_loop_async(client, t, before_turn=barrier) for client, t in zip(clients, tasks, strict=True))
        )
        seen = await metrics(proc, session)
    for client in clients:
        await client.close()

    direct = Capture().async_client(emulator.base_url)
    want = await asyncio.gather(*(run_loop_async(direct, t) for t in tasks))
    for capture, run, ref in zip(captures, runs, want, strict=True):
        assert run.contents == ref.contents  # every answer correct
        assert [e.status for e in capture.exchanges] == [200] * (STEPS + 1)
        assert_fidelity(emulator, capture.bodies, run.response_ids)  # the model saw the app's input
        # turns 2..N continued (all of them: each conversation's connection is on its owner)
        assert capture.modes[1:] == ["continuation"] * STEPS, capture.modes
        for prev, rid in zip(run.response_ids, run.response_ids[1:], strict=False):
            rec = emulator.record(rid)
            assert rec is not None and rec["continuation"] and rec["cache_hit"]
            assert rec["previous_response_id"] == prev
    # Turn 1 of about two thirds of the conversations landed on a non-owner: handed off, once.
    adopted = handoffs(snapshot, "adopted")
    assert CONVERSATIONS * 0.4 < adopted <= CONVERSATIONS, snapshot.get("upshift_handoffs_total")
    assert forwards(snapshot) == 0, snapshot.get("upshift_forwards_total")
    # After turn 1 nothing moved any more: no handoff and no forward of any outcome.
    assert total(seen, "upshift_handoffs_total") == total(snapshot, "upshift_handoffs_total") == adopted
    assert forwards(seen) == 0
    served = {w: 0.0 for w in ("0", "1", "2")}
    for labels, value in seen["upshift_requests_total"]:
        if labels["route"] == "responses" and labels["mode"] != "forwarded":
            served[labels["worker"]] += value
    assert all(v > 0 for v in served.values()), served  # all three workers carry traffic
    assert sum(served.values()) == CONVERSATIONS * (STEPS + 1)
    assert await proc.terminate() == 0
