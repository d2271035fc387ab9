"""``response.steer`` on one WebSocket connection (protocol.md §1.4, §6; SDK ``ResponseSteerEvent``).

Gate: ``EmulatorConfig.steer_models`` (empty by default: every steer gets
``response.steer.failed`` / ``steering_not_supported``, as before). For a gated model:

* a steer whose target is **running** on this connection is ``accepted``; the response then ends at
  its next safe output boundary (before an ``output_item.added``, or before its terminal event) with
  ``response.incomplete`` / ``incomplete_details.reason: "steered"`` and its finished items, and an
  automatic successor starts on the same lane with its own ``response.created``
  (``previous_response_id`` = the steered response, the steer input as its input, the same settings);
* if the target's output awaits client tool output (it calls a function), it is not interrupted: after
  its ``response.completed`` the server sends ``response.steer.pending``
  (``waiting_for_required_input`` with ``function_call_output`` stubs), and the steer input is
  prepended to the client's next create with that ``previous_response_id`` on that lane;
* otherwise ``response.steer.failed`` with ``invalid_input`` (keys other than ``type``,
  ``previous_response_id``, ``input``; input not a non-empty string or array of user messages),
  ``response_not_found``, ``steering_not_supported`` (model not gated, or the target uses
  ``context_management`` / ``conversation``), ``response_already_completed``,
  ``too_many_pending_steers`` (more than :data:`MAX_PENDING` per response), ``response_not_active``
  (the target failed after accepting) or ``successor_creation_failed``.

Steer replies carry their own per-connection ``sequence_number`` (0, 1, …) [C: undocumented], and
``stream_id`` when the target's lane is named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from .engine import Execution, Turn, new_id, prepare
from .errors import ApiError
from .oracle import normalize_input
from .runner import Outcome
from .wslane import Lane

if TYPE_CHECKING:
    from .ws import WsConnection

__all__ = ["MAX_PENDING", "Steering"]

JSON = Any
MAX_PENDING: Final = 4
_KEYS: Final = frozenset({"type", "previous_response_id", "input"})
_PARTS: Final = frozenset({"input_text", "input_image", "input_file"})


@dataclass(slots=True)
class _Steer:
    id: str
    target: str
    input: JSON
    """As the client sent it (returned in ``response.steer.failed``)."""


@dataclass(slots=True)
class _Active:
    turn: Turn
    lane: Lane
    awaits_input: bool
    accepted: list[_Steer] = field(default_factory=list)

    def interrupt(self, index: int) -> bool:
        """Stop at this boundary: a steer was accepted and no client tool output is awaited."""
        return bool(self.accepted) and not self.awaits_input


def _valid_input(value: JSON) -> bool:
    if isinstance(value, str):
        return bool(value)
    if not isinstance(value, list) or not value:
        return False
    for item in value:
        if not isinstance(item, dict) or item.get("role") != "user" or item.get("type", "message") != "message":
            return False
        if set(item) - {"type", "role", "content"}:
            return False
        content = item.get("content")
        if isinstance(content, list):
            if not content or not all(isinstance(p, dict) and p.get("type") in _PARTS for p in content):
                return False
        elif not isinstance(content, str):
            return False
    return True


class Steering:
    """Running responses that can be steered, accepted steers, and pending ones."""

    def __init__(self, conn: WsConnection) -> None:
        self.conn = conn
        self._active: dict[str, _Active] = {}
        self._ended: dict[str, _Active] = {}
        self._pending: dict[str, tuple[str | None, list[_Steer]]] = {}
        self._sequence = 0

    # -- replies ----------------------------------------------------------------------------------
    async def _reply(self, payload: dict[str, JSON], stream_id: str | None, outcome: str) -> None:
        payload["sequence_number"] = self._sequence
        self._sequence += 1
        if stream_id is not None:
            payload["stream_id"] = stream_id
        self.conn.state.stats.count(self.conn.state.stats.steers, outcome)
        await self.conn.send(payload)

    async def _failed(
        self, event: dict[str, JSON], code: str, message: str, steer_id: str | None = None, stream_id: str | None = None
    ) -> None:
        target = event.get("previous_response_id")
        steer: dict[str, JSON] = {
            "input": event.get("input", ""),
            "previous_response_id": target if isinstance(target, str) else "",
        }
        if steer_id is not None:
            steer["id"] = steer_id
        error = {"type": "invalid_request_error", "code": code, "message": message}
        payload = {"type": "response.steer.failed", "error": error, "steer": steer}
        await self._reply(payload, stream_id, f"failed:{code}")

    # -- client event -----------------------------------------------------------------------------
    async def on_steer(self, event: dict[str, JSON]) -> None:
        """Answer one ``response.steer``."""
        config = self.conn.config
        if not config.steer_models:
            await self._failed(event, "steering_not_supported", "Steering is not supported for this response.")
            return
        unknown = sorted(set(event) - _KEYS)
        target_id = event.get("previous_response_id")
        if unknown:
            await self._failed(event, "invalid_input", f"Unknown parameter: '{unknown[0]}'.")
            return
        if not isinstance(target_id, str) or not _valid_input(event.get("input")):
            message = "Steering input must be a non-empty string or array of user messages."
            await self._failed(event, "invalid_input", message)
            return
        active = self._active.get(target_id)
        if active is None:
            if target_id in self._ended or target_id in self.conn.state.records:
                await self._failed(event, "response_already_completed", "The response has already completed.")
            else:
                await self._failed(event, "response_not_found", f"Response with id '{target_id}' not found.")
            return
        lane_key = active.lane.key
        body = active.turn.body
        if not config.steering(body.get("model")) or body.get("context_management") or body.get("conversation"):
            # SDK docstring: responses bound to a conversation or using automatic compaction cannot be steered
            message = "Steering is not supported for this response."
            await self._failed(event, "steering_not_supported", message, stream_id=lane_key)
            return
        if len(active.accepted) >= MAX_PENDING:
            message = "Too much steering input is pending for this response."
            await self._failed(event, "too_many_pending_steers", message, stream_id=lane_key)
            return
        steer = _Steer(new_id("steer", 12), target_id, event.get("input"))
        active.accepted.append(steer)
        ref = {"id": steer.id, "previous_response_id": target_id}
        await self._reply({"type": "response.steer.accepted", "steer": ref}, lane_key, "accepted")

    # -- lifecycle of a steerable response ----------------------------------------------------------
    def begin(self, turn: Turn, execution: Execution, lane: Lane) -> _Active:
        """A turn starts playing: it can be steered until it ends."""
        awaits = any(item.get("type") == "function_call" for item in execution.final.get("output") or [])
        active = _Active(turn, lane, awaits)
        self._active[turn.id] = active
        return active

    def end(self, turn: Turn) -> None:
        """The turn's terminal event was sent (or it was cut)."""
        active = self._active.pop(turn.id, None)
        if active is not None:
            self._ended[turn.id] = active
            while len(self._ended) > 64:
                del self._ended[next(iter(self._ended))]

    async def after(self, turn: Turn, outcome: Outcome, lane: Lane) -> None:
        """After the terminal event: ``pending`` (tool output awaited) or ``failed`` (target failed)."""
        active = self._ended.get(turn.id)
        if active is None or not active.accepted:
            return
        if outcome.status == "failed":
            for steer in active.accepted:
                event = {"input": steer.input, "previous_response_id": steer.target}
                message = "The response is no longer accepting steering input."
                await self._failed(event, "response_not_active", message, steer.id, lane.key)
            active.accepted.clear()
        elif active.awaits_input and outcome.status == "completed":
            stubs = [
                {"type": "function_call_output", "call_id": item["call_id"], "name": item["name"]}
                for item in outcome.response.get("output") or []
                if item.get("type") == "function_call"
            ]
            for steer in active.accepted:
                payload = {
                    "type": "response.steer.pending",
                    "reason": "waiting_for_required_input",
                    "required_input": stubs,
                    "steer": {"id": steer.id, "previous_response_id": steer.target},
                }
                await self._reply(payload, lane.key, "pending")
            self._pending[turn.id] = (lane.key, list(active.accepted))
            active.accepted.clear()

    def successor(self, turn: Turn, outcome: Outcome, lane: Lane) -> Turn | None:
        """The automatic successor of a steered (or normally completed, steered-late) response."""
        active = self._ended.get(turn.id)
        if active is None or not active.accepted or outcome.status not in ("completed", "incomplete"):
            return None
        steers, active.accepted = list(active.accepted), []
        items = [item for steer in steers for item in normalize_input(steer.input)]
        body = {**turn.body, "input": items, "previous_response_id": turn.id}
        base = lane.latest.chain if lane.latest is not None and lane.latest.id == turn.id else None
        if base is None:
            return None
        conn = self.conn
        try:
            successor = prepare(
                body,
                config=conn.config,
                transport="ws",
                owner=conn.owner,
                base=base,
                lookup_item=lambda item_id: conn.state.item(item_id, conn.owner),
                input_bytes=0,
                cached=True,
                hydrated=False,
                connection_id=conn.id,
                stream_id=lane.key,
                service_tier=turn.service_tier,  # the target's settings, the tier served included
            )
        except ApiError:
            return None
        conn.state.stats.count(conn.state.stats.steers, "successors")
        return successor

    def take_pending(self, body: dict[str, JSON], lane: Lane) -> dict[str, JSON]:
        """Prepend steer input left ``pending`` for this parent on this lane to the client's create."""
        prev = body.get("previous_response_id")
        entry = self._pending.get(prev) if isinstance(prev, str) else None
        if entry is None or entry[0] != lane.key:
            return body
        del self._pending[str(prev)]
        items = [item for steer in entry[1] for item in normalize_input(steer.input)]
        return {**body, "input": items + normalize_input(body.get("input"))}
