"""Upstream failures before any byte reached the app end in the right answer, via one full replay.

* ``previous_response_not_found`` (every shape seen in the field) on a continuation;
* the connection age limit (``websocket_connection_limit_reached``, then close);
* the upstream socket dropped (1006) or closed (1011) before the first event.

Each time: the app's answers equal a direct run, the emulator records the replay as a
non-continuation carrying the app's full input, the model's context is the app's input, and the
sidecar's ``upshift_replays_total{cause}`` moved by one.

Also: an upstream 500 retried by the SDK itself, and an app that gives up mid-turn and re-sends
it, never build on the failed turn's anchor.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import pytest

from tests.sidecar import Sidecar
from upshift_emulator import NOT_FOUND_SHAPES, Emulator

from .support import (
    MODEL,
    TOOLS,
    Capture,
    Run,
    app_items,
    assert_fidelity,
    delta,
    metrics,
    record,
    run_loop_async,
    summarize,
    task_text,
    tool_outputs,
)

STEPS = 3
FAILED_TURN = 2


async def run_with(
    emulator: Emulator,
    sidecar: Sidecar,
    task: str,
    before_turn: Callable[[int], Any],
    collect: str = "create",
) -> tuple[Run, Capture, Run, dict[Any, float], dict[Any, float]]:
    """The loop through the sidecar (with ``before_turn`` arming a fault), then directly."""
    capture = Capture()
    before = await metrics(sidecar.admin_url)
    async with capture.async_client(sidecar.base_url) as client:
        through = await run_loop_async(client, task, collect=collect, before_turn=before_turn)
    after = await metrics(sidecar.admin_url)
    async with Capture().async_client(emulator.base_url) as client:
        direct = await run_loop_async(client, task, collect=collect)
    return through, capture, direct, before, after


def assert_replayed(emulator: Emulator, through: Run, capture: Capture, direct: Run, replayed: int) -> None:
    """Right answers; turn ``replayed`` went as a full, anchor-less send; the others continued."""
    assert through.tool_calls == STEPS
    assert through.contents == direct.contents
    assert capture.modes.count(None) == 0
    assert [e.status for e in capture.exchanges] == [200] * len(through.turns)
    assert_fidelity(emulator, capture.bodies, through.response_ids)
    assert capture.modes[replayed] == "full", capture.modes
    for index, response_id in enumerate(through.response_ids):
        rec = record(emulator, response_id)
        if index in (0, replayed):
            assert rec["continuation"] is False, f"turn {index}: {rec}"
            assert rec["input_items"] == len(app_items(capture.bodies[index])), f"turn {index}: not the full input"
        else:
            assert rec["continuation"] is True and rec["cache_hit"] is True, f"turn {index}: {rec}"
            assert rec["previous_response_id"] == through.response_ids[index - 1]


def arm_at(turn: int, arm: Callable[[], Any]) -> Callable[[int], None]:
    def before_turn(index: int) -> None:
        if index == turn:
            arm()

    return before_turn


@pytest.mark.parametrize("collect", ["create", "stream_items"])
@pytest.mark.parametrize("shape", NOT_FOUND_SHAPES)
async def test_previous_response_not_found_is_replayed(
    emulator: Emulator, sidecar: Sidecar, shape: str, collect: str
) -> None:
    def arm() -> None:
        emulator.faults.arm("miss", shape=shape, match={"previous_response_id_present": True})

    through, capture, direct, before, after = await run_with(
        emulator, sidecar, task_text(STEPS, f"miss {shape}"), arm_at(FAILED_TURN, arm), collect
    )
    assert emulator.stats.faults_fired == {"miss": 1}
    assert emulator.faults.pending == []
    assert emulator.stats.misses["ws"] == 1 and emulator.stats.continuations["ws"] == STEPS
    assert_replayed(emulator, through, capture, direct, FAILED_TURN)
    # the replay went on the same socket (a not-found does not spoil the connection)
    connections = {record(emulator, r)["connection_id"] for r in through.response_ids}
    assert len(connections) == 1
    assert delta(before, after, "upshift_replays_total", cause="previous_response_not_found") == 1


@pytest.fixture
async def aging() -> AsyncIterator[tuple[Emulator, Sidecar]]:
    """An emulator whose connections age out after 1 second, and a sidecar in front of it."""
    async with Emulator(ws_max_age_s=1.0) as emu, Sidecar(emu.base_url) as sc:
        yield emu, sc


@pytest.mark.parametrize("collect", ["create", "stream_items"])
async def test_connection_age_limit_is_replayed_on_a_new_socket(aging: tuple[Emulator, Sidecar], collect: str) -> None:
    emulator, sidecar = aging

    async def before_turn(index: int) -> None:
        if index == 1:
            await asyncio.sleep(1.1)

    through, capture, direct, before, after = await run_with(
        emulator, sidecar, task_text(STEPS, "aging"), before_turn, collect
    )
    assert_replayed(emulator, through, capture, direct, 1)
    records = [record(emulator, r) for r in through.response_ids]
    assert records[0]["connection_id"] != records[1]["connection_id"]
    assert len({r["connection_id"] for r in records[1:]}) == 1
    old = emulator.stats.connections[records[0]["connection_id"]]
    assert old.open is False and old.close_code == 1000
    assert old.requests == 2 and emulator.stats.errors["ws"] == 1  # the create that met the limit
    assert delta(before, after, "upshift_replays_total", cause="connection_limit") == 1


CUTS = {
    "drop_on_continuation": ("drop", {"previous_response_id_present": True}, FAILED_TURN),
    "close_1011_on_continuation": ("close", {"previous_response_id_present": True}, FAILED_TURN),
    "drop_on_first_turn": ("drop", {"previous_response_id_present": False}, 0),
}


@pytest.mark.parametrize("collect", ["create", "stream_items"])
@pytest.mark.parametrize("cut", list(CUTS))
async def test_socket_lost_before_first_event_is_replayed(
    emulator: Emulator, sidecar: Sidecar, cut: str, collect: str
) -> None:
    kind, match, turn = CUTS[cut]

    def arm() -> None:
        emulator.faults.arm(kind, after_events=0, match=match)

    through, capture, direct, before, after = await run_with(
        emulator, sidecar, task_text(STEPS, cut), arm_at(turn, arm), collect
    )
    assert emulator.stats.faults_fired == {kind: 1}
    assert_replayed(emulator, through, capture, direct, turn)
    records = [record(emulator, r) for r in through.response_ids]
    # the replay needed a new socket: the failed one is closed
    lost = [c for c in emulator.stats.connections.values() if not c.open]
    assert len(lost) == 1 and lost[0].requests == 1 + (turn if turn else 0)
    assert records[turn]["connection_id"] not in {k for k, c in emulator.stats.connections.items() if not c.open}
    assert delta(before, after, "upshift_replays_total", cause="closed_before_first_event") == 1


async def test_sdk_retry_after_upstream_error_is_a_full_send(emulator: Emulator, sidecar: Sidecar) -> None:
    """An upstream 500 on a continuation is not replayed by the sidecar (not a lost anchor): the
    app gets the 500 with the upstream's ``retry-after-ms``, the SDK retries the byte-identical
    body, and that retry must not build on the failed turn's anchor (pitfall 1, rule 9)."""

    def arm() -> None:
        emulator.faults.arm(
            "error", status=500, headers={"retry-after-ms": "10"}, match={"previous_response_id_present": True}
        )

    capture = Capture()
    async with capture.async_client(sidecar.base_url, max_retries=1) as client:
        through = await run_loop_async(client, task_text(STEPS, "sdk retry"), before_turn=arm_at(FAILED_TURN, arm))
    async with Capture().async_client(emulator.base_url) as client:
        direct = await run_loop_async(client, task_text(STEPS, "sdk retry"))
    assert emulator.stats.faults_fired == {"error": 1}
    assert [e.status for e in capture.exchanges] == [200, 200, 500, 200, 200]
    assert capture.exchanges[2].body == capture.exchanges[3].body
    assert through.contents == direct.contents
    bodies = [e.body for e in capture.exchanges if e.status == 200]
    assert_fidelity(emulator, bodies, through.response_ids)
    retried = record(emulator, through.response_ids[FAILED_TURN])
    assert retried["continuation"] is False
    assert retried["input_items"] == len(app_items(bodies[FAILED_TURN]))
    last = record(emulator, through.response_ids[-1])
    assert last["continuation"] is True and last["cache_hit"] is True


async def test_app_gives_up_mid_turn_then_retries(emulator: Emulator, sidecar: Sidecar) -> None:
    """The app times out while the upstream is still working, then re-sends the same turn: the
    socket with the unfinished response is never handed to the retry, and the answer is right."""
    task = task_text(STEPS, "impatient")
    capture = Capture()
    async with capture.async_client(sidecar.base_url) as client:
        history: list[Any] = [{"role": "user", "content": task}]
        first = await client.responses.create(model=MODEL, input=history, tools=TOOLS)
        history += first.output
        history += tool_outputs(first.output)
        emulator.faults.arm("delay", seconds=0.3, match={"previous_response_id_present": True})
        with pytest.raises(openai.APITimeoutError):
            await client.responses.create(model=MODEL, input=history, tools=TOOLS, timeout=0.1)
        ids = [first.id]
        while True:
            response = await client.responses.create(model=MODEL, input=history, tools=TOOLS)
            ids.append(response.id)
            history += response.output
            added = tool_outputs(response.output)
            if not added:
                break
            history += added
    async with Capture().async_client(emulator.base_url) as client:
        direct = await run_loop_async(client, task)
    assert [summarize(o) for o in response.output] == direct.contents[-1]
    assert len(ids) == len(direct.turns)
    bodies = [e.body for e in capture.exchanges if e.status == 200]
    assert_fidelity(emulator, bodies, ids)
    retried = record(emulator, ids[1])
    assert retried["continuation"] is False  # the anchor went with the abandoned attempt
    assert record(emulator, ids[-1])["cache_hit"] is True
    await asyncio.sleep(0.35)  # let the abandoned response finish upstream
    # The lane with the unfinished response was never handed to the retry (it drained alone).
    abandoned = [r for r in emulator.state.records.values() if r["transport"] == "ws" and r["id"] not in ids]
    assert len(abandoned) == 1
    lane = lambda r: (r["connection_id"], r["stream_id"])  # noqa: E731
    assert lane(abandoned[0]) != lane(retried)
