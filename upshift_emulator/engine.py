"""Turn a validated create request into a response: resolve the context, run the model, build
the response object and its event sequence. No I/O; transports (``http.py``, ``ws.py``) drive it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from .config import EmulatorConfig
from .events import Event, build_events, lifecycle
from .model import ModelRequest, Plan, plan
from .objects import failed_object, response_object, steered_object, usage
from .oracle import Segment, settings_digest
from .state import EmulatorState, ResponseRecord
from .turn import Turn, new_id, prepare

__all__ = [
    "Execution",
    "Turn",
    "compaction_due",
    "compaction_item",
    "compaction_triggered",
    "encrypted_reasoning",
    "execute",
    "failed_object",
    "finish",
    "new_id",
    "prepare",
    "steered_object",
]

JSON = Any


@dataclass(slots=True)
class Execution:
    """A generated response, ready to stream."""

    shell: dict[str, JSON]
    final: dict[str, JSON]
    events: list[Event]
    terminal: str
    safeguard_at: int | None = None
    """A safeguard review pauses the stream before this event for :attr:`safeguard_s`."""
    safeguard_s: float = 0.0


def _materialise(result: Plan, include_encrypted: bool) -> list[JSON]:
    items: list[JSON] = []
    program_call = ""
    for planned in result.items:
        item: dict[str, JSON]
        if planned.kind == "program":
            program_call = new_id("call", 12)
            fingerprint = hashlib.sha256(planned.text.encode()).hexdigest()[:32]
            item = {
                "id": new_id("prg"),
                "type": "program",
                "call_id": program_call,
                "code": planned.text,
                "fingerprint": "fp_" + fingerprint,
            }
        elif planned.kind == "program_output":
            item = {
                "id": new_id("pro"),
                "type": "program_output",
                "call_id": planned.call_id,
                "result": planned.text,
                "status": "completed",
            }
        elif planned.kind == "reasoning":
            item = {
                "id": new_id("rs"),
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": planned.text}],
            }
            if include_encrypted:
                item["encrypted_content"] = planned.encrypted_content
        elif planned.kind == "function_call":
            item = {
                "id": new_id("fc"),
                "type": "function_call",
                "status": planned.status,
                "arguments": planned.arguments,
                "call_id": new_id("call", 12),
                "name": planned.name,
            }
            if planned.programmatic and program_call:
                item["caller"] = {"type": "program", "caller_id": program_call}
        else:
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": planned.text}
            item = {
                "id": new_id("msg"),
                "type": "message",
                "status": planned.status,
                "content": [part],
                "role": "assistant",
            }
            if planned.phase is not None:
                item["phase"] = planned.phase
        items.append(item)
    return items


def execute(turn: Turn, config: EmulatorConfig) -> Execution:
    """Run the model and build the event sequence (``generate: false``: created + completed only)."""
    shell = response_object(turn, status="in_progress", output=[], usage=None)
    if not turn.generate:
        final = response_object(turn, status="completed", output=[], usage=usage(turn, 0, 0))
        events = [Event(lifecycle("response.created", shell)), Event(lifecycle("response.completed", final))]
        return Execution(shell, final, events, "response.completed")
    body = turn.body
    reasoning = body.get("reasoning")
    wants_reasoning = isinstance(reasoning, dict) and reasoning.get("effort") != "none"
    result = plan(
        ModelRequest(
            context=turn.read,
            tools=tuple(body.get("tools") or ()),
            tool_choice=body.get("tool_choice"),
            reasoning=wants_reasoning,
            reply_bytes=config.reply_bytes,
            max_output_tokens=body.get("max_output_tokens"),
        )
    )
    output = _materialise(result, encrypted_reasoning(body, config))
    if compaction_due(turn) or compaction_triggered(turn):
        output.insert(0, compaction_item(turn.read))
    out_tokens = sum(p.tokens for p in result.items)
    reasoning_tokens = sum(p.tokens for p in result.items if p.kind == "reasoning")
    spent = usage(turn, out_tokens, reasoning_tokens)
    if result.incomplete:
        final = response_object(
            turn, status="incomplete", output=output, usage=spent, incomplete_details={"reason": "max_output_tokens"}
        )
        terminal = "response.incomplete"
    else:
        final = response_object(turn, status="completed", output=output, usage=spent)
        terminal = "response.completed"
    events = build_events(shell, final, terminal, config.delta_chars)
    pause = _safeguard_pause(events) if result.safeguard and config.safeguard_pause_s > 0 else None
    return Execution(shell, final, events, terminal, pause, config.safeguard_pause_s)


def _safeguard_pause(events: list[Event]) -> int:
    """Where a safeguard review pauses the stream: after the first text delta (mid-message)."""
    for index, event in enumerate(events):
        if event.payload["type"] == "response.output_text.delta":
            return index + 1
    return max(2, len(events) - 1)


def encrypted_reasoning(body: dict[str, JSON], config: EmulatorConfig) -> bool:
    """Reasoning items carry ``encrypted_content`` when ``include`` asks for it, and by default for
    stateless requests (``store: false``) on the models of ``config.encrypted_reasoning_models``
    (protocol.md §7)."""
    if "reasoning.encrypted_content" in (body.get("include") or ()):
        return True
    model = str(body.get("model") or "")
    return body.get("store") is False and model.startswith(config.encrypted_reasoning_models)


def compaction_item(read: Segment) -> dict[str, JSON]:
    """The ``compaction`` item standing for the context ``read`` (its content is a function of it:
    equal contexts compact alike)."""
    blob = hashlib.sha256(read.digest.encode()).hexdigest()
    return {"id": new_id("cmp"), "type": "compaction", "encrypted_content": "gAAAAAC" + blob}


def compaction_triggered(turn: Turn) -> bool:
    """Compaction v2 (protocol.md §7): the input ends with a ``compaction_trigger`` item."""
    return bool(turn.new_items) and turn.new_items[-1].get("type") == "compaction_trigger"


def compaction_due(turn: Turn) -> bool:
    """Server-side compaction trigger [C]: ``context_management: [{"type": "compaction",
    "compact_threshold": N}]`` and the request's input tokens reach N. The response's output then starts
    with a ``compaction`` item, announced by ``response.compaction.compacting``. The chain keeps every
    item; the model reads it from its latest compaction item on (:func:`~.oracle.visible`)."""
    entries = turn.body.get("context_management")
    if not isinstance(entries, list):
        return False
    input_tokens = math.ceil((turn.context.nbytes + turn.settings_bytes) / 4)
    for entry in entries:
        if isinstance(entry, dict) and entry.get("type") == "compaction":
            threshold = entry.get("compact_threshold")
            if isinstance(threshold, int) and input_tokens >= threshold:
                return True
    return False


def finish(state: EmulatorState, turn: Turn, final: dict[str, JSON]) -> ResponseRecord:
    """Record a finished response: oracle record, counters, and the store when ``store`` is true."""
    status = str(final["status"])
    output = list(final.get("output") or [])
    record = ResponseRecord(
        id=turn.id,
        owner=turn.owner,
        response=final,
        output=output,
        context=turn.context,
        chain=turn.context.extend(output),
        input_items=turn.new_items,
        store=turn.store,
    )
    stats = state.stats
    stats.responses[status] = stats.responses.get(status, 0) + 1
    stats.input_items[turn.id] = len(turn.new_items)
    state.record(turn.id, oracle_record(turn, status))
    if turn.store and status != "failed":
        state.put(record)
    return record


def oracle_record(turn: Turn, status: str) -> dict[str, JSON]:
    """What ``GET /_emulator/responses/{id}`` shows for a response."""
    return {
        "id": turn.id,
        "status": status,
        "context_digest": turn.read.digest,
        "chain_digest": turn.context.digest,
        "reasoning_context": turn.reasoning_context,
        "service_tier": turn.body.get("service_tier"),
        "settings_digest": settings_digest(turn.body.get("instructions"), turn.body.get("tools")),
        "context_items": turn.context.count,
        "input_items": len(turn.new_items),
        "context_bytes": turn.context.nbytes,
        "cached_bytes": turn.cached_bytes,
        "transport": turn.transport,
        "continuation": turn.previous_response_id is not None,
        "cache_hit": turn.cached,
        "hydrated": turn.hydrated,
        "input_bytes": turn.input_bytes,
        "previous_response_id": turn.previous_response_id,
        "connection_id": turn.connection_id,
        "stream_id": turn.stream_id,
        "store": turn.store,
        "generate": turn.generate,
        "model": turn.body.get("model"),
    }
