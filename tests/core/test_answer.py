"""The choice of answer, as transcripts: feed a channel upstream events, then ask what the app gets."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.core.answer import Answer, AnswerKind, Attempt, decide, kept, status_outcome
from proxy.core.channel import Channel, Out
from proxy.core.retry import Replay
from proxy.errors import UpstreamClosed, UpstreamTimeout
from proxy.reasons import ReplayCause, RequestOutcome

ANCHOR = "resp_sidecar_anchor"
FIRST = Attempt(0, continuation=True, named=False, stream=True)
"""The first try of a continuation, streamed."""


def resp(status: str = "in_progress", **extra: Any) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "status": status, "previous_response_id": ANCHOR, **extra}


def ev(kind: str, seq: int, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "sequence_number": seq, **fields}


CREATED = [ev("response.created", 0, response=resp()), ev("response.in_progress", 1, response=resp())]
ITEM = {"id": "msg_1", "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}
OUTPUT = [ev("response.output_item.added", 2, output_index=0, item={**ITEM, "content": []})]
COMPLETED = ev("response.completed", 3, response=resp("completed", output=[ITEM]))
INCOMPLETE = ev("response.incomplete", 3, response=resp("incomplete", output=[ITEM]))
FAILED = ev("response.failed", 3, response=resp("failed", error={"code": "server_error", "message": "boom"}))
NOT_FOUND = ev(
    "error",
    2,
    status=400,
    error={"type": "invalid_request_error", "code": "previous_response_not_found", "message": "gone"},
)
RATE_LIMITED = ev(
    "error",
    2,
    status=429,
    error={"type": "tokens", "code": "rate_limit_exceeded", "message": "slow", "headers": {"retry-after": "2"}},
)


def fed(*events: dict[str, Any], prev: str | None = None) -> Channel:
    channel = Channel(prev)
    for event in events:
        channel.feed(orjson.dumps(event), event)
    return channel


def answer(channel: Channel, failure: Any = None, attempt: Attempt = FIRST, written: bool = False) -> Answer:
    found = decide(channel, failure, attempt, written)
    assert isinstance(found, Answer), found
    return found


def types(outs: tuple[Out, ...]) -> list[str]:
    return [o.type for o in outs]


# -- the response ended after output: the stream ends, or the object is the body ----------


def test_a_completed_stream_just_ends() -> None:
    got = answer(fed(*CREATED, *OUTPUT, COMPLETED), written=True)
    assert got == Answer(AnswerKind.SSE_END)  # the events went out as they came
    assert got.outcome is None  # the status decides: ok


@pytest.mark.parametrize("terminal", [COMPLETED, INCOMPLETE])
def test_stream_false_gets_the_response_object(terminal: dict[str, Any]) -> None:
    channel = fed(*CREATED, *OUTPUT, terminal)
    got = answer(channel, attempt=Attempt(0, continuation=True, named=False, stream=False))
    assert (got.kind, got.status, got.outcome) == (AnswerKind.JSON, 200, None)
    assert got.body is channel.response and got.body is not None and got.body["previous_response_id"] is None


def test_a_failure_after_output_is_an_upstream_error_that_ends_the_stream() -> None:
    got = answer(fed(*CREATED, *OUTPUT, FAILED), written=True)
    assert (got.kind, got.outcome, got.events) == (AnswerKind.SSE_END, RequestOutcome.UPSTREAM_ERROR, ())


def test_stream_false_failure_after_output_is_a_500_with_the_four_key_body() -> None:
    got = answer(fed(*CREATED, *OUTPUT, FAILED), attempt=Attempt(0, True, False, stream=False))
    assert (got.kind, got.status, got.outcome) == (AnswerKind.HTTP_ERROR, 500, RequestOutcome.UPSTREAM_ERROR)
    assert got.body == {"error": {"message": "boom", "type": "server_error", "param": None, "code": "server_error"}}


# -- nothing reached the app: replay, or the error as HTTP would have said it -------------


def test_not_found_before_output_is_replayed_on_the_same_socket() -> None:
    got = decide(fed(*CREATED, NOT_FOUND), None, FIRST, False)
    assert got == Replay(ReplayCause.PREVIOUS_RESPONSE_NOT_FOUND, new_socket=False)


def test_not_found_of_the_apps_own_anchor_is_its_http_error() -> None:
    app = Attempt(0, continuation=False, named=False, stream=True)
    got = answer(fed(NOT_FOUND), attempt=app)
    assert (got.kind, got.status, got.outcome) == (AnswerKind.HTTP_ERROR, 400, RequestOutcome.CLIENT_ERROR)
    assert got.body is not None and got.body["error"]["code"] == "previous_response_not_found"


def test_an_error_before_the_response_started_keeps_its_status_and_rate_limit_headers() -> None:
    got = answer(fed(RATE_LIMITED))
    assert (got.kind, got.status, got.outcome) == (AnswerKind.HTTP_ERROR, 429, RequestOutcome.CLIENT_ERROR)
    assert got.headers == {"retry-after": "2"} and got.error is None


def test_an_error_after_the_held_prefix_releases_it_with_the_error_event() -> None:
    channel = fed(*CREATED, RATE_LIMITED)
    got = answer(channel)
    assert (got.kind, got.outcome) == (AnswerKind.SSE_END, RequestOutcome.UPSTREAM_ERROR)
    assert types(got.events) == ["response.created", "response.in_progress", "error"]
    assert got.events[-1].obj is not None and got.events[-1].obj["sequence_number"] == 2
    assert channel.released  # the held events were given to the answer: they are not held twice


def test_a_replayed_attempt_surfaces_what_it_got() -> None:
    got = answer(fed(*CREATED, NOT_FOUND), attempt=Attempt(1, continuation=False, named=False, stream=True))
    assert got.kind is AnswerKind.SSE_END and types(got.events)[-1] == "error"


# -- the socket failed: replay before output, the sidecar's own error after ---------------


def test_a_socket_closed_before_output_is_replayed_on_a_new_socket() -> None:
    got = decide(fed(*CREATED), UpstreamClosed("gone"), FIRST, False)
    assert got == Replay(ReplayCause.CLOSED_BEFORE_FIRST_EVENT, new_socket=True)


def test_a_1009_close_goes_over_http() -> None:
    got = decide(fed(), UpstreamClosed("too big", close_code=1009), FIRST, False)
    assert isinstance(got, Replay) and got.over_http and got.cause is ReplayCause.FRAME_TOO_BIG


def test_a_timeout_before_anything_was_written_is_its_http_error() -> None:
    failure = UpstreamTimeout("silent")
    got = answer(fed(*CREATED), failure)
    assert (got.kind, got.status, got.outcome) == (AnswerKind.HTTP_ERROR, failure.status, RequestOutcome.UPSTREAM_ERROR)
    assert got.body == failure.body() and got.error == failure.code


def test_a_socket_lost_after_output_is_one_error_event_of_the_sidecars_own() -> None:
    failure = UpstreamClosed("gone")
    got = answer(fed(*CREATED, *OUTPUT), failure, written=True)
    assert (got.kind, got.outcome, got.error) == (AnswerKind.ERROR_EVENT, RequestOutcome.UPSTREAM_ERROR, failure.code)
    (event,) = got.events
    assert event.obj is not None and event.obj["sequence_number"] == 3  # right after the last one seen
    assert event.obj["error"]["code"] == failure.code


def test_a_socket_lost_after_output_of_stream_false_is_its_http_error() -> None:
    failure = UpstreamClosed("gone")
    got = answer(fed(*CREATED, *OUTPUT), failure, attempt=Attempt(0, True, False, stream=False))
    assert (got.kind, got.status) == (AnswerKind.HTTP_ERROR, failure.status)


# -- what the lane keeps --------------------------------------------------------------------


def test_only_a_completed_response_becomes_the_head() -> None:
    done = kept(fed(*CREATED, *OUTPUT, COMPLETED))
    assert done.response is not None and done.chainable is None and not done.retire
    cut = kept(fed(*CREATED, *OUTPUT, INCOMPLETE))
    assert cut.response is None and cut.chainable == "resp_1"  # the app may still chain it
    assert kept(fed(*CREATED)).chainable is None


def test_the_age_limit_retires_the_socket() -> None:
    aged = ev("error", 2, status=400, error={"code": "websocket_connection_limit_reached", "message": "limit"})
    assert kept(fed(aged)).retire


def test_status_outcomes() -> None:
    assert [status_outcome(s) for s in (200, 404, 503)] == [
        RequestOutcome.OK,
        RequestOutcome.CLIENT_ERROR,
        RequestOutcome.UPSTREAM_ERROR,
    ]
