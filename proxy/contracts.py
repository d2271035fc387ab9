"""The one door to library internals: every private attribute of aiohttp or websockets that the
sidecar must read or set is read or set here, and nowhere else.

Each accessor names the library version range it was checked against; ``tests/test_contracts.py``
has one contract test per accessor that fails with a clear message when the library changes the
internal (CI runs it at the lowest and highest allowed versions, ``.ci/constraints-*.txt``).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
from aiohttp.client_exceptions import UnixClientConnectorError

__all__ = ["AbstractUnixConnector"]

# --- aiohttp -------------------------------------------------------------------------------
# (accessors for aiohttp internals go in this section)


class AbstractUnixConnector(aiohttp.UnixConnector):
    """``aiohttp.UnixConnector`` that also reaches abstract socket names (a leading NUL, the
    workers' private sockets on Linux) on uvloop, whose ``create_unix_connection(path=...)``
    refuses them: the socket is connected by hand and handed over with ``sock=``.

    Internals used (aiohttp 3.9 – 3.14): ``BaseConnector._create_connection(req, traces,
    timeout)`` (overridden), ``BaseConnector._factory`` and ``BaseConnector._loop``.
    """

    async def _create_connection(self, req: Any, traces: Any, timeout: aiohttp.ClientTimeout) -> Any:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        loop = self._loop
        try:
            async with asyncio.timeout(timeout.sock_connect):
                await loop.sock_connect(sock, self.path)
        except OSError as exc:
            sock.close()
            raise UnixClientConnectorError(self.path, req.connection_key, exc) from exc
        except BaseException:
            sock.close()
            raise
        factory: Any = self._factory
        _, proto = await loop.create_unix_connection(factory, sock=sock)
        return proto


# --- websockets ----------------------------------------------------------------------------
# (accessors for websockets internals go in this section)
