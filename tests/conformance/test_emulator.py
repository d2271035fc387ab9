"""Everything the emulator emits conforms to the OpenAPI file and the SDK types.

Known lags are listed once, in ``lags.py``; every other finding fails.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import orjson
import pytest

import upshift_emulator
from upshift_emulator import Emulator

from . import schema
from .lags import KNOWN_LAGS, RELAY_ONLY
from .scenarios import SCENARIOS, Payload

pytestmark = pytest.mark.timeout(60)

EMITTED = (
    "error",
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.output_item.done",
    "response.content_part.added",
    "response.content_part.done",
    "response.output_text.delta",
    "response.output_text.done",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.reasoning_summary_part.added",
    "response.reasoning_summary_part.done",
    "response.reasoning_summary_text.delta",
    "response.reasoning_summary_text.done",
    "response.compaction.compacting",
    "response.completed",
    "response.incomplete",
    "response.failed",
    "response.steer.accepted",
    "response.steer.pending",
    "response.steer.failed",
)
"""Every event type the emulator can emit (the emulator never emits refusals, ``response.queued``
events, audio, hosted-tool or custom-tool events)."""


def validate(what: str, obj: Any) -> list[str]:
    """Validate one payload; returns the event types it carried."""
    if what == "sse":
        return [str(e["type"]) for e in schema.validate_sse_bytes(obj)]
    if what == "ws":
        schema.validate_ws_server_event(obj)
        return [str(obj["type"])]
    {
        "response": schema.validate_response,
        "error": schema.validate_error_body,
        "create": schema.validate_create_body,
        "client": schema.validate_client_event,
    }[what](obj)
    return []


async def run_all() -> list[Payload]:
    payloads: list[Payload] = []
    for scenario in SCENARIOS.values():
        async with Emulator() as emu:
            payloads.extend(await scenario(emu))
    return payloads


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_scenario_conforms(name: str) -> None:
    async with Emulator() as emu:
        payloads = await SCENARIOS[name](emu)
    assert payloads
    for what, obj in payloads:
        validate(what, obj)


def _emulator_event_literals() -> set[str]:
    """String constants in upshift_emulator/*.py that name a server event type of the SDK."""
    known = set(schema._models("stream")) | set(schema._models("ws")) | {"error"}
    found: set[str] = set()
    for path in Path(upshift_emulator.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
                found.add(node.value)
    return found


async def test_every_emitted_type_is_covered_and_no_lag_is_stale() -> None:
    literals = _emulator_event_literals()
    assert literals == set(EMITTED), "a new event type in the emulator: add it to EMITTED and to a scenario"
    seen: set[str] = set()
    for what, obj in await run_all():
        seen.update(validate(what, obj))
    assert set(EMITTED) <= seen, f"not covered by any scenario: {sorted(set(EMITTED) - seen)}"
    # A lag of a layer that did not run (no OpenAPI file in this clone) cannot be hit.
    checked = {pattern for pattern in KNOWN_LAGS if pattern.split(" ", 1)[0] in schema.LAYERS}
    stale = checked - RELAY_ONLY - schema.used_lags()
    assert not stale, f"known lags no finding needs any more (remove them): {sorted(stale)}"


async def test_ws_server_events_are_stream_events_too() -> None:
    """protocol.md §1.3: WS server events are the SSE payloads (plus ``stream_id``, steering, errors)."""
    async with Emulator() as emu:
        payloads = await SCENARIOS["ws_turns"](emu)
    for what, obj in payloads:
        if what == "ws" and obj["type"] != "error":
            schema.validate_stream_event({k: v for k, v in obj.items() if k != "stream_id"})


def test_sse_round_trip_helper_returns_payloads() -> None:
    body = b'event: response.in_progress\ndata: {"type":"response.in_progress"}\n\n'
    with pytest.raises(schema.ConformanceError):
        schema.validate_sse_bytes(body)  # framing is fine, the event lacks its required fields
    assert orjson.loads(body.split(b"data: ")[1]) == {"type": "response.in_progress"}


def test_lags_are_documented() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "emulator.md").read_text(encoding="utf-8")
    missing = [pattern for pattern in KNOWN_LAGS if f"| `{pattern}` |" not in docs]
    assert not missing, f"docs/emulator.md lacks these known lags: {missing}"
