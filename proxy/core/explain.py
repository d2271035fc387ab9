"""Explained misses: where a full-history request departed from the best candidate head.

A miss reason (``diverged``, ``settings_changed``, ...) says *that* a turn went upstream in full;
an :class:`Explanation` says *where*: the index of the first input item that differs from the
candidate head (``miss_item``), that item's type (``miss_type``), the first differing field
path inside it (``miss_field``: ``arguments``, ``content[0].text``, or a setting's name such as
``tools``), and the candidate's length. Never a value: only indices, schema names and digests.

The comparison is the matcher's own (client-echo.md §4): input items by
:func:`~proxy.core.items.item_key` (kept on the head as 8-byte digests), echoed output items by
:func:`~proxy.core.items.echo_matches`, settings field by field after rules 1-2. So an item a
client re-serialised into an equivalent form is never reported; one it changed is.

What a head keeps for this (:mod:`proxy.core.headnotes`, as the table records it):

* 8 bytes per input item: enough to find the first differing index without content;
* per output item, one 8-byte digest per projected field (``call_id``, ``name``, ``arguments``,
  ``content[i].text``, ...): enough to name the field of an echo that differs;
* per distinct settings, one 8-byte digest per top-level setting (shared by every head with
  those settings);
* the field path inside a differing *input* item needs the previous body, which the head keeps
  only while hot (:class:`~proxy.core.fastparse.RawPrefix` ``body``); after that the answer is an
  honest :attr:`Detail.FIELD_UNKNOWN`.

Pure: no I/O, no clock. :class:`~proxy.core.explainer.MissExplainer` picks the candidates.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.headnotes import (
    DIGEST,
    EchoFields,
    SettingsFields,
    echo_fields,
    item_digests,
    settings_fields,
)
from proxy.core.headnotes import field_paths as _projection
from proxy.core.headnotes import schema_name as _safe
from proxy.core.headnotes import value_digest as _d
from proxy.core.items import (
    OutputFingerprint,
    _is_reference,
    _kind,
    echo_matches,
    input_view,
    phase_dropped,
)
from proxy.reasons import MissReason, Tolerance

__all__ = [
    "DIGEST",
    "Candidate",
    "Detail",
    "EchoFields",
    "Explanation",
    "Score",
    "SettingsFields",
    "echo_fields",
    "explain_against",
    "first_field_diff",
    "first_stretch_only",
    "input_items",
    "item_digests",
    "score",
    "settings_fields",
]


class Detail(enum.StrEnum):
    """How the request departs at ``miss_item`` (``miss_detail`` in the access log)."""

    FIELD = "field"
    """A field of the item differs: ``miss_field`` names it."""
    FIELD_UNKNOWN = "field_unknown"
    """The item differs, but the candidate keeps only its digest now (its body went cold)."""
    MISSING = "missing"
    """The request ends (or skips) where the candidate has an item (truncated history)."""
    SETTING = "setting"
    """A setting differs: ``miss_field`` is its name (``tools``, ``instructions``, ...)."""
    REASONING_DROPPED = "reasoning_dropped"
    """The echo leaves out a reasoning item of the candidate's output (tolerance ``reasoning``)."""
    PHASE_DROPPED = "phase_dropped"
    """The echo sends an assistant message of the candidate's output without its ``phase``
    (``miss_field`` ``phase``; tolerance ``phase``)."""
    NO_NEW_ITEMS = "no_new_items"
    """The request is the candidate's input and output echo, with nothing new after it."""
    RETRY = "retry"
    """The request's input equals the candidate's input: the same turn again."""


@dataclass(frozen=True, slots=True)
class Explanation:
    """Where a miss departed from its best candidate head (no content, ever).

    Attributes:
        reason: The miss reason; a ``no_head`` with a candidate that agrees on later items
            becomes ``diverged`` (an edited early item), or ``settings_changed``.
        miss_item: Index of the first differing input item, or ``None`` (a setting differs,
            or no candidate).
        miss_type: That item's type (the request's item; the candidate's when missing).
        miss_field: First differing field path inside the item, or the setting's name.
        detail: A :class:`Detail`, or ``None`` without a candidate.
        candidate_items: The candidate's length: its input plus its output items.
        identity: A digest prefix of the caller's identity (set by the head table).
    """

    reason: MissReason
    miss_item: int | None = None
    miss_type: str | None = None
    miss_field: str | None = None
    detail: Detail | None = None
    candidate_items: int | None = None
    identity: str = ""

    def fields(self) -> dict[str, Any]:
        """The access-log / ``/misses`` fields."""
        return {
            "miss_item": self.miss_item,
            "miss_type": self.miss_type,
            "miss_field": self.miss_field,
            "miss_detail": self.detail.value if self.detail is not None else None,
            "candidate_items": self.candidate_items,
        }


@dataclass(frozen=True, slots=True)
class Candidate:
    """What a head offers for an explanation (built by the head table)."""

    n_input: int
    items: bytes
    """:data:`DIGEST` bytes per input item."""
    output: tuple[OutputFingerprint, ...]
    echo: tuple[EchoFields, ...]
    same_settings: bool
    settings: SettingsFields | None
    """The head's settings digests, if still known."""
    body: bytes | None = None
    """The head's request body while hot (field paths inside differing input items)."""


@dataclass(frozen=True, slots=True)
class Score:
    """How far a request agrees with a candidate, position by position."""

    agree: int
    """Positions (input and echoed output) that agree."""
    first: int | None
    """First position that differs, if any."""
    after: int
    """Positions after ``first`` that agree again: evidence of an edit, not a new conversation."""
    n_input: int
    """The candidate's input length."""

    @property
    def full_prefix(self) -> bool:
        """The request starts with the candidate's input (as far as both go)."""
        return self.first is None or self.first >= self.n_input


def _unpack(fields: EchoFields) -> list[tuple[str, bytes]]:
    paths, digests = fields
    return [(path, digests[i * DIGEST : (i + 1) * DIGEST]) for i, path in enumerate(paths)]


def _echo_field(fp: OutputFingerprint, fields: EchoFields, echo: Any) -> str | None:
    """The first field path at which ``echo`` fails to match the output item behind ``fp``."""
    if not isinstance(echo, dict):
        return None
    if _is_reference(echo):
        return "id"
    echo_id = echo.get("id")
    if echo_id is not None and echo_id != fp.id:
        return "id"
    if _kind(echo) != fp.kind:
        return "type"
    pairs = _unpack(fields)
    mine = dict(pairs)
    theirs = dict((path, _d(value)) for path, value in _projection(echo))
    for path, want in pairs:
        if path != "encrypted_content" and theirs.get(path) != want:
            return path
    for path in theirs:
        if path not in mine:
            return path
    if fp.kind == "reasoning":
        enc = echo.get("encrypted_content")
        if enc is not None and mine.get("encrypted_content") != _d(enc):
            return "encrypted_content"
        if enc is None and "encrypted_content" in mine:
            return "encrypted_content"
    return None


def first_field_diff(old: Any, new: Any, path: str = "", depth: int = 0) -> str | None:
    """The first field path at which two input items differ (after rules 1-4 and 7).

    Keys are visited in the old item's order, then keys only the new one has; list elements
    by index. A path names schema keys and indices only (odd keys show as ``?``).
    """
    if depth == 0:
        old, new = input_view(old), input_view(new)
    if old == new:
        return None
    if isinstance(old, dict) and isinstance(new, dict) and depth < 8:
        for key in [*old, *(k for k in new if k not in old)]:
            if old.get(key) != new.get(key):
                name = _safe(key) or "?"
                sub = f"{path}.{name}" if path else name
                return first_field_diff(old.get(key), new.get(key), sub, depth + 1) or sub
    if isinstance(old, list) and isinstance(new, list) and depth < 8:
        for index in range(max(len(old), len(new))):
            a = old[index] if index < len(old) else None
            b = new[index] if index < len(new) else None
            if index >= len(old) or index >= len(new) or a != b:
                sub = f"{path}[{index}]"
                return first_field_diff(a, b, sub, depth + 1) or sub
    return path or None


def input_items(body: bytes) -> list[Any] | None:
    """The input items of a request body (string input = one user message), if parseable."""
    try:
        fields = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(fields, dict):
        return None
    raw = fields.get("input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    return raw if isinstance(raw, list) else None


def _type_of(item: Any) -> str | None:
    if not isinstance(item, dict):
        return None
    return _safe(_kind(item)) or "other"


def _agreement(mine: bytes, theirs: bytes) -> tuple[int, int | None]:
    """Positions at which two digest strings (:data:`DIGEST` bytes an item, same length) agree,
    and the first at which they differ: one XOR of the two as integers, then the zero words
    counted in C (a head of 200 items costs microseconds, not a Python loop over them)."""
    if mine == theirs:
        return len(mine) // DIGEST, None
    diff = (int.from_bytes(mine, "little") ^ int.from_bytes(theirs, "little")).to_bytes(len(mine), "little")
    first = (len(diff) - len(diff.lstrip(b"\0"))) // DIGEST
    return memoryview(diff).cast("Q").tolist().count(0), first


def _input_agreement(n_input: int, inputs: bytes, mine: bytes) -> tuple[int, int | None] | None:
    """:func:`_agreement` over the positions a request (``mine``: its :func:`item_digests`) and
    a head's input (``n_input`` items, ``inputs`` their digests) share; ``None`` if the head's
    digests are shorter than its input (malformed: compare item by item)."""
    size = min(n_input, len(mine) // DIGEST) * DIGEST
    theirs = inputs[:size]
    if len(theirs) != size:
        return None
    return _agreement(mine[:size], theirs)


def first_stretch_only(n_input: int, inputs: bytes, output: Sequence[OutputFingerprint], mine: bytes) -> bool:
    """Whether :func:`score` would find that a request (``mine``: its :func:`item_digests`)
    departs from this head within the head's input and agrees nowhere after: a new
    conversation, told from the digests alone before a :class:`Candidate` is built (a first
    turn's explanation looks at hundreds of heads of a busy key). ``False`` whenever echoed
    output could still agree, or the answer needs the full score."""
    if len(mine) // DIGEST > n_input and output:
        return False
    found = _input_agreement(n_input, inputs, mine)
    return found is not None and found[1] is not None and found[0] == found[1]


def score(cand: Candidate, keys: Sequence[bytes], items: Sequence[Any], digests: bytes | None = None) -> Score:
    """Agreement of a request with ``cand``, position by position (input, then echo).

    ``digests``: :func:`item_digests` of ``keys``, when the caller scores several candidates.
    """
    n, m = cand.n_input, len(keys)
    mine = digests if digests is not None else item_digests(keys)
    found = _input_agreement(n, cand.items, mine)
    if found is not None:
        agree, first = found
        after = agree - first if first is not None else 0  # every position before first agrees
    else:  # a malformed candidate: compare what there is, item by item
        agree, first, after = 0, None, 0
        for i in range(min(n, m)):
            if mine[i * DIGEST : (i + 1) * DIGEST] == cand.items[i * DIGEST : (i + 1) * DIGEST]:
                agree += 1
                after += first is not None
            elif first is None:
                first = i
    for j, fp in enumerate(cand.output):
        position = n + j
        if position >= m:
            break
        if echo_matches(fp, items[position]) or phase_dropped(fp, items[position]):
            agree += 1
            after += first is not None
        elif first is None and fp.kind != "reasoning":
            first = position
    return Score(agree, first, after, n)


def explain_against(
    cand: Candidate,
    keys: Sequence[bytes],
    items: Sequence[Any],
    settings: SettingsFields,
    reason: MissReason,
    tolerate: frozenset[Tolerance] = frozenset(),
) -> Explanation | None:
    """Walk the request against ``cand`` as the matcher does, and say where it departs.

    Args:
        cand: The candidate head.
        keys: The request's item keys; ``items``: its input items.
        settings: :func:`settings_fields` of the request.
        reason: What to call a departure in the input items (``diverged``).
        tolerate: The tolerances in force (``matching.tolerate``): what they accept is no
            departure.

    Returns:
        The explanation, or ``None`` if the request would continue ``cand``.
    """
    length = cand.n_input + len(cand.output)

    def at(
        why: MissReason, index: int | None, kind: str | None, detail: Detail, name: str | None = None
    ) -> Explanation:
        return Explanation(why, index, kind, name, detail, length)

    if not cand.same_settings:
        name = _first_setting(cand.settings, settings) if cand.settings is not None else None
        return at(MissReason.SETTINGS_CHANGED, None, None, Detail.SETTING, name)
    n, m = cand.n_input, len(items)
    digests = cand.items
    for i in range(n):
        if i >= m:
            return at(reason, i, None, Detail.MISSING)
        if keys[i][:DIGEST] != digests[i * DIGEST : (i + 1) * DIGEST]:
            old = input_items(cand.body) if cand.body is not None else None
            if old is not None and i < len(old):
                name = first_field_diff(old[i], items[i])
                return at(reason, i, _type_of(items[i]), Detail.FIELD, name)
            return at(reason, i, _type_of(items[i]), Detail.FIELD_UNKNOWN)
    if m == n:
        kind = cand.output[0].kind if cand.output else None
        return at(MissReason.RETRY, n, kind, Detail.RETRY)
    position = n
    dropped: int | None = None
    phase_at: int | None = None
    for fp, fields in zip(cand.output, cand.echo, strict=False):
        if position < m and echo_matches(fp, items[position]):
            position += 1
        elif position < m and phase_dropped(fp, items[position]):
            if phase_at is None and Tolerance.PHASE not in tolerate:
                phase_at = position
            position += 1
        elif fp.kind == "reasoning" and Tolerance.REASONING in tolerate:
            continue
        elif fp.kind == "reasoning":
            dropped = position if dropped is None else dropped
        elif position >= m:
            return at(reason, position, fp.kind, Detail.MISSING)
        else:
            name = _echo_field(fp, fields, items[position])
            detail = Detail.FIELD if name is not None else Detail.FIELD_UNKNOWN
            return at(reason, position, _type_of(items[position]), detail, name)
    if position == m:
        return at(MissReason.NO_NEW_ITEMS, m, None, Detail.NO_NEW_ITEMS)
    if dropped is not None:
        return at(MissReason.DROPPED_REASONING, dropped, "reasoning", Detail.REASONING_DROPPED)
    if phase_at is not None:
        return at(MissReason.DROPPED_PHASE, phase_at, "message", Detail.PHASE_DROPPED, "phase")
    return None


def _first_setting(old: SettingsFields, new: SettingsFields) -> str | None:
    mine, theirs = dict(old), dict(new)
    for name, value in old:
        if theirs.get(name) != value:
            return _safe(name) or "?"
    for name in theirs:
        if name not in mine:
            return _safe(name) or "?"
    return None
