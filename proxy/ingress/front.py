"""The front of ``POST /v1/responses``: where is this request served?

The ingress layer reads the body within the limit under its memory lease, identifies the
caller and asks the cluster whether another process or replica owns the conversation (then
that one answers: a handoff of the connection or a forward of the bytes). Only a request
served here reaches the local handler (:func:`proxy.serve.handlers.serve`), as an
:class:`~proxy.serve.handlers.Arrival`: body, identity, record. The handler imports nothing
of the cluster, the handoff or the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from proxy.core.reasons import RequestOutcome
from proxy.errors import RequestError
from proxy.ingress.cluster import Cluster
from proxy.ops.metrics import INFLIGHT, REQUEST_BYTES
from proxy.serve.handlers import SERVICES, Arrival, refuse, serve
from proxy.serve.memory import MemoryRefused
from proxy.serve.streaming import Record, new_request_id, read_body

__all__ = ["CLUSTER", "post_responses"]

CLUSTER = web.AppKey("upshift_cluster", Cluster)
"""Conversation affinity: forwards a request to the process owning it (absent: serve here)."""

_NO_LEASE: contextlib.nullcontext[None] = contextlib.nullcontext()
"""Stands in for the memory lease when there is no gate (an app built without one)."""


async def post_responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``."""
    started = time.perf_counter()
    rec = Record(new_request_id())
    INFLIGHT.inc()
    svc = request.app[SERVICES]
    try:
        # issue 12: the request's memory lease, from before its body is read until its answer
        # is written; a refusal (429/503 + retry-after) is answered here, nothing was read.
        try:
            async with svc.memory.lease(request.content_length) if svc.memory else _NO_LEASE as mem:
                try:
                    body = await read_body(request, svc.settings.limits.max_body_bytes, mem)
                    rec.bytes_in = len(body)
                    REQUEST_BYTES.inc(len(body))
                    arrival = Arrival(request, body, svc.identity(request), rec, started, mem)
                    routed = await _route(request, arrival)
                except RequestError as exc:
                    response: web.StreamResponse = refuse(exc, {"x-request-id": rec.request_id}, rec, started)
                else:
                    response = routed if routed is not None else await serve(svc, arrival)
        except MemoryRefused as exc:
            response = refuse(exc, exc.headers(rec.request_id), rec, started)
            rec.outcome = RequestOutcome.PROXY_ERROR
        rec.status = response.status
        return response
    except asyncio.CancelledError:
        rec.outcome = RequestOutcome.CANCELLED
        raise
    except Exception:
        rec.outcome, rec.status = RequestOutcome.PROXY_ERROR, 500
        raise
    finally:
        INFLIGHT.dec()
        if not rec.added_s:
            rec.added_s = max(time.perf_counter() - started - rec.upstream_s, 0.0)
        rec.finish()


async def _route(request: web.Request, arrival: Arrival) -> web.StreamResponse | None:
    """The owner's answer when another process or replica owns the conversation, else None."""
    cluster = request.app.get(CLUSTER)
    if cluster is None:
        return None
    return await cluster.maybe_forward(request, arrival.body, arrival.identity, arrival.rec)
