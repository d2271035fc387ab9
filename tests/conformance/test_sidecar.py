"""What the sidecar returns to an app (real openai SDK) and what it sends upstream conform too."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from tests.conftest import SidecarFactory
from upshift_emulator import Emulator

from . import schema
from .lags import RELAY_ONLY
from .scenarios import HEADERS, REASONING, TOOLS

pytestmark = pytest.mark.timeout(60)


async def test_app_view_and_upstream_frames_conform(emulator: Emulator, make_sidecar: SidecarFactory) -> None:
    received = emulator.state.start_recording()
    sidecar = await make_sidecar()
    app = AsyncOpenAI(base_url=sidecar.base_url, api_key="sk-test", max_retries=0)
    try:
        history: list[Any] = [{"role": "user", "content": "steps=2 please read"}]
        for _ in range(3):  # a tool loop: every turn after the first can be continued upstream
            async with app.responses.with_streaming_response.create(
                model="gpt-6.1-sol", input=history, tools=TOOLS, stream=True, **REASONING
            ) as raw:
                events = schema.validate_sse_bytes(await raw.read())
            final = events[-1]["response"]
            history.extend(final["output"])
            for item in final["output"]:
                if item["type"] == "function_call":
                    history.append({"type": "function_call_output", "call_id": item["call_id"], "output": "ok"})
        history.append({"role": "user", "content": "thanks"})
        raw_json = await app.responses.with_raw_response.create(
            model="gpt-6.1-sol", input=history, tools=TOOLS, **REASONING
        )
        schema.validate_response(raw_json.http_response.json())
        with pytest.raises(openai.BadRequestError) as info:
            await app.responses.create(model="gpt-6.1-sol", input="x", previous_response_id="resp_unknown")
        schema.validate_error_body(info.value.response.json())
    finally:
        await app.close()
    frames = [r["body"] for r in received if r["transport"] == "ws"]
    assert frames, "the sidecar sent nothing upstream over WebSocket"
    assert any(f.get("previous_response_id") for f in frames), "no continuation was sent"
    for frame in frames:
        schema.validate_client_event(frame)
    for body in (r["body"] for r in received if r["transport"] == "http"):
        schema.validate_create_body(body)


async def test_streams_cut_after_output_end_with_a_conformant_error(
    emulator: Emulator, make_sidecar: SidecarFactory
) -> None:
    """A socket lost after the app saw bytes: the SSE stream ends with one nested ``error`` event."""
    sidecar = await make_sidecar()
    async with aiohttp.ClientSession(headers=HEADERS) as session:
        for kind in ("drop", "close"):
            emulator.faults.arm(kind, transport="ws", after_events=5)
            body = {"model": "gpt-6.1-sol", "input": "cut me", "stream": True}
            async with session.post(sidecar.base_url + "/responses", json=body) as resp:
                events = schema.validate_sse_bytes(await resp.read())
            assert events[-1]["type"] == "error" and events[-1]["error"]["code"]
    assert {lag for lag in RELAY_ONLY if lag.split(" ", 1)[0] in schema.LAYERS} <= schema.used_lags()
