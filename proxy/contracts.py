"""The one door to library internals: every private attribute of aiohttp or websockets that the
sidecar must read or set is read or set here, and nowhere else.

Each accessor names the library version range it was checked against; ``tests/test_contracts.py``
has one contract test per accessor that fails with a clear message when the library changes the
internal (CI runs it at the lowest and highest allowed versions, ``.ci/constraints-*.txt``).
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from websockets.protocol import Protocol


class ContractBroken(RuntimeError):
    """A library no longer has the internal an accessor relies on (upgrade or pin the library)."""


# --- aiohttp -------------------------------------------------------------------------------
# (accessors for aiohttp internals go in this section)


# --- websockets ----------------------------------------------------------------------------
# (accessors for websockets internals go in this section)
# Checked against websockets 15.0 – 16.x (pyproject's range). ``proxy/upstream/ws.py`` takes an
# open client connection over after the handshake and from then on speaks to websockets only
# through its documented sans-I/O ``Protocol`` (send_*, data_to_send, receive_data,
# events_received, close_expected, close_rcvd/close_sent, state, extensions).


def ws_take_over(connection: object, protocol: asyncio.Protocol) -> tuple[asyncio.Transport, Protocol, bytes]:
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
