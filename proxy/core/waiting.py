"""Whether a turn waits for a lane, and for how long: a pure rule over measured quantities.

A turn whose lane cannot be had now has an alternative it can take at once: an HTTP
continuation (a stored head), a full send on a free lane or over plain HTTP. Waiting for the
lane is worth it only while the wait is expected to be shorter than what the lane saves against
that alternative; otherwise the turn goes now (the app would not have waited without the
sidecar). Both sides are measured, per identity, never assumed:

- how long a lane of the identity stays busy with one response (:meth:`Estimates.busy`), from
  which the time until a busy lane frees follows (:meth:`Estimates.remaining`);
- the upstream's own time for a response (from the send to its terminal event's arrival) for
  each way of sending (:class:`Send`), per size of the request (requests of similar size share
  a bucket): what a continuation on a lane saves is the alternative's time minus the
  continuation's (:meth:`Estimates.saving`). The whole response's time, not its first event's:
  it is measured the same way over a socket and over plain HTTP (a stream's first byte and a
  JSON answer's are not alike), and a rebuilt context costs before the first token either way.

Until an identity has samples of both sides, the saving is taken as nothing and the busy time
as long (:data:`DEFAULT_BUSY_SECONDS`): a turn does not wait on a guess. A new head waiting for
lanes a moment away (a handshake, a lane probe) is the exception: what it saves is its next
turns continued in memory (:meth:`Estimates.head_saving`), not measurable before a conversation
has continued, and until it is the head waits a bounded while (``pool.wait_seconds``), as a
conversation sent over HTTP instead would make its next turn a hydration. Once measured, it
waits only while the new heads' recent waits (:meth:`Estimates.grow`) are shorter than that
saving. Nothing here reads a clock; the planner's patience (:mod:`proxy.core.patience`) applies
:func:`wait_seconds` and the pool only executes the resulting plan.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from proxy.reasons import WaitOutcome

__all__ = [
    "DEFAULT_BUSY_SECONDS",
    "Estimates",
    "Send",
    "WaitRule",
    "Waiting",
    "wait_seconds",
]

DEFAULT_BUSY_SECONDS = 1.0
"""How long a lane is taken to stay busy before the identity has a sample: long, so no turn
waits for a lane on a guess."""
WEIGHT = 0.2
"""Weight of a new sample in a rolling estimate (about the last ten samples count)."""
MAX_IDENTITIES = 4096
"""Identities whose estimates are kept (the least recently measured goes first)."""
_BUCKETS = 12
LINGER = 1.5
"""A turn waits at most this many times the lane's expected time to free (and never beyond
what the lane saves): a lane a little late is still worth it, one far past its estimate is not."""


class Send(enum.StrEnum):
    """A way of sending a turn upstream, as the estimates tell them apart."""

    CONTINUE = "continue"
    """``previous_response_id`` + the new items on the lane that holds the head (cached)."""
    FULL = "full"
    """The whole input on a socket."""
    HTTP_CONTINUE = "http_continue"
    """``previous_response_id`` + the new items over plain HTTP (the upstream hydrates it)."""
    HTTP_FULL = "http_full"
    """The whole input over plain HTTP (what the app does without the sidecar)."""


def size_bucket(size: int) -> int:
    """Requests of similar size share a bucket (powers of two of 4 KiB)."""
    return min((size >> 12).bit_length(), _BUCKETS)


@dataclass(slots=True)
class _Mean:
    value: float
    samples: int = 1

    def add(self, sample: float) -> None:
        self.samples += 1
        self.value += WEIGHT * (sample - self.value)


class _Identity:
    __slots__ = ("busy", "first", "first_any", "grow")

    def __init__(self) -> None:
        self.busy: _Mean | None = None
        self.grow: _Mean | None = None
        self.first: dict[tuple[Send, int], _Mean] = {}
        self.first_any: dict[Send, _Mean] = {}


def _busy(mine: _Identity, seconds: float) -> None:
    if mine.busy is None:
        mine.busy = _Mean(seconds)
    else:
        mine.busy.add(seconds)


def _upstream(mine: _Identity, send: Send, size: int, seconds: float) -> None:
    key = (send, size_bucket(size))
    mean = mine.first.get(key)
    if mean is None:
        mine.first[key] = _Mean(seconds)
    else:
        mean.add(seconds)
    overall = mine.first_any.get(send)
    if overall is None:
        mine.first_any[send] = _Mean(seconds)
    else:
        overall.add(seconds)


class Estimates:
    """Rolling per-identity estimates of lane busy time and of the upstream's own time by
    :class:`Send` and size bucket (bounded: :data:`MAX_IDENTITIES`)."""

    def __init__(self, max_identities: int = MAX_IDENTITIES) -> None:
        self._max = max_identities
        self._ids: dict[str, _Identity] = {}

    def _get(self, identity: str) -> _Identity:
        found = self._ids.pop(identity, None)
        if found is None:
            found = _Identity()
            if len(self._ids) >= self._max:
                del self._ids[next(iter(self._ids))]
        self._ids[identity] = found  # the most recently measured last
        return found

    def observe_busy(self, identity: str, seconds: float) -> None:
        """A lane of ``identity`` carried one response for ``seconds`` (begin to terminal event)."""
        _busy(self._get(identity), seconds)

    def observe_upstream(self, identity: str, send: Send, size: int, seconds: float) -> None:
        """The upstream took ``seconds`` from the send to the terminal event for a ``size``-byte request."""
        _upstream(self._get(identity), send, size, seconds)

    def observe_turn(self, identity: str, busy: float | None, send: Send | None, size: int, seconds: float) -> None:
        """One turn on a lane of ``identity`` ended: :meth:`observe_busy` of ``busy`` and
        :meth:`observe_upstream` of ``send`` (each unless ``None``), with one lookup."""
        mine = self._get(identity)
        if send is not None:
            _upstream(mine, send, size, seconds)
        if busy is not None:
            _busy(mine, busy)

    def observe_grow(self, identity: str, seconds: float) -> None:
        """A new head of ``identity`` waited ``seconds`` for lanes a moment away (a handshake, a
        probe, the slow start) until it got one, or until it gave up (then: at least that)."""
        mine = self._get(identity)
        if mine.grow is None:
            mine.grow = _Mean(seconds)
        else:
            mine.grow.add(seconds)

    def grow(self, identity: str) -> float | None:
        """Expected seconds a new head of ``identity`` waits for lanes a moment away, or ``None``."""
        mine = self._ids.get(identity)
        return mine.grow.value if mine is not None and mine.grow is not None else None

    def head_saving(self, identity: str, size: int, store: bool) -> float | None:
        """Seconds a lane saves a new head of a ``size``-byte request against sending it now
        over plain HTTP, or ``None`` until that is measured.

        What a head on a lane gains is its next turn: continued from the lane's memory
        (:attr:`Send.CONTINUE`) rather than rebuilt upstream, which a stored answer adopted
        from HTTP costs as a hydration (:attr:`Send.HTTP_CONTINUE`, else a full send's time:
        the whole context is re-read either way) and a ``store: false`` one as a full send
        (:attr:`Send.FULL`). Plus what the send itself gains on a socket against HTTP
        (:meth:`saving`, 0 until measured). The next turn is taken as of the same size."""
        here = self.upstream_time(identity, Send.CONTINUE, size)
        there = self.upstream_time(identity, Send.HTTP_CONTINUE, size) if store else None
        if there is None:
            there = self.upstream_time(identity, Send.FULL, size)
        if here is None or there is None:
            return None
        return max(there - here, 0.0) + self.saving(identity, Send.HTTP_FULL, size, on_lane=Send.FULL)

    def busy(self, identity: str) -> float:
        """Expected seconds a lane of ``identity`` stays busy with one response."""
        mine = self._ids.get(identity)
        return mine.busy.value if mine is not None and mine.busy is not None else DEFAULT_BUSY_SECONDS

    def remaining(self, identity: str, elapsed: float) -> float:
        """Expected seconds until a lane busy for ``elapsed`` seconds frees: its busy time
        minus what passed, and never less than a tenth of it (a response past its estimate is
        running long, not about to end)."""
        busy = self.busy(identity)
        return max(busy - elapsed, 0.1 * busy)

    def upstream_time(self, identity: str, send: Send, size: int) -> float | None:
        """Expected upstream seconds (the size's bucket, else any size), or ``None``."""
        mine = self._ids.get(identity)
        if mine is None:
            return None
        mean = mine.first.get((send, size_bucket(size))) or mine.first_any.get(send)
        return mean.value if mean is not None else None

    def saving(self, identity: str, alternative: Send, size: int, on_lane: Send = Send.CONTINUE) -> float:
        """Seconds the lane (``on_lane``) saves against ``alternative`` for a ``size``-byte
        request: 0 until both are measured."""
        there = self.upstream_time(identity, alternative, size)
        here = self.upstream_time(identity, on_lane, size)
        if there is None or here is None:
            return 0.0
        return max(there - here, 0.0)


def wait_seconds(expected: float, saving: float, limit: float) -> float:
    """How long a turn waits for a lane expected to free in ``expected`` seconds when the lane
    saves ``saving`` seconds against going now: 0 (go now) unless ``expected < saving``, then
    up to :data:`LINGER` times the expected wait, never more than the saving nor ``limit``."""
    if expected >= saving or expected >= limit:
        return 0.0
    return min(expected * LINGER, saving, limit)


class WaitRule(enum.Enum):
    """Which rule set a turn's deadline."""

    BUSY = "busy"
    """For a busy lane, while it pays (:func:`wait_seconds`)."""
    BRIEF = "brief"
    """A stored turn's short wait for lanes a moment away."""
    GROW = "grow"
    """For lanes a moment away, extended while they grow, while that pays once measured."""


@dataclass(slots=True)
class Waiting:
    """One turn's wait, kept by the pool across the turn's plans and decided by the planner."""

    started: float
    """When the turn first asked for a lane."""
    deadline: float | None = None
    """Until when it waits (set by the planner's first WAIT); ``None``: it has not waited."""
    growing: bool = False
    """The wait is for lanes a moment away (a handshake, a probe): extended while they grow."""
    outcome: WaitOutcome | None = None
    """How the wait ended (``None``: no wait was considered)."""
    rule: WaitRule | None = None
    """Which rule set :attr:`deadline` (a new situation sets a deadline of its own)."""
    queued: bool = False
    """It is counted among its identity's turns waiting for a busy lane."""
    identity: str = ""
    """Whose queue it is in, or whose lanes a moment away it waits for."""
    seconds: float = 0.0
    """Seconds the turn spent before its plan was carried out (a wait, a handshake): set by the pool."""

    def waited(self, now: float) -> float:
        """Seconds waited so far."""
        return now - self.started if self.deadline is not None else 0.0
