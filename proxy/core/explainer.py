"""The miss explainer: where a missed request departs from the best of the recent heads.

:class:`MissExplainer` reads the :class:`~proxy.core.conversation.HeadTable` (its most recent
heads, their kept bodies while hot, its tolerances) and the notes the table keeps for it
(:class:`~proxy.core.headnotes.HeadNotes`: per-setting digests, where each head's input
ends). The comparison itself is :mod:`proxy.core.explain`'s. Only ever called on a miss, never
on the continuation path; nothing of the request's content is returned. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

from proxy.core.conversation import HeadTable
from proxy.core.explain import (
    DIGEST,
    Candidate,
    Explanation,
    explain_against,
    first_stretch_only,
    item_digests,
    score,
    settings_fields,
)
from proxy.core.headnotes import HeadNotes
from proxy.core.heads import Head
from proxy.core.request import ParsedRequest
from proxy.reasons import MissReason, Reason

__all__ = ["MissExplainer"]

_EXPLAINED = frozenset(
    {
        MissReason.NO_HEAD,
        MissReason.DIVERGED,
        MissReason.SETTINGS_CHANGED,
        MissReason.DROPPED_REASONING,
        MissReason.DROPPED_PHASE,
        MissReason.RETRY,
        MissReason.NO_NEW_ITEMS,
    }
)
"""Miss reasons :meth:`MissExplainer.explain` explains (the others are not about the input)."""


class MissExplainer:
    """Explains the misses of one head table.

    Built before the table records heads: its :class:`~proxy.core.headnotes.HeadNotes` are the
    table's listener (:attr:`HeadTable.listener <proxy.core.conversation.HeadTable.listener>`),
    told of every head recorded from a full history and let go; it reads them on a miss.

    Args:
        heads: The head table whose misses are explained.
    """

    EXPLAIN_CANDIDATES = 8
    """Most candidate heads compared position by position to explain a miss."""
    EXPLAIN_SCAN = 16
    """Most recent heads looked at (of any identity) when the miss happens (with their kept
    bodies: the head the request's own answer replaces is among them)."""
    EXPLAIN_REACH = 512
    """Request positions looked up in that index per miss (the last ones): bounded cost."""
    EXPLAIN_PARSE_BYTES = 4 * 1024 * 1024
    """Largest kept body parsed to explain a miss (one per miss; beyond it the digests say
    which item differs, not which field)."""

    def __init__(self, heads: HeadTable) -> None:
        self.heads = heads
        self.notes = HeadNotes()
        """What the table tells of the heads it records and lets go (its listener)."""
        heads.listener = self.notes

    def __repr__(self) -> str:
        return f"<MissExplainer [{len(self.notes.settings_fields)} settings]>"

    def explain(self, identity: str, req: ParsedRequest, reason: Reason | None) -> Explanation | None:
        """Say where a missed request departs from its best candidate head, or ``None``.

        ``reason`` is the :meth:`~proxy.core.conversation.HeadTable.lookup` verdict. A
        ``no_head`` whose request agrees with a recent head of ``identity`` on items after the
        first differing one (an edited early item: a timestamp in the system prompt, an edited
        first message) is explained as ``diverged`` at that item.
        """
        later = self.explain_later(identity, req, reason)
        return later() if later is not None else None

    def explain_later(
        self, identity: str, req: ParsedRequest, reason: Reason | None
    ) -> Callable[[], Explanation | None] | None:
        """:meth:`explain` in two steps: the few most recent heads of ``identity`` are taken
        now (no comparison: cheap), and compared when the returned callable runs, after the
        answer, off the request's path, with the heads of ``identity`` whose input ends where
        the request has the same item (found by digest, not by a scan: a busy key's hundreds of
        heads cost a lookup per request position). Heads recorded in between (this request's
        own among them) are not candidates, and a recent head this request replaces still is
        (with its raw prefix, which a replaced head gives up).
        """
        if req.previous_response_id is not None or not isinstance(reason, MissReason) or reason not in _EXPLAINED:
            return None
        heads: list[tuple[Head, bytes | None]] = []
        for anchor, head in self.heads.recent(self.EXPLAIN_SCAN):
            if head.identity == identity and not head.chained and head.items is not None:
                heads.append((head, self.heads.prefixes.body(anchor)))
        return partial(self._explain, identity, req, reason, heads, self.notes.serial)

    def _ending_like(self, identity: str, mine: bytes, before: int, taken: list[tuple[Head, bytes | None]]) -> None:
        """Add to ``taken`` the heads of ``identity`` in the table, recorded by serial
        ``before``, whose last input item is the request's item at the same position (``mine``:
        its digests), the longest first."""
        seen = {id(head) for head, _ in taken}
        m = len(mine) // DIGEST
        for n in range(m, max(0, m - self.EXPLAIN_REACH), -1):
            entry = self.notes.ends.get((identity, n, mine[(n - 1) * DIGEST : n * DIGEST]))
            if entry is None or entry[0] > before:
                continue
            _, anchor, response_id = entry
            head = self.heads.get(anchor)
            if head is not None and head.response_id == response_id and id(head) not in seen:
                seen.add(id(head))
                taken.append((head, self.heads.prefixes.body(anchor)))

    def _explain(
        self,
        identity: str,
        req: ParsedRequest,
        reason: MissReason,
        heads: list[tuple[Head, bytes | None]],
        before: int,
    ) -> Explanation | None:
        keys, items = req.item_keys(), req.all_items()
        mine = item_digests(keys)
        heads = list(heads)
        self._ending_like(identity, mine, before, heads)
        found: list[tuple[tuple[int, int, int], Candidate, int]] = []
        for head, body in heads:
            if len(found) >= self.EXPLAIN_CANDIDATES:
                break
            if head.items is None or first_stretch_only(head.n_input, head.items, head.output, mine):
                continue
            cand = Candidate(
                n_input=head.n_input,
                items=head.items,
                output=head.output,
                echo=head.echo,
                same_settings=head.settings == req.settings_digest,
                settings=self.notes.settings_fields.get(head.settings),
                body=body,
            )
            sc = score(cand, keys, items, mine)
            if sc.agree == 0 or not (sc.full_prefix or sc.after):
                continue  # shares nothing, or only a first stretch: a new conversation
            if reason == MissReason.SETTINGS_CHANGED and cand.same_settings:
                continue
            # Same settings first, then full prefix agreement, then most agreement.
            found.append(((int(cand.same_settings), int(sc.full_prefix), sc.agree), cand, sc.after))
        prefix = identity[:8]
        results = []
        # The request's per-setting digests, only with a candidate to compare them with (most
        # first turns have none): from the table when a head has the same settings.
        wanted = (self.notes.settings_fields.get(req.settings_digest) or settings_fields(req.fields)) if found else ()
        parse_left = self.EXPLAIN_PARSE_BYTES
        for _, cand, after in sorted(found, key=lambda f: f[0], reverse=True):
            if cand.body is not None:
                # digests decide first; at most one kept body, of bounded size, is
                # parsed (for the field path inside a differing item), never eight of them.
                if len(cand.body) > parse_left:
                    cand = replace(cand, body=None)
                else:
                    parse_left = 0
            explanation = explain_against(cand, keys, items, wanted, MissReason.DIVERGED, self.heads.tolerate)
            if explanation is None:
                continue
            if reason == MissReason.NO_HEAD and explanation.reason == MissReason.DIVERGED and not after:
                # A new conversation that starts like a known one (the same task again): where
                # it departs is worth showing, but only an edit (agreement after the first
                # difference) makes it a divergence.
                explanation = replace(explanation, reason=MissReason.NO_HEAD)
            results.append(explanation)
        # The candidate that explains the matcher's own verdict; only a no_head may become
        # another reason (an edit the prefix index cannot see). A verdict no recent candidate
        # explains (its head is beyond the bounded scan) stays as it is, unexplained.
        fallback = results[0] if results and reason == MissReason.NO_HEAD else None
        best = next((e for e in results if e.reason == reason), fallback)
        return _with_identity(best, prefix) if best is not None else Explanation(reason, identity=prefix)


def _with_identity(explanation: Explanation, identity: str) -> Explanation:
    return replace(explanation, identity=identity)
