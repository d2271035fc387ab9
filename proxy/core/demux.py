"""Lane demultiplexing of one upstream socket, sans-I/O: an event in, its lane out (or a routing
failure), plus what the event taught about the upstream's lanes.

This is the one owner of the fact "this socket's upstream takes ``stream_id``"
(:attr:`Demux.support`): the planner reads it to decide whether the socket may carry a second
response (``Socket.demux``), the socket's shell feeds it every event. The rule cannot
guess:

- **lanes proven** (an event came back with the ``stream_id`` of a lane in flight): every event
  is routed by its ``stream_id``; one without goes to the default lane, which is the only lane
  whose events carry none (protocol.md §1.4). With the default lane not in flight, an event
  without ``stream_id`` cannot be placed: it is a connection-level error or a stray of a lane we
  cannot name.
- **not proven** (unknown, refused, ignored): the socket carries one response at a time
  (:meth:`Demux.may_send`), and every event goes to that response. The first named lane sent
  on such a socket is the probe: a ``stream_id`` echoed proves lanes, a refusal of the
  ``stream_id`` refuses them, events without it say the upstream ignores lanes (it queues).

An event that cannot be placed is :class:`Unroutable`: every response in flight on the socket
is failed at once and the socket retires, so no waiter ever waits for events that went
elsewhere.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.retry import is_lane_refusal

__all__ = ["BadEvent", "Demux", "LaneSignal", "LaneSupport", "Routed", "Stray", "Unroutable", "strip_stream_id"]


class BadEvent(ValueError):
    """A message of the upstream that is not a JSON object (the socket's protocol is broken)."""


class LaneSupport(enum.StrEnum):
    """What one socket's upstream is known to do with ``stream_id``."""

    UNKNOWN = "unknown"
    """No named lane answered yet: one response at a time."""
    PROVEN = "proven"
    """A ``stream_id`` came back on an event: lanes multiplex, events are routed by it."""
    REFUSED = "refused"
    """The upstream refused a ``stream_id`` (``invalid_stream_id``, unknown parameter)."""
    IGNORED = "ignored"
    """A named lane's events came back without ``stream_id``: the upstream queues, one at a time."""


class LaneSignal(enum.StrEnum):
    """What an event taught the planner (returned once, when the support changes)."""

    PROVEN = "proven"
    REFUSED = "refused"
    IGNORED = "ignored"


@dataclass(frozen=True, slots=True)
class Routed:
    """The event belongs to ``lane``'s response in flight."""

    lane: str | None
    signal: LaneSignal | None = None


@dataclass(frozen=True, slots=True)
class Stray:
    """Nobody waits for the event (a lane done already, or nothing in flight): dropped."""


@dataclass(frozen=True, slots=True)
class Unroutable:
    """The event cannot be placed: fail every response in ``lanes`` and retire the socket."""

    lanes: tuple[str | None, ...]
    why: str


_STRAY = Stray()


class Demux:
    """The lanes in flight on one socket and the routing rule for its events."""

    __slots__ = ("_flight", "_members", "_routed", "support")

    def __init__(self) -> None:
        self.support = LaneSupport.UNKNOWN
        self._flight: dict[str | None, None] = {}
        """Lanes with a response in flight, in the order their creates were sent."""
        self._routed: dict[str | None, Routed] = {}
        """One :class:`Routed` per lane (an event costs no allocation on the hot path)."""
        self._members: dict[str, tuple[bytes, bytes, bytes]] = {}
        """Each named lane's ``"stream_id":…`` member as the upstream writes it, with that member
        as the object's last (``,member}``) and first (``{member,``) (built once per lane, not
        once per event)."""

    def __repr__(self) -> str:
        return f"<Demux {self.support} in flight {list(self._flight)}>"

    @property
    def proven(self) -> bool:
        """Whether the upstream of this socket multiplexes ``stream_id`` lanes."""
        return self.support is LaneSupport.PROVEN

    @property
    def probing(self) -> bool:
        """Whether a named lane is in flight on a socket whose lanes are still unknown (its
        first event proves or refuses them)."""
        return self.support is LaneSupport.UNKNOWN and any(lane is not None for lane in self._flight)

    @property
    def in_flight(self) -> int:
        """Responses in flight on the socket."""
        return len(self._flight)

    def lanes(self) -> tuple[str | None, ...]:
        """The lanes in flight, oldest first."""
        return tuple(self._flight)

    def may_send(self, lane: str | None) -> bool:
        """Whether a create for ``lane`` may go out now: its lane is free, and either lanes are
        proven or nothing else is in flight."""
        if lane in self._flight:
            return False
        return self.support is LaneSupport.PROVEN or not self._flight

    def sent(self, lane: str | None) -> None:
        """A create for ``lane`` went out. Recorded whether :meth:`may_send` allowed it or not:
        a socket that carries two unproven responses routes neither's events by guessing, it
        fails them (:class:`Unroutable`)."""
        self._flight[lane] = None

    def _to(self, lane: str | None) -> Routed:
        routed = self._routed.get(lane)
        if routed is None:
            routed = self._routed[lane] = Routed(lane)
        return routed

    def done(self, lane: str | None) -> None:
        """``lane``'s response ended (terminal event, failure, or its reader left)."""
        self._flight.pop(lane, None)

    def route(self, sid: str | None, event: Mapping[str, Any]) -> Routed | Stray | Unroutable:
        """Where an event goes; ``sid`` is its top-level ``stream_id`` (a string) or ``None``.

        An event whose ``stream_id`` is not a string is routed as if it had none.
        """
        flight = self._flight
        if sid is not None:
            if sid not in flight:
                if self.support is LaneSupport.PROVEN or not flight:
                    return _STRAY  # a lane that ended (its late event), or nothing waits
                return Unroutable(self.lanes(), f"an event of lane {sid!r}, which has nothing in flight")
            if self.support is not LaneSupport.PROVEN:
                self.support = LaneSupport.PROVEN
                return Routed(sid, LaneSignal.PROVEN)
            return self._to(sid)
        if self.support is LaneSupport.PROVEN:
            if None in flight:
                return self._to(None)
            if not flight:
                return _STRAY
            return Unroutable(self.lanes(), "an event without stream_id while only named lanes are in flight")
        if not flight:
            return _STRAY
        if len(flight) > 1:  # never by the planner's rule; the guard keeps the routing exact
            return Unroutable(self.lanes(), "an event without stream_id with several responses in flight")
        lane = next(iter(flight))
        if lane is None or self.support is not LaneSupport.UNKNOWN:
            return self._to(lane)
        if event.get("type") == "error":
            if not is_lane_refusal(event):
                return self._to(lane)  # a connection-level error, or the request's own: teaches nothing
            self.support = LaneSupport.REFUSED
            return Routed(lane, LaneSignal.REFUSED)
        self.support = LaneSupport.IGNORED
        return Routed(lane, LaneSignal.IGNORED)

    def receive(self, raw: bytes) -> tuple[Routed | Stray | Unroutable, bytes, dict[str, Any]]:
        """One message of the socket: parsed, routed (:meth:`route`) by its top-level
        ``stream_id``, which a routed event's bytes and object no longer hold
        (:func:`strip_stream_id`: the app asked over HTTP).

        Raises:
            BadEvent: the message is not a JSON object.
        """
        try:
            event = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadEvent(f"The upstream sent a frame that is not JSON: {exc}") from None
        if not isinstance(event, dict):
            raise BadEvent("The upstream sent a frame that is not a JSON object.")
        sid = event.pop("stream_id", None)
        if sid is None:
            return self.route(None, event), raw, event
        if sid.__class__ is not str:
            # not a lane name: placed as an event without one (its bytes unchanged)
            return self.route(None, event), raw, event
        if self.support is LaneSupport.PROVEN and sid in self._flight:
            route: Routed | Stray | Unroutable = self._to(sid)  # the hot path: route()'s answer
        else:
            route = self.route(sid, event)
            if route.__class__ is not Routed:
                return route, raw, event
        forms = self._members.get(sid)
        if forms is None:
            member = b'"stream_id":' + orjson.dumps(sid)
            forms = self._members[sid] = (member, b"," + member + b"}", b"{" + member + b",")
        member, tail, head = forms
        # Where upstreams put it (last, or first) is cut here without a call; anywhere else,
        # strip_stream_id decides.
        if raw.endswith(tail):
            return route, raw[: len(raw) - len(tail)] + b"}", event
        if raw.startswith(head):
            return route, b"{" + raw[len(head) :], event
        return route, strip_stream_id(raw, sid, event, member), event


def strip_stream_id(raw: bytes, sid: str, event: dict[str, Any], member: bytes = b"") -> bytes:
    """``raw`` without its top-level ``"stream_id"`` member (the app asked over HTTP).

    The member (``member``: its compact form, when the caller has it) is cut out of the bytes
    when it occurs exactly once (the usual case: no re-serialisation); otherwise the parsed
    event, already without it, is written anew.
    """
    member = member or b'"stream_id":' + orjson.dumps(sid)
    # Where upstreams put it, first or last: then it is the top-level member by position alone
    # (the pattern cannot occur inside a JSON string, whose quotes are escaped, and a nested
    # object's last member is followed by two braces), found without scanning the event.
    tail = b"," + member + b"}"
    if raw.endswith(tail):
        return raw[: len(raw) - len(tail)] + b"}"
    head = b"{" + member + b","
    if raw.startswith(head):
        return b"{" + raw[len(head) :]
    at = raw.find(member)
    if at >= 0 and raw.find(member, at + 1) < 0:
        end = at + len(member)
        if raw[end : end + 1] == b",":
            return raw[:at] + raw[end + 1 :]
        if raw[at - 1 : at] == b",":
            return raw[: at - 1] + raw[end:]
    return orjson.dumps(event)
