"""The app's side of one ``POST /v1/responses``, and the loop that feeds it from upstream.

``stream: true``: an SSE ``StreamResponse``, prepared when the first event is released (so an
error before any response event can still become an HTTP status), one write per read of the
upstream socket (all the events it brought; or per released batch), the upstream's JSON bytes
unchanged. ``stream: false``: nothing is written until the terminal event; then one JSON body.

``x-upshift-overhead-ms`` is the sidecar's own time up to the moment the headers go out: wall
time since the request's first bytes arrived minus the upstream's own time (from the frame's
send to the arrival at the socket of the latest event, :attr:`LeasedLane.upstream_seconds`):
the sidecar's queueing, before the handler ran or after an event arrived and before the loop
handed it on, is its own. For a stream that is the overhead before the first byte; the access
log and ``upshift_added_latency_seconds`` record the same measure at the end of the response.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import orjson
from aiohttp import web

from proxy import contracts
from proxy.core.answer import Answer, AnswerKind, finished
from proxy.core.channel import TERMINAL, Channel, HoldPath, Out
from proxy.errors import ClientGone, UpstreamTimeout
from proxy.intake.memory import Lease
from proxy.observe.metrics import HELD_LIFECYCLE
from proxy.wire.sse import CONTENT_TYPE, encode_events

log = logging.getLogger("upshift.streaming")

__all__ = [
    "ClientGone",
    "Downstream",
    "LeasedLane",
    "count_hold_back",
    "json_body",
    "new_request_id",
    "pump",
    "wants_obfuscation",
]

_MAX_WRITE = 1024 * 1024
"""Most bytes of events (as upstream sent them) written to the app in one write: more than one
read of the upstream socket brings (256 KiB), so a read's events leave in one write; a backlog
(the app reads slowly) goes in writes of this size, each followed by aiohttp's drain, which
bounds what waits in the app's write buffer."""


def json_body(obj: Any) -> bytes:
    """Compact JSON bytes (orjson)."""
    return orjson.dumps(obj)


_LAST = frozenset(TERMINAL) | {"response.done"}
"""Event types after which nothing more is written: their write also ends the body."""
_CREATIONS = frozenset({"response.created", "response.output_item.added"})
"""Events that show the app a new id (the response's, an output item's: ``item_reference``)."""
_HELD = {path: HELD_LIFECYCLE.labels(path) for path in HoldPath}
"""``upshift_held_lifecycle_total`` by path, looked up once (a constant label set)."""


def _frames(outs: list[Out]) -> bytes:
    return encode_events((o.type, o.raw if o.raw is not None else orjson.dumps(o.obj)) for o in outs)


def wants_obfuscation(fields: Mapping[str, Any]) -> bool:
    """``stream_options.include_obfuscation`` as the app asked (default true, as on the API)."""
    options = fields.get("stream_options")
    return not (isinstance(options, dict) and options.get("include_obfuscation") is False)


def _without_obfuscation(out: Out) -> Out:
    """``out`` minus the ``obfuscation`` of a delta event. The frame leaves ``stream_options`` out
    (protocol.md §4.1) and whether a WebSocket upstream adds ``obfuscation`` is undocumented, so an
    app that asked for none gets none whichever transport its turn took (docs/fidelity.md)."""
    if not out.type.endswith(".delta"):
        return out
    if out.raw is not None:
        if out.raw.find(b'"obfuscation"') < 0:
            return out
        event = orjson.loads(out.raw)
        if not isinstance(event, dict) or "obfuscation" not in event:
            return out
        del event["obfuscation"]
        return Out(out.type, orjson.dumps(event))
    if out.obj is not None and "obfuscation" in out.obj:
        return Out(out.type, None, {k: v for k, v in out.obj.items() if k != "obfuscation"})
    return out


class Downstream:
    """What goes back to the app for one request.

    Args:
        request: The app's request.
        stream: Whether the app asked for SSE.
        headers: Headers for the answer (``x-request-id``, ``x-upshift-mode``); the caller may
            update them until the answer starts.
        started: ``time.perf_counter()`` when the request arrived.
        lease: The request's memory lease: :func:`pump` shrinks it to the body once the frame
            is sent.
        on_id: Told the id of each response :func:`pump` moves and of its output items,
            before the app can see them (the id's owner is recorded first).
        obfuscation: False when the app asked for no ``obfuscation`` on deltas: it is taken out.
    """

    def __init__(
        self,
        request: web.Request,
        *,
        stream: bool,
        headers: dict[str, str],
        started: float,
        lease: Lease | None,
        on_id: Callable[[str], None] | None = None,
        obfuscation: bool = True,
    ) -> None:
        self.request = request
        self.obfuscation = obfuscation
        """The app did not ask ``stream_options.include_obfuscation: false`` (:func:`wants_obfuscation`)."""
        self.stream = stream
        self.headers = headers
        self.started = started
        self.lease = lease
        self.on_id = on_id
        self.response: web.StreamResponse | None = None
        """The answer once prepared: SSE at its first events, JSON once :meth:`settle` sent it."""
        self.gone = False
        """The app went away mid-stream; the rest of the response is drained, not written."""
        self.upstream_wait = 0.0
        """The upstream's own seconds (from each frame's send to its latest event's arrival)."""
        self.bytes_out = 0
        """SSE bytes written to the app."""
        self._last = b""
        """The batch that ends with the terminal event, sent by :meth:`end` with the body's end."""
        self._ended = False
        """:meth:`end` ended the SSE body (nothing more can be written)."""

    @property
    def written(self) -> bool:
        """Whether headers (and maybe events) already went to the app."""
        return self.response is not None

    def added(self) -> float:
        """The sidecar's own time so far, in seconds."""
        return max(time.perf_counter() - self.started - self.upstream_wait, 0.0)

    def _overhead_header(self) -> dict[str, str]:
        return {"x-upshift-overhead-ms": f"{self.added() * 1000:.3f}"}

    async def write(self, outs: list[Out]) -> None:
        """Write released events as SSE (prepares the response on the first call).

        One buffer and one socket write per call: the headers go out with the first events.
        A batch that ends with the terminal event is kept for :meth:`end`, which sends it with
        the end of the body (the chunked encoding's last chunk) in the same write: so a turn
        whose events arrive together costs one write (:meth:`settle` sends it before the lane
        records the conversation's head).
        """
        if self.gone or not outs:
            return
        if not self.obfuscation:
            outs = [_without_obfuscation(o) for o in outs]
        data = _frames(outs)
        if self._last:
            data = self._last + data  # never happens in a well-formed stream
            self._last = b""
        try:
            if self.response is None:
                response = web.StreamResponse(
                    status=200,
                    headers={"Content-Type": CONTENT_TYPE, **self.headers, **self._overhead_header()},
                )
                # aiohttp then sends the headers with the first body bytes, in one write.
                contracts.send_headers_with_first_write(response)
                self.response = response
                await response.prepare(self.request)
            self.bytes_out += len(data)
            if outs[-1].type in _LAST:
                self._last = data
            else:
                await self.response.write(data)
        except ConnectionResetError:
            # The app closed its connection; keep reading upstream to the terminal event so
            # the socket stays usable (pitfall 20), but write nothing more.
            self.gone = True

    async def end(self) -> web.StreamResponse:
        """Finish the SSE stream cleanly (no ``[DONE]``), with the terminal batch if one is kept."""
        assert self.response is not None
        if not self.gone and not self._ended:
            last, self._last = self._last, b""
            self._ended = True
            try:
                await self.response.write_eof(last)
            except ConnectionResetError:
                self.gone = True
        return self.response

    def json(self, status: int, body: bytes, extra: Mapping[str, str] | None = None) -> web.Response:
        """A JSON answer (``stream: false``, or an error before anything was written)."""
        headers = {**(extra or {}), **self.headers, **self._overhead_header()}
        return web.Response(body=body, status=status, content_type="application/json", headers=headers)

    async def settle(self, channel: Channel) -> None:
        """Send the answer now if the response ended with its output released: that answer is
        :func:`proxy.core.answer.finished`'s, whatever :func:`~proxy.core.answer.decide` is asked
        next. The shell calls it before the lane's lease ends, and the lease's exit
        records the conversation's head in the same loop callback as the last write: the app's
        next turn is read only after that, so it cannot race the head (only a write that waited
        for a slow app to read leaves a window, and a turn in it is planned on what is recorded:
        at worst sent in full), and the app does not wait for the record. Otherwise (a failure,
        a replay still possible) nothing is sent.
        """
        if not channel.done or not channel.released or self.gone:
            return
        if self.stream:
            if self.response is not None:
                await self.end()
            return
        response = await self.answer(finished(channel, False))
        self.response = response
        try:
            await response.prepare(self.request)
            await response.write_eof()
        except ConnectionResetError:
            # The app hung up before its answer: the response is complete upstream and its
            # head recorded; there is nobody to give it to (aiohttp's own finish sees the same).
            self.gone = True

    async def answer(self, answer: Answer) -> web.StreamResponse:
        """Give the app ``answer`` (chosen by :func:`proxy.core.answer.decide`); one :meth:`settle`
        sent already (a JSON body, or the SSE body's end) is that answer: nothing more is written."""
        if self.response is not None and (self._ended or not self.stream):
            return self.response
        if answer.kind is AnswerKind.SSE_END or answer.kind is AnswerKind.ERROR_EVENT:
            await self.write(list(answer.events))
            return await self.end()
        return self.json(answer.status, json_body(answer.body), answer.headers)


class LeasedLane(Protocol):
    """What :func:`pump` needs of a lane lent by the pool (:class:`proxy.upstream.pool.Turn`)."""

    async def send(self, frame: bytes) -> None: ...
    async def burst(self, timeout: float) -> list[tuple[bytes, dict[str, Any]]]: ...
    @property
    def upstream_seconds(self) -> float:
        """The upstream's own time so far: from the send to the latest event's arrival at the socket."""
        ...


async def pump(lane: LeasedLane, frames: list[bytes], channel: Channel, down: Downstream, idle_timeout: float) -> None:
    """Send the frame and move its response's events to the app until the channel is done.

    :attr:`Downstream.on_id` is told the response's id when its ``response.created`` arrives
    (an output item's on ``response.output_item.added``), before that event can reach the app
    (the id's owner is known before the app could name it).

    ``frames`` holds the one frame, and pump empties it: the caller keeps no reference, so the
    frame is freed as soon as it is sent, not when the response ends, and the request's memory
    lease (:attr:`Downstream.lease`) shrinks to the body.

    Returns when the terminal event arrived; what the app gets for it (if it was held) is the
    caller's decision.

    Raises:
        UpstreamClosed | UpstreamTimeout | UpstreamProtocolError: from the socket or a bad frame.
    """
    before = down.upstream_wait  # an earlier attempt's upstream time (a replay)
    await lane.send(frames.pop())
    if down.lease is not None:
        down.lease.sent()
    stream, on_id = down.stream, down.on_id
    clock = time.perf_counter
    batch: list[Out] = []
    size = 0
    while not channel.done:
        # While lifecycle events are held, wait only until their deadline (the bounded
        # hold-back): then they go to the app, and a later loss is surfaced, not replayed.
        deadline = channel.deadline()
        wait = idle_timeout if deadline is None else max(0.0, min(idle_timeout, deadline - clock()))
        try:
            events = await lane.burst(wait)
        except UpstreamTimeout:
            down.upstream_wait = before + lane.upstream_seconds
            if deadline is None or wait >= idle_timeout:
                raise  # a real idle timeout
            released = channel.on_timer(clock())
            if released and stream:
                await down.write(released)
            continue
        down.upstream_wait = before + lane.upstream_seconds
        now = clock()
        # Events that arrived together leave together: one wake-up and one write
        # (one wakeup of the app) per read of the upstream socket, however many events it
        # carried; never held back while upstream is silent. After the terminal event the
        # loop ends and the last batch goes below.
        for raw, event in events:
            if on_id is not None and (kind := event.get("type")) in _CREATIONS:
                created = event.get("response" if kind == "response.created" else "item")
                rid = created.get("id") if isinstance(created, dict) else None
                if isinstance(rid, str):
                    on_id(rid)
            outs = channel.feed(raw, event, now)
            if outs and stream:
                batch += outs
                size += len(raw)
                if size >= _MAX_WRITE:
                    await down.write(batch)
                    batch, size = [], 0
            if channel.done:
                break  # anything after the terminal event is not this response's
        if batch and not channel.done:
            await down.write(batch)
            batch, size = [], 0
    if batch:
        await down.write(batch)


def count_hold_back(channel: Channel) -> None:
    """Count how ``channel``'s held lifecycle events left the hold (``upshift_held_lifecycle_total``).

    Call once per attempt, when the shell is done with its channel (after the answer was
    written, or before a replay): events still held then never reached the app.
    """
    path = channel.hold_path
    if path is not None:
        _HELD[path].inc()


def new_request_id() -> str:
    """``req_`` + 32 hex digits, as OpenAI's ``x-request-id``."""
    return "req_" + os.urandom(16).hex()
