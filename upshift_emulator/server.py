"""The aiohttp application and the in-process :class:`Emulator` API used by tests and benchmarks."""

from __future__ import annotations

import asyncio
import secrets
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

from aiohttp import web

from . import control, extras, http, network, stores
from .appkeys import FAULTS, OWNER, REGISTRY, STARTED, STATE, Registry
from .config import EmulatorConfig
from .errors import ApiError, invalid_api_key
from .faults import FaultQueue
from .state import EmulatorState, Stats, identity_of

__all__ = ["Emulator", "ThreadedEmulator", "authenticate", "build_app"]

JSON = Any
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_RATE_LIMIT_HEADERS = {
    "x-ratelimit-limit-requests": "10000",
    "x-ratelimit-limit-tokens": "30000000",
    "x-ratelimit-remaining-requests": "9999",
    "x-ratelimit-remaining-tokens": "29999000",
    "x-ratelimit-reset-requests": "6ms",
    "x-ratelimit-reset-tokens": "0s",
}


_AZURE_PREFIX = "/openai"
"""Every ``/v1`` route is served under ``/openai/v1`` too (Azure OpenAI's v1 API base path)."""


def authenticate(request: web.Request, config: EmulatorConfig) -> str:
    """The caller's identity hash, or :class:`ApiError` 401 ``invalid_api_key`` (protocol.md §2.5).

    Azure OpenAI's ``api-key: <key>`` header (protocol.md §6.1) is accepted as the same key as
    ``Authorization: Bearer <key>`` when no ``Authorization`` is sent.
    """
    header = request.headers.get("Authorization", "")
    if not header and request.headers.get("api-key", "").strip():
        header = "Bearer " + request.headers["api-key"].strip()
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise invalid_api_key(None)
    allowed = key in config.require_keys if config.require_keys else not key.startswith(config.bad_key_prefix)
    if not allowed:
        raise invalid_api_key(key)
    return identity_of(header)


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request[STARTED] = time.monotonic()
    try:
        if request.path.startswith(("/v1/", _AZURE_PREFIX + "/v1/")) or request.path == "/v1":
            await network.delay_inbound(request, request.app[STATE])  # rtt_ms / connect_ms (network.py)
            request[STARTED] = time.monotonic()  # openai-processing-ms excludes the network
            request[OWNER] = authenticate(request, request.app[STATE].config)
        return await handler(request)
    except ApiError as error:
        return http.error_response(error)
    except web.HTTPNotFound:
        return http.error_response(ApiError(404, f"Invalid URL ({request.method} {request.path})"))
    except web.HTTPMethodNotAllowed:
        return http.error_response(ApiError(405, f"Invalid method for URL ({request.method} {request.path})"))


async def _add_headers(request: web.Request, response: web.StreamResponse) -> None:
    """OpenAI's per-request headers (protocol.md §2.6); none on the WebSocket 101."""
    if isinstance(response, web.WebSocketResponse) or not request.path.startswith(("/v1", _AZURE_PREFIX + "/v1")):
        return
    headers = response.headers
    headers.setdefault("x-request-id", "req_" + secrets.token_hex(16))
    elapsed = time.monotonic() - request.get(STARTED, time.monotonic())
    headers.setdefault("openai-processing-ms", str(int(elapsed * 1000)))
    headers.setdefault("openai-version", "2020-10-01")
    headers.setdefault("openai-organization", "emulator-org")
    headers.setdefault("openai-project", "proj_emulator")
    if response.status < 400:
        for name, value in _RATE_LIMIT_HEADERS.items():
            headers.setdefault(name, value)


async def _network_out(request: web.Request, response: web.StreamResponse) -> None:
    """The response start (HTTP headers, the 101) travels RTT/2 (network.py)."""
    if request.path.startswith("/v1"):
        await network.delay_outbound(request.app[STATE])


def build_app(state: EmulatorState, faults: FaultQueue) -> web.Application:
    """The aiohttp application serving HTTP and WebSocket mode on the same port."""
    app = web.Application(middlewares=[_middleware], client_max_size=state.config.ws_max_message_bytes)
    app[STATE] = state
    app[FAULTS] = faults
    app[REGISTRY] = Registry()
    app.on_response_prepare.append(_add_headers)
    app.on_response_prepare.append(_network_out)
    app.add_routes(http.routes)
    app.add_routes(extras.routes)
    stores.install(app)
    app.add_routes(control.routes)
    for route in [*http.routes, *extras.routes]:  # Azure OpenAI's v1 paths: /openai/v1/...
        if isinstance(route, web.RouteDef):
            app.router.add_route(route.method, _AZURE_PREFIX + route.path, route.handler, **route.kwargs)
    app.on_shutdown.append(_close_sockets)
    return app


async def _close_sockets(app: web.Application) -> None:
    for task in list(app[REGISTRY].tasks):
        task.cancel()
    for ws in list(app[REGISTRY].sockets):
        await ws.close(code=1001, message=b"emulator shutting down")


class Emulator:
    """An emulated OpenAI Responses API on one port (HTTP + WebSocket mode).

    Args:
        config: settings; default :class:`EmulatorConfig` (zero latency).
        **overrides: ``EmulatorConfig`` fields to change, e.g. ``Emulator(ws_max_age_s=1)``.
    """

    def __init__(self, config: EmulatorConfig | None = None, **overrides: Any) -> None:
        base = config or EmulatorConfig()
        self.config: EmulatorConfig = base.replace(**overrides) if overrides else base
        self.state = EmulatorState(self.config)
        self.faults = FaultQueue()
        """Arm fault hooks directly: ``emulator.faults.arm("error", status=429, ...)``."""
        self.app = build_app(self.state, self.faults)
        self._runner: web.AppRunner | None = None
        self.host = "127.0.0.1"
        self.port = 0
        self.tls = False
        """Served over TLS (:meth:`start` with an ``ssl_context``)."""

    @property
    def stats(self) -> Stats:
        """Live counters; ``stats.snapshot()`` for a plain dict."""
        return self.state.stats

    @property
    def url(self) -> str:
        """``http://host:port`` (``https://`` over TLS; IPv6 hosts bracketed)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The SDK ``base_url``: ``http://host:port/v1``."""
        return self.url + "/v1"

    @property
    def ws_url(self) -> str:
        """``ws://host:port/v1/responses`` (``wss://`` over TLS)."""
        return "ws" + self.url[4:] + "/v1/responses"

    def record(self, response_id: str) -> dict[str, JSON] | None:
        """The oracle record of a response (see ``GET /_emulator/responses/{id}``)."""
        return self.state.records.get(response_id)

    def reset(self) -> None:
        """Zero counters, forget stored responses and records, disarm faults."""
        self.state.reset()
        self.faults.clear()

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, ssl_context: ssl.SSLContext | None = None) -> None:
        """Listen on ``host:port`` (0 = a free port; read it back from ``.port``), over TLS with
        ``ssl_context`` (then :attr:`url` is ``https://``, :attr:`ws_url` ``wss://``)."""
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        self.tls = ssl_context is not None
        await site.start()
        self.host = host
        self.port = int(next(a for a in self._runner.addresses if isinstance(a, tuple))[1])

    async def stop(self) -> None:
        """Close every socket (1001) and stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Emulator:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


class ThreadedEmulator:
    """An :class:`Emulator` running in a background thread with its own loop (for the sync SDK).

    Use as a context manager; ``.emulator`` is the running instance (``base_url``, ``faults``,
    ``stats``, ``record()`` are safe to use from the calling thread).
    """

    def __init__(self, config: EmulatorConfig | None = None, host: str = "127.0.0.1", **overrides: Any) -> None:
        self.emulator = Emulator(config, **overrides)
        self._host = host
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="emulator", daemon=True)

    def __enter__(self) -> Emulator:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.emulator.start(self._host), self._loop).result(10)
        return self.emulator

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        asyncio.run_coroutine_threadsafe(self.emulator.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
