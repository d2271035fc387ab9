"""SSE framing: bytes exactly as OpenAI frames them."""

from __future__ import annotations

import pytest

from proxy.core.sse import CONTENT_TYPE, encode_event, encode_events, nested_error


@pytest.mark.parametrize(
    ("event_type", "data", "expected"),
    [
        (
            "response.created",
            b'{"type":"response.created","sequence_number":0}',
            b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n',
        ),
        ("error", b"{}", b"event: error\ndata: {}\n\n"),
        # pretty-printed JSON: one data line per line, joined back with \n by readers
        ("x", b'{\n  "a": 1\n}', b'event: x\ndata: {\ndata:   "a": 1\ndata: }\n\n'),
        ("x", b'{"a":\r\n1}', b'event: x\ndata: {"a":\ndata: 1}\n\n'),
        # a line break in the name never forges another field
        ("evil\ndata: x", b"{}", b"event: evildata: x\ndata: {}\n\n"),
        ("caf\u00e9", b"{}", "event: caf\u00e9\ndata: {}\n\n".encode()),
    ],
    ids=["plain", "empty-object", "pretty", "crlf", "newline-in-name", "utf8-name"],
)
def test_encode_event(event_type: str, data: bytes, expected: bytes) -> None:
    assert encode_event(event_type, data) == expected


def test_no_done_marker_and_content_type() -> None:
    assert b"[DONE]" not in encode_event("response.completed", b"{}")
    assert CONTENT_TYPE == "text/event-stream; charset=utf-8"


def test_nested_error_shape() -> None:
    assert nested_error(7, type="server_error", code="upstream_closed", message="gone") == {
        "type": "error",
        "sequence_number": 7,
        "error": {"type": "server_error", "code": "upstream_closed", "message": "gone", "param": None},
    }


def test_a_batch_is_framed_as_its_events_one_by_one() -> None:
    batch = [
        ("response.created", b'{"type":"response.created"}'),
        ("x", b'{\n  "a": 1\n}'),
        ("evil\ndata: x", b"{}"),
        ("response.completed", b"{}"),
    ]
    assert encode_events(batch) == b"".join(encode_event(t, d) for t, d in batch)
    assert encode_events([]) == b""
