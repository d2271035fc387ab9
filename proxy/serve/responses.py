"""The routes that name a stored response: ``GET``/``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel`` (and anything else
under ``/v1/responses/{id}/``), plus the other ``POST /v1/responses/...`` routes whose body may
carry a ``previous_response_id`` (``/compact``, ``/input_tokens``).

Each asks the owner book (:mod:`proxy.serve.creator_check`) before anything is forwarded (a body is
read as one JSON object by :func:`~proxy.core.named_ids.read_request`: one that does not parse, or
repeats a key naming an id, gets a 400 and is not forwarded): a response
id another identity created is answered with the upstream's own 404 for an unknown id (a
``previous_response_id`` with its 400 ``previous_response_not_found``), and behind an injected
key so is an id no process of the sidecar knows. Everything allowed is relayed unchanged over
HTTP, as before (:mod:`proxy.upstream.passthrough`).
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from proxy.core.named_ids import PARSE_INLINE, NamedIds, read_request
from proxy.errors import ForeignResponseRoute, RequestError
from proxy.intake.body import read_body
from proxy.reasons import Mode, Route
from proxy.serve.handlers import SERVICES, refuse
from proxy.serve.record import Record
from proxy.serve.streaming import new_request_id

__all__ = ["add_routes"]

_ID_SUBROUTES = "/v1/responses/{response_id}/{tail:.*}"
_ID_ROUTE = "/v1/responses/{response_id}"
_NOT_IDS = frozenset({"compact", "input_tokens"})
"""``POST /v1/responses/<these>`` are operations, not ids (their bodies are checked instead)."""


def add_routes(app: web.Application) -> None:
    """Register the id-bearing ``/v1/responses/...`` routes (before the ``/v1`` catch-all)."""
    app.router.add_route("*", _ID_SUBROUTES, _named)
    app.router.add_route("*", _ID_ROUTE, _named)


async def _named(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()
    rec = Record(new_request_id(), route=Route.OTHER, mode=Mode.PASSTHROUGH)
    headers = {"x-request-id": rec.request_id}
    svc = request.app[SERVICES]
    try:
        rid = request.match_info["response_id"]
        body: bytes | None = None
        try:
            identity = svc.identity(request)
            if request.method == "POST" and "tail" not in request.match_info and rid in _NOT_IDS:
                body = await read_body(request, svc.settings.limits.max_body_bytes)
                await svc.owners.check(identity.digest, await _read(body))
            elif not await svc.owners.allows(identity.digest, rid):
                raise ForeignResponseRoute(rid)
        except RequestError as exc:
            response = refuse(exc, headers, rec, started)
            rec.responded(response.status)
            return response
        headers["x-upshift-mode"] = "passthrough"
        rec.received(len(body) if body is not None else request.content_length or 0)
        fwd = await svc.passthrough.forward(request, headers=headers, body=body, started=started)
        rec.passed_through(fwd)
        return fwd.response
    finally:
        rec.finish()


async def _read(body: bytes) -> NamedIds:
    """The ids ``body`` names, read as the upstream reads it (in a thread when it is large)."""
    return read_request(body) if len(body) <= PARSE_INLINE else await asyncio.to_thread(read_request, body)
