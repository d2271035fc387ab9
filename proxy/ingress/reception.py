"""The reception of one ``POST /v1/responses``: its body read in time and within its memory.

Before anyone decides where a request is served, it is received here: its length and the
caller's identity from the headers, its memory lease (from before the body is read
until the answer is written, admitted fairly by identity), its body under the deadlines of
:class:`~proxy.intake.body.BodyClock`. What the reception refuses is answered
here, as it always was: a bad head or body (4xx, the record says ``client_error``), no memory
(429/503 + ``retry-after``), a body that did not keep arriving (408, the connection closed), an
app gone mid-body (nobody reads the answer). The access record is opened, closed and counted
here whatever happens. The answer comes from the process or replica owning the conversation
when the cluster says so (:meth:`~proxy.ingress.cluster.Cluster.maybe_forward`), else from this
process's handler (:func:`~proxy.serve.handlers.serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial

from aiohttp import web

from proxy.errors import BodyTimeout, ProxyError, RequestError
from proxy.ingress.cluster import Cluster
from proxy.intake.body import BodyClock, body_length, read_body
from proxy.intake.identity import Identity
from proxy.intake.memory import Lease, MemoryRefused
from proxy.observe.metrics import BODIES_ABORTED, INFLIGHT, REQUEST_BYTES
from proxy.reasons import BodyAbort
from proxy.serve.handlers import Arrival, Services, refuse, serve
from proxy.serve.record import Record
from proxy.serve.streaming import ClientGone, new_request_id

__all__ = ["Reception"]

log = logging.getLogger("proxy.ingress.front")
"""The front's logger (these lines were the front's before the reception had a module)."""

_NO_LEASE: contextlib.nullcontext[None] = contextlib.nullcontext()
"""Stands in for the memory lease when there is no gate (an app built without one)."""
_LINGER = 10.0
"""How long aiohttp reads and drops an unread body after the answer (its ``lingering_time``)."""


class Reception:
    """Receives one ``POST /v1/responses`` and answers what the reception refuses.

    Args:
        request: The app's request (its head read, its body not yet).
        svc: The app's services (settings, identity, memory gate).
    """

    def __init__(self, request: web.Request, svc: Services) -> None:
        self.request = request
        self.svc = svc
        self.started = arrived_at(request)
        self.rec = Record(new_request_id())
        # the body must be complete within limits.body_timeout_seconds of the head (and
        # keep a minimum rate), waiting for memory included.
        self.clock = BodyClock(svc.settings.limits, asyncio.get_running_loop().time())

    async def answer(self, cluster: Cluster | None) -> web.StreamResponse:
        """Receive the request, then answer it: forwarded to its owner when ``cluster`` (absent:
        a single process) says another process or replica owns it, else served here; the access
        record is finished (and the request counted in flight meanwhile) on every path."""
        INFLIGHT.inc()
        try:
            return await self._answer(cluster)
        except asyncio.CancelledError:
            self.rec.cancelled()
            raise
        except Exception:
            self.rec.failed(500)
            raise
        finally:
            INFLIGHT.dec()
            self.rec.ended(time.perf_counter() - self.started)  # a stream's last byte is written by now

    async def _answer(self, cluster: Cluster | None) -> web.StreamResponse:
        try:
            # The identity is known from the headers: the memory budget admits fairly by it.
            length = body_length(self.request)
            identity = self.svc.identity(self.request)
        except RequestError as exc:
            return self._refuse(exc)
        try:
            async with self._lease(length, identity) as mem:
                return await self._leased(identity, mem, cluster)
        except BodyTimeout as exc:  # the deadline passed while it waited for memory
            return await self._timed_out(exc)
        except MemoryRefused as exc:
            response = self._refuse(exc, exc.headers(self.rec.request_id))
            self.rec.failed()
            return self._answered(response)

    def _lease(self, length: int | None, identity: Identity) -> contextlib.AbstractAsyncContextManager[Lease | None]:
        """The request's memory lease, from before its body is read until its answer is
        written; a refusal (429/503 + retry-after) is answered by :meth:`_answer`, nothing read."""
        memory, request = self.svc.memory, self.request
        if memory is None:
            return _NO_LEASE
        # Admitted fairly by tenant (what the caller cannot vary for free); the body's promise
        # counts only as far as what the app actually sent can deliver it in time.
        return memory.lease(
            length,
            key=identity.tenant,
            headers=_head_size(request),
            deadline=self.clock.deadline,
            keyless=identity.keyless,
            progress=partial(_sent, request),
        )

    async def _leased(self, identity: Identity, mem: Lease | None, cluster: Cluster | None) -> web.StreamResponse:
        """Under the lease: read the body, then the owner's answer, else this process's."""
        try:
            body = await read_body(self.request, self.svc.settings.limits.max_body_bytes, mem, self.clock)
            self.rec.received(len(body))
            REQUEST_BYTES.inc(len(body))
            arrival = Arrival(self.request, body, identity, self.rec, self.started, mem)
            routed = (
                await cluster.maybe_forward(self.request, body, identity, self.rec)
                if cluster is not None and cluster.routes
                else None
            )
        except ClientGone:
            BODIES_ABORTED.labels(BodyAbort.CLIENT_GONE).inc()
            log.info("the app closed its connection before its request body was complete")
            self.rec.cancelled(499)
            return web.Response(status=400)  # nobody reads it: aiohttp drops it quietly
        except BodyTimeout as exc:
            return await self._timed_out(exc)
        except RequestError as exc:
            return self._answered(self._refuse(exc))
        return self._answered(routed if routed is not None else await serve(self.svc, arrival))

    def _refuse(self, exc: ProxyError, headers: dict[str, str] | None = None) -> web.Response:
        if headers is None:
            headers = {"x-request-id": self.rec.request_id}
        response = refuse(exc, headers, self.rec, self.started)
        self.rec.responded(response.status)
        return response

    def _answered(self, response: web.StreamResponse) -> web.StreamResponse:
        """The answer's status on the record; a refusal with the body unread: aiohttp then reads
        and drops the rest for a while (so the app sees the answer, not a reset), then closes;
        if the body's deadline comes first, it stops there."""
        self.rec.responded(response.status)
        request, loop = self.request, asyncio.get_running_loop()
        if response.status < 400 or request.content.is_eof() or self.clock.deadline >= loop.time() + _LINGER:
            return response  # read to its end, or the lingering ends first

        def close() -> None:
            if not request.content.is_eof() and request.transport is not None:
                request.protocol.force_close()

        loop.call_at(self.clock.deadline, close)
        return response

    async def _timed_out(self, exc: BodyTimeout) -> web.StreamResponse:
        """408 for a body that did not keep arriving, and the connection closed (never drained)."""
        BODIES_ABORTED.labels(BodyAbort.TOO_SLOW if exc.slow else BodyAbort.TIMEOUT).inc()
        why = "too slow" if exc.slow else "deadline"
        log.info("closed a connection whose request body did not keep arriving (%s)", why)
        response = self._refuse(exc, {"x-request-id": self.rec.request_id, "Connection": "close"})
        with contextlib.suppress(ConnectionError):
            await response.prepare(self.request)
            await response.write_eof()
        self.request.protocol.force_close()  # the rest of the body is not waited for (no lingering)
        return response


def _sent(request: web.Request) -> int:
    """Bytes of the body the app sent so far (received from the socket, read or not)."""
    return int(request.content.total_raw_bytes)


def arrived_at(request: web.Request) -> float:
    """``time.perf_counter()`` when the request's first bytes were read (the hardened
    listener's protocol notes it, :class:`~proxy.ingress.listener.GuardedHandler`), else now:
    the sidecar's time starts there, not when its handler got to run (under load, the loop's
    queueing before the handler is the sidecar's too)."""
    now = time.perf_counter()
    arrived = getattr(request.protocol, "arrived", 0.0)
    return arrived if isinstance(arrived, float) and 0.0 < arrived <= now else now


def _head_size(request: web.Request) -> int:
    """Bytes of the request's head (they count against the memory budget)."""
    return len(request.raw_path) + sum(len(k) + len(v) + 4 for k, v in request.raw_headers) + 16
