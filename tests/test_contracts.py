"""Contract tests for every library internal read in proxy/contracts.py: each fails with a clear
message when aiohttp or websockets changes what the accessor relies on."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

import proxy.contracts
from proxy import contracts
from proxy.config import ListenerSettings
from proxy.ingress.listener import Guard, HardenedTCPSite, protocol_factory
from tests.loops import LOOP_KINDS, loop_runner

# --- aiohttp -------------------------------------------------------------------------------

AIOHTTP = f"aiohttp {aiohttp.__version__}"


async def _hello(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(text="hi")


@pytest.fixture
async def runner() -> AsyncIterator[web.AppRunner]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", _hello)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    yield runner
    await runner.cleanup()


def _request(body: bytes = b"x") -> bytes:
    return b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


async def test_request_handler_state(runner: web.AppRunner) -> None:
    """The RequestHandler privates the listener reads: queued messages and their payloads, the
    request count, in progress, upgraded, and the 'holds nothing more' set."""
    slots = {name for cls in RequestHandler.__mro__ for name in getattr(cls, "__slots__", ())}
    for name in contracts.REQUEST_HANDLER_STATE:
        assert name in slots, f"{AIOHTTP}: RequestHandler.{name} is gone (proxy/contracts.py reads it)"
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    transport, handler = await loop.connect_accepted_socket(protocol_factory(runner, Guard(ListenerSettings())), ours)
    try:
        assert isinstance(handler, RequestHandler)
        assert contracts.handler_loop(handler) is loop
        assert not contracts.handler_queued(handler) and contracts.handler_last_payload(handler) is None
        assert contracts.handler_holds_nothing_more(handler) and not contracts.handler_in_progress(handler)
        before = contracts.handler_request_count(handler)
        handler.data_received(_request(b"one") + _request(b"two"))  # pipelined: two messages queued
        assert contracts.handler_queued(handler), f"{AIOHTTP}: parsed messages are no longer in _messages"
        payload = contracts.handler_last_payload(handler)
        assert isinstance(payload, aiohttp.StreamReader) and payload.is_eof()
        assert not contracts.handler_holds_nothing_more(handler)
        theirs.setblocking(False)
        for _ in range(200):  # the handler loop takes both and answers them
            await asyncio.sleep(0.01)
            if contracts.handler_request_count(handler) == before + 2 and not contracts.handler_queued(handler):
                break
        assert contracts.handler_request_count(handler) == before + 2, f"{AIOHTTP}: _request_count not counted"
        assert not contracts.handler_upgraded(handler)
    finally:
        transport.close()
        theirs.close()


async def test_handler_arguments_make_a_handler(runner: web.AppRunner) -> None:
    assert runner.server is not None
    arguments = contracts.handler_arguments(runner.server)
    assert arguments["loop"] is asyncio.get_running_loop()
    RequestHandler(runner.server, **arguments)  # accepted as RequestHandler's own keywords


async def test_site_internals(runner: web.AppRunner) -> None:
    """A site of ours registers with the runner, lists its address and stops its server."""
    site = HardenedTCPSite(runner, "127.0.0.1", 0, Guard(ListenerSettings()))
    assert contracts.site_runner(site) is runner and contracts.site_backlog(site) == 1024
    await site.start()
    address = next(a for a in runner.addresses if isinstance(a, tuple))
    assert address[1] == site.port != 0, f"{AIOHTTP}: runner.addresses no longer reads site._server"
    async with aiohttp.ClientSession() as session, session.post(f"http://127.0.0.1:{site.port}/x") as resp:
        assert resp.status == 200
    await site.stop()
    with pytest.raises(aiohttp.ClientConnectorError):
        async with aiohttp.ClientSession() as session:
            await session.get(f"http://127.0.0.1:{site.port}/x")


async def test_a_client_answers_transport_outlives_its_release(runner: web.AppRunner) -> None:
    """A small answer read whole with its headers has released its connection by the time the
    caller sees it; the transport it came on is still found (and is the connection's socket)."""
    site = HardenedTCPSite(runner, "127.0.0.1", 0, Guard(ListenerSettings()))
    await site.start()
    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"http://127.0.0.1:{site.port}/x", data=b"x")
            transport = contracts.client_response_transport(resp)
            assert transport is not None, f"{AIOHTTP}: ClientResponse._protocol.transport is gone"
            sock = transport.get_extra_info("socket")
            assert sock.getpeername()[1] == site.port
            assert await resp.text() == "hi"
            resp.release()
    finally:
        await site.stop()


async def test_headers_go_with_the_first_write(runner: web.AppRunner) -> None:
    assert getattr(web.StreamResponse(), "_send_headers_immediately", None) is True, AIOHTTP

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        contracts.send_headers_with_first_write(response)
        await response.prepare(request)
        assert request.transport is not None
        writes.append(request.transport.get_write_buffer_size())
        await response.write(b"body")
        return response

    writes: list[int] = []
    app = web.Application()
    app.router.add_get("/", stream)
    client_runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await client_runner.setup()
    site = web.TCPSite(client_runner, "127.0.0.1", 0)
    await site.start()
    port = next(a for a in client_runner.addresses if isinstance(a, tuple))[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
    first = await reader.read(65536)
    writer.close()
    await client_runner.cleanup()
    assert first.startswith(b"HTTP/1.1 200") and b"body" in first  # headers and body in one write


async def test_checked_unix_connector_checks_before_a_byte_is_sent() -> None:
    assert "_create_connection" in vars(aiohttp.UnixConnector), f"{AIOHTTP}: UnixConnector._create_connection gone"
    params = list(inspect.signature(aiohttp.UnixConnector._create_connection).parameters)
    assert params == ["self", "req", "traces", "timeout"], f"{AIOHTTP}: _create_connection{params}"
    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.read(65536))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "s.sock")
    server = await asyncio.start_unix_server(serve, path)
    seen: list[int] = []

    def refuse(sock: socket.socket) -> None:
        seen.append(sock.fileno())
        raise OSError("not ours")

    try:
        async with aiohttp.ClientSession(connector=contracts.CheckedUnixConnector(path, refuse)) as session:
            with pytest.raises(aiohttp.ClientConnectionError):
                await session.get("http://localhost/x")
        await asyncio.sleep(0.05)
        assert seen and received in ([], [b""]), received  # checked, and not a byte was sent
        async with aiohttp.ClientSession(connector=contracts.CheckedUnixConnector(path, seen.append)) as session:
            async with session.get("http://localhost/x") as resp:
                assert resp.status == 200 and await resp.read() == b"ok"
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):  # Python 3.13+ removes it on close
            os.unlink(path)
        os.rmdir(folder)


# --- websockets ----------------------------------------------------------------------------


async def _websockets_pair() -> tuple[Any, Any]:
    """A websockets server on 127.0.0.1 and a client connection to it (opened, past the 101)."""
    from websockets.asyncio.client import connect
    from websockets.asyncio.server import serve

    async def echo(conn: Any) -> None:
        async for message in conn:
            await conn.send(message)

    server = await serve(echo, "127.0.0.1", 0)
    port = next(iter(server.sockets)).getsockname()[1]
    client = await connect(f"ws://127.0.0.1:{port}/", ping_interval=None, compression=None)
    return server, client


class _Sink(asyncio.Protocol):
    def __init__(self) -> None:
        self.received = bytearray()
        self.got = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.received += data
        self.got.set()


@pytest.mark.parametrize("loop_kind", LOOP_KINDS)
def test_websockets_connection_can_be_taken_over_after_the_handshake(loop_kind: str) -> None:
    """Under both event loops the sidecar runs on (uvloop's transports are no asyncio.Transport)."""
    with loop_runner(loop_kind) as loop:
        loop.run(_take_over())


async def _take_over() -> None:
    """ws_take_over: ClientConnection.transport/.protocol and Protocol.reader.buffer exist, and
    after the take-over our protocol receives the connection's bytes (websockets' own reader
    no longer does)."""
    from websockets.protocol import Protocol

    server, client = await _websockets_pair()
    try:
        sink = _Sink()
        transport, protocol, held = proxy.contracts.ws_take_over(client, sink)
        assert isinstance(protocol, Protocol), "websockets: ClientConnection.protocol is no longer a sans-I/O Protocol"
        assert held == b"", "websockets: bytes after the 101 stayed in Protocol.reader.buffer"
        assert transport.get_protocol() is sink
        protocol.send_text(b"ping me back")
        transport.writelines(protocol.data_to_send())
        await asyncio.wait_for(sink.got.wait(), 5)
        protocol.receive_data(bytes(sink.received))
        (frame,) = protocol.events_received()
        assert frame.data == b"ping me back", "websockets: the sans-I/O protocol no longer parses what it sent back"
        transport.abort()
    finally:
        server.close()
        await server.wait_closed()


def test_websockets_protocol_reader_buffer_is_where_unparsed_bytes_wait() -> None:
    """Protocol.reader.buffer holds received bytes the parser has not consumed yet."""
    from websockets.client import ClientProtocol
    from websockets.protocol import State
    from websockets.uri import parse_uri

    protocol = ClientProtocol(parse_uri("ws://127.0.0.1/"), state=State.OPEN)
    protocol.receive_data(b"\x81")  # half a frame header
    buffer = getattr(getattr(protocol, "reader", None), "buffer", None)
    assert isinstance(buffer, bytearray | bytes), (
        "websockets: Protocol.reader.buffer is gone; proxy.contracts.ws_take_over must find another way to see "
        "bytes the library holds after the handshake"
    )
    assert bytes(buffer) == b"\x81", "websockets: Protocol.reader.buffer no longer holds the unparsed bytes"


def test_websockets_parser_error_is_exposed() -> None:
    """ws_parser_error: Protocol.parser_exc is set when the parser stops on a violation."""
    from websockets.client import ClientProtocol
    from websockets.protocol import State
    from websockets.uri import parse_uri

    protocol = ClientProtocol(parse_uri("ws://127.0.0.1/"), state=State.OPEN)
    assert proxy.contracts.ws_parser_error(protocol) is None
    protocol.receive_data(b"\x83\x00")  # a reserved opcode
    assert proxy.contracts.ws_parser_error(protocol) is not None, "websockets: Protocol.parser_exc is not set"


async def test_an_upgraded_connections_reader_can_be_wrapped() -> None:
    """The relay counts a WebSocket message's bytes before aiohttp assembles it."""
    seen: list[int] = []

    class Counting:
        def __init__(self, reader: Any) -> None:
            self.reader = reader

        def feed_data(self, data: bytes) -> Any:
            seen.append(len(data))
            return self.reader.feed_data(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.reader, name)

    async def echo(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        contracts.wrap_upgraded_reader(request, Counting)
        async for msg in ws:
            await ws.send_bytes(msg.data)
        return ws

    app = web.Application()
    app.router.add_get("/", echo)
    ws_runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await ws_runner.setup()
    site = web.TCPSite(ws_runner, "127.0.0.1", 0)
    await site.start()
    port = next(a for a in ws_runner.addresses if isinstance(a, tuple))[1]
    try:
        async with aiohttp.ClientSession() as session, session.ws_connect(f"http://127.0.0.1:{port}/") as ws:
            await ws.send_bytes(b"x" * 100_000)
            echoed = await ws.receive_bytes(timeout=10)
    finally:
        await ws_runner.cleanup()
    assert echoed == b"x" * 100_000
    assert sum(seen) >= 100_000, f"{AIOHTTP}: the wrapped reader did not see the message's bytes ({seen})"


def test_module_imports() -> None:
    assert proxy.contracts.__doc__
