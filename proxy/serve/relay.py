"""WebSocket-native apps (``client.responses.connect()``, Codex): relay frame by frame.

A ``GET /v1/responses`` with ``Upgrade: websocket`` gets an upstream socket of its own (not
pooled: the app drives its own chain) with the app's identity headers. The upgrade is answered
only after the upstream accepted, so a refused upstream upgrade is answered with the same status
(426 when there is none: the de-facto "use HTTP instead" signal), never a hang, 404 or 405.
Frames go through unchanged in both directions; close codes propagate both ways.

Inside the sidecar's limits: an app message may be as large as the upstream's own
frame budget (``limits.ws_frame_budget_bytes``) and a request body (``limits.max_body_bytes``;
larger: close 1009, refused from the frame header, never read), a session's messages are paid
for in the memory budget as their bytes are read, before aiohttp assembles them
(:class:`~proxy.intake.meter.MessageMeter`: reading pauses while the budget is taken; after
``limits.memory_wait_seconds`` the app gets the budget's ``error`` event and the session closes
1013, nothing of the message sent), and a
session counts as one upstream socket against ``pool.max_sockets_per_identity`` and
``pool.max_sockets_total`` (beyond them: close 1013 saying which limit, no upstream socket).
The per-credential quota is the tenant's (:attr:`Identity.tenant`: the app's credential,
whatever query string or optional headers it adds), and a session with no message in either
direction for ``pool.idle_close_seconds`` is closed (1001), as an idle pooled socket is: a
tenant cannot keep slots it does not use.
Every app frame is read as one JSON object (what does not parse, or repeats a key naming an id,
gets an ``invalid_request_error`` event and goes nowhere); one naming a ``previous_response_id``
must name the identity's own response (:mod:`proxy.serve.creator_check`), else it gets the upstream's
``previous_response_not_found`` event;
every ``response.created`` the upstream sends is recorded as the identity's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import WSMsgType, web
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from proxy import contracts
from proxy.core.creators import created_id
from proxy.core.named_ids import PARSE_INLINE, read_request
from proxy.core.tenants import tenant_of
from proxy.errors import InvalidRequest, ProxyError, RequestError, UpstreamRefused, UpstreamUnavailable
from proxy.intake.identity import Identity
from proxy.intake.memory import MemoryRefused
from proxy.intake.meter import MessageMeter
from proxy.observe.metrics import ERRORS, INFLIGHT
from proxy.reasons import Mode, Route
from proxy.serve.creator_check import OwnerBook
from proxy.serve.handlers import SERVICES, Services, refuse
from proxy.serve.record import Record
from proxy.serve.streaming import json_body, new_request_id
from proxy.upstream.handshake import open_websocket

__all__ = ["RELAY_REFUSED_CODE", "relay_websocket", "sendable_code"]

log = logging.getLogger(__name__)

_UNSENDABLE = {1005: 1000, 1006: 1011, 1015: 1011}
"""Codes that only describe a close and cannot be sent in a Close frame."""
RELAY_REFUSED_CODE = 1013
"""Close code of a relay session refused at the socket limits (RFC 6455 "Try Again Later")."""
_MAX_REASON = 123
"""A close frame's reason is at most 123 bytes."""


def sendable_code(code: int | None) -> int:
    """A close code that may go in a Close frame, closest in meaning to ``code``."""
    if code is None:
        return 1000
    if code in _UNSENDABLE:
        return _UNSENDABLE[code]
    if 1000 <= code <= 1014 and code not in (1004,) or 3000 <= code <= 4999:
        return code
    return 1011


async def relay_websocket(request: web.Request) -> web.StreamResponse:
    """Relay one downstream WebSocket session to an upstream socket of its own."""
    svc = request.app[SERVICES]
    started = time.perf_counter()
    rec = Record(new_request_id(), route=Route.RESPONSES_WS, mode=Mode.RELAY)
    headers = {"x-request-id": rec.request_id}
    INFLIGHT.inc()
    try:
        try:
            identity = svc.identity(request)
        except RequestError as exc:
            return refuse(exc, headers, rec, started)
        refusal = _over_socket_limits(svc, identity)
        if refusal is not None:
            return await _refuse_session(request, headers, rec, refusal)
        # a relay's upstream socket counts against the pool's socket limits.
        svc.relay_sessions[identity.digest] += 1
        try:
            return await _session(request, svc, identity, headers, rec, started)
        finally:
            svc.relay_sessions[identity.digest] -= 1
            if svc.relay_sessions[identity.digest] <= 0:
                del svc.relay_sessions[identity.digest]
    finally:
        INFLIGHT.dec()
        rec.finish()


async def _session(
    request: web.Request, svc: Services, identity: Identity, headers: dict[str, str], rec: Record, started: float
) -> web.StreamResponse:
    # The session's messages are paid as their bytes arrive, from its first step on (a session
    # the budget cannot take is refused before any upstream socket is opened).
    limits = svc.settings.limits
    largest = min(limits.ws_frame_budget_bytes, limits.max_body_bytes or limits.ws_frame_budget_bytes)
    memory = svc.memory
    meter = MessageMeter(memory, largest, key=identity.tenant, keyless=identity.keyless) if memory else None
    try:
        if meter is not None:
            try:
                await meter.open()
            except MemoryRefused as exc:
                return refuse(exc, exc.headers(rec.request_id), rec, started)
        return await _upgraded(request, svc, identity, headers, rec, started, meter)
    finally:
        if meter is not None:
            meter.close()


async def _upgraded(
    request: web.Request,
    svc: Services,
    identity: Identity,
    headers: dict[str, str],
    rec: Record,
    started: float,
    meter: MessageMeter | None,
) -> web.StreamResponse:
    try:
        upstream = await open_websocket(identity.ws_url, identity.headers, svc.settings)
    except UpstreamRefused as exc:
        status = exc.http_status if 400 <= exc.http_status <= 599 else 426
        rec.responded(status)
        kind = exc.headers.get("content-type", "application/json")
        return web.Response(status=status, body=exc.payload, headers={**headers, "Content-Type": kind})
    except UpstreamUnavailable as exc:
        rec.responded(426)
        return web.Response(status=426, body=json_body(exc.body()), content_type="application/json", headers=headers)
    rec.connected(time.perf_counter() - started)
    # no app message larger than what the upstream itself accepts in a frame, nor
    # than a request body may be (what the memory budget is sized for); aiohttp refuses a
    # larger one from its frame header (close 1009), before reading its payload.
    limits = svc.settings.limits
    largest = min(limits.ws_frame_budget_bytes, limits.max_body_bytes or limits.ws_frame_budget_bytes)
    ws = web.WebSocketResponse(max_msg_size=largest, decode_text=False)
    ws.headers.update(headers)
    try:
        await ws.prepare(request)
    except BaseException:
        await upstream.close(1001)
        raise
    rec.responded(101)
    svc.relays.add(ws)
    loop = asyncio.get_running_loop()
    r = _Relay(ws, upstream, svc.owners, identity.digest, meter, svc.settings.pool.idle_close_seconds, loop)
    if meter is not None:
        _meter_reads(request, r, meter)
    try:
        await _relay(r)
    finally:
        svc.relays.discard(ws)
    return ws


def _over_socket_limits(svc: Services, identity: Identity) -> str | None:
    """Why a new relay session would exceed ``pool.max_sockets_per_identity`` or
    ``pool.max_sockets_total`` (the pool's sockets and the open relays together), or ``None``."""
    p = svc.settings.pool
    tenant = identity.tenant
    relays = sum(n for digest, n in svc.relay_sessions.items() if tenant_of(digest) == tenant)
    mine = svc.pool.count(tenant=tenant) + relays
    if mine >= p.max_sockets_per_identity:
        limit = p.max_sockets_per_identity
        return f"too many upstream sockets for this credential (pool.max_sockets_per_identity = {limit})"
    if svc.pool.count() + sum(svc.relay_sessions.values()) >= p.max_sockets_total:
        return f"too many upstream sockets (pool.max_sockets_total = {p.max_sockets_total})"
    return None


async def _refuse_session(request: web.Request, headers: dict[str, str], rec: Record, why: str) -> web.StreamResponse:
    """Accept the upgrade and close at once with 1013 (try again later) saying why: no upstream
    socket was opened."""
    ws = web.WebSocketResponse()
    ws.headers.update(headers)
    await ws.prepare(request)
    rec.failed(101)
    await ws.close(code=RELAY_REFUSED_CODE, message=f"upshift: {why}; retry later".encode()[:_MAX_REASON])
    return ws


@dataclass(slots=True)
class _Relay:
    ws: web.WebSocketResponse
    upstream: ClientConnection
    owners: OwnerBook
    identity: str
    meter: MessageMeter | None
    idle: float
    """Close the session after this long without a message either way (``pool.idle_close_seconds``)."""
    loop: asyncio.AbstractEventLoop
    last: float = 0.0
    """Loop time of the last message either way."""


_FRAME_HEAD = 14
"""Most bytes of a WebSocket frame's header (what a message costs beyond its payload)."""


class _MeteredParser:
    """Stands in for the session's WebSocket parser: counts the bytes read before they are
    parsed into a message, and pauses reading while the session's memory does not cover them
    (resumed once the budget grants the next step; refused: the session closes 1013)."""

    __slots__ = ("growing", "parser", "protocol", "relay")

    def __init__(self, parser: Any, protocol: Any, relay: _Relay) -> None:
        self.parser = parser
        self.protocol = protocol
        self.relay = relay
        self.growing: asyncio.Task[None] | None = None

    def feed_data(self, data: bytes) -> Any:
        meter = self.relay.meter
        if meter is not None and meter.arrived(len(data)) and self.growing is None:
            self.protocol.pause_reading()
            self.growing = self.relay.loop.create_task(self._grow(meter))
        return self.parser.feed_data(data)

    async def _grow(self, meter: MessageMeter) -> None:
        try:
            await meter.grow()
        except MemoryRefused as exc:
            # The message cannot be skipped unread: the app gets the budget's error event, and
            # the session closes (try again later); nothing of the message went upstream.
            ws = self.relay.ws
            with contextlib.suppress(ConnectionError):
                await _send_error(ws, exc, exc.status, None)
            why = "upshift: the memory budget stayed taken; retry later"
            await ws.close(code=RELAY_REFUSED_CODE, message=why.encode()[:_MAX_REASON])
            return
        finally:
            self.growing = None
        self.protocol.resume_reading()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


def _meter_reads(request: web.Request, r: _Relay, meter: MessageMeter) -> None:
    """Count the session's incoming bytes as the server reads them (before aiohttp assembles a
    message out of them), so a message is paid for before it is in memory."""
    protocol = request.protocol
    contracts.wrap_upgraded_reader(request, lambda reader: _MeteredParser(reader, protocol, r))


async def _relay(r: _Relay) -> None:
    ws, upstream = r.ws, r.upstream
    loop = r.loop
    r.last = loop.time()
    pair = {loop.create_task(_app_to_upstream(r)), loop.create_task(_upstream_to_app(r))}
    tasks = {*pair, loop.create_task(_close_when_idle(r))} if r.idle > 0 else pair
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        # One side closed and told the other; give that close a moment to finish.
        await asyncio.wait(pair, timeout=5.0)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await upstream.close(1001)
        if not ws.closed:
            await ws.close(code=1001)


async def _close_when_idle(r: _Relay) -> None:
    """Close both sides once no message went either way for ``r.idle`` seconds."""
    while (due := r.last + r.idle) > r.loop.time():
        await asyncio.sleep(due - r.loop.time())
    log.info("closed a WebSocket relay session idle for %g s", r.idle)
    reason = f"upshift: relay session idle for {r.idle:g} s (pool.idle_close_seconds)"
    await r.ws.close(code=1001, message=reason.encode()[:_MAX_REASON])
    with contextlib.suppress(Exception):
        await r.upstream.close(1001)


async def _app_to_upstream(r: _Relay) -> None:
    ws, upstream = r.ws, r.upstream
    try:
        async for msg in ws:
            r.last = r.loop.time()
            if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                if r.meter is not None:
                    r.meter.done(_FRAME_HEAD + (len(msg.data) if isinstance(msg.data, bytes) else 0))
                if msg.type is WSMsgType.ERROR:
                    break
                continue
            try:
                if not await _may_send(ws, msg.data, r.owners, r.identity):
                    continue  # names another tenant's response: answered here, nothing forwarded
                # decode_text=False: the UTF-8 bytes go on as a text frame, never decoded. The
                # message was paid for as its bytes arrived (the session's MessageMeter).
                await upstream.send(msg.data, text=msg.type is WSMsgType.TEXT)
            finally:
                if r.meter is not None:
                    r.meter.done(len(msg.data) + _FRAME_HEAD)
            del msg
    except ConnectionClosed:
        return  # the upstream went first; the other direction closes the app's side
    code = sendable_code(ws.close_code)
    await upstream.close(code)


async def _send_error(ws: web.WebSocketResponse, exc: ProxyError, status: int, stream_id: str | None) -> None:
    """One ``error`` event to the app, in the upstream's own envelope (protocol.md §1.6)."""
    event: dict[str, object] = {"type": "error", "status": status}
    if stream_id is not None:
        event["stream_id"] = stream_id
    event["error"] = exc.body()["error"]
    ERRORS.labels(exc.code).inc()
    await ws.send_str(json_body(event).decode())


async def _may_send(ws: web.WebSocketResponse, data: bytes | str, owners: OwnerBook, identity: str) -> bool:
    """Whether the app's frame may go upstream. It is read as the upstream reads it
    (:func:`~proxy.core.named_ids.read_request`): a frame that is not one JSON object, or repeats a
    key naming an id, gets an ``invalid_request_error`` event; a ``previous_response_id``
    (``response.create``, ``response.steer``) must name the identity's own response, else the
    upstream's own ``previous_response_not_found``. A refused frame goes nowhere."""
    raw = data.encode() if isinstance(data, str) else data
    try:
        named = read_request(raw) if len(raw) <= PARSE_INLINE else await asyncio.to_thread(read_request, raw)
    except InvalidRequest as exc:
        await _send_error(ws, exc, exc.status, None)
        return False
    try:
        await owners.check(identity, named)
    except RequestError as exc:
        await _send_error(ws, exc, exc.status, named.stream_id)
        return False
    return True


async def _upstream_to_app(r: _Relay) -> None:
    ws, upstream = r.ws, r.upstream
    try:
        async for message in upstream:
            r.last = r.loop.time()
            rid = created_id(message)
            if rid is not None:
                r.owners.note(r.identity, rid)  # before the app can see (and name) it
            if isinstance(message, str):
                await ws.send_str(message)
            else:
                await ws.send_bytes(message)
    except ConnectionClosed:
        pass
    except ConnectionResetError:
        return  # the app is gone; the other direction closes upstream
    rcvd = upstream.close_code
    if not ws.closed:
        await ws.close(code=sendable_code(rcvd), message=(upstream.close_reason or "").encode())
