"""The doctor's way to the upstream: the sidecar's own parts, one request at a time.

The credential headers and the WebSocket URL come from :func:`proxy.intake.identity.request_identity`
(as for an app's request), the HTTP URL from :meth:`Passthrough.url_for` (path prefix, the
upstream's query string, the app's ``api-version``), the egress proxy and TLS trust from
:mod:`proxy.upstream.egress`, the upgrade from :func:`proxy.upstream.handshake.open_websocket`, the
socket from :class:`proxy.upstream.ws.UpstreamSocket` (its lane demultiplexer judges
``stream_id`` as the pool does) and every frame from :func:`proxy.core.request.build_frame`.
What the doctor sees is what the sidecar would see on this network, with this key.

Every request counts against one :class:`Budget`; nothing is sent once it is spent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

from proxy.config import Settings
from proxy.core.demux import LaneSignal
from proxy.core.request import build_frame, parse_request
from proxy.core.retry import error_fields
from proxy.errors import UpstreamClosed, UpstreamError
from proxy.intake.identity import USER_AGENT, request_identity
from proxy.intake.keys import KeySource
from proxy.redact import redact_urls
from proxy.upstream.handshake import open_websocket
from proxy.upstream.passthrough import Passthrough
from proxy.upstream.ws import UpstreamSocket
from proxy.wire import sse

__all__ = ["Answer", "Budget", "Upstream"]

_TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})
_BEFORE_OUTPUT = frozenset({"response.created", "response.in_progress", "response.queued"})
"""Events an upstream sends before it has read the context: the first event after them is the
first output, where a continuation's saving shows."""


class Budget:
    """The requests the doctor may still send (``--max-requests``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sent = 0

    def take(self, count: int = 1) -> bool:
        """Spend ``count`` requests if that many are left; whether they were."""
        if self.sent + count > self.limit:
            return False
        self.sent += count
        return True


@dataclass(slots=True)
class Answer:
    """What one request got: a response, an error, or a failure to get either."""

    status: int | None = None
    """HTTP status (an ``error`` event's ``status`` on a socket)."""
    body: dict[str, Any] | None = None
    """The JSON body, the terminal event's ``response``, or the ``error`` event."""
    failure: str = ""
    """Why no answer came (unreachable, TLS, socket closed), already free of secrets."""
    close_code: int | None = None
    """The close code when the socket closed instead of answering."""
    first_output_ms: float | None = None
    """Milliseconds from sending to the first output event (streams and sockets)."""
    total_ms: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    signal: LaneSignal | None = None
    """What the socket's lane demultiplexer learnt about ``stream_id`` from this answer."""
    unsent: bool = False
    """Not sent: the budget was spent."""

    @property
    def response(self) -> dict[str, Any] | None:
        """The response object, if one came (a JSON body or a terminal event's)."""
        if self.body is None:
            return None
        if self.body.get("object") == "response":
            return self.body
        inner = self.body.get("response")
        return inner if isinstance(inner, dict) else None

    @property
    def answered(self) -> bool:
        """A response came back completed or cut at ``max_output_tokens`` (both chain)."""
        response = self.response
        return response is not None and response.get("status") in ("completed", "incomplete")

    @property
    def response_id(self) -> str:
        response = self.response
        return str(response.get("id", "")) if response is not None else ""

    def error(self) -> tuple[str | None, str | None, str | None]:
        """``(code, message, param)`` of the upstream's error, if it sent one."""
        if self.body is None:
            return None, None, None
        return error_fields(self.body)

    def describe(self) -> str:
        """One phrase: what came back."""
        if self.failure:
            return self.failure
        code, message, param = self.error()
        status = f"HTTP {self.status}" if self.status is not None else "an error"
        if message is not None or code is not None:
            where = f" (param {param})" if param else ""
            return f"{status}{' ' + code if code else ''}: {message or ''}{where}".rstrip()
        response = self.response
        if response is not None:
            return f"a response with status {response.get('status')!r}"
        return status


def _http_failure(exc: BaseException, timeout: float) -> str:
    """The reason an HTTP request got no answer, as the relay words it (no URL secrets)."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, aiohttp.ClientHttpProxyError):
        return f"the egress proxy refused the connection to the upstream (HTTP {exc.status} to CONNECT)"
    if isinstance(exc, aiohttp.ClientProxyConnectionError):
        return f"the egress proxy is unreachable: {redact_urls(str(exc.os_error.strerror or exc.os_error))}"
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return f"TLS: the upstream's certificate is not trusted ({redact_urls(str(exc.certificate_error))})"
    if isinstance(exc, aiohttp.ClientSSLError):
        return f"TLS failed: {redact_urls(str(exc))}"
    return f"the upstream is unreachable: {redact_urls(str(exc))}"


class Upstream:
    """The upstream as the sidecar reaches it for one app credential.

    Args:
        settings: The sidecar's settings (upstream, egress, identity, timeouts).
        keys: Its key source (passthrough: the app's own header).
        app_headers: The headers an app would send (its credential, for passthrough).
        query: The app's query string (Azure's ``api-version=...``), without ``?``.
        timeout: Seconds one request may take.
        budget: Shared by every request of the run.
    """

    def __init__(
        self,
        settings: Settings,
        keys: KeySource,
        app_headers: Mapping[str, str],
        query: str,
        timeout: float,
        budget: Budget,
    ) -> None:
        self.settings = settings
        self.identity = request_identity(CIMultiDict(app_headers), query, settings, keys)
        self.relay = Passthrough(settings, keys)
        self.query = query
        self.timeout = timeout
        self.budget = budget
        self._proxy, self._proxy_headers = self.relay.egress.without_credentials()
        self._session: aiohttp.ClientSession | None = None
        self._signals: dict[int, list[LaneSignal]] = {}
        """The lane signals of each socket opened (its ``on_signal``), by the socket's key."""
        self.sockets_opened = 0

    async def __aenter__(self) -> Upstream:
        self._session = aiohttp.ClientSession(
            trust_env=False,  # the egress path is proxy.upstream.egress's, as for the relay
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.settings.timeouts.connect_seconds),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def describe_path(self) -> str:
        """``direct`` or ``via proxy http://host:port`` (no credentials)."""
        return self.relay.egress.describe()

    def _headers(self) -> dict[str, str]:
        headers = dict(self.identity.headers)
        headers["User-Agent"] = USER_AGENT
        return headers

    async def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        base: str | None = None,
    ) -> Answer:
        """One HTTP request (counted); a ``stream: true`` body is read as SSE.

        Args:
            method: ``POST`` or ``GET``.
            path: Under ``/v1`` (``/v1/responses``).
            body: JSON body.
            headers: Instead of the upstream credential headers (a request to a sidecar).
            base: Another base URL than the upstream (``--via``: the sidecar's ``/v1``); no
                egress proxy then (the app's own path to its sidecar).
        """
        assert self._session is not None, "Upstream used outside 'async with'"
        answer = Answer()
        if not self.budget.take():
            answer.unsent, answer.failure = True, "not sent: --max-requests reached"
            return answer
        query = f"?{self.query}" if self.query else ""
        if base is None:
            url: Any = self.relay.url_for(path + query)
            proxy, proxy_headers = self._proxy, self._proxy_headers or None
            ssl: Any = self.relay.egress.ssl if self.relay.egress.ssl is not None else True
        else:
            url = base.rstrip("/") + path.removeprefix("/v1") + query
            proxy, proxy_headers, ssl = None, None, True
        sent = {**(self._headers() if headers is None else headers)}
        data = None
        if body is not None:
            sent["Content-Type"] = "application/json"
            data = orjson.dumps(body)
        started = time.perf_counter()
        try:
            async with self._session.request(
                method, url, data=data, headers=sent, proxy=proxy, proxy_headers=proxy_headers, ssl=ssl
            ) as resp:
                answer.status = resp.status
                answer.headers = {k.lower(): v for k, v in resp.headers.items()}
                if resp.content_type == "text/event-stream":
                    await self._read_sse(resp, answer, started)
                else:
                    raw = await resp.read()
                    try:
                        parsed = orjson.loads(raw) if raw else None
                    except orjson.JSONDecodeError:
                        parsed = None
                    answer.body = parsed if isinstance(parsed, dict) else None
        except (aiohttp.ClientError, TimeoutError) as exc:
            answer.failure = _http_failure(exc, self.timeout)
        answer.total_ms = (time.perf_counter() - started) * 1000
        return answer

    @staticmethod
    async def _read_sse(resp: aiohttp.ClientResponse, answer: Answer, started: float) -> None:
        decoder = sse.Decoder()
        async for chunk in resp.content.iter_any():
            for event in decoder.feed(chunk):
                try:
                    data = orjson.loads(event.data)
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(data, dict):
                    continue
                kind = data.get("type")
                if answer.first_output_ms is None and kind not in _BEFORE_OUTPUT:
                    answer.first_output_ms = (time.perf_counter() - started) * 1000
                if kind in _TERMINAL:
                    answer.body = data
        if answer.body is None:
            answer.failure = "the stream ended without a terminal event"

    async def open_socket(self) -> UpstreamSocket:
        """A new upstream socket (the upgrade as the pool makes it).

        Raises:
            UpstreamRefused: the upgrade was answered with another status than 101.
            UpstreamUnavailable: unreachable, TLS, the egress proxy refused, timed out.
        """
        self.sockets_opened += 1
        ws = await open_websocket(self.identity.ws_url, self.identity.headers, self.settings)
        signals: list[LaneSignal] = []
        sock = UpstreamSocket(self.sockets_opened, ws, asyncio.get_running_loop().time(), on_signal=signals.append)
        self._signals[sock.key] = signals
        return sock

    async def turn(self, sock: UpstreamSocket, body: dict[str, Any], *, lane: str | None = None) -> Answer:
        """One ``response.create`` on ``sock`` (counted), read to its terminal event."""
        answer = Answer()
        if not self.budget.take():
            answer.unsent, answer.failure = True, "not sent: --max-requests reached"
            return answer
        frame = build_frame(parse_request(orjson.dumps(body)), stream_id=lane)
        signals = self._signals.setdefault(sock.key, [])
        seen = len(signals)
        inbox = sock.open_inbox(lane)
        started = time.perf_counter()
        try:
            await sock.send(frame, lane)
            while True:
                _, event = await inbox.get(self.timeout)
                kind = event.get("type")
                if answer.first_output_ms is None and kind not in _BEFORE_OUTPUT:
                    answer.first_output_ms = (time.perf_counter() - started) * 1000
                if kind in _TERMINAL:
                    answer.body = event
                    status = event.get("status")
                    answer.status = status if isinstance(status, int) else None
                    break
        except UpstreamClosed as exc:
            answer.failure = str(exc)
            answer.close_code = exc.close_code
        except UpstreamError as exc:
            answer.failure = str(exc)
        finally:
            sock.close_inbox(inbox)
        answer.total_ms = (time.perf_counter() - started) * 1000
        if len(signals) > seen:
            answer.signal = signals[-1]
        return answer
