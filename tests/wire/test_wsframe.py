"""The client-side RFC 6455 frame reader (proxy/wire/wsframe.py), sans-I/O: frames split at every
byte, each protocol violation, and a differential fuzz test against websockets' own sans-I/O
parser (the same bytes give the same messages and control frames, or both fail)."""

from __future__ import annotations

import os
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.client import ClientProtocol
from websockets.frames import Close, Frame, Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

from proxy.contracts import ws_parser_error
from proxy.wire.wsframe import FrameReader, LibraryReader, PeerClosed, Ping, Pong, Received, Violation

LIMIT = 1 << 16
EXAMPLES = int(os.environ.get("UPSHIFT_FUZZ_EXAMPLES", "300"))


def frame(opcode: int, data: bytes, fin: bool = True, *, rsv: int = 0, mask: bool = False, wide: int = 0) -> bytes:
    """A frame's bytes as RFC 6455 §5.2 lays them out, valid or not (built by hand on purpose);
    ``wide`` forces a 16-bit (2) or 64-bit (8) length even for a short payload."""
    first = (0x80 if fin else 0) | (rsv << 4) | opcode
    size = len(data)
    if wide == 8 or (not wide and size >= 65536):
        length = b"\x7f" + size.to_bytes(8, "big")
    elif wide == 2 or size >= 126:
        length = b"\x7e" + size.to_bytes(2, "big")
    else:
        length = bytes([size])
    header = bytes([first, length[0] | (0x80 if mask else 0)]) + length[1:]
    if not mask:
        return header + data
    key = b"\x01\x02\x03\x04"
    return header + key + bytes(b ^ key[i % 4] for i, b in enumerate(data))


EVENTS = [
    {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}},
    {"type": "response.output_text.delta", "delta": "x" * 300},  # a 16-bit length
    {"type": "response.output_text.delta", "delta": "y" * 70_000},  # a 64-bit length
    {"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "output": []}},
]


def feed_in_steps(reader: FrameReader, data: bytes, step: int) -> list[Received]:
    out: list[Received] = []
    for at in range(0, len(data), step or len(data)):
        out += reader.feed(data[at : at + (step or len(data))])
    return out


@pytest.mark.parametrize("step", [0, 1, 2, 3, 7, 125, 4096])
def test_frames_split_anywhere_come_out_whole_with_a_ping_between_fragments(step: int) -> None:
    raws = [orjson.dumps(e) for e in EVENTS]
    half = len(raws[2]) // 2  # a fragmented message with a ping between its fragments (§5.4)
    script = b"".join(frame(Opcode.TEXT, r) for r in raws[:2])
    script += frame(Opcode.TEXT, raws[2][:half], fin=False) + frame(Opcode.PING, b"are you there")
    script += frame(Opcode.CONT, raws[2][half:]) + frame(Opcode.TEXT, raws[3]) + frame(Opcode.PONG, b"ok")
    reader = FrameReader(1 << 20)
    got = feed_in_steps(reader, script, step)
    assert got == [raws[0], raws[1], Ping(b"are you there"), raws[2], raws[3], Pong(b"ok")]
    assert reader.buffered == 0 and not reader.done


def test_a_close_ends_the_reading() -> None:
    reader = FrameReader(LIMIT)
    data = frame(Opcode.TEXT, b"{}") + frame(Opcode.CLOSE, Close(1013, "try again later").serialize())
    got = reader.feed(data + frame(Opcode.TEXT, b"{}"))
    assert got == [b"{}", PeerClosed(Close(1013, "try again later"))]
    assert reader.done and reader.feed(frame(Opcode.TEXT, b"{}")) == []


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (frame(Opcode.TEXT, b'{"type":"x"}', mask=True), "masked"),  # servers never mask
        (frame(Opcode.TEXT, b'{"type":"x"}', rsv=4), "reserved bits"),  # no extension
        (frame(Opcode.CONT, b'{"type":"x"}'), "out of order"),  # a continuation of nothing
        (frame(Opcode.TEXT, b'{"type":', fin=False) + frame(Opcode.TEXT, b'"x"}'), "out of order"),
        (frame(Opcode.PING, b"x", fin=False), "control frame"),  # a fragmented control frame
        (frame(Opcode.PING, b"x" * 126), "control frame"),  # over 125 bytes
        (b"\x83\x00", "control frame"),  # opcode 3: reserved
        (frame(Opcode.CLOSE, b"\x03"), "close frame"),  # a one-byte close payload
        (frame(Opcode.CLOSE, (1005).to_bytes(2, "big")), "close frame"),  # a code never sent
        (frame(Opcode.TEXT, b"x" * (LIMIT + 1)), "over"),  # one frame over the limit
        (frame(Opcode.TEXT, b"x" * LIMIT, fin=False) + frame(Opcode.CONT, b"x"), "over"),  # a message over it
    ],
    ids=["masked", "rsv1", "lone-cont", "text-in-message", "fragmented-ping", "long-ping", "reserved-opcode",
         "one-byte-close", "close-1005", "frame-too-big", "message-too-big"],
)  # fmt: skip
@pytest.mark.parametrize("step", [0, 1])
def test_each_violation_is_a_typed_result_and_ends_the_reading(data: bytes, said: str, step: int) -> None:
    reader = FrameReader(LIMIT)
    got = feed_in_steps(reader, data + frame(Opcode.TEXT, b"{}"), step)
    assert len(got) == 1 and isinstance(got[0], Violation), got
    assert said in got[0].message
    assert reader.done and reader.buffered == 0


def test_a_valid_close_after_a_control_frame_keeps_order() -> None:
    reader = FrameReader(LIMIT)
    got = reader.feed(frame(Opcode.PING, b"") + frame(Opcode.CLOSE, b""))
    assert got == [Ping(b""), PeerClosed(Close(1005, ""))]


# -- differential: the same bytes through websockets' own client-side parser ------------------


def _normalise(items: list[Received]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if isinstance(item, bytes):
            out.append(("message", item))
        elif isinstance(item, Ping):
            out.append(("ping", item.payload))
        elif isinstance(item, Pong):
            out.append(("pong", item.payload))
        elif isinstance(item, PeerClosed):
            out.append(("close", item.close.code, item.close.reason))
            break
        else:
            out.append(("fail",))
            break
    return out


def _library(chunks: list[bytes]) -> list[Any]:
    """What websockets' ClientProtocol makes of the chunks (the reference)."""
    protocol = ClientProtocol(parse_uri("ws://upstream.test/v1/responses"), state=State.OPEN, max_size=LIMIT)
    out: list[Any] = []
    parts: list[bytes] = []
    for chunk in chunks:
        protocol.receive_data(chunk)
        for event in protocol.events_received():
            assert isinstance(event, Frame)
            if event.opcode is Opcode.PING:
                out.append(("ping", bytes(event.data)))
            elif event.opcode is Opcode.PONG:
                out.append(("pong", bytes(event.data)))
            elif event.opcode is Opcode.CLOSE:
                close = protocol.close_rcvd
                assert close is not None
                out.append(("close", close.code, close.reason))
                return out
            else:
                parts.append(bytes(event.data))
                if event.fin:
                    out.append(("message", b"".join(parts)))
                    parts = []
        if protocol.parser_exc is not None:
            out.append(("fail",))
            return out
    return out


def _close(code: int, reason: str) -> bytes:
    return frame(8, Close(code, reason).serialize())


_OPCODES = st.sampled_from([0, 1, 2, 8, 9, 10, 0, 1, 3, 11])
_FRAME = st.builds(
    frame,
    _OPCODES,
    st.one_of(st.binary(max_size=40), st.binary(min_size=120, max_size=130), st.just(b"\x03\xe8ok")),
    st.booleans(),
    rsv=st.sampled_from([0, 0, 0, 0, 0, 0, 1, 4]),
    mask=st.sampled_from([False] * 9 + [True]),
    wide=st.sampled_from([0, 0, 0, 2, 8]),
)
_VALIDISH = st.lists(
    st.one_of(
        st.builds(frame, st.just(1), st.binary(max_size=300), st.booleans()),
        st.builds(frame, st.just(0), st.binary(max_size=300), st.booleans()),
        st.builds(frame, st.sampled_from([9, 10]), st.binary(max_size=125)),
        st.builds(_close, st.sampled_from([1000, 1001, 1011, 4000]), st.text(max_size=20)),
    ),
    max_size=12,
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frames=st.one_of(
        _VALIDISH, st.lists(_FRAME, max_size=10), st.lists(st.binary(min_size=1, max_size=30), max_size=4)
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=8),
    masked=st.booleans(),
)
def test_the_same_bytes_give_what_websockets_gives(frames: list[bytes], cuts: list[int], masked: bool) -> None:
    data = b"".join(frames)
    if masked and data:  # now and then a masked frame somewhere (servers must not mask)
        data += frame(1, b"{}", mask=True)
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    chunks = [data[a:b] for a, b in zip(points, points[1:], strict=False) if b > a]
    reader = FrameReader(LIMIT)
    ours: list[Received] = []
    for chunk in chunks:
        ours += reader.feed(chunk)
    mine, theirs = _normalise(ours), _library(chunks)
    if mine[-1:] == [("fail",)] and theirs[-1:] not in ([("fail",)], [("close",)]) and len(theirs) < len(mine):
        # Ours refuses a frame by its header (mask, reserved bits, length); websockets reads the
        # payload first: given the rest of that frame, it must refuse it too.
        theirs = _library([*chunks, bytes(LIMIT + 16)])
    assert mine == theirs


def test_the_library_reader_gives_the_same_results() -> None:
    """The reader used with an extension (websockets' protocol) yields the same typed results."""
    protocol = ClientProtocol(parse_uri("ws://upstream.test/v1/responses"), state=State.OPEN, max_size=LIMIT)
    reader = LibraryReader(protocol, ws_parser_error)
    data = frame(1, b'{"a":', fin=False) + frame(9, b"hi") + frame(0, b"1}") + frame(10, b"p")
    data += frame(8, Close(1000, "bye").serialize())
    got = [r for i in range(len(data)) for r in reader.feed(data[i : i + 1])]
    assert got[:3] == [b'{"a":1}', Pong(b"p"), PeerClosed(Close(1000, "bye"), answered=True)]
    assert reader.done
