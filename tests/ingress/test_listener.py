"""The hardened API listener: a header deadline and a bound on open connections."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from tests.conftest import SidecarFactory

SLOW = 200


async def _half_request(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/respo")  # half a request line, then nothing
    await writer.drain()
    return reader, writer


async def test_connections_without_complete_headers_are_closed(make_sidecar: SidecarFactory) -> None:
    """200 connections that sent half a request line are all closed by the header deadline,
    and a normal client is served meanwhile."""
    sidecar = await make_sidecar(listener={"header_timeout_seconds": 1.0})
    slow = await asyncio.gather(*(_half_request(sidecar.port) for _ in range(SLOW)))
    async with aiohttp.ClientSession() as session:
        async with session.get(sidecar.url + "/nothing-here") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["type"] == "invalid_request_error"
    # every slow connection sees the server's close (bounded wait only so a bug cannot hang)
    async with asyncio.timeout(15):
        closed = await asyncio.gather(*(reader.read() for reader, _ in slow))
    assert closed == [b""] * SLOW
    for _, writer in slow:
        writer.close()
    assert sidecar.server.guard.open == 0


async def test_a_keep_alive_connection_gets_the_deadline_per_request(make_sidecar: SidecarFactory) -> None:
    sidecar = await make_sidecar(listener={"header_timeout_seconds": 1.0})
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
    writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404")
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
    await reader.readexactly(length)
    writer.write(b"GET /y HTTP/1.1\r\nHo")  # the next request stalls in its headers
    async with asyncio.timeout(15):
        assert await reader.read() == b""
    writer.close()


async def test_a_kept_alive_connection_is_not_closed_by_an_earlier_requests_deadline(
    make_sidecar: SidecarFactory,
) -> None:
    """The deadline of a request whose headers arrived must not fire later, on the idle moment
    after its answer, and close the connection just as the client reuses it."""
    sidecar = await make_sidecar(listener={"header_timeout_seconds": 0.5})
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
    for _ in range(2):
        writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 404")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
        await reader.readexactly(length)
        await asyncio.sleep(0.7)  # idle past the first request's deadline
    assert not reader.at_eof()
    writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 404")
    writer.close()


async def test_open_connections_are_bounded(make_sidecar: SidecarFactory) -> None:
    sidecar = await make_sidecar(listener={"max_connections": 20, "header_timeout_seconds": 30.0})
    held = [await asyncio.open_connection("127.0.0.1", sidecar.port) for _ in range(20)]
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
    async with asyncio.timeout(15):
        refusal = await reader.read()
    head, _, body = refusal.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"x-upshift-refused: max_connections" in head
    assert orjson.loads(body)["error"]["code"] == "too_many_connections"
    writer.close()
    for _, w in held:
        w.close()
    # once they are gone, new connections are served again
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            if sidecar.server.guard.open == 0:
                break
            await asyncio.sleep(0.02)
        async with session.get(sidecar.url + "/v1/nothing", headers={"Authorization": "Bearer x"}) as resp:
            assert resp.status != 503


async def _served(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: bytes = b"/x") -> bytes:
    writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: a\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
    await reader.readexactly(length)
    return head


async def _closed(reader: asyncio.StreamReader, wait: float = 2.0) -> bool:
    try:
        async with asyncio.timeout(wait):
            return await reader.read() == b""
    except TimeoutError:
        return False


async def test_at_the_limit_an_idle_keep_alive_connection_makes_room(make_sidecar: SidecarFactory) -> None:
    """Four idle keep-alive connections fill the listener: a fifth client is served, and the
    least recently active idle connection is the one closed for it."""
    sidecar = await make_sidecar(listener={"max_connections": 4})
    held = [await asyncio.open_connection("127.0.0.1", sidecar.port) for _ in range(4)]
    for reader, writer in held:
        assert (await _served(reader, writer)).startswith(b"HTTP/1.1 404")
    await _served(*held[0])  # the first is now the most recently active
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
    assert (await _served(reader, writer)).startswith(b"HTTP/1.1 404")  # not a 503
    assert await _closed(held[1][0])  # the least recently active idle one went
    assert not held[0][0].at_eof()
    assert (await _served(*held[0])).startswith(b"HTTP/1.1 404")  # the others keep working
    for _, w in [*held, (reader, writer)]:
        w.close()


async def test_at_the_limit_a_connection_stalled_in_its_headers_makes_room(make_sidecar: SidecarFactory) -> None:
    sidecar = await make_sidecar(listener={"max_connections": 4, "header_timeout_seconds": 30.0})
    stalled = [await _half_request(sidecar.port) for _ in range(4)]
    await asyncio.sleep(1.2)  # stalled for longer than a client needs to send its headers
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
    assert (await _served(reader, writer)).startswith(b"HTTP/1.1 404")
    assert await _closed(stalled[0][0])  # the one stalled longest
    writer.close()
    for _, w in stalled:
        w.close()


async def test_connections_with_a_request_in_progress_are_never_reaped(make_sidecar: SidecarFactory) -> None:
    """Control: requests whose bodies are still arriving hold their connections (their body has
    its own deadline); the fifth connection is refused."""
    sidecar = await make_sidecar(listener={"max_connections": 4})
    busy = []
    for _ in range(4):
        reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
        writer.write(b'POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"model"')
        await writer.drain()
        busy.append((reader, writer))
    await asyncio.sleep(1.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
    async with asyncio.timeout(15):
        refusal = await reader.read()
    assert refusal.startswith(b"HTTP/1.1 503") and b"max_connections" in refusal
    assert not any(r.at_eof() for r, _ in busy)
    writer.close()
    for _, w in busy:
        w.close()


async def test_the_admin_listener_has_the_same_limits(make_sidecar: SidecarFactory) -> None:
    """The admin port: a header deadline and the connection bound, as the API port has."""
    sidecar = await make_sidecar(listener={"max_connections": 3, "header_timeout_seconds": 1.0})
    port = sidecar.server.admin_address[1]
    slow = await _half_request(port)
    async with asyncio.timeout(15):
        assert await slow[0].read() == b""  # closed by the header deadline
    slow[1].close()
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    async with asyncio.timeout(15):
        refusal = await reader.read()
    assert refusal.startswith(b"HTTP/1.1 503") and b"max_connections" in refusal
    for _, w in [*held, (reader, writer)]:
        w.close()
    # control: an ordinary probe is served
    for _ in range(100):
        if sidecar.server.admin_guard.open == 0:
            break
        await asyncio.sleep(0.02)
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/healthz") as resp:
        assert resp.status == 200
