"""What the app gets for one attempt once its pump returned: an answer, or a replay.

Pure policy beside :func:`proxy.core.retry.classify` (which it asks): given the attempt's
:class:`~proxy.core.channel.Channel` (how far the response got, how it ended), the socket's
failure if any, and whether the shell already wrote to the app, :func:`decide` returns either a
:class:`~proxy.core.retry.Replay` or the :class:`Answer` to give, as data. The shell only
performs it (:meth:`proxy.serve.streaming.Downstream.answer`). Four kinds:

- **SSE end**: the stream ends cleanly after the events given (a completed stream; a failure the
  upstream reported, released as it is, with its ``error`` event normalised).
- **JSON**: ``stream: false`` and the response ended ``completed`` / ``incomplete``: its object.
- **HTTP error**: nothing reached the app yet: the error as the app would have got it over HTTP.
- **Error event**: the socket failed after output reached the app: one nested SSE ``error``
  event of the sidecar's own, then the end (never a truncated body behind a 200).

The channel's held events and sequence numbers are the channel's: an answer that releases them
takes them from it (so call :func:`decide` once per attempt).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.core.channel import Channel, Ending, Out
from proxy.core.retry import Replay, classify, is_connection_limit
from proxy.errors import UpstreamError
from proxy.reasons import RequestOutcome

__all__ = ["Answer", "AnswerKind", "Attempt", "Kept", "decide", "finished", "kept", "status_outcome"]


class AnswerKind(enum.StrEnum):
    """How the answer goes to the app."""

    SSE_END = "sse_end"
    """Write :attr:`Answer.events` (maybe none) and end the SSE body."""
    JSON = "json"
    """``200 application/json`` with :attr:`Answer.body`, the response object."""
    HTTP_ERROR = "http_error"
    """:attr:`Answer.status` with the OpenAI error :attr:`Answer.body` and :attr:`Answer.headers`."""
    ERROR_EVENT = "error_event"
    """Write the sidecar's own error event (:attr:`Answer.events`) and end the SSE body."""


@dataclass(frozen=True, slots=True)
class Answer:
    """One answer to give the app."""

    kind: AnswerKind
    outcome: RequestOutcome | None = None
    """The access record's outcome; ``None``: derived from the status (:func:`status_outcome`)."""
    status: int = 200
    body: Mapping[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    events: tuple[Out, ...] = ()
    error: str | None = None
    """The sidecar's own error code surfaced (``upshift_errors_total{code}``), if any."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """What decides between replay and answer, beside the channel: which attempt this was."""

    number: int
    """0 for the first try, then 1, 2 for replays."""
    continuation: bool
    """The frame carried an anchor the sidecar chose."""
    named: bool
    """The frame went on a named ``stream_id`` lane."""
    stream: bool
    """The app asked for SSE."""


@dataclass(frozen=True, slots=True)
class Kept:
    """What the lane keeps of a finished attempt (``Turn.finish``)."""

    response: dict[str, Any] | None
    """The completed response (it becomes the lane's head), else ``None``."""
    chainable: str | None
    """The id of a response that did not complete: the app may still chain it."""
    retire: bool
    """The upstream aged the socket out (it closes it after this error): no new turns on it."""


def status_outcome(status: int) -> RequestOutcome:
    """The outcome an answer with ``status`` has when nothing more specific is known."""
    if status < 400:
        return RequestOutcome.OK
    return RequestOutcome.CLIENT_ERROR if status < 500 else RequestOutcome.UPSTREAM_ERROR


def kept(channel: Channel) -> Kept:
    """What the lane keeps of ``channel``'s response, whatever the answer."""
    response = channel.response if channel.ending is Ending.COMPLETED else None
    rid = channel.response.get("id") if response is None and channel.response is not None else None
    # A completed response carries no error: only another ending can be the connection's age.
    aged = response is None and channel.terminal is not None and is_connection_limit(channel.terminal)
    return Kept(response, rid if isinstance(rid, str) else None, aged)


def decide(channel: Channel, failure: UpstreamError | None, attempt: Attempt, written: bool) -> Answer | Replay:
    """The attempt's answer, or its replay.

    Args:
        channel: The attempt's channel, after the pump returned (or raised ``failure``).
        failure: What the socket raised, or ``None`` if the terminal event arrived.
        attempt: Which attempt this was.
        written: Whether the shell already wrote headers (and events) to the app.
    """
    if failure is None and channel.released:
        return finished(channel, attempt.stream)
    verdict = classify(
        failure if failure is not None else (channel.terminal or {}),
        channel.released,
        attempt.number,
        continuation=attempt.continuation,
        named=attempt.named,
    )
    if isinstance(verdict, Replay):
        return verdict
    return _surfaced(channel, failure, attempt.stream, written)


def finished(channel: Channel, stream: bool) -> Answer:
    """The response reached its terminal event after output was released: what :func:`decide`
    answers then, whatever the attempt (known before the shell lets its lane go)."""
    failed = RequestOutcome.UPSTREAM_ERROR if channel.ending in (Ending.FAILED, Ending.ERROR) else None
    if stream:
        return Answer(AnswerKind.SSE_END, failed)
    if channel.ending in (Ending.COMPLETED, Ending.INCOMPLETE) and channel.response is not None:
        return Answer(AnswerKind.JSON, failed, 200, channel.response)
    err = channel.http_error()
    return Answer(AnswerKind.HTTP_ERROR, failed, err.status, err.body, err.headers)


def _surfaced(channel: Channel, failure: UpstreamError | None, stream: bool, written: bool) -> Answer:
    """The failure as it is: an HTTP error if nothing was written, else an SSE error and the end."""
    upstream = RequestOutcome.UPSTREAM_ERROR
    if failure is not None:
        if stream and written:
            out = channel.proxy_error_out(type=failure.type, code=failure.code, message=failure.message)
            return Answer(AnswerKind.ERROR_EVENT, upstream, events=(out,), error=failure.code)
        return Answer(AnswerKind.HTTP_ERROR, upstream, failure.status, failure.body(), error=failure.code)
    if (channel.ending is Ending.ERROR and not channel.started) or not stream:
        err = channel.http_error()
        outcome = RequestOutcome.CLIENT_ERROR if err.status < 500 else upstream
        return Answer(AnswerKind.HTTP_ERROR, outcome, err.status, err.body, err.headers)
    outs = channel.release()
    if channel.ending is Ending.ERROR and channel.terminal is not None:
        outs.append(channel.error_out(channel.terminal))
    return Answer(AnswerKind.SSE_END, upstream, events=tuple(outs))
