"""WebSocket-native apps (``client.responses.connect()``, Codex): relay frame by frame.

A ``GET /v1/responses`` with ``Upgrade: websocket`` gets an upstream socket of its own (not
pooled: the app drives its own chain) with the app's identity headers. The upgrade is answered
only after the upstream accepted, so a refused upstream upgrade is answered with the same status
(426 when there is none: the de-facto "use HTTP instead" signal), never a hang, 404 or 405.
Frames go through unchanged in both directions; close codes propagate both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiohttp import WSMsgType, web
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from proxy.core.owners import chained_ids, created_id
from proxy.errors import ForeignResponse, UpstreamRefused, UpstreamUnavailable
from proxy.ops.metrics import ERRORS, INFLIGHT
from proxy.serve.handlers import SERVICES
from proxy.serve.owners import OwnerBook
from proxy.serve.streaming import Record, json_body, new_request_id
from proxy.upstream.ws import MAX_RECEIVED_FRAME, open_websocket

__all__ = ["relay_websocket", "sendable_code"]

log = logging.getLogger(__name__)

_UNSENDABLE = {1005: 1000, 1006: 1011, 1015: 1011}
"""Codes that only describe a close and cannot be sent in a Close frame."""
_PARSE_INLINE = 256 * 1024
"""An app frame naming a response id is parsed on the loop up to this size, else in a thread."""


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
    rec = Record(new_request_id(), route="responses_ws", mode="relay")
    headers = {"x-request-id": rec.request_id}
    INFLIGHT.inc()
    try:
        try:
            identity = svc.identity(request)
            upstream = await open_websocket(identity.ws_url, identity.headers, svc.settings)
        except UpstreamRefused as exc:
            rec.status = exc.http_status if 400 <= exc.http_status <= 599 else 426
            kind = exc.headers.get("content-type", "application/json")
            return web.Response(status=rec.status, body=exc.payload, headers={**headers, "Content-Type": kind})
        except UpstreamUnavailable as exc:
            rec.status = 426
            return web.Response(
                status=426, body=json_body(exc.body()), content_type="application/json", headers=headers
            )
        rec.added_s = time.perf_counter() - started
        ws = web.WebSocketResponse(max_msg_size=MAX_RECEIVED_FRAME, decode_text=False)
        ws.headers.update(headers)
        try:
            await ws.prepare(request)
        except BaseException:
            await upstream.close(1001)
            raise
        rec.status = 101
        svc.relays.add(ws)
        try:
            await _relay(ws, upstream, svc.owners, identity.digest)
        finally:
            svc.relays.discard(ws)
        return ws
    finally:
        INFLIGHT.dec()
        rec.finish()


async def _relay(ws: web.WebSocketResponse, upstream: ClientConnection, owners: OwnerBook, identity: str) -> None:
    loop = asyncio.get_running_loop()
    tasks = {
        loop.create_task(_app_to_upstream(ws, upstream, owners, identity)),
        loop.create_task(_upstream_to_app(upstream, ws, owners, identity)),
    }
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        # One side closed and told the other; give that close a moment to finish.
        await asyncio.wait(tasks, timeout=5.0)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await upstream.close(1001)
        if not ws.closed:
            await ws.close(code=1001)


async def _app_to_upstream(
    ws: web.WebSocketResponse, upstream: ClientConnection, owners: OwnerBook, identity: str
) -> None:
    try:
        async for msg in ws:
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY) and not await _may_send(ws, msg.data, owners, identity):
                continue  # names another tenant's response: answered here, nothing forwarded
            if msg.type is WSMsgType.TEXT:
                # decode_text=False: the UTF-8 bytes go on as a text frame, never decoded.
                await upstream.send(msg.data, text=True)
            elif msg.type is WSMsgType.BINARY:
                await upstream.send(msg.data)
            elif msg.type is WSMsgType.ERROR:
                break
    except ConnectionClosed:
        return  # the upstream went first; the other direction closes the app's side
    code = sendable_code(ws.close_code)
    await upstream.close(code)


async def _may_send(ws: web.WebSocketResponse, data: bytes | str, owners: OwnerBook, identity: str) -> bool:
    """Whether the app's frame may go upstream: a ``previous_response_id`` (``response.create``,
    ``response.steer``) must name the identity's own response; otherwise the app gets the
    upstream's own ``previous_response_not_found`` error event and the frame goes nowhere."""
    raw = data.encode() if isinstance(data, str) else data
    try:
        named = chained_ids(raw) if len(raw) <= _PARSE_INLINE else await asyncio.to_thread(chained_ids, raw)
    except ValueError:
        return True  # not JSON: the upstream answers it; it names nobody's response
    if named is None:
        return True
    rid, stream_id = named
    if await owners.allows(identity, rid):
        return True
    err = ForeignResponse(rid)
    event: dict[str, object] = {"type": "error", "status": err.status}
    if stream_id is not None:
        event["stream_id"] = stream_id
    event["error"] = err.body()["error"]
    ERRORS.labels(err.code).inc()
    await ws.send_str(json_body(event).decode())
    return False


async def _upstream_to_app(
    upstream: ClientConnection, ws: web.WebSocketResponse, owners: OwnerBook, identity: str
) -> None:
    try:
        async for message in upstream:
            rid = created_id(message)
            if rid is not None:
                owners.note(identity, rid)  # before the app can see (and name) it
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
