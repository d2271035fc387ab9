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

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.protocol import State

from proxy.config import Settings
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


_FRAGMENT = 1024 * 1024
"""Frames above this go as a fragmented message (issue 12: memory per byte sent)."""


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
        url: ``settings.ws_url``.
        headers: Upgrade headers (``Identity.headers``); never cookies or hop-by-hop headers.
        settings: Pool and timeout settings.

    Raises:
        UpstreamRefused: the upgrade was answered with a non-101 status.
        UpstreamUnavailable: connection refused, DNS failure, handshake timeout or failure.
    """
    pool = settings.pool
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
            # Never through an HTTP(S)_PROXY from the environment: traffic goes where configured.
            proxy=None,
        )
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
            if len(frame) > _FRAGMENT:
                # issue 12: a large frame goes as one message in 1 MiB fragments, so the library's
                # masked copy and its write buffer hold one fragment at a time, not the whole frame.
                view = memoryview(frame)
                await self.ws.send((view[i : i + _FRAGMENT] for i in range(0, len(frame), _FRAGMENT)), text=True)
            else:
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
