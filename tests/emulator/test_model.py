"""The scripted model: grammar and determinism (pure, no sockets)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from upshift_emulator.model import ModelRequest, plan, tokens
from upshift_emulator.oracle import Segment

from .conftest import TOOLS

pytestmark = pytest.mark.timeout(30)


def _request(items: list[dict[str, Any]], **kwargs: Any) -> ModelRequest:
    return ModelRequest(context=Segment.root().extend(items), **kwargs)


def test_plain_reply_depends_on_context_and_is_deterministic() -> None:
    a = plan(_request([{"role": "user", "content": "hello"}]))
    b = plan(_request([{"role": "user", "content": "hello"}]))
    c = plan(_request([{"role": "user", "content": "hello!"}]))
    assert a == b and a.items[0].kind == "message"
    assert "Echo: 'hello'" in a.items[0].text
    assert a.items[0].text[:14] != c.items[0].text[:14]  # the digest tag differs


def test_reply_bytes() -> None:
    short = plan(_request([{"role": "user", "content": "x"}], reply_bytes=50)).items[0].text
    long = plan(_request([{"role": "user", "content": "x reply_bytes=600"}], reply_bytes=50)).items[0].text
    assert 50 <= len(short) < 80 and 600 <= len(long) < 640


def test_steps_grammar_and_arguments_follow_schema() -> None:
    for text in ("steps=2", "please run 2 tool calls", "2 tool steps", "Steps: 2"):
        result = plan(_request([{"role": "user", "content": text}], tools=tuple(TOOLS)))
        [call] = result.items
        assert call.kind == "function_call" and call.name == "read_file"
        assert json.loads(call.arguments) == {"path": "src/step_1.txt"}


def test_outputs_advance_steps_then_final_quote() -> None:
    items: list[dict[str, Any]] = [{"role": "user", "content": "steps=2"}]
    for step in (1, 2):
        [call] = plan(_request(items, tools=tuple(TOOLS))).items
        assert json.loads(call.arguments)["path"] == f"src/step_{step}.txt"
        items += [
            {"type": "function_call", "call_id": f"c{step}", "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": f"c{step}", "output": f"payload {step}"},
        ]
    [final] = plan(_request(items, tools=tuple(TOOLS))).items
    assert final.kind == "message" and "Done after 2 tool call(s). Last output: payload 2" in final.text


def test_call_ids_do_not_change_the_reply() -> None:
    def run(call_id: str) -> str:
        items = [
            {"role": "user", "content": "steps=1"},
            {"type": "function_call", "call_id": call_id, "name": "read_file", "arguments": "{}"},
            {"type": "function_call_output", "call_id": call_id, "output": "x"},
        ]
        return plan(_request(items, tools=tuple(TOOLS))).items[0].text

    assert run("call_a") == run("call_b")


def test_parallel_and_tool_choice() -> None:
    result = plan(_request([{"role": "user", "content": "steps=5 parallel 3"}], tools=tuple(TOOLS)))
    assert [i.kind for i in result.items] == ["function_call"] * 3
    none = plan(_request([{"role": "user", "content": "steps=5"}], tools=tuple(TOOLS), tool_choice="none"))
    assert none.items[0].kind == "message"
    required = plan(_request([{"role": "user", "content": "hi"}], tools=tuple(TOOLS), tool_choice="required"))
    assert required.items[0].kind == "function_call"
    no_tools = plan(_request([{"role": "user", "content": "steps=1"}]))
    assert "No function tool declared" in no_tools.items[0].text


def test_reasoning_and_budget() -> None:
    result = plan(_request([{"role": "user", "content": "hi"}], reasoning=True))
    assert [i.kind for i in result.items] == ["reasoning", "message"]
    assert result.items[0].encrypted_content.startswith("gAAAA") and result.items[0].text
    budget = plan(_request([{"role": "user", "content": "hi reply_bytes=400"}], max_output_tokens=16))
    assert budget.incomplete and budget.items[0].status == "incomplete"
    assert tokens(budget.items[0].text) <= 16


def test_schema_driven_values() -> None:
    tool = {
        "type": "function",
        "name": "t",
        "parameters": {
            "type": "object",
            "properties": {
                "n": {"type": "integer"},
                "mode": {"type": "string", "enum": ["fast", "slow"]},
                "flag": {"type": ["boolean", "null"]},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
        },
    }
    [call] = plan(_request([{"role": "user", "content": "steps=1"}], tools=(tool,))).items
    assert json.loads(call.arguments) == {"n": 1, "mode": "fast", "flag": True, "tags": ["tags-1"]}
