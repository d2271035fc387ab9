"""The response object of protocol.md §2.4 in its states (in progress, completed, failed, steered) and usage."""

from __future__ import annotations

import math
import time
from typing import Any

from .model import tokens
from .turn import Turn

__all__ = ["failed_object", "response_object", "steered_object", "usage"]

JSON = Any


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
        "reasoning": _reasoning(reasoning, turn),
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": turn.service_tier,
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


def _reasoning(asked: dict[str, JSON], turn: Turn) -> dict[str, JSON]:
    """The response's ``reasoning``: as asked, with the effective ``context`` (protocol.md §7) and any
    other field (``mode``) passed back."""
    out = {**asked, "effort": asked.get("effort"), "summary": asked.get("summary")}
    out["context"] = turn.reasoning_context
    return out


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
        usage=usage(turn, out_tokens, reasoning),
        incomplete_details={"reason": "steered"},
    )


def _item_tokens(item: JSON) -> int:
    if item.get("type") == "function_call":
        return tokens(str(item.get("name", ""))) + tokens(str(item.get("arguments", "")))
    if item.get("type") == "reasoning":
        return sum(tokens(str(p.get("text", ""))) for p in item.get("summary", []))
    return sum(tokens(str(p.get("text", ""))) for p in item.get("content", []))


def usage(turn: Turn, output_tokens: int, reasoning_tokens: int) -> dict[str, JSON]:
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
