"""The access record of one request: one line, written once per stage, and the counts that go with each.

Every stage of the request path (:mod:`proxy.serve.handlers`, the reception in
:mod:`proxy.ingress.reception`) writes the record through one method named by the stage; the
counters that belong to a stage (tolerated echoes, replays, the sidecar's own errors, HTTP
continuations) are counted by the same method, so a stage's bookkeeping is in one place. At the
end, :meth:`Record.finish` emits the request's metrics and its access line (never content, never
credentials), a miss's explanation computed after the answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from proxy.core.answer import status_outcome
from proxy.core.explain import Explanation
from proxy.core.plans import Continue, HttpContinue, OnLane
from proxy.core.request import Transport
from proxy.core.waiting import Waiting
from proxy.observe.log import access_log
from proxy.observe.metrics import (
    ADDED_LATENCY,
    CONTINUATION_MISSES,
    DROPPED_REASONING,
    ECHO_TOLERANCES,
    ERRORS,
    HTTP_CONTINUATIONS,
    HYDRATED,
    INPUT_ITEMS_AVOIDED,
    LANE_WAITS,
    PASSTHROUGH,
    REPLAYS,
    REQUESTS,
    SERVICE_TIERS,
    UPSTREAM_BYTES_SENT,
)
from proxy.observe.misses import RECENT
from proxy.reasons import (
    ForwardReason,
    Hit,
    Mode,
    PassthroughReason,
    Reason,
    ReplayCause,
    RequestOutcome,
    Route,
    ServiceTier,
    Tolerance,
    WaitOutcome,
)
from proxy.upstream.passthrough import Forwarded

__all__ = ["Record"]

log = logging.getLogger("upshift.streaming")
"""The record's lines went out under the streaming module's name before it had its own."""

_EXPLAINER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="upshift-explain")
"""Explains misses (:meth:`Record.finish`) off the event loop, one at a time."""
_EXPLAIN_INLINE_BYTES = 256 * 1024
"""Misses of requests up to this size are explained on the loop (after the answer); larger
ones in :data:`_EXPLAINER`."""
_MAX_EXPLAINING = 64
"""Explanations waiting or running at most; beyond, a miss's line goes out unexplained."""
_EXPLAINING = [0]
_MISSED_OVER_HTTP = frozenset({PassthroughReason.POOL_FULL, PassthroughReason.WAIT_NOT_WORTH_IT})
"""Passthrough reasons that are also continuation misses (a conversation's turn found no lane)."""
_SENT_ON_SOCKETS = UPSTREAM_BYTES_SENT.labels("websocket")
"""``upshift_upstream_bytes_sent_total`` of the sockets, looked up once (a constant label)."""


_CHILDREN: dict[tuple[object, ...], Counter] = {}
"""Labelled children of the counters the record writes per turn, by label values (every label is an enum value:
a bounded set), so that a turn looks each up in one dict instead of prometheus' ``labels``."""


def child(metric: Counter, *values: str) -> Counter:
    """``metric.labels(*values)``, looked up once per label set (per-turn cost)."""
    key = (metric, *values)
    found = _CHILDREN.get(key)
    if found is None:
        found = _CHILDREN[key] = metric.labels(*values)
    return found


@dataclass(slots=True)
class Record:
    """One access-log line, filled in along the way (never content, never credentials)."""

    request_id: str
    route: Route = Route.RESPONSES
    mode: Mode = Mode.FULL
    reason: Reason | None = None
    """``None`` is logged as ``""``: nothing to say (a continuation's is ``continuation``)."""
    transport: Transport | None = None
    """:attr:`Transport.HTTP` for a continuation sent over plain HTTP; else ``None``."""
    items_in: int = 0
    items_sent: int = 0
    items_avoided: int = 0
    bytes_in: int = 0
    bytes_sent: int = 0
    status: int = 0
    outcome: RequestOutcome | None = None
    """``None`` until an answer sets it; then :meth:`finish` derives it from :attr:`status`."""
    replays: int = 0
    upstream_s: float = 0.0
    added_s: float = 0.0
    explanation: Explanation | None = None
    """Where a miss departed from its best candidate head, as :attr:`explainer` computed it."""
    explained: Reason | None = None
    """The matcher's verdict the explanation was computed for."""
    explainer: Callable[[], Explanation | None] | None = None
    """Computes :attr:`explanation` (:meth:`~proxy.core.explainer.MissExplainer.explain_later`)."""
    tier_requested: ServiceTier | None = None
    tier_served: ServiceTier | None = None
    """The service tiers of a response that ended on a socket (:meth:`tiers`)."""
    wait_s: float = 0.0
    """Seconds the request waited for a lane or a handshake (the sidecar's time)."""
    wait: WaitOutcome | None = None
    """How its wait for a lane ended, or why it did not wait (``None``: no lane was busy)."""

    # -- one write per stage of the request path (proxy/serve/handlers.py); no module but this
    # one assigns a field (tests/test_record_stages.py) ----------------------------------------

    def received(self, bytes_in: int) -> None:
        """The intake stage: the request body's size (read, or declared when it streams on)."""
        self.bytes_in = bytes_in

    def parsed(self, items_in: int) -> None:
        """The parse stage: the input items the app sent."""
        self.items_in = items_in

    def planned(self, mode: Mode, reason: Reason | None, items_sent: int, items_avoided: int) -> None:
        """The plan stage: how the attempt goes upstream."""
        self.mode, self.reason, self.items_sent, self.items_avoided = mode, reason, items_sent, items_avoided

    def waited(self, waiting: Waiting) -> None:
        """The wait stage: how long the attempt waited for a lane or a handshake, and how its
        wait for a lane ended (or why it did not wait)."""
        self.wait_s += waiting.seconds
        if waiting.outcome is not None:
            self.wait = waiting.outcome
            child(LANE_WAITS, waiting.outcome).inc()

    def planned_lane(self, plan: OnLane, waiting: Waiting, n_items: int, first: bool) -> None:
        """The wait and plan stages of an attempt on a lane (``first``: not a replay): its wait
        (:meth:`waited`), then continued with the plan's new items, or sent in full (a replay
        keeps the reason it replays for); what the echo left out that the match tolerated,
        counted once per request."""
        self.waited(waiting)
        cont = isinstance(plan, Continue)
        if (plan.dropped_reasoning or plan.dropped_phase) and first:
            accepted = "true" if cont else "false"
            if plan.dropped_reasoning:
                DROPPED_REASONING.labels(accepted).inc()
                ECHO_TOLERANCES.labels(Tolerance.REASONING, accepted).inc()
            if plan.dropped_phase:
                ECHO_TOLERANCES.labels(Tolerance.PHASE, accepted).inc()
        if isinstance(plan, Continue):
            if plan.hydrated:
                HYDRATED.inc()
            self.planned(Mode.CONTINUATION, Hit.CONTINUATION, len(plan.new_items), plan.items_avoided)
        else:
            self.planned(Mode.FULL, plan.reason if first else self.reason, n_items, 0)

    def planned_http(self, plan: HttpContinue) -> None:
        """The plan stage of a continuation over plain HTTP."""
        self.planned(Mode.CONTINUATION, Hit.CONTINUATION, len(plan.new_items), plan.items_avoided)
        self.transport = Transport.HTTP

    def pumped(self, sent: int, upstream_s: float, tier: object = None, response: dict[str, Any] | None = None) -> None:
        """The pump stage: ``sent`` more bytes went upstream on a socket; the upstream's time so far;
        ``tier``: the ``service_tier`` asked for, counted with the served one when ``response`` ended."""
        _SENT_ON_SOCKETS.inc(sent)
        self.bytes_sent += sent
        self.upstream_s = upstream_s
        if response is not None:
            self.tiers(tier, response)

    def tiers(self, requested: object, response: dict[str, Any] | None) -> None:
        """The service tier the app asked for and the one the upstream served (the response's
        ``service_tier``): ``upshift_service_tiers_total`` and the access line."""
        self.tier_requested = ServiceTier.of(requested)
        self.tier_served = ServiceTier.of(response.get("service_tier") if response is not None else None)
        child(SERVICE_TIERS, self.tier_requested, self.tier_served).inc()

    def answered(self, outcome: RequestOutcome | None, added_s: float, error: str | None = None) -> None:
        """The answer stage (``outcome`` ``None``: derived from the status at the end); ``error``:
        the sidecar's own error code it surfaces (``upshift_errors_total``)."""
        if error is not None:
            ERRORS.labels(error).inc()
        if outcome is not None:
            self.outcome = outcome
        self.added_s = added_s

    def responded(self, status: int) -> None:
        """The answer's HTTP status, as written to the app (``101``: a WebSocket upgrade)."""
        self.status = status

    def cancelled(self, status: int | None = None) -> None:
        """The app went away before its answer (``status``: what the line says it got, 499)."""
        self.outcome = RequestOutcome.CANCELLED
        if status is not None:
            self.status = status

    def failed(self, status: int | None = None) -> None:
        """The sidecar could not serve the request (``status``: the one it answered with)."""
        self.outcome = RequestOutcome.PROXY_ERROR
        if status is not None:
            self.status = status

    def connected(self, added_s: float) -> None:
        """A WebSocket relay's upstream socket is open: the sidecar's time up to it."""
        self.added_s = added_s

    def sent_to(self, reason: ForwardReason) -> None:
        """The request went to the process that owns it (``mode="forwarded"``), as ``reason`` says."""
        self.mode, self.reason = Mode.FORWARDED, reason

    def upstream_time(self, seconds: float) -> None:
        """``seconds`` more spent waiting on what answers (another process, when forwarded)."""
        self.upstream_s += seconds

    def ended(self, elapsed_s: float) -> None:
        """The end of a request served here, ``elapsed_s`` after it arrived: unless the answer
        stage already said it, the sidecar's time is all of it but the upstream's own (a
        stream's queueing after the answer began counts); then :meth:`finish`."""
        if not self.added_s or self.upstream_s:
            self.added_s = max(elapsed_s - self.upstream_s, 0.0)
        self.finish()

    def replayed(self, cause: ReplayCause) -> None:
        """The attempt is replayed with the full input, for ``cause`` (``upshift_replays_total``)."""
        REPLAYS.labels(cause).inc()
        self.replays += 1
        self.reason = cause

    def over_http(self, reason: Reason | None, upstream_s: float) -> None:
        """The request goes over plain HTTP (the upstream's time so far)."""
        self.mode, self.reason, self.upstream_s = Mode.PASSTHROUGH, reason, upstream_s

    def forwarded(self, fwd: Forwarded) -> None:
        """The HTTP passthrough answered: every item went, over HTTP."""
        self.items_sent, self.bytes_sent = self.items_in, fwd.bytes_sent
        self.upstream_s, self.added_s = fwd.upstream_seconds, fwd.added_seconds

    def passed_through(self, fwd: Forwarded) -> None:
        """A route the sidecar only relays over HTTP answered (its status, bytes and times)."""
        self.status, self.bytes_sent = fwd.status, fwd.bytes_sent
        self.upstream_s, self.added_s = fwd.upstream_seconds, fwd.added_seconds

    def continued_http(self, fwd: Forwarded) -> None:
        """An HTTP continuation answered; ``previous_response_not_found`` made it a full send
        of the app's own body (a replay, for that cause)."""
        HTTP_CONTINUATIONS.labels("full" if fwd.fell_back else "continuation").inc()
        if fwd.fell_back:
            self.planned(Mode.FULL, ReplayCause.PREVIOUS_RESPONSE_NOT_FOUND, self.items_in, 0)
            self.replayed(ReplayCause.PREVIOUS_RESPONSE_NOT_FOUND)
        self.bytes_sent = fwd.bytes_sent
        self.upstream_s, self.added_s = fwd.upstream_seconds, fwd.added_seconds

    def explain(self, explainer: Callable[[], Explanation | None] | None, reason: Reason | None) -> None:
        """Attach what computes the explanation of the matcher's miss ``reason`` (never content):
        :meth:`finish` runs it after the answer, and only if the verdict stood.

        If the request still goes out in full for that reason, the line carries ``miss_item``,
        ``miss_type``, ``miss_field``, ``miss_detail`` and ``candidate_items``, and the reason
        becomes the explanation's (a ``no_head`` that edited an early item is ``diverged``).
        """
        self.explanation, self.explainer, self.explained = None, explainer, reason

    def _verdict_stood(self) -> bool:
        """The request went out in full for the reason that was explained (not a continuation
        after all, a replay or HTTP)."""
        return self.mode == Mode.FULL and self.reason == self.explained

    def finish(self) -> None:
        """Emit the metrics and the access line.

        With an explanation still to compute, that happens in the event loop's next round: the
        app's answer is written first (a first turn's explanation compares the request with
        recent heads, a fraction of a millisecond the app need not wait for).
        """
        if self.explainer is not None and self._verdict_stood():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: explain now
                self._explain()
                self._emit()
                return
            if self.bytes_in <= _EXPLAIN_INLINE_BYTES:
                # A small request: a fraction of a millisecond, in the loop's next round.
                loop.call_soon(self._explain_then_emit)
                return
            if _EXPLAINING[0] < _MAX_EXPLAINING:
                # a large one in a thread of its own, one at a time, never on the
                # event loop (its items and a kept body may be compared); the line follows.
                _EXPLAINING[0] += 1
                loop.run_in_executor(_EXPLAINER, self._explain).add_done_callback(self._explained)
                return
            # Too many waiting (one tenant's flood of misses): this line goes unexplained.
        self.explainer = None  # nothing to explain, or the verdict did not stand
        self._emit()

    def _explain(self) -> None:
        explainer, self.explainer = self.explainer, None
        try:
            self.explanation = explainer() if explainer is not None else None
        except Exception:  # noqa: BLE001 - a diagnostic must never cost the request's line
            log.exception("explaining a miss failed")

    def _explain_then_emit(self) -> None:
        self._explain()
        self._emit()

    def _explained(self, _: object) -> None:
        _EXPLAINING[0] -= 1
        self._emit()

    def _emit(self) -> None:
        if self.outcome is None:
            self.outcome = status_outcome(self.status)
        exp = self.explanation
        if exp is None or not self._verdict_stood():
            exp = None  # a continuation after all, a replay, or HTTP: the verdict did not stand
        elif exp.reason:
            self.reason = exp.reason
        child(REQUESTS, self.route, self.mode, self.outcome).inc()
        missed = self.mode == Mode.FULL or self.reason in _MISSED_OVER_HTTP
        if self.mode == Mode.CONTINUATION:
            INPUT_ITEMS_AVOIDED.inc(self.items_avoided)
        elif self.reason and not self.replays and missed:
            # A replay is counted in upshift_replays_total; misses are the matcher's verdicts.
            child(CONTINUATION_MISSES, self.reason).inc()
            RECENT.add(self.reason, self.items_in, exp)
        if self.mode == Mode.PASSTHROUGH and self.route == Route.RESPONSES:
            child(PASSTHROUGH, self.reason or "unknown").inc()
        ADDED_LATENCY.observe(self.added_s)
        access_log(
            {
                "request_id": self.request_id,
                "route": self.route,
                "mode": self.mode,
                "reason": self.reason or "",
                "items_in": self.items_in,
                "items_sent": self.items_sent,
                "bytes_in": self.bytes_in,
                "bytes_sent": self.bytes_sent,
                "status": self.status,
                "outcome": self.outcome,
                "replays": self.replays,
                "upstream_ms": round(self.upstream_s * 1000, 3),
                "added_ms": round(self.added_s * 1000, 3),
                "wait_ms": round(self.wait_s * 1000, 3),
                **({"wait": self.wait.value} if self.wait else {}),
                **({"transport": self.transport.value} if self.transport else {}),
                **(
                    {"tier_requested": self.tier_requested, "tier_served": self.tier_served}
                    if self.tier_served is not None
                    else {}
                ),
                **(exp.fields() if exp is not None else {}),
            }
        )
