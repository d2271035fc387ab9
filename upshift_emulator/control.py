"""Test-only control endpoints under ``/_emulator`` (no auth): stats, oracle records, faults,
reset and the live latency model."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
from aiohttp import web

from .appkeys import FAULTS, STATE
from .config import LATENCY_PRESETS
from .errors import ApiError
from .faults import Fault
from .http import json_response

__all__ = ["routes"]

JSON = Any
routes = web.RouteTableDef()


async def _body(request: web.Request) -> JSON:
    raw = await request.read()
    try:
        return orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        raise ApiError(400, "Invalid JSON.") from None


@routes.get("/_emulator/health")
async def health(request: web.Request) -> web.Response:
    """Liveness."""
    return json_response({"ok": True})


@routes.get("/_emulator/stats")
async def stats(request: web.Request) -> web.Response:
    """Every counter (see ``state.Stats``)."""
    return json_response(request.app[STATE].stats.snapshot())


@routes.post("/_emulator/reset")
async def reset(request: web.Request) -> web.Response:
    """Zero counters, forget stored responses and records, disarm faults."""
    request.app[STATE].reset()
    request.app[FAULTS].clear()
    return json_response({"ok": True})


@routes.get("/_emulator/responses")
async def list_records(request: web.Request) -> web.Response:
    """The newest oracle records (``?limit=``, default 100)."""
    limit = int(request.query.get("limit", "100"))
    records = list(request.app[STATE].records.values())[-limit:]
    return json_response({"object": "list", "data": records})


@routes.get("/_emulator/responses/{response_id}")
async def record(request: web.Request) -> web.Response:
    """The oracle record of one response (any transport, any ``store``)."""
    found = request.app[STATE].records.get(request.match_info["response_id"])
    if found is None:
        raise ApiError(404, "No emulator record for this response id.")
    return json_response(found)


@routes.get("/_emulator/faults")
async def list_faults(request: web.Request) -> web.Response:
    """Faults still armed."""
    queue = request.app[FAULTS]
    return json_response({"faults": [f.to_dict() for f in queue.pending], "held": [h.to_dict() for h in queue.held]})


@routes.post("/_emulator/faults/release")
async def release_held(request: web.Request) -> web.Response:
    """Release responses paused by ``hold`` faults: ``{"then": "drop", "fault_id": "fault_3"}`` (both optional)."""
    body = await _body(request)
    try:
        released = request.app[FAULTS].release(body.get("then"), body.get("fault_id"))
    except (AttributeError, ValueError) as exc:
        raise ApiError(400, f"Invalid release: {exc}") from None
    return json_response({"released": released})


@routes.post("/_emulator/recording")
async def start_recording(request: web.Request) -> web.Response:
    """Start keeping received requests (``{"limit": N}``, default 1000); clears earlier ones."""
    body = await _body(request)
    request.app[STATE].start_recording(int(body.get("limit", 1000)))
    return json_response({"ok": True})


@routes.get("/_emulator/received")
async def received(request: web.Request) -> web.Response:
    """What was received since recording started: ``{"transport": "http"|"ws", "body": …}`` each."""
    recording = request.app[STATE].recording
    return json_response({"object": "list", "data": list(recording) if recording is not None else []})


@routes.post("/_emulator/faults")
async def arm_faults(request: web.Request) -> web.Response:
    """Arm one fault (an object), or several (a list, or ``{"faults": [...]}``)."""
    body = await _body(request)
    specs = body.get("faults", [body]) if isinstance(body, dict) else body
    try:
        faults = [Fault.from_dict(spec) for spec in specs]
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"Invalid fault: {exc}") from None
    for fault in faults:
        request.app[FAULTS].add(fault)
    return json_response({"armed": [f.to_dict() for f in faults]})


@routes.delete("/_emulator/faults")
async def clear_faults(request: web.Request) -> web.Response:
    """Disarm every fault."""
    request.app[FAULTS].clear()
    return json_response({"ok": True})


@routes.get("/_emulator/latency")
async def get_latency(request: web.Request) -> web.Response:
    """The latency model in force."""
    return json_response(dataclasses.asdict(request.app[STATE].latency))


@routes.post("/_emulator/latency")
async def set_latency(request: web.Request) -> web.Response:
    """Replace the latency model: optional ``preset`` then any of its fields."""
    body = await _body(request)
    state = request.app[STATE]
    try:
        latency = LATENCY_PRESETS[body.pop("preset")] if "preset" in body else state.latency
        state.latency = dataclasses.replace(latency, **{k: float(v) for k, v in body.items()})
    except (KeyError, TypeError, ValueError) as exc:
        raise ApiError(400, f"Invalid latency settings: {exc}") from None
    return json_response(dataclasses.asdict(state.latency))


@routes.get("/_emulator/config")
async def get_config(request: web.Request) -> web.Response:
    """The emulator's configuration (latency as started, not as changed since)."""
    config = request.app[STATE].config
    data = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    data["latency"] = dataclasses.asdict(config.latency)
    return json_response(data)
