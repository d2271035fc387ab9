"""The one-response state machine, as transcripts: feed upstream events, check what comes out."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from proxy.core.channel import Channel, Ending, HoldPath, HttpError, Out, nested_error
from proxy.errors import UpstreamProtocolError

ANCHOR = "resp_sidecar_anchor"


def resp(status: str = "in_progress", prev: str | None = ANCHOR, **extra: Any) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "status": status, "previous_response_id": prev, **extra}


def ev(kind: str, seq: int, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "sequence_number": seq, **fields}


def feed(channel: Channel, events: list[dict[str, Any]], now: float | None = None) -> list[Out]:
    out: list[Out] = []
    for event in events:
        out += channel.feed(orjson.dumps(event), event, now)
    return out


def text_turn(prev: str | None = ANCHOR) -> list[dict[str, Any]]:
    item = {"id": "msg_1", "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}
    return [
        ev("response.created", 0, response=resp(prev=prev)),
        ev("response.in_progress", 1, response=resp(prev=prev)),
        ev("response.output_item.added", 2, output_index=0, item={**item, "content": []}),
        ev("response.output_text.delta", 3, item_id="msg_1", output_index=0, content_index=0, delta="hi"),
        ev("response.output_item.done", 4, output_index=0, item=item),
        ev("response.completed", 5, response=resp("completed", prev=prev, output=[item])),
    ]


def test_text_turn_prefix_held_until_output_then_passthrough() -> None:
    channel = Channel(None)
    events = text_turn()
    assert feed(channel, events[:2]) == []  # lifecycle prefix held
    assert channel.started and not channel.released
    outs = feed(channel, events[2:3])
    assert [o.type for o in outs] == ["response.created", "response.in_progress", "response.output_item.added"]
    # lifecycle events are patched to the app's own previous_response_id (null), in their bytes
    assert outs[0].raw is not None and outs[0].obj is None
    assert orjson.loads(outs[0].raw) == {**events[0], "response": resp(prev=None)}
    # every other event is the upstream's bytes, unchanged
    assert outs[2].raw == orjson.dumps(events[2]) and outs[2].obj is None
    outs = feed(channel, events[3:])
    assert [o.type for o in outs] == ["response.output_text.delta", "response.output_item.done", "response.completed"]
    assert channel.done and channel.ending is Ending.COMPLETED
    assert channel.response is not None and channel.response["previous_response_id"] is None
    assert channel.response["output"][0]["id"] == "msg_1"
    assert channel.last_sequence == 5


def test_lifecycle_bytes_pass_unchanged_when_ids_agree() -> None:
    channel = Channel("resp_app")
    outs = feed(channel, text_turn(prev="resp_app"))
    assert all(o.raw is not None for o in outs)


def test_completed_without_output_events_releases_everything() -> None:
    channel = Channel(None)
    outs = feed(
        channel, [ev("response.created", 0, response=resp()), ev("response.completed", 1, response=resp("completed"))]
    )
    assert [o.type for o in outs] == ["response.created", "response.completed"]
    assert channel.released and channel.ending is Ending.COMPLETED


def test_incomplete_is_terminal() -> None:
    channel = Channel(None)
    feed(
        channel, [ev("response.created", 0, response=resp()), ev("response.incomplete", 1, response=resp("incomplete"))]
    )
    assert channel.ending is Ending.INCOMPLETE and channel.released


@pytest.mark.parametrize(("status", "ending"), [("completed", Ending.COMPLETED), ("failed", Ending.FAILED)])
def test_codex_response_done(status: str, ending: Ending) -> None:
    channel = Channel(None)
    feed(channel, [ev("response.output_item.added", 0), ev("response.done", 1, response=resp(status))])
    assert channel.ending is ending


def test_failed_before_output_is_held_for_a_replay_decision() -> None:
    channel = Channel(None)
    failed = ev(
        "response.failed", 1, response=resp("failed", error={"code": "previous_response_not_found", "message": "m"})
    )
    assert feed(channel, [ev("response.created", 0, response=resp()), failed]) == []
    assert channel.ending is Ending.FAILED and not channel.released
    want = {"message": "m", "type": "server_error", "param": None, "code": "previous_response_not_found"}
    assert channel.http_error() == HttpError(500, {"error": want})
    assert [o.type for o in channel.release()] == ["response.created", "response.failed"]


def test_failed_after_output_goes_straight_through() -> None:
    channel = Channel(None)
    events = text_turn()[:3] + [ev("response.failed", 3, response=resp("failed", error={"code": "server_error"}))]
    outs = feed(channel, events)
    assert outs[-1].type == "response.failed" and channel.ending is Ending.FAILED


def test_error_before_any_response_event_becomes_http_status_and_headers() -> None:
    channel = Channel(None)
    error = {
        "type": "error",
        "status": 429,
        "error": {
            "type": "requests",
            "code": "rate_limit_exceeded",
            "message": "slow down",
            "param": None,
            "headers": {"Retry-After": "2", "x-ratelimit-remaining-requests": "0", "set-cookie": "no"},
        },
    }
    assert feed(channel, [error]) == []
    assert not channel.started and channel.ending is Ending.ERROR
    err = channel.http_error()
    assert err.status == 429
    assert err.body == {
        "error": {"type": "requests", "code": "rate_limit_exceeded", "message": "slow down", "param": None}
    }
    assert err.headers == {"retry-after": "2", "x-ratelimit-remaining-requests": "0"}


@pytest.mark.parametrize(
    ("event", "status", "headers"),
    [
        ({"type": "error", "status_code": 503, "error": {"message": "busy"}}, 503, {}),
        (
            {"type": "error", "error": {"message": "?"}, "headers": {"retry-after-ms": "150"}},
            500,
            {"retry-after-ms": "150"},
        ),
        ({"type": "error", "status": 200, "code": "weird", "message": "m"}, 500, {}),
        ({"type": "error", "status": True, "message": "m"}, 500, {}),
    ],
    ids=["status_code-alias", "top-level-headers", "non-error-status", "bool-status"],
)
def test_error_status_and_headers_variants(event: dict[str, Any], status: int, headers: dict[str, str]) -> None:
    channel = Channel(None)
    feed(channel, [event])
    err = channel.http_error()
    assert (err.status, err.headers) == (status, headers)
    assert set(err.body["error"]) == {"type", "code", "message", "param"}


def test_error_after_output_is_normalised_to_the_nested_shape() -> None:
    channel = Channel(None)
    flat = {"type": "error", "code": "server_error", "message": "boom", "param": None}
    outs = feed(channel, text_turn()[:4] + [flat])
    assert outs[-1] == Out(
        "error",
        None,
        {
            "type": "error",
            "sequence_number": 4,
            "error": {"type": "server_error", "code": "server_error", "message": "boom", "param": None},
        },
    )


def test_error_after_created_but_before_output_is_held() -> None:
    channel = Channel(None)
    err = {"type": "error", "status": 400, "error": {"code": "previous_response_not_found", "message": "m"}}
    assert feed(channel, [ev("response.created", 0, response=resp()), err]) == []
    assert channel.started and not channel.released


def test_backend_extras_before_the_response_are_held_too() -> None:
    channel = Channel(None)
    assert feed(channel, [{"type": "codex.rate_limits", "limits": {}}]) == []
    assert not channel.released


def test_proxy_error_event_takes_the_next_sequence_number() -> None:
    channel = Channel(None)
    feed(channel, text_turn()[:4])
    out = channel.proxy_error_out(type="server_error", code="upstream_closed", message="gone")
    assert out.obj is not None and out.obj["sequence_number"] == 4


@pytest.mark.parametrize(
    "events",
    [[{"sequence_number": 0}], [ev("response.completed", 0, response=resp("completed")), ev("x", 1)]],
    ids=["no-type", "after-terminal"],
)
def test_protocol_errors(events: list[dict[str, Any]]) -> None:
    with pytest.raises(UpstreamProtocolError):
        feed(Channel(None), events)


# -- bounded hold-back: the clock is passed in ---------------------------------------------------


def test_output_within_the_bound_releases_everything_together() -> None:
    channel = Channel(None, hold_back_s=0.25)
    events = text_turn()
    assert feed(channel, events[:2], now=10.0) == []
    assert channel.deadline() == 10.25
    assert channel.on_timer(10.2) == []  # early timer: nothing yet
    outs = feed(channel, events[2:3], now=10.2)
    assert [o.type for o in outs] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert channel.deadline() is None and channel.hold_path is HoldPath.OUTPUT


def test_deadline_releases_the_held_events_and_ends_the_replay_window() -> None:
    channel = Channel(None, hold_back_s=0.25)
    events = text_turn()
    assert feed(channel, events[:1], now=10.0) == []
    assert feed(channel, events[1:2], now=10.1) == []  # the bound counts from the first held event
    assert channel.deadline() == 10.25
    outs = channel.on_timer(10.25)
    assert [o.type for o in outs] == ["response.created", "response.in_progress"]
    assert outs[0].raw is not None and orjson.loads(outs[0].raw)["response"]["previous_response_id"] is None
    assert channel.released and channel.hold_path is HoldPath.DEADLINE and channel.deadline() is None
    assert channel.on_timer(11.0) == []  # a late second timer releases nothing twice
    # from now on every event passes at once, and a failure is surfaced, never replayed
    outs = feed(channel, events[2:], now=12.0)
    assert [o.type for o in outs] == [e["type"] for e in events[2:]]
    assert channel.hold_path is HoldPath.DEADLINE


def test_a_late_event_past_the_bound_releases_without_a_timer() -> None:
    channel = Channel(None, hold_back_s=0.25)
    assert feed(channel, [ev("response.created", 0, response=resp())], now=1.0) == []
    outs = feed(channel, [ev("response.in_progress", 1, response=resp())], now=1.5)
    assert [o.type for o in outs] == ["response.created", "response.in_progress"]
    assert channel.hold_path is HoldPath.DEADLINE


def test_failure_after_the_deadline_release_is_not_held() -> None:
    channel = Channel(None, hold_back_s=0.25)
    feed(channel, [ev("response.created", 0, response=resp())], now=0.0)
    channel.on_timer(0.3)
    failed = ev("response.failed", 1, response=resp("failed", error={"code": "server_error", "message": "m"}))
    outs = feed(channel, [failed], now=0.4)
    assert [o.type for o in outs] == ["response.failed"] and channel.released


def test_zero_bound_never_holds() -> None:
    channel = Channel(None, hold_back_s=0.0)
    outs = feed(channel, [ev("response.created", 0, response=resp())], now=5.0)
    assert [o.type for o in outs] == ["response.created"] and channel.hold_path is HoldPath.DEADLINE


def test_no_bound_holds_until_output_as_before() -> None:
    for channel in (Channel(None), Channel(None, hold_back_s=None)):
        assert feed(channel, text_turn()[:2], now=0.0) == []
        assert channel.deadline() is None and channel.on_timer(1e9) == []
    # a bound without a clock is not armed either (an old shell that passes no ``now``)
    channel = Channel(None, hold_back_s=0.25)
    assert feed(channel, text_turn()[:2]) == [] and channel.deadline() is None


def test_terminal_while_held_and_discarded_paths() -> None:
    channel = Channel(None, hold_back_s=0.25)
    done = ev("response.completed", 2, response=resp("completed", output=[]))
    outs = feed(channel, [ev("response.created", 0, response=resp()), done], now=0.0)
    assert [o.type for o in outs] == ["response.created", "response.completed"]
    assert channel.hold_path is HoldPath.TERMINAL and channel.deadline() is None
    # a failure held for a replay decision: no deadline any more (the shell decides at once)
    channel = Channel(None, hold_back_s=0.25)
    failed = ev("response.failed", 1, response=resp("failed", error={"code": "previous_response_not_found"}))
    assert feed(channel, [ev("response.created", 0, response=resp()), failed], now=0.0) == []
    assert channel.deadline() is None and channel.on_timer(1.0) == []
    assert channel.hold_path is HoldPath.DISCARDED  # replayed: nothing of it reached the app
    channel.release()  # ... or surfaced by the shell
    assert channel.hold_path is HoldPath.TERMINAL
    assert Channel(None).hold_path is None  # nothing held at all


def test_lifecycle_patch_falls_back_to_serialising_when_the_bytes_are_ambiguous() -> None:
    channel = Channel("resp_app")
    tricky = resp(metadata={"previous_response_id": ANCHOR})  # the same member twice in the bytes
    spaced = ev("response.in_progress", 1, response=resp())
    outs = channel.feed(orjson.dumps(ev("response.created", 0, response=tricky)), ev("response.created", 0,
                        response=tricky))  # fmt: skip
    outs += channel.feed(json.dumps(spaced).encode(), spaced)  # "key": "value": no byte match
    outs += channel.feed(orjson.dumps(text_turn()[2]), text_turn()[2])
    assert outs[0].raw is None and outs[0].obj is not None
    assert outs[0].obj["response"]["previous_response_id"] == "resp_app"
    assert outs[0].obj["response"]["metadata"] == {"previous_response_id": ANCHOR}
    assert outs[1].raw is None and outs[1].obj is not None
    assert outs[1].obj["response"]["previous_response_id"] == "resp_app"


def test_nested_error_shape() -> None:
    assert nested_error(7, type="server_error", code="upstream_closed", message="gone") == {
        "type": "error",
        "sequence_number": 7,
        "error": {"type": "server_error", "code": "upstream_closed", "message": "gone", "param": None},
    }
