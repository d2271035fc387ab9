"""HTTP handlers: ``POST /v1/responses`` over a pooled upstream lane, everything else relayed.

The request path (docs/architecture.md), top to bottom in :func:`_post` and :func:`_websocket`:
read the body within the limit → parse (``HeadTable.parse``: the fast parse) → transport →
**plan** (``Pool.plan``: the planner picks continue / full on a lane, or HTTP) → **lease** the
lane (``async with Pool.lease``) → **relay** (:func:`~proxy.serve.streaming.pump`) → **finish** (the
lease's exit records the head or frees the lane, on every path). A failure before anything
reached the app is classified by :func:`proxy.core.retry.classify` and replayed once with the
app's full input; after that it surfaces. Whenever no lane can be had, the request goes over
plain HTTP: slower, never wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from aiohttp import web

from proxy.config import Settings
from proxy.core.channel import Channel, Outcome
from proxy.core.conversation import HeadTable
from proxy.core.fastparse import hash_prefix, prefix_length
from proxy.core.planner import Plan, PlanKind
from proxy.core.reasons import Mode, PassthroughReason, ReplayCause
from proxy.core.request import ParsedRequest, Transport, build_frame, choose_transport
from proxy.core.retry import Replay, classify, is_connection_limit
from proxy.errors import (
    ForeignResponse,
    ProxyError,
    RequestError,
    UnsupportedRequest,
    UpstreamError,
)
from proxy.ops.metrics import (
    DROPPED_REASONING,
    ERRORS,
    HYDRATED,
    REPLAYS,
    UPSTREAM_BYTES_SENT,
    UPSTREAM_DURATION,
)
from proxy.serve.identity import Identity, request_identity
from proxy.serve.keys import KeySource
from proxy.serve.memory import Lease, MemoryGate
from proxy.serve.owners import OwnerBook
from proxy.serve.streaming import Downstream, Record, count_hold_back, json_body, pump
from proxy.upstream.passthrough import Passthrough
from proxy.upstream.pool import Pool, Turn

__all__ = ["SERVICES", "Arrival", "Services", "refuse", "serve"]

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
    relay_sessions: Counter[str] = field(default_factory=Counter)
    """Open relay sessions (each holds an upstream socket) by identity digest, counted with the
    pool's sockets against ``pool.max_sockets_per_identity`` / ``max_sockets_total``."""
    streams: set[tuple[Downstream, Channel]] = field(default_factory=set)
    """Responses being pumped to apps right now (ended by :func:`cut_stream` if the drain's
    grace runs out)."""
    memory: MemoryGate | None = None
    """The memory budget every request draws from (issue 12; proxy/serve/memory.py)."""
    owners: OwnerBook = field(init=False)
    """Who created each response id, and who may name it (issue 22; proxy/serve/owners.py)."""

    def __post_init__(self) -> None:
        self.owners = OwnerBook(self.heads.owners, strict=self.keys.injects)

    def identity(self, request: web.Request) -> Identity:
        """The caller's identity (and the upstream upgrade headers)."""
        # providers hook: credential headers, injected key header and the app's query string.
        return request_identity(request.headers, request.rel_url.raw_query_string, self.settings, self.keys)


SERVICES = web.AppKey("upshift_services", Services)

_WARM_ABOVE = 256 * 1024
"""Bodies larger than this that were parsed in full get their item keys in slices."""
_WARM_SLICE = 16
"""Items canonicalised per event-loop turn (a 20 KB tool output takes ~0.1 ms)."""


@dataclass(slots=True)
class Arrival:
    """What the ingress layer hands the local handler: the request's body, read within the
    limit under its memory lease, who sent it, and its access record."""

    request: web.Request
    body: bytes
    identity: Identity
    rec: Record
    started: float
    mem: Lease | None = None


def refuse(exc: ProxyError, headers: dict[str, str], rec: Record, started: float) -> web.Response:
    """A request refused by the sidecar itself (nothing forwarded)."""
    ERRORS.labels(exc.code).inc()
    rec.outcome = "client_error" if isinstance(exc, RequestError) else "upstream_error"
    rec.added_s = time.perf_counter() - started
    headers = {**headers, "x-upshift-overhead-ms": f"{rec.added_s * 1000:.3f}"}
    return web.Response(body=json_body(exc.body()), status=exc.status, content_type="application/json", headers=headers)


async def serve(svc: Services, arrival: Arrival) -> web.StreamResponse:
    """Serve one ``POST /v1/responses`` here: parse, choose the transport, relay."""
    request, body, identity, rec, started = (
        arrival.request,
        arrival.body,
        arrival.identity,
        arrival.rec,
        arrival.started,
    )
    mem = arrival.mem
    headers = {"x-request-id": rec.request_id}
    try:
        # Skips the history prefix this identity's previous turn already sent, byte for byte.
        req = svc.heads.parse(identity.digest, body)
        rid = req.previous_response_id
        if rid is not None and not await svc.owners.allows(identity.digest, str(rid)):
            # Another tenant's response (or, behind an injected key, one no process knows):
            # the upstream's store is shared behind one key and would serve it.
            raise ForeignResponse(str(rid))
    except RequestError as exc:
        return refuse(exc, headers, rec, started)
    if req.base is None and len(body) > _WARM_ABOVE:
        # A large body parsed in full (a new conversation, or a divergence): canonicalise its
        # items a slice at a time, so other streams are not stalled for tens of milliseconds.
        while not req.warm_keys(_WARM_SLICE):
            await asyncio.sleep(0)
    rec.items_in = req.n_items
    s = svc.settings
    transport, reason = choose_transport(req, mode=s.mode, frame_budget=s.limits.ws_frame_budget_bytes)
    if transport is Transport.HTTP:
        return await _passthrough(svc, request, req, rec, headers, started, reason, identity)
    return await _websocket(svc, request, req, identity, rec, headers, started, mem)


async def _passthrough(
    svc: Services,
    request: web.Request,
    req: ParsedRequest,
    rec: Record,
    headers: dict[str, str],
    started: float,
    reason: str,
    identity: Identity,
) -> web.StreamResponse:
    rec.mode, rec.reason = "passthrough", reason
    headers["x-upshift-mode"] = "passthrough"
    if "generate" in req.fields:
        # A warm-up over HTTP is a real, billed generation or a 400 (pitfall 18): never send it.
        msg = "The 'generate' parameter is only supported in WebSocket mode."
        return refuse(UnsupportedRequest(msg, param="generate"), headers, rec, started)
    fwd = await svc.passthrough.forward(
        request, headers=headers, body=req.body, started=started, on_id=partial(svc.owners.note, identity.digest)
    )
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
    mem: Lease | None = None,
) -> web.StreamResponse:
    """Plan → lease a lane → relay → finish; a failure before output is replayed once."""
    down = Downstream(request, stream=req.stream, headers=headers, started=started)
    prefix = _hash_prefix_in_thread(req)
    attempt = 0
    while True:
        plan, _waited = await svc.pool.plan(identity, req, replay=attempt > 0)
        if attempt == 0 and plan.kind is PlanKind.FULL:  # where the miss departs (never content)
            rec.explain(svc.heads.explain_later(identity.digest, req, plan.reason), plan.reason)
        if plan.kind is PlanKind.HTTP:
            rec.upstream_s = down.upstream_wait
            return await _passthrough(svc, request, req, rec, headers, started, plan.reason, identity)
        frame = _note_plan(rec, req, plan, attempt)
        headers["x-upshift-mode"] = rec.mode
        hold = svc.settings.streaming.hold_back_seconds if req.stream else None
        channel = Channel(req.previous_response_id, hold_back_s=hold)
        failure: UpstreamError | None = None
        # issue 12: pump takes the only reference to the frame, frees it once sent, shrinks `mem`.
        frames, sent = [frame], len(frame)
        del frame
        try:
            async with svc.pool.lease(plan) as turn:
                await _relay(svc, turn, frames, channel, down, req, identity, prefix, mem)
        except UpstreamError as exc:
            failure = exc
        rec.bytes_sent += sent
        UPSTREAM_BYTES_SENT.labels("websocket").inc(sent)
        rec.upstream_s = down.upstream_wait
        if failure is None and channel.released:
            try:
                return await _finish(down, channel, rec)
            finally:
                count_hold_back(channel)
        terminal = failure if failure is not None else (channel.terminal or {})
        decision = classify(
            terminal,
            channel.released,
            attempt,
            continuation=plan.kind is PlanKind.CONTINUE,
            named=plan.stream_id is not None,
        )
        if not isinstance(decision, Replay):
            try:
                return await _surface(down, channel, failure, rec)
            finally:
                count_hold_back(channel)
        count_hold_back(channel)  # a replay: what was held never reached the app
        REPLAYS.labels(decision.cause).inc()
        rec.replays += 1
        if decision.cause is ReplayCause.LANES_UNSUPPORTED:
            svc.pool.lanes_refused()
        elif decision.cause is ReplayCause.STREAM_LIMIT and plan.lane is not None:
            svc.pool.stream_limit(plan.lane)
        if decision.over_http:
            return await _passthrough(
                svc, request, req, rec, headers, started, PassthroughReason.FRAME_TOO_BIG, identity
            )
        log.info("replaying with full input (%s)", decision.cause)
        attempt, rec.reason = attempt + 1, decision.cause


def _note_plan(rec: Record, req: ParsedRequest, plan: Plan, attempt: int) -> bytes:
    """Fill the access record for this attempt and build its ``response.create`` frame."""
    if plan.dropped_reasoning and attempt == 0:
        DROPPED_REASONING.labels("true" if plan.kind is PlanKind.CONTINUE else "false").inc()
    if plan.kind is PlanKind.CONTINUE:
        rec.mode, rec.reason = Mode.CONTINUATION, "continuation"
        rec.items_sent, rec.items_avoided = len(plan.new_items or ()), plan.items_avoided
        if plan.hydrated:
            HYDRATED.inc()
        return build_frame(
            req, previous_response_id=plan.response_id, items=plan.new_items or [], stream_id=plan.stream_id
        )
    rec.mode, rec.items_sent, rec.items_avoided = Mode.FULL, req.n_items, 0
    if attempt == 0:
        rec.reason = plan.reason
    return build_frame(req, stream_id=plan.stream_id)


async def _relay(
    svc: Services,
    turn: Turn,
    frames: list[bytes],
    channel: Channel,
    down: Downstream,
    req: ParsedRequest,
    identity: Identity,
    prefix: asyncio.Future[Any] | None,
    mem: Lease | None,
) -> None:
    """One response on one lane, to its terminal event; the lane's head is set on the way out."""
    entry = (down, channel)
    svc.streams.add(entry)
    try:
        sent_at = time.perf_counter()
        idle = svc.settings.timeouts.stream_idle_seconds
        await pump(turn, frames, channel, down, idle, mem, on_id=partial(svc.owners.note, identity.digest))
        UPSTREAM_DURATION.observe(time.perf_counter() - sent_at)
    finally:
        svc.streams.discard(entry)
    response = channel.response if channel.outcome is Outcome.COMPLETED else None
    if response is None and channel.response is not None:
        rid = channel.response.get("id")
        if isinstance(rid, str):
            svc.owners.note(identity.digest, rid)  # an incomplete response is chainable too
    state = await prefix if response is not None and prefix is not None else None
    # After the age-limit error the upstream closes the socket: no new turns on it.
    aged = channel.terminal is not None and is_connection_limit(channel.terminal)
    turn.finish(req=req, response=response, prefix_state=state, retire=aged)


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
