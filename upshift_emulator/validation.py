"""Request validation shared by HTTP and WebSocket creates (the real API's 400s, same wording)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from .config import EmulatorConfig
from .errors import ApiError, unknown_parameter
from .oracle import canonical_item, normalize_input

__all__ = ["HTTP_FIELDS", "WS_FIELDS", "check_tool_pairs", "resolve_input", "validate_body"]

JSON = Any
HTTP_FIELDS: Final = frozenset(
    {
        "access_programs", "background", "background_options", "client_metadata", "context_management",
        "conversation", "image", "include", "input", "instructions", "max_output_tokens", "max_tool_calls",
        "metadata", "model", "moderation", "parallel_tool_calls", "previous_response_id", "prompt",
        "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning",
        "safety_identifier", "service_tier", "store", "stream", "stream_options", "temperature", "text",
        "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user",
    }
)  # fmt: skip
"""``POST /v1/responses`` fields: openai-python 3.57 ``ResponseCreateParams`` + ``client_metadata``."""
WS_FIELDS: Final = HTTP_FIELDS | {"type", "stream_id", "generate"}
MIN_OUTPUT_TOKENS: Final = 16


def _missing(name: str) -> ApiError:
    return ApiError(400, f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")


def _invalid_type(name: str, expected: str) -> ApiError:
    return ApiError(400, f"Invalid type for '{name}': expected {expected}.", param=name, code="invalid_type")


def validate_body(body: JSON, *, transport: str, config: EmulatorConfig) -> None:
    """Raise :class:`ApiError` for what the real API rejects before generating."""
    if not isinstance(body, dict):
        raise ApiError(400, "Invalid request body: expected a JSON object.")
    if config.reject_unknown_params:
        allowed = WS_FIELDS if transport == "ws" else HTTP_FIELDS
        for key in body:
            if key not in allowed:
                raise unknown_parameter(key)
    model = body.get("model")
    if model is None:
        raise _missing("model")
    if not isinstance(model, str) or not model:
        raise _invalid_type("model", "a string")
    if "input" in body and body["input"] is not None and not isinstance(body["input"], str | list):
        raise _invalid_type("input", "a string or an array of input items")
    for index, item in enumerate(normalize_input(body.get("input"))):
        if not isinstance(item, dict):
            raise _invalid_type(f"input[{index}]", "an object")
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool):
            raise _invalid_type("max_output_tokens", "an integer")
        if limit < MIN_OUTPUT_TOKENS:
            raise ApiError(
                400,
                "Invalid 'max_output_tokens': integer below minimum value. "
                f"Expected a value >= {MIN_OUTPUT_TOKENS}, but got {limit} instead.",
                param="max_output_tokens",
                code="integer_below_min_value",
            )
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not prev.startswith("resp")):
        raise ApiError(
            400,
            f"Invalid 'previous_response_id': '{prev}'. Expected an ID that begins with 'resp'.",
            param="previous_response_id",
            code="invalid_value",
        )
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _invalid_type("tools", "an array")
        for index, tool in enumerate(tools):
            if not isinstance(tool, dict) or "type" not in tool:
                raise _missing(f"tools[{index}].type")
            if tool["type"] == "function" and not tool.get("name"):
                raise _missing(f"tools[{index}].name")
    if prev is not None and body.get("conversation") is not None:
        raise ApiError(
            400,
            "Mutually exclusive parameters: Ensure you are only providing one of: "
            "'previous_response_id' or 'conversation'.",
            param="previous_response_id",
            code="mutually_exclusive_parameters",
        )
    if transport == "http" and body.get("background") and body.get("store") is False:
        raise ApiError(400, "Background mode requires `store` to be true.", param="background")
    _check_prompt_cache_options(body.get("prompt_cache_options"))
    _check_reasoning(body.get("reasoning"))
    _check_service_tier(body.get("service_tier"))
    _check_new_items(normalize_input(body.get("input")))
    _check_context_management(body.get("context_management"))
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(i, str) for i in include)):
        raise _invalid_type("include", "an array of strings")


_CACHE_OPTIONS: Final = {
    "mode": ("implicit", "explicit"),
    "ttl": ("30m", "12h"),
}


def _check_prompt_cache_options(options: JSON) -> None:
    """protocol.md §6: ``prompt_cache_options`` {prewarm, ttl, mode, comparison_response_id}."""
    if options is None:
        return
    if not isinstance(options, dict):
        raise _invalid_type("prompt_cache_options", "an object")
    for key, value in options.items():
        name = f"prompt_cache_options.{key}"
        if key in _CACHE_OPTIONS:
            if value not in _CACHE_OPTIONS[key]:
                allowed = " and ".join(f"'{v}'" for v in _CACHE_OPTIONS[key])
                message = f"Invalid value: '{value}'. Supported values are: {allowed}."
                raise ApiError(400, message, param=name, code="invalid_value")
        elif key == "prewarm":
            if not isinstance(value, bool):
                raise _invalid_type(name, "a boolean")
        elif key == "comparison_response_id":
            if value is not None and not isinstance(value, str):
                raise _invalid_type(name, "a string")
        else:
            raise unknown_parameter(name)


REASONING_CONTEXTS: Final = ("auto", "all_turns", "current_turn")
SERVICE_TIERS: Final = ("auto", "default", "flex", "scale", "priority", "fast", "ultrafast")
_BREAKPOINT_KEYS: Final = frozenset({"mode", "ttl"})


def _enum(name: str, value: JSON, allowed: tuple[str, ...]) -> None:
    if value is not None and value not in allowed:
        shown = ", ".join(f"'{v}'" for v in allowed)
        message = f"Invalid value: '{value}'. Supported values are: {shown}."
        raise ApiError(400, message, param=name, code="invalid_value")


def _check_reasoning(reasoning: JSON) -> None:
    """protocol.md §7: ``reasoning.context`` is ``auto`` | ``all_turns`` | ``current_turn``."""
    if isinstance(reasoning, dict):
        _enum("reasoning.context", reasoning.get("context"), REASONING_CONTEXTS)


def _check_service_tier(tier: JSON) -> None:
    _enum("service_tier", tier, SERVICE_TIERS)


def _check_new_items(items: list[JSON]) -> None:
    """protocol.md §7: ``compaction_trigger`` must be the final input item (or, in a history, be
    followed by the ``compaction`` item it produced); a content block's
    ``prompt_cache_breakpoint`` is ``{"mode": "explicit", "ttl"?: "30m" | "12h"}``."""
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        served = index + 1 < len(items) and isinstance(items[index + 1], dict)
        served = served and items[index + 1].get("type") == "compaction"  # history: a trigger already answered
        if item.get("type") == "compaction_trigger" and index != len(items) - 1 and not served:
            raise ApiError(
                400,
                "Invalid 'input': a 'compaction_trigger' item must be the final input item.",
                param=f"input[{index}]",
                code="invalid_value",
            )
        content = item.get("content")
        if not isinstance(content, list):
            continue
        for c_index, part in enumerate(content):
            mark = part.get("prompt_cache_breakpoint") if isinstance(part, dict) else None
            if mark is None:
                continue
            name = f"input[{index}].content[{c_index}].prompt_cache_breakpoint"
            if not isinstance(mark, dict) or set(mark) - _BREAKPOINT_KEYS:
                raise _invalid_type(name, "an object with 'mode' and optional 'ttl'")
            _enum(f"{name}.mode", mark.get("mode"), ("explicit",))
            _enum(f"{name}.ttl", mark.get("ttl"), ("30m", "12h"))


MIN_COMPACT_THRESHOLD: Final = 1000


def _check_context_management(entries: JSON) -> None:
    """``context_management``: a non-empty array of ``{type, compact_threshold >= 1000}`` (OpenAPI)."""
    if entries is None:
        return
    if not isinstance(entries, list) or not entries:
        raise _invalid_type("context_management", "a non-empty array")
    for index, entry in enumerate(entries):
        name = f"context_management[{index}]"
        if not isinstance(entry, dict) or "type" not in entry:
            raise _missing(f"{name}.type")
        threshold = entry.get("compact_threshold")
        if threshold is not None and (not isinstance(threshold, int) or threshold < MIN_COMPACT_THRESHOLD):
            raise ApiError(
                400,
                f"Invalid '{name}.compact_threshold': integer below minimum value. "
                f"Expected a value >= {MIN_COMPACT_THRESHOLD}, but got {threshold} instead.",
                param=f"{name}.compact_threshold",
                code="integer_below_min_value",
            )


def resolve_input(items: list[JSON], *, store: bool, lookup: Callable[[str], JSON | None]) -> list[JSON]:
    """Replace ``item_reference`` items (and id-only reasoning items) by the stored items they name.

    Raises:
        ApiError: the referenced item is not stored (with the real API's ``store: false`` hint).
    """
    out: list[JSON] = []
    for item in items:
        kind = item.get("type")
        by_id = kind == "item_reference" or (
            kind == "reasoning" and item.get("encrypted_content") is None and isinstance(item.get("id"), str)
        )
        if not by_id:
            out.append(item)
            continue
        ident = str(item.get("id"))
        found = lookup(ident)
        if found is not None:
            out.append(found)
            continue
        if not store:
            raise ApiError(
                400,
                f"Item with id '{ident}' not found. Items are not persisted when `store` is set to false. "
                "Try again with `store` set to true, or remove this item from your input.",
                param="input",
            )
        raise ApiError(404, f"Item with id '{ident}' not found.", param="input")
    return out


def check_tool_pairs(context: list[JSON]) -> None:
    """Every call needs a later output and every output an earlier call (real API 400s).

    ``context`` may hold raw or canonical items (canonicalising is idempotent).
    """
    pending: dict[str, None] = {}
    seen: set[str] = set()
    for raw in context:
        item = canonical_item(raw)
        kind = item.get("type")
        call_id = str(item.get("call_id"))
        if kind in ("function_call", "custom_tool_call"):
            pending[call_id] = None
            seen.add(call_id)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if call_id not in seen:
                raise ApiError(
                    400, f"No tool call found for function call output with call_id {call_id}.", param="input"
                )
            pending.pop(call_id, None)
    if pending:
        call_id = next(iter(pending))
        raise ApiError(400, f"No tool output found for function call {call_id}.", param="input")
