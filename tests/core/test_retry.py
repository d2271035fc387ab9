"""Replay or surface: the pure recovery policy, as tables."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.retry import (
    Replay,
    Surface,
    SurfaceReason,
    classify,
    error_fields,
    is_connection_limit,
    is_not_found,
)
from proxy.errors import UpstreamClosed, UpstreamProtocolError, UpstreamTimeout
from proxy.reasons import ReplayCause

CLOSED = ReplayCause.CLOSED_BEFORE_FIRST_EVENT
NOT_FOUND_MSG = "Previous response with id 'resp_abc' not found."

NOT_FOUND_SHAPES: list[tuple[str, dict[str, Any]]] = [
    (
        "nested",
        {
            "type": "error",
            "status": 400,
            "error": {
                "type": "invalid_request_error",
                "code": "previous_response_not_found",
                "message": NOT_FOUND_MSG,
                "param": "previous_response_id",
            },
        },
    ),
    ("no_type", {"type": "error", "status": 400, "error": {"code": "previous_response_not_found", "message": "x"}}),
    ("flat", {"type": "error", "code": "previous_response_not_found", "message": NOT_FOUND_MSG, "param": None}),
    ("top_level", {"type": "error", "status": 400, "code": "previous_response_not_found", "message": "m"}),
    (
        "response_failed",
        {
            "type": "response.failed",
            "response": {"status": "failed", "error": {"code": "previous_response_not_found", "message": "m"}},
        },
    ),
    (
        "parameterless",
        {"type": "error", "status": 400, "error": {"code": None, "message": "Invalid `previous_response_id`."}},
    ),
    ("renamed", {"type": "error", "error": {"code": "codex_previous_response_stale", "message": "stale"}}),
    ("message_only", {"type": "error", "error": {"message": NOT_FOUND_MSG}}),
    ("param_only", {"type": "error", "error": {"code": "invalid_value", "param": "previous_response_id"}}),
]

LIMIT = {
    "type": "error",
    "status": 400,
    "error": {
        "type": "invalid_request_error",
        "code": "websocket_connection_limit_reached",
        "message": "Responses websocket connection limit reached (60 minutes). Create a new websocket connection.",
    },
}
RATE_LIMIT = {"type": "error", "status": 429, "error": {"type": "requests", "code": "rate_limit_exceeded"}}
SERVER_FAILED = {"type": "response.failed", "response": {"error": {"code": "server_error", "message": "boom"}}}


@pytest.mark.parametrize(("name", "event"), NOT_FOUND_SHAPES, ids=[n for n, _ in NOT_FOUND_SHAPES])
def test_not_found_in_every_shape(name: str, event: dict[str, Any]) -> None:
    assert is_not_found(event)
    assert not is_connection_limit(event)
    assert classify(event, False, 0) == Replay(ReplayCause.PREVIOUS_RESPONSE_NOT_FOUND, new_socket=False)


@pytest.mark.parametrize("event", [LIMIT, RATE_LIMIT, SERVER_FAILED], ids=["limit", "429", "failed"])
def test_other_errors_are_not_not_found(event: dict[str, Any]) -> None:
    assert not is_not_found(event)


def test_connection_limit_flat_and_by_message() -> None:
    assert is_connection_limit({"type": "error", "code": "websocket_connection_limit_reached"})
    assert is_connection_limit({"type": "error", "error": {"message": "Responses websocket connection limit reached"}})


CASES: list[tuple[str, Any, bool, int, bool, Replay | Surface]] = [
    ("not_found", NOT_FOUND_SHAPES[0][1], False, 0, True, Replay(ReplayCause.PREVIOUS_RESPONSE_NOT_FOUND, False)),
    ("not_found-app-anchor", NOT_FOUND_SHAPES[0][1], False, 0, False, Surface(SurfaceReason("app_anchor"))),
    ("not_found-emitted", NOT_FOUND_SHAPES[0][1], True, 0, True, Surface(SurfaceReason("emitted"))),
    ("not_found-second", NOT_FOUND_SHAPES[0][1], False, 1, True, Surface(SurfaceReason("attempted"))),
    ("limit", LIMIT, False, 0, True, Replay(ReplayCause.CONNECTION_LIMIT, True)),
    ("limit-full-send", LIMIT, False, 0, False, Replay(ReplayCause.CONNECTION_LIMIT, True)),
    ("limit-second", LIMIT, False, 1, False, Surface(SurfaceReason("attempted"))),
    (
        "closed",
        UpstreamClosed("x", close_code=1006),
        False,
        0,
        True,
        Replay(ReplayCause.CLOSED_BEFORE_FIRST_EVENT, True),
    ),
    ("closed-emitted", UpstreamClosed("x", close_code=1011), True, 0, True, Surface(SurfaceReason("emitted"))),
    ("closed-second", UpstreamClosed("x"), False, 1, False, Surface(SurfaceReason("attempted"))),
    ("timeout", UpstreamTimeout("x"), False, 0, True, Surface(SurfaceReason("not_retryable"))),
    ("protocol", UpstreamProtocolError("x"), False, 0, True, Surface(SurfaceReason("not_retryable"))),
    ("429", RATE_LIMIT, False, 0, True, Surface(SurfaceReason("not_retryable"))),
    ("failed", SERVER_FAILED, False, 0, True, Surface(SurfaceReason("not_retryable"))),
]


@pytest.mark.parametrize(
    ("name", "what", "emitted", "attempt", "continuation", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_classify(
    name: str, what: Any, emitted: bool, attempt: int, continuation: bool, expected: Replay | Surface
) -> None:
    assert classify(what, emitted, attempt, continuation=continuation) == expected


def test_error_fields_shapes() -> None:
    assert error_fields({"error": {"code": "c", "message": "m", "param": "p"}}) == ("c", "m", "p")
    assert error_fields({"code": "c", "message": "m"}) == ("c", "m", None)
    assert error_fields({"response": {"error": {"code": "c"}}}) == ("c", None, None)
    assert error_fields({"error": {"code": 5, "message": None}}) == (None, None, None)


def test_message_too_big_goes_over_http_even_on_a_replay() -> None:
    too_big = UpstreamClosed("x", close_code=1009)
    assert classify(too_big, False, 0) == Replay(ReplayCause.FRAME_TOO_BIG, new_socket=False, over_http=True)
    assert classify(too_big, False, 1) == Replay(ReplayCause.FRAME_TOO_BIG, new_socket=False, over_http=True)
    assert classify(too_big, True, 0) == Surface(SurfaceReason("emitted"))
