"""A TCP server of a test's own on 127.0.0.1: started and stopped as an async context manager,
every connection served by :meth:`LoopbackServer._serve`, whose tasks are cancelled at the end."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Self


class LoopbackServer:
    """Subclasses implement :meth:`_serve`; tasks they start go in ``_tasks`` to be cancelled."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
