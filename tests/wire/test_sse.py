"""proxy/wire/sse.py: bytes exactly as OpenAI frames them, and the one SSE decoder: byte split,
the standard's edge cases, and agreement with the encoder."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.wire.sse import CONTENT_TYPE, Decoder, Event, EventTooLarge, decode_all, encode, encode_events

EVENTS = [
    ("response.created", orjson.dumps({"type": "response.created", "sequence_number": 0})),
    ("response.output_text.delta", orjson.dumps({"type": "response.output_text.delta", "delta": "a\nb"})),
    ("response.completed", b'{\n  "type": "response.completed",\n  "sequence_number": 2\n}'),
]


def _decoded(pieces: list[bytes]) -> list[Event]:
    decoder = Decoder()
    return [event for piece in pieces for event in decoder.feed(piece)]


def test_decodes_what_the_core_encoder_frames() -> None:
    wire = encode_events(EVENTS)
    events = _decoded([wire])
    assert [(e.event, orjson.loads(e.data)) for e in events] == [(t, orjson.loads(d)) for t, d in EVENTS]
    assert b"".join(e.raw for e in events) == wire  # raw bytes exactly as received, nothing lost


def test_encode_frames_as_the_core_does() -> None:
    for event_type, data in EVENTS:
        assert encode(event_type, data) == encode_events([(event_type, data)])
    assert encode("a\nevent: b", b"{}") == b"event: aevent: b\ndata: {}\n\n"  # no field smuggled in


@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30))
def test_any_byte_split_gives_the_same_events(cuts: list[int]) -> None:
    wire = encode_events(EVENTS).replace(b"\n", b"\r\n")  # CRLF: a CR and its LF may be split
    pieces, pos = [], 0
    for cut in cuts:
        pieces.append(wire[pos : pos + cut])
        pos += cut
    pieces.append(wire[pos:])
    events = _decoded(pieces)
    assert [e.event for e in events] == [t for t, _ in EVENTS]
    assert b"".join(e.raw for e in events) == wire
    assert events == _decoded([wire])


def test_one_byte_at_a_time_with_cr_line_ends() -> None:
    wire = encode_events(EVENTS).replace(b"\n", b"\r")
    decoder = Decoder()
    events = [e for i in range(len(wire)) for e in decoder.feed(wire[i : i + 1])]
    assert len(events) == 2  # a CR last may be half a CRLF: the last event waits for one more byte
    events += decoder.feed(b":")
    assert [orjson.loads(e.data)["type"] for e in events] == [t for t, _ in EVENTS]


def test_the_standards_edge_cases() -> None:
    wire = (
        b"\xef\xbb\xbf: a comment\n"  # a BOM, then a comment
        b"data:no space\n"
        b"data:  two spaces\n\n"  # only one space after the colon is dropped
        b"event: ping\n\n"  # no data: nothing dispatched
        b"id: 7\nretry: 10\nunknown: x\ndata\n\n"  # a field name alone: an empty value
    )
    events = _decoded([wire[:1], wire[1:2], wire[2:]])  # the BOM split too
    assert [(e.event, e.data, e.id) for e in events] == [
        ("message", b"no space\n two spaces", None),
        ("message", b"", "7"),
    ]


def test_an_event_without_its_blank_line_is_held_back() -> None:
    decoder = Decoder()
    wire = encode_events(EVENTS[:1]) + b"event: half\ndata: {"
    (only,) = decoder.feed(wire)
    assert only.event == "response.created"
    assert decoder.pending == b"event: half\ndata: {"
    assert decode_all(wire)[-1].data == b"{"  # a saved file: the last event counts without it


def test_a_stream_that_never_ends_an_event_is_bounded() -> None:
    decoder = Decoder(max_event_bytes=1024)
    decoder.feed(b"data: " + b"x" * 1000)
    with pytest.raises(EventTooLarge):
        decoder.feed(b"x" * 100)


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
def test_encode(event_type: str, data: bytes, expected: bytes) -> None:
    assert encode(event_type, data) == expected


def test_no_done_marker_and_content_type() -> None:
    assert b"[DONE]" not in encode("response.completed", b"{}")
    assert CONTENT_TYPE == "text/event-stream; charset=utf-8"


def test_a_batch_is_framed_as_its_events_one_by_one() -> None:
    batch = [
        ("response.created", b'{"type":"response.created"}'),
        ("x", b'{\n  "a": 1\n}'),
        ("evil\ndata: x", b"{}"),
        ("response.completed", b"{}"),
    ]
    assert encode_events(batch) == b"".join(encode(t, d) for t, d in batch)
    assert encode_events([]) == b""
