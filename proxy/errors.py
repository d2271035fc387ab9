"""One error taxonomy for the sidecar.

Blame is always the *request* (the app's fault, 4xx, never retried) or the *upstream*
(5xx, replayed only before any byte reached the app)::

    ProxyError(Exception)                     .status  .code
    ├─ RequestError                           4xx
    │  ├─ InvalidRequest(ValueError)          400 invalid_request_error
    │  ├─ BodyTooLarge                        413 request_too_large
    │  ├─ BodyTimeout                         408 request_timeout (and the connection closed)
    │  ├─ UnsupportedEncoding                 415 unsupported_content_encoding
    │  ├─ ForeignOrigin                       403 origin_not_allowed
    │  ├─ ForeignHost                         403 host_not_allowed
    │  ├─ ForeignResponse                     400 previous_response_not_found
    │  ├─ ForeignResponseRoute                404 (code null: the upstream's unknown id)
    │  └─ UnsupportedRequest                  400 unsupported
    ├─ MemoryRefused                          retry-after: the memory budget (proxy.intake.memory)
    │  ├─ MemoryBusy                          429 memory_busy
    │  └─ MemoryTooLarge                      503 memory_too_large
    ├─ UpstreamError                          5xx
    │  ├─ UpstreamUnavailable(ConnectionError)502 upstream_unavailable
    │  │  └─ UpstreamRefused                  502 upstream_refused (upgrade answered non-101)
    │  ├─ UpstreamTimeout(TimeoutError)       504 upstream_timeout
    │  ├─ UpstreamClosed                      502 upstream_closed
    │  └─ UpstreamProtocolError               502 upstream_protocol
    └─ ConfigError(ValueError)                startup only: exit 1

Not errors: an upstream ``error`` event or ``response.failed`` is relayed to the app with its
own status and body; a divergence in matching is a diff result (full resend); a full pool is a
plan (wait, then HTTP). Codes are :class:`proxy.reasons.ErrorCode` values.

Outside the tree: :class:`ClientGone` (``ConnectionResetError``), the app leaving mid-body, not an
error of ours.

Outside the taxonomy: :class:`InvalidTransition` (``AssertionError``), a bug in the planner, never
sent to anyone. It lives here, not in ``proxy.core.lanes``, because the compiled build (mypyc)
cannot make a native class of an ``AssertionError`` subclass; this module stays interpreted.
"""

from __future__ import annotations

from typing import Any

from proxy.reasons import ErrorCode
from proxy.redact import redact_urls

__all__ = [
    "ClientGone",
    "BodyTimeout",
    "BodyTooLarge",
    "ForeignHost",
    "ForeignOrigin",
    "UnsupportedEncoding",
    "ConfigError",
    "ForeignResponse",
    "ForeignResponseRoute",
    "InvalidRequest",
    "InvalidTransition",
    "MemoryTooLarge",
    "MemoryRefused",
    "MemoryBusy",
    "ProxyError",
    "RequestError",
    "UnsupportedRequest",
    "UpstreamClosed",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamRefused",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "invalid_url_body",
]


def invalid_url_body(method: str, path: str) -> dict[str, Any]:
    """The upstream's own 404 body for a path it does not serve (``Invalid URL (GET /x)``)."""
    return {
        "error": {
            "message": f"Invalid URL ({method} {path})",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }


class ClientGone(ConnectionResetError):
    """The app closed its connection before its body was complete (not an error of ours: one
    INFO line and ``upshift_request_bodies_aborted_total{reason="client_gone"}``). Here, not in
    :mod:`proxy.serve.streaming`: a compiled module cannot define a subclass of a builtin error."""


class InvalidTransition(AssertionError):
    """A lane or socket step the tables of :mod:`proxy.core.lanes` do not allow: a bug in the caller."""


class ProxyError(Exception):
    """Root of every error the sidecar raises on purpose."""

    status: int = 500
    """HTTP status the app receives."""
    code: str = ErrorCode.INTERNAL_ERROR
    """OpenAI-style ``error.code``; also the ``code`` label of ``upshift_errors_total``."""
    type: str = "server_error"
    """OpenAI-style ``error.type``."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        message = redact_urls(message)  # an error text never carries a URL's secrets
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """The OpenAI-shaped error body ``{"error": {message, type, param, code}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class RequestError(ProxyError):
    """The request is at fault: 4xx, never retried."""

    status = 400
    code = ErrorCode.INVALID_REQUEST
    type = "invalid_request_error"


class InvalidRequest(RequestError, ValueError):
    """Malformed JSON, a non-object body, or a field of the wrong type."""

    code = ErrorCode.INVALID_REQUEST


class BodyTooLarge(RequestError):
    """The body exceeds ``limits.max_body_bytes``."""

    status = 413
    code = ErrorCode.REQUEST_TOO_LARGE


class BodyTimeout(RequestError):
    """The body did not keep arriving: not complete within ``limits.body_timeout_seconds``, or
    slower than ``limits.body_min_bytes_per_second`` after the grace (the connection is closed)."""

    status = 408
    code = ErrorCode.REQUEST_TIMEOUT

    def __init__(self, message: str, *, slow: bool = False) -> None:
        super().__init__(message)
        self.slow = slow
        """Too slow (the minimum rate, or silent for the grace) rather than past the deadline."""


class UnsupportedEncoding(RequestError):
    """A ``Content-Encoding`` the sidecar does not decode (only gzip and deflate are)."""

    status = 415
    code = ErrorCode.UNSUPPORTED_CONTENT_ENCODING


class ForeignOrigin(RequestError):
    """A browser request (it carries ``Origin``) from an origin not in ``listener.allowed_origins``."""

    status = 403
    code = ErrorCode.ORIGIN_NOT_ALLOWED


class ForeignHost(RequestError):
    """A ``Host`` the listener does not answer to (a DNS-rebound page names its own)."""

    status = 403
    code = ErrorCode.HOST_NOT_ALLOWED


class UnsupportedRequest(RequestError):
    """A request the sidecar cannot serve (e.g. ``generate`` over HTTP)."""

    code = ErrorCode.UNSUPPORTED


class ForeignResponse(RequestError):
    """The app chains on a response id that another identity created through this sidecar.

    Answered exactly as the upstream answers an unknown id, so nothing about the other tenant
    is revealed; nothing is forwarded (behind one injected key the upstream store is shared).
    """

    code = ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Previous response with id '{response_id}' not found.", param="previous_response_id")


class ForeignResponseRoute(RequestError):
    """A route names (``GET``/``DELETE /v1/responses/{id}``, ``/input_items``, ``/cancel``) a
    response id that is not the caller's: the upstream's own 404 for an unknown id, word for
    word (``code: null``), so nothing about the other tenant is revealed."""

    status = 404
    code = ErrorCode.RESPONSE_NOT_FOUND

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.")

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["code"] = None
        return body


class ForeignObject(RequestError):
    """A route or body names a stored object (a conversation, a file, ...) that is not the
    caller's: a 404 as for an unknown id, so nothing about the other tenant is revealed."""

    status = 404
    code = ErrorCode.OBJECT_NOT_FOUND

    def __init__(self, noun: str, object_id: str, *, param: str | None = None) -> None:
        super().__init__(f"No {noun} with id '{object_id}' found.", param=param)


class NotShared(RequestError):
    """Behind an injected key, what would reach every tenant's objects (a list route, a route of
    objects the sidecar does not track) and ``identity.shared_objects`` does not open."""

    status = 403
    code = ErrorCode.NOT_SHARED


class MemoryRefused(ProxyError):
    """A request the memory budget cannot take (nothing was read or forwarded;
    :mod:`proxy.intake.memory`)."""

    retryable = True
    retry_after = 1

    def headers(self, request_id: str) -> dict[str, str]:
        """The answer's headers: ``retry-after`` (every OpenAI SDK honours it)."""
        return {"x-request-id": request_id, "retry-after": str(self.retry_after), "x-should-retry": "true"}


class MemoryBusy(MemoryRefused):
    """The request waited ``limits.memory_wait_seconds`` for memory."""

    status = 429
    code = ErrorCode.MEMORY_BUSY
    type = "rate_limit_error"


class MemoryTooLarge(MemoryRefused):
    """The request would not fit even into an empty budget."""

    status = 503
    code = ErrorCode.MEMORY_TOO_LARGE
    retry_after = 5


class UpstreamError(ProxyError):
    """The upstream is at fault: 5xx; replayed only before any byte reached the app."""

    status = 502
    code = ErrorCode.UPSTREAM_ERROR


class UpstreamUnavailable(UpstreamError, ConnectionError):
    """Connecting to the upstream failed (refused, DNS, TLS, refused upgrade)."""

    code = ErrorCode.UPSTREAM_UNAVAILABLE


class UpstreamRefused(UpstreamUnavailable):
    """The upstream answered the WebSocket upgrade with an HTTP status instead of 101.

    Kept apart because callers act on the status: a relayed upgrade answers the app with the same
    status, and a 426 switches an identity to HTTP.
    """

    code = ErrorCode.UPSTREAM_REFUSED

    def __init__(
        self, message: str, *, http_status: int, headers: dict[str, str] | None = None, payload: bytes = b""
    ) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.headers = headers or {}
        self.payload = payload


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The upstream went silent for longer than the stream idle timeout."""

    status = 504
    code = ErrorCode.UPSTREAM_TIMEOUT


class UpstreamClosed(UpstreamError):
    """The upstream socket closed before the response's terminal event."""

    code = ErrorCode.UPSTREAM_CLOSED

    def __init__(self, message: str, *, close_code: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.close_code = close_code
        self.reason = reason


class UpstreamProtocolError(UpstreamError):
    """The upstream sent something the protocol does not allow (bad JSON, binary frame)."""

    code = ErrorCode.UPSTREAM_PROTOCOL


class ConfigError(ProxyError, ValueError):
    """Invalid configuration; raised at startup only (exit code 1)."""

    code = "config_error"
