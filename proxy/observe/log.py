"""JSON logging: one object per line on stdout, with a redaction safety net.

Every record becomes ``{"ts", "level", "logger", "msg", ...extra}``; extra fields come from
``logger.info("...", extra={...})`` or from :func:`access_log`. Nothing should ever log a
credential, but if something does, :func:`redact` replaces it before the line is written:
header-shaped keys (``authorization``, ``api_key``, ...) are dropped, and strings that look like
a bearer token, an ``sk-`` key or an ``Authorization:`` header become ``[redacted]``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
from collections.abc import Mapping
from typing import IO, Any

import orjson

from proxy.config import LoggingSettings
from proxy.redact import redact_urls

__all__ = [
    "ACCESS_LOGGER",
    "FLUSH_DELAY",
    "REDACTED",
    "BatchedHandler",
    "JsonFormatter",
    "access_log",
    "redact",
    "setup_logging",
]

ACCESS_LOGGER = "upshift.access"
"""Logger name of the one-line-per-request access log."""
REDACTED = "[redacted]"
"""What a secret-looking value is replaced with."""

# Keys compared after lower-casing and mapping "-" to "_".
_DROP_KEYS = frozenset({"authorization", "proxy_authorization", "api_key", "openai_api_key", "x_api_key"})
_SECRET = re.compile(
    r"""(?ix)
    \bauthorization["']?\s*[:=]\s*["']?(?:(?:bearer|basic|token)\s+)?[^\s"',;}]+  # header text
    | \bbearer\s+[A-Za-z0-9._~+/=-]+                                            # bearer token
    | \bsk-[A-Za-z0-9_-]{8,}                                                      # OpenAI-style key
    """
)
# Attributes every LogRecord has; anything else on a record came in through ``extra=``.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_HANDLER_MARK = "_upshift_handler"
_ACCESS_ATTR = "_upshift_access"
"""LogRecord attribute holding an access line's fields (see :func:`access_log`)."""
_SAFE_STRING_KEYS = frozenset({"request_id", "route", "mode", "reason", "outcome"})
"""Access-log fields the sidecar fills itself (an id it generated, enum values): no secret can be
in them, so no regex runs over them. Numbers and booleans never need one either."""

_access_enabled = True
_access_logger = logging.getLogger(ACCESS_LOGGER)
_ROOT = logging.getLogger()
_UPSHIFT = logging.getLogger("upshift")
_INFO = logging.INFO
_second = -1
_second_text = ""


def _timestamp(created: float) -> str:
    """``2026-12-01T13:20:05.123Z``; the part up to the second is formatted once per second."""
    global _second, _second_text
    whole = int(created)
    if whole != _second:
        _second, _second_text = whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    return f"{_second_text}.{int((created - whole) * 1000):03d}Z"


def _access_line(created: float, fields: Mapping[str, object]) -> dict[str, Any]:
    """An access line: the fixed keys, then ``fields``; a regex runs only over strings that did
    not come from the sidecar itself."""
    line: dict[str, Any] = {
        "ts": _timestamp(created),
        "level": "info",
        "logger": ACCESS_LOGGER,
        "msg": "access",
    }
    for key, value in fields.items():
        if key in line or key in _RECORD_ATTRS:
            key = f"f_{key}"
        if value is None or value.__class__ in (int, float, bool) or key in _SAFE_STRING_KEYS:
            line[key] = value
        elif str(key).lower().replace("-", "_") not in _DROP_KEYS:
            line[key] = redact(value)
    return line


def redact(value: Any) -> Any:
    """Return ``value`` with secret-looking strings replaced and credential keys dropped.

    Recurses into mappings, lists and tuples; other values are returned unchanged.
    """
    if isinstance(value, str):
        return redact_urls(_SECRET.sub(REDACTED, value))
    if isinstance(value, Mapping):
        return {str(k): redact(v) for k, v in value.items() if str(k).lower().replace("-", "_") not in _DROP_KEYS}
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON object (no trailing newline; the handler adds it)."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as ``{"ts", "level", "logger", "msg", ...extra}``, redacted."""
        fields = record.__dict__.get(_ACCESS_ATTR)
        if fields is not None:
            return orjson.dumps(_access_line(record.created, fields), default=str).decode()
        line: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in line:
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        # default=str: a stray object in extra= must not lose the whole line.
        return orjson.dumps(redact(line), default=str).decode()


FLUSH_DELAY = 0.02
"""Seconds a line may wait for the lines after it, so that a busy sidecar writes its log in one
syscall per burst instead of one per request (a warning or error is written at once)."""


class BatchedHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A ``StreamHandler`` that writes the lines of one burst together: on the event loop, a line
    waits at most :data:`FLUSH_DELAY` (a warning or worse flushes at once, with everything
    before it, so the order of lines never changes); elsewhere it is written at once.
    ``flush()`` (and ``logging.shutdown()`` at exit) writes whatever waits.
    """

    def __init__(self, stream: IO[str]) -> None:
        super().__init__(stream)
        self._pending: list[str] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - as logging's own handlers: report, never raise
            self.handleError(record)
            return
        self.add(line, urgent=record.levelno >= logging.WARNING)

    def add(self, line: str, *, urgent: bool = False) -> None:
        """Queue one formatted line (the caller holds the handler's lock, as ``emit``'s does)."""
        self._pending.append(line)
        if urgent:
            self._write()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: nothing would flush later
            self._write()
            return
        if self._timer is not None:
            if self._timer_loop is not loop:  # set on a loop that is gone: it never fires
                self._write()
            return
        self._timer, self._timer_loop = loop.call_later(FLUSH_DELAY, self.flush), loop

    def flush(self) -> None:
        self.acquire()
        try:
            self._write()
        finally:
            self.release()

    def _write(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending:
            text = "\n".join(self._pending) + "\n"
            self._pending.clear()
            try:
                self.stream.write(text)
                self.stream.flush()
            except Exception:  # noqa: BLE001 - a closed or full stream must not break a request
                pass


_batched: BatchedHandler | None = None
"""The handler :func:`setup_logging` installed (the access log's fast path writes to it)."""


def setup_logging(s: LoggingSettings, *, stream: IO[str] | None = None) -> None:
    """Send every log record to ``stream`` (default: stdout) as a JSON line.

    Idempotent: replaces the handler a previous call installed, leaves others alone.

    Args:
        s: Level and access-log switch.
        stream: Where lines go; tests pass a buffer.
    """
    global _access_enabled, _batched
    _access_enabled = s.access_log
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        old.flush()
        root.removeHandler(old)
    handler = _batched = BatchedHandler(stream if stream is not None else sys.stdout)
    setattr(handler, _HANDLER_MARK, True)
    handler.setFormatter(JsonFormatter())
    root.addHandler(handler)
    root.setLevel(s.level.upper())
    # websockets logs every handshake (with headers) at DEBUG; never let that through.
    logging.getLogger("websockets").setLevel(logging.WARNING)
    # The sidecar writes its own access line (access_log below); aiohttp's would duplicate it.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def access_log(fields: Mapping[str, object]) -> None:
    """Log one access line on ``upshift.access`` with ``fields`` merged into the JSON object.

    Args:
        fields: ``request_id``, ``mode``, ``reason``, ``items_in``, ``items_sent``,
            ``bytes_in``, ``bytes_sent``, ``upstream_ms``, ``added_ms``, ``status``, ...
            Keys that collide with LogRecord attributes (e.g. ``msg``) are prefixed ``f_``.
    """
    if not _access_enabled or not _access_logger.isEnabledFor(_INFO):
        return
    handler = _batched
    if (
        handler is not None
        and _ROOT.handlers == [handler]
        and not (_access_logger.handlers or _access_logger.filters or _UPSHIFT.handlers or _ROOT.filters)
        and _access_logger.propagate
        and _UPSHIFT.propagate
    ):
        # The usual case (only the handler setup_logging installed): the line is formatted
        # straight from ``fields``, with no LogRecord and no logging dispatch.
        line = orjson.dumps(_access_line(time.time(), fields), default=str).decode()
        handler.acquire()
        try:
            handler.add(line)
        finally:
            handler.release()
        return
    # One record built directly (no caller lookup: the line names no source location). The
    # fields are record attributes as with ``extra=`` (for filters and handlers), and kept as
    # one mapping too, which JsonFormatter renders without the generic redaction pass.
    record = _access_logger.makeRecord(ACCESS_LOGGER, _INFO, "", 0, "access", (), None)
    attrs = record.__dict__
    for key, value in fields.items():
        attrs[f"f_{key}" if key in _RECORD_ATTRS else key] = value
    attrs[_ACCESS_ATTR] = fields
    _access_logger.handle(record)
