"""Every reason, cause and code the sidecar reports, as values.

The reason tables of docs/operations.md and the label values of the generated metrics reference
(docs/reference/metrics.md) are checked exactly against these enums (``tests/test_reasons.py``),
so a reason passed around in a variable can never be missing from the docs. Values are the wire
names (metric labels, access-log fields).
"""

from __future__ import annotations

import enum
from typing import TypeAlias

__all__ = [
    "BodyAbort",
    "Build",
    "BrowserRefusal",
    "ErrorCode",
    "ForwardOutcome",
    "ForwardReason",
    "Hit",
    "ListenerClose",
    "MemoryRefusal",
    "MissReason",
    "Mode",
    "ObjectKind",
    "OwnerVerdict",
    "PassthroughReason",
    "Reason",
    "ReplayCause",
    "RequestOutcome",
    "Route",
    "Tolerance",
    "WaitOutcome",
]


class Build(enum.StrEnum):
    """Which build runs (``upshift_build_info{build}``, ``--version``): see :mod:`proxy.build`."""

    PURE = "pure"
    COMPILED = "compiled"


class Hit(enum.StrEnum):
    """The matcher's verdict when the request continues a head (``mode="continuation"``)."""

    CONTINUATION = "continuation"


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
    DROPPED_PHASE = "dropped_phase"
    """The echo leaves out the ``phase`` of an assistant message and that is not allowed."""
    RETRY = "retry"
    """The request repeats the previous turn's input (a client retry)."""
    NO_NEW_ITEMS = "no_new_items"
    """The echo is there but nothing new follows it."""
    APP_CHAINED = "app_chained"
    """The app sets its own ``previous_response_id``."""
    PRUNED_AT_COMPACTION = "pruned_at_compaction"
    """The history starts at a ``compaction`` item (pruned after compaction) that no known head
    produced, or the echo after it differs from that head's output."""
    POOL_FULL = "pool_full"
    """No lane could be had within the limits and the wait bound: sent over HTTP."""
    WAIT_NOT_WORTH_IT = "wait_not_worth_it"
    """Its head's lane was busy and expected to free later than the continuation would save
    (or it waited that long and the lane was still busy): sent in full at once."""


class ObjectKind(enum.StrEnum):
    """Stored objects other than responses an app may create, each owned by its tenant behind an
    injected key unless ``identity.shared_objects`` lists it."""

    CONVERSATIONS = "conversations"
    ITEMS = "items"
    """Items an ``item_reference`` input names: its tenant's when the sidecar saw it created for
    the caller (an output item, an item added to its conversation), else refused behind an
    injected key unless shared."""
    FILES = "files"
    VECTOR_STORES = "vector_stores"
    CHAT_COMPLETIONS = "chat_completions"
    BATCHES = "batches"
    CONTAINERS = "containers"
    UPLOADS = "uploads"
    UNTRACKED = "untracked"
    """The ``/v1`` routes the sidecar neither owner-checks nor knows to name no stored object
    (``/v1/fine_tuning/...``, ``/v1/evals/...``, ``/v1/assistants/...``, ``/v1/threads/...``,
    ``/v1/videos/...``, ...): refused behind an injected key (403 ``not_shared``) unless listed,
    when they are forwarded unchecked and every tenant sees every other's objects on them."""


class Tolerance(enum.StrEnum):
    """``matching.tolerate`` values and ``upshift_echo_tolerances_total{tolerance}``: echoes that
    differ from the previous output in a way the model sees, accepted only when opted in."""

    REASONING = "reasoning"
    """The echo leaves out reasoning items of the previous output (client-echo.md rule 6)."""
    PHASE = "phase"
    """The echo leaves out the ``phase`` of an assistant message that had one."""


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
    WAIT_NOT_WORTH_IT = "wait_not_worth_it"
    """No lane was free and waiting for one was expected to cost more than it saves: sent now."""
    FRAME_TOO_BIG = "frame_too_big"
    """The upstream closed the socket with 1009 on this frame: replayed over HTTP."""


class WaitOutcome(enum.StrEnum):
    """How a turn's wait for a lane ended (the access line's ``wait``)."""

    LANE = "lane"
    """It waited and got a lane."""
    WAIT_NOT_WORTH_IT = "wait_not_worth_it"
    """Its lane was busy and expected to free later than what the lane saves: it went now."""
    WAIT_EXPIRED = "wait_expired"
    """It waited as long as its lane was expected to take to free; the lane was still busy: it went now."""


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
    """The drain's grace ran out with the stream in flight: it ends with one ``error`` event
    (type ``server_error``) instead of a truncated body; retry the request."""
    INTERNAL_ERROR = "internal_error"
    """A bug of the sidecar: 500, the access line holds the details."""
    REQUEST_TIMEOUT = "request_timeout"
    """The body did not arrive within ``limits.body_timeout_seconds`` or kept below the minimum rate: 408."""
    UNSUPPORTED_CONTENT_ENCODING = "unsupported_content_encoding"
    """A request body in a ``Content-Encoding`` other than gzip or deflate: 415."""
    ORIGIN_NOT_ALLOWED = "origin_not_allowed"
    """A browser request (``Origin``) from an origin not in ``listener.allowed_origins``: 403."""
    HOST_NOT_ALLOWED = "host_not_allowed"
    """A ``Host`` this listener does not answer to (DNS rebinding): 403."""
    OBJECT_NOT_FOUND = "object_not_found"
    """A route or body named a stored object (a conversation, file, ...) of another identity (or,
    behind an injected key, of no known identity): answered 404 as for an unknown id."""
    NOT_SHARED = "not_shared"
    """Behind an injected key, a list of every tenant's objects, or a route of objects the sidecar
    does not track, that ``identity.shared_objects`` does not open: 403."""


class BodyAbort(enum.StrEnum):
    """``upshift_request_bodies_aborted_total{reason}``: request bodies that never completed."""

    CLIENT_GONE = "client_gone"
    """The app closed its connection mid-body (logged as one INFO line)."""
    TIMEOUT = "timeout"
    """Not complete within ``limits.body_timeout_seconds``: 408 and close."""
    TOO_SLOW = "too_slow"
    """Below ``limits.body_min_bytes_per_second`` after the grace, or silent for longer than it: 408 and close."""


class BrowserRefusal(enum.StrEnum):
    """``upshift_browser_refusals_total{reason}``: requests refused as coming from a web page."""

    ORIGIN = "origin"
    """``Origin`` not in ``listener.allowed_origins``."""
    HOST = "host"
    """``Host`` not the listen address, ``localhost:PORT`` or in ``listener.allowed_hosts``."""


class MemoryRefusal(enum.StrEnum):
    """``upshift_memory_refusals_total{reason}``: why a request was refused for memory."""

    TOO_LARGE = "too_large"
    """It would not fit even into an empty budget (503 ``memory_too_large``)."""
    WAIT_TIMEOUT = "wait_timeout"
    """The budget stayed taken for ``limits.memory_wait_seconds`` (429 ``memory_busy``)."""


class OwnerVerdict(enum.StrEnum):
    """Whose a response id is, as far as the sidecar knows (``proxy.core.creators``)."""

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
    FORWARDED = "forwarded"
    """Answered by the process owning the conversation (which counts it again, with its mode)."""


class RequestOutcome(enum.StrEnum):
    """``upshift_requests_total{outcome}``: how the sidecar's answer to one request went."""

    OK = "ok"
    CLIENT_ERROR = "client_error"
    UPSTREAM_ERROR = "upstream_error"
    PROXY_ERROR = "proxy_error"
    CANCELLED = "cancelled"


class ForwardReason(enum.StrEnum):
    """Why a request went to another process (``mode="forwarded"``): how it got there."""

    HANDOFF = "handoff"
    """The app's connection itself was handed to the owning worker."""
    REPLICA = "replica"
    """The bytes were forwarded to the replica owning the conversation."""
    WORKER = "worker"
    """The bytes were forwarded to the worker owning the conversation."""


class ForwardOutcome(enum.StrEnum):
    """How a forward ended (``upshift_forwards_total{outcome}``, ``upshift_owner_misses_total{reason}``)."""

    OK = "ok"
    CUT = "cut"
    """The owner's answer started, then its connection broke."""
    OWNER_DOWN = "owner_down"
    """Connecting failed (refused, unreachable, not one of ours): served locally, owner skipped."""
    CONNECT_TIMEOUT = "connect_timeout"
    """No connection or no ``100 Continue`` within the connect timeout."""
    BUSY = "busy"
    """The per-peer limit stayed full for the connect timeout."""
    REFUSED = "refused"
    """A 5xx not from an upshift request path, the owner's listener was full, or the owner
    refused the forward as unauthenticated (403)."""
    FAILED_BEFORE_ANSWER = "failed_before_answer"
    """The owner accepted the request, then its connection broke before any answer."""
    UNPROVEN = "unproven"
    """The peer could not prove it holds the cluster secret: it is sent nothing."""


class ListenerClose(enum.StrEnum):
    """Why the listener closed a connection on its own (``upshift_listener_closed_connections_total{reason}``)."""

    HEADER_TIMEOUT = "header_timeout"
    """No complete request headers within ``listener.header_timeout_seconds``."""
    MAX_CONNECTIONS = "max_connections"
    """Refused (503) at ``listener.max_connections``: nothing could make room."""
    REAPED_IDLE = "reaped_idle"
    """An idle keep-alive connection closed to admit a new one at the limit."""
    REAPED_STALLED = "reaped_stalled"
    """A connection stalled in its headers closed to admit a new one at the limit."""


Reason: TypeAlias = Hit | MissReason | PassthroughReason | ReplayCause | ForwardReason
"""Everything the access log's ``reason`` may say (``""`` when there is nothing to say)."""


class ServiceTier(enum.StrEnum):
    """``service_tier`` as a bounded label (``upshift_service_tiers_total``, the access line): the
    tiers the API documents, anything else ``other``; ``none`` when the field is absent."""

    AUTO = "auto"
    DEFAULT = "default"
    FLEX = "flex"
    SCALE = "scale"
    PRIORITY = "priority"
    FAST = "fast"
    ULTRAFAST = "ultrafast"
    OTHER = "other"
    NONE = "none"

    @classmethod
    def of(cls, value: object) -> ServiceTier:
        """The label of a ``service_tier`` value as the app or the upstream sent it."""
        if value is None:
            return cls.NONE
        try:
            return cls(value) if isinstance(value, str) and value not in ("other", "none") else cls.OTHER
        except ValueError:
            return cls.OTHER
