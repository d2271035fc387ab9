"""Every event one read of the upstream socket delivers reaches the app in one write.

A relay on 127.0.0.1 between the sidecar and the emulator holds the emulator's frames back until
the responses of the turn are complete, then hands them to the sidecar in one TCP write (one
segment on loopback: one read). The app reads the raw HTTP answer: aiohttp writes each of the
sidecar's writes as one chunk of the chunked encoding, so the chunks the app receives count the
sidecar's writes to it, whatever the kernel coalesced on the way.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any

import orjson

from tests.loopback import LoopbackServer
from tests.sidecar import Sidecar
from upshift_emulator import Emulator

_TERMINAL = (b'"response.completed"', b'"response.failed"', b'"response.incomplete"', b'"error"')


def _frames(buffer: bytearray) -> list[bytes]:
    """Whole server frames (unmasked) cut off the front of ``buffer``."""
    out = []
    while len(buffer) >= 2:
        size, head = buffer[1] & 0x7F, 2
        if size == 126:
            if len(buffer) < 4:
                break
            (size,), head = struct.unpack_from("!H", buffer, 2), 4
        elif size == 127:
            if len(buffer) < 10:
                break
            (size,), head = struct.unpack_from("!Q", buffer, 2), 10
        if len(buffer) < head + size:
            break
        out.append(bytes(buffer[: head + size]))
        del buffer[: head + size]
    return out


class Coalescer(LoopbackServer):
    """A TCP relay that passes the upgrade through, then holds the upstream's frames until
    ``turns`` terminal events arrived and writes everything it holds in one write."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__()
        self.upstream_port = upstream_port
        self.turns = 1
        self.writes = 0
        """Coalesced writes made to the sidecar (each: one read at the sidecar)."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _serve(self, app_r: asyncio.StreamReader, app_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        tasks = {asyncio.ensure_future(self._copy(app_r, up_w)), asyncio.ensure_future(self._hold(up_r, app_w))}
        self._tasks |= tasks
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for writer in (app_w, up_w):
                with contextlib.suppress(Exception):
                    writer.close()
            self._tasks -= tasks

    async def _copy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readuntil(b"\r\n\r\n"))  # the 101 answer, as it came
        buffer, held, ended = bytearray(), [], 0
        while data := await reader.read(65536):
            buffer += data
            for frame in _frames(buffer):
                held.append(frame)
                ended += frame[0] & 0x0F == 1 and any(t in frame[:120] for t in _TERMINAL)
            if ended >= self.turns:
                writer.write(b"".join(held))
                self.writes += 1
                held, ended = [], 0


async def _post(port: int, body: dict[str, Any]) -> list[bytes]:
    """POST over a raw connection; the chunks of the chunked answer, as the sidecar wrote them."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = orjson.dumps(body)
    writer.write(
        b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAuthorization: Bearer sk-test\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (port, len(data), data)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
    chunks = []
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        chunks.append((await reader.readexactly(size + 2))[:-2])
    await reader.readexactly(2)
    writer.close()
    return chunks


def _events(chunks: list[bytes]) -> list[str]:
    """The event types of an SSE body (``event: T\\ndata: JSON\\n\\n`` blocks)."""
    blocks = b"".join(chunks).split(b"\n\n")
    assert blocks[-1] == b""
    return [block.split(b"\n")[0].removeprefix(b"event: ").decode() for block in blocks[:-1]]


# 800 bytes of reply in deltas of 8 characters: over 100 events, about 25 KB of frames (one
# loopback segment).
_EMULATOR = {"reply_bytes": 800, "delta_chars": 8, "ws_compress": False}


async def test_one_read_of_many_events_is_one_write_to_the_app() -> None:
    async with Emulator(**_EMULATOR) as emu, Coalescer(emu.port) as relay, Sidecar(relay.base_url) as sc:
        for _ in range(3):
            writes_before = relay.writes
            chunks = await _post(sc.port, {"model": "gpt-6.1-sol", "input": "hi", "stream": True})
            assert relay.writes == writes_before + 1  # one read at the sidecar
            kinds = _events(chunks)
            assert len(kinds) > 100 and kinds[0] == "response.created" and kinds[-1] == "response.completed"
            assert len(chunks) == 1, [c.count(b"\n\n") for c in chunks]


def _body(text: str) -> dict[str, Any]:
    return {"model": "gpt-6.1-sol", "input": text, "stream": True}


async def test_one_read_for_two_lanes_is_one_write_to_each_app() -> None:
    pool = {"max_sockets_per_identity": 1}
    async with Emulator(**_EMULATOR) as emu, Coalescer(emu.port) as relay, Sidecar(relay.base_url, pool=pool) as sc:
        # The socket opens with a turn on its default lane; the next conversation's turn goes
        # on a named lane and proves the upstream takes lanes: then two may be in flight.
        await _post(sc.port, _body("warm up"))
        await _post(sc.port, _body("prove lanes"))
        relay.turns = 2
        writes_before = relay.writes
        first, second = await asyncio.gather(_post(sc.port, _body("one")), _post(sc.port, _body("two")))
        assert relay.writes == writes_before + 1  # both lanes' events in one read at the sidecar
        assert sc.pool.count() == 1
        for chunks in (first, second):
            assert _events(chunks)[-1] == "response.completed"
            assert len(chunks) == 1, [c.count(b"\n\n") for c in chunks]
