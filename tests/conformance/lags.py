"""Known lags and contradictions between what the API sends, the August 2026 OpenAPI file and the
``openai`` 3.57 SDK types: the ONE place where a finding may be accepted (docs/emulator.md repeats it).

Keys are fnmatch patterns over ``"<source> <subject> <path> <kind>"`` (see ``schema.Finding``):
``source`` is ``openapi``, ``sdk`` or ``sse``; ``subject`` the event type, ``Response.<status>``,
``error``, ``ErrorResponse`` or ``CreateResponse``; ``path`` dotted (``*`` for list indexes); ``kind``
the jsonschema keyword, the pydantic error type or ``unknown_key``.
Every entry must keep explaining at least one finding of the emulator suite (``test_no_stale_lags``).
"""

from __future__ import annotations

from typing import Final

__all__ = ["KNOWN_LAGS", "OFF_SPEC_SHAPES", "RELAY_ONLY"]

_LIFECYCLE_NULL_USAGE = (
    "document-level contradiction: Response.usage is typed non-nullable, but the file's own examples of "
    'response.created / in_progress / failed send "usage": null (there is no usage before the end)'
)
_USER_NULL = (
    "document-level contradiction: Response.user is typed string (deprecated), but every example in the "
    'file sends "user": null; the SDK types it Optional[str]'
)

_NESTED_SSE_ERROR = (
    "document vs production: the documented SSE `error` event (OpenAPI ResponseErrorEvent, SDK "
    "ResponseErrorEvent) is flat (top-level code/message/param); production streams send the nested "
    "{type, sequence_number, error: {type, code, message, param}} shape (protocol.md §2.5), which is "
    "also what makes the SDK raise APIError mid-stream. The sidecar emits the nested shape (§4.1.5)"
)

KNOWN_LAGS: Final[dict[str, str]] = {
    # -- document-level contradictions of the OpenAPI file ----------------------------------------------
    "openapi Response.* user type": _USER_NULL,
    "openapi response.* response.user type": _USER_NULL,
    "openapi Response.in_progress usage type": _LIFECYCLE_NULL_USAGE,
    "openapi Response.failed usage type": _LIFECYCLE_NULL_USAGE,
    "openapi Response.queued usage type": _LIFECYCLE_NULL_USAGE,
    "openapi Response.cancelled usage type": _LIFECYCLE_NULL_USAGE,
    "openapi response.created response.usage type": _LIFECYCLE_NULL_USAGE,
    "openapi response.in_progress response.usage type": _LIFECYCLE_NULL_USAGE,
    "openapi response.failed response.usage type": _LIFECYCLE_NULL_USAGE,
    # -- the August OpenAPI file lags the SDK types (protocol.md §6) ----------------------------------------
    "openapi response.steer.* type unknown_type": (
        "OpenAPI lag: no response.steer.accepted/pending/failed server events (SDK 3.57 has them; openapi/README.md)"
    ),
    "openapi response.steer type unknown_type": "OpenAPI lag: no response.steer client event (SDK 3.57 has it)",
    "openapi response.compaction.compacting type unknown_type": (
        "OpenAPI lag: no response.compaction.compacting event (SDK 3.57: ResponseCompactionCompactingEvent, "
        "and ResponseCompactionWsCompacting on WebSocket)"
    ),
    "openapi Response.incomplete incomplete_details anyOf": (
        "OpenAPI lag: incomplete_details.reason has no 'steered' (SDK 3.57: max_output_tokens, "
        "content_filter, max_messages, steered)"
    ),
    "openapi response.incomplete response.incomplete_details anyOf": (
        "OpenAPI lag: incomplete_details.reason has no 'steered'"
    ),
    "openapi * prompt_cache_options.ttl enum": (
        "OpenAPI lag: PromptCacheTTLEnum is ['30m']; SDK 3.57 has '30m' or '12h' (create params and Response)"
    ),
    "openapi response.* response.prompt_cache_options.ttl enum": "OpenAPI lag: PromptCacheTTLEnum is ['30m']",
    # -- the SDK types lag the API / the OpenAPI file -----------------------------------------------------
    "sdk Response.* store unknown_key": (
        "SDK lag: the API returns `store` (and the OpenAPI Response has it); SDK 3.57's Response model "
        "has no `store` field (protocol.md §2.4)"
    ),
    "sdk response.* response.store unknown_key": "SDK lag: Response has no `store` field",
    "sdk response.function_call_arguments.done name unknown_key": (
        "SDK lag: the OpenAPI file requires `name` on response.function_call_arguments.done (with an "
        "example); SDK 3.57 does not declare it. The emulator sends it (docs/emulator.md)"
    ),
    # -- the documented error event vs production (protocol.md §2.5, §4.1.5) -----------------------------
    "openapi error code,message,param required": _NESTED_SSE_ERROR,
    "sdk error message missing": _NESTED_SSE_ERROR,
    # -- undeclared by both ------------------------------------------------------------------------------
    "sdk response.*.delta obfuscation unknown_key": (
        "neither schema declares `obfuscation`, which real HTTP streams add to delta events unless "
        "stream_options.include_obfuscation is false (the SDK's create param documents it)"
    ),
}

RELAY_ONLY: Final = frozenset({"openapi error code,message,param required", "sdk error message missing"})
"""Lags only the sidecar's output hits (the emulator never streams an SSE ``error``): ``test_sidecar``
checks they stay needed, the emulator suite's stale check skips them."""

OFF_SPEC_SHAPES: Final[dict[str, str]] = {
    "no_type": "previous_response_not_found without error.type (first GA guide, xAI): ResponseWsError requires type",
    "alpha": "without status (alpha): valid (status is optional), listed for completeness",
    "flat": "the documented flat error event: no nested `error` object, which ResponseWsError requires",
    "top_level": "ChatGPT-backend style top-level code/message: no nested `error` object",
    "parameterless": "code null and a different message: valid by schema, wrong by protocol.md §1.6",
    "renamed": "code renamed by a proxy: valid by schema, wrong by protocol.md §1.6",
    "response_failed": "a minimal response object without most required fields",
}
"""``miss`` fault shapes that imitate third-party or older servers on purpose (faults.NOT_FOUND_SHAPES).
They are not the emulator's own output; ``test_off_spec_shapes`` checks which of them the validators
reject, so nobody mistakes them for conformant output."""
