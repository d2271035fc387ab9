"""One upstream WebSocket connection (websockets' asyncio client), its lanes' inboxes, and the
boundary where library exceptions become :mod:`proxy.errors`.

Every send goes through :meth:`UpstreamSocket.send` and every frame is read by the socket's one
reader task, which routes it to the inbox of its lane: one write path, one read path, each
mapping ``ConnectionClosed``, ``OSError`` and ``TimeoutError`` once. :func:`open_websocket` maps the handshake failures
(``InvalidStatus``, ``InvalidHandshake``, ``OSError``, ``TimeoutError``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import orjson
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
    UpstreamError,
    UpstreamProtocolError,
    UpstreamRefused,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.identity import USER_AGENT

__all__ = ["MAX_RECEIVED_FRAME", "Inbox", "UpstreamSocket", "closed_error", "open_websocket", "strip_stream_id"]

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


_TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "response.done", "error"})
_LANE_ERRORS = frozenset({"invalid_stream_id", "websocket_stream_limit_reached", "unknown_parameter"})


class Inbox:
    """The events of one lane's response in flight, filled by the socket's reader.

    A turn reads with :meth:`get`; everything that arrived meanwhile is kept in order, so the
    turn can write a whole burst to the app at once (:meth:`pending`). An abandoned turn's inbox
    *drains*: events are dropped until the terminal one, then ``on_drained`` runs.
    """

    __slots__ = ("_waiter", "draining", "error", "frames", "lane", "on_drained", "seen")

    def __init__(self, lane: str | None) -> None:
        self.lane = lane
        self.frames: deque[tuple[bytes, dict[str, Any]]] = deque()
        self.error: UpstreamError | None = None
        self.draining = False
        self.on_drained: Callable[[], None] | None = None
        self.seen = False
        """An event of this lane arrived."""
        self._waiter: asyncio.Future[None] | None = None

    def put(self, raw: bytes, event: dict[str, Any]) -> None:
        self.seen = True
        if self.draining:
            if event.get("type") in _TERMINAL and self.on_drained is not None:
                callback, self.on_drained = self.on_drained, None
                callback()
            return
        self.frames.append((raw, event))
        self._wake()

    def fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def pending(self) -> bool:
        """Whether another event is already here (the caller may batch its writes)."""
        return bool(self.frames)

    async def get(self, timeout: float) -> tuple[bytes, dict[str, Any]]:
        """The next event of this lane: ``(raw bytes, parsed object)``.

        Raises:
            UpstreamClosed | UpstreamProtocolError: the socket failed.
            UpstreamTimeout: nothing arrived within ``timeout``.
        """
        if self.frames:
            return self.frames.popleft()
        if self.error is not None:
            raise self.error
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError as exc:
            if not self.frames and self.error is None:
                raise UpstreamTimeout(f"The upstream sent nothing for {timeout:g} s.") from exc
        finally:
            self._waiter = None
        if self.frames:
            return self.frames.popleft()
        assert self.error is not None
        raise self.error


class UpstreamSocket:
    """An open upstream connection, its reader, and the inboxes of its lanes in flight.

    One reader task parses every frame once and routes it by ``stream_id`` (the ``stream_id``
    is taken out of the event: the app sees what HTTP would have given it). Events without one
    belong to the default lane; until the socket has seen an event with a ``stream_id`` they are
    attributed in the order the creates were sent (an upstream that ignores lanes runs them one
    after another), and an ``error`` about the ``stream_id`` itself goes to the oldest named lane
    still waiting for its first event.

    Args:
        key: The pool's id for this socket.
        ws: The open connection.
        now: Monotonic time of the handshake.
        on_closed: Called once when the connection is gone (by whichever side).
        on_lanes_ignored: Called when a named lane's events come without ``stream_id``.
    """

    def __init__(
        self,
        key: int,
        ws: ClientConnection,
        now: float,
        *,
        on_closed: Callable[[UpstreamSocket], None] | None = None,
        on_lanes_ignored: Callable[[UpstreamSocket], None] | None = None,
    ) -> None:
        self.key = key
        self.ws = ws
        self.created_at = now
        """Monotonic time the socket opened (rotation age)."""
        self.inboxes: dict[str | None, Inbox] = {}
        self._first: deque[str | None] = deque()
        self._current: Inbox | None = None
        self.proven = False
        """An event with a ``stream_id`` arrived on this socket: the upstream has lanes."""
        self._on_closed = on_closed
        self._on_lanes_ignored = on_lanes_ignored
        self.error: UpstreamError | None = None
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def __repr__(self) -> str:
        return f"<UpstreamSocket #{self.key} {self.ws.state.name.lower()} lanes={len(self.inboxes)}>"

    @property
    def closed(self) -> bool:
        """Whether the connection is closing or closed."""
        return self.ws.state is not State.OPEN or self.error is not None

    def open_inbox(self, lane: str | None) -> Inbox:
        """Start receiving for ``lane`` (one response in flight per lane)."""
        inbox = Inbox(lane)
        if self.error is not None:
            inbox.fail(self.error)
        self.inboxes[lane] = inbox
        return inbox

    def close_inbox(self, inbox: Inbox) -> None:
        """Stop receiving for ``inbox``'s lane."""
        if self.inboxes.get(inbox.lane) is inbox:
            del self.inboxes[inbox.lane]
        with contextlib.suppress(ValueError):
            self._first.remove(inbox.lane)
        if self._current is inbox:
            self._current = None

    async def send(self, frame: bytes, lane: str | None) -> None:
        """Send one ``response.create`` for ``lane`` as a text frame (UTF-8 JSON already).

        The send runs shielded: a cancelled caller never leaves half a frame on a socket that
        other lanes share.

        Raises:
            UpstreamClosed: the connection is closed.
        """
        if self.error is not None:
            raise self.error
        self._first.append(lane)
        try:
            await asyncio.shield(self._send(frame))
        except ConnectionClosed as exc:
            raise closed_error(exc) from exc
        except OSError as exc:
            raise UpstreamClosed(f"Sending to the upstream failed: {exc}") from exc

    async def _send(self, frame: bytes) -> None:
        if len(frame) > _FRAGMENT:
            # issue 12: a large frame goes as one message in 1 MiB fragments, so the library's
            # masked copy and its write buffer hold one fragment at a time, not the whole frame.
            view = memoryview(frame)
            await self.ws.send((view[i : i + _FRAGMENT] for i in range(0, len(frame), _FRAGMENT)), text=True)
        else:
            await self.ws.send(frame, text=True)

    async def _read(self) -> None:
        error: UpstreamError
        try:
            while True:
                # decode=False yields bytes for text frames too; no UTF-8 decode on the hot path.
                data = await self.ws.recv(decode=False)
                raw = data if isinstance(data, bytes) else data.encode()
                try:
                    event = orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    raise UpstreamProtocolError(f"The upstream sent a frame that is not JSON: {exc}") from None
                if not isinstance(event, dict):
                    raise UpstreamProtocolError("The upstream sent a frame that is not a JSON object.")
                self._route(raw, event)
        except ConnectionClosed as exc:
            error = closed_error(exc)
        except UpstreamProtocolError as exc:
            error = exc
            self.ws.transport.abort()
        except OSError as exc:
            error = UpstreamClosed(f"Receiving from the upstream failed: {exc}")
        except asyncio.CancelledError:
            error = UpstreamClosed("The upstream socket was closed by the sidecar.")
            self._fail(error)
            raise
        self._fail(error)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is not None:
            return
        self.error = error
        for inbox in list(self.inboxes.values()):
            inbox.fail(error)
        if self._on_closed is not None:
            self._on_closed(self)

    def _route(self, raw: bytes, event: dict[str, Any]) -> None:
        sid = event.pop("stream_id", None)
        kind = event.get("type")
        inbox: Inbox | None
        if isinstance(sid, str):
            self.proven = True
            inbox = self.inboxes.get(sid)
            raw = strip_stream_id(raw, sid, event)
        elif kind == "error" and _about_lanes(event):
            inbox = self._oldest(named=True)
        elif self._current is not None:
            inbox = self._current
        elif self.proven:
            inbox = self.inboxes.get(None)
            if inbox is None and kind == "error":
                inbox = self._oldest(named=False)
        else:
            inbox = self._oldest(named=False)
            if inbox is not None and inbox.lane is not None and kind != "error":
                # A named lane's events come without stream_id: the upstream ignores lanes.
                if self._on_lanes_ignored is not None:
                    self._on_lanes_ignored(self)
        if inbox is None:
            return  # nobody waits for it (an abandoned lane's stray event, an unsolicited frame)
        with contextlib.suppress(ValueError):
            self._first.remove(inbox.lane)
        if sid is None:
            self._current = None if kind in _TERMINAL else inbox
        inbox.put(raw, event)

    def _oldest(self, *, named: bool) -> Inbox | None:
        for lane in self._first:
            if named and lane is None:
                continue
            inbox = self.inboxes.get(lane)
            if inbox is not None:
                return inbox
        return None

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the connection; never raises (closing is cleanup)."""
        try:
            await self.ws.close(code, reason)
        except Exception:  # noqa: BLE001 - a failing close leaves nothing to clean up
            self.ws.transport.abort()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def wait_closed(self) -> None:
        """Return once the connection is closed, whoever closed it."""
        await self.ws.wait_closed()


def _about_lanes(event: dict[str, Any]) -> bool:
    """Whether a connection-level ``error`` is about a ``stream_id`` (a named lane's create)."""
    inner = event.get("error")
    if not isinstance(inner, dict):
        inner = event
    return inner.get("param") == "stream_id" or inner.get("code") in _LANE_ERRORS


def strip_stream_id(raw: bytes, sid: str, event: dict[str, Any]) -> bytes:
    """``raw`` without its top-level ``"stream_id"`` member (the app asked over HTTP).

    The member is cut out of the bytes when its compact form occurs exactly once (the usual
    case: no re-serialisation); otherwise the parsed event, already without it, is written anew.
    """
    member = b'"stream_id":' + orjson.dumps(sid)
    at = raw.find(member)
    if at >= 0 and raw.find(member, at + 1) < 0:
        end = at + len(member)
        if raw[end : end + 1] == b",":
            return raw[:at] + raw[end + 1 :]
        if raw[at - 1 : at] == b",":
            return raw[: at - 1] + raw[end:]
    return orjson.dumps(event)
