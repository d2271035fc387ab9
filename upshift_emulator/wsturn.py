"""One ``response.create`` on one lane: faults, validation, cache resolution, play, cache update.

The rules (protocol.md §1.7, §4.2.4): each lane caches its latest finished response; an id hits if
it is **any** lane's latest (a fork); a miss hydrates from the store when the parent was stored,
else ``previous_response_not_found`` (the socket stays open); a same-lane continuation that fails
evicts its parent, a failed cross-lane fork keeps it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from . import errors
from .engine import Turn, execute, finish, prepare
from .errors import ApiError
from .faults import Fault
from .oracle import Segment
from .runner import CUT_KINDS, Hold, Outcome, Sink, play
from .sinks import obfuscation, wants_obfuscation
from .state import ResponseRecord
from .validation import validate_body
from .wslane import Gone, Lane, request_facts
from .wsreplies import Miss, not_found_events

if TYPE_CHECKING:
    from .ws import WsConnection

__all__ = ["process", "run_turn"]

JSON = Any


def _fire(conn: WsConnection, kinds: set[str], facts: dict[str, JSON]) -> Fault | None:
    fault = conn.faults.take(kinds, "ws", facts)
    if fault is not None:
        conn.state.stats.fault_fired(fault.kind)
    return fault


def _resolve(conn: WsConnection, prev: str | None, forced: Fault | None) -> tuple[Segment, bool, bool]:
    """(base chain, cache hit, hydrated) for ``previous_response_id``; raises :class:`Miss`."""
    if prev is None:
        return Segment.root(), False, False
    stats, mine = conn.state.stats, conn.stats
    stats.continuations["ws"] += 1
    mine.continuations += 1
    if forced is not None:
        for lane in conn.lanes.values():
            if lane.latest is not None and lane.latest.id == prev:
                lane.latest = None
    else:
        for lane in conn.lanes.values():
            if lane.latest is not None and lane.latest.id == prev:
                stats.cache_hits += 1
                mine.cache_hits += 1
                return lane.latest.chain, True, False
        record = conn.state.get(prev, conn.owner)
        if record is not None:
            stats.hydrations["ws"] += 1
            mine.hydrations += 1
            return record.chain, False, True
    stats.misses["ws"] += 1
    mine.misses += 1
    raise Miss(prev, forced.shape if forced is not None else "nested")


def lookup_item(conn: WsConnection, item_id: str) -> JSON | None:
    """An output item by id: any lane's latest response first, then the store."""
    for lane in conn.lanes.values():
        if lane.latest is not None:
            for item in lane.latest.output:
                if isinstance(item, dict) and item.get("id") == item_id:
                    return item
    return conn.state.item(item_id, conn.owner)


def _evict(lane: Lane, prev: str | None) -> None:
    """A failed same-lane continuation evicts its parent (protocol.md §1.7)."""
    if prev is not None and lane.latest is not None and lane.latest.id == prev:
        lane.latest = None


async def _error(conn: WsConnection, lane: Lane, prev: str | None, error: ApiError) -> None:
    conn.state.stats.errors["ws"] += 1
    conn.stats.errors += 1
    _evict(lane, prev)
    await conn.send(error.ws_event(lane.key))


async def process(conn: WsConnection, lane: Lane, event: dict[str, JSON], size: int) -> None:
    """Run one create (and any automatic steering successors) on ``lane``."""
    body = {k: v for k, v in event.items() if k not in ("type", "stream", "stream_id")}
    facts = request_facts(body, lane.key, conn.id)
    prev = body.get("previous_response_id")
    delay = _fire(conn, {"delay"}, facts)
    if delay is not None:
        await asyncio.sleep(delay.seconds)
    try:
        outcome_fault = _fire(conn, {"error", *CUT_KINDS}, facts)
        if outcome_fault is not None and outcome_fault.kind == "error":
            raise outcome_fault.to_error()
        if body.get("background"):
            raise errors.background_over_ws()
        validate_body(body, transport="ws", config=conn.config)
        body = conn.steering.take_pending(body, lane)
        forced = _fire(conn, {"miss"}, facts) if prev is not None else None
        base, cached, hydrated = _resolve(conn, prev, forced)
        turn = prepare(
            body,
            config=conn.config,
            transport="ws",
            owner=conn.owner,
            base=base,
            lookup_item=lambda item_id: lookup_item(conn, item_id),
            input_bytes=size,
            cached=cached,
            hydrated=hydrated,
            connection_id=conn.id,
            stream_id=lane.key,
            service_tier=conn.state.serve_tier(conn.owner, body),
        )
    except Miss as miss:
        conn.state.stats.errors["ws"] += 1
        conn.stats.errors += 1
        for payload in not_found_events(miss, lane.key, body):
            await conn.send(payload)
        return
    except ApiError as error:
        await _error(conn, lane, prev, error)
        return
    hold_fault = _fire(conn, {"hold"}, facts)
    hold = Hold(hold_fault, conn.faults, conn.id) if hold_fault is not None else None
    outcome = await run_turn(conn, lane, turn, fault=outcome_fault, hold=hold)
    while outcome is not None:  # steering: the automatic successor of a steered response
        successor = conn.steering.successor(turn, outcome, lane)
        if successor is None:
            return
        turn = successor
        outcome = await run_turn(conn, lane, turn)


class _Obfuscating:
    """The connection as a sink that adds ``obfuscation`` to delta events (``ws_obfuscation``)."""

    def __init__(self, conn: WsConnection) -> None:
        self.conn = conn

    async def send(self, payload: dict[str, JSON]) -> None:
        if str(payload["type"]).endswith(".delta") and isinstance(payload.get("delta"), str):
            payload = {**payload, "obfuscation": obfuscation(payload["delta"])}
        await self.conn.send(payload)

    async def abort(self) -> None:
        await self.conn.abort()

    async def close(self, code: int) -> None:
        await self.conn.close(code)


async def run_turn(
    conn: WsConnection, lane: Lane, turn: Turn, *, fault: Fault | None = None, hold: Hold | None = None
) -> Outcome | None:
    """Play a prepared turn, update the lane cache; None when the socket is gone."""
    if not turn.generate:
        conn.state.stats.generate_false += 1
    execution = execute(turn, conn.config)
    active = conn.steering.begin(turn, execution, lane)
    settled: list[ResponseRecord] = []  # recorded before the terminal event goes out
    sink: Sink = _Obfuscating(conn) if wants_obfuscation(turn.body, conn.config.ws_obfuscation) else conn
    try:
        outcome = await play(
            execution, turn, sink, latency=conn.state.latency, fault=fault, hold=hold, interrupt=active.interrupt,
            settle=lambda final: settled.append(finish(conn.state, turn, final)),
        )  # fmt: skip
    finally:
        conn.steering.end(turn)
    record = settled[0] if settled else finish(conn.state, turn, outcome.response)
    if outcome.status in ("completed", "incomplete"):
        lane.latest = record
    else:
        _evict(lane, turn.previous_response_id)
    if outcome.status in ("dropped", "closed"):
        raise Gone
    await conn.steering.after(turn, outcome, lane)
    return outcome
