"""OpenAI-shaped errors: one exception type, rendered as an HTTP body or a WebSocket ``error`` event.

Exact texts come from protocol.md §1.6 and §2.5; the rest mirror the real API's wording.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "INVALID_JSON_MESSAGE",
    "ApiError",
    "background_over_ws",
    "connection_cap_reached",
    "connection_limit_reached",
    "invalid_api_key",
    "invalid_stream_id",
    "not_found",
    "previous_response_not_found",
    "stream_limit_reached",
    "unknown_parameter",
]

INVALID_JSON_MESSAGE: Final = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your "
    "HTTP library correctly. The OpenAI API expects a JSON payload, but what was sent was not valid JSON. "
    "If you have trouble figuring out how to fix this, please contact us through our help center at "
    "help.openai.com.)"
)


@dataclass(slots=True)
class ApiError(Exception):
    """A request-level failure with the HTTP status it would have had."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    misalignment: dict[str, Any] | None = None
    """WebSocket only: ``error.misalignment`` (protocol.md §6)."""

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"

    def error_object(self, *, with_headers: bool = False) -> dict[str, Any]:
        """The inner ``error`` object (``headers`` only for WebSocket events)."""
        obj: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        if with_headers and self.headers:
            obj["headers"] = dict(self.headers)
        if with_headers and self.misalignment is not None:
            obj["misalignment"] = dict(self.misalignment)
        return obj

    def http_body(self) -> dict[str, Any]:
        """``{"error": {message, type, param, code}}`` (protocol.md §2.5)."""
        return {"error": self.error_object()}

    def ws_event(self, stream_id: str | None = None) -> dict[str, Any]:
        """The nested WebSocket ``error`` event (protocol.md §1.6); ``stream_id`` only on named lanes."""
        event: dict[str, Any] = {"type": "error", "status": self.status}
        if stream_id is not None:
            event["stream_id"] = stream_id
        event["error"] = self.error_object(with_headers=True)
        return event


def previous_response_not_found(response_id: str) -> ApiError:
    """400 ``previous_response_not_found`` with the exact §1.6 message."""
    return ApiError(
        400,
        f"Previous response with id '{response_id}' not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def invalid_stream_id() -> ApiError:
    """400 ``invalid_stream_id`` (§1.6); the event carries no ``stream_id``."""
    return ApiError(
        400,
        "The 'stream_id' field must be a non-empty string with at most 256 characters and may only "
        "contain letters, numbers, underscores, hyphens, and periods.",
        param="stream_id",
        code="invalid_stream_id",
    )


def stream_limit_reached(limit: int) -> ApiError:
    """400 ``websocket_stream_limit_reached`` (§1.6)."""
    return ApiError(
        400,
        f"This WebSocket connection has reached its maximum number of distinct stream IDs ({limit}). "
        "Reuse an existing stream_id or open a new WebSocket connection.",
        param="stream_id",
        code="websocket_stream_limit_reached",
    )


def connection_limit_reached(max_age_s: float) -> ApiError:
    """400 ``websocket_connection_limit_reached`` (§1.6); exact text for the default 60 minutes."""
    if max_age_s >= 60 and max_age_s % 60 == 0:
        shown = f"{int(max_age_s // 60)} minutes"
    else:
        shown = f"{max_age_s:g} seconds"
    return ApiError(
        400,
        f"Responses websocket connection limit reached ({shown}). Create a new websocket connection to continue.",
        code="websocket_connection_limit_reached",
    )


def connection_cap_reached(cap: int, retry_after_s: float) -> ApiError:
    """429 on a WebSocket upgrade past ``ws_max_connections_per_key`` (protocol.md §5.2: status and body are
    undocumented; this is the ordinary rate-limit body, with ``retry-after``)."""
    shown = f"{retry_after_s:g}"
    return ApiError(
        429,
        f"Too many concurrent WebSocket connections for this API key (limit {cap}). "
        f"Close an open connection or try again in {shown}s.",
        type="requests",
        code="rate_limit_exceeded",
        headers={"retry-after": shown},
    )


def ultrafast_rate_limited(limit: int) -> ApiError:
    """429 past the Ultrafast tier's own rate limit (protocol.md §7: separate from Standard's)."""
    return ApiError(
        429,
        f"Rate limit reached for service_tier 'ultrafast' (limit {limit} requests per min). "
        "Please try again in 60s, or use another service tier.",
        type="requests",
        code="rate_limit_exceeded",
        headers={"retry-after": "60", "x-ratelimit-limit-requests": str(limit)},
    )


def background_over_ws() -> ApiError:
    """§4.2.2: ``background: true`` is not supported over WebSocket."""
    return ApiError(
        400,
        "Background mode is not supported in WebSocket mode. Use the HTTP API for background responses.",
        param="background",
    )


def invalid_api_key(key: str | None) -> ApiError:
    """401 ``invalid_api_key`` (§2.5), with the key redacted as the real API does."""
    if not key:
        message = (
            "You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
        )
    else:
        shown = key if len(key) <= 10 else key[:6] + "*" * (len(key) - 10) + key[-4:]
        message = (
            f"Incorrect API key provided: {shown}. "
            "You can find your API key at https://platform.openai.com/account/api-keys."
        )
    return ApiError(401, message, code="invalid_api_key")


def unknown_parameter(name: str) -> ApiError:
    """400 ``unknown_parameter`` for a body field the API does not know."""
    return ApiError(400, f"Unknown parameter: '{name}'.", param=name, code="unknown_parameter")


def not_found(what: str, ident: str) -> ApiError:
    """404 for an unknown stored object."""
    return ApiError(404, f"{what} with id '{ident}' not found.")
