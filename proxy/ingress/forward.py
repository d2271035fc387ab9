"""Forwarding one request to its owner and relaying the answer, over aiohttp's client.

One :class:`Peer` per owner (a replica's URL, or a worker's private unix socket), each with its
own ``ClientSession``: its connector keeps at most ``cluster.max_forwards_per_peer``
connections (alive between forwards), the peer's semaphore bounds forwards in flight. HTTP/1.1
itself (heads, ``100-continue``, chunked bodies, keep-alive) is aiohttp's; this module only
decides timeouts, what is forwarded and how the answer reaches the app
(:mod:`proxy.ingress.cluster` states the rules).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from proxy.contracts import CheckedUnixConnector
from proxy.core.channel import nested_error
from proxy.errors import UpstreamClosed
from proxy.reasons import ForwardOutcome
from proxy.serve.streaming import json_body
from proxy.upstream.forwarding import HOP_BY_HOP
from proxy.wire import sse

__all__ = ["Answer", "Level", "Peer", "PeerError", "relay"]

log = logging.getLogger(__name__)

OWNER_HEADER = "x-upshift-owner"
REFUSED_HEADER = "x-upshift-refused"
_RESPONSE_DROP = HOP_BY_HOP | {"content-length", "date", "server"}
_IDLE_KEEP_SECONDS = 20.0
"""An idle forwarding connection older than this is closed instead of reused (owners close
keep-alive connections after ``listener.keepalive_seconds``)."""
_MAX_JSON_ANSWER = 512 * 1024 * 1024
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
"""aiohttp adds these when absent: a forward carries only what the app sent."""


class Level(enum.StrEnum):
    """Where a forward goes."""

    REPLICA = "replica"
    WORKER = "worker"


class PeerError(Exception):
    """The owner's connection failed or misbehaved before its answer."""


@dataclass(slots=True)
class Peer:
    """One owner and the connections to it."""

    name: str
    level: Level
    base: str
    """Base URL requests go to (``http://localhost`` for a worker's unix socket)."""
    make_connector: Callable[[], aiohttp.BaseConnector]
    slots: asyncio.Semaphore
    server_name: str | None = None
    """TLS name checked instead of the URL's host (``cluster.tls_server_name``)."""
    down_until: float = 0.0
    proven_until: float = 0.0
    session: aiohttp.ClientSession | None = field(default=None)

    def client(self) -> aiohttp.ClientSession:
        if self.session is None or self.session.closed:
            self.session = aiohttp.ClientSession(
                connector=self.make_connector(), auto_decompress=False, skip_auto_headers=_NO_AUTO_HEADERS
            )
        return self.session

    async def close(self) -> None:
        """Close its connections (idle ones at once; a forward in flight is cut)."""
        session, self.session = self.session, None
        if session is not None:
            await session.close()

    def url(self, raw_path: str) -> URL:
        return URL(self.base + raw_path, encoded=True)


def replica_peer(url: str, limit: int, tls: ssl.SSLContext | None, server_name: str = "") -> Peer:
    def connector() -> aiohttp.BaseConnector:
        return aiohttp.TCPConnector(
            limit=limit, keepalive_timeout=_IDLE_KEEP_SECONDS, ssl=tls if tls is not None else True
        )

    name = server_name if server_name and url.startswith("https://") else None
    return Peer(url, Level.REPLICA, url.rstrip("/"), connector, asyncio.Semaphore(limit), name)


def worker_peer(index: int, path: str, limit: int, check: Callable[[Any], None]) -> Peer:
    def connector() -> aiohttp.BaseConnector:
        return CheckedUnixConnector(path, check, limit=limit, keepalive_timeout=_IDLE_KEEP_SECONDS)

    return Peer(f"worker-{index}", Level.WORKER, "http://localhost", connector, asyncio.Semaphore(limit))


@dataclass(slots=True)
class Answer:
    status: int
    headers: CIMultiDict[str]
    response: aiohttp.ClientResponse


def _drop(task: asyncio.Future[aiohttp.ClientResponse]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()


async def _body_once(body: bytes, sent: asyncio.Event) -> AsyncIterator[bytes]:
    sent.set()  # aiohttp asks for the body only after the owner's 100 Continue
    yield body


async def send(
    peer: Peer, request: web.Request, headers: CIMultiDict[str], body: bytes, *, connect: float, idle: float
) -> Answer:
    """Send the forward; the owner's answer head.

    A replica gets ``Expect: 100-continue``: its ``100 Continue`` (proof that its event loop
    runs) must come within ``connect`` seconds, then the answer head within ``idle``. A worker
    on the same machine is sent head and body at once: its unix socket refuses a connection
    when it is gone, and the supervisor restarts one that hangs.

    Raises:
        TimeoutError: no connection or no ``100 Continue`` within ``connect``.
        OSError: connecting failed (refused, unreachable, a private socket not ours).
        PeerError: the connection broke, or no answer within ``idle``.
    """
    timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect, sock_read=idle)
    headers["Content-Length"] = str(len(body))
    for attempt in range(2):
        continued = asyncio.Event()
        expect = peer.level is Level.REPLICA
        data: Any = _body_once(body, continued) if expect else body
        client = peer.client()
        call = client.request(
            "POST",
            peer.url(request.raw_path),
            data=data,
            headers=headers,
            expect100=expect,
            allow_redirects=False,
            timeout=timeout,
            server_hostname=peer.server_name,
        )
        sending = asyncio.ensure_future(call)
        try:
            if expect:
                waiter = asyncio.ensure_future(continued.wait())
                try:
                    done, _ = await asyncio.wait(
                        {sending, waiter}, timeout=connect, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    waiter.cancel()
                if not done:
                    raise TimeoutError
            response = await sending
        except aiohttp.ConnectionTimeoutError:
            raise TimeoutError from None
        except aiohttp.ClientConnectorError as exc:
            raise OSError(str(exc)) from None
        except aiohttp.ServerDisconnectedError as exc:
            # A kept-alive connection the owner had closed meanwhile, before the body went (a
            # replica: no 100 Continue came) or before anything was answered: once more, fresh.
            if attempt == 0 and not continued.is_set():
                continue
            raise PeerError(str(exc) or type(exc).__name__) from None
        except aiohttp.ClientError as exc:  # a read timeout after the body, a broken answer
            raise PeerError(str(exc) or type(exc).__name__) from None
        except RuntimeError:
            if not client.closed:
                raise
            # Another forward marked this peer down (and closed its session) before this one
            # started: nothing was sent, so it is served locally like any unreachable owner.
            raise OSError("the owner was marked down meanwhile") from None
        finally:
            if not sending.done():  # timed out or cancelled: the answer, if one comes, is dropped
                sending.add_done_callback(_drop)
                sending.cancel()
        return Answer(response.status, CIMultiDict(response.headers), response)
    raise PeerError("no connection")  # pragma: no cover - the second attempt raises or returns


def answer_headers(answer: Answer) -> CIMultiDict[str]:
    """The owner's answer headers without hop-by-hop ones (and those its Connection lists)."""
    listed = {h.strip().lower() for v in answer.headers.getall("Connection", []) for h in v.split(",")}
    return CIMultiDict(
        (k, v) for k, v in answer.headers.items() if k.lower() not in _RESPONSE_DROP and k.lower() not in listed
    )


async def relay(
    peer: Peer, request: web.Request, answer: Answer, idle: float
) -> tuple[web.StreamResponse, ForwardOutcome]:
    """The owner's answer to the app: an SSE stream as it arrives, a JSON body whole."""
    headers = answer_headers(answer)
    if answer.headers.get("Content-Type", "").startswith("text/event-stream"):
        return await _relay_stream(peer, request, answer, headers, idle)
    try:
        async with asyncio.timeout(idle):
            data = await _read_whole(answer.response)
    except (aiohttp.ClientError, TimeoutError, PeerError) as exc:
        answer.response.close()
        log.info("forwarded answer from %s cut: %s", peer.name, type(exc).__name__)
        err = UpstreamClosed("The connection to the owning process broke before the answer was complete.")
        response = web.Response(body=json_body(err.body()), status=err.status, content_type="application/json")
        return response, ForwardOutcome.CUT
    answer.response.release()
    return web.Response(body=data, status=answer.status, headers=headers), ForwardOutcome.OK


async def _read_whole(response: aiohttp.ClientResponse) -> bytes:
    parts, size = [], 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > _MAX_JSON_ANSWER:
            raise PeerError("answer too large")
        parts.append(chunk)
    return b"".join(parts)


async def _relay_stream(
    peer: Peer, request: web.Request, answer: Answer, headers: CIMultiDict[str], idle: float
) -> tuple[web.StreamResponse, ForwardOutcome]:
    """Complete events only are written (a cut stream then ends with one error event, never
    inside a half event); the bytes of each are the owner's, unchanged."""
    response = web.StreamResponse(status=answer.status, headers=headers)
    await response.prepare(request)
    decoder = sse.Decoder()
    last: sse.Event | None = None
    chunks = answer.response.content.iter_any()
    try:
        while True:
            try:
                async with asyncio.timeout(idle):
                    chunk = await anext(chunks, None)
                events = decoder.feed(chunk) if chunk is not None else []
            except (aiohttp.ClientError, TimeoutError, sse.EventTooLarge) as exc:
                answer.response.close()
                log.info("forwarded stream from %s cut: %s", peer.name, type(exc).__name__)
                await _write_cut(response, last)
                return response, ForwardOutcome.CUT
            if chunk is None:
                break
            if events:
                last = events[-1]
                # The app left: stop reading; the owner sees its connection go and drains the
                # upstream response itself.
                await response.write(b"".join(e.raw for e in events) if len(events) > 1 else events[0].raw)
        if pending := decoder.pending:
            await response.write(pending)
        await response.write_eof()
    except ConnectionResetError:
        answer.response.close()
        return response, ForwardOutcome.OK
    answer.response.release()
    return response, ForwardOutcome.OK


async def _write_cut(response: web.StreamResponse, last: sse.Event | None) -> None:
    """End a cut stream with one nested error event numbered after the last relayed one."""
    sequence = 0
    if last is not None:
        with contextlib.suppress(orjson.JSONDecodeError, TypeError, ValueError):
            event: Any = orjson.loads(last.data)
            if isinstance(event, dict) and isinstance(event.get("sequence_number"), int):
                sequence = event["sequence_number"] + 1
    err = UpstreamClosed("The connection to the owning process broke before the response finished; retry the request.")
    out = nested_error(sequence, type=err.type, code=err.code, message=err.message)
    with contextlib.suppress(ConnectionResetError):
        await response.write(sse.encode("error", orjson.dumps(out)))
        await response.write_eof()
