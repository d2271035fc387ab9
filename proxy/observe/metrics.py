"""Every metric, defined once. Labels are bounded: no ids, keys, models or free text.

All metrics live in :data:`REGISTRY` (not the global default registry), so tests and
several in-process sidecars do not collide.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.core.budget import Kind
from proxy.core.channel import HoldPath
from proxy.reasons import (
    BodyAbort,
    BrowserRefusal,
    Build,
    ErrorCode,
    ForwardOutcome,
    ListenerClose,
    MemoryRefusal,
    MissReason,
    Mode,
    PassthroughReason,
    ReplayCause,
    RequestOutcome,
    Route,
    ServiceTier,
    Tolerance,
    WaitOutcome,
)

__all__ = [
    "ADDED_LATENCY",
    "BODIES_ABORTED",
    "BROWSER_REFUSALS",
    "BUILD_INFO",
    "CLUSTER_PEERS",
    "CONTINUATION_MISSES",
    "DROPPED_REASONING",
    "ECHO_TOLERANCES",
    "ERRORS",
    "FORWARDS",
    "FORWARDS_RECEIVED",
    "HANDOFFS",
    "HELD_LIFECYCLE",
    "HTTP_CONTINUATIONS",
    "HYDRATED",
    "INFLIGHT",
    "INPUT_ITEMS_AVOIDED",
    "LABEL_VALUES",
    "LANES",
    "LANES_FALLBACKS",
    "LISTENER_CLOSED",
    "LISTENER_CONNECTIONS",
    "MEMORY_BUDGET",
    "MEMORY_BYTES",
    "MEMORY_REFUSALS",
    "MEMORY_RSS",
    "MEMORY_WAITING",
    "MEMORY_WAITS",
    "OWNER_MISSES",
    "PASSTHROUGH",
    "POOL_WAIT",
    "LANE_WAITS",
    "REGISTRY",
    "REPLAYS",
    "REQUESTS",
    "REQUEST_BYTES",
    "RESEEDS",
    "SERVICE_TIERS",
    "SOCKETS",
    "SOCKET_AGE_AT_ROTATION",
    "SOCKET_CAP",
    "UPGRADE_REFUSALS",
    "UPSTREAM_BYTES_SENT",
    "UPSTREAM_DURATION",
    "WORKERS_READY",
    "WORKER_RESTARTS",
]

REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter(
    "upshift_requests",
    "Requests by route, mode and outcome.",
    ["route", "mode", "outcome"],
    registry=REGISTRY,
)
"""route: :class:`Route`; mode: :class:`Mode` (``forwarded``: sent on to the conversation's
owner, which counts it again with its own mode); outcome: :class:`RequestOutcome`."""

CONTINUATION_MISSES = Counter(
    "upshift_continuation_misses",
    "Full-history sends for a request that was not a continuation, by reason.",
    ["reason"],
    registry=REGISTRY,
)
"""reason: :class:`MissReason`."""

DROPPED_REASONING = Counter(
    "upshift_dropped_reasoning_echoes",
    "Echoes that left out reasoning items of the previous output (client-echo.md rule 6).",
    ["accepted"],
    registry=REGISTRY,
)
"""Deprecated: ``upshift_echo_tolerances_total{tolerance="reasoning"}`` counts the same.
accepted: true | false."""

ECHO_TOLERANCES = Counter(
    "upshift_echo_tolerances",
    "Echoes that differ from the previous output in a way the model sees (a left-out reasoning "
    "item or phase), by tolerance; accepted only with matching.tolerate.",
    ["tolerance", "accepted"],
    registry=REGISTRY,
)
"""tolerance: reasoning | phase (proxy.reasons.Tolerance); accepted: true | false."""

SERVICE_TIERS = Counter(
    "upshift_service_tiers",
    "Responses by the service tier the app asked for and the tier the upstream served.",
    ["requested", "served"],
    registry=REGISTRY,
)
"""requested, served: :class:`ServiceTier` (``ultrafast`` asked and ``default`` served is a fallback)."""

REPLAYS = Counter(
    "upshift_replays",
    "Turns replayed with full input before any byte reached the app, by cause.",
    ["cause"],
    registry=REGISTRY,
)
"""cause: :class:`ReplayCause`."""

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

PASSTHROUGH = Counter(
    "upshift_passthrough",
    "POST /v1/responses requests sent over plain HTTP instead of a WebSocket, by reason.",
    ["reason"],
    registry=REGISTRY,
)
"""reason: :class:`PassthroughReason` (a replay cause sent over HTTP is one of them)."""

SOCKETS = Gauge(
    "upshift_upstream_sockets",
    "Upstream WebSocket sockets by state.",
    ["state"],
    registry=REGISTRY,
)
"""state: open | busy | idle | connecting (open = busy + idle)."""

HYDRATED = Counter(
    "upshift_hydrated_continuations",
    "Continuations of a stored response whose lane was gone (the upstream hydrated it).",
    registry=REGISTRY,
)

RESEEDS = Counter(
    "upshift_reseeds",
    "store:false heads rebuilt on a new lane with a generate:false create when their socket was rotated.",
    ["outcome"],
    registry=REGISTRY,
)
"""outcome: ok | failed."""

LANES = Gauge(
    "upshift_upstream_lanes",
    "Upstream lanes (socket + stream_id) by state.",
    ["state"],
    registry=REGISTRY,
)
"""state: busy | idle | draining."""

HTTP_CONTINUATIONS = Counter(
    "upshift_http_continuations",
    "Stored conversations continued over plain HTTP (previous_response_id + new items) when no lane could be had.",
    ["sent"],
    registry=REGISTRY,
)
"""sent: continuation | full (previous_response_not_found: the full history went instead)."""

UPGRADE_REFUSALS = Counter(
    "upshift_upgrade_refusals",
    "Upstream WebSocket upgrades refused (cap: 429 or websocket_connection_limit_reached, which teach the socket cap).",
    ["refusal"],
    registry=REGISTRY,
)
"""refusal: cap | other."""

SOCKET_CAP = Gauge(
    "upshift_upstream_socket_cap",
    "Sockets per credential the upstream allows, as learned from refused upgrades (the lowest of the "
    "credentials that met a cap; 0: none did).",
    registry=REGISTRY,
)

LANES_FALLBACKS = Counter(
    "upshift_lane_fallbacks",
    "Times the upstream refused a named stream_id lane and the sidecar fell back to one lane per socket.",
    registry=REGISTRY,
)

POOL_WAIT = Histogram(
    "upshift_pool_wait_seconds",
    "Time requests waited for a free lane or an HTTP connection (counted in the added latency).",
    ["pool"],
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    registry=REGISTRY,
)
"""pool: lanes | http."""

LANE_WAITS = Counter(
    "upshift_lane_waits_total",
    "Turns whose lane was busy, by how their wait ended or why they did not wait (proxy/core/waiting.py).",
    ["outcome"],
    registry=REGISTRY,
)
"""outcome: a :class:`~proxy.reasons.WaitOutcome`."""

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

# -- the memory budget (proxy/intake/memory.py) -------------------------------------------------------

MEMORY_BUDGET = Gauge(
    "upshift_memory_budget_bytes",
    "The sidecar's memory budget (limits.memory_bytes, RSS).",
    registry=REGISTRY,
)

MEMORY_BYTES = Gauge(
    "upshift_memory_bytes",
    "Bytes of the memory budget in use, by kind.",
    ["kind"],
    registry=REGISTRY,
)
"""kind: in_flight (requests received, parsed, sent) | kept_bodies (heads' byte-comparison
copies) | heads (heads and their sockets) | baseline (the idle process, fixed at startup)."""

MEMORY_WAITING = Gauge(
    "upshift_memory_waiting_requests",
    "Requests whose body is not read yet because the memory budget is taken.",
    registry=REGISTRY,
)

MEMORY_WAITS = Counter(
    "upshift_memory_waits",
    "Requests that had to wait for memory before their body was read.",
    registry=REGISTRY,
)

MEMORY_REFUSALS = Counter(
    "upshift_memory_refusals",
    "Requests refused for memory (429/503 with retry-after), by reason.",
    ["reason"],
    registry=REGISTRY,
)
"""reason: :class:`MemoryRefusal`."""


def _rss() -> float:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return float(int(fh.read().split()[1]) * _PAGE)
    except (OSError, ValueError, IndexError):
        return 0.0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

MEMORY_RSS = Gauge(
    "upshift_memory_rss_bytes",
    "Resident set size of the sidecar process, read at scrape time.",
    registry=REGISTRY,
)
MEMORY_RSS.set_function(_rss)


# -- cluster: affinity, forwarding, workers, the hardened listener ---------------------------

FORWARDS = Counter(
    "upshift_forwards",
    "Requests forwarded (or meant to be) to the process owning their conversation, by level and outcome.",
    ["level", "outcome"],
    registry=REGISTRY,
)
"""level: replica | worker; outcome: :class:`ForwardOutcome`."""

FORWARDS_RECEIVED = Counter(
    "upshift_forwards_received",
    "Requests received from another process that forwarded them here, by level and marker check.",
    ["level", "verified"],
    registry=REGISTRY,
)
"""level: replica | worker; verified: true | false (bad signature) | unsigned (no secret)."""

OWNER_MISSES = Counter(
    "upshift_owner_misses",
    "Requests served by a process that does not own their conversation (a full send), by reason.",
    ["reason"],
    registry=REGISTRY,
)
"""reason: the :class:`ForwardOutcome` that made it local."""

HANDOFFS = Counter(
    "upshift_handoffs",
    "Client connections offered to the worker owning their request's conversation, by outcome.",
    ["outcome"],
    registry=REGISTRY,
)
"""outcome: adopted | ineligible | busy | refused | owner_down | timeout (proxy/ingress/handoff.py)."""

CLUSTER_PEERS = Gauge(
    "upshift_cluster_peers",
    "Peers known to this process (itself included), by level and state.",
    ["level", "state"],
    registry=REGISTRY,
)
"""level: replica | worker; state: up | down (skipped after a failure)."""

LISTENER_CONNECTIONS = Gauge(
    "upshift_listener_connections",
    "Open connections on the API listener.",
    registry=REGISTRY,
)

BODIES_ABORTED = Counter(
    "upshift_request_bodies_aborted",
    "Request bodies that never completed (the app went away, too slow, past the deadline), by reason.",
    ["reason"],
    registry=REGISTRY,
)
"""reason: :class:`BodyAbort`."""

BROWSER_REFUSALS = Counter(
    "upshift_browser_refusals",
    "Requests refused as a web page's (a foreign Origin or Host), by reason.",
    ["reason"],
    registry=REGISTRY,
)
"""reason: :class:`BrowserRefusal`."""

LISTENER_CLOSED = Counter(
    "upshift_listener_closed_connections",
    "Connections the API listener closed on its own, by reason.",
    ["reason"],
    registry=REGISTRY,
)
"""reason: header_timeout | max_connections | reaped_idle | reaped_stalled
(proxy.reasons.ListenerClose)."""

WORKER_RESTARTS = Counter(
    "upshift_worker_restarts",
    "Worker processes restarted by the supervisor after they exited.",
    registry=REGISTRY,
)

WORKERS_READY = Gauge(
    "upshift_workers_ready",
    "Worker processes answering their readiness probe (supervisor only).",
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
    "Always 1; the labels say which version runs on which event loop, in which build.",
    ["version", "loop", "python", "build"],
    registry=REGISTRY,
)
"""loop: uvloop | asyncio; build: pure | compiled (:mod:`proxy.build`)."""


# -- every label value, from the enums that name them ------------------------------------------


def _values(*enums: type[enum.StrEnum]) -> frozenset[str]:
    return frozenset(str(member) for kind in enums for member in kind)


_STATES = frozenset({"open", "busy", "idle", "connecting", "draining", "up", "down"})
"""upshift_upstream_sockets, upshift_upstream_lanes and upshift_cluster_peers."""

LABEL_VALUES: Mapping[str, frozenset[str]] = {
    "route": _values(Route),
    "mode": _values(Mode),
    "outcome": _values(RequestOutcome, ForwardOutcome, WaitOutcome) | {"failed"},  # upshift_reseeds_total: ok | failed
    "reason": _values(
        MissReason, PassthroughReason, ReplayCause, ForwardOutcome, MemoryRefusal, BodyAbort, BrowserRefusal
    )
    | _values(ListenerClose)
    | {"unknown"},
    "cause": _values(ReplayCause),
    "code": _values(ErrorCode),
    "state": _STATES,
    "pool": frozenset({"lanes", "http"}),
    "kind": _values(Kind),
    "transport": frozenset({"websocket", "http"}),
    "accepted": frozenset({"true", "false"}),
    "tolerance": _values(Tolerance),
    "refusal": frozenset({"cap", "other"}),  # upshift_upgrade_refusals_total
    "sent": frozenset({"continuation", "full"}),  # upshift_http_continuations_total
    "level": frozenset({"replica", "worker"}),
    "verified": frozenset({"true", "false", "unsigned"}),
    "worker": frozenset(str(i) for i in range(32)),
    "path": _values(HoldPath),
    "loop": frozenset({"uvloop", "asyncio"}),
    "build": _values(Build),
    "version": frozenset(),
    "python": frozenset(),
    "requested": _values(ServiceTier),  # upshift_service_tiers_total
    "served": _values(ServiceTier),
}
"""Every value each label of the sidecar's own metrics may take (``version`` and ``python`` of
``upshift_build_info`` are free: checked by shape). The ingress layer's
``upshift_handoffs_total{outcome}`` adds :class:`proxy.ingress.handoff.HandoffOutcome`."""
