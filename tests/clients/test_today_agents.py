"""``openai-agents`` with ``reasoning.context`` (its ``ModelSettings.reasoning`` is the openai SDK's
``Reasoning``, which carries ``context``): an app that runs one agent run per user turn and keeps
the history between runs without reasoning items (``to_input_list()`` minus ``reasoning``).

Inside a run the Agents SDK echoes its reasoning items: every request after the first continues.
Between runs the app drops the previous runs' reasoning, some of it from the *input* of the latest
response (the SDK echoed it inside the run). Under ``current_turn`` the model reads no reasoning
before the new user message, so the next run's first request continues; under ``all_turns`` it is
read, so that request is a full send. The oracle checks every request either way.
"""

from __future__ import annotations

from typing import Any

import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
from openai.types.shared import Reasoning

from tests.sidecar import Sidecar
from upshift_emulator import Emulator
from upshift_emulator.oracle import context_digest

from .support import MODEL, Capture, app_items, record, task_text
from .test_agents import read_file

set_tracing_disabled(True)
RUNS = 3


@pytest.mark.parametrize("context", ["current_turn", "all_turns"])
async def test_agent_runs_dropping_reasoning_between_turns(emulator: Emulator, sidecar: Sidecar, context: Any) -> None:
    capture = Capture()
    settings = ModelSettings(
        store=False,
        reasoning=Reasoning(effort="low", summary="auto", context=context),
        response_include=["reasoning.encrypted_content"],
    )
    agent: Agent[Any] = Agent(
        name="repo-assistant",
        instructions="You inspect repositories with the read_file tool.",
        tools=[read_file],
        model=OpenAIResponsesModel(model=MODEL, openai_client=capture.async_client(sidecar.base_url)),
        model_settings=settings,
    )
    history: list[Any] = []
    ids: list[str] = []
    firsts: list[int] = []
    for run in range(RUNS):
        firsts.append(len(ids))
        result = await Runner.run(agent, [*history, {"role": "user", "content": task_text(1, f"run {run}")}])
        assert str(result.final_output).endswith("Last output: read_file -> ok: path=src/step_1.txt")
        ids += [r.response_id for r in result.raw_responses]
        history = [i for i in result.to_input_list() if i.get("type") != "reasoning"]
    assert len(ids) == 2 * RUNS and len(capture.bodies) == len(ids)
    for index, (body, rid) in enumerate(zip(capture.bodies, ids, strict=True)):
        assert record(emulator, rid)["context_digest"] == context_digest(app_items(body), context), index
    continued = [bool(record(emulator, rid)["continuation"]) for rid in ids]
    within = [flag for index, flag in enumerate(continued) if index not in firsts]
    across = [continued[index] for index in firsts[1:]]
    assert all(within), continued  # the SDK echoes its own reasoning inside a run
    if context == "current_turn":
        assert all(across), continued  # earlier user turns' reasoning is not read
    else:
        assert not any(across), continued  # it is read: the history without it is another context
    reasoning = [body["reasoning"] for body in capture.bodies]
    assert all(r["context"] == context for r in reasoning)  # the SDK sent the field as set
