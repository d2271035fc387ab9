"""pydantic-ai (``OpenAIResponsesModel``, an ``Agent`` with one tool) through the sidecar.

pydantic-ai re-sends the whole history every request (``store: false``). It sends ``phase`` back
on assistant messages only for model ids its profile knows to support it (``gpt-5.4``,
``gpt-5.5``, ``gpt-5.6``, ``gpt-6`` and later); for others (here ``gpt-5.2``) it leaves ``phase``
off, although the model labelled its messages. The scripted model labels them when the prompt asks for a ``preamble``
(a ``phase: "commentary"`` message before each call, the answer ``phase: "final_answer"``).

* ``gpt-5.2`` by default: a phase-less echo is another message for the model, so every turn after
  the first goes upstream in full, explained on ``/misses`` at the message's ``phase``; the
  oracle shows the app's exact context for every response, and every answer equals a direct run.
* ``gpt-5.2`` with ``matching.tolerate: [phase]``: every turn continues and is counted; the model
  then sees the ``phase`` the app left out, and only that (the oracle's digest is the app's input
  with those phases put back).
* ``gpt-5.4`` (pydantic-ai keeps ``phase``): every turn continues, with the app's exact context.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.openai import OpenAIResponsesModel, OpenAIResponsesModelSettings
from pydantic_ai.providers.openai import OpenAIProvider

from proxy.observe.misses import RECENT
from tests.sidecar import Sidecar
from upshift_emulator import Emulator, context_digest

from .support import (
    Capture,
    app_items,
    assert_continuations,
    assert_fidelity,
    delta,
    metrics,
    record,
)

JSON = Any
STEPS = 3
INSTRUCTIONS = "You inspect repositories with the read_file tool."
SETTINGS = OpenAIResponsesModelSettings(openai_store=False)


def make_agent(base_url: str, capture: Capture, model: str) -> tuple[Agent[None, str], list[str]]:
    client = capture.async_client(base_url)
    llm = OpenAIResponsesModel(model, provider=OpenAIProvider(openai_client=client))
    agent: Agent[None, str] = Agent(llm, instructions=INSTRUCTIONS, model_settings=SETTINGS)
    calls: list[str] = []

    @agent.tool_plain
    def read_file(path: str) -> str:
        """Read a file of the repository.

        Args:
            path: Path of the file.
        """
        calls.append(path)
        return f"read_file -> ok: path={path}"

    return agent, calls


async def run_agent(agent: Agent[None, str], task: str, streamed: bool) -> tuple[str, list[ModelMessage]]:
    if not streamed:
        result = await agent.run(task)
        return result.output, result.all_messages()
    kinds: list[str] = []
    async with agent.run_stream_events(task) as events:
        async for event in events:
            kinds.append(event.event_kind)
            if event.event_kind == "agent_run_result":
                final = event.result
    assert "part_delta" in kinds and "function_tool_result" in kinds, sorted(set(kinds))
    return final.output, final.all_messages()


def response_ids(messages: Sequence[ModelMessage]) -> list[str]:
    ids = [m.provider_response_id for m in messages if isinstance(m, ModelResponse)]
    assert all(isinstance(i, str) for i in ids)
    return [str(i) for i in ids]


def output_counts(messages: Sequence[ModelMessage]) -> list[int]:
    """Output items per response (pydantic-ai keeps one part per item and echoes every one)."""
    return [len(m.parts) for m in messages if isinstance(m, ModelResponse)]


def phases(messages: Sequence[ModelMessage]) -> dict[str, str]:
    """The ``phase`` the model gave each of its messages, by message id."""
    out: dict[str, str] = {}
    for message in messages:
        if isinstance(message, ModelResponse):
            for part in message.parts:
                phase = (part.provider_details or {}).get("phase") if isinstance(part, TextPart) else None
                if phase is not None and part.id is not None:
                    out[part.id] = phase
    return out


def with_phases(items: list[JSON], known: dict[str, str]) -> list[JSON]:
    """The app's input with the ``phase`` it left out put back (what the upstream chain holds)."""
    out = copy.deepcopy(items)
    for item in out:
        if item.get("role") == "assistant" and "phase" not in item and item.get("id") in known:
            item["phase"] = known[item["id"]]
    return out


def phaseless_echoes(bodies: Sequence[dict[str, JSON]]) -> list[int]:
    """Per request, how many echoed assistant messages carry no ``phase``."""
    return [sum(1 for i in app_items(b) if i.get("role") == "assistant" and "phase" not in i) for b in bodies]


async def misses(sc: Sidecar) -> list[dict[str, JSON]]:
    async with aiohttp.ClientSession() as session, session.get(sc.admin_url + "/misses") as resp:
        assert resp.status == 200
        body = await resp.json()
    found: list[dict[str, JSON]] = body["misses"]
    return found


async def through_and_direct(
    emulator: Emulator, sidecar: Sidecar, model: str, streamed: bool, label: str
) -> tuple[Capture, list[ModelMessage], str, str]:
    """The same agent run through the sidecar and straight against the emulator."""
    task = f"Task {label}: inspect the repository, steps={STEPS}, with a preamble, then summarise."
    capture, direct_capture = Capture(), Capture()
    agent, calls = make_agent(sidecar.base_url, capture, model)
    output, messages = await run_agent(agent, task, streamed)
    direct_agent, direct_calls = make_agent(emulator.base_url, direct_capture, model)
    direct_output, direct_messages = await run_agent(direct_agent, task, streamed)
    assert calls == direct_calls == [f"src/step_{n}.txt" for n in range(1, STEPS + 1)]
    assert output.endswith(f"Done after {STEPS} tool call(s). Last output: read_file -> ok: path=src/step_{STEPS}.txt")
    assert len(capture.bodies) == len(direct_capture.bodies) == STEPS + 1
    assert all("previous_response_id" not in b and b["store"] is False for b in capture.bodies)
    # the model labelled every message it wrote: STEPS commentaries and the final answer
    assert sorted(phases(messages).values()) == ["commentary"] * STEPS + ["final_answer"]
    assert_fidelity(emulator, direct_capture.bodies, response_ids(direct_messages))
    return capture, messages, output, direct_output


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_stream_events"])
async def test_phase_dropped_by_the_client_is_a_full_send(emulator: Emulator, sidecar: Sidecar, streamed: bool) -> None:
    RECENT.clear()
    before = await metrics(sidecar.admin_url)
    capture, messages, output, direct_output = await through_and_direct(
        emulator, sidecar, "gpt-5.2", streamed, f"full {streamed}"
    )
    after = await metrics(sidecar.admin_url)
    bodies, ids = capture.bodies, response_ids(messages)
    # pydantic-ai's profile for gpt-5.2 leaves phase off every assistant message it sends back
    assert phaseless_echoes(bodies) == list(range(STEPS + 1))
    # the model saw exactly what the app sent, every time; so the answers are a direct run's
    assert_fidelity(emulator, bodies, ids)
    assert output == direct_output
    assert capture.modes == ["full"] * (STEPS + 1)
    assert all(record(emulator, r)["continuation"] is False for r in ids)
    assert delta(before, after, "upshift_continuation_misses_total", reason="dropped_phase") == STEPS
    assert delta(before, after, "upshift_echo_tolerances_total", tolerance="phase", accepted="false") == STEPS
    assert delta(before, after, "upshift_echo_tolerances_total", tolerance="phase", accepted="true") == 0
    # explained at the echoed commentary message, field phase (its index in the request)
    found = [m for m in await misses(sidecar) if m["reason"] == "dropped_phase"]
    assert len(found) == STEPS
    for entry in found:
        assert (entry["miss_type"], entry["miss_field"], entry["miss_detail"]) == ("message", "phase", "phase_dropped")
    # each time the first item after the previous request's input: the echoed commentary
    assert sorted(m["miss_item"] for m in found) == [len(app_items(b)) for b in bodies[:-1]]


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_stream_events"])
async def test_phase_tolerance_continues_and_counts(emulator: Emulator, make_sidecar: Any, streamed: bool) -> None:
    tolerant = await make_sidecar(matching={"tolerate": ["phase"]})
    before = await metrics(tolerant.admin_url)
    capture, messages, _, _ = await through_and_direct(emulator, tolerant, "gpt-5.2", streamed, f"tolerant {streamed}")
    after = await metrics(tolerant.admin_url)
    bodies, ids = capture.bodies, response_ids(messages)
    counts = output_counts(messages)
    assert counts == [2] * STEPS + [1]  # commentary + call, then the answer
    assert_continuations(emulator, bodies, ids, counts, capture.modes)
    assert delta(before, after, "upshift_echo_tolerances_total", tolerance="phase", accepted="true") == STEPS
    assert delta(before, after, "upshift_continuation_misses_total", reason="dropped_phase") == 0
    # The documented difference: the model saw the phases the app left out, and nothing else.
    known = phases(messages)
    for index, (body, response_id) in enumerate(zip(bodies, ids, strict=True)):
        items = app_items(body)
        seen = record(emulator, response_id)["context_digest"]
        assert seen == context_digest(with_phases(items, known)), f"turn {index}"
        if index:
            assert seen != context_digest(items), f"turn {index}: the oracle missed the dropped phase"


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_stream_events"])
async def test_phase_kept_by_the_client_continues(emulator: Emulator, sidecar: Sidecar, streamed: bool) -> None:
    capture, messages, output, direct_output = await through_and_direct(
        emulator, sidecar, "gpt-5.4", streamed, f"kept {streamed}"
    )
    bodies, ids = capture.bodies, response_ids(messages)
    assert phaseless_echoes(bodies) == [0] * (STEPS + 1)
    assert output == direct_output
    counts = output_counts(messages)
    assert counts == [3] * STEPS + [2]  # reasoning (gpt-5.4 asks for it), commentary, call; then the answer
    assert_continuations(emulator, bodies, ids, counts, capture.modes)
    assert_fidelity(emulator, bodies, ids)
