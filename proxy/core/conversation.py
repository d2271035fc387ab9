r"""Conversation heads: the index of what each conversation's latest completed turn was.

A *head* is the end state of one completed response: the app's input to it (as digests), the
upstream's output items (as fingerprints), the response id, and the lane (*anchor*, a
``(socket id, stream_id)`` key) whose cache holds it. The upstream caches only a lane's latest
response, so a lane has at most one head. Which lanes exist and whether one is free is the
planner's business, not this table's: a lookup passes over the anchors the planner says are
busy. A stored head outlives its lane (the upstream can hydrate it from any socket).

No conversation id is needed. A request continues a head when (client-echo.md §4):

1. its non-input fields equal the head's (settings digest),
2. its input starts with the head's input (prefix digest), then
3. echoes the head's output items (everything the model sees of them, :func:`~proxy.core.items.projection`;
   a left-out reasoning item or ``phase`` only with ``matching.tolerate``), then
4. carries at least one new item.

Among all heads of the caller's identity the longest match wins, so forks and parallel
sub-agents that share a prefix each keep their own chain. A request whose input *equals* a
head's input is a retry of that turn, not its successor. A head the planner cannot use now
(its lane busy) is never used (the request goes out with full input instead). Everything is
synchronous and pure; the clock is passed in.

:class:`HeadTable` matches (:meth:`~HeadTable.lookup` only reads; the planner expires first
and touches the head it continues), records and expires. Beside it: :mod:`proxy.core.heads`
(the records), :class:`~proxy.core.fastparse.PrefixCache` (the next fast parse's prefixes) and
:mod:`proxy.core.sideindex` (pruned and ``current_turn`` histories).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from proxy.core.budget import FairShares
from proxy.core.explain import item_digests
from proxy.core.fastparse import PrefixCache, kept_prefix
from proxy.core.heads import Head, Listener, Lookup, Match, Recorded, stronger
from proxy.core.items import echo_matches, fingerprint, phase_dropped, projection
from proxy.core.prefixes import KeptPrefix
from proxy.core.request import ParsedRequest
from proxy.core.sideindex import BARE_AFTER, BareIndex, CompactionIndex, bare_state, current_turn, digest_of, user_turn
from proxy.reasons import Hit, MissReason, Tolerance

__all__ = ["HeadTable", "MissReason"]


_Key = tuple[str, bytes, int, bytes]


class HeadTable:
    """Every conversation head the sidecar knows, across identities: the index.

    Args:
        max_heads: Upper bound on heads kept; the least recently used of the identity holding
            the most goes first.
        ttl_seconds: A head unused for this long is forgotten.
        tolerate: Differences the model sees that still continue (``matching.tolerate``):
            left-out reasoning items, a left-out ``phase``. Counted either way.
        allow_dropped_reasoning: Deprecated spelling of ``tolerate=[Tolerance.REASONING]``.
        hot_bytes, hot_seconds: The :class:`PrefixCache`'s bounds.
    """

    def __init__(
        self,
        *,
        max_heads: int,
        ttl_seconds: float,
        tolerate: Iterable[Tolerance] = (),
        allow_dropped_reasoning: bool = False,
        hot_bytes: int = 256 * 1024 * 1024,
        hot_seconds: float = 120.0,
    ) -> None:
        self.max_heads = max_heads
        self.prefixes = PrefixCache(hot_bytes=hot_bytes, hot_seconds=hot_seconds)
        """The raw prefixes and hot bodies of the heads' requests (told of every add and drop)."""
        self.ttl_seconds = ttl_seconds
        self.tolerate = frozenset(tolerate) | ({Tolerance.REASONING} if allow_dropped_reasoning else set())
        self._heads: OrderedDict[Hashable, Head] = OrderedDict()
        self._index: dict[_Key, list[Hashable]] = {}
        self._buckets: dict[tuple[str, bytes], dict[int, int]] = {}
        """(identity, settings) → the prefix lengths of its heads → heads with each (a plain
        dict: ``Counter``'s methods are interpreted code)."""
        self._by_response: dict[str, Hashable] = {}
        self._fair_heads = FairShares()
        """Heads by identity: at ``max_heads`` the heaviest identity's least recent goes."""
        self._compactions = CompactionIndex()
        """The heads by the compaction items of their output (a history pruned at one continues
        it: :meth:`_pruned`)."""
        self._bare = BareIndex()
        """(identity, settings) → (input items other than reasoning, their digest) → anchors, for
        the heads of ``current_turn`` requests (:meth:`_bare_lookup`)."""
        self.listener: Listener | None = None
        """Told of each head recorded from a full history, with its request (the miss
        explainer, :class:`proxy.core.explainer.MissExplainer`, which attaches itself)."""

    def __len__(self) -> int:
        return len(self._heads)

    def __repr__(self) -> str:
        return f"<HeadTable [{len(self._heads)} heads]>"

    def has(self, anchor: Hashable) -> bool:
        """Whether a head is kept under ``anchor``."""
        return anchor in self._heads

    def get(self, anchor: Hashable) -> Head | None:
        """The head kept under ``anchor``."""
        return self._heads.get(anchor)

    def head(self, anchor: Hashable) -> Head:
        """The head kept under ``anchor`` (a lookup's match names one)."""
        return self._heads[anchor]

    def recent(self, limit: int) -> Iterator[tuple[Hashable, Head]]:
        """``(anchor, head)`` of the most recently used heads first, at most ``limit``."""
        for seen, anchor in enumerate(reversed(self._heads)):
            if seen >= limit:
                return
            yield anchor, self._heads[anchor]

    # -- queries ---------------------------------------------------------------------------

    def parse(self, identity: str, body: bytes) -> ParsedRequest:
        """:meth:`PrefixCache.parse` of the heads' prefixes."""
        return self.prefixes.parse(identity, body)

    def lookup(
        self, identity: str, req: ParsedRequest, now: float, busy: AbstractSet[Hashable] = frozenset()
    ) -> Lookup:
        """Find the head ``req`` continues, or say why there is none.

        ``busy``: anchors whose heads the planner cannot continue now (their lanes are busy); a
        matching head under one is passed over and makes the miss ``head_busy``. The planner asks
        first with none, and again with the matched anchor added if it finds that one busy (the
        next best match may be usable). Only reads: the caller expires heads before
        (:meth:`expire`) and touches the head it continues (:meth:`touch`).
        """
        if req.previous_response_id is not None:
            return Lookup(None, MissReason.APP_CHAINED)
        current = current_turn(req)
        if req.base is not None and req.tail is not None:
            # A fast parse knows its head: try it first; on a miss the search below decides.
            head = self._heads.get(req.base.anchor)
            if head is not None and head.identity == identity and head.settings == req.settings_digest:
                found = self._try(head, req.tail, 0, req.base.count, busy, current)
                if isinstance(found, Lookup):
                    return found
        bucket = self._buckets.get((identity, req.settings_digest))
        reason: MissReason = MissReason.NO_HEAD
        dropped_seen = (0, 0)
        if bucket is not None:
            n_items = req.n_items
            lengths = {n for n in bucket if n <= n_items}
            digests = req.prefix_digests(lengths)
            for n in sorted(lengths, reverse=True):
                for anchor in self._index.get((identity, req.settings_digest, n, digests[n]), ()):
                    items, at, skipped = req.items_from(n)  # the fast parse's tail when it suffices
                    tried = self._try(self._heads[anchor], items, at, skipped, busy, current)
                    if isinstance(tried, Lookup):
                        return tried
                    why, dropped = tried
                    if why in (MissReason.DROPPED_REASONING, MissReason.DROPPED_PHASE):
                        dropped_seen = dropped
                    reason = stronger(reason, why)
        if reason in (MissReason.NO_HEAD, MissReason.DIVERGED) and self._compactions.holds(identity):
            pruned = self._pruned(identity, req, busy, current)
            if isinstance(pruned, Lookup):
                return pruned
            if pruned is not None:
                reason = pruned
        if current and reason in BARE_AFTER and self._bare.holds(identity, req.settings_digest):
            bare = self._bare_lookup(identity, req, busy)
            if bare is not None:
                return bare
        if reason == MissReason.NO_HEAD and self._matches_other_settings(identity, req):
            reason = MissReason.SETTINGS_CHANGED
        return Lookup(None, reason, *dropped_seen)

    def _bare_lookup(self, identity: str, req: ParsedRequest, busy: AbstractSet[Hashable]) -> Lookup | None:
        """Under ``current_turn``: a head whose input equals the request's but for reasoning items,
        continued when a user message follows the echo of its output (why: :mod:`proxy.core.sideindex`)."""
        items = req.all_items()
        found = self._bare.candidates(identity, req, items)
        for n, anchor in reversed(found):  # the longest (latest) first
            tried = self._try(self._heads[anchor], items, n, 0, busy, True, need_user=True)
            if isinstance(tried, Lookup):
                return tried
        return None

    def _pruned(
        self, identity: str, req: ParsedRequest, busy: AbstractSet[Hashable], current: bool
    ) -> Lookup | MissReason | None:
        """A history pruned at a compaction item (its first item): the head whose output holds
        that item continues it when the request echoes that output from the compaction item on.

        The model reads a context from its latest compaction item on (protocol.md §7: the item
        stands for everything before it), so the pruned history and the head's chain plus the new
        items are the same context exactly when that echo matches (docs/fidelity.md). ``None``:
        the request does not start with a compaction item.
        """
        items, at, skipped = req.items_from(0)
        first = items[at] if at < len(items) else None
        if not isinstance(first, dict) or first.get("type") != "compaction":
            return None
        anchor = self._compactions.anchor_of(identity, first)
        head = self._heads.get(anchor) if anchor is not None else None
        if head is None or head.settings != req.settings_digest:
            return MissReason.PRUNED_AT_COMPACTION
        start = next((i for i, fp in enumerate(head.output) if fp.kind == "compaction"), None)
        if start is None:
            return MissReason.PRUNED_AT_COMPACTION
        tried = self._try(head, items, at, skipped, busy, current, start)
        if isinstance(tried, Lookup):
            return tried
        why = tried[0]
        return why if why in (MissReason.HEAD_BUSY, MissReason.DROPPED_REASONING) else MissReason.PRUNED_AT_COMPACTION

    def _try(
        self,
        head: Head,
        items: Sequence[Any],
        n: int,
        skipped: int,
        busy: AbstractSet[Hashable],
        current: bool = False,
        start: int = 0,
        need_user: bool = False,
    ) -> Lookup | tuple[MissReason, tuple[int, int]]:
        """Continue ``head`` with ``items[n:]`` if its echo matches and the planner can use it.

        ``skipped`` input items precede ``items`` (a fast parse's byte-identical prefix);
        ``start``: the echo starts at this item of the head's output (a pruned history).
        ``current``: the request's ``reasoning.context`` is ``current_turn``, under which the
        model does not read reasoning of earlier user turns: left-out reasoning of the head's
        output continues when a user message follows the echo (a new user turn begins).
        ``need_user``: continue only then (the input matched but for its reasoning items).
        Returns the continuation, or ``(the miss reason, (reasoning items left out, phases
        left out))``.
        """
        found = self._continue(head, items, n, start)
        if isinstance(found, MissReason):
            return found, (0, 0)
        consumed, reasoning, phases = found
        if need_user and not user_turn(items, n + consumed):
            return MissReason.DIVERGED, (0, 0)
        if reasoning and current and user_turn(items, n + consumed):
            reasoning = 0  # not read under current_turn: no difference, no tolerance
        drops = (reasoning, phases)
        if reasoning and Tolerance.REASONING not in self.tolerate:
            return MissReason.DROPPED_REASONING, drops
        if phases and Tolerance.PHASE not in self.tolerate:
            return MissReason.DROPPED_PHASE, drops
        if head.anchor in busy:
            return MissReason.HEAD_BUSY, drops
        match = Match(head.anchor, head.response_id, list(items[n + consumed :]), skipped + n + consumed)
        return Lookup(match, Hit.CONTINUATION, *drops)

    def touch(self, anchor: Hashable, now: float) -> None:
        """The head of ``anchor`` is being continued: used now (last to expire or be evicted)."""
        head = self._heads.get(anchor)
        if head is not None:
            head.last_used = now
            self._heads.move_to_end(anchor)
            self._fair_heads.touch(anchor)

    def _continue(self, head: Head, items: Sequence[Any], n: int, start: int = 0) -> tuple[int, int, int] | MissReason:
        """Match the echo of ``head.output`` at ``items[n:]``.

        Returns ``(items consumed by the echo, reasoning items left out, messages whose
        phase was left out)``, or a miss reason.
        """
        if n == len(items):
            return MissReason.RETRY
        position = n
        dropped = phases = 0
        for fp in head.output[start:] if start else head.output:
            if position < len(items) and echo_matches(fp, items[position]):
                position += 1
            elif position < len(items) and phase_dropped(fp, items[position]):
                position += 1
                phases += 1
            elif fp.kind == "reasoning":
                dropped += 1
            else:
                return MissReason.DIVERGED
        if position == len(items):
            return MissReason.NO_NEW_ITEMS
        return position - n, dropped, phases

    def _matches_other_settings(self, identity: str, req: ParsedRequest) -> bool:
        """Whether the input extends a head of ``identity`` whose settings differ."""
        for (ident, settings), bucket in self._buckets.items():
            if ident != identity or settings == req.settings_digest:
                continue
            lengths = {n for n in bucket if n < req.n_items}
            for n, value in req.prefix_digests(lengths).items():
                if (identity, settings, n, value) in self._index:
                    return True
        return False

    def anchor_for(self, identity: str, response_id: str) -> Hashable | None:
        """The lane holding ``response_id``, if it belongs to ``identity``."""
        anchor = self._by_response.get(response_id)
        if anchor is None:
            return None
        head = self._heads.get(anchor)
        if head is None or head.identity != identity:
            return None
        return anchor

    def _item_digests(self, req: ParsedRequest) -> bytes | None:
        """The per-item digests of ``req`` for its head (8 bytes an item), cheaply.

        A fast parse extends the digests of the head whose prefix it skipped (the prefix is
        never parsed); if that head is gone, the digests are unknown (``None``).
        """
        if req.previous_response_id is not None:
            return None
        if req.base is not None and req.tail is not None:
            base = self._heads.get(req.base.anchor)
            if (
                base is None
                or base.items is None
                or base.n_input != req.base.count
                or base.input_digest != req.base.input_state.digest()[:16]
            ):
                return None
            return base.items + item_digests(req.tail_keys())
        return item_digests(req.item_keys())

    # -- updates ---------------------------------------------------------------------------

    def rename(self, anchor: Hashable, response_id: str) -> Head | None:
        """The head of ``anchor`` is now known upstream as ``response_id`` (a re-seed rebuilt
        the same context under a new id); returns it."""
        head = self._heads.get(anchor)
        if head is None:
            return None
        if self._by_response.get(head.response_id) == anchor:
            del self._by_response[head.response_id]
        head.response_id = response_id
        self._by_response[response_id] = anchor
        return head

    def rekey(self, anchor: Hashable, new: Hashable) -> Head | None:
        """Keep the head of ``anchor`` under ``new`` (its lane is taken by another
        conversation; a stored head stays continuable through the upstream's store); returns it."""
        head = self._heads.get(anchor)
        if head is None:
            return None
        prefix = self.prefixes.take(anchor)  # cooled: a rekeyed head keeps only its digest
        self.discard(anchor)
        head.anchor = new
        self._insert(head, head.last_used, prefix)
        return head

    def record(
        self,
        identity: str,
        anchor: Hashable,
        req: ParsedRequest,
        response: dict[str, Any],
        now: float,
        prefix_state: Any = None,
    ) -> Head | None:
        """``response.completed`` arrived on ``anchor`` for ``req``: it becomes the head (returned;
        ``None`` for a response without an id).

        ``prefix_state`` is :func:`~proxy.core.fastparse.hash_prefix` of a fully parsed body,
        when the caller computed it off the event loop.
        """
        digests = self._item_digests(req)  # before the swap: a fast parse extends this head's
        bare = None
        if req.previous_response_id is None and current_turn(req):
            bare = bare_state(self._heads.get(req.base.anchor) if req.base is not None else None, req)
        response_id = response.get("id")
        if not isinstance(response_id, str):
            self.discard(anchor)
            return None
        output = response.get("output")
        chained = req.previous_response_id is not None
        items = [i for i in output if isinstance(i, dict)] if isinstance(output, list) else []
        seen = [projection(i) for i in items]  # once per item: for the fingerprint and the echo fields
        fps = tuple(fingerprint(i, s) for i, s in zip(items, seen, strict=True))
        state = None
        if chained:
            head = Head(identity, anchor, response_id, req.settings_digest, 0, b"", fps, now, chained=True)
        else:
            state = req.input_state()
            input_digest = state.digest()[:16]
            head = Head(identity, anchor, response_id, req.settings_digest, req.n_items, input_digest, fps, now)
            head.items = digests
            for item in items:
                if item.get("type") == "compaction" and isinstance(item.get("encrypted_content"), str):
                    head.compactions += (digest_of(item["encrypted_content"]),)
        head.store = req.store
        head.bare = bare
        self._insert(head, now, Recorded(req, state, prefix_state, items, seen))
        return head

    def _insert(self, head: Head, now: float, source: Recorded | KeptPrefix | None = None) -> None:
        """Index ``head`` under ``head.anchor`` in place of the head there (the lane's previous
        head, usually the one continued), in one step: its prefix and fair share replace the old
        head's, the listener hears of the old head let go, then of the new one. ``source``: what
        a recorded head came from, or the prefix a rekeyed head takes along."""
        anchor = head.anchor
        old = self._heads.pop(anchor, None)
        if old is not None:
            self._unindex(old, anchor)
        self._heads[anchor] = head
        self._by_response[head.response_id] = anchor
        if head.compactions:
            self._compactions.add(head)
        if head.bare is not None:
            self._bare.add(head)
        if not head.chained:
            self._index.setdefault(self._key(head), []).append(anchor)
            bucket_key = (head.identity, head.settings)
            bucket = self._buckets.get(bucket_key)
            if bucket is None:  # (not setdefault: that builds a bucket on every insert)
                bucket = self._buckets[bucket_key] = {}
            bucket[head.n_input] = bucket.get(head.n_input, 0) + 1
            if isinstance(source, Recorded):
                prefix = kept_prefix(head.identity, source.req, source.state, source.prefix_state)
            else:
                prefix = source
            self.prefixes.replace(anchor, prefix, now)  # the old head's, if any, goes with it
        elif old is not None and not old.chained:
            self.prefixes.take(anchor)
        self._fair_heads.add(head.identity, anchor)  # the old head's share (same anchor) moves
        if self.listener is not None:
            if old is not None and not old.chained:
                self.listener.discarded(old)
            if isinstance(source, Recorded) and not head.chained:
                self.listener.recorded(head, source)
        while len(self._heads) > self.max_heads:
            self.discard(self._fair_heads.victim() or next(iter(self._heads)))

    def _unindex(self, head: Head, anchor: Hashable) -> None:
        """Remove ``head`` (no longer in :attr:`_heads`) from the indexes; its prefix and fair
        share are the caller's."""
        if self._by_response.get(head.response_id) == anchor:
            del self._by_response[head.response_id]
        if head.compactions:
            self._compactions.remove(head, anchor)
        if head.bare is not None:
            self._bare.remove(head, anchor)
        if head.chained:
            return
        key = self._key(head)
        anchors = self._index.get(key)
        if anchors is not None:
            anchors.remove(anchor)
            if not anchors:
                del self._index[key]
        bucket_key = (head.identity, head.settings)
        bucket = self._buckets[bucket_key]
        left = bucket[head.n_input] - 1
        if left > 0:
            bucket[head.n_input] = left
        else:
            del bucket[head.n_input]
        if not bucket:
            del self._buckets[bucket_key]

    def discard(self, anchor: Hashable) -> None:
        """Forget the head of ``anchor`` (socket closed, reconnected or turn not completed)."""
        head = self._heads.pop(anchor, None)
        if head is None:
            return
        if not head.chained:
            self.prefixes.take(anchor)  # its prefix and hot body first: their memory is free at once
        self._fair_heads.remove(anchor)
        self._unindex(head, anchor)
        if self.listener is not None and not head.chained:
            self.listener.discarded(head)

    def expire(self, now: float) -> list[Hashable]:
        """Drop heads unused for ``ttl_seconds`` and bodies older than the cache's
        ``hot_seconds``; returns the anchors of the heads dropped."""
        self.prefixes.expire(now)
        gone = []
        for anchor, head in self._heads.items():
            if now - head.last_used < self.ttl_seconds:
                break
            gone.append(anchor)
        for anchor in gone:
            self.discard(anchor)
        return gone

    @staticmethod
    def _key(head: Head) -> _Key:
        return (head.identity, head.settings, head.n_input, head.input_digest)
