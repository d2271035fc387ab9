"""Turn a validated create request into a response: resolve the context, run the model, build
the response object and its event sequence. No I/O; transports (``http.py``, ``ws.py``) drive it.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from .config import EmulatorConfig
from .events import Event, build_events, lifecycle
from .model import ModelRequest, Plan, plan, tokens
from .oracle import Segment, clean, normalize_input, settings_digest
from .state import EmulatorState, ResponseRecord
from .validation import check_tool_pairs, resolve_input

__all__ = [
    "Execution",
    "Turn",
    "compaction_due",
    "execute",
    "failed_object",
    "finish",
    "new_id",
    "prepare",
    "steered_object",
]

JSON = Any


def new_id(prefix: str, nbytes: int = 24) -> str:
    """``<prefix>_<hex>``: unique, random (content stays deterministic)."""
    return f"{prefix}_{secrets.token_hex(nbytes)}"


@dataclass(slots=True)
class Turn:
    """One accepted create, resolved against its chain."""

    id: str
    body: dict[str, JSON]
    transport: str
    owner: str
    base: Segment
    """The inherited chain (previous response, conversation, or empty)."""
    context: Segment
    """``base`` + the new input: what the model sees."""
    new_items: list[JSON]
    input_bytes: int
    previous_response_id: str | None = None
    cached: bool = False
    """``base`` came from this connection's cache (WS hit)."""
    hydrated: bool = False
    """``base`` was loaded from the store."""
    connection_id: str | None = None
    stream_id: str | None = None
    conversation_id: str | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def store(self) -> bool:
        """``store`` defaults to true."""
        return self.body.get("store") is not False

    @property
    def generate(self) -> bool:
        """``generate: false`` is a warm-up (WS only); ``prompt_cache_options.prewarm`` forces it (§6)."""
        options = self.body.get("prompt_cache_options")
        if isinstance(options, dict) and options.get("prewarm") is True:
            return False
        return self.body.get("generate") is not False

    @property
    def cached_bytes(self) -> int:
        """Canonical context bytes that came from the connection cache."""
        return self.base.nbytes if self.cached else 0

    @property
    def rebuild_bytes(self) -> int:
        """Canonical context bytes that must be (re)processed."""
        return self.context.nbytes - self.cached_bytes

    @property
    def settings_bytes(self) -> int:
        """Bytes of the non-inherited settings (instructions + tools) counted as input."""
        extra = {"instructions": self.body.get("instructions"), "tools": self.body.get("tools")}
        return len(orjson.dumps(clean(extra)))


def prepare(
    body: dict[str, JSON],
    *,
    config: EmulatorConfig,
    transport: str,
    owner: str,
    base: Segment,
    lookup_item: Callable[[str], JSON | None],
    input_bytes: int,
    **extra: Any,
) -> Turn:
    """Resolve the new input against ``base``; raises :class:`ApiError` like the real API would."""
    store = body.get("store") is not False
    items = resolve_input(normalize_input(body.get("input")), store=store, lookup=lookup_item)
    context = base.extend(items)
    if config.validate_tool_pairs:
        check_tool_pairs(context.to_list())
    return Turn(
        id=new_id("resp"),
        body=body,
        transport=transport,
        owner=owner,
        base=base,
        context=context,
        new_items=items,
        input_bytes=input_bytes,
        previous_response_id=body.get("previous_response_id"),
        **extra,
    )


def response_object(turn: Turn, *, status: str, output: list[JSON], usage: JSON, **extra: JSON) -> dict[str, JSON]:
    """The full response object of protocol.md §2.4."""
    body = turn.body
    reasoning = body.get("reasoning") or {}
    obj: dict[str, JSON] = {
        "id": turn.id,
        "object": "response",
        "created_at": turn.created_at,
        "status": status,
        "background": bool(body.get("background") or False),
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "model": body["model"],
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": turn.previous_response_id,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": body.get("service_tier") or "default",
        "store": turn.store,
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": [_echo_tool(tool) for tool in body.get("tools") or []],
        "top_logprobs": body.get("top_logprobs", 0),
        "top_p": body.get("top_p", 1.0),
        "truncation": body.get("truncation", "disabled"),
        "usage": usage,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }
    if turn.conversation_id is not None:
        obj["conversation"] = {"id": turn.conversation_id}
    options = body.get("prompt_cache_options")
    if isinstance(options, dict):  # echoed as applied (SDK ``Response.prompt_cache_options``)
        applied: dict[str, JSON] = {"mode": options.get("mode", "implicit"), "ttl": options.get("ttl", "30m")}
        if options.get("comparison_response_id") is not None:
            applied["comparison_response_id"] = options["comparison_response_id"]
        obj["prompt_cache_options"] = applied
    obj.update(extra)
    return obj


def _echo_tool(tool: JSON) -> JSON:
    """A tool as the response echoes it: function tools get ``description``, ``parameters`` and ``strict``
    (default true in the Responses API), which the published ``FunctionTool`` schema requires."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return tool
    return {"description": None, "parameters": None, **tool, "strict": tool.get("strict", True)}


def failed_object(turn: Turn, message: str = "An error occurred while processing your request.") -> dict[str, JSON]:
    """A ``failed`` response object with a ``server_error`` (protocol.md §4.2.8)."""
    return response_object(
        turn, status="failed", output=[], usage=None, error={"code": "server_error", "message": message}
    )


def steered_object(turn: Turn, final: dict[str, JSON], items_done: int) -> dict[str, JSON]:
    """The ``incomplete`` / ``steered`` response: the items finished before the boundary (protocol.md §6)."""
    output = list(final["output"][:items_done])
    out_tokens = sum(_item_tokens(item) for item in output)
    reasoning = sum(_item_tokens(item) for item in output if item.get("type") == "reasoning")
    return response_object(
        turn,
        status="incomplete",
        output=output,
        usage=_usage(turn, out_tokens, reasoning),
        incomplete_details={"reason": "steered"},
    )


def _item_tokens(item: JSON) -> int:
    if item.get("type") == "function_call":
        return tokens(str(item.get("name", ""))) + tokens(str(item.get("arguments", "")))
    if item.get("type") == "reasoning":
        return sum(tokens(str(p.get("text", ""))) for p in item.get("summary", []))
    return sum(tokens(str(p.get("text", ""))) for p in item.get("content", []))


@dataclass(slots=True)
class Execution:
    """A generated response, ready to stream."""

    shell: dict[str, JSON]
    final: dict[str, JSON]
    events: list[Event]
    terminal: str


def _usage(turn: Turn, output_tokens: int, reasoning_tokens: int) -> dict[str, JSON]:
    input_tokens = math.ceil((turn.context.nbytes + turn.settings_bytes) / 4)
    cached = math.ceil(turn.cached_bytes / 4)
    # [C] WebSocket mode writes what it did not read from the lane cache into it; HTTP writes nothing
    written = max(0, input_tokens - cached) if turn.transport == "ws" else 0
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def _materialise(result: Plan, include_encrypted: bool) -> list[JSON]:
    items: list[JSON] = []
    for planned in result.items:
        if planned.kind == "reasoning":
            item: dict[str, JSON] = {
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
        else:
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": planned.text}
            item = {
                "id": new_id("msg"),
                "type": "message",
                "status": planned.status,
                "content": [part],
                "role": "assistant",
            }
        items.append(item)
    return items


def execute(turn: Turn, config: EmulatorConfig) -> Execution:
    """Run the model and build the event sequence (``generate: false``: created + completed only)."""
    shell = response_object(turn, status="in_progress", output=[], usage=None)
    if not turn.generate:
        final = response_object(turn, status="completed", output=[], usage=_usage(turn, 0, 0))
        events = [Event(lifecycle("response.created", shell)), Event(lifecycle("response.completed", final))]
        return Execution(shell, final, events, "response.completed")
    body = turn.body
    reasoning = body.get("reasoning")
    wants_reasoning = isinstance(reasoning, dict) and reasoning.get("effort") != "none"
    result = plan(
        ModelRequest(
            context=turn.context,
            tools=tuple(body.get("tools") or ()),
            tool_choice=body.get("tool_choice"),
            reasoning=wants_reasoning,
            reply_bytes=config.reply_bytes,
            max_output_tokens=body.get("max_output_tokens"),
        )
    )
    output = _materialise(result, "reasoning.encrypted_content" in (body.get("include") or ()))
    if compaction_due(turn):
        blob = hashlib.sha256(turn.context.digest.encode()).hexdigest()
        output.insert(0, {"id": new_id("cmp"), "type": "compaction", "encrypted_content": "gAAAAAC" + blob})
    out_tokens = sum(p.tokens for p in result.items)
    reasoning_tokens = sum(p.tokens for p in result.items if p.kind == "reasoning")
    usage = _usage(turn, out_tokens, reasoning_tokens)
    if result.incomplete:
        final = response_object(
            turn, status="incomplete", output=output, usage=usage, incomplete_details={"reason": "max_output_tokens"}
        )
        terminal = "response.incomplete"
    else:
        final = response_object(turn, status="completed", output=output, usage=usage)
        terminal = "response.completed"
    return Execution(shell, final, build_events(shell, final, terminal, config.delta_chars), terminal)


def compaction_due(turn: Turn) -> bool:
    """Server-side compaction trigger [C]: ``context_management: [{"type": "compaction",
    "compact_threshold": N}]`` and the request's input tokens reach N. The response's output then starts
    with a ``compaction`` item, announced by ``response.compaction.compacting``. The emulator does not
    shrink the context: the item is an opaque marker the model's context keeps, like any output."""
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
        "context_digest": turn.context.digest,
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
