"""Whether a failed turn is replayed with the app's full input, or surfaced to the app.

Pure policy (protocol.md §4.1.6, pitfalls 4, 5, 9, 21). A replay is always the app's own body,
unreshaped, without a sidecar anchor, and happens at most once per turn and only while nothing of
the response has reached the app: a replay after output would duplicate text and tool effects.

Causes:
- ``previous_response_not_found`` in any shape (the upstream lost the anchor): replay, the same
  socket is fine. Only when the sidecar itself chose the anchor: the app's own body would fail
  the same way again.
- ``websocket_connection_limit_reached`` (the socket aged out): replay on a new socket.
- The socket closed before the response reached the app: replay on a new socket; a 1009 close
  ("message too big") is not retryable as is (pitfall 16), so that turn goes over plain HTTP.
- A named lane refused by the upstream (``invalid_stream_id``, an unknown ``stream_id``
  parameter): replay on a default lane; ``websocket_stream_limit_reached``: replay elsewhere.
- Anything else (timeouts included: delivery is ambiguous) surfaces.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.errors import UpstreamClosed
from proxy.reasons import ReplayCause

__all__ = [
    "Replay",
    "Surface",
    "SurfaceReason",
    "classify",
    "error_fields",
    "is_connection_limit",
    "is_lane_refusal",
    "is_not_found",
    "is_stream_limit",
]

_MESSAGE_TOO_BIG = 1009

_STALE_WORDS = ("not_found", "stale", "missing", "expired", "invalid")


@dataclass(frozen=True, slots=True)
class Replay:
    """Send the turn again with the app's full input."""

    cause: ReplayCause
    new_socket: bool
    """Whether the replay needs a fresh socket (the old one is closed or aged out)."""
    over_http: bool = False
    """Replay over plain HTTP instead (the frame itself was refused)."""


class SurfaceReason(enum.StrEnum):
    """Why a failed turn is not replayed."""

    EMITTED = "emitted"
    """Something of the response reached the app: a replay would duplicate it."""
    ATTEMPTED = "attempted"
    """The turn was replayed already."""
    APP_ANCHOR = "app_anchor"
    """The app chose the ``previous_response_id`` itself: its own body would fail the same way."""
    NOT_RETRYABLE = "not_retryable"
    """Anything else (timeouts included: delivery is ambiguous)."""


@dataclass(frozen=True, slots=True)
class Surface:
    """Give the app the failure as it is."""

    reason: SurfaceReason
    """Why there is no replay."""


def error_fields(event: Mapping[str, Any]) -> tuple[str | None, str | None, str | None]:
    """``(code, message, param)`` of an upstream error in any shape.

    Handles the nested ``error`` event, the flat one (``code`` at top level), and
    ``response.failed`` / ``response.done`` with ``response.error``.
    """
    inner: Any = event.get("error")
    if not isinstance(inner, Mapping):
        response = event.get("response")
        inner = response.get("error") if isinstance(response, Mapping) else None
    if not isinstance(inner, Mapping):
        inner = event  # the flat shape
    code, message, param = inner.get("code"), inner.get("message"), inner.get("param")
    return (
        code if isinstance(code, str) else None,
        message if isinstance(message, str) else None,
        param if isinstance(param, str) else None,
    )


def is_not_found(event: Mapping[str, Any]) -> bool:
    """Whether ``event`` says the upstream does not know the ``previous_response_id``.

    Generous on purpose: a false positive only costs a full replay, which is what the app sent.
    """
    code, message, param = error_fields(event)
    if code == "previous_response_not_found":
        return True
    if code and "previous_response" in code and any(w in code for w in _STALE_WORDS):
        return True  # renames such as codex_previous_response_stale
    if param == "previous_response_id":
        return True
    lowered = (message or "").lower()
    if "invalid `previous_response_id`" in lowered:
        return True  # the parameterless message some backends send
    return "previous response" in lowered and "not found" in lowered


def is_connection_limit(event: Mapping[str, Any]) -> bool:
    """Whether ``event`` is ``websocket_connection_limit_reached`` (nested or flat)."""
    code, message, _ = error_fields(event)
    if code == "websocket_connection_limit_reached":
        return True
    return code is None and "websocket connection limit reached" in (message or "").lower()


def is_lane_refusal(event: Mapping[str, Any]) -> bool:
    """Whether ``event`` refuses the ``stream_id`` itself (an upstream without lanes)."""
    code, _, param = error_fields(event)
    return code == "invalid_stream_id" or (param == "stream_id" and code != "websocket_stream_limit_reached")


def is_stream_limit(event: Mapping[str, Any]) -> bool:
    """Whether ``event`` is ``websocket_stream_limit_reached``."""
    return error_fields(event)[0] == "websocket_stream_limit_reached"


def classify(
    event_or_failure: Mapping[str, Any] | BaseException,
    emitted: bool,
    attempt: int,
    *,
    continuation: bool = True,
    named: bool = False,
) -> Replay | Surface:
    """Decide what to do with a turn that did not complete.

    Args:
        event_or_failure: The upstream ``error`` / ``response.failed`` event, or the exception
            the socket raised (mapped to :mod:`proxy.errors` already).
        emitted: Whether anything of this response reached the app (or, for ``stream: false``,
            would have: output events were received).
        attempt: 0 for the first try, 1 for the replay.
        continuation: Whether the failed frame carried an anchor the sidecar chose.
        named: Whether the frame went on a named ``stream_id`` lane.

    Returns:
        :class:`Replay` or :class:`Surface`.
    """
    if emitted:
        return Surface(SurfaceReason.EMITTED)
    if isinstance(event_or_failure, UpstreamClosed) and event_or_failure.close_code == _MESSAGE_TOO_BIG:
        # The same frame would be refused again; HTTP has no frame limit. Final, so no loop.
        return Replay(ReplayCause.FRAME_TOO_BIG, new_socket=False, over_http=True)
    if named and attempt < 2 and not isinstance(event_or_failure, BaseException):
        # Lane refusals are the sidecar's own doing: replay even a second time (the replay
        # then goes on a lane the upstream takes), but never a third.
        if is_lane_refusal(event_or_failure):
            return Replay(ReplayCause.LANES_UNSUPPORTED, new_socket=False)
        if is_stream_limit(event_or_failure):
            return Replay(ReplayCause.STREAM_LIMIT, new_socket=False)
    if attempt > 0:
        return Surface(SurfaceReason.ATTEMPTED)
    if isinstance(event_or_failure, BaseException):
        if isinstance(event_or_failure, UpstreamClosed):
            return Replay(ReplayCause.CLOSED_BEFORE_FIRST_EVENT, new_socket=True)
        return Surface(SurfaceReason.NOT_RETRYABLE)
    if is_connection_limit(event_or_failure):
        return Replay(ReplayCause.CONNECTION_LIMIT, new_socket=True)
    if is_not_found(event_or_failure):
        if not continuation:
            return Surface(SurfaceReason.APP_ANCHOR)
        return Replay(ReplayCause.PREVIOUS_RESPONSE_NOT_FOUND, new_socket=False)
    return Surface(SurfaceReason.NOT_RETRYABLE)
