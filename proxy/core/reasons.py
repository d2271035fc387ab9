"""Every reason, cause and code the sidecar reports, as values.

The README tables, ``config.yaml`` comments and the metric label sets are checked exactly against
these enums (``tests/test_reasons.py``), so a reason passed around in a variable can never be
missing from the docs. Values are the wire names (metric labels, access-log fields).
"""

from __future__ import annotations

import enum

__all__ = ["ErrorCode", "Mode", "MissReason", "Outcome", "OwnerVerdict", "PassthroughReason", "ReplayCause", "Route"]


class MissReason(enum.StrEnum):
    """Why a request of a conversation went upstream with its full input (``mode="full"``)."""

    NO_HEAD = "no_head"
    """Nothing to continue (first turn, head expired or its lane gone with ``store: false``)."""
    DIVERGED = "diverged"
    """The history differs from the known head or from the echo of its output."""
    SETTINGS_CHANGED = "settings_changed"
    """The history matches but a non-input field differs."""
    HEAD_BUSY = "head_busy"
    """The matching lane is busy with another response (parallel branches)."""
    DROPPED_REASONING = "dropped_reasoning"
    """The echo leaves out reasoning items and that is not allowed."""
    RETRY = "retry"
    """The request repeats the previous turn's input (a client retry)."""
    NO_NEW_ITEMS = "no_new_items"
    """The echo is there but nothing new follows it."""
    APP_CHAINED = "app_chained"
    """The app sets its own ``previous_response_id``."""
    POOL_FULL = "pool_full"
    """No lane could be had within the limits and the wait bound: sent over HTTP."""


class ReplayCause(enum.StrEnum):
    """Why a turn was replayed once with the app's full input before any byte reached the app."""

    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
    CONNECTION_LIMIT = "connection_limit"
    CLOSED_BEFORE_FIRST_EVENT = "closed_before_first_event"
    FRAME_TOO_BIG = "frame_too_big"
    LANES_UNSUPPORTED = "lanes_unsupported"
    """The upstream refused a named ``stream_id`` lane; lanes are off for it from now on."""
    STREAM_LIMIT = "stream_limit"
    """``websocket_stream_limit_reached``: the socket is retired, the turn goes elsewhere."""


class PassthroughReason(enum.StrEnum):
    """Why a ``POST /v1/responses`` went over plain HTTP (``mode="passthrough"``)."""

    MODE_HTTP = "mode_http"
    BACKGROUND = "background"
    CONVERSATION = "conversation"
    WS_ONLY_FIELD = "ws_only_field"
    OVERSIZE = "oversize"
    UPGRADE_REFUSED = "upgrade_refused"
    """No socket of the identity is open and opening one is held off after a refusal."""
    WS_UNAVAILABLE = "ws_unavailable"
    """A new upstream socket could not be opened and no other lane was free."""
    POOL_FULL = "pool_full"
    """Every lane the identity may have stayed busy for ``pool.wait_seconds``."""
    FRAME_TOO_BIG = "frame_too_big"
    """The upstream closed the socket with 1009 on this frame: replayed over HTTP."""


class ErrorCode(enum.StrEnum):
    """``upshift_errors_total{code}``: errors the sidecar itself answered or surfaced."""

    INVALID_REQUEST = "invalid_request_error"
    REQUEST_TOO_LARGE = "request_too_large"
    UNSUPPORTED = "unsupported"
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
    RESPONSE_NOT_FOUND = "response_not_found"
    """A route named a response id of another identity (or, behind an injected key, of no
    known identity): answered 404 as the upstream answers an unknown id."""
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_REFUSED = "upstream_refused"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_CLOSED = "upstream_closed"
    UPSTREAM_PROTOCOL = "upstream_protocol"
    MEMORY_BUSY = "memory_busy"
    """The memory budget stayed taken for ``limits.memory_wait_seconds``: 429 + ``retry-after``."""
    MEMORY_TOO_LARGE = "memory_too_large"
    """The request cannot fit even into an empty memory budget: 503."""
    SHUTTING_DOWN = "shutting_down"
    INTERNAL_ERROR = "internal_error"


class OwnerVerdict(enum.StrEnum):
    """Whose a response id is, as far as the sidecar knows (``proxy.core.owners``)."""

    OWN = "own"
    """Created by the asking identity."""
    FOREIGN = "foreign"
    """Created by another identity: refused as the upstream refuses an unknown id."""
    UNKNOWN = "unknown"
    """Never seen (or forgotten): refused behind an injected key, forwarded otherwise."""


class Route(enum.StrEnum):
    """``upshift_requests_total{route}``."""

    RESPONSES = "responses"
    RESPONSES_WS = "responses_ws"
    OTHER = "other"


class Mode(enum.StrEnum):
    """``upshift_requests_total{mode}`` and the ``x-upshift-mode`` header."""

    CONTINUATION = "continuation"
    FULL = "full"
    PASSTHROUGH = "passthrough"
    RELAY = "relay"


class Outcome(enum.StrEnum):
    """``upshift_requests_total{outcome}``."""

    OK = "ok"
    CLIENT_ERROR = "client_error"
    UPSTREAM_ERROR = "upstream_error"
    PROXY_ERROR = "proxy_error"
    CANCELLED = "cancelled"
