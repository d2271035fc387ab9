"""Every explained miss reason, produced through a real sidecar by a real client pattern.

The app is the real ``openai`` SDK (``AsyncOpenAI``) pointed at an in-process sidecar in front
of the emulator; each test makes the client misbehave the way real clients do (an edited first
item, re-serialised tool arguments, dropped reasoning, changed tools, a retry, a turn with
nothing new) and checks the access line's explanation: ``reason``, ``miss_item``,
``miss_type``, ``miss_field``, ``candidate_items``, and the same entry on ``GET /misses``.
A last test puts unique canary strings in every piece of the app's content and finds none of
them in the access log, on ``/misses``, on the status page or in ``/metrics``.
"""

from __future__ import annotations

import io
import json
import uuid
from typing import Any

import aiohttp
from openai import AsyncOpenAI

from tests.clients.support import READ_FILE, WEATHER, task_text, tool_result
from tests.sidecar import Sidecar
from upshift_emulator import Emulator

from .conftest import AccessLines

MODEL = "gpt-6.1-sol"
Item = dict[str, Any]


def client(sc: Sidecar, key: str = "sk-test-ops") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=sc.base_url, api_key=key, max_retries=0)


async def create(app: AsyncOpenAI, history: list[Item], **kw: Any) -> list[Item]:
    kw.setdefault("tools", [READ_FILE])
    kw.setdefault("store", False)
    response = await app.responses.create(model=MODEL, input=history, **kw)  # type: ignore[arg-type]
    return [item.model_dump(exclude_none=True) for item in response.output]


def outputs_for(output: list[Item]) -> list[Item]:
    return [
        {"type": "function_call_output", "call_id": o["call_id"], "output": tool_result(o["name"], o["arguments"])}
        for o in output
        if o["type"] == "function_call"
    ]


async def agent_loop(app: AsyncOpenAI, history: list[Item], **kw: Any) -> list[Item]:
    """Run the tool loop to its final message; returns the whole history (with that message)."""
    for _ in range(10):
        output = await create(app, history, **kw)
        history = [*history, *output]
        results = outputs_for(output)
        if not results:
            return history
        history += results
    raise AssertionError("the scripted model did not finish")


def last(lines: AccessLines) -> dict[str, Any]:
    rows = [line for line in lines() if line.get("route") == "responses"]
    assert rows
    return rows[-1]


def explained(line: dict[str, Any]) -> tuple[Any, ...]:
    return (line["reason"], line["miss_item"], line["miss_type"], line["miss_field"])


async def misses(sc: Sidecar) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(sc.admin_url + "/misses") as resp:
        assert resp.status == 200
        body = await resp.json()
    found: list[dict[str, Any]] = body["misses"]
    return found


def user(text: str) -> Item:
    return {"role": "user", "content": text}


async def test_edited_first_item_is_diverged_at_item_0(
    stack: tuple[Emulator, Sidecar], access_log: tuple[AccessLines, io.StringIO]
) -> None:
    """An agent framework that puts a timestamp in its system prompt, 3 tool turns in."""
    _, sc = stack
    lines, _ = access_log
    app = client(sc)
    system = {"role": "system", "content": "You are a coding agent. Now: 2026-12-01T10:00:00Z"}
    history = await agent_loop(app, [system, user(task_text(3, "edit"))])
    assert [line["mode"] for line in lines()] == ["full", "continuation", "continuation", "continuation"]
    edited = [{**system, "content": "You are a coding agent. Now: 2026-12-01T10:05:00Z"}, *history[1:]]
    await create(app, [*edited, user("and now the tests")])
    line = last(lines)
    assert line["mode"] == "full"
    assert explained(line) == ("diverged", 0, "message", "content[0].text")
    assert line["miss_detail"] == "field"
    assert line["candidate_items"] == len(history)  # the last turn's input and its final message
    entry = (await misses(sc))[0]
    assert (entry["reason"], entry["miss_item"], entry["miss_type"], entry["miss_field"]) == explained(line)
    assert len(entry["identity"]) == 8


async def test_reserialised_arguments_are_diverged_at_the_call(
    stack: tuple[Emulator, Sidecar], access_log: tuple[AccessLines, io.StringIO]
) -> None:
    """Equivalent re-serialisation continues; a client that stores arguments as a dict and
    writes them back with ``str()`` (not JSON) is reported at ``arguments``."""
    _, sc = stack
    lines, _ = access_log
    app = client(sc)
    first = [user(task_text(2, "args"))]
    output = await create(app, first)
    (call,) = [o for o in output if o["type"] == "function_call"]
    pretty = {**call, "arguments": json.dumps(json.loads(call["arguments"]), indent=2)}
    await create(app, [*first, pretty, *outputs_for(output)])
    assert last(lines)["mode"] == "continuation"
    broken = {**call, "arguments": str(json.loads(call["arguments"]))}
    await create(app, [*first, broken, *outputs_for(output)])
    line = last(lines)
    assert explained(line) == ("diverged", 1, "function_call", "arguments")
    assert line["candidate_items"] == 4  # turn 2 (3 input items, 1 output) replaced turn 1 on its socket


async def test_dropped_reasoning_is_explained_at_the_reasoning_item(
    stack: tuple[Emulator, Sidecar], access_log: tuple[AccessLines, io.StringIO]
) -> None:
    """LangChain / AI SDK under ``store:false``: the echo leaves the reasoning item out."""
    _, sc = stack
    lines, _ = access_log
    app = client(sc)
    settings: dict[str, Any] = {"reasoning": {"effort": "low", "summary": "auto"}}
    settings["include"] = ["reasoning.encrypted_content"]
    first = [user(task_text(2, "reasoning"))]
    output = await create(app, first, **settings)
    assert output[0]["type"] == "reasoning"
    echo = [o for o in output if o["type"] != "reasoning"]
    await create(app, [*first, *echo, *outputs_for(output)], **settings)
    line = last(lines)
    assert explained(line) == ("dropped_reasoning", 1, "reasoning", None)
    assert line["miss_detail"] == "reasoning_dropped"


async def test_dropped_phase_is_explained_at_the_message(
    stack: tuple[Emulator, Sidecar], access_log: tuple[AccessLines, io.StringIO]
) -> None:
    """llama-index, LangChain's chat form, pydantic-ai for model ids it does not know: the
    assistant message goes back without the ``phase`` the model gave it."""
    _, sc = stack
    lines, _ = access_log
    app = client(sc)
    first = [user(task_text(2, "phase") + " With a preamble.")]
    output = await create(app, first)
    assert output[0]["type"] == "message" and output[0]["phase"] == "commentary"
    echo = [{k: v for k, v in o.items() if k != "phase"} for o in output]
    await create(app, [*first, *echo, *outputs_for(output)])
    line = last(lines)
    assert line["mode"] == "full"
    assert explained(line) == ("dropped_phase", 1, "message", "phase")
    assert line["miss_detail"] == "phase_dropped"
    entry = (await misses(sc))[0]
    assert (entry["reason"], entry["miss_item"], entry["miss_type"], entry["miss_field"]) == explained(line)
    assert entry["miss_detail"] == "phase_dropped"


async def test_changed_tools_are_settings_changed_at_tools(
    stack: tuple[Emulator, Sidecar], access_log: tuple[AccessLines, io.StringIO]
) -> None:
    """An app that enables one more tool in the middle of a conversation."""
    _, sc = stack
    lines, _ = access_log
    app = client(sc)
    first = [user(task_text(2, "tools"))]
    output = await create(app, first)
    await create(app, [*first, *output, *outputs_for(output)], tools=[READ_FILE, WEATHER])
    line = last(lines)
    assert explained(line) == ("settings_changed", None, None, "tools")
    assert line["miss_detail"] == "setting"


async def test_retry_of_a_completed_turn(
    stack: tuple[Emulator, Sidecar], access_log: tuple[AccessLines, io.StringIO]
) -> None:
    """The app sends the same turn again (its own retry after a timeout it saw)."""
    _, sc = stack
    lines, _ = access_log
    app = client(sc)
    first = [user(task_text(2, "retry"))]
    await create(app, first)
    await create(app, first)
    line = last(lines)
    assert explained(line) == ("retry", 1, "function_call", None)
    assert (line["miss_detail"], line["candidate_items"]) == ("retry", 2)


async def test_turn_with_nothing_new_is_no_new_items(
    stack: tuple[Emulator, Sidecar], access_log: tuple[AccessLines, io.StringIO]
) -> None:
    """A chat app that echoes the answer and asks again without a new message ("continue")."""
    _, sc = stack
    lines, _ = access_log
    app = client(sc)
    first = [user("Say hello.")]
    output = await create(app, first, tools=[])
    assert output[-1]["type"] == "message"
    await create(app, [*first, *output], tools=[])
    line = last(lines)
    assert explained(line) == ("no_new_items", 2, None, None)


async def test_no_content_in_logs_misses_or_status_page(
    stack: tuple[Emulator, Sidecar], access_log: tuple[AccessLines, io.StringIO]
) -> None:
    _, sc = stack
    lines, buffer = access_log
    canary = {name: f"CANARY{name.upper()}{uuid.uuid4().hex}" for name in ("sys", "user", "edit", "args", "inst")}
    key = f"sk-ops-canary-{uuid.uuid4().hex}"
    app = client(sc, key)
    system = {"role": "system", "content": f"You are an agent {canary['sys']}"}
    first = [system, user(f"{task_text(2, 'canary')} {canary['user']}")]
    history = await agent_loop(app, first, instructions=f"Be brief {canary['inst']}")
    # diverged (edited item 0), settings_changed (instructions), retry: all explained
    edited = [{**system, "content": f"You are an agent {canary['edit']}"}, *history[1:]]
    await create(app, [*edited, user("more")], instructions=f"Be brief {canary['inst']}")
    await create(app, [*history, user("more")], instructions=f"Be briefer {canary['inst']}")
    output = await create(app, first, instructions=f"Be brief {canary['inst']}")
    call = next(o for o in output if o["type"] == "function_call")
    args = {**call, "arguments": '{"path": "' + canary["args"] + '"}'}
    await create(app, [*first, args, *outputs_for(output)], instructions=f"Be brief {canary['inst']}")
    reasons = [line["reason"] for line in lines() if line["mode"] == "full"]
    assert {"diverged", "settings_changed"} <= set(reasons), reasons
    assert any(line.get("miss_field") == "instructions" for line in lines())
    async with aiohttp.ClientSession() as session:
        pages = {}
        for path in ("/misses", "/", "/status", "/metrics"):
            async with session.get(sc.admin_url + path) as resp:
                assert resp.status == 200
                pages[path] = await resp.text()
    assert "diverged" in pages["/status"] and "content[0].text" in pages["/status"]
    texts = {"access log": buffer.getvalue(), **pages}
    secrets = [*canary.values(), key, *(o.get("id", "") for o in history if o.get("id"))]
    for where, text in texts.items():
        for secret in secrets:
            assert secret not in text, f"{secret[:12]}... found in {where}"
        assert "resp_" not in text, where
