"""Fault hooks: armed from tests (``emulator.faults.arm(...)``) or ``POST /_emulator/faults``.

A fault waits in a queue until a request (or a WebSocket upgrade) matches it, fires ``count``
times, then disappears. Kinds:

=================  ===============================================================================
``error``          the next create fails before ``response.created``: HTTP status + JSON body +
                   headers; on WS an ``error`` event with ``status`` and ``error.headers``
``fail``           ``response.failed`` (``server_error``) after ``after_events`` events (default 2)
``drop``           abort the TCP connection after ``after_events`` events (default 0): WS sees 1006
``close``          WS close with ``close_code`` (default 1011) after ``after_events`` events
``delay``          sleep ``seconds`` before handling the create
``refuse_upgrade`` answer the WS upgrade with ``status`` (default 426), an error body and ``headers``
``miss``           the next continuation misses the cache (and the store): previous_response_not_found,
                   rendered in ``shape`` (see :data:`NOT_FOUND_SHAPES`)
``hold``           pause the response after ``after_events`` events (default 0) until released
                   (:meth:`FaultQueue.release`, ``POST /_emulator/faults/release``), then apply
                   ``then``: ``continue`` | ``drop`` | ``close`` (``close_code``) | ``fail``;
                   ``seconds`` > 0 releases by itself after that long (with ``then``)
``age_limit``      the next create is answered as if the socket had reached ``ws_max_age_s``:
                   ``websocket_connection_limit_reached``, then close (per ``ws_close_on_age_limit``),
                   which ends every other lane in flight on that socket
=================  ===============================================================================

``error`` faults may carry ``misalignment`` (an object): WS error events then have
``error.misalignment`` (protocol.md §6).

``match`` narrows which request fires it: keys ``previous_response_id_present``,
``previous_response_id``, ``stream_id``, ``connection_id``, ``store``, ``generate``, ``model``,
``stream`` (``refuse_upgrade``: ``identity``), each compared for equality with the request's value
(a list matches any of its members).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Final

from .errors import ApiError

__all__ = ["FAULT_KINDS", "HOLD_ACTIONS", "NOT_FOUND_SHAPES", "Fault", "FaultQueue", "Held"]

FAULT_KINDS: Final = frozenset(
    {"error", "fail", "drop", "close", "delay", "refuse_upgrade", "miss", "hold", "age_limit"}
)
HOLD_ACTIONS: Final = ("continue", "drop", "close", "fail")
NOT_FOUND_SHAPES: Final = (
    "nested",  # protocol.md §1.6: status + error{type, code, message, param}
    "no_type",  # first GA guide / xAI: status, error without type
    "alpha",  # alpha: error.type, no status
    "flat",  # documented flat error event: top-level code/message/param
    "top_level",  # ChatGPT-backend style: top-level status/code/message, no error object
    "response_failed",  # response.created then response.failed with response.error.code
    "parameterless",  # nested, code null, message "Invalid `previous_response_id`."
    "renamed",  # nested, code renamed by a proxy: codex_previous_response_stale
)
_DEFAULTS: Final[dict[int, tuple[str, str | None, str]]] = {
    400: ("invalid_request_error", None, "Invalid request."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    403: ("permission_error", None, "You are not allowed to access this resource."),
    404: ("invalid_request_error", None, "Not found."),
    408: ("timeout", None, "Request timed out."),
    409: ("invalid_request_error", "conflict", "Conflict."),
    426: ("invalid_request_error", "upgrade_required", "WebSocket mode is not available; use HTTP."),
    429: ("requests", "rate_limit_exceeded", "Rate limit reached for requests. Please try again in 2s."),
    500: ("server_error", "server_error", "The server had an error while processing your request."),
    502: ("server_error", None, "Bad gateway."),
    503: ("server_error", None, "The engine is currently overloaded, please try again later."),
}
_ids = itertools.count(1)


@dataclass(slots=True)
class Fault:
    """One armed fault. ``None`` fields take per-kind / per-status defaults."""

    kind: str
    status: int | None = None
    code: str | None = None
    type: str | None = None
    message: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    after_events: int | None = None
    close_code: int = 1011
    seconds: float = 0.0
    transport: str = "any"
    count: int = 1
    match: dict[str, Any] = field(default_factory=dict)
    shape: str = "nested"
    then: str = "continue"
    """``hold``: what happens on release."""
    misalignment: dict[str, Any] | None = None
    """``error``: an ``error.misalignment`` object for WS error events."""
    id: str = ""
    fired: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {sorted(FAULT_KINDS)}")
        if self.transport not in ("ws", "http", "any"):
            raise ValueError("transport must be 'ws', 'http' or 'any'")
        if self.shape not in NOT_FOUND_SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; expected one of {NOT_FOUND_SHAPES}")
        if self.then not in HOLD_ACTIONS:
            raise ValueError(f"unknown hold action {self.then!r}; expected one of {HOLD_ACTIONS}")
        if self.count < 1:
            raise ValueError("count must be >= 1")
        if not self.id:
            self.id = f"fault_{next(_ids)}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fault:
        """Build from JSON; unknown keys are an error."""
        known = {f.name for f in fields(cls)} - {"fired"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown fault fields {sorted(unknown)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy."""
        return asdict(self)

    @property
    def events_before(self) -> int:
        """How many events are sent before a ``fail`` / ``drop`` / ``close`` fires."""
        if self.after_events is not None:
            return self.after_events
        return 2 if self.kind == "fail" else 0

    def to_error(self) -> ApiError:
        """The error an ``error`` / ``refuse_upgrade`` fault produces."""
        status = self.status or (426 if self.kind == "refuse_upgrade" else 500)
        default_type, default_code, default_message = _DEFAULTS.get(status, ("server_error", None, "Error."))
        return ApiError(
            status,
            self.message or default_message,
            type=self.type or default_type,
            param=self.param,
            code=self.code if self.code is not None else default_code,
            headers=dict(self.headers),
            misalignment=dict(self.misalignment) if self.misalignment is not None else None,
        )

    def matches(self, transport: str, facts: dict[str, Any]) -> bool:
        """Whether a request on ``transport`` with ``facts`` fires this fault."""
        if self.transport not in ("any", transport):
            return False
        return all(
            facts.get(key) in value if isinstance(value, list) else facts.get(key) == value
            for key, value in self.match.items()
        )


@dataclass(slots=True)
class Held:
    """A response paused by a ``hold`` fault, waiting for :meth:`FaultQueue.release`."""

    fault: Fault
    connection_id: str | None
    stream_id: str | None
    events_sent: int
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event
    action: str = "continue"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {
            "fault_id": self.fault.id,
            "connection_id": self.connection_id,
            "stream_id": self.stream_id,
            "events_sent": self.events_sent,
        }


class FaultQueue:
    """Armed faults, safe to arm from another thread than the emulator's loop."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._held: list[Held] = []
        self._lock = threading.Lock()

    @property
    def held(self) -> list[Held]:
        """Responses currently paused by ``hold`` faults."""
        with self._lock:
            return list(self._held)

    def release(self, then: str | None = None, fault_id: str | None = None) -> int:
        """Release held responses (all, or those of ``fault_id``); ``then`` overrides the fault's action.

        Returns how many were released. Safe from any thread.
        """
        if then is not None and then not in HOLD_ACTIONS:
            raise ValueError(f"unknown hold action {then!r}; expected one of {HOLD_ACTIONS}")
        with self._lock:
            chosen = [h for h in self._held if fault_id is None or h.fault.id == fault_id]
            for held in chosen:
                self._held.remove(held)
        for held in chosen:
            held.action = then or held.fault.then
            held.loop.call_soon_threadsafe(held.event.set)
        return len(chosen)

    async def wait_held(self, held: Held) -> str:
        """Register ``held``, wait for its release (or its fault's ``seconds``), return the action."""
        with self._lock:
            self._held.append(held)
        timeout = held.fault.seconds if held.fault.seconds > 0 else None
        try:
            await asyncio.wait_for(held.event.wait(), timeout)
        except TimeoutError:
            held.action = held.fault.then
        finally:
            with self._lock:
                if held in self._held:
                    self._held.remove(held)
        return held.action

    def arm(self, kind: str, **options: Any) -> Fault:
        """Arm a fault (see the module docstring); returns it."""
        return self.add(Fault(kind=kind, **options))

    def add(self, fault: Fault) -> Fault:
        """Arm an already built fault."""
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        """Disarm everything (held responses continue)."""
        with self._lock:
            self._faults.clear()
        self.release("continue")

    @property
    def pending(self) -> list[Fault]:
        """Faults still armed, in arming order."""
        with self._lock:
            return list(self._faults)

    def take(self, kinds: frozenset[str] | set[str], transport: str, facts: dict[str, Any]) -> Fault | None:
        """Fire the first armed fault of one of ``kinds`` that matches; None if there is none."""
        with self._lock:
            for fault in self._faults:
                if fault.kind in kinds and fault.matches(transport, facts):
                    fault.fired += 1
                    if fault.fired >= fault.count:
                        self._faults.remove(fault)
                    return fault
        return None
