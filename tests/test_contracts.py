"""Contract tests for every library internal read in proxy/contracts.py: each fails with a clear
message when aiohttp or websockets changes what the accessor relies on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import proxy.contracts

# --- aiohttp -------------------------------------------------------------------------------


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


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_websockets_connection_can_be_taken_over_after_the_handshake(loop_kind: str) -> None:
    """Under both event loops the sidecar runs on (uvloop's transports are no asyncio.Transport)."""
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    else:
        runner = asyncio.Runner()
    with runner:
        runner.run(_take_over())


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


def test_module_imports() -> None:
    assert proxy.contracts.__doc__
