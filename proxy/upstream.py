"""One upstream WebSocket connection (websockets' asyncio client), and the boundary where
library exceptions become :mod:`proxy.errors`.

Every send goes through :meth:`UpstreamSocket.send` and every receive through
:meth:`UpstreamSocket.recv`: one write path, one read path, each mapping ``ConnectionClosed``,
``OSError`` and ``TimeoutError`` once. :func:`open_websocket` maps the handshake failures
(``InvalidStatus``, ``InvalidHandshake``, ``OSError``, ``TimeoutError``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidProxy,
    InvalidProxyStatus,
    InvalidStatus,
    InvalidURI,
    ProxyError,
)
from websockets.protocol import State

from proxy.config import Settings
from proxy.egress import egress_for
from proxy.errors import (
    UpstreamClosed,
    UpstreamRefused,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.identity import USER_AGENT

__all__ = ["MAX_RECEIVED_FRAME", "UpstreamSocket", "closed_error", "open_websocket"]

MAX_RECEIVED_FRAME = 64 * 1024 * 1024
"""Largest frame accepted from upstream: a ``response.completed`` holds the whole output."""

_CLOSE_TIMEOUT = 2.0
"""Seconds to wait for the closing handshake before dropping the TCP connection."""


def closed_error(exc: ConnectionClosed) -> UpstreamClosed:
    """Map ``ConnectionClosed`` to :class:`UpstreamClosed`, keeping code and reason."""
    frame = exc.rcvd or exc.sent
    code = frame.code if frame is not None else 1006
    reason = frame.reason if frame is not None else ""
    return UpstreamClosed(
        f"The upstream closed the connection ({code}{' ' + reason if reason else ''}).",
        close_code=code,
        reason=reason,
    )


async def open_websocket(url: str, headers: Sequence[tuple[str, str]], settings: Settings) -> ClientConnection:
    """Open an upstream WebSocket with the sidecar's options.

    Args:
        url: ``Identity.ws_url`` (the upstream's path and query plus the app's query string).
        headers: Upgrade headers (``Identity.headers``); never cookies or hop-by-hop headers.
        settings: Pool and timeout settings.

    The connection goes through the egress proxy of :func:`proxy.egress.egress_for` (an HTTP
    ``CONNECT`` tunnel), with its TLS context.

    Raises:
        UpstreamRefused: the upgrade was answered with a non-101 status.
        UpstreamUnavailable: connection refused, DNS failure, handshake timeout or failure, TLS
            verification failure, or the egress proxy refused the ``CONNECT``.
    """
    pool = settings.pool
    egress = egress_for(settings)
    # The shared TLS context (egress.ca_file, SSL_CERT_FILE) for wss; none for ws.
    tls: dict[str, Any] = {"ssl": egress.ssl} if egress.ssl is not None and url.startswith("wss:") else {}
    if egress.ssl is not None and egress.proxy is not None and egress.proxy.startswith("https:"):
        tls["proxy_ssl"] = egress.ssl  # TLS to an https:// proxy trusts the same CAs
    try:
        return await connect(
            url,
            additional_headers=list(headers),
            user_agent_header=USER_AGENT,
            compression="deflate" if pool.compression else None,
            open_timeout=settings.timeouts.connect_seconds,
            ping_interval=pool.ping_interval_seconds or None,
            ping_timeout=pool.ping_timeout_seconds or None,
            close_timeout=_CLOSE_TIMEOUT,
            max_size=MAX_RECEIVED_FRAME,
            # Resolved once by proxy.egress (egress.proxy: env|off|URL, NO_PROXY), never by
            # websockets itself, so the HTTP relay and the sockets take the same path.
            proxy=egress.for_websockets(),
            **tls,
        )
    except InvalidProxyStatus as exc:
        status = exc.response.status_code
        raise UpstreamUnavailable(
            f"The egress proxy refused the connection to the upstream (HTTP {status} to CONNECT)."
        ) from exc
    except (ProxyError, InvalidProxy) as exc:
        raise UpstreamUnavailable(f"The egress proxy failed: {exc}") from exc
    except InvalidStatus as exc:
        response = exc.response
        raise UpstreamRefused(
            f"The upstream refused the WebSocket upgrade with HTTP {response.status_code}.",
            http_status=response.status_code,
            headers={k.lower(): v for k, v in response.headers.raw_items()},
            payload=bytes(response.body or b""),
        ) from exc
    except (InvalidHandshake, InvalidURI) as exc:
        raise UpstreamUnavailable(f"The upstream WebSocket handshake failed: {exc}") from exc
    except TimeoutError as exc:
        raise UpstreamUnavailable("Connecting to the upstream timed out.") from exc
    except OSError as exc:
        raise UpstreamUnavailable(f"The upstream is unreachable: {exc.strerror or exc}") from exc


class UpstreamSocket:
    """An open upstream connection with one response in flight at most (the pool enforces it).

    Args:
        key: The pool's key for this socket; also the head table's anchor.
        ws: The open connection.
        now: Monotonic time of the handshake.
    """

    def __init__(self, key: int, ws: ClientConnection, now: float) -> None:
        self.key = key
        self.ws = ws
        self.created_at = now
        """Monotonic time the socket opened (rotation age)."""

    def __repr__(self) -> str:
        return f"<UpstreamSocket #{self.key} {self.ws.state.name.lower()}>"

    @property
    def closed(self) -> bool:
        """Whether the connection is closing or closed."""
        return self.ws.state is not State.OPEN

    def pending(self) -> bool:
        """Whether another frame already waits in the receive buffer.

        Best effort (it peeks at websockets' receive queue and says ``False`` if that ever
        changes): it only lets the caller batch writes to the app, never changes what is sent.
        """
        frames = getattr(getattr(self.ws, "recv_messages", None), "frames", None)
        try:
            return len(frames) > 0  # type: ignore[arg-type]
        except TypeError:
            return False

    async def send(self, frame: bytes) -> None:
        """Send one ``response.create`` frame as a text frame (the bytes are UTF-8 JSON already).

        Raises:
            UpstreamClosed: the connection is closed.
        """
        try:
            await self.ws.send(frame, text=True)
        except ConnectionClosed as exc:
            raise closed_error(exc) from exc
        except OSError as exc:
            raise UpstreamClosed(f"Sending to the upstream failed: {exc}") from exc

    async def recv(self, timeout: float) -> bytes:
        """Receive the next frame's bytes.

        Args:
            timeout: Longest silence allowed (``timeouts.stream_idle_seconds``).

        Raises:
            UpstreamClosed: the connection closed.
            UpstreamTimeout: nothing arrived within ``timeout``.
        """
        try:
            async with asyncio.timeout(timeout):
                data = await self.ws.recv(decode=False)
        except ConnectionClosed as exc:
            raise closed_error(exc) from exc
        except TimeoutError as exc:
            raise UpstreamTimeout(f"The upstream sent nothing for {timeout:g} s.") from exc
        except OSError as exc:
            raise UpstreamClosed(f"Receiving from the upstream failed: {exc}") from exc
        # decode=False yields bytes for text frames too; no UTF-8 decode on the hot path.
        return data if isinstance(data, bytes) else data.encode()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the connection; never raises (closing is cleanup)."""
        try:
            await self.ws.close(code, reason)
        except Exception:  # noqa: BLE001 - a failing close leaves nothing to clean up
            self.ws.transport.abort()

    async def wait_closed(self) -> None:
        """Return once the connection is closed, whoever closed it."""
        await self.ws.wait_closed()
