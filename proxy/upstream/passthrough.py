"""Plain HTTP relay to the upstream: everything that does not go over a WebSocket.

``background: true``, ``conversation``, oversize and ``mode: http`` requests, every other path
under ``/v1`` (models, chat/completions, embeddings, files, ``GET``/``DELETE
/v1/responses/{id}``, ...) and the fallback when no socket can be had. Streamed both ways: the
request body flows from the app's stream (unless it was already read), the response body is
written as it arrives (SSE is never buffered), and the upstream's bytes stay as they are
(no decompression, no re-encoding). Hop-by-hop headers and cookies are dropped; the
``Authorization`` (or ``api_key.header``) comes from :class:`~proxy.intake.keys.KeySource`. The
connection takes the egress path of :mod:`proxy.upstream.egress` (forward proxy, TLS trust).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from proxy import contracts
from proxy.config import Settings, merge_query
from proxy.core.creators import SNIFF_LIMIT
from proxy.core.fields import TRANSPORT_ONLY_FIELDS
from proxy.core.request import ParsedRequest, build_frame
from proxy.errors import BodyTimeout, InvalidRequest, ProxyError, UpstreamTimeout, UpstreamUnavailable
from proxy.intake.body import BodyClock, BodyWatch
from proxy.intake.keys import KeySource
from proxy.kernel import received_ago, tcp_socket
from proxy.observe.metrics import BODIES_ABORTED, POOL_WAIT, UPSTREAM_BYTES_SENT
from proxy.reasons import BodyAbort
from proxy.redact import redact_url, redact_urls
from proxy.upstream.egress import egress_for
from proxy.upstream.forwarding import RESPONSE_DROP, SKIP_AUTO, Swap, cleartext, decoded, forward_headers
from proxy.upstream.sniff import IdSniffer, answer_members

__all__ = ["Forwarded", "Passthrough", "error_response"]

log = logging.getLogger(__name__)

CAPTURE_BYTES = 8 * 1024 * 1024
"""Largest answer of a stored request over HTTP kept to adopt its response as a head."""
_ERROR_PEEK = 64 * 1024
"""Bytes of an HTTP continuation's 4xx answer read to look for ``previous_response_not_found``."""


@dataclass(slots=True)
class Forwarded:
    """What the access log needs of a relayed request."""

    response: web.StreamResponse
    status: int
    bytes_sent: int
    upstream_seconds: float
    added_seconds: float
    fell_back: bool = False
    """An HTTP continuation got ``previous_response_not_found``: the full body went instead."""
    captured: bytes | None = None
    """The answer's body as sent to the app (``capture``: a 200 up to :data:`CAPTURE_BYTES`)."""


def http_continuation_body(req: ParsedRequest, response_id: str | None, items: list[Any]) -> bytes:
    """The ``POST /v1/responses`` body of an HTTP continuation: the app's request with
    ``previous_response_id`` set and ``input`` = the new items, its HTTP-only fields
    (``stream``, ``stream_options``, ``background``) kept as the app sent them."""
    frame = build_frame(req, previous_response_id=response_id, items=items)
    try:
        fields = orjson.loads(frame)
    except orjson.JSONDecodeError:  # an integer beyond 64 bits: the stdlib keeps it exact
        fields = json.loads(frame)
    fields.pop("type", None)
    for key in TRANSPORT_ONLY_FIELDS:
        if key in req.fields:
            fields[key] = req.fields[key]
    try:
        return orjson.dumps(fields)
    except TypeError:
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()


def error_response(exc: ProxyError, headers: dict[str, str]) -> web.Response:
    """An OpenAI-shaped JSON error answer for ``exc``."""
    return web.json_response(exc.body(), status=exc.status, headers=headers)


@dataclass(frozen=True, slots=True)
class Options:
    """What a relay does besides moving bytes (the defaults: nothing)."""

    capture: bool = False
    """Keep a 200 answer (up to ``CAPTURE_BYTES``) to adopt its response as a head."""
    on_id: Callable[[str], None] | None = None
    """Told the response id of a 2xx answer before the bytes that complete it reach the app."""
    fallback: bytes | None = None
    """Sent instead when the upstream answers ``previous_response_not_found`` before any byte."""
    rewrite: tuple[bytes, bytes] | None = None
    """``(old, new)`` bytes swapped in the answer (an HTTP continuation's anchor)."""
    sse_id: tuple[str, ...] | None = None
    """Where ``on_id`` finds the id in the first event of an SSE answer (``None``: ``response.id``)."""
    answer: tuple[tuple[str, ...], ...] = ()
    """Members of a 2xx JSON answer told to ``on_id`` (``"*"``: every element of a list): the
    answer is read whole (up to ``SNIFF_LIMIT``) before any byte of it reaches the app."""

    @classmethod
    def continuation(cls, anchor: str, full: bytes, on_id: Callable[[str], None] | None = None) -> Options:
        """An HTTP continuation's (its body: ``previous_response_id`` = ``anchor`` + the new
        items): its answer captured (to become the head), the anchor shown to the app as it sent
        it (none: ``null``), as over a socket; if the upstream does not know the anchor
        (``previous_response_not_found``, before anything reached the app), ``full``, the app's
        own body, is sent instead."""
        rewrite = (b'"previous_response_id":' + orjson.dumps(anchor), b'"previous_response_id":null')
        return cls(capture=True, on_id=on_id, fallback=full, rewrite=rewrite)


_NO_OPTIONS = Options()


def _sniffed(sniffer: IdSniffer, chunk: bytes, on_id: Callable[[str], None] | None) -> None:
    """Tell ``on_id`` the ids ``chunk`` shows (before the chunk is written to the app)."""
    if on_id is None:
        return
    if (rid := sniffer.feed(chunk)) is not None:
        on_id(rid)
    for item in sniffer.take():
        on_id(item)


async def timed_stream(content: Any, clock: BodyClock) -> AsyncIterator[bytes]:
    """A body relayed as it arrives (the other ``/v1`` routes: uploads, batches) under the same
    deadlines as a ``POST /v1/responses`` body: :class:`BodyTimeout` once it stalls
    or trickles, so it never holds an HTTP relay slot for longer than the body deadline."""
    watch = BodyWatch(clock, content)
    try:
        async for chunk in content.iter_any():
            watch.chunk(len(chunk))
            yield chunk
    finally:
        watch.stop()
    if watch.fired is not None:
        raise watch.fired


class Passthrough:
    """The HTTP relay; one ``aiohttp.ClientSession`` for the sidecar's lifetime.

    Args:
        settings: ``upstream``, ``timeouts``.
        keys: Source of the upstream ``Authorization``.
    """

    def __init__(self, settings: Settings, keys: KeySource) -> None:
        self.settings = settings
        self.keys = keys
        base = urlsplit(settings.upstream)
        self._base = urlunsplit((base.scheme, base.netloc, base.path.rstrip("/"), "", ""))
        self._base_query = base.query
        self._key_header = settings.api_key.header if keys.injects else None
        self.egress = egress_for(settings)
        """The forward proxy and TLS context (shared with the WebSocket client)."""
        self._ssl: ssl.SSLContext | bool = self.egress.ssl if self.egress.ssl is not None else True
        self._proxy, self._proxy_headers = self.egress.without_credentials()
        self._session: aiohttp.ClientSession | None = None
        self._slots = asyncio.Semaphore(settings.pool.http_connections)
        """HTTP requests in flight to the upstream (``pool.http_connections``); a request waits
        for a slot, and that wait is the sidecar's time (added latency), not the upstream's."""

    async def start(self) -> None:
        """Open the client session (needs a running loop)."""
        t = self.settings.timeouts
        log.info("upstream %s, egress %s", redact_url(self.settings.upstream), self.egress.describe())
        if cleartext(self.settings.upstream):
            log.warning(
                "the upstream %s is plain http:// off this machine: keys and content travel unencrypted",
                redact_url(self.settings.upstream),
            )
        self._session = aiohttp.ClientSession(
            auto_decompress=False,  # pass the upstream's bytes through as they are
            cookie_jar=aiohttp.DummyCookieJar(),
            # The proxy is resolved by proxy.upstream.egress (egress.proxy, NO_PROXY) and passed per
            # request, so aiohttp's own environment lookup stays off.
            trust_env=False,
            connector=aiohttp.TCPConnector(limit=0),  # bounded by self._slots, which is measured
            timeout=aiohttp.ClientTimeout(
                total=t.http_total_seconds, sock_connect=t.connect_seconds, sock_read=t.stream_idle_seconds
            ),
        )

    async def close(self) -> None:
        """Close the client session."""
        if self._session is not None:
            await self._session.close()

    def url_for(self, raw_path: str) -> URL:
        """The upstream URL of an app path under ``/v1``: the upstream's path prefix
        (``/openai/v1``) and query string, then the app's query string (still encoded; a
        parameter the upstream URL sets wins over the app's).

        Raises:
            InvalidRequest: the path has dot segments (plain or percent-encoded) or encoded
                slashes, which an upstream or a front proxy could resolve outside ``/v1``.
        """
        path = raw_path.partition("?")[0]
        for segment in path.split("/"):
            lowered = segment.lower()
            if unquote(segment) in (".", "..") or "%2f" in lowered or "%5c" in lowered or "\\" in segment:
                raise InvalidRequest(f"Invalid URL ({path})")
        tail = path[3:] if path.startswith("/v1") else path
        query = merge_query(self._base_query, raw_path.partition("?")[2])
        return URL(self._base + tail + ("?" + query if query else ""), encoded=True)

    async def forward(
        self,
        request: web.Request,
        *,
        headers: dict[str, str],
        body: bytes | None,
        started: float,
        options: Options | None = None,
    ) -> Forwarded:
        """Relay ``request`` and stream the answer back.

        Args:
            request: The app's request.
            headers: Headers to add to the answer (``x-request-id``, ``x-upshift-mode``).
            body: The body if already read (``POST /v1/responses``); else it streams from the app.
            started: ``time.perf_counter()`` at arrival, for ``x-upshift-overhead-ms``.
            options: What else to do with the answer: ``capture`` keeps a stored request's
                completed answer to adopt as a head; ``on_id`` is told the response id
                of a 2xx answer (the top-level ``id`` of a JSON body,
                ``response.id`` of the first SSE event) before the bytes that complete it are
                written to the app; the bytes themselves pass unchanged.

        Returns:
            The answer, already sent; a JSON error (502 unreachable, 504 timeout) if the upstream
            failed before its headers.
        """
        waited = time.perf_counter()
        async with self._slots:
            POOL_WAIT.labels("http").observe(time.perf_counter() - waited)
            return await self._forward(request, headers=headers, body=body, started=started, options=options)

    async def _forward(
        self,
        request: web.Request,
        *,
        headers: dict[str, str],
        body: bytes | None,
        started: float,
        options: Options | None = None,
    ) -> Forwarded:
        assert self._session is not None, "Passthrough.start() not called"
        opts = options or _NO_OPTIONS
        fallback, rewrite, capture, on_id = opts.fallback, opts.rewrite, opts.capture, opts.on_id
        try:
            url = self.url_for(request.raw_path)
        except InvalidRequest as exc:
            refused = error_response(exc, headers)
            return Forwarded(refused, exc.status, 0, 0.0, time.perf_counter() - started)
        authorization = self.keys.authorization(request.headers.get("Authorization"))
        data: bytes | AsyncIterator[bytes] | None = body
        if body is None and request.body_exists:  # a streamed body has deadlines too
            data = timed_stream(request.content, BodyClock(self.settings.limits, asyncio.get_running_loop().time()))
        out_headers = forward_headers(request, authorization, keep_length=body is None, key_header=self._key_header)
        if rewrite is not None or capture or opts.answer:
            out_headers["Accept-Encoding"] = "identity"  # its bytes are rewritten or read on the way
        sent = len(body) if body is not None else request.content_length or 0
        t_send = time.perf_counter()
        try:
            upstream = await self._session.request(
                request.method,
                url,
                headers=out_headers,
                data=data,
                allow_redirects=False,
                skip_auto_headers=SKIP_AUTO,
                proxy=self._proxy,
                proxy_headers=self._proxy_headers or None,
                ssl=self._ssl,
            )
        except TimeoutError:
            return self._failed(UpstreamTimeout("The upstream did not answer in time."), headers, started, t_send)
        except BodyTimeout as exc:
            return self._body_late(exc, headers, started, t_send)
        except aiohttp.ClientHttpProxyError as exc:
            # Never the proxy URL in the message: it may hold credentials.
            msg = f"The egress proxy refused the connection to the upstream (HTTP {exc.status} to CONNECT)."
            return self._failed(UpstreamUnavailable(msg), headers, started, t_send)
        except aiohttp.ClientProxyConnectionError as exc:
            msg = f"The egress proxy is unreachable: {redact_urls(str(exc.os_error.strerror or exc.os_error))}"
            return self._failed(UpstreamUnavailable(msg), headers, started, t_send)
        except aiohttp.ClientError as exc:
            late = _body_timeout(exc)
            if late is not None:  # the app's body stalled while it was relayed
                return self._body_late(late, headers, started, t_send)
            err = UpstreamUnavailable(f"The upstream is unreachable: {redact_urls(str(exc))}")
            return self._failed(err, headers, started, t_send)
        UPSTREAM_BYTES_SENT.labels("http").inc(sent)
        held = b""
        if fallback is not None and upstream.status in (400, 404):
            # An error answer is small: read it whole to see whether the anchor was unknown.
            try:
                held = await upstream.content.read(_ERROR_PEEK)
            except (aiohttp.ClientError, TimeoutError):
                held = b""
            if b"previous_response_not_found" in decoded(held, upstream.headers.get("Content-Encoding", "")):
                upstream.release()
                # The answer is now a full send, and says so (x-upshift-mode).
                shown = {**headers, "x-upshift-mode": "full"} if "x-upshift-mode" in headers else headers
                again = Options(capture=capture, on_id=on_id)
                full = await self._forward(request, headers=shown, body=fallback, started=started, options=again)
                full.fell_back = True
                return full
        t_headers = time.perf_counter()
        captured: bytes | None = None
        # When the kernel received the answer's latest bytes: the upstream's time ends there.
        sock = tcp_socket(contracts.client_response_transport(upstream))
        t_last = time.perf_counter() - received_ago(sock)
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                lowered = name.lower()
                # never a CORS grant to a web page (access-control-*).
                if lowered not in RESPONSE_DROP and not lowered.startswith("access-control-"):
                    response.headers.add(name, value)
            swap = Swap(*rewrite) if rewrite is not None and "Content-Encoding" not in upstream.headers else None
            if swap is None and upstream.content_length is not None and "Transfer-Encoding" not in upstream.headers:
                response.content_length = upstream.content_length
            response.headers.update(headers)
            prep = time.perf_counter() - t_headers
            added = (t_send - started) + prep
            response.headers["x-upshift-overhead-ms"] = f"{added * 1000:.3f}"
            await response.prepare(request)
            sniffer = None
            pending: list[bytes] | None = None  # an answer whose ids are read whole first
            if on_id is not None and 200 <= upstream.status < 300:
                is_sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
                if opts.answer and not is_sse:
                    pending = []
                else:
                    items = is_sse and opts.sse_id is None  # a response's stream: its output items too
                    sniffer = IdSniffer(sse=is_sse, sse_path=opts.sse_id, items=items)
            pending_size = 0
            try:
                kept: list[bytes] | None = [] if capture and upstream.status == 200 else None
                kept_size = 0
                if held:
                    if sniffer is not None:
                        _sniffed(sniffer, held, on_id)
                    await response.write(swap.feed(held) if swap is not None else held)
                async for chunk in upstream.content.iter_any():
                    if sniffer is not None and not sniffer.done:
                        _sniffed(sniffer, chunk, on_id)
                    out = swap.feed(chunk) if swap is not None else chunk
                    if kept is not None:
                        kept.append(out)
                        kept_size += len(out)
                        if kept_size > CAPTURE_BYTES:
                            kept = None
                    if pending is not None:
                        pending.append(out)
                        pending_size += len(out)
                        if pending_size <= SNIFF_LIMIT:
                            continue
                        out, pending = b"".join(pending), None  # too large: its ids stay unknown
                    await response.write(out)
                # The answer's last bytes are the connection's latest: read their age once, here.
                t_last = time.perf_counter() - received_ago(sock)
                if pending is not None:
                    whole = b"".join(pending)
                    for object_id in answer_members(whole, opts.answer):
                        on_id(object_id)  # type: ignore[misc]  # on_id is set whenever pending is
                    await response.write(whole)
                if swap is not None:
                    rest = swap.rest()
                    if kept is not None:
                        kept.append(rest)
                    await response.write(rest)
                await response.write_eof()
                captured = b"".join(kept) if kept is not None else None
            except (ConnectionResetError, aiohttp.ClientError, TimeoutError) as exc:
                # After the headers there is no way to tell the app but to cut the connection.
                log.info("passthrough stream ended early: %s", type(exc).__name__)
                if request.transport is not None:
                    request.transport.close()
        # The upstream's time: from the send to its last bytes' arrival in the kernel; the loop's
        # lag before reading them and the writes to the app after are the sidecar's.
        upstream_seconds = max(t_last - t_send, 0.0)
        return Forwarded(response, upstream.status, sent, upstream_seconds, added, captured=captured)

    def _body_late(self, exc: BodyTimeout, headers: dict[str, str], started: float, t_send: float) -> Forwarded:
        """408 for a relayed body that stalled; the connection is closed after it (the rest of
        the body is never read)."""
        BODIES_ABORTED.labels(BodyAbort.TOO_SLOW if exc.slow else BodyAbort.TIMEOUT).inc()
        fwd = self._failed(exc, headers, started, t_send)
        fwd.response.force_close()
        return fwd

    def _failed(self, exc: ProxyError, headers: dict[str, str], started: float, t_send: float) -> Forwarded:
        response = error_response(exc, headers)
        added = t_send - started
        response.headers["x-upshift-overhead-ms"] = f"{added * 1000:.3f}"
        return Forwarded(response, exc.status, 0, time.perf_counter() - t_send, added)


def _body_timeout(exc: BaseException) -> BodyTimeout | None:
    """The app's :class:`BodyTimeout` behind a client error (aiohttp wraps what the body's
    iterator raised while it wrote the request)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, BodyTimeout):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
