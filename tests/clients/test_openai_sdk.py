"""The real ``openai`` SDK runs a 5-tool-call loop through the sidecar, in every way apps use it.

For each pattern (sync ``create``, ``create(stream=True)`` collecting ``output_item.done`` items or
``response.completed``, the ``responses.stream()`` helper, ``AsyncOpenAI``; echo by model objects,
``model_dump()``, ``model_dump_json``, ``exclude_none``, ``to_dict``): the answers equal a direct
run against the emulator, every turn after the first was a cache-hitting continuation carrying
only the new items, and the model's effective context is exactly the app's input.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.sidecar import Sidecar
from upshift_emulator import Emulator

from .support import (
    Capture,
    Run,
    assert_continuations,
    assert_fidelity,
    assert_phases_kept,
    assert_small_frames,
    delta,
    metrics,
    run_loop_async,
    run_loop_sync,
    task_text,
)

STEPS = 5


def check_run(emu: Emulator, through: Run, capture: Capture, direct: Run) -> None:
    """The three checks of this directory, plus "the loop really made 5 tool calls"."""
    assert through.tool_calls == STEPS and len(through.turns) == STEPS + 1
    assert through.final_text.endswith("Last output: read_file -> ok: path=src/step_5.txt"), through.final_text
    # (a) same content as the same app talking to the emulator directly
    assert through.contents == direct.contents
    # every request reached the sidecar and got an answer from it
    assert [e.status for e in capture.exchanges] == [200] * len(through.turns)
    # (b) continuations with only the new items
    assert_continuations(emu, capture.bodies, through.response_ids, through.output_counts, capture.modes)
    assert_small_frames(emu, capture.sizes, through.response_ids)
    # (c) the model saw exactly what the app sent
    assert_fidelity(emu, capture.bodies, through.response_ids)


SYNC_CASES = [
    ("create", "objects"),
    ("create", "model_dump"),
    ("create", "model_dump_json"),
    ("create", "exclude_none"),
    ("create", "to_dict"),
    ("stream_items", "objects"),
    ("stream_items", "model_dump"),
    ("stream_completed", "objects"),
    ("stream_completed", "to_dict"),
    ("stream_helper", "objects"),
    ("stream_helper", "model_dump"),
]


@pytest.mark.parametrize(("collect", "echo_as"), SYNC_CASES)
async def test_sync_client_tool_loop(emulator: Emulator, sidecar: Sidecar, collect: str, echo_as: str) -> None:
    task = task_text(STEPS, f"{collect}/{echo_as}", preamble=True)
    before = await metrics(sidecar.admin_url)
    capture, direct_capture = Capture(), Capture()
    with capture.sync_client(sidecar.base_url) as client:
        through = await asyncio.to_thread(run_loop_sync, client, task, collect=collect, echo_as=echo_as)
    after = await metrics(sidecar.admin_url)
    with direct_capture.sync_client(emulator.base_url) as client:
        direct = await asyncio.to_thread(run_loop_sync, client, task, collect=collect, echo_as=echo_as)
    check_run(emulator, through, capture, direct)
    assert_phases_kept(capture.bodies, STEPS)
    # the app sent the same bodies either way, up to the ids the two runs got
    assert [len(b["input"]) for b in capture.bodies] == [len(b["input"]) for b in direct_capture.bodies]
    # the sidecar's own accounting agrees with the emulator's
    ok = {"route": "responses", "outcome": "ok"}
    assert delta(before, after, "upshift_requests_total", mode="continuation", **ok) == STEPS
    assert delta(before, after, "upshift_requests_total", mode="full", **ok) == 1
    avoided = (
        sum(len(b["input"]) for b in capture.bodies[1:])
        - sum(
            emulator.record(r)["input_items"]  # type: ignore[index]
            for r in through.response_ids[1:]
        )
    )
    assert delta(before, after, "upshift_input_items_avoided_total") == avoided


ASYNC_CASES = [
    ("create", "objects"),
    ("create", "model_dump"),
    ("stream_items", "objects"),
    ("stream_completed", "exclude_none"),
    ("stream_helper", "objects"),
    ("stream_helper", "model_dump_json"),
]


@pytest.mark.parametrize(("collect", "echo_as"), ASYNC_CASES)
async def test_async_client_tool_loop(emulator: Emulator, sidecar: Sidecar, collect: str, echo_as: str) -> None:
    task = task_text(STEPS, f"async {collect}/{echo_as}", preamble=True)
    capture, direct_capture = Capture(), Capture()
    async with capture.async_client(sidecar.base_url) as client:
        through = await run_loop_async(client, task, collect=collect, echo_as=echo_as)
    async with direct_capture.async_client(emulator.base_url) as client:
        direct = await run_loop_async(client, task, collect=collect, echo_as=echo_as)
    check_run(emulator, through, capture, direct)
    assert_phases_kept(capture.bodies, STEPS)


async def test_upstream_socket_reused_for_the_whole_loop(emulator: Emulator, sidecar: Sidecar) -> None:
    """One conversation, one upstream connection: all six creates on it, five cache hits."""
    capture = Capture()
    async with capture.async_client(sidecar.base_url) as client:
        through = await run_loop_async(client, task_text(STEPS, "one socket"))
    connections = {emulator.record(r)["connection_id"] for r in through.response_ids}  # type: ignore[index]
    assert len(connections) == 1
    stats = emulator.stats.connections[connections.pop()]
    assert (stats.requests, stats.continuations, stats.cache_hits, stats.misses) == (6, 5, 5, 0)
    assert emulator.stats.requests["http"] == 0


async def test_parallel_calls_and_reasoning_loop(emulator: Emulator, sidecar: Sidecar) -> None:
    """Two calls per turn and reasoning items (store=false, encrypted content) echoed back."""
    params = {
        "store": False,
        "reasoning": {"effort": "low", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
    }
    task = "Refactor the module: steps=6 parallel=2."
    capture, direct_capture = Capture(), Capture()
    async with capture.async_client(sidecar.base_url) as client:
        through = await run_loop_async(client, task, echo_as="model_dump", **params)
    async with direct_capture.async_client(emulator.base_url) as client:
        direct = await run_loop_async(client, task, echo_as="model_dump", **params)
    assert through.tool_calls == 6 and len(through.turns) == 4
    assert all(turn.output[0][0] == "reasoning" for turn in through.turns)
    assert through.contents == direct.contents
    assert_continuations(emulator, capture.bodies, through.response_ids, through.output_counts, capture.modes)
    assert_fidelity(emulator, capture.bodies, through.response_ids)
