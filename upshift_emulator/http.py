"""HTTP side of ``/v1/responses``: create (JSON, SSE, background), retrieve, delete, and the
WebSocket upgrade on ``GET /v1/responses`` (handed to :class:`~.ws.WsConnection`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import orjson
from aiohttp import web

from . import errors
from .appkeys import FAULTS, OWNER, REGISTRY, STATE
from .engine import Execution, Turn, compaction_item, execute, finish, new_id, prepare
from .errors import ApiError
from .events import build_events, stamp
from .faults import Fault
from .objects import usage
from .oracle import Segment
from .runner import CUT_KINDS, Hold, Outcome, play
from .sinks import NullSink, SseSink, wants_obfuscation
from .state import Conversation, EmulatorState, ResponseRecord
from .validation import HTTP_FIELDS, validate_body
from .ws import WsConnection

__all__ = ["json_response", "routes"]

JSON = Any
routes = web.RouteTableDef()


def json_response(data: JSON, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """Compact JSON via orjson."""
    return web.Response(body=orjson.dumps(data), status=status, headers=headers, content_type="application/json")


def error_response(error: ApiError) -> web.Response:
    """An OpenAI-style error body with its status and headers (a 429 keeps ``retry-after``)."""
    return json_response(error.http_body(), error.status, error.headers or None)


def _fire(request: web.Request, kinds: set[str], facts: dict[str, JSON]) -> Fault | None:
    fault = request.app[FAULTS].take(kinds, "http", facts)
    if fault is not None:
        request.app[STATE].stats.fault_fired(fault.kind)
    return fault


def _conversation(state: EmulatorState, owner: str, value: JSON) -> Conversation:
    conv_id = value.get("id") if isinstance(value, dict) else value
    if not isinstance(conv_id, str) or not conv_id:
        raise ApiError(400, "Invalid 'conversation': expected an id.", param="conversation", code="invalid_value")
    conv = state.conversations.get(conv_id)
    if conv is None:  # created lazily: the emulator keeps it simple
        conv = state.conversations[conv_id] = Conversation(conv_id, owner, Segment.root())
    elif state.config.isolate_keys and conv.owner != owner:
        raise errors.not_found("Conversation", conv_id)
    return conv


def _base(request: web.Request, body: dict[str, JSON], owner: str) -> tuple[Segment, bool, str | None]:
    """(inherited chain, hydrated, conversation id) for an HTTP create."""
    state = request.app[STATE]
    prev = body.get("previous_response_id")
    if body.get("conversation") is not None:
        conv = _conversation(state, owner, body["conversation"])
        return conv.chain, False, conv.id
    if prev is None:
        return Segment.root(), False, None
    state.stats.continuations["http"] += 1
    facts = {"previous_response_id_present": True, "previous_response_id": prev}
    forced = _fire(request, {"miss"}, facts)
    record = None if forced is not None else state.get(prev, owner)
    if record is None:
        state.stats.misses["http"] += 1
        raise errors.previous_response_not_found(prev)
    state.stats.hydrations["http"] += 1
    return record.chain, True, None


@routes.post("/v1/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``: JSON, SSE or background."""
    state = request.app[STATE]
    raw = await request.read()
    state.stats.requests["http"] += 1
    state.stats.bytes_received["http"] += len(raw)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return error_response(ApiError(400, errors.INVALID_JSON_MESSAGE))
    state.received("http", body)
    facts: dict[str, JSON] = {}
    if isinstance(body, dict):
        prev = body.get("previous_response_id")
        facts = {
            "previous_response_id_present": prev is not None,
            "previous_response_id": prev,
            "store": body.get("store") is not False,
            "model": body.get("model"),
            "stream": body.get("stream") is True,
        }
    delay = _fire(request, {"delay"}, facts)
    if delay is not None:
        await asyncio.sleep(delay.seconds)
    try:
        fault = _fire(request, {"error", *CUT_KINDS}, facts)
        if fault is not None and fault.kind == "error":
            raise fault.to_error()
        validate_body(body, transport="http", config=state.config)
        owner = request[OWNER]
        base, hydrated, conv_id = _base(request, body, owner)
        turn = prepare(
            body,
            config=state.config,
            transport="http",
            owner=owner,
            base=base,
            lookup_item=lambda item_id: state.item(item_id, owner),
            input_bytes=len(raw),
            hydrated=hydrated,
            conversation_id=conv_id,
            service_tier=state.serve_tier(owner, body),
        )
    except ApiError as error:
        state.stats.errors["http"] += 1
        return error_response(error)
    execution = execute(turn, state.config)
    if body.get("background") and body.get("stream") is not True:
        return _start_background(request, turn, execution)
    if body.get("stream") is True:
        return await _stream(request, turn, execution, fault, _hold(request, facts))
    hold = _hold(request, facts)
    outcome = await play(execution, turn, NullSink(request), latency=state.latency, fault=fault, hold=hold)
    _finish(state, turn, outcome)
    if outcome.status == "failed":
        failure = outcome.response["error"]
        return json_response({"error": {**failure, "type": "server_error", "param": None}}, 500)
    return json_response(outcome.response)


def _hold(request: web.Request, facts: dict[str, JSON]) -> Hold | None:
    fault = _fire(request, {"hold"}, facts)
    return Hold(fault, request.app[FAULTS]) if fault is not None else None


async def _stream(
    request: web.Request, turn: Turn, execution: Execution, fault: Fault | None, hold: Hold | None
) -> web.StreamResponse:
    state = request.app[STATE]
    latency = state.latency
    if latency.overhead_ms > 0:  # paid before the headers, as a real upstream would
        await asyncio.sleep(latency.overhead_ms / 1000.0)
        latency = dataclasses.replace(latency, overhead_ms=0.0)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    response.headers["Cache-Control"] = "no-cache"
    await response.prepare(request)
    try:
        sink = SseSink(request, response, wants_obfuscation(turn.body, state.config.http_obfuscation))
        settled: list[ResponseRecord] = []  # recorded before the terminal event goes out

        def settle(final: dict[str, JSON]) -> None:
            settled.append(_settle(state, turn, final))

        outcome = await play(execution, turn, sink, latency=latency, fault=fault, hold=hold, settle=settle)
    except ConnectionError:
        return response
    if not settled:
        _finish(state, turn, outcome)
    if outcome.status in ("dropped", "closed"):
        return response
    await response.write_eof()
    return response


def _finish(state: EmulatorState, turn: Turn, outcome: Outcome) -> ResponseRecord:
    return _settle(state, turn, outcome.response)


def _settle(state: EmulatorState, turn: Turn, response: dict[str, JSON]) -> ResponseRecord:
    """Record a finished response (and move its conversation on, if it completed)."""
    record = finish(state, turn, response)
    if turn.conversation_id is not None and response.get("status") in ("completed", "incomplete"):
        state.conversations[turn.conversation_id].chain = record.chain
    return record


def _start_background(request: web.Request, turn: Turn, execution: Execution) -> web.Response:
    state = request.app[STATE]
    queued = {**execution.shell, "status": "queued"}
    placeholder = ResponseRecord(turn.id, turn.owner, queued, [], turn.context, turn.context, turn.new_items, True)
    state.put(placeholder)

    async def run() -> None:
        await asyncio.sleep(state.config.background_delay_s)
        if state.store.get(turn.id) is not placeholder:  # cancelled or deleted meanwhile
            return
        placeholder.response = {**execution.shell, "status": "in_progress"}
        outcome = await play(execution, turn, NullSink(None), latency=state.latency)
        if state.store.get(turn.id) is placeholder:
            _finish(state, turn, outcome)

    task = asyncio.create_task(run())
    request.app[REGISTRY].tasks.add(task)
    task.add_done_callback(request.app[REGISTRY].tasks.discard)
    return json_response(queued)


@routes.get("/v1/responses")
async def upgrade(request: web.Request) -> web.StreamResponse:
    """WebSocket mode on the same path; a plain GET is a 405 like the real API."""
    state = request.app[STATE]
    ws = web.WebSocketResponse(
        autoping=True,
        heartbeat=None,
        compress=state.config.ws_compress,
        max_msg_size=state.config.ws_max_message_bytes,
    )
    if not ws.can_prepare(request).ok:
        return error_response(ApiError(405, "Invalid method for URL (GET /v1/responses)"))
    owner = request[OWNER]
    refuse = request.app[FAULTS].take({"refuse_upgrade"}, "ws", {"identity": owner})
    if refuse is not None:
        state.stats.fault_fired("refuse_upgrade")
        state.stats.ws_connections["refused"] += 1
        return error_response(refuse.to_error())
    key = state.stats.key(owner)
    cap = state.config.ws_max_connections_per_key
    at = time.monotonic()
    key.attempts_at.append(at)
    if cap and key.open >= cap:
        key.refused += 1
        key.refused_at.append(at)
        state.stats.ws_connections["refused"] += 1
        state.stats.ws_connections["refused_cap"] += 1
        return error_response(errors.connection_cap_reached(cap, state.config.ws_connection_retry_after_s))
    key.open += 1  # reserved before the first await, so concurrent upgrades cannot overshoot the cap
    key.opened += 1
    key.peak_open = max(key.peak_open, key.open)
    try:
        await ws.prepare(request)
        request.app[REGISTRY].sockets.add(ws)
        await WsConnection(state, request.app[FAULTS], ws, request, owner).run()
    finally:
        request.app[REGISTRY].sockets.discard(ws)
        current = state.stats.key(owner)  # after a reset the table is new
        current.open = max(0, current.open - 1)
    return ws


def _stored(request: web.Request) -> ResponseRecord:
    response_id = request.match_info["response_id"]
    record = request.app[STATE].get(response_id, request[OWNER])
    if record is None:
        raise errors.not_found("Response", response_id)
    return record


@routes.get("/v1/responses/{response_id}")
async def retrieve(request: web.Request) -> web.StreamResponse:
    """A stored response (404 unless ``store`` was true). ``?stream=true`` replays a background
    response's events as SSE, those after ``starting_after`` only (how an SDK resumes)."""
    record = _stored(request)
    if request.query.get("stream") != "true":
        return json_response(record.response)
    if not record.response.get("background"):
        raise ApiError(400, "Only background responses can be streamed.", param="stream")
    final = record.response
    status = str(final.get("status"))
    terminal = f"response.{status}" if status in ("completed", "failed", "incomplete") else "response.completed"
    shell = {**final, "status": "in_progress", "output": [], "usage": None}
    events = build_events(shell, final, terminal, request.app[STATE].config.delta_chars)
    after = int(request.query.get("starting_after", "-1"))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    sink = SseSink(request, response, False)
    for sequence, event in enumerate(events):
        if sequence > after:
            await sink.send(stamp(event.payload, sequence, None))
    await response.write_eof()
    return response


@routes.delete("/v1/responses/{response_id}")
async def delete(request: web.Request) -> web.Response:
    """Delete a stored response."""
    record = _stored(request)
    request.app[STATE].delete(record.id, request[OWNER])
    return json_response({"id": record.id, "object": "response.deleted", "deleted": True})


@routes.post("/v1/responses/{response_id}/cancel")
async def cancel(request: web.Request) -> web.Response:
    """Cancel a queued/in-progress background response."""
    record = _stored(request)
    if record.response.get("status") not in ("queued", "in_progress"):
        raise ApiError(400, "Cannot cancel a response that is not in progress.", param="response_id")
    cancelled = {**record.response, "status": "cancelled"}
    request.app[STATE].put(ResponseRecord(**{**_fields(record), "response": cancelled}))
    return json_response(cancelled)


def _fields(record: ResponseRecord) -> dict[str, JSON]:
    return {name: getattr(record, name) for name in ResponseRecord.__slots__}


@routes.get("/v1/responses/{response_id}/input_items")
async def input_items(request: web.Request) -> web.Response:
    """The new input items of a stored response (ids added where missing)."""
    record = _stored(request)
    data = [item if "id" in item else {"id": new_id("msg"), **item} for item in record.input_items]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return json_response({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": False})


_COMPACT_FIELDS = frozenset(
    {
        "model", "input", "previous_response_id", "instructions", "prompt_cache_key", "prompt_cache_retention",
        "prompt_cache_options", "service_tier", "safety_identifier", "image",
    }
)  # fmt: skip
"""``POST /v1/responses/compact`` fields (the OpenAPI ``CompactResponseMethodPublicBody``)."""


async def _compact_turn(request: web.Request, fields: frozenset[str]) -> Turn:
    """The context a ``/compact`` or ``/input_tokens`` request names: its chain plus its input."""
    state = request.app[STATE]
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ApiError(400, errors.INVALID_JSON_MESSAGE) from None
    if not isinstance(body, dict):
        raise ApiError(400, "Invalid request body: expected a JSON object.")
    state.received("http", body)
    for key in body:
        if key not in fields:
            raise errors.unknown_parameter(key)
    scratch = {k: v for k, v in body.items() if k in ("model", "input", "previous_response_id", "instructions")}
    validate_body({"model": "-", **scratch}, transport="http", config=state.config)
    owner = request[OWNER]
    base, _, _ = _base(request, scratch, owner)
    return prepare(
        {"model": "-", **scratch},
        config=state.config,
        transport="http",
        owner=owner,
        base=base,
        lookup_item=lambda item_id: state.item(item_id, owner),
        input_bytes=len(raw),
        service_tier=state.serve_tier(owner, body),
    )


def _window_message(item: JSON) -> JSON:
    content = [
        {"type": "input_text", "text": part.get("text", "")} if part.get("type") == "text" else part
        for part in item.get("content") or []
        if isinstance(part, dict)
    ]
    return {"id": new_id("msg"), "type": "message", "status": "completed", "content": content, "role": "user"}


@routes.post("/v1/responses/compact")
async def compact(request: web.Request) -> web.Response:
    """Standalone compaction (protocol.md §7): the window to start a new chain with, every user
    message of the context read, then one ``compaction`` item standing for it."""
    state = request.app[STATE]
    state.stats.other("compact")
    try:
        turn = await _compact_turn(request, _COMPACT_FIELDS)
        body = orjson.loads(await request.read())
        if not isinstance(body.get("model"), str) or not body["model"]:
            message = "Missing required parameter: 'model'."
            raise ApiError(400, message, param="model", code="missing_required_parameter")
    except ApiError as error:
        return error_response(error)
    read = turn.read.to_list()
    window = [_window_message(item) for item in read if item.get("type") == "message" and item.get("role") == "user"]
    window.append(compaction_item(turn.read))
    spent = usage(turn, 0, 0)
    spent["output_tokens"] = 8
    spent["total_tokens"] = spent["input_tokens"] + 8
    return json_response(
        {
            "id": new_id("resp"),
            "object": "response.compaction",
            "created_at": int(time.time()),
            "output": window,
            "usage": spent,
            "service_tier": turn.service_tier,
        }
    )


@routes.post("/v1/responses/input_tokens")
async def input_tokens(request: web.Request) -> web.Response:
    """``POST /v1/responses/input_tokens``: the input tokens of the context the request names."""
    state = request.app[STATE]
    state.stats.other("input_tokens")
    try:
        turn = await _compact_turn(request, HTTP_FIELDS - {"stream", "stream_options", "background"})
    except ApiError as error:
        return error_response(error)
    return json_response({"object": "response.input_tokens", "input_tokens": usage(turn, 0, 0)["input_tokens"]})
