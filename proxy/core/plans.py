"""What the planner decides for one attempt of one request: a :data:`Plan`, one of five kinds.

Each kind carries only what its execution needs, and the kind is the class: the pool
(``proxy/upstream/pool.py``) and the handler take a plan apart with ``match``, and nothing
rewrites one. Only :class:`~proxy.core.planner.Planner` builds them.

- :class:`Continue`: ``previous_response_id`` + the new items on a lane (the head's own, or any
  lane when the head's response is stored and the upstream hydrates it).
- :class:`Full`: the app's whole input on a lane.
- :class:`Wait`: no lane can be had now; the turn's :class:`~proxy.core.waiting.Waiting` says
  until when it waits before it plans again.
- :class:`Http`: the app's body over plain HTTP.
- :class:`HttpContinue`: ``previous_response_id`` + the new items over plain HTTP (a stored
  head with no lane now).

Every kind carries ``close``: sockets the pool closes first (the total limit's least recently
used, an identity giving up one of its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.core.lanes import LaneKey
from proxy.core.request import ParsedRequest, build_frame
from proxy.reasons import Hit, MissReason, PassthroughReason

__all__ = ["Continue", "Full", "Http", "HttpContinue", "OnLane", "Plan", "Ready", "Wait"]


@dataclass(frozen=True, slots=True)
class Continue:
    """Continue the head ``response_id`` on ``lane`` (reserved: BUSY until the turn ends)."""

    lane: LaneKey
    response_id: str
    new_items: list[Any]
    items_avoided: int
    dropped_reasoning: int = 0
    dropped_phase: int = 0
    """Echoed items the match tolerated without their reasoning / ``phase``."""
    hydrated: bool = False
    """The head's own lane is gone or taken: the upstream hydrates the stored response."""
    open_socket: bool = False
    """The lane's socket is new: the pool opens it (``opened``/``open_failed``)."""
    close: tuple[int, ...] = ()
    warm: int | None = None
    """A spare socket to open in the background (nobody waits for it)."""

    @property
    def reason(self) -> Hit:
        """Always :attr:`Hit.CONTINUATION`."""
        return Hit.CONTINUATION

    @property
    def stream_id(self) -> str | None:
        """The lane's ``stream_id`` (``None``: the default lane)."""
        return self.lane[1]

    def frame(self, req: ParsedRequest) -> bytes:
        """The ``response.create`` frame: the new items after ``previous_response_id``."""
        return build_frame(req, previous_response_id=self.response_id, items=self.new_items, stream_id=self.lane[1])


@dataclass(frozen=True, slots=True)
class Full:
    """Send the app's whole input on ``lane`` (reserved), for ``reason`` (``None``: a replay's)."""

    reason: Hit | MissReason | None
    lane: LaneKey
    dropped_reasoning: int = 0
    dropped_phase: int = 0
    open_socket: bool = False
    close: tuple[int, ...] = ()
    warm: int | None = None

    @property
    def stream_id(self) -> str | None:
        """The lane's ``stream_id`` (``None``: the default lane)."""
        return self.lane[1]

    def frame(self, req: ParsedRequest) -> bytes:
        """The ``response.create`` frame: the app's whole input."""
        return build_frame(req, stream_id=self.lane[1])


@dataclass(frozen=True, slots=True)
class Wait:
    """No lane now: wait (until the turn's deadline, or a lane frees), then plan again.

    ``reason`` :attr:`Hit.CONTINUATION`: a matched head waits for a lane (a stored one may
    become an :class:`HttpContinue` when the wait ends); else why a new head has none."""

    reason: Hit | MissReason | None
    close: tuple[int, ...] = ()
    growing: bool = False
    """For lanes a moment away (a handshake, a lane probe), not for busy ones."""


@dataclass(frozen=True, slots=True)
class Http:
    """Send the app's body over plain HTTP, for ``reason``."""

    reason: PassthroughReason
    close: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class HttpContinue:
    """Send ``previous_response_id`` + the new items over plain HTTP (the upstream hydrates)."""

    response_id: str
    new_items: list[Any]
    items_avoided: int
    close: tuple[int, ...] = ()


Plan = Continue | Full | Wait | Http | HttpContinue
"""The planner's decision for one attempt."""

Ready = Continue | Full | Http | HttpContinue
"""A plan the pool hands back to the handler: its waits are over."""

OnLane = Continue | Full
"""A plan that holds a reserved lane."""
