"""The local handler of ``POST /v1/responses``: a short perform loop over one :class:`Exchange`.

The request path (docs/architecture.md): the ingress front (:mod:`proxy.ingress.front`) hands
:func:`serve` an :class:`Arrival`; :func:`serve` parses it (the fast parse) and chooses the
transport; :func:`_perform` then loops **plan** (``Pool.plan``: continue / full on a lane, or
HTTP) → **lease** the lane (``async with Pool.lease``; its exit records the head or frees the
lane, on every path) → **pump** (:func:`~proxy.serve.streaming.pump`) → **answer**: which
answer, or a replay, is :func:`proxy.core.answer.decide`'s choice (pure, beside
:func:`proxy.core.retry.classify`); the shell only performs it. A failure before anything
reached the app is replayed once with the app's full input; after that it surfaces. Whenever no
lane can be had, the request goes over plain HTTP: slower, never wrong. Each stage writes the
access record once: plan (:func:`_planned`), pump (:func:`_lease_and_pump`), answer
(:func:`_answer`), replay (:func:`_replay`), HTTP (:func:`_over_http`).
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
from proxy.core.answer import Answer, Attempt, Kept, decide, kept
from proxy.core.channel import Channel
from proxy.core.conversation import HeadTable
from proxy.core.fastparse import hash_prefix, prefix_length
from proxy.core.planner import Plan, PlanKind
from proxy.core.reasons import Hit, Mode, PassthroughReason, Reason, ReplayCause, RequestOutcome, Tolerance
from proxy.core.request import ParsedRequest, Transport, build_frame, choose_transport
from proxy.core.retry import Replay
from proxy.errors import (
    ForeignResponse,
    ProxyError,
    RequestError,
    UnsupportedRequest,
    UpstreamError,
)
from proxy.ops.metrics import (
    DROPPED_REASONING,
    ECHO_TOLERANCES,
    ERRORS,
    HTTP_CONTINUATIONS,
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
from proxy.upstream.passthrough import Options, Passthrough, http_continuation_body
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
    streams: set[tuple[Downstream, Channel]] = field(default_factory=set)
    """Responses being pumped to apps right now (ended by :func:`cut_stream` if the drain's
    grace runs out)."""
    memory: MemoryGate | None = None
    """The memory budget every request draws from (issue 12; proxy/serve/memory.py)."""
    owners: OwnerBook = field(init=False)
    """Who created each response id, and who may name it (issue 22; proxy/serve/owners.py)."""

    def __post_init__(self) -> None:
        self.owners = OwnerBook(self.heads.owners, strict=self.keys.injects)

    @property
    def relay_sessions(self) -> Counter[str]:
        """Open WebSocket relay sessions per identity: upstream sockets outside the pool, counted
        by the planner against the socket limits (issue 22)."""
        return self.pool.planner.outside

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
    outcome = RequestOutcome.CLIENT_ERROR if isinstance(exc, RequestError) else RequestOutcome.UPSTREAM_ERROR
    rec.answered(outcome, time.perf_counter() - started)
    headers = {**headers, "x-upshift-overhead-ms": f"{rec.added_s * 1000:.3f}"}
    return web.Response(body=json_body(exc.body()), status=exc.status, content_type="application/json", headers=headers)


@dataclass(slots=True)
class Exchange:
    """One ``POST /v1/responses`` served here, from its parse to its answer: what every stage
    reads, and the one access record they fill (one stage, one write)."""

    svc: Services
    arrival: Arrival
    req: ParsedRequest
    down: Downstream
    attempt: int = 0
    """0 for the first try; a replay counts up."""
    prefix: asyncio.Future[Any] | None = None
    """The history prefix's hash, computed in a thread for a large body (the next fast parse)."""

    @property
    def rec(self) -> Record:
        return self.arrival.rec


async def serve(svc: Services, arrival: Arrival) -> web.StreamResponse:
    """Serve one ``POST /v1/responses`` here: parse, choose the transport, perform."""
    headers = {"x-request-id": arrival.rec.request_id}
    try:
        req = await _parse(svc, arrival)
    except RequestError as exc:
        return refuse(exc, headers, arrival.rec, arrival.started)
    while req.base is None and len(req.body) > _WARM_ABOVE and not req.warm_keys(_WARM_SLICE):
        await asyncio.sleep(0)  # a large body parsed in full: its item keys a slice per loop turn
    arrival.rec.items_in = req.n_items
    # issue 22: every response id this request gets is recorded with its creator before the app sees it.
    on_id = partial(svc.owners.note, arrival.identity.digest)
    down = Downstream(
        arrival.request, stream=req.stream, headers=headers, started=arrival.started, lease=arrival.mem, on_id=on_id
    )
    x = Exchange(svc, arrival, req, down)
    budget = svc.settings.limits.ws_frame_budget_bytes
    transport, reason = choose_transport(req, mode=svc.settings.mode, frame_budget=budget)
    return await (_over_http(x, reason) if transport is Transport.HTTP else _perform(x))


async def _parse(svc: Services, arrival: Arrival) -> ParsedRequest:
    """The fast parse (skips the history prefix this identity's previous turn already sent);
    another tenant's ``previous_response_id`` (or, behind an injected key, one no process knows)
    is refused: the upstream's store is shared behind one key and would serve it (issue 22)."""
    req = svc.heads.parse(arrival.identity.digest, arrival.body)
    rid = req.previous_response_id
    if rid is not None and not await svc.owners.allows(arrival.identity.digest, str(rid)):
        raise ForeignResponse(str(rid))
    return req


async def _perform(x: Exchange) -> web.StreamResponse:
    """Plan → lease a lane → pump → answer; a failure before output is replayed once."""
    x.prefix = _hash_prefix_in_thread(x.req)
    while True:
        plan, _waited = await x.svc.pool.plan(x.arrival.identity, x.req, replay=x.attempt > 0)
        if plan.kind is PlanKind.HTTP:  # a stored new conversation's answer is adopted as a head
            return await _over_http(x, plan.reason, adopt=bool(x.req.store) and x.req.previous_response_id is None)
        if plan.kind is PlanKind.HTTP_CONTINUE:
            return await _http_continuation(x, plan)
        channel, failure = await _lease_and_pump(x, plan)
        attempt = Attempt(x.attempt, plan.kind is PlanKind.CONTINUE, plan.stream_id is not None, x.req.stream)
        verdict = decide(channel, failure, attempt, x.down.written)
        if isinstance(verdict, Answer):
            return await _answer(x, channel, verdict)
        count_hold_back(channel)  # a replay: what was held never reached the app
        if _replay(x, plan, verdict):
            return await _over_http(x, PassthroughReason.FRAME_TOO_BIG)


def _planned(x: Exchange, plan: Plan) -> bytes:
    """The plan stage: the record's mode, reason and items, and the ``response.create`` frame."""
    req, first, cont = x.req, x.attempt == 0, plan.kind is PlanKind.CONTINUE
    if (plan.dropped_reasoning or plan.dropped_phase) and first:
        accepted = "true" if cont else "false"
        if plan.dropped_reasoning:
            DROPPED_REASONING.labels(accepted).inc()
            ECHO_TOLERANCES.labels(Tolerance.REASONING, accepted).inc()
        if plan.dropped_phase:
            ECHO_TOLERANCES.labels(Tolerance.PHASE, accepted).inc()
    if first and plan.kind is PlanKind.FULL:  # where the miss departs (never content), after the answer
        x.rec.explain(x.svc.heads.explain_later(x.arrival.identity.digest, req, plan.reason), plan.reason)
    if cont and plan.hydrated:
        HYDRATED.inc()
    new = (plan.new_items or []) if cont else None
    if new is not None:
        x.rec.planned(Mode.CONTINUATION, Hit.CONTINUATION, len(new), plan.items_avoided)
    else:
        x.rec.planned(Mode.FULL, plan.reason if first else x.rec.reason, req.n_items, 0)
    x.down.headers["x-upshift-mode"] = x.rec.mode
    anchor = plan.response_id if cont else None
    return build_frame(req, previous_response_id=anchor, items=new, stream_id=plan.stream_id)


async def _http_continuation(x: Exchange, plan: Plan) -> web.StreamResponse:
    """A stored head with no lane now (issue 23): ``previous_response_id`` + the new items over
    plain HTTP; the upstream hydrates the stored response. ``previous_response_not_found`` gets
    the app's own body instead (the passthrough's ``fallback``)."""
    new = plan.new_items or []
    x.rec.planned(Mode.CONTINUATION, Hit.CONTINUATION, len(new), plan.items_avoided)
    x.rec.transport = Transport.HTTP
    x.down.headers["x-upshift-mode"] = Mode.CONTINUATION
    body = http_continuation_body(x.req, plan.response_id, new)
    arrival = x.arrival
    fwd = await x.svc.passthrough.continuation(
        arrival.request,
        headers=x.down.headers,
        body=body,
        full=x.req.body,
        anchor=str(plan.response_id),
        started=arrival.started,
        on_id=x.down.on_id,
    )
    HTTP_CONTINUATIONS.labels("full" if fwd.fell_back else "continuation").inc()
    if fwd.fell_back:
        x.rec.planned(Mode.FULL, ReplayCause.PREVIOUS_RESPONSE_NOT_FOUND, x.req.n_items, 0)
        x.rec.replays += 1
        REPLAYS.labels(ReplayCause.PREVIOUS_RESPONSE_NOT_FOUND).inc()
    if fwd.captured is not None and plan.response_id is not None:
        x.svc.pool.adopt_http(arrival.identity, x.req, fwd.captured)
    x.rec.bytes_sent = fwd.bytes_sent
    x.rec.upstream_s, x.rec.added_s = fwd.upstream_seconds, fwd.added_seconds
    return fwd.response


async def _lease_and_pump(x: Exchange, plan: Plan) -> tuple[Channel, UpstreamError | None]:
    """Lease the plan's lane and pump one response on it; the lane keeps its head on the way out."""
    hold = x.svc.settings.streaming.hold_back_seconds if x.req.stream else None
    channel = Channel(x.req.previous_response_id, hold_back_s=hold)
    frames = [_planned(x, plan)]  # issue 12: pump takes the only reference, frees it once sent
    if x.down.lease is not None and not x.svc.settings.pool.fragment_bytes:
        await x.down.lease.whole_frame(len(frames[0]))  # issue 19: its masked copy is paid for too
    sent, failure, entry = len(frames[0]), None, (x.down, channel)
    x.svc.streams.add(entry)
    try:
        async with x.svc.pool.lease(plan) as turn:
            sent_at = time.perf_counter()
            await pump(turn, frames, channel, x.down, x.svc.settings.timeouts.stream_idle_seconds)
            UPSTREAM_DURATION.observe(time.perf_counter() - sent_at)
            await _keep(x, turn, kept(channel))
    except UpstreamError as exc:
        failure = exc
    finally:
        x.svc.streams.discard(entry)
    UPSTREAM_BYTES_SENT.labels("websocket").inc(sent)
    x.rec.pumped(sent, x.down.upstream_wait)
    return channel, failure


async def _keep(x: Exchange, turn: Turn, keep: Kept) -> None:
    """Tell the lane what it keeps: a completed response becomes its head."""
    if keep.chainable is not None:  # an incomplete response is chainable too
        x.svc.owners.note(x.arrival.identity.digest, keep.chainable)
    state = await x.prefix if keep.response is not None and x.prefix is not None else None
    turn.finish(req=x.req, response=keep.response, prefix_state=state, retire=keep.retire)


async def _answer(x: Exchange, channel: Channel, answer: Answer) -> web.StreamResponse:
    """The answer stage: its record (outcome, added time), its error count, the answer written."""
    x.rec.answered(answer.outcome, x.down.added())
    if answer.error is not None:
        ERRORS.labels(answer.error).inc()
    try:
        return await x.down.answer(answer)
    finally:
        count_hold_back(channel)


def _replay(x: Exchange, plan: Plan, replay: Replay) -> bool:
    """The replay stage (the pool told what the upstream refused); ``True`` if it goes over HTTP."""
    REPLAYS.labels(replay.cause).inc()
    x.rec.replayed(replay.cause)
    if replay.cause is ReplayCause.LANES_UNSUPPORTED:
        x.svc.pool.lanes_refused()
    elif replay.cause is ReplayCause.STREAM_LIMIT and plan.lane is not None:
        x.svc.pool.stream_limit(plan.lane)
    if replay.over_http:
        return True
    log.info("replaying with full input (%s)", replay.cause)
    x.attempt += 1
    return False


async def _over_http(x: Exchange, reason: Reason | None, adopt: bool = False) -> web.StreamResponse:
    """Plain HTTP passthrough: slower, never wrong. ``adopt``: the completed response becomes
    the conversation's head (issue 23: its later turns are continued)."""
    x.rec.over_http(reason, x.down.upstream_wait)
    x.down.headers["x-upshift-mode"] = Mode.PASSTHROUGH
    if "generate" in x.req.fields:  # over HTTP a warm-up is a real, billed generation or a 400 (pitfall 18)
        exc = UnsupportedRequest("The 'generate' parameter is only supported in WebSocket mode.", param="generate")
        return refuse(exc, x.down.headers, x.rec, x.arrival.started)
    arrival = x.arrival
    fwd = await x.svc.passthrough.forward(
        arrival.request,
        headers=x.down.headers,
        body=x.req.body,
        started=arrival.started,
        options=Options(capture=adopt, on_id=x.down.on_id),
    )
    if adopt and fwd.captured is not None:
        x.svc.pool.adopt_http(arrival.identity, x.req, fwd.captured)
    x.rec.forwarded(fwd.bytes_sent, fwd.upstream_seconds, fwd.added_seconds)
    return fwd.response


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
