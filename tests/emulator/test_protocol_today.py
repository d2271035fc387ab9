"""The GPT-5.6-era surface (protocol.md §7) on the emulator, through the real openai SDK where its
types carry the field: reasoning.context, prompt_cache_breakpoint, compaction v2 and /compact,
Ultrafast, programmatic tool calls, encrypted reasoning by default, obfuscation on WebSocket,
safeguard pauses and the nested response.create envelope. Each oracle rule is checked against
the digest of what the model reads (``upshift_emulator.oracle``)."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import openai
import pytest
import websockets

from upshift_emulator import Emulator
from upshift_emulator.oracle import context_digest

from .conftest import KEY, TOOLS, ClientFactory, EmulatorFactory
from .test_lanes import recv, until_terminals

pytestmark = pytest.mark.timeout(40)
HEADERS = {"Authorization": f"Bearer {KEY}"}
MODEL = "gpt-6.1-sol"
PROGRAM_TOOLS = [{**TOOLS[0], "allowed_callers": ["direct", "programmatic"]}]


def dump(items: list[Any]) -> list[Any]:
    return [i.model_dump(exclude_none=True, warnings=False) if hasattr(i, "model_dump") else i for i in items]


def user(text: str, **part: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "input_text", "text": text, **part}]}


async def test_reasoning_context_effective_value_and_rule(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    """The response reports the effective value (auto = the model's default); under current_turn
    the reasoning of earlier user turns is not read, reasoning inside the current tool loop is."""
    emu = await make_emulator()
    client = sdk(emu)
    for model, asked, effective in [
        (MODEL, None, "all_turns"),
        (MODEL, "auto", "all_turns"),
        ("gpt-5.2", "auto", "current_turn"),
        (MODEL, "current_turn", "current_turn"),
        ("gpt-5.2", "all_turns", "all_turns"),
    ]:
        reasoning: dict[str, Any] = {"effort": "low"} | ({"context": asked} if asked else {})
        reply = await client.responses.create(model=model, input="hi", reasoning=reasoning)  # type: ignore[arg-type]
        assert reply.reasoning is not None and reply.reasoning.context == effective
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input="hi", reasoning={"context": "every_turn"})  # type: ignore[typeddict-item]
    assert info.value.param == "reasoning.context"

    current: dict[str, Any] = {"effort": "low", "context": "current_turn"}
    first = await client.responses.create(model=MODEL, input="steps=1", tools=TOOLS, reasoning=current)  # type: ignore[arg-type]
    out = dump(first.output)
    call = next(i for i in out if i["type"] == "function_call")
    loop = [user("steps=1"), *out, {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}]
    answer = await client.responses.create(model=MODEL, input=loop, tools=TOOLS, reasoning=current)  # type: ignore[arg-type]
    later = [*loop, *dump(answer.output), user("and now?")]
    reply = await client.responses.create(model=MODEL, input=later, tools=TOOLS, reasoning=current)  # type: ignore[arg-type]
    without = [i for i in later if i.get("type") != "reasoning"]
    read = emu.record(reply.id)
    assert read is not None
    # Earlier user turns' reasoning: not read under current_turn, read under all_turns.
    assert read["context_digest"] == context_digest(without, "current_turn") == context_digest(later, "current_turn")
    assert context_digest(without) != context_digest(later)
    # Reasoning inside the current tool loop is read under current_turn too.
    loop_without = [i for i in loop if i.get("type") != "reasoning"]
    assert context_digest(loop_without, "current_turn") != context_digest(loop, "current_turn")


async def test_breakpoint_is_not_read_and_validated(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator()
    client = sdk(emu)
    mark = {"prompt_cache_breakpoint": {"mode": "explicit", "ttl": "30m"}}
    marked = await client.responses.create(
        model=MODEL, input=[user("hello there", **mark)], prompt_cache_options={"mode": "explicit"}
    )
    plain = await client.responses.create(model=MODEL, input=[user("hello there")])
    assert marked.output_text == plain.output_text  # the model reads the same context
    digests = [emu.record(r.id)["context_digest"] for r in (marked, plain)]  # type: ignore[index]
    assert digests[0] == digests[1] == context_digest([user("hello there", **mark)])
    assert marked.usage is not None and marked.usage.input_tokens_details.cache_write_tokens == 0  # HTTP [C]
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input=[user("x", prompt_cache_breakpoint={"mode": "always"})])  # type: ignore[typeddict-item]
    assert info.value.param == "input[0].content[0].prompt_cache_breakpoint.mode"


async def test_compaction_trigger_and_the_context_rule(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    """A trailing compaction_trigger gives exactly one compaction item before the answer; the
    model reads a context from its latest compaction item on, so a history pruned there and the
    whole chain are the same context."""
    emu = await make_emulator()
    client = sdk(emu)
    history: list[Any] = [user("first question")]
    first = await client.responses.create(model=MODEL, input=history, store=False)
    history += dump(first.output)
    history.append(user("second question"))
    history.append({"type": "compaction_trigger"})
    async with client.responses.stream(model=MODEL, input=history, store=False) as stream:
        events = [event.type async for event in stream]
        compacted = await stream.get_final_response()
    out = dump(compacted.output)
    assert [i["type"] for i in out] == ["compaction", "message"] and out[0]["encrypted_content"]
    assert events.count("response.compaction.compacting") == 1
    history += out
    pruned = out + [user("third question")]
    full = await client.responses.create(model=MODEL, input=[*history, user("third question")], store=False)
    short = await client.responses.create(model=MODEL, input=pruned, store=False)
    assert emu.record(full.id)["context_digest"] == emu.record(short.id)["context_digest"]  # type: ignore[index]
    assert full.output_text == short.output_text
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input=[{"type": "compaction_trigger"}, user("x")])
    assert info.value.param == "input[0]"


async def test_standalone_compact_window(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator()
    client = sdk(emu)
    first = await client.responses.create(model=MODEL, input="plan the trip")
    window = await client.responses.compact(model=MODEL, previous_response_id=first.id, input="and the budget")
    assert window.object == "response.compaction"
    kinds = [item.type for item in window.output]
    assert kinds == ["message", "message", "compaction"]
    base = dump(window.output)
    reply = await client.responses.create(model=MODEL, input=[*base, user("go on")])
    assert emu.record(reply.id)["context_digest"] == context_digest([base[-1], user("go on")])  # type: ignore[index]
    counted = await client.responses.input_tokens.count(model=MODEL, input=[*base, user("go on")])
    assert counted.input_tokens > 0
    assert emu.stats.other_requests == {"compact": 1, "input_tokens": 1}


async def test_ultrafast_fallback_and_its_own_limit(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator(ultrafast_fallback_every=3, ultrafast_rate_limit=7)
    client = sdk(emu)
    other = await client.responses.create(model="gpt-5.2", input="quick", service_tier="ultrafast")
    assert other.service_tier == "default"  # not served on that model
    served = []
    for _ in range(6):
        reply = await client.responses.create(model=MODEL, input="quick", service_tier="ultrafast")
        served.append(reply.service_tier)
    assert served == ["ultrafast", "default", "ultrafast"] * 2
    with pytest.raises(openai.RateLimitError) as info:  # its own limit: 7 a minute
        await client.responses.create(model=MODEL, input="quick", service_tier="ultrafast")
    assert "ultrafast" in info.value.message and info.value.response.headers["retry-after"] == "60"
    standard = await client.responses.create(model=MODEL, input="quick")  # another tier's limits
    assert standard.service_tier == "default"
    assert emu.stats.tiers["ultrafast->default"] == 3 and emu.stats.tiers["ultrafast:429"] == 1


async def test_programmatic_tool_calls(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator()
    client = sdk(emu)
    history: list[Any] = [user("run it as a program, steps=1")]
    first = await client.responses.create(model=MODEL, input=history, tools=PROGRAM_TOOLS)  # type: ignore[arg-type]
    out = dump(first.output)
    assert [i["type"] for i in out] == ["program", "function_call"]
    program, call = out
    assert call["caller"] == {"type": "program", "caller_id": program["call_id"]} and program["fingerprint"]
    history += [*out, {"type": "function_call_output", "call_id": call["call_id"], "output": "42"}]
    done = await client.responses.create(model=MODEL, input=history, tools=PROGRAM_TOOLS)  # type: ignore[arg-type]
    result, answer = dump(done.output)
    assert result["type"] == "program_output" and result["call_id"] == program["call_id"]
    assert result["result"] == "42" and "Last output: 42" in answer["content"][0]["text"]
    # ``caller`` is a linkage the model reads: an echo without it is another context.
    no_caller = [{k: v for k, v in i.items() if k != "caller"} for i in history]
    assert context_digest(no_caller) != context_digest(history)
    direct = await client.responses.create(model=MODEL, input="steps=1 program", tools=TOOLS)
    assert [i.type for i in direct.output] == ["function_call"]  # the tool does not allow programs


async def test_encrypted_reasoning_by_default_for_stateless(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator()
    client = sdk(emu)
    low: Any = {"effort": "low"}
    stateless = await client.responses.create(model=MODEL, input="hi", reasoning=low, store=False)
    stored = await client.responses.create(model=MODEL, input="hi", reasoning=low)
    older = await client.responses.create(model="gpt-5.2", input="hi", reasoning=low, store=False)
    asked = await client.responses.create(
        model="gpt-5.2", input="hi", reasoning=low, store=False, include=["reasoning.encrypted_content"]
    )
    assert [r.output[0].encrypted_content is not None for r in (stateless, stored, older, asked)] == [
        True,
        False,
        False,
        True,
    ]


async def _ws_deltas(emu: Emulator, **fields: Any) -> list[dict[str, Any]]:
    async with websockets.connect(emu.ws_url, additional_headers=HEADERS) as conn:
        await conn.send(json.dumps({"type": "response.create", "model": MODEL, "input": "say hi", **fields}))
        events = await until_terminals(conn, 1)
    return [e for e in events if e["type"].endswith(".delta")]


async def test_obfuscation_on_websocket_unless_false(make_emulator: EmulatorFactory) -> None:
    emu = await make_emulator()
    default = await _ws_deltas(emu)
    assert default and all(e["obfuscation"] for e in default)
    plain = await _ws_deltas(emu, stream_options={"include_obfuscation": False})
    assert plain and not any("obfuscation" in e for e in plain)
    off = await make_emulator(ws_obfuscation=False)
    assert not any("obfuscation" in e for e in await _ws_deltas(off))


async def test_nested_create_envelope(make_emulator: EmulatorFactory) -> None:
    emu = await make_emulator()
    async with websockets.connect(emu.ws_url, additional_headers=HEADERS) as conn:
        nested = {"type": "response.create", "response": {"model": MODEL, "input": "nested hi", "store": False}}
        await conn.send(json.dumps(nested))
        events = await until_terminals(conn, 1)
        await conn.send(json.dumps({"type": "response.create", "model": MODEL, "input": "nested hi", "store": False}))
        flat = await until_terminals(conn, 1)
    assert events[-1]["type"] == flat[-1]["type"] == "response.completed"
    first, second = (e[-1]["response"] for e in (events, flat))
    assert emu.record(first["id"])["context_digest"] == emu.record(second["id"])["context_digest"]  # type: ignore[index]


@pytest.mark.parametrize("transport", ["http", "ws"])
async def test_safeguard_pause_mid_stream(make_emulator: EmulatorFactory, transport: str) -> None:
    emu = await make_emulator(safeguard_pause_s=0.4)
    body = {"model": MODEL, "input": "safeguard this answer", "store": False}
    gaps: list[float] = []
    kinds: list[str] = []
    last = time.monotonic()
    if transport == "ws":
        async with websockets.connect(emu.ws_url, additional_headers=HEADERS) as conn:
            await conn.send(json.dumps({"type": "response.create", **body}))
            while not kinds or kinds[-1] != "response.completed":
                kinds.append((await recv(conn))["type"])
                gaps.append(time.monotonic() - last)
                last = time.monotonic()
    else:
        async with aiohttp.ClientSession(headers=HEADERS) as session:
            async with session.post(emu.base_url + "/responses", json={**body, "stream": True}) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        kinds.append(json.loads(line[6:])["type"])
                        gaps.append(time.monotonic() - last)
                        last = time.monotonic()
    paused = max(range(len(gaps)), key=gaps.__getitem__)
    assert gaps[paused] >= 0.35 and kinds[paused - 1] == "response.output_text.delta"
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds[paused:]
