"""HTTP handlers: ``POST /v1/responses`` over a pooled upstream socket, everything else relayed.

The request path (docs/architecture.md): read the body within the limit → ``HeadTable.parse`` →
``choose_transport`` → identity → ``HeadTable.lookup`` → ``Pool.acquire`` → ``HeadTable.begin``
→ :func:`~proxy.streaming.pump` → ``record`` (completed) or ``discard`` (anything else) →
``Pool.release``. A failure before anything reached the app is classified by
:func:`proxy.core.retry.classify` and replayed once with the app's full input; after that it
surfaces. Whenever no socket can be had, the request goes over plain HTTP: slower, never wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.cluster import Cluster
from proxy.config import Settings
from proxy.core.channel import Channel, Outcome
from proxy.core.conversation import HeadTable, Lookup, MissReason
from proxy.core.fastparse import hash_prefix, prefix_length
from proxy.core.request import ParsedRequest, Transport, build_frame, choose_transport
from proxy.core.retry import Replay, classify, is_connection_limit
from proxy.errors import (
    ForeignResponse,
    ProxyError,
    RequestError,
    UnsupportedRequest,
    UpstreamError,
    UpstreamUnavailable,
)
from proxy.identity import Identity, identify
from proxy.keys import KeySource
from proxy.metrics import (
    DROPPED_REASONING,
    ERRORS,
    INFLIGHT,
    REPLAYS,
    REQUEST_BYTES,
    UPSTREAM_BYTES_SENT,
    UPSTREAM_DURATION,
)
from proxy.passthrough import Passthrough
from proxy.pool import Pool
from proxy.streaming import Downstream, Record, json_body, new_request_id, pump, read_body

__all__ = ["SERVICES", "Services", "post_responses"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Services:
    """Everything a handler needs, shared by the whole API app."""

    settings: Settings
    keys: KeySource
    heads: HeadTable
    pool: Pool
    passthrough: Passthrough
    relays: set[web.WebSocketResponse] = field(default_factory=set)
    """Open downstream WebSocket relays (closed with 1001 on shutdown)."""
    streams: set[tuple[Downstream, Channel]] = field(default_factory=set)
    """Responses being pumped to apps right now (ended by :func:`cut_stream` if the drain's
    grace runs out)."""
    cluster: Cluster | None = None
    """Conversation affinity: forwards a request to the process owning it (proxy/cluster.py)."""

    def identity(self, request: web.Request) -> Identity:
        """The caller's identity (and the upstream upgrade headers)."""
        s = self.settings
        authorization = self.keys.authorization(request.headers.get("Authorization"))
        return identify(
            request.headers, upstream=s.upstream, authorization=authorization, openai_beta=s.pool.openai_beta
        )


SERVICES = web.AppKey("upshift_services", Services)

_WARM_ABOVE = 256 * 1024
"""Bodies larger than this that were parsed in full get their item keys in slices."""
_WARM_SLICE = 16
"""Items canonicalised per event-loop turn (a 20 KB tool output takes ~0.1 ms)."""


async def post_responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``."""
    started = time.perf_counter()
    rec = Record(new_request_id())
    INFLIGHT.inc()
    try:
        response = await _post(request.app[SERVICES], request, rec, started)
        rec.status = response.status
        return response
    except asyncio.CancelledError:
        rec.outcome = "cancelled"
        raise
    except Exception:
        rec.outcome, rec.status = "proxy_error", 500
        raise
    finally:
        INFLIGHT.dec()
        if not rec.added_s:
            rec.added_s = max(time.perf_counter() - started - rec.upstream_s, 0.0)
        rec.finish()


def _error(exc: ProxyError, headers: dict[str, str], rec: Record, started: float) -> web.Response:
    """A request refused by the sidecar itself (nothing forwarded)."""
    ERRORS.labels(exc.code).inc()
    rec.outcome = "client_error" if isinstance(exc, RequestError) else "upstream_error"
    rec.added_s = time.perf_counter() - started
    headers = {**headers, "x-upshift-overhead-ms": f"{rec.added_s * 1000:.3f}"}
    return web.Response(body=json_body(exc.body()), status=exc.status, content_type="application/json", headers=headers)


async def _post(svc: Services, request: web.Request, rec: Record, started: float) -> web.StreamResponse:
    headers = {"x-request-id": rec.request_id}
    try:
        body = await read_body(request, svc.settings.limits.max_body_bytes)
        rec.bytes_in = len(body)
        REQUEST_BYTES.inc(len(body))
        identity = svc.identity(request)
        # Conversation affinity (#10): on a non-owner, the owner's answer (proxy/cluster.py).
        fwd = await svc.cluster.maybe_forward(request, body, identity, rec) if svc.cluster else None
        if fwd is not None:
            return fwd
        # Skips the history prefix this identity's previous turn already sent, byte for byte.
        req = svc.heads.parse(identity.digest, body)
        owner = svc.heads.owner_of(req.previous_response_id) if req.previous_response_id else None
        if owner is not None and owner != identity.digest:
            # Another tenant's response: behind an injected key the upstream would serve it.
            raise ForeignResponse(str(req.previous_response_id))
    except RequestError as exc:
        return _error(exc, headers, rec, started)
    if req.base is None and len(body) > _WARM_ABOVE:
        # A large body parsed in full (a new conversation, or a divergence): canonicalise its
        # items a slice at a time, so other streams are not stalled for tens of milliseconds.
        while not req.warm_keys(_WARM_SLICE):
            await asyncio.sleep(0)
    rec.items_in = req.n_items
    s = svc.settings
    transport, reason = choose_transport(req, mode=s.mode, frame_budget=s.limits.ws_frame_budget_bytes)
    if transport is Transport.WS and svc.pool.prefers_http(identity):
        transport, reason = Transport.HTTP, "upgrade_refused"
    if transport is Transport.HTTP:
        return await _passthrough(svc, request, req, rec, headers, started, reason)
    return await _websocket(svc, request, req, identity, rec, headers, started)


async def _passthrough(
    svc: Services,
    request: web.Request,
    req: ParsedRequest,
    rec: Record,
    headers: dict[str, str],
    started: float,
    reason: str,
) -> web.StreamResponse:
    rec.mode, rec.reason = "passthrough", reason
    headers["x-upshift-mode"] = "passthrough"
    if "generate" in req.fields:
        # A warm-up over HTTP is a real, billed generation or a 400 (pitfall 18): never send it.
        msg = "The 'generate' parameter is only supported in WebSocket mode."
        return _error(UnsupportedRequest(msg, param="generate"), headers, rec, started)
    fwd = await svc.passthrough.forward(request, headers=headers, body=req.body, started=started)
    rec.items_sent, rec.bytes_sent = rec.items_in, fwd.bytes_sent
    rec.upstream_s, rec.added_s = fwd.upstream_seconds, fwd.added_seconds
    return fwd.response


async def _websocket(
    svc: Services,
    request: web.Request,
    req: ParsedRequest,
    identity: Identity,
    rec: Record,
    headers: dict[str, str],
    started: float,
) -> web.StreamResponse:
    heads, pool = svc.heads, svc.pool
    lookup: Lookup = heads.lookup(identity.digest, req, time.monotonic(), pool.is_idle)
    match = lookup.match
    prefix = _hash_prefix_in_thread(req)
    if lookup.dropped_reasoning:
        DROPPED_REASONING.labels("true" if match else "false").inc()
    anchor = match.anchor if match else None
    if anchor is None and req.previous_response_id is not None:
        # The app chains itself: relay its id as is, on the socket that produced it if known.
        anchor = heads.anchor_for(identity.digest, req.previous_response_id)
    down = Downstream(request, stream=req.stream, headers=headers, started=started)
    full_frame: bytes | None = None
    attempt, fresh = 0, False
    while True:
        try:
            lease = await pool.acquire(identity, anchor, fresh=fresh)
        except UpstreamUnavailable as exc:
            log.info("upstream socket unavailable, using HTTP: %s", exc.message)
            rec.upstream_s = down.upstream_wait
            return await _passthrough(svc, request, req, rec, headers, started, "ws_unavailable")
        if lease is None:
            return await _passthrough(svc, request, req, rec, headers, started, "pool_full")
        continuation = match is not None and lease.anchored and attempt == 0
        if match is not None and continuation:
            frame = build_frame(req, previous_response_id=match.response_id, items=match.new_items)
            rec.mode, rec.reason = "continuation", "continuation"
            rec.items_sent, rec.items_avoided = len(match.new_items), match.items_avoided
        else:
            frame = full_frame = full_frame or build_frame(req)
            rec.mode, rec.items_sent = "full", req.n_items
            if attempt == 0:
                rec.reason = lookup.reason if match is None else MissReason.HEAD_BUSY
        headers["x-upshift-mode"] = rec.mode
        heads.begin(lease.key)
        channel = Channel(req.previous_response_id)
        failure: UpstreamError | None = None
        sent_at = time.perf_counter()
        entry = (down, channel)
        svc.streams.add(entry)
        try:
            await pump(lease.socket, frame, channel, down, svc.settings.timeouts.stream_idle_seconds)
        except UpstreamError as exc:
            pool.release(lease, reusable=False)
            failure = exc
        except BaseException:
            pool.release(lease, reusable=False)  # cancelled mid-response: never reuse the socket
            raise
        else:
            UPSTREAM_DURATION.observe(time.perf_counter() - sent_at)
            done = channel.outcome is Outcome.COMPLETED and channel.response is not None
            if done and channel.response is not None:
                state = await prefix if prefix is not None else None
                heads.record(identity.digest, lease.key, req, channel.response, time.monotonic(), state)
            else:
                heads.discard(lease.key)
                rid = channel.response.get("id") if channel.response else None
                if isinstance(rid, str):
                    heads.note_owner(identity.digest, rid)  # an incomplete response is chainable too
            # After the age-limit error the upstream closes the socket: never reuse it.
            aged = channel.terminal is not None and is_connection_limit(channel.terminal)
            pool.release(lease, reusable=not aged, head=done)
        finally:
            svc.streams.discard(entry)
        rec.bytes_sent += len(frame)
        UPSTREAM_BYTES_SENT.labels("websocket").inc(len(frame))
        rec.upstream_s = down.upstream_wait
        if failure is None and channel.released:
            return await _finish(down, channel, rec)
        terminal = failure if failure is not None else (channel.terminal or {})
        decision = classify(terminal, channel.released, attempt, continuation=continuation)
        if isinstance(decision, Replay):
            REPLAYS.labels(decision.cause).inc()
            if decision.over_http:
                rec.replays += 1
                return await _passthrough(svc, request, req, rec, headers, started, decision.cause)
            log.info("replaying with full input (%s)", decision.cause)
            attempt, rec.replays, anchor = attempt + 1, rec.replays + 1, None
            fresh, rec.reason = decision.new_socket, decision.cause
            continue
        return await _surface(down, channel, failure, rec)


async def _finish(down: Downstream, channel: Channel, rec: Record) -> web.StreamResponse:
    """The response reached its terminal event after output was released."""
    rec.added_s = down.added()
    if channel.outcome in (Outcome.FAILED, Outcome.ERROR):
        rec.outcome = "upstream_error"
    if down.stream:
        return await down.end()
    if channel.outcome in (Outcome.COMPLETED, Outcome.INCOMPLETE) and channel.response is not None:
        return down.json(200, json_body(channel.response))
    err = channel.http_error()
    return down.json(err.status, json_body(err.body), err.headers)


async def _surface(
    down: Downstream, channel: Channel, failure: UpstreamError | None, rec: Record
) -> web.StreamResponse:
    """Give the app the failure as it is: an HTTP error if nothing was written, else one nested
    SSE ``error`` event and a clean end."""
    rec.added_s = down.added()
    rec.outcome = "upstream_error"
    if failure is not None:
        ERRORS.labels(failure.code).inc()
        if down.stream and down.written:
            await down.write([channel.proxy_error_out(type=failure.type, code=failure.code, message=failure.message)])
            return await down.end()
        return down.json(failure.status, json_body(failure.body()))
    if (channel.outcome is Outcome.ERROR and not channel.started) or not down.stream:
        err = channel.http_error()
        rec.outcome = "client_error" if err.status < 500 else "upstream_error"
        return down.json(err.status, json_body(err.body), err.headers)
    outs = channel.release()
    if channel.outcome is Outcome.ERROR and channel.terminal is not None:
        outs.append(channel.error_out(channel.terminal))
    await down.write(outs)
    return await down.end()


def _hash_prefix_in_thread(req: ParsedRequest) -> asyncio.Future[Any] | None:
    """For a large body parsed in full, hash its history prefix (the next turn's fast-parse
    check) in a worker thread while the upstream works: SHA-256 of megabytes would otherwise
    hold the event loop for milliseconds when the head is recorded."""
    if req.base is not None or len(req.body) <= _WARM_ABOVE:
        return None
    length = prefix_length(req)
    if length is None:
        return None
    return asyncio.ensure_future(asyncio.to_thread(hash_prefix, req.body, length))


async def cut_stream(down: Downstream, channel: Channel) -> None:
    """End an in-flight SSE stream now, with one error event the app can act on.

    Used when the drain's grace runs out: like any failure after output, never a truncated
    body behind a 200. Later writes of the handler are dropped (``down.gone``).
    """
    if not down.stream or not down.written or down.gone:
        return
    out = channel.proxy_error_out(
        type="server_error",
        code="shutting_down",
        message="The sidecar shut down before the response finished; retry the request.",
    )
    with contextlib.suppress(Exception):
        await down.write([out])
        await down.end()
    down.gone = True
