"""``openai-agents`` (``Runner.run`` / ``Runner.run_streamed``) through the sidecar.

An agent with a function tool is asked for 5 tool calls. Agents re-send the whole history every
turn (``model_dump(exclude_unset=True)`` echoes, ``instructions`` each time). Checks: same answer
as a direct run against the emulator, continuations with only the new items after the first turn,
and the emulator's effective context equals the app's input for every response.
"""

from __future__ import annotations

from typing import Any

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai.types.shared import Reasoning

from tests.sidecar import Sidecar
from upshift_emulator import Emulator

from .support import (
    MODEL,
    Capture,
    assert_continuations,
    assert_fidelity,
    assert_phases_kept,
    assert_small_frames,
    summarize,
    task_text,
)

set_tracing_disabled(True)

STEPS = 5
CALLS: list[str] = []


@function_tool
def read_file(path: str) -> str:
    """Read a file of the repository.

    Args:
        path: Path of the file.
    """
    CALLS.append(path)
    return f"read_file -> ok: path={path}"


def make_agent(base_url: str, capture: Capture, settings: ModelSettings) -> Agent[Any]:
    client = capture.async_client(base_url)
    return Agent(
        name="repo-assistant",
        instructions="You inspect repositories with the read_file tool.",
        tools=[read_file],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=settings,
    )


async def run_agent(agent: Agent[Any], task: str, streamed: bool, run_config: RunConfig | None) -> Any:
    if not streamed:
        return await Runner.run(agent, task, max_turns=12, run_config=run_config)
    result = Runner.run_streamed(agent, task, max_turns=12, run_config=run_config)
    kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    return result


VARIANTS = {
    "run": (False, ModelSettings(), None),
    "run_store_false": (False, ModelSettings(store=False), None),
    "streamed": (True, ModelSettings(), None),
    "streamed_store_false": (True, ModelSettings(store=False), None),
    "run_reasoning_id_omitted": (
        False,
        ModelSettings(
            store=False,
            reasoning=Reasoning(effort="low", summary="auto"),
            response_include=["reasoning.encrypted_content"],
        ),
        RunConfig(reasoning_item_id_policy="omit"),
    ),
    "streamed_reasoning": (
        True,
        ModelSettings(
            store=False,
            reasoning=Reasoning(effort="low", summary="auto"),
            response_include=["reasoning.encrypted_content"],
        ),
        None,
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_agent_tool_loop(emulator: Emulator, sidecar: Sidecar, variant: str) -> None:
    streamed, settings, run_config = VARIANTS[variant]
    task = task_text(STEPS, f"agents {variant}", preamble=True)
    capture, direct_capture = Capture(), Capture()
    CALLS.clear()
    through = await run_agent(make_agent(sidecar.base_url, capture, settings), task, streamed, run_config)
    calls_through = list(CALLS)
    CALLS.clear()
    direct = await run_agent(make_agent(emulator.base_url, direct_capture, settings), task, streamed, run_config)

    # (a) same answer and same outputs turn by turn as a direct run
    assert calls_through == [f"src/step_{n}.txt" for n in range(1, STEPS + 1)]
    assert CALLS == calls_through
    assert through.final_output == direct.final_output
    assert str(through.final_output).endswith("Last output: read_file -> ok: path=src/step_5.txt")
    contents = [[summarize(o) for o in r.output] for r in through.raw_responses]
    assert contents == [[summarize(o) for o in r.output] for r in direct.raw_responses]
    assert len(through.raw_responses) == STEPS + 1
    response_ids = [r.response_id for r in through.raw_responses]
    counts = [len(r.output) for r in through.raw_responses]
    bodies = capture.bodies
    assert len(bodies) == STEPS + 1
    # agents send instructions every turn and re-send the whole history
    assert all(b["instructions"] == "You inspect repositories with the read_file tool." for b in bodies)
    assert all("previous_response_id" not in b for b in bodies)
    if settings.store is False:
        assert all(b["store"] is False for b in bodies)
    if run_config is not None:  # reasoning_item_id_policy="omit": echoed reasoning lost its id
        echoed = [i for i in bodies[-1]["input"] if i.get("type") == "reasoning"]
        assert len(echoed) == STEPS and all("id" not in i for i in echoed)
    if settings.reasoning is not None:
        assert all(c[0][0] == "reasoning" for c in contents)
    # (b) continuations carrying only the new items
    assert_phases_kept(bodies, STEPS)
    assert_continuations(emulator, bodies, response_ids, counts, capture.modes)
    assert_small_frames(emulator, capture.sizes, response_ids)
    # (c) fidelity
    assert_fidelity(emulator, bodies, response_ids)
    assert_fidelity(emulator, direct_capture.bodies, [r.response_id for r in direct.raw_responses])


async def test_second_run_continues_from_to_input_list(emulator: Emulator, sidecar: Sidecar) -> None:
    """Across runs: ``result.to_input_list() + [new message]`` continues the previous run's chain."""
    capture = Capture()
    agent = make_agent(sidecar.base_url, capture, ModelSettings(store=False))
    first = await Runner.run(agent, task_text(2, "first run"), max_turns=8)
    follow_up = [*first.to_input_list(), {"role": "user", "content": "Now steps=2 more, please."}]
    second = await Runner.run(agent, follow_up, max_turns=8)
    assert str(second.final_output).endswith("Last output: read_file -> ok: path=src/step_2.txt")
    response_ids = [r.response_id for r in [*first.raw_responses, *second.raw_responses]]
    counts = [len(r.output) for r in [*first.raw_responses, *second.raw_responses]]
    assert len(response_ids) == 6
    assert_continuations(emulator, capture.bodies, response_ids, counts, capture.modes)
    assert_fidelity(emulator, capture.bodies, response_ids)
