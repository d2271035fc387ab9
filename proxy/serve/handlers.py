"""The local handler of ``POST /v1/responses``: a short perform loop over one :class:`Exchange`.

The request path (docs/architecture.md): the ingress front (:mod:`proxy.ingress.front`) hands
:func:`serve` an :class:`Arrival`; :func:`serve` parses it (the fast parse) and chooses the
transport; :func:`_perform` then loops **plan** (``Pool.plan``: continue / full on a lane, or
HTTP) → **lease** the lane (``async with Pool.lease``; its exit records the head or frees the
lane, on every path) → **pump** (:func:`~proxy.serve.streaming.pump`) → **answer**: which
answer, or a replay, is :func:`proxy.core.answer.decide`'s choice (pure, beside
:func:`proxy.core.retry.classify`); the shell only performs it. A failure before anything
reached the app is replayed once with the app's full input; after that it surfaces. Whenever no
lane can be had, the request goes over plain HTTP: slower, never wrong (:func:`_over_http`, or
:func:`_http_continuation` for a stored head; both through :func:`_relay`). Each stage writes
the access record once, through the :class:`~proxy.serve.record.Record` method named by the
stage (which counts the stage's metrics too): plan (:func:`_planned`), pump
(:func:`_lease_and_pump`), answer (:func:`_answer`), replay (:func:`_replay`), HTTP. What is
not the loop's has its own module: the reception (:mod:`proxy.ingress.reception`), large
bodies kept off the event loop (:mod:`proxy.serve.offload`), the responses in flight
(:mod:`proxy.serve.inflight`).
"""

from __future__ import annotations

import asyncio
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
from proxy.core.explainer import MissExplainer
from proxy.core.named_ids import parsed_ids
from proxy.core.plans import Continue, Full, Http, HttpContinue, OnLane
from proxy.core.request import ParsedRequest, Transport, choose_transport, http_unsupported
from proxy.core.retry import Replay
from proxy.core.waiting import Waiting
from proxy.errors import ProxyError, RequestError, UpstreamError
from proxy.intake.identity import Identity, request_identity
from proxy.intake.keys import KeySource
from proxy.intake.memory import WHOLE_FRAME_EXTRA_ABOVE, Lease, MemoryGate
from proxy.observe.metrics import UPSTREAM_DURATION
from proxy.reasons import Mode, PassthroughReason, Reason, RequestOutcome
from proxy.serve.creator_check import OwnerBook
from proxy.serve.inflight import Streams
from proxy.serve.offload import hash_prefix_in_thread, large, warm_keys
from proxy.serve.record import Record
from proxy.serve.streaming import Downstream, count_hold_back, json_body, pump, wants_obfuscation
from proxy.upstream.passthrough import Forwarded, Options, Passthrough, http_continuation_body
from proxy.upstream.pool import Pool, Turn

__all__ = ["SERVICES", "Arrival", "Services", "refuse", "serve"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Services:
    """Everything a handler needs, shared by the whole API app."""

    settings: Settings
    keys: KeySource
    heads: HeadTable
    misses: MissExplainer
    """Explains a miss of :attr:`heads` after the answer (the access line's ``miss_*`` fields)."""
    pool: Pool
    passthrough: Passthrough
    relays: set[web.WebSocketResponse] = field(default_factory=set)
    """Open downstream WebSocket relays (closed with 1001 on shutdown)."""
    streams: Streams = field(default_factory=Streams)
    """Responses being pumped to apps right now (ended if the drain's grace runs out)."""
    memory: MemoryGate | None = None
    """The memory budget every request draws from (proxy/intake/memory.py)."""
    owners: OwnerBook = field(init=False)
    """Who created each response id, and who may name it (proxy/serve/creator_check.py)."""

    def __post_init__(self) -> None:
        shared = self.settings.identity.shared_objects
        self.owners = OwnerBook(self.pool.owners, strict=self.keys.injects, shared=shared)

    @property
    def relay_sessions(self) -> Counter[str]:
        """Open WebSocket relay sessions per identity: upstream sockets outside the pool, counted
        by the planner against the socket limits."""
        return self.pool.planner.outside

    def identity(self, request: web.Request) -> Identity:
        """The caller's identity (and the upstream upgrade headers)."""
        # providers hook: credential headers, injected key header and the app's query string.
        return request_identity(request.headers, request.rel_url.raw_query_string, self.settings, self.keys)


SERVICES = web.AppKey("upshift_services", Services)


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
    outcome = RequestOutcome.CLIENT_ERROR if isinstance(exc, RequestError) else RequestOutcome.UPSTREAM_ERROR
    rec.answered(outcome, time.perf_counter() - started, exc.code)
    headers = {**headers, "x-upshift-overhead-ms": f"{rec.added_s * 1000:.3f}"}
    return web.Response(body=json_body(exc.body()), status=exc.status, content_type="application/json", headers=headers)


@dataclass(slots=True)
class Exchange:
    """One ``POST /v1/responses`` served here, from its parse to its answer: what every stage
    reads, and the one access record they fill (one stage, one write)."""

    svc: Services
    req: ParsedRequest
    down: Downstream
    """The app's side: its request, the answer's headers, arrival time and memory lease."""
    identity: Identity
    rec: Record
    attempt: int = 0
    """0 for the first try; a replay counts up."""
    prefix: asyncio.Future[Any] | None = None
    """The history prefix's hash, computed in a thread for a large body (the next fast parse)."""


async def serve(svc: Services, arrival: Arrival) -> web.StreamResponse:
    """Serve one ``POST /v1/responses`` here: parse, choose the transport, perform."""
    headers = {"x-request-id": arrival.rec.request_id}
    try:
        req = await _parse(svc, arrival)
    except RequestError as exc:
        return refuse(exc, headers, arrival.rec, arrival.started)
    # every response id this request gets is recorded with its creator before the app sees it.
    on_id = partial(svc.owners.note, arrival.identity.digest)
    down = Downstream(
        arrival.request, stream=req.stream, headers=headers, started=arrival.started, lease=arrival.mem, on_id=on_id,
        obfuscation=wants_obfuscation(req.fields),
    )  # fmt: skip
    x = Exchange(svc, req, down, arrival.identity, arrival.rec)
    budget = svc.settings.limits.ws_frame_budget_bytes
    transport, reason = choose_transport(req, mode=svc.settings.mode, frame_budget=budget)
    return await (_over_http(x, reason) if transport is Transport.HTTP else _perform(x))


async def _parse(svc: Services, arrival: Arrival) -> ParsedRequest:
    """The fast parse (skips the history prefix this identity's previous turn already sent);
    another tenant's ``previous_response_id`` (or, behind an injected key, one no process knows)
    is refused: the upstream's store is shared behind one key and would serve it.
    The ids are read from this parse (:func:`~proxy.core.named_ids.parsed_ids`), never from a second one;
    a request that names none (most turns) has nothing to check."""
    req = svc.heads.parse(arrival.identity.digest, arrival.body)
    named = parsed_ids(req)
    if named.names_any:
        await svc.owners.check(arrival.identity.digest, named)
    if large(req):
        await warm_keys(req)
    arrival.rec.parsed(req.n_items)
    return req


async def _perform(x: Exchange) -> web.StreamResponse:
    """Plan → lease a lane → pump → answer; a failure before output is replayed once."""
    x.prefix = hash_prefix_in_thread(x.req) if large(x.req) else None
    while True:
        plan, waiting = await x.svc.pool.plan(x.identity, x.req, replay=x.attempt > 0)
        if isinstance(plan, Http):  # a stored new conversation's answer is adopted as a head
            x.rec.waited(waiting)
            return await _over_http(x, plan.reason, adopt=x.req.adoptable)
        if isinstance(plan, HttpContinue):
            x.rec.waited(waiting)
            return await _http_continuation(x, plan)
        channel, verdict = await _lease_and_pump(x, plan, waiting)
        if isinstance(verdict, Answer):
            return await _answer(x, channel, verdict)
        if _replay(x, plan, channel, verdict):
            return await _over_http(x, PassthroughReason.FRAME_TOO_BIG)


def _planned(x: Exchange, plan: OnLane, waiting: Waiting) -> bytes:
    """The plan stage: its record (its wait, its counts), a miss's explanation, the
    ``response.create`` frame."""
    first = x.attempt == 0
    x.rec.planned_lane(plan, waiting, x.req.n_items, first)
    if first and isinstance(plan, Full):  # where the miss departs (never content), after the answer
        x.rec.explain(x.svc.misses.explain_later(x.identity.digest, x.req, plan.reason), plan.reason)
    x.down.headers["x-upshift-mode"] = x.rec.mode
    return plan.frame(x.req)


async def _lease_and_pump(x: Exchange, plan: OnLane, waiting: Waiting) -> tuple[Channel, Answer | Replay]:
    """Lease the plan's lane and pump one response on it (the lane keeps its head on the way
    out); the attempt's verdict (:func:`~proxy.core.answer.decide`: its answer or its replay),
    then the pump stage's record, next to the answer stage's."""
    hold = x.svc.settings.streaming.hold_back_seconds if x.req.stream else None
    channel = Channel(x.req.previous_response_id, hold_back_s=hold)
    frames = [_planned(x, plan, waiting)]  # pump takes the only reference, frees it once sent
    sent, failure = len(frames[0]), None
    if sent > WHOLE_FRAME_EXTRA_ABOVE and x.down.lease is not None and not x.svc.settings.pool.fragment_bytes:
        await x.down.lease.whole_frame(sent)  # its masked copy is paid for too (a small one's is not)
    try:
        with x.svc.streams.pumping(x.down, channel):
            async with x.svc.pool.lease(plan) as turn:
                sent_at = time.perf_counter()
                await pump(turn, frames, channel, x.down, x.svc.settings.timeouts.stream_idle_seconds)
                UPSTREAM_DURATION.observe(time.perf_counter() - sent_at)
                await _keep(x, turn, kept(channel))
                await x.down.settle(channel)  # the app's answer before the lane records its head
    except UpstreamError as exc:
        failure = exc
    attempt = Attempt(x.attempt, isinstance(plan, Continue), plan.lane[1] is not None, x.req.stream)
    verdict = decide(channel, failure, attempt, x.down.written)
    x.rec.pumped(sent, x.down.upstream_wait, x.req.fields.get("service_tier"), channel.response)
    return channel, verdict


async def _keep(x: Exchange, turn: Turn, keep: Kept) -> None:
    """Tell the lane what it keeps: a completed response becomes its head."""
    if keep.chainable is not None:  # an incomplete response is chainable too
        x.svc.owners.note(x.identity.digest, keep.chainable)
    state = await x.prefix if keep.response is not None and x.prefix is not None else None
    turn.finish(req=x.req, response=keep.response, prefix_state=state, retire=keep.retire)


async def _answer(x: Exchange, channel: Channel, answer: Answer) -> web.StreamResponse:
    """The answer stage: its record (outcome, added time, error count), the answer written."""
    x.rec.answered(answer.outcome, x.down.added(), answer.error)
    try:
        return await x.down.answer(answer)
    finally:
        count_hold_back(channel)


def _replay(x: Exchange, plan: OnLane, channel: Channel, replay: Replay) -> bool:
    """The replay stage: its record, the pool told what the upstream refused; ``True`` if it
    goes over HTTP."""
    count_hold_back(channel)  # what was held never reached the app
    x.rec.replayed(replay.cause)
    x.svc.pool.replayed(replay.cause, plan.lane)
    if not replay.over_http:
        log.info("replaying with full input (%s)", replay.cause)
        x.attempt += 1
    return replay.over_http


async def _over_http(x: Exchange, reason: Reason | None, adopt: bool = False) -> web.StreamResponse:
    """Plain HTTP passthrough: slower, never wrong. ``adopt``: the completed response becomes
    the conversation's head (its later turns are continued)."""
    x.rec.over_http(reason, x.down.upstream_wait)
    x.down.headers["x-upshift-mode"] = Mode.PASSTHROUGH
    if (unsupported := http_unsupported(x.req)) is not None:
        return refuse(unsupported, x.down.headers, x.rec, x.down.started)
    fwd = await _relay(x, x.req.body, Options(capture=adopt, on_id=x.down.on_id))
    x.rec.forwarded(fwd)
    return fwd.response


async def _http_continuation(x: Exchange, plan: HttpContinue) -> web.StreamResponse:
    """A stored head with no lane now: ``previous_response_id`` + the new items over
    plain HTTP; the upstream hydrates the stored response. ``previous_response_not_found`` gets
    the app's own body instead (:meth:`Options.continuation`)."""
    x.rec.planned_http(plan)
    x.down.headers["x-upshift-mode"] = Mode.CONTINUATION
    body = http_continuation_body(x.req, plan.response_id, plan.new_items)
    fwd = await _relay(x, body, Options.continuation(plan.response_id, x.req.body, x.down.on_id))
    x.rec.continued_http(fwd)
    return fwd.response


async def _relay(x: Exchange, body: bytes, options: Options) -> Forwarded:
    """Relay ``body`` over plain HTTP; a captured answer (``options.capture``) becomes the
    conversation's head."""
    d = x.down
    fwd = await x.svc.passthrough.forward(d.request, headers=d.headers, body=body, started=d.started, options=options)
    x.svc.pool.measured_http(x.identity, x.req, fwd, continued=body is not x.req.body)
    if fwd.captured is not None:
        x.svc.pool.adopt_http(x.identity, x.req, fwd.captured)
    return fwd
