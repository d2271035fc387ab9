"""The GPT-5.6-era surface (protocol.md §7) the emulator emits conforms to the OpenAPI file and the
SDK types, like everything else it emits (``test_emulator.py``): reasoning.context on the response,
``service_tier: "ultrafast"``, the ``compaction`` item of a ``compaction_trigger``, ``program`` /
``program_output`` items and ``caller``, encrypted reasoning by default, obfuscation on WebSocket
deltas; and the string-input request bodies that carry the new fields are valid creates."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
import websockets

from upshift_emulator import Emulator

from . import schema
from .scenarios import HEADERS, TOOLS, _post, turn

pytestmark = pytest.mark.timeout(60)
MODEL = "gpt-6.1-sol"
PROGRAM_TOOLS = [{**TOOLS[0], "allowed_callers": ["direct", "programmatic"]}]
MARK = {"prompt_cache_breakpoint": {"mode": "explicit"}}  # the OpenAPI file has no ttl (the SDK has)
BODIES: list[dict[str, Any]] = [
    {"model": MODEL, "input": "hi", "reasoning": {"effort": "low", "context": "current_turn"}, "store": False},
    {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi", **MARK}]}]},
    {"model": MODEL, "input": [{"role": "user", "content": "hi"}, {"type": "compaction_trigger"}], "store": False},
    {"model": MODEL, "input": "quick", "service_tier": "ultrafast"},
    {"model": MODEL, "input": "as a program, steps=1", "tools": PROGRAM_TOOLS},
]


async def test_new_fields_conform_on_both_transports() -> None:
    async with Emulator(ultrafast_fallback_every=2) as emu, aiohttp.ClientSession(headers=HEADERS) as session:
        for body in BODIES:
            if isinstance(body["input"], str):  # (the file's input oneOf matches a list of parts twice)
                schema.validate_create_body(body)
            what, obj = await _post(session, emu, body)
            assert what == "response", obj
            schema.validate_response(obj)
            what, data = await _post(session, emu, {**body, "stream": True})
            assert what == "sse"
            schema.validate_sse_bytes(data)
        async with websockets.connect(emu.ws_url, additional_headers=HEADERS) as conn:
            for body in BODIES:
                frame = {"type": "response.create", **body}
                events = await turn(conn, [], frame)
                for event in events:
                    schema.validate_ws_server_event(event)
                deltas = [e for e in events if e["type"].endswith(".delta")]
                assert all("obfuscation" in e for e in deltas)
    assert emu.stats.tiers["ultrafast->default"] >= 1


async def test_program_items_and_their_caller_conform() -> None:
    async with Emulator() as emu, aiohttp.ClientSession(headers=HEADERS) as session:
        _, first = await _post(session, emu, BODIES[-1])
        program, call = first["output"]
        assert program["type"] == "program" and call["caller"]["caller_id"] == program["call_id"]
        history = [
            {"role": "user", "content": "as a program, steps=1"},
            *first["output"],
            {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"},
        ]
        body = {"model": MODEL, "input": history, "tools": PROGRAM_TOOLS}
        what, done = await _post(session, emu, body)
        schema.validate_response(done)
        assert [i["type"] for i in done["output"]] == ["program_output", "message"]
        async with session.post(emu.base_url + "/responses/compact", json={"model": MODEL, "input": history}) as resp:
            window = await resp.json()
    assert window["object"] == "response.compaction" and window["output"][-1]["type"] == "compaction"
    # The compaction item is an output item (the window's user messages are input items, as in the
    # OpenAPI file's example: `input_text` parts, which Response.output does not allow).
    schema.validate_response({**done, "output": window["output"][-1:]})
    assert all(i["role"] == "user" for i in window["output"][:-1]) and window["usage"]["input_tokens"] > 0
