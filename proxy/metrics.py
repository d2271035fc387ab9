"""Every metric, defined once. Labels are bounded: no ids, keys, models or free text.

All metrics live in :data:`REGISTRY` (not the global default registry), so tests and
several in-process sidecars do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = [
    "ADDED_LATENCY",
    "BUILD_INFO",
    "CONTINUATION_MISSES",
    "DROPPED_REASONING",
    "ERRORS",
    "HELD_LIFECYCLE",
    "INFLIGHT",
    "INPUT_ITEMS_AVOIDED",
    "REGISTRY",
    "REPLAYS",
    "REQUESTS",
    "REQUEST_BYTES",
    "SOCKETS",
    "SOCKET_AGE_AT_ROTATION",
    "UPSTREAM_BYTES_SENT",
    "UPSTREAM_DURATION",
]

REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter(
    "upshift_requests",
    "Requests by route, mode and outcome.",
    ["route", "mode", "outcome"],
    registry=REGISTRY,
)
"""route: responses | responses_ws | other; mode: continuation | full | passthrough | relay;
outcome: ok | client_error | upstream_error | proxy_error | cancelled."""

CONTINUATION_MISSES = Counter(
    "upshift_continuation_misses",
    "Full-history sends for a request that was not a continuation, by reason.",
    ["reason"],
    registry=REGISTRY,
)
"""reason: no_head | diverged | settings_changed | head_busy | dropped_reasoning | retry |
no_new_items | app_chained | pool_full (bounded set, see proxy.core.conversation.MissReason)."""

DROPPED_REASONING = Counter(
    "upshift_dropped_reasoning_echoes",
    "Echoes that left out reasoning items of the previous output (client-echo.md rule 6).",
    ["accepted"],
    registry=REGISTRY,
)

REPLAYS = Counter(
    "upshift_replays",
    "Turns replayed with full input before any byte reached the app, by cause.",
    ["cause"],
    registry=REGISTRY,
)
"""cause: previous_response_not_found | connection_limit | closed_before_first_event."""

ERRORS = Counter(
    "upshift_errors",
    "Errors raised by the sidecar itself, by code.",
    ["code"],
    registry=REGISTRY,
)

REQUEST_BYTES = Counter(
    "upshift_request_bytes",
    "Request body bytes received from apps.",
    registry=REGISTRY,
)

UPSTREAM_BYTES_SENT = Counter(
    "upshift_upstream_bytes_sent",
    "Bytes sent upstream (WebSocket frames and HTTP bodies), by transport.",
    ["transport"],
    registry=REGISTRY,
)

INPUT_ITEMS_AVOIDED = Counter(
    "upshift_input_items_avoided",
    "Input items not re-sent upstream thanks to continuations.",
    registry=REGISTRY,
)

SOCKETS = Gauge(
    "upshift_upstream_sockets",
    "Upstream WebSocket sockets by state.",
    ["state"],
    registry=REGISTRY,
)
"""state: open | busy | idle."""

SOCKET_AGE_AT_ROTATION = Histogram(
    "upshift_socket_age_at_rotation_seconds",
    "Age of upstream sockets when retired by rotation.",
    buckets=(60, 300, 900, 1800, 2700, 3300, 3600),
    registry=REGISTRY,
)

ADDED_LATENCY = Histogram(
    "upshift_added_latency_seconds",
    "Time the sidecar adds to a request (its own processing, excluding upstream time).",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    registry=REGISTRY,
)

UPSTREAM_DURATION = Histogram(
    "upshift_upstream_duration_seconds",
    "Upstream time per request, first frame sent to terminal event.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    registry=REGISTRY,
)

INFLIGHT = Gauge(
    "upshift_inflight_requests",
    "Requests in flight.",
    registry=REGISTRY,
)

HELD_LIFECYCLE = Counter(
    "upshift_held_lifecycle",
    "Streamed responses whose response.created/in_progress were held back, by how the hold ended.",
    ["path"],
    registry=REGISTRY,
)
"""path: output (first output came within streaming.hold_back_seconds) | deadline (released on
their own) | terminal (the response ended while they were held) | discarded (replayed, or answered
as an HTTP error); see proxy.core.channel.HoldPath."""

BUILD_INFO = Gauge(
    "upshift_build_info",
    "Always 1; the labels say which version runs on which event loop.",
    ["version", "loop", "python"],
    registry=REGISTRY,
)
"""loop: uvloop | asyncio."""
