"""Misbehaving peers on real loopback sockets: what a broken or overloaded replica looks like."""

from __future__ import annotations

import asyncio
import contextlib

import orjson

from proxy.wire.sse import encode
from tests.loopback import LoopbackServer


class FakePeer(LoopbackServer):
    """A TCP server on 127.0.0.1 that plays a peer replica.

    Behaviours: ``silent`` (accepts, reads, never answers), ``error_500`` (a plain 500 that no
    upshift wrote), ``hang_up`` (reads the whole request, then closes without an answer),
    ``cut_sse`` (two SSE events, then the connection breaks), ``cut_json`` (a JSON answer
    shorter than its Content-Length), ``slow_ok`` (a complete JSON answer after ``delay``).
    """

    def __init__(self, behaviour: str, delay: float = 0.3) -> None:
        super().__init__()
        self.behaviour = behaviour
        self.delay = delay
        self.requests = 0
        self.concurrent = 0
        self.max_concurrent = 0

    @property
    def open_connections(self) -> int:
        """Connections open to this peer right now."""
        return len(self._tasks)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests += 1
                self.concurrent += 1
                self.max_concurrent = max(self.max_concurrent, self.concurrent)
                try:
                    if not await self._one(head, reader, writer):
                        return
                finally:
                    self.concurrent -= 1
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
            self._tasks.discard(task)

    async def _one(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        if self.behaviour == "silent":
            await reader.read(-1)
            return False
        if self.behaviour == "error_500":
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 5\r\n\r\noops!")
            await writer.drain()
            return False
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await reader.readexactly(length)
        if self.behaviour == "hang_up":
            return False
        owner = b"x-upshift-owner: fake\r\nx-upshift-mode: continuation\r\n"
        if self.behaviour == "cut_sse":
            events = b"".join(
                encode(t, orjson.dumps({"type": t, "sequence_number": n, "response": {"id": "resp_f"}}))
                for n, t in enumerate(("response.created", "response.in_progress"))
            )
            chunk = f"{len(events):x}\r\n".encode() + events + b"\r\n"
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                + owner
                + b"Transfer-Encoding: chunked\r\n\r\n"
                + chunk
                + b"5\r\nevent"  # half of a third event, then the connection breaks
            )
            await writer.drain()
            return False
        if self.behaviour == "cut_json":
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + owner
            writer.write(head + b'Content-Length: 1000\r\n\r\n{"id":')
            await writer.drain()
            return False
        await asyncio.sleep(self.delay)
        body = orjson.dumps({"id": "resp_fake", "object": "response", "output": []})
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + owner
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        return True
