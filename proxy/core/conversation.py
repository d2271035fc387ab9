"""Conversation heads: which upstream socket can continue which conversation.

A *head* is the end state of one completed response: the app's input to it (as digests), the
upstream's output items (as fingerprints), the response id, and the socket (*anchor*) whose
default lane caches it. The upstream caches only a lane's latest response, so a socket has at
most one head, and a head never outlives its socket.

No conversation id is needed. A request continues a head when (client-echo.md §4):

1. its non-input fields equal the head's (settings digest),
2. its input starts with the head's input (prefix digest), then
3. echoes the head's output items (per-type projection), then
4. carries at least one new item.

Among all heads of the caller's identity the longest match wins, so forks and parallel
sub-agents that share a prefix each keep their own chain. A request whose input *equals* a
head's input is a retry of that turn, not its successor. A head whose socket is busy is never
used (the request goes out with full input instead). Everything is synchronous and pure; the
clock is passed in.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.core.fastparse import PROBE, RawPrefix, fast_parse, raw_prefix
from proxy.core.items import OutputFingerprint, echo_matches, fingerprint
from proxy.core.request import ParsedRequest, parse_request

__all__ = ["Head", "HeadTable", "Lookup", "Match", "MissReason"]


class MissReason:
    """Why a request went upstream with its full input (metric label values)."""

    NO_HEAD = "no_head"
    DIVERGED = "diverged"
    SETTINGS_CHANGED = "settings_changed"
    HEAD_BUSY = "head_busy"
    DROPPED_REASONING = "dropped_reasoning"
    RETRY = "retry"
    NO_NEW_ITEMS = "no_new_items"
    APP_CHAINED = "app_chained"


@dataclass(slots=True)
class Head:
    """The end state of one completed response on one socket."""

    identity: str
    anchor: Hashable
    response_id: str
    settings: bytes
    n_input: int
    input_digest: bytes
    output: tuple[OutputFingerprint, ...]
    last_used: float
    input_state: Any = None
    """SHA-256 state over the input item keys (extended, not recomputed, next turn)."""
    raw: RawPrefix | None = None
    """Byte-level facts about the request body, for the next turn's fast parse."""
    busy: bool = False
    chained: bool = False
    """The app chained this turn itself (``previous_response_id``): its input is a delta, so
    the head serves only :meth:`HeadTable.anchor_for`, never full-history matching."""


@dataclass(frozen=True, slots=True)
class Match:
    """A continuation: send ``new_items`` with ``previous_response_id=response_id`` on ``anchor``."""

    anchor: Hashable
    response_id: str
    new_items: list[Any]
    items_avoided: int


@dataclass(frozen=True, slots=True)
class Lookup:
    """The outcome of :meth:`HeadTable.lookup`."""

    match: Match | None
    reason: str
    """``continuation`` or a :class:`MissReason` value."""
    dropped_reasoning: int = 0
    """Reasoning items of the head's output that the echo left out."""


_Key = tuple[str, bytes, int, bytes]


@dataclass(slots=True)
class _Bucket:
    """Prefix lengths present among the heads of one (identity, settings)."""

    lengths: Counter[int] = field(default_factory=Counter)


class HeadTable:
    """Every conversation head the sidecar knows, across identities.

    Args:
        max_heads: Upper bound on heads kept; the least recently used goes first.
        ttl_seconds: A head unused for this long is forgotten.
        allow_dropped_reasoning: Accept echoes that leave out reasoning items.
        hot_bytes: Request bodies kept for the byte comparison of the next turn's prefix,
            in total (least recently recorded dropped first).
        hot_seconds: A body is dropped this long after its turn (the head then verifies the
            next prefix with its digest: slower, same answer).
    """

    def __init__(
        self,
        *,
        max_heads: int,
        ttl_seconds: float,
        allow_dropped_reasoning: bool = False,
        hot_bytes: int = 256 * 1024 * 1024,
        hot_seconds: float = 120.0,
    ) -> None:
        self.max_heads = max_heads
        self.hot_bytes = hot_bytes
        self.hot_seconds = hot_seconds
        self._hot: OrderedDict[Hashable, float] = OrderedDict()
        self._hot_size = 0
        self.ttl_seconds = ttl_seconds
        self.allow_dropped_reasoning = allow_dropped_reasoning
        self._heads: OrderedDict[Hashable, Head] = OrderedDict()
        self._index: dict[_Key, list[Hashable]] = {}
        self._buckets: dict[tuple[str, bytes], _Bucket] = {}
        self._by_response: dict[str, Hashable] = {}
        self._raw: dict[str, dict[int, dict[bytes, list[Hashable]]]] = {}
        self._owners: OrderedDict[str, str] = OrderedDict()
        self.max_owners = max(4 * max_heads, 1024)
        """Response ids remembered with their identity (LRU), for :meth:`owner_of`."""

    def __len__(self) -> int:
        return len(self._heads)

    def __repr__(self) -> str:
        busy = sum(1 for h in self._heads.values() if h.busy)
        return f"<HeadTable [{len(self._heads)} heads, {busy} busy]>"

    # -- queries ---------------------------------------------------------------------------

    def parse(self, identity: str, body: bytes) -> ParsedRequest:
        """Parse ``body``, skipping the prefix a head of ``identity`` already holds.

        Clients re-send their previous body byte for byte up to the end of its input
        (client-echo.md §1.2). When a head's prefix digest matches, only the bytes after it
        are parsed; otherwise (or on any doubt) the whole body is.

        Raises:
            InvalidRequest: as :func:`~proxy.core.request.parse_request`.
        """
        by_length = self._raw.get(identity)
        if by_length:
            size = len(body)
            # Longest prefix first: it is the most recent turn of the conversation.
            for length in sorted(by_length, reverse=True):
                if length >= size:
                    continue
                for anchor in by_length[length].get(body[length - PROBE : length], ()):
                    head = self._heads[anchor]
                    if head.raw is None or not head.raw.starts(body):
                        continue
                    fast = fast_parse(head.raw, anchor, head.n_input, head.input_state, body)
                    if fast is not None:
                        return fast
        return parse_request(body)

    def lookup(
        self,
        identity: str,
        req: ParsedRequest,
        now: float,
        is_idle: Callable[[Hashable], bool],
    ) -> Lookup:
        """Find the head ``req`` continues, or say why there is none."""
        if req.previous_response_id is not None:
            return Lookup(None, MissReason.APP_CHAINED)
        self.expire(now)
        if req.base is not None and req.tail is not None:
            # A fast parse knows its head: try it first; on a miss the search below decides.
            head = self._heads.get(req.base.anchor)
            if head is not None and head.identity == identity and head.settings == req.settings_digest:
                found, _, _ = self._try(head, req.tail, 0, req.base.count, now, is_idle)
                if found is not None:
                    return found
        bucket = self._buckets.get((identity, req.settings_digest))
        reason = MissReason.NO_HEAD
        dropped_seen = 0
        if bucket is not None:
            n_items = req.n_items
            lengths = {n for n in bucket.lengths if n <= n_items}
            digests = req.prefix_digests(lengths)
            for n in sorted(lengths, reverse=True):
                for anchor in self._index.get((identity, req.settings_digest, n, digests[n]), ()):
                    items, at, skipped = req.items_from(n)  # the fast parse's tail when it suffices
                    found, why, dropped = self._try(self._heads[anchor], items, at, skipped, now, is_idle)
                    if found is not None:
                        return found
                    if why == MissReason.DROPPED_REASONING:
                        dropped_seen = dropped
                    reason = _stronger(reason, why)
        if reason == MissReason.NO_HEAD and self._matches_other_settings(identity, req):
            reason = MissReason.SETTINGS_CHANGED
        return Lookup(None, reason, dropped_seen)

    def _try(
        self,
        head: Head,
        items: Sequence[Any],
        n: int,
        skipped: int,
        now: float,
        is_idle: Callable[[Hashable], bool],
    ) -> tuple[Lookup | None, str, int]:
        """Continue ``head`` with ``items[n:]`` if its echo matches and its socket is idle.

        ``skipped`` input items precede ``items`` (a fast parse's byte-identical prefix).
        Returns ``(the continuation, or None; the miss reason; reasoning items dropped)``.
        """
        found = self._continue(head, items, n)
        if isinstance(found, str):
            return None, found, 0
        consumed, dropped = found
        if dropped and not self.allow_dropped_reasoning:
            return None, MissReason.DROPPED_REASONING, dropped
        if head.busy or not is_idle(head.anchor):
            return None, MissReason.HEAD_BUSY, dropped
        head.last_used = now
        self._heads.move_to_end(head.anchor)
        match = Match(head.anchor, head.response_id, list(items[n + consumed :]), skipped + n + consumed)
        return Lookup(match, "continuation", dropped), "continuation", dropped

    def _continue(self, head: Head, items: Sequence[Any], n: int) -> tuple[int, int] | str:
        """Match the echo of ``head.output`` at ``items[n:]``.

        Returns ``(items consumed by the echo, reasoning items dropped)``, or a miss reason.
        """
        if n == len(items):
            return MissReason.RETRY
        position = n
        dropped = 0
        for fp in head.output:
            if position < len(items) and echo_matches(fp, items[position]):
                position += 1
            elif fp.kind == "reasoning":
                dropped += 1
            else:
                return MissReason.DIVERGED
        if position == len(items):
            return MissReason.NO_NEW_ITEMS
        return position - n, dropped

    def _matches_other_settings(self, identity: str, req: ParsedRequest) -> bool:
        """Whether the input extends a head of ``identity`` whose settings differ."""
        for (ident, settings), bucket in self._buckets.items():
            if ident != identity or settings == req.settings_digest:
                continue
            lengths = {n for n in bucket.lengths if n < req.n_items}
            for n, value in req.prefix_digests(lengths).items():
                if (identity, settings, n, value) in self._index:
                    return True
        return False

    def note_owner(self, identity: str, response_id: str) -> None:
        """Remember that ``identity`` created ``response_id`` (bounded, least recent first out)."""
        self._owners[response_id] = identity
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.max_owners:
            self._owners.popitem(last=False)

    def owner_of(self, response_id: str) -> str | None:
        """The identity that created ``response_id`` through this sidecar, if remembered."""
        return self._owners.get(response_id)

    def anchor_for(self, identity: str, response_id: str) -> Hashable | None:
        """The socket holding ``response_id``, if it belongs to ``identity`` and is not busy."""
        anchor = self._by_response.get(response_id)
        if anchor is None:
            return None
        head = self._heads.get(anchor)
        if head is None or head.identity != identity or head.busy:
            return None
        return anchor

    # -- updates ---------------------------------------------------------------------------

    def begin(self, anchor: Hashable) -> None:
        """A create is about to go out on ``anchor``: its head can no longer be continued."""
        head = self._heads.get(anchor)
        if head is not None:
            head.busy = True

    def record(
        self,
        identity: str,
        anchor: Hashable,
        req: ParsedRequest,
        response: dict[str, Any],
        now: float,
        prefix_state: Any = None,
    ) -> None:
        """``response.completed`` arrived on ``anchor`` for ``req``: it becomes the head.

        ``prefix_state`` is :func:`~proxy.core.fastparse.hash_prefix` of a fully parsed body,
        when the caller computed it off the event loop.
        """
        self.discard(anchor)
        response_id = response.get("id")
        if not isinstance(response_id, str):
            return
        output = response.get("output")
        chained = req.previous_response_id is not None
        fps = tuple(fingerprint(i) for i in output if isinstance(i, dict)) if isinstance(output, list) else ()
        if chained:
            head = Head(identity, anchor, response_id, req.settings_digest, 0, b"", fps, now, chained=True)
        else:
            state = req.input_state()
            head = Head(
                identity=identity,
                anchor=anchor,
                response_id=response_id,
                settings=req.settings_digest,
                n_input=req.n_items,
                input_digest=state.digest()[:16],
                output=fps,
                last_used=now,
                input_state=state,
                raw=raw_prefix(req, prefix_state),
            )
        self._heads[anchor] = head
        self._by_response[response_id] = anchor
        self.note_owner(identity, response_id)
        if not chained:
            self._index.setdefault(self._key(head), []).append(anchor)
            bucket = self._buckets.setdefault((identity, head.settings), _Bucket())
            bucket.lengths[head.n_input] += 1
            if head.raw is not None:
                probes = self._raw.setdefault(identity, {}).setdefault(head.raw.length, {})
                probes.setdefault(head.raw.probe, []).append(anchor)
                if head.raw.body is not None:
                    self._hot[anchor] = now
                    self._hot_size += len(head.raw.body)
                    while self._hot_size > self.hot_bytes and self._hot:
                        self._cool(next(iter(self._hot)))
        while len(self._heads) > self.max_heads:
            self.discard(next(iter(self._heads)))

    def discard(self, anchor: Hashable) -> None:
        """Forget the head of ``anchor`` (socket closed, reconnected or turn not completed)."""
        head = self._heads.pop(anchor, None)
        if head is None:
            return
        if self._by_response.get(head.response_id) == anchor:
            del self._by_response[head.response_id]
        if head.chained:
            return
        if head.raw is not None:
            self._cool(anchor, head)
            by_length = self._raw[head.identity]
            probes = by_length[head.raw.length]
            probes[head.raw.probe].remove(anchor)
            if not probes[head.raw.probe]:
                del probes[head.raw.probe]
                if not probes:
                    del by_length[head.raw.length]
                    if not by_length:
                        del self._raw[head.identity]
        key = self._key(head)
        anchors = self._index.get(key)
        if anchors is not None:
            anchors.remove(anchor)
            if not anchors:
                del self._index[key]
        bucket_key = (head.identity, head.settings)
        bucket = self._buckets[bucket_key]
        bucket.lengths[head.n_input] -= 1
        if bucket.lengths[head.n_input] <= 0:
            del bucket.lengths[head.n_input]
        if not bucket.lengths:
            del self._buckets[bucket_key]

    def _cool(self, anchor: Hashable, head: Head | None = None) -> None:
        """Let go of the body a head keeps for the byte comparison (the digest stays)."""
        if self._hot.pop(anchor, None) is None:
            return
        head = head or self._heads.get(anchor)
        if head is not None and head.raw is not None and head.raw.body is not None:
            self._hot_size -= len(head.raw.body)
            head.raw.body = None

    def expire(self, now: float) -> list[Hashable]:
        """Drop heads unused for ``ttl_seconds`` and bodies older than ``hot_seconds``;
        returns the anchors of the heads dropped."""
        while self._hot:
            anchor, since = next(iter(self._hot.items()))
            if now - since < self.hot_seconds:
                break
            self._cool(anchor)
        gone = []
        for anchor, head in self._heads.items():
            if now - head.last_used < self.ttl_seconds:
                break
            if not head.busy:
                gone.append(anchor)
        for anchor in gone:
            self.discard(anchor)
        return gone

    @staticmethod
    def _key(head: Head) -> _Key:
        return (head.identity, head.settings, head.n_input, head.input_digest)


_STRENGTH = {
    MissReason.NO_HEAD: 0,
    MissReason.DIVERGED: 1,
    MissReason.NO_NEW_ITEMS: 2,
    MissReason.RETRY: 3,
    MissReason.DROPPED_REASONING: 4,
    MissReason.HEAD_BUSY: 5,
}


def _stronger(current: str, candidate: str) -> str:
    """The more specific of two miss reasons (the one closest to a continuation)."""
    return candidate if _STRENGTH.get(candidate, 0) > _STRENGTH.get(current, 0) else current
