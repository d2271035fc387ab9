"""The WebSocket relay passes frames it does not know both ways untouched: ``response.steer``
from the real SDK (``conn.response.steer``) reaches the emulator, whose
``response.steer.failed`` reply reaches the app; an unknown client frame gets the upstream's own
error; and the socket goes on serving the chain afterwards."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from openai import AsyncOpenAI

from tests.sidecar import Sidecar
from upshift_emulator import Emulator

TERMINAL = ("response.completed", "response.failed", "response.incomplete", "error")


async def _until_terminal(conn: Any) -> list[Any]:
    events = []
    while True:
        event = await asyncio.wait_for(conn.recv(), 5.0)
        events.append(event)
        if event.type in TERMINAL:
            return events


async def test_steer_and_unknown_frames_pass_both_ways(emulator: Emulator, sidecar: Sidecar) -> None:
    async with AsyncOpenAI(base_url=sidecar.base_url, api_key="sk-steer", max_retries=0) as client:
        async with client.responses.connect() as conn:
            await conn.response.create(model="gpt-6.1-sol", input="Say something long.")
            first = (await _until_terminal(conn))[-1]
            assert first.type == "response.completed"
            response_id = first.response.id

            before = emulator.stats.snapshot()
            await conn.response.steer(input="Also mention the weather.", previous_response_id=response_id)
            reply = json.loads(await asyncio.wait_for(conn.recv_bytes(), 5.0))
            assert reply["type"] == "response.steer.failed"
            assert reply["error"]["code"] == "steering_not_supported"
            assert reply["steer"] == {"input": "Also mention the weather.", "previous_response_id": response_id}
            middle = emulator.stats.snapshot()
            assert middle["ws_frames_received"] - before["ws_frames_received"] == 1

            # A frame nobody here knows, in an odd spelling: it reaches the upstream byte for byte.
            odd = '{ "type" : "response.inject",  "input":[],"x":"\u00e9é" }'
            await conn.send_raw(odd)
            error = json.loads(await asyncio.wait_for(conn.recv_bytes(), 5.0))
            assert error["type"] == "error" and "response.inject" in error["error"]["message"]
            after = emulator.stats.snapshot()
            assert after["ws_frames_received"] - middle["ws_frames_received"] == 1
            assert after["bytes_received"]["ws"] - middle["bytes_received"]["ws"] == len(odd.encode())

            # The relayed socket still serves the chain.
            await conn.response.create(model="gpt-6.1-sol", input="And now?", previous_response_id=response_id)
            second = (await _until_terminal(conn))[-1]
            assert second.type == "response.completed"
            rec = emulator.record(second.response.id)
            assert rec is not None and rec["continuation"] is True and rec["cache_hit"] is True
