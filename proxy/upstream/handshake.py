"""The handshakes of an upstream WebSocket, and their failures as :mod:`proxy.errors`.

Opening (:func:`open_websocket`): websockets' client does the proxy tunnel, TLS and the upgrade
with the sidecar's options, and each way it fails becomes one error a turn knows what to do
with (a refused upgrade goes over HTTP, an unreachable upstream is retried elsewhere). Closing
(:func:`echo_close`, :func:`closed_error`): the close frames exchanged, answered, become one
:class:`~proxy.errors.UpstreamClosed`. In between, :class:`proxy.upstream.ws.UpstreamSocket` owns
the connection; these are apart from it because they run once per connection, never per turn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    InvalidHandshake,
    InvalidProxy,
    InvalidProxyStatus,
    InvalidStatus,
    InvalidURI,
    ProtocolError,
    ProxyError,
)
from websockets.frames import Close, CloseCode
from websockets.protocol import Protocol

from proxy.config import Settings
from proxy.errors import UpstreamClosed, UpstreamRefused, UpstreamUnavailable
from proxy.intake.identity import USER_AGENT
from proxy.redact import redact_urls
from proxy.upstream.egress import egress_for

__all__ = ["CLOSE_TIMEOUT", "MAX_RECEIVED_FRAME", "closed_error", "echo_close", "open_websocket"]

MAX_RECEIVED_FRAME = 64 * 1024 * 1024
"""Largest frame accepted from upstream: a ``response.completed`` holds the whole output."""

CLOSE_TIMEOUT = 2.0
"""Seconds to wait for the closing handshake before dropping the TCP connection."""

_UNSENDABLE = frozenset({CloseCode.NO_STATUS_RCVD, CloseCode.ABNORMAL_CLOSURE, CloseCode.TLS_HANDSHAKE})
"""Close codes that may be received but never sent: such a close is echoed without a code."""


def echo_close(protocol: Protocol, rcvd: Close) -> None:
    """Answer the close frame ``rcvd`` the upstream sent with the same code and reason (RFC 6455
    §5.5.1; without a code for one that may never be sent)."""
    with contextlib.suppress(ProtocolError):
        if rcvd.code in _UNSENDABLE:
            protocol.send_close()
        else:
            protocol.send_close(rcvd.code, rcvd.reason)


def closed_error(rcvd: Close | None, sent: Close | None) -> UpstreamClosed:
    """:class:`UpstreamClosed` for a closing handshake: the code and reason the upstream sent
    (else ours; 1006 when no close frame went either way)."""
    frame = rcvd or sent
    code = frame.code if frame is not None else 1006
    reason = frame.reason if frame is not None else ""
    return UpstreamClosed(
        f"The upstream closed the connection ({code}{' ' + reason if reason else ''}).",
        close_code=code,
        reason=reason,
    )


class _NoRedirects(connect):
    """websockets' ``connect`` that follows no redirect: a 3xx answer to the upgrade is a
    refused upgrade (:class:`~proxy.errors.UpstreamRefused`, so the turn goes over HTTP). A
    redirect would carry the upgrade's headers to another origin, and websockets strips only
    ``Authorization``, ``Cookie`` and ``Proxy-Authorization`` there, not a key in another
    header (``api_key.header: api-key``); the HTTP relay follows none either."""

    def process_redirect(self, exc: Exception) -> Exception | str:
        return exc


async def open_websocket(url: str, headers: Sequence[tuple[str, str]], settings: Settings) -> ClientConnection:
    """Open an upstream WebSocket with the sidecar's options.

    Args:
        url: ``Identity.ws_url`` (the upstream's path and query plus the app's query string).
        headers: Upgrade headers (``Identity.headers``); never cookies or hop-by-hop headers.
        settings: Pool and timeout settings.

    The connection goes through the egress proxy of :func:`proxy.upstream.egress.egress_for` (an HTTP
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
        return await _NoRedirects(
            url,
            additional_headers=list(headers),
            user_agent_header=USER_AGENT,
            compression="deflate" if pool.compression else None,
            open_timeout=settings.timeouts.connect_seconds,
            ping_interval=None,  # the UpstreamSocket's own keepalive (it owns the transport)
            close_timeout=CLOSE_TIMEOUT,
            max_size=MAX_RECEIVED_FRAME,
            # Resolved once by proxy.upstream.egress (egress.proxy: env|off|URL, NO_PROXY), never by
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
        raise UpstreamUnavailable(f"The egress proxy failed: {redact_urls(str(exc))}") from exc
    except InvalidStatus as exc:
        response = exc.response
        reason = f"refused the WebSocket upgrade with HTTP {response.status_code}"
        if 300 <= response.status_code <= 399:
            reason = f"answered the WebSocket upgrade with a redirect (HTTP {response.status_code}), not followed"
        raise UpstreamRefused(
            f"The upstream {reason}.",
            http_status=response.status_code,
            headers={k.lower(): v for k, v in response.headers.raw_items()},
            payload=bytes(response.body or b""),
        ) from exc
    except (InvalidHandshake, InvalidURI) as exc:
        raise UpstreamUnavailable(f"The upstream WebSocket handshake failed: {redact_urls(str(exc))}") from exc
    except TimeoutError as exc:
        raise UpstreamUnavailable("Connecting to the upstream timed out.") from exc
    except OSError as exc:
        raise UpstreamUnavailable(f"The upstream is unreachable: {redact_urls(str(exc.strerror or exc))}") from exc
