"""parse_request validation, transport choice and frame building."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.core.request import Transport, build_frame, choose_transport, parse_request
from proxy.errors import InvalidRequest


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1,2]", None),
        (b'"a string"', None),
        (b'{"input": 5}', "input"),
        (b'{"input": [1]}', "input[0]"),
        (b'{"tools": {"a": 1}}', "tools"),
        (b'{"tools": ["x"]}', "tools[0]"),
        (b'{"stream": "yes"}', "stream"),
        (b'{"store": 1}', "store"),
        (b'{"model": 5}', "model"),
        (b'{"previous_response_id": 3}', "previous_response_id"),
        (b'{"input": "\xff\xfe"}', None),
        (b"[" * 5000 + b"]" * 5000, None),
    ],
)
def test_bad_input_is_invalid_request(body: bytes, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(body)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_big_integers_are_valid_json() -> None:
    parsed = parse_request(b'{"model":"m","input":"x","metadata":{"n":123456789012345678901234567890}}')
    assert parsed.fields["metadata"]["n"] == pytest.approx(123456789012345678901234567890)
    # orjson reads it as a float; the frame still carries the exact digits.
    assert b'"n":123456789012345678901234567890' in build_frame(parsed)
    delta = build_frame(parsed, previous_response_id="resp_1", items=parsed.items)
    assert b'"n":123456789012345678901234567890' in delta


def test_defaults() -> None:
    parsed = parse_request(b'{"model":"m","input":"hi"}')
    assert parsed.items == [{"role": "user", "content": "hi"}]
    assert (parsed.stream, parsed.store, parsed.previous_response_id) == (False, True, None)


@pytest.mark.parametrize(
    ("fields", "transport", "reason"),
    [
        ({}, Transport.WS, None),
        ({"background": True}, Transport.HTTP, "background"),
        ({"background": False}, Transport.WS, None),
        ({"conversation": "conv_1"}, Transport.HTTP, "conversation"),
        ({"generate": False}, Transport.HTTP, "ws_only_field"),
        ({"stream_id": "a"}, Transport.HTTP, "ws_only_field"),
        ({"input": "x" * 2000}, Transport.HTTP, "oversize"),
    ],
)
def test_choose_transport(fields: dict[str, Any], transport: Transport, reason: str | None) -> None:
    parsed = parse_request(orjson.dumps({"model": "m", **fields}))
    assert choose_transport(parsed, mode="websocket", frame_budget=1024) == (transport, reason)
    assert choose_transport(parsed, mode="http", frame_budget=1024) == (Transport.HTTP, "mode_http")


def test_frame_strips_transport_fields_and_sets_anchor() -> None:
    parsed = parse_request(
        b'{"model":"m","stream":true,"stream_options":{"include_obfuscation":false},"store":false,'
        b'"input":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}'
    )
    full = orjson.loads(build_frame(parsed))
    assert full == {
        "type": "response.create",
        "model": "m",
        "store": False,
        "input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    }
    delta = orjson.loads(build_frame(parsed, previous_response_id="resp_1", items=parsed.items[1:]))
    assert delta["previous_response_id"] == "resp_1"
    assert delta["input"] == [{"role": "user", "content": "b"}]
    assert delta["store"] is False


def test_settings_digest_ignores_transport_and_input_fields_only() -> None:
    a = parse_request(b'{"model":"m","input":"a","stream":true,"client_metadata":{"x":1}}')
    b = parse_request(b'{"model":"m","input":"b","stream":false}')
    c = parse_request(b'{"model":"m","input":"b","temperature":0.5}')
    assert a.settings_digest == b.settings_digest != c.settings_digest
