"""What refused upgrades teach: an identity's socket cap, its backoff, and hold-offs.

A 429 (or ``websocket_connection_limit_reached``) on an upgrade teaches the identity's socket
cap (:class:`SocketCap`): no upgrade before ``retry-after`` or the backoff (doubling, with the
caller's jitter), whichever is later, none above the cap but one probe every
``cap_probe_seconds`` (a raised limit is found again). A 426, 401 or 403 holds off the
identity's *new* sockets for a while (:func:`hold_off_seconds`): turns whose lane exists go on.
Nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Caps", "SocketCap", "hold_off_seconds", "is_cap_refusal"]

_HOLD_426 = 300.0
_HOLD_AUTH = 30.0
_HOLD_MAX = 300.0
_BACKOFF_BASE = 0.5
"""First backoff after a cap refusal without ``retry-after`` (doubling per refusal in a row)."""
_BACKOFF_MAX = 60.0


def is_cap_refusal(status: int | None, payload: bytes = b"") -> bool:
    """Whether a refused upgrade says the credential's socket cap is reached: HTTP 429, or a
    ``websocket_connection_limit_reached`` body (protocol.md §5.2: undocumented, so both)."""
    return status == 429 or b"websocket_connection_limit_reached" in payload


@dataclass(slots=True)
class SocketCap:
    """What an identity's refused upgrades taught (shared by the workers of one machine)."""

    limit: int | None = None
    """Sockets the upstream allows this credential (``None``: no refusal seen)."""
    until: float = 0.0
    """No upgrade before this (``retry-after``, backoff, jitter)."""
    refusals: int = 0
    """Cap refusals in a row (the backoff's exponent); a successful upgrade resets it."""
    probe_at: float = 0.0
    """When one upgrade above :attr:`limit` may try whether the limit was raised."""


def hold_off_seconds(status: int | None, headers: Mapping[str, str]) -> float:
    """How long an identity opens no new socket after its upgrade was refused with ``status``.

    426 ("use HTTP"): 5 minutes; a ``retry-after`` is honoured (at most 5 minutes); 401/403
    without it: 30 s; anything else (including a connect error, ``status=None``): nothing.
    """
    if status == 426:
        return _HOLD_426
    try:
        retry_after = float(headers.get("retry-after", ""))
    except ValueError:
        retry_after = 0.0
    if retry_after > 0:
        return min(retry_after, _HOLD_MAX)
    return _HOLD_AUTH if status in (401, 403) else 0.0


class Caps:
    """Learned socket caps and hold-offs, by identity.

    Args:
        probe_seconds: How long after a cap refusal one upgrade above the cap may probe again.
    """

    def __init__(self, probe_seconds: float) -> None:
        self.probe_seconds = probe_seconds
        self.caps: dict[str, SocketCap] = {}
        """Learned socket caps by identity."""
        self._hold_until: dict[str, float] = {}

    def held_off(self, identity: str, now: float) -> bool:
        """Whether new sockets of ``identity`` are held off after a refused upgrade (a
        ``retry-after`` or backoff of a cap refusal included)."""
        cap = self.caps.get(identity)
        if cap is not None and now < cap.until:
            return True
        until = self._hold_until.get(identity)
        if until is None:
            return False
        if now < until:
            return True
        del self._hold_until[identity]
        return False

    def allows(self, identity: str, sockets: int, connecting: int, now: float) -> bool:
        """Whether ``identity``, holding ``sockets`` (``connecting`` of them in their handshake),
        may open one more as far as its learned cap goes: below it, or as the one probe above
        it that ``probe_seconds`` allows (taken here)."""
        cap = self.caps.get(identity)
        if cap is None or cap.limit is None or sockets < cap.limit:
            return True
        if now < cap.probe_at or connecting:
            return False  # above the learned cap: one probe at a time, now and then
        cap.probe_at = now + self.probe_seconds
        return True

    def opened(self, identity: str, sockets: int) -> None:
        """An upgrade of ``identity`` succeeded, which now holds ``sockets``: the refusals in a
        row end, and a probe above the cap that got through raises the cap."""
        cap = self.caps.get(identity)
        if cap is not None:
            cap.refusals = 0
            if cap.limit is not None and sockets > cap.limit:
                cap.limit = sockets

    def refused(
        self, identity: str, now: float, status: int | None, headers: Mapping[str, str], payload: bytes
    ) -> bool:
        """An upgrade of ``identity`` was refused with ``status``; returns whether it was a cap
        refusal (which the caller then teaches with :meth:`capped`), else holds new sockets off
        as :func:`hold_off_seconds` says."""
        if is_cap_refusal(status, payload):
            return True
        hold = hold_off_seconds(status, headers)
        if hold > 0:
            self._hold_until[identity] = max(self._hold_until.get(identity, 0.0), now + hold)
        return False

    def capped(self, identity: str, open_now: int, now: float, headers: Mapping[str, str], jitter: float) -> None:
        """The upstream counts ``identity``'s sockets and refused one more: the ``open_now``
        ones are the cap (at least one), and no upgrade before ``retry-after`` or the backoff
        (stretched by up to a quarter by ``jitter``, a fraction in [0, 1), so workers do not
        retry in step)."""
        cap = self.caps.setdefault(identity, SocketCap())
        cap.limit = max(1, open_now) if cap.limit is None else max(1, min(cap.limit, max(open_now, 1)))
        try:
            retry_after = max(0.0, float(headers.get("retry-after", "")))
        except ValueError:
            retry_after = 0.0
        backoff = min(_BACKOFF_BASE * 2.0**cap.refusals, _BACKOFF_MAX)
        cap.refusals += 1
        # The upstream's retry-after exactly; our own backoff stretched by the jitter.
        cap.until = max(cap.until, now + max(retry_after, backoff * (1.0 + 0.25 * jitter)))
        cap.probe_at = max(cap.probe_at, now + self.probe_seconds)

    def learned(self, identity: str) -> int | None:
        """The socket cap learned for ``identity`` (``None``: none seen)."""
        cap = self.caps.get(identity)
        return cap.limit if cap is not None else None

    def merge(self, identity: str, shared: SocketCap) -> None:
        """Another worker's knowledge of ``identity``'s cap: the stricter of the two holds."""
        cap = self.caps.setdefault(identity, SocketCap())
        if shared.limit is not None:
            cap.limit = shared.limit if cap.limit is None else min(cap.limit, shared.limit)
        cap.until = max(cap.until, shared.until)
        cap.probe_at = max(cap.probe_at, shared.probe_at)
        cap.refusals = max(cap.refusals, shared.refusals)
