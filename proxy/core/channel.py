"""One response on one upstream socket, as a sans-I/O state machine.

Feed it each parsed upstream event with its raw bytes; it returns what to emit to the app and
keeps the bookkeeping the shell needs: whether the response started, whether anything was
released to the app, the terminal outcome, the final response object, the HTTP error to answer.

Two rules shape it:

- **Lifecycle prefix held back, for a bounded time.** ``response.created`` / ``in_progress`` /
  ``queued`` are held until the first other event (or a successful terminal) arrives. They carry
  no output, so the app loses little by waiting, and a ``response.failed`` that says
  ``previous_response_not_found`` (or a socket lost before output) can still be replayed
  invisibly: nothing reached the app yet. With a ``hold_back_s`` bound the held events are
  released anyway once they are that old (:meth:`Channel.deadline`, :meth:`Channel.on_timer`):
  a model that thinks for seconds before its first output no longer leaves the app without a
  byte, and from then on a failure is surfaced like one after output. How the hold ended is
  :attr:`Channel.hold_path` (a metric label).
- **The app's own ``previous_response_id``.** Every lifecycle event's ``response`` shows the
  id the app sent (``null`` when it sent none), never the sidecar's anchor. Only those events are
  patched (in their bytes where that is exact, else re-serialised); every other event passes
  through as the upstream's bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.core.retry import error_fields
from proxy.errors import UpstreamProtocolError

__all__ = ["PREFIX", "TERMINAL", "Channel", "Ending", "HoldPath", "HttpError", "Out", "nested_error"]

PREFIX = frozenset({"response.created", "response.in_progress", "response.queued"})
"""Lifecycle events before output: held back until the response is known to proceed."""


class Ending(enum.Enum):
    """How a response ended."""

    COMPLETED = "completed"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    ERROR = "error"


class HoldPath(enum.StrEnum):
    """How held lifecycle events left the hold (``upshift_held_lifecycle_total{path}``)."""

    OUTPUT = "output"
    """The first output event arrived within the bound: everything went out together."""
    DEADLINE = "deadline"
    """No output by the bound: the held events were released on their own."""
    TERMINAL = "terminal"
    """The terminal event arrived while they were held (no output at all, or a failure the
    shell surfaced)."""
    DISCARDED = "discarded"
    """They never reached the app: the attempt was replayed, or answered as an HTTP error."""


TERMINAL = {
    "response.completed": Ending.COMPLETED,
    "response.incomplete": Ending.INCOMPLETE,
    "response.failed": Ending.FAILED,
    "error": Ending.ERROR,
}
"""Terminal event types; the Codex backend's ``response.done`` is mapped by its status."""

_DONE_STATUS = {"completed": Ending.COMPLETED, "incomplete": Ending.INCOMPLETE}

_PASSED_HEADERS = ("retry-after", "retry-after-ms", "x-should-retry")


@dataclass(slots=True)
class Out:
    """One event to emit to the app: the upstream's bytes, or an object to serialise.

    Never changed once made, yet not a frozen dataclass: one is made per event (about 20 a
    turn), and a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``
    (0.56 µs, against 0.19 µs, when interpreted).
    """

    type: str
    raw: bytes | None
    """The upstream JSON bytes, unchanged (``None`` when :attr:`obj` must be serialised)."""
    obj: dict[str, Any] | None = None
    """A patched lifecycle event or a normalised error event."""


@dataclass(frozen=True, slots=True)
class HttpError:
    """An upstream error as the app would have got it over HTTP."""

    status: int
    body: dict[str, Any]
    """``{"error": {"type", "code", "message", "param"}}``."""
    headers: dict[str, str] = field(default_factory=dict)
    """``retry-after``, ``retry-after-ms``, ``x-ratelimit-*`` taken from the error frame."""


def _status(event: Mapping[str, Any]) -> int:
    for key in ("status", "status_code"):
        value = event.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 400 <= value <= 599:
            return value
    return 500


def _headers(event: Mapping[str, Any]) -> dict[str, str]:
    inner = event.get("error")
    found = inner.get("headers") if isinstance(inner, Mapping) else None
    if not isinstance(found, Mapping):
        found = event.get("headers")  # Codex reads a top-level ``headers``
    if not isinstance(found, Mapping):
        return {}
    out: dict[str, str] = {}
    for name, value in found.items():
        lowered = str(name).lower()
        if lowered in _PASSED_HEADERS or lowered.startswith("x-ratelimit-"):
            text = str(value)
            if "\n" not in text and "\r" not in text:  # never let a value forge a header
                out[lowered] = text
    return out


def error_object(event: Mapping[str, Any]) -> dict[str, Any]:
    """``{"type", "code", "message", "param"}`` of an error event in any shape, plus every other
    field the upstream put in its ``error`` object (``misalignment``, ...; protocol.md §6), except
    ``headers``, which become HTTP headers."""
    code, message, param = error_fields(event)
    inner = event.get("error")
    kind = inner.get("type") if isinstance(inner, Mapping) else None
    if not isinstance(kind, str):
        kind = "invalid_request_error" if _status(event) < 500 else "server_error"
    out: dict[str, Any] = {"type": kind, "code": code, "message": message or "An error occurred.", "param": param}
    if isinstance(inner, Mapping):
        for key, value in inner.items():
            if key not in out and key != "headers":
                out[key] = value
    return out


class Channel:
    """The events of one response, from the ``response.create`` frame to its terminal event.

    Args:
        app_previous_response_id: The app's own ``previous_response_id`` (``None`` if it sent
            none); shown in every lifecycle event instead of the sidecar's anchor.
        hold_back_s: Longest time events are held (from the first held one's arrival, as given
            by :meth:`feed`'s ``now``); ``None`` holds until output or the terminal event (use it
            for ``stream: false``, where releasing early gains nothing). ``0`` never holds.
    """

    def __init__(self, app_previous_response_id: str | None, hold_back_s: float | None = None) -> None:
        self._app_prev = app_previous_response_id
        self._hold_back = hold_back_s
        self._held: list[Out] = []
        self._held_since: float | None = None
        self._was_held = False
        self._path: HoldPath | None = None
        self.started = False
        """A ``response.*`` event arrived: the upstream began the response."""
        self.released = False
        """Events beyond the lifecycle prefix were released to the app: no replay any more."""
        self.ending: Ending | None = None
        """Set once the terminal event arrived."""
        self.terminal: dict[str, Any] | None = None
        """The terminal event itself."""
        self.response: dict[str, Any] | None = None
        """The final response object (patched), for ``stream: false`` and the head table."""
        self.last_sequence = -1
        """Highest ``sequence_number`` seen, so the sidecar's own error event comes next."""

    @property
    def done(self) -> bool:
        """The terminal event arrived."""
        return self.ending is not None

    @property
    def hold_path(self) -> HoldPath | None:
        """How the held events left the hold; ``None`` if nothing was ever held.

        Final once the shell is done with the channel: events still held then never reached
        the app (:attr:`HoldPath.DISCARDED`).
        """
        if self._path is None and self._was_held:
            return HoldPath.DISCARDED
        return self._path

    def deadline(self) -> float | None:
        """When the held events must be released (same clock as ``now``), or ``None``."""
        if self.released or self._hold_back is None or self._held_since is None or self.ending is not None:
            return None
        return self._held_since + self._hold_back

    def on_timer(self, now: float) -> list[Out]:
        """The timer set for :meth:`deadline` fired: what to emit now (possibly nothing)."""
        deadline = self.deadline()
        if deadline is None or now < deadline:
            return []
        return self.release(HoldPath.DEADLINE)

    def _hold(self, out: Out, now: float | None) -> list[Out]:
        """Hold ``out``; release everything at once if the bound has passed."""
        self._held.append(out)
        self._was_held = True
        if now is None:
            return []
        if self._held_since is None:
            self._held_since = now
        return self.on_timer(now)

    def feed(self, raw: bytes, event: dict[str, Any], now: float | None = None) -> list[Out]:
        """Take one upstream event and return what to emit now (possibly nothing).

        Args:
            raw: The event's bytes as the upstream sent them.
            event: Those bytes parsed.
            now: The shell's monotonic clock when the event arrived; it starts the hold-back
                bound (without it, the bound is not armed by this event).

        Raises:
            UpstreamProtocolError: the event has no string ``type``, or arrives after the end.
        """
        kind = event.get("type")
        if not isinstance(kind, str):
            raise UpstreamProtocolError("upstream event without a string 'type'")
        if self.ending is not None:
            raise UpstreamProtocolError(f"upstream event {kind!r} after the terminal event")
        seq = event.get("sequence_number")
        if isinstance(seq, int) and seq > self.last_sequence:
            self.last_sequence = seq
        if kind in PREFIX:
            self.started = True
            out = self._lifecycle(kind, raw, event)
            if self.released:
                return [out]
            return self._hold(out, now)
        outcome = TERMINAL.get(kind)
        if outcome is None and kind == "response.done":
            response = event.get("response")
            status = response.get("status") if isinstance(response, Mapping) else None
            outcome = _DONE_STATUS.get(status if isinstance(status, str) else "", Ending.FAILED)
        if outcome is None:
            if self.released:
                return [Out(kind, raw)]
            if not kind.startswith("response."):
                # Backend extras (``codex.rate_limits``, timings) carry no output: hold them
                # with the prefix so a replay stays possible.
                return self._hold(Out(kind, raw), now)
            self.started = True
            return self.release(HoldPath.OUTPUT) + [Out(kind, raw)]
        self.ending = outcome
        self.terminal = event
        if outcome is Ending.ERROR:
            if self.released:
                return [self.error_out(event)]
            return []  # held: the shell replays, answers an HTTP error, or calls release()
        self.started = True
        out = self._lifecycle(kind, raw, event)
        response = event.get("response")
        self.response = response if isinstance(response, dict) else None
        if outcome is Ending.FAILED and not self.released:
            self._held.append(out)  # a not_found in response.failed can still be replayed
            self._was_held = True
            return []
        return self.release() + [out]

    def release(self, path: HoldPath = HoldPath.TERMINAL) -> list[Out]:
        """Release every held event (the response goes to the app as it is).

        ``path`` is recorded as :attr:`hold_path` if events were held and this is their release.
        """
        if not self.released and self._was_held and self._path is None:
            self._path = path
        self.released = True
        held, self._held = self._held, []
        return held

    def error_out(self, event: Mapping[str, Any]) -> Out:
        """An upstream error event, normalised to the nested shape with the next sequence number."""
        error = error_object(event)
        return Out("error", None, nested_error(self._next_sequence(event), **error))

    def proxy_error_out(self, *, type: str, code: str, message: str) -> Out:
        """The sidecar's own nested error event (a failure after output reached the app)."""
        self.last_sequence += 1
        return Out("error", None, nested_error(self.last_sequence, type=type, code=code, message=message))

    def http_error(self) -> HttpError:
        """The terminal error as an HTTP answer: ``status`` (or ``status_code``, default 500), the
        OpenAI error body and the rate-limit headers; ``response.failed`` is 500 with
        ``response.error`` completed to the four-key OpenAI error shape.
        """
        event = self.terminal or {}
        if self.ending is Ending.ERROR:
            return HttpError(_status(event), {"error": error_object(event)}, _headers(event))
        error = self.response.get("error") if self.response else None
        error = error if isinstance(error, dict) else {}
        # response.error carries only code and message; HTTP error bodies have all four keys.
        body = {
            "message": error.get("message") or "The response failed.",
            "type": error.get("type") or "server_error",
            "param": error.get("param"),
            "code": error.get("code") or "server_error",
        }
        return HttpError(500, {"error": body})

    def _next_sequence(self, event: Mapping[str, Any]) -> int:
        seq = event.get("sequence_number")
        if isinstance(seq, int) and not isinstance(seq, bool):
            return seq
        self.last_sequence += 1
        return self.last_sequence

    def _lifecycle(self, kind: str, raw: bytes, event: dict[str, Any]) -> Out:
        """Show the app's own ``previous_response_id``; rewrite only if it differs.

        The rewrite patches the upstream's bytes when the member occurs in them exactly once
        (outside strings a ``"`` is never escaped, so that one occurrence is the member the
        parse found); otherwise the event is serialised anew.
        """
        response = event.get("response")
        if not isinstance(response, dict):
            return Out(kind, raw)
        previous = response.get("previous_response_id")
        if previous == self._app_prev:
            return Out(kind, raw)
        response["previous_response_id"] = self._app_prev
        if isinstance(previous, str):
            old = b'"previous_response_id":' + orjson.dumps(previous)
            if raw.count(old) == 1:
                return Out(kind, raw.replace(old, b'"previous_response_id":' + orjson.dumps(self._app_prev)))
        return Out(kind, None, event)


def nested_error(
    sequence_number: int, *, type: str, code: str | None, message: str, param: str | None = None
) -> dict[str, Any]:
    """The nested ``error`` event (the production shape, protocol.md §2.5).

    The nested shape is the one every client reads: the openai SDK raises ``APIError`` with
    ``.code`` and ``.message`` set for it, whereas the flat shape parses with ``error=None``.
    """
    return {
        "type": "error",
        "sequence_number": sequence_number,
        "error": {"type": type, "code": code, "message": message, "param": param},
    }
