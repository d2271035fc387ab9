"""The floor of a Python relay: the least work that turns an HTTP Responses turn into a WebSocket
mode one, measured beside the sidecar so that "a turn costs no more than a Python relay must"
is a ratio in one run, not a guess.

``python -m bench.floor PORT UPSTREAM`` serves ``POST /v1/responses`` (SSE, ``Content-Length``
bodies, keep-alive) on 127.0.0.1:PORT with uvloop and bare asyncio protocols, and relays each
turn over one upstream WebSocket per app connection: ``orjson.loads`` of the body, the input
past the last turn's items plus ``previous_response_id`` in one masked frame, then each event
frame parsed (``orjson.loads``: a relay has to know its type and its end) and written to the
app as SSE, one write per burst of frames. An ``https://`` upstream is reached over TLS
(``--ca``: the CA to trust), as the sidecar reaches a ``wss://`` one.

``--http`` serves the least an HTTP hop does instead (aiohttp on both sides): the app's body is
posted unchanged to the upstream's ``/v1/responses`` and the upstream's answer returned as it
came (JSON or SSE, streamed), the floor of a relay that sends every turn over plain HTTP, as the
sidecar does when the upstream has no socket for a turn.

It is a lower bound, not a product: no aiohttp, no websockets state machine, no matching beyond
"the same first item and more items than last time" (nothing verifies the prefix), no settings
check, no metrics, no log, no memory accounting, no error handling. Any correct relay does at
least this much per turn.
"""

from __future__ import annotations

import asyncio
import base64
import os
import ssl
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlsplit

import orjson
from websockets.speedups import apply_mask

from .procs import Managed, free_port
from .tls import LoopbackCA

__all__ = ["FloorProc", "main"]

_TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})
_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n"
_MAX_CHAINS = 10_000


class _Upstream(asyncio.Protocol):
    """One upstream WebSocket (client side): a hand-written upgrade, unfragmented frames."""

    def __init__(self) -> None:
        self.buffer = b""
        self.sink: Callable[[list[bytes]], None] | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self._handshake = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        buf = self.buffer + data
        if self._handshake:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buffer = buf
                return
            buf, self._handshake = buf[end + 4 :], False
            self.ready.set_result(None)
        pos, frames, size = 0, [], len(buf)
        while size - pos >= 2:
            length, header = buf[pos + 1] & 0x7F, 2
            if length == 126:
                if size - pos < 4:
                    break
                (length,), header = struct.unpack_from("!H", buf, pos + 2), 4
            elif length == 127:
                if size - pos < 10:
                    break
                (length,), header = struct.unpack_from("!Q", buf, pos + 2), 10
            if size - pos < header + length:
                break
            frames.append(buf[pos + header : pos + header + length])
            pos += header + length
        self.buffer = buf[pos:]
        if frames and self.sink is not None:
            self.sink(frames)

    def send(self, payload: bytes) -> None:
        assert self.transport is not None
        size, mask = len(payload), os.urandom(4)
        if size < 126:
            header = struct.pack("!BB", 0x81, 0x80 | size)
        elif size < 65536:
            header = struct.pack("!BBH", 0x81, 0xFE, size)
        else:
            header = struct.pack("!BBQ", 0x81, 0xFF, size)
        self.transport.writelines([header, mask, apply_mask(payload, mask)])


Chains = OrderedDict[bytes, tuple[int, str | None]]


def _create(body: bytes, chains: Chains) -> tuple[bytes, bytes, int]:
    """The ``response.create`` frame for a full-history body, its chain key and input length."""
    request: dict[str, Any] = orjson.loads(body)
    items = request.pop("input")
    request.pop("stream", None)
    key = orjson.dumps(items[0])
    known = chains.get(key)
    new, previous = (items[known[0] :], known[1]) if known and len(items) > known[0] else (items, None)
    frame = orjson.dumps({"type": "response.create", **request, "input": new, "previous_response_id": previous})
    return frame, key, len(items)


def _sse(frames: list[bytes], chains: Chains, key: bytes, n_input: int) -> tuple[bytes, bool]:
    """The SSE bytes of ``frames`` (up to the terminal one) and whether it came."""
    parts = []
    for raw in frames:
        event = orjson.loads(raw)
        kind = event["type"]
        parts.append(b"event: " + kind.encode() + b"\ndata: " + raw + b"\n\n")
        if kind in _TERMINAL:
            response = event.get("response") or {}
            chains[key] = (n_input + len(response.get("output") or []), response.get("id"))
            while len(chains) > _MAX_CHAINS:
                chains.popitem(last=False)
            return b"".join(parts), True
    return b"".join(parts), False


Address = tuple[str, int, ssl.SSLContext | None]
"""The upstream's host, port and TLS context (None: plain ``ws://``)."""


async def _connect(address: Address) -> _Upstream:
    host, port, context = address
    loop = asyncio.get_running_loop()
    _, up = await loop.create_connection(_Upstream, host, port, ssl=context, server_hostname=host if context else None)
    key = base64.b64encode(os.urandom(16)).decode()
    request = (
        f"GET /v1/responses HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer sk-test\r\n\r\n"
    )
    assert up.transport is not None
    up.transport.write(request.encode())
    await up.ready
    return up


class _App(asyncio.Protocol):
    """One app connection: requests in order, one upstream socket."""

    def __init__(self, upstream: Address, chains: OrderedDict[bytes, tuple[int, str | None]]) -> None:
        self.upstream_address = upstream
        self.chains = chains
        self.buffer = b""
        self.busy = False
        self.up: _Upstream | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].lower() + b"\r\n"
        at = head.find(b"content-length:")
        length = int(head[at + 15 : head.find(b"\r\n", at)]) if at >= 0 else 0
        total = end + 4 + length
        if len(self.buffer) < total:
            return
        body, self.buffer, self.busy = self.buffer[end + 4 : total], self.buffer[total:], True
        asyncio.get_running_loop().create_task(self._turn(body))

    async def _turn(self, body: bytes) -> None:
        if self.up is None:
            self.up = await _connect(self.upstream_address)
        frame, key, n_input = _create(body, self.chains)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        started = [False]
        transport = self.transport
        assert transport is not None

        def sink(frames: list[bytes]) -> None:
            data, end = _sse(frames, self.chains, key, n_input)
            out = [_HEAD] if not started[0] else []
            started[0] = True
            out.append(b"%x\r\n%s\r\n" % (len(data), data))
            if end:
                out.append(b"0\r\n\r\n")
            transport.writelines(out)
            if end and not done.done():
                done.set_result(None)

        self.up.sink = sink
        self.up.send(frame)
        await done
        self.busy = False
        if self.buffer:
            self._next()


def _aiohttp_app(address: Address, chains: Chains) -> Any:
    """The same relay with aiohttp serving the app side, as the sidecar does (``--aiohttp``): what
    aiohttp's request and response machinery adds to the floor."""
    from aiohttp import web

    ups: dict[int, _Upstream] = {}

    async def responses(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        conn = id(request.protocol)
        up = ups.get(conn)
        if up is None or up.transport is None or up.transport.is_closing():
            up = ups[conn] = await _connect(address)
        frame, key, n_input = _create(body, chains)
        frames: list[bytes] = []
        wake: list[asyncio.Future[None]] = []

        def sink(more: list[bytes]) -> None:
            frames.extend(more)
            if wake and not wake[0].done():
                wake[0].set_result(None)

        up.sink = sink
        up.send(frame)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        response._send_headers_immediately = False  # headers go with the first events, as the sidecar's
        await response.prepare(request)
        while True:
            if not frames:
                wake[:] = [asyncio.get_running_loop().create_future()]
                await wake[0]
            batch, frames[:] = list(frames), []
            data, end = _sse(batch, chains, key, n_input)
            if end:
                await response.write_eof(data)
                return response
            await response.write(data)

    app = web.Application(client_max_size=1 << 30)  # the sidecar's own body limit is its config's
    app.router.add_post("/v1/responses", responses)
    return app


def _http_app(upstream: str, context: ssl.SSLContext | None) -> Any:
    """The bare HTTP hop (``--http``): one client session, bodies and answers passed unchanged
    (built in the running loop, as ``_serve`` calls it)."""
    import aiohttp
    from aiohttp import web

    connector = aiohttp.TCPConnector(limit=0, ssl=context if context is not None else True)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=False)
    url = upstream.rstrip("/") + "/responses"

    async def responses(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {name: request.headers[name] for name in ("Authorization", "Content-Type") if name in request.headers}
        async with session.post(url, data=body, headers=headers) as upstream_answer:
            response = web.StreamResponse(status=upstream_answer.status)
            response.content_type = upstream_answer.content_type
            await response.prepare(request)
            async for chunk in upstream_answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/responses", responses)
    return app


async def _serve(port: int, upstream: str, with_aiohttp: bool, ca_file: str | None, http: bool = False) -> None:
    parts = urlsplit(upstream)
    tls = parts.scheme == "https"
    context = ssl.create_default_context(cafile=ca_file) if tls else None
    address = (parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80), context)
    chains: Chains = OrderedDict()
    if with_aiohttp or http:
        from aiohttp import web

        app = _http_app(upstream, context) if http else _aiohttp_app(address, chains)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()
    server = await asyncio.get_running_loop().create_server(lambda: _App(address, chains), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.floor PORT UPSTREAM [--aiohttp | --http] [--ca PEM]`` (uvloop where it is
    installed; an ``https://`` upstream over TLS, trusting the CA of ``--ca``)."""
    args = sys.argv[1:] if argv is None else argv
    ca_file = args[args.index("--ca") + 1] if "--ca" in args[2:] else None
    serve = _serve(int(args[0]), args[1], "--aiohttp" in args[2:], ca_file, http="--http" in args[2:])
    try:
        import uvloop

        uvloop.run(serve)
    except ImportError:
        asyncio.run(serve)


class FloorProc(Managed):
    """The floor relay as a process beside the sidecar (same interface as :class:`SidecarProc`)."""

    def __init__(
        self,
        log_dir: Any,
        upstream: str,
        *,
        with_aiohttp: bool = False,
        tls: LoopbackCA | None = None,
        http: bool = False,
    ) -> None:
        self.port = free_port()
        mode = ["--http"] if http else ["--aiohttp"] if with_aiohttp else []
        argv = [sys.executable, "-m", "bench.floor", str(self.port), upstream, *mode]
        if tls is not None:
            argv += ["--ca", str(tls.ca_file)]
        name = "floor-http" if http else "floor-aiohttp" if with_aiohttp else "floor"
        super().__init__(name + ("-tls" if tls else ""), argv, log_dir)

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

    async def ready(self, timeout: float = 20.0) -> None:
        """Wait until the port accepts connections."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return
            except OSError:
                if asyncio.get_running_loop().time() > deadline or not self.alive():
                    raise RuntimeError(f"the floor relay did not start: {self.log_tail()}") from None
                await asyncio.sleep(0.05)


if __name__ == "__main__":
    main()
