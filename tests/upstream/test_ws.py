"""One upstream socket against the emulator (and a header-capturing server): each failure mode
and the error it maps to; identities."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import socket
from typing import Any

import orjson
import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.frames import Close, Frame, Opcode
from websockets.http11 import Request
from websockets.protocol import Protocol, Side, State

from bench.ports import free_port
from proxy.config import PoolSettings, Settings, TimeoutSettings
from proxy.core.demux import strip_stream_id
from proxy.errors import UpstreamClosed, UpstreamProtocolError, UpstreamRefused, UpstreamTimeout, UpstreamUnavailable
from proxy.intake.identity import USER_AGENT, identify
from proxy.upstream.handshake import open_websocket
from proxy.upstream.ws import UpstreamSocket, writelines_pauses

KEY = "sk-test"


def settings_for(url: str, **pool: Any) -> Settings:
    return Settings(upstream=url, pool=PoolSettings(**pool))


async def open_socket(settings: Settings, key: str = KEY) -> UpstreamSocket:
    identity = identify({"Authorization": f"Bearer {key}"}, upstream=settings.upstream, authorization=f"Bearer {key}")
    ws = await open_websocket(settings.ws_url, identity.headers, settings)
    return UpstreamSocket(1, ws, 0.0, fragment_bytes=settings.pool.fragment_bytes)


async def test_one_response_over_the_socket(emulator: Any) -> None:
    sock = await open_socket(settings_for(emulator.base_url))
    inbox = sock.open_inbox(None)
    await sock.send(b'{"type":"response.create","model":"gpt-6.1-sol","input":"hi"}', None)
    types = []
    while not types or types[-1] != "response.completed":
        raw, event = await inbox.get(5)
        assert orjson.loads(raw) == event
        types.append(event["type"])
    assert types[0] == "response.created"
    await sock.close()
    assert sock.closed


async def test_handshake_headers() -> None:
    seen: list[Request] = []

    def capture(connection: ServerConnection, request: Request) -> None:
        seen.append(request)

    async def handler(connection: ServerConnection) -> None:
        await connection.wait_closed()

    async with serve(handler, "127.0.0.1", 0, process_request=capture) as server:
        port = server.sockets[0].getsockname()[1]
        settings = settings_for(f"http://127.0.0.1:{port}/v1", openai_beta="responses_websockets=2026-02-06")
        app = {
            "Authorization": "Bearer sk-app",
            "OpenAI-Organization": "org-1",
            "OpenAI-Project": "proj-1",
            "Cookie": "session=1",
            "X-Other": "no",
        }
        identity = identify(
            app, upstream=settings.upstream, authorization="Bearer sk-app", openai_beta=settings.pool.openai_beta
        )
        ws = await open_websocket(settings.ws_url, identity.headers, settings)
        await ws.close()
    headers = seen[0].headers
    assert seen[0].path == "/v1/responses"
    assert headers["Authorization"] == "Bearer sk-app"
    assert headers["OpenAI-Organization"] == "org-1" and headers["OpenAI-Project"] == "proj-1"
    assert headers["OpenAI-Beta"] == "responses_websockets=2026-02-06"
    assert headers["User-Agent"] == USER_AGENT and USER_AGENT.startswith("upshift/")
    assert "Cookie" not in headers and "X-Other" not in headers
    assert "Sec-WebSocket-Extensions" not in headers  # compression off by default


async def test_compression_is_offered_when_configured(emulator: Any) -> None:
    sock = await open_socket(settings_for(emulator.base_url, compression=True))
    assert sock.ws.protocol.extensions  # permessage-deflate negotiated
    await sock.close()


async def test_refused_upgrade_keeps_status_and_body(emulator: Any) -> None:
    with pytest.raises(UpstreamRefused) as info:
        await open_socket(settings_for(emulator.base_url), key="sk-bad-key")
    assert info.value.http_status == 401
    assert orjson.loads(info.value.payload)["error"]["code"] == "invalid_api_key"
    assert isinstance(info.value, UpstreamUnavailable)


async def test_unreachable_is_unavailable() -> None:
    port = free_port()
    with pytest.raises(UpstreamUnavailable) as info:
        await open_socket(settings_for(f"http://127.0.0.1:{port}/v1"))
    assert info.value.status == 502


async def test_close_maps_to_upstream_closed_with_code(emulator: Any) -> None:
    emulator.faults.arm("close", after_events=1, close_code=1011)
    sock = await open_socket(settings_for(emulator.base_url))
    inbox = sock.open_inbox(None)
    await sock.send(b'{"type":"response.create","model":"gpt-6.1-sol","input":"hi"}', None)
    await inbox.get(5)
    with pytest.raises(UpstreamClosed) as info:
        await inbox.get(5)
    assert info.value.close_code == 1011
    with pytest.raises(UpstreamClosed):
        await sock.send(b"{}", None)


async def _accept_upgrade(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer a WebSocket upgrade with 101 (a raw upstream: nothing else of the protocol)."""
    request = await reader.readuntil(b"\r\n\r\n")
    key = next(
        v.split(b":", 1)[1].strip() for v in request.split(b"\r\n") if v.lower().startswith(b"sec-websocket-key:")
    )
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")  # fmt: skip


class _RawUpstream:
    """A raw TCP upstream's server and the handlers of its open connections."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.handlers: set[asyncio.Task[Any]] = set()

    def end_connections(self) -> None:
        """The upstream ends every connection still open (its handlers are cancelled)."""
        for task in self.handlers:
            task.cancel()

    async def close(self) -> None:
        """Ends the connections, then the server (on Python 3.12+ a server's ``wait_closed``
        waits for its connections, which a handler may hold open for seconds)."""
        self.end_connections()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def _raw_upstream(handler: Any, rcvbuf: int | None = None) -> tuple[_RawUpstream, str]:
    """A raw TCP upstream on 127.0.0.1 running ``handler`` per connection, and its base URL;
    ``rcvbuf``: the receive buffer of its connections (set on the listener, so that their window
    is that small)."""
    upstream = _RawUpstream()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        upstream.handlers.add(task)
        try:
            await handler(reader, writer)
        finally:
            upstream.handlers.discard(task)
            writer.close()

    server = upstream.server = await asyncio.start_server(serve, "127.0.0.1", 0)
    if rcvbuf is not None:
        server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return upstream, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


async def _hold_open(writer: asyncio.StreamWriter, seconds: float = 10.0) -> None:
    """Keep the connection open (answering nothing) until cancelled or ``seconds`` pass."""
    try:
        await asyncio.sleep(seconds)
    finally:
        writer.close()


async def _upgrade_then_close_without_fin(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A raw upstream: accepts the upgrade, answers the first frame with a close frame (1011),
    then keeps the TCP connection open (a slow closing handshake)."""
    await _accept_upgrade(reader, writer)
    await reader.read(1)  # the create frame
    writer.write(b"\x88\x02\x03\xf3")  # close, 1011
    await _hold_open(writer)


async def test_send_while_the_upstream_closes_is_upstream_closed() -> None:
    server, url = await _raw_upstream(_upgrade_then_close_without_fin)
    sock = await open_socket(settings_for(url))
    inbox = sock.open_inbox(None)
    await sock.send(b'{"type":"response.create","model":"gpt-6.1-sol","input":"hi"}', None)
    with pytest.raises(UpstreamClosed) as info:
        await inbox.get(5)
    assert info.value.close_code == 1011
    assert sock.protocol.state is State.CLOSING and sock.closed  # the close frame came, TCP is still up
    with pytest.raises(UpstreamClosed) as again:
        await sock.send(b'{"type":"response.create","model":"gpt-6.1-sol","input":"again"}', None)
    assert again.value.close_code == 1011
    server.end_connections()  # the upstream ends the TCP connection now
    await asyncio.wait_for(sock.wait_closed(), 5)
    await server.close()


async def test_keepalive_pings_are_answered(emulator: Any) -> None:
    settings = settings_for(emulator.base_url)
    identity = identify({"Authorization": f"Bearer {KEY}"}, upstream=settings.upstream, authorization=f"Bearer {KEY}")
    ws = await open_websocket(settings.ws_url, identity.headers, settings)
    sock = UpstreamSocket(1, ws, 0.0, ping_interval=0.02, ping_timeout=0.05)
    await asyncio.sleep(0.3)  # about 10 pings: one unanswered for 50 ms would drop the socket
    assert not sock.closed
    inbox = sock.open_inbox(None)
    await sock.send(b'{"type":"response.create","model":"gpt-6.1-sol","input":"hi"}', None)
    while (await inbox.get(5))[1]["type"] != "response.completed":
        pass
    assert not sock.closed
    await sock.close()


async def test_unanswered_keepalive_ping_drops_the_socket() -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _accept_upgrade(reader, writer)
        try:
            await reader.read()  # reads pings, never answers
        finally:
            writer.close()

    server, url = await _raw_upstream(mute)
    settings = settings_for(url)
    identity = identify({"Authorization": f"Bearer {KEY}"}, upstream=settings.upstream, authorization=f"Bearer {KEY}")
    ws = await open_websocket(settings.ws_url, identity.headers, settings)
    sock = UpstreamSocket(1, ws, 0.0, ping_interval=0.05, ping_timeout=0.1)
    inbox = sock.open_inbox(None)
    with pytest.raises(UpstreamClosed) as info:
        await inbox.get(5)
    assert info.value.close_code == 1011 and "keepalive" in info.value.reason
    await asyncio.wait_for(sock.wait_closed(), 5)
    await server.close()


async def test_silence_maps_to_upstream_timeout(emulator: Any) -> None:
    sock = await open_socket(settings_for(emulator.base_url))
    with pytest.raises(UpstreamTimeout):
        await sock.open_inbox(None).get(0.05)
    await sock.close()


async def test_handshake_timeout_is_unavailable() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _hold_open(writer, 5)

    server, url = await _raw_upstream(silent)
    settings = Settings(upstream=url, timeouts=TimeoutSettings(connect_seconds=0.1))
    with pytest.raises(UpstreamUnavailable):
        await open_socket(settings)
    await server.close()


def test_identity_parts() -> None:
    base = {"Authorization": "Bearer a"}
    up = "https://api.openai.com/v1"
    one = identify(base, upstream=up, authorization="Bearer a")
    assert one == identify(dict(base), upstream=up, authorization="Bearer a")
    different = [
        identify({"Authorization": "Bearer b"}, upstream=up, authorization="Bearer b"),
        identify({**base, "OpenAI-Organization": "o"}, upstream=up, authorization="Bearer a"),
        identify({**base, "OpenAI-Project": "p"}, upstream=up, authorization="Bearer a"),
        identify({**base, "OpenAI-Beta": "x"}, upstream=up, authorization="Bearer a"),
        identify(base, upstream=up, authorization="Bearer a", openai_beta="y"),
        identify(base, upstream="https://other/v1", authorization="Bearer a"),
        identify(base, upstream=up, authorization="Bearer injected"),
    ]
    assert len({one, *different}) == len(different) + 1
    # an injected key: tenants with different own headers stay apart
    t1 = identify({"Authorization": "Bearer t1"}, upstream=up, authorization="Bearer key")
    t2 = identify({"Authorization": "Bearer t2"}, upstream=up, authorization="Bearer key")
    assert t1 != t2 and t1.headers == t2.headers == (("Authorization", "Bearer key"),)
    assert "Bearer" not in repr(t1)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"stream_id":"s1","type":"response.output_text.delta","delta":"hi"}',
        b'{"type":"response.output_text.delta","stream_id":"s1","delta":"hi"}',
        b'{"type":"response.output_text.delta","delta":"hi","stream_id":"s1"}',
        b'{"type": "response.output_text.delta", "delta": "hi", "stream_id": "s1"}',  # not compact
        b'{"type":"response.output_text.delta","delta":"\\"stream_id\\":\\"s1\\"","stream_id":"s1"}',
    ],
)
def test_strip_stream_id_leaves_the_rest_of_the_event_unchanged(raw: bytes) -> None:
    event = orjson.loads(raw)
    sid = event.pop("stream_id")
    stripped = strip_stream_id(raw, sid, event, b'"stream_id":"s1"')
    assert orjson.loads(stripped) == event and b'"stream_id":"s1"' not in stripped.replace(b'\\"', b"")
    assert strip_stream_id(raw, sid, event) == stripped


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (b'{"type":"x","response":{"metadata":{"stream_id":"s1"}},"stream_id":"s1"}',
         b'{"type":"x","response":{"metadata":{"stream_id":"s1"}}}'),
        (b'{"stream_id":"s1","type":"x","metadata":{"stream_id":"s1"}}', b'{"type":"x","metadata":{"stream_id":"s1"}}'),
        (b'{"type":"x","metadata":{"a":1,"stream_id":"s1"},"stream_id":"s1","b":2}',
         b'{"type":"x","metadata":{"a":1,"stream_id":"s1"},"b":2}'),  # neither end: re-serialised
    ],
)  # fmt: skip
def test_strip_stream_id_cuts_only_the_top_level_member(raw: bytes, want: bytes) -> None:
    """An app's metadata may hold a ``stream_id`` of its own: it reaches the app unchanged."""
    event = orjson.loads(raw)
    sid = event.pop("stream_id")
    assert strip_stream_id(raw, sid, event, b'"stream_id":"s1"') == want


async def test_large_frames_of_two_lanes_never_interleave_their_fragments() -> None:
    """With ``pool.fragment_bytes`` set, two lanes send 8 MB creates at once to an upstream that
    reads slowly (the transport pauses between fragments): each goes out as one message in 1 MiB
    fragments, one after the other. Interleaved fragments are a protocol error (found by the
    cgroup load test)."""
    received = bytearray()
    done = asyncio.Event()

    async def slow_reader(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _accept_upgrade(reader, writer)
        await asyncio.sleep(0.5)  # the kernel buffers fill: the sender's transport pauses
        while len(received) < 2 * 8_000_000 + 40:  # both payloads and the small one, at least
            chunk = await reader.read(1 << 20)
            if not chunk:
                break
            received.extend(chunk)
        done.set()
        await _hold_open(writer)

    # A small receive window: what the kernels hold (that window and at most the sender's 4 MB
    # send buffer) is less than one 8 MB message, whatever the machine's autotuning allows.
    server, url = await _raw_upstream(slow_reader, rcvbuf=64 * 1024)
    sock = await open_socket(settings_for(url, fragment_bytes=1024 * 1024))
    frames = {lane: orjson.dumps({"type": "response.create", "input": lane + "x" * 8_000_000}) for lane in ("u1", "u2")}
    small = b'{"type":"response.create","input":"small"}'
    # The moment that broke: the transport resumes, and before u1's next fragment another lane
    # starts its send (a task that runs first). Here that lane starts exactly then.
    later: list[asyncio.Task[None]] = []
    resume = sock.resume_writing

    def resume_then_send() -> None:
        resume()
        if not later and sock.protocol.expect_continuation_frame:  # u1 is mid-message
            loop = asyncio.get_running_loop()
            later.extend([loop.create_task(sock.send(frames["u2"], "u2")), loop.create_task(sock.send(small, "u3"))])

    sock.resume_writing = resume_then_send  # type: ignore[method-assign]
    await sock.send(frames["u1"], "u1")
    assert later, "the transport never paused mid-message: the test did not reach its moment"
    await asyncio.gather(*later)
    await asyncio.wait_for(done.wait(), 20)
    upstream = Protocol(Side.SERVER, max_size=None)
    upstream.receive_data(bytes(received))
    texts, message = [], b""
    for frame in upstream.events_received():
        assert isinstance(frame, Frame)
        message += frame.data
        if frame.fin:
            texts.append(message)
            message = b""
    assert upstream.parser_exc is None
    assert sorted(texts) == sorted([*frames.values(), small])
    server.end_connections()  # first: the socket's close then waits for no closing handshake
    await sock.close()
    await server.close()


@pytest.mark.parametrize(
    ("version", "pauses"),
    [((3, 11, 7), True), ((3, 12, 1), False), ((3, 12, 8), False), ((3, 12, 9), True), ((3, 13, 0), False),
     ((3, 13, 1), False), ((3, 13, 2), True), ((3, 14, 0), True)],
)  # fmt: skip
def test_frames_go_through_write_where_asyncios_writelines_never_pauses(version: tuple[int, ...], pauses: bool) -> None:
    # CVE-2024-12254: there, the test above finds the transport never paused (run on such a Python).
    assert writelines_pauses(version) is pauses


# -- the frame parser of the receive path (RFC 6455 §5) ------------------------------------------

_EVENTS = [
    {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}},
    {"type": "response.output_text.delta", "delta": "x" * 300},  # a 16-bit length
    {"type": "response.output_text.delta", "delta": "y" * 70_000},  # a 64-bit length
    {"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "output": []}},
]


def _server_frame(opcode: int, data: bytes, fin: bool = True, *, rsv1: bool = False, mask: bool = False) -> bytes:
    """A frame's bytes as RFC 6455 §5.2 lays them out, valid or not (built by hand on purpose)."""
    first = (0x80 if fin else 0) | (0x40 if rsv1 else 0) | opcode
    size = len(data)
    length = (
        bytes([size])
        if size < 126
        else b"\x7e" + size.to_bytes(2, "big")
        if size < 65536
        else b"\x7f" + size.to_bytes(8, "big")
    )
    header = bytes([first]) + bytes([length[0] | (0x80 if mask else 0)]) + length[1:]
    if not mask:
        return header + data
    key = b"\x01\x02\x03\x04"
    return header + key + bytes(b ^ key[i % 4] for i, b in enumerate(data))


async def _scripted(script: bytes, *, step: int = 0) -> tuple[UpstreamSocket, _RawUpstream, list[Frame]]:
    """A raw upstream that answers the first frame with ``script`` (``step`` bytes per write, 0:
    at once) and collects what the socket sends afterwards; the socket, the upstream, those frames."""
    sent: list[Frame] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _accept_upgrade(reader, writer)
        upstream = Protocol(Side.SERVER, max_size=None)
        upstream.receive_data(await reader.read(65536))  # the create
        upstream.events_received()
        for at in range(0, len(script), step or len(script)):
            writer.write(script[at : at + (step or len(script))])
            await writer.drain()
        try:
            while chunk := await reader.read(65536):
                upstream.receive_data(chunk)
                sent.extend(e for e in upstream.events_received() if isinstance(e, Frame))
        finally:
            writer.close()

    server, url = await _raw_upstream(handler)
    sock = await open_socket(settings_for(url))
    assert not sock._library  # no extension negotiated: proxy.wire.wsframe's reader, not the library's
    await sock.send(b'{"type":"response.create","model":"gpt-6.1-sol","input":"hi"}', None)
    return sock, server, sent


async def _drain(inbox: Any, n: int) -> list[dict[str, Any]]:
    return [(await inbox.get(5))[1] for _ in range(n)]


@pytest.mark.parametrize("step", [0, 1, 7])
async def test_frames_split_anywhere_arrive_whole_and_a_ping_mid_message_gets_its_pong(step: int) -> None:
    raws = [orjson.dumps(e) for e in _EVENTS]
    script = b"".join(_server_frame(Opcode.TEXT, r) for r in raws[:2])
    half = len(raws[2]) // 2  # a fragmented message with a ping between its fragments (§5.4)
    script += _server_frame(Opcode.TEXT, raws[2][:half], fin=False) + _server_frame(Opcode.PING, b"are you there")
    script += _server_frame(Opcode.CONT, raws[2][half:]) + _server_frame(Opcode.TEXT, raws[3])
    sock, server, sent = await _scripted(script, step=step)
    inbox = sock.open_inbox(None)
    assert await _drain(inbox, 4) == _EVENTS
    await asyncio.sleep(0.05)
    assert [(f.opcode, f.data) for f in sent] == [(Opcode.PONG, b"are you there")]
    server.end_connections()  # first: the socket's close then waits for no closing handshake
    await sock.close()
    await server.close()


async def test_a_close_frame_is_echoed_and_fails_the_lanes_with_its_code() -> None:
    close = _server_frame(Opcode.CLOSE, Close(1013, "try again later").serialize())
    sock, server, sent = await _scripted(_server_frame(Opcode.TEXT, orjson.dumps(_EVENTS[0])) + close)
    inbox = sock.open_inbox(None)
    assert (await inbox.get(5))[1] == _EVENTS[0]
    with pytest.raises(UpstreamClosed) as info:
        await inbox.get(5)
    assert (info.value.close_code, info.value.reason) == (1013, "try again later")
    assert sock.closed and sock.close_rcvd == Close(1013, "try again later")
    await asyncio.sleep(0.05)
    assert [(f.opcode, Close.parse(f.data).code) for f in sent] == [(Opcode.CLOSE, 1013)]
    with pytest.raises(UpstreamClosed):
        await sock.send(b"{}", None)
    await server.close()


@pytest.mark.parametrize(
    ("frame", "said"),
    [
        (_server_frame(Opcode.TEXT, b'{"type":"x"}', mask=True), "masked"),  # servers never mask
        (_server_frame(Opcode.TEXT, b'{"type":"x"}', rsv1=True), "reserved bits"),  # no extension
        (_server_frame(Opcode.CONT, b'{"type":"x"}'), "out of order"),  # a continuation of nothing
        (_server_frame(Opcode.TEXT, b'{"type":', fin=False) + _server_frame(Opcode.TEXT, b'"x"}'), "out of order"),
        (_server_frame(Opcode.PING, b"x", fin=False), "control frame"),  # a fragmented control frame
        (_server_frame(Opcode.PING, b"x" * 126), "control frame"),  # over 125 bytes
        (b"\x83\x00", "control frame"),  # opcode 3: reserved
        (_server_frame(Opcode.CLOSE, b"\x03"), "close frame"),  # a one-byte close payload
        (_server_frame(Opcode.TEXT, b"\xff\xfe"), "not JSON"),  # not UTF-8
    ],
    ids=["masked", "rsv1", "lone-cont", "text-in-message", "fragmented-ping", "long-ping", "reserved-opcode",
         "bad-close", "not-utf8"],
)  # fmt: skip
async def test_a_frame_against_the_protocol_fails_the_socket(frame: bytes, said: str) -> None:
    sock, server, _ = await _scripted(frame)
    inbox = sock.open_inbox(None)
    with pytest.raises(UpstreamProtocolError) as info:
        await inbox.get(5)
    assert said in info.value.message
    await asyncio.wait_for(sock.wait_closed(), 5)  # dropped
    await server.close()


async def test_a_large_message_goes_as_one_frame_by_default() -> None:
    """The default framing is the official clients': one frame per message, however large
    (``pool.fragment_bytes`` is off)."""
    received = bytearray()
    done = asyncio.Event()

    async def reader_(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _accept_upgrade(reader, writer)
        while len(received) < 3_000_000 + 14:
            chunk = await reader.read(1 << 20)
            if not chunk:
                break
            received.extend(chunk)
        done.set()
        await _hold_open(writer)

    server, url = await _raw_upstream(reader_)
    sock = await open_socket(settings_for(url))
    frame = orjson.dumps({"type": "response.create", "input": "x" * 3_000_000})
    await sock.send(frame, None)
    await asyncio.wait_for(done.wait(), 20)
    upstream = Protocol(Side.SERVER, max_size=None)
    upstream.receive_data(bytes(received))
    (got,) = [f for f in upstream.events_received() if isinstance(f, Frame)]
    assert got.fin and got.opcode is Opcode.TEXT and got.data == frame
    server.end_connections()  # first: the socket's close then waits for no closing handshake
    await sock.close()
    await server.close()
