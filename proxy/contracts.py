"""The one door to library internals: every private attribute of aiohttp or websockets that the
sidecar must read or set is read or set here, and nowhere else.

Each accessor names the library version range it was checked against; ``tests/test_contracts.py``
has one contract test per accessor that fails with a clear message when the library changes the
internal (CI runs it at the lowest and highest allowed versions, ``.ci/constraints-*.txt``).
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from aiohttp import ClientRequest, ClientResponse, ClientTimeout, UnixConnector, web
from aiohttp.client_exceptions import UnixClientConnectorError
from aiohttp.client_proto import ResponseHandler
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server as LowServer
from websockets.protocol import Protocol


class ContractBroken(RuntimeError):
    """A library no longer has the internal an accessor relies on (upgrade or pin the library)."""


# --- aiohttp -------------------------------------------------------------------------------
# Checked against aiohttp 3.14.0 .. 3.14.5 (.ci/constraints-low.txt, .ci/constraints-high.txt).
# RequestHandler state read by the hardened listener (proxy/ingress/listener.py), which
# subclasses RequestHandler (a public class) and reads its state only through these.

REQUEST_HANDLER_STATE = (
    "_messages",
    "_request_count",
    "_upgraded",
    "_request_in_progress",
    "_message_tail",
    "_reading_paused",
    "_buffer_paused",
    "_loop",
)
"""The ``RequestHandler`` attributes read below (the contract test checks each exists)."""


def handler_queued(handler: RequestHandler) -> bool:
    """Whether the handler holds parsed messages its request loop has not taken yet."""
    return bool(handler._messages)


def handler_last_payload(handler: RequestHandler) -> Any:
    """The payload (``StreamReader``) of the last message parsed, ``None`` if none is queued."""
    messages = handler._messages
    return messages[-1][1] if messages else None


def handler_request_count(handler: RequestHandler) -> int:
    """Requests the handler's loop has started on this connection."""
    return int(handler._request_count)


def handler_upgraded(handler: RequestHandler) -> bool:
    """Whether the connection was upgraded (a WebSocket): HTTP parsing stopped."""
    return bool(handler._upgraded)


def handler_in_progress(handler: RequestHandler) -> bool:
    """Whether a request is being handled (between its headers and its answer's end)."""
    return bool(handler._request_in_progress)


def handler_holds_nothing_more(handler: RequestHandler) -> bool:
    """Whether the handler holds no bytes or message beyond the current request (nothing
    queued, no partial message, not upgraded, reading neither paused by it nor by its buffer)."""
    return not (
        handler._messages
        or handler._message_tail
        or handler._upgraded
        or handler._reading_paused
        or handler._buffer_paused
    )


def handler_loop(handler: RequestHandler) -> asyncio.AbstractEventLoop:
    """The event loop the handler runs on."""
    loop: asyncio.AbstractEventLoop = handler._loop
    return loop


def handler_arguments(server: LowServer) -> dict[str, Any]:
    """Keyword arguments (``loop`` included) the low-level server passes every
    ``RequestHandler`` it makes: what a protocol factory of our own must pass too."""
    return {"loop": server._loop, **server._kwargs}


def site_runner(site: web.BaseSite) -> web.BaseRunner:
    """The runner a site was made for."""
    runner: web.BaseRunner = site._runner
    return runner


def site_listening(site: web.BaseSite, server: asyncio.AbstractServer) -> None:
    """Make ``server`` (created with our protocol factory) the site's listening server: the
    runner's ``addresses`` and the site's ``stop`` then use it."""
    site._server = server


def site_backlog(site: web.BaseSite) -> int:
    """The listen backlog the site was made with."""
    return int(site._backlog)


def send_headers_with_first_write(response: web.StreamResponse) -> None:
    """Hold a prepared response's headers until its first body write (one write for both)."""
    response._send_headers_immediately = False


def wrap_upgraded_reader(request: web.BaseRequest, wrap: Any) -> None:
    """Route every byte an upgraded (WebSocket) connection reads through ``wrap(reader)`` before
    aiohttp's WebSocket reader parses it; called after ``WebSocketResponse.prepare``.

    Reads ``RequestHandler._payload_parser`` (set by the upgrade to the connection's WebSocket
    reader, whose ``feed_data(data)`` gets the bytes as they are read) and sets it to what
    ``wrap`` returns: an object with the same ``feed_data`` that hands the bytes on. The relay
    counts a message's bytes this way before aiohttp assembles it (no public hook sees them).
    """
    protocol = request.protocol
    reader = getattr(protocol, "_payload_parser", None)
    if not callable(getattr(reader, "feed_data", None)):
        raise ContractBroken("aiohttp: RequestHandler._payload_parser (an upgraded connection's reader) is gone")
    protocol._payload_parser = wrap(reader)


def client_response_transport(response: ClientResponse) -> asyncio.Transport | None:
    """The transport a client answer came on, also once its connection went back to the pool
    (a small answer read whole with its headers releases it before the caller sees it):
    ``ClientResponse._protocol``'s transport, ``None`` if it is closed."""
    transport = getattr(getattr(response, "_protocol", None), "transport", None)
    return cast("asyncio.Transport | None", transport)


class CheckedUnixConnector(UnixConnector):
    """``UnixConnector`` that checks who listens on the socket before a byte is sent.

    ``check`` gets the connected socket and raises ``OSError`` to refuse it: the request then
    fails as a refused connection does (``ClientConnectorError``), not a byte sent. Overrides
    ``_create_connection``, the connector's one connection-making hook (no public hook sees the
    socket before the request is written).
    """

    def __init__(self, path: str, check: Any, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.check = check

    async def _create_connection(
        self, req: ClientRequest, traces: list[Any], timeout: ClientTimeout
    ) -> ResponseHandler:
        proto = await super()._create_connection(req, traces, timeout)
        transport = proto.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        try:
            if sock is None:
                raise OSError("no socket to check")
            self.check(sock)
        except OSError as exc:
            if transport is not None:
                transport.abort()
            raise UnixClientConnectorError(self.path, req.connection_key, exc) from exc
        return proto


# --- websockets ----------------------------------------------------------------------------
# (accessors for websockets internals go in this section)
# Checked against websockets 15.0 – 16.x (pyproject's range). ``proxy/upstream/ws.py`` takes an
# open client connection over after the handshake and from then on speaks to websockets only
# through its documented sans-I/O ``Protocol`` (send_*, data_to_send, receive_data,
# events_received, close_expected, close_rcvd/close_sent, state, extensions).


def ws_take_over(connection: object, protocol: asyncio.BaseProtocol) -> tuple[asyncio.Transport, Protocol, bytes]:
    """Take an open ``websockets.asyncio.client.ClientConnection``'s transport over: from now on
    ``protocol`` receives its bytes, and the connection object is only kept for its sans-I/O
    protocol.

    Reads three internals: ``connection.transport`` (the asyncio transport, set by the
    library's ``connection_made``), ``connection.protocol`` (the sans-I/O protocol; public in
    the docs, but its type is checked here too) and ``protocol.reader.buffer`` (bytes the library
    received after the 101 and did not parse yet: a frame reader of our own may take over only
    when that is empty).

    Returns:
        ``(transport, sans-I/O protocol, bytes held by the library's reader)``.
    """
    transport: Any = getattr(connection, "transport", None)
    sans_io = getattr(connection, "protocol", None)
    # asyncio's or uvloop's transport (uvloop's does not subclass asyncio.Transport).
    if not callable(getattr(transport, "set_protocol", None)) or not isinstance(sans_io, Protocol):
        raise ContractBroken("websockets: ClientConnection.transport / .protocol are not a transport / Protocol")
    reader = getattr(sans_io, "reader", None)
    buffer = getattr(reader, "buffer", None)
    if not isinstance(buffer, bytearray | bytes):
        raise ContractBroken("websockets: Protocol.reader.buffer (the received, unparsed bytes) is gone")
    held = bytes(buffer)
    transport.set_protocol(protocol)
    return cast(asyncio.Transport, transport), sans_io, held


def ws_parser_error(protocol: Protocol) -> Exception | None:
    """The exception websockets' parser stopped on (``Protocol.parser_exc``), if any."""
    try:
        exc = protocol.parser_exc
    except AttributeError as missing:
        raise ContractBroken("websockets: Protocol.parser_exc is gone") from missing
    return exc
