"""The fast parse: read only the bytes after the history prefix the previous turn sent.

Clients re-send their previous body byte for byte up to the end of its input (client-echo.md
§1.2). A head keeps where that prefix ends (:class:`RawPrefix`); a new body that starts with
the same bytes is parsed from there on only, and :func:`fast_parse` returns ``None`` whenever
the shortcut is not certain to agree with a full parse.

The prefix is verified with a byte comparison while the previous body is still held (a *hot*
head: a conversation in the middle of its agent loop), otherwise with a SHA-256 digest, whose
state is carried from turn to turn so each turn hashes only its own new bytes. The members
around the input array are processed once and shared while later bodies carry the same bytes
there (:func:`settings_block`); the records kept between turns are in :mod:`proxy.core.prefixes`.

:class:`PrefixCache` keeps those prefixes, one per recorded head (told what to add and forget by
:class:`~proxy.core.conversation.HeadTable`), and the hot bodies among them while memory allows
(asking its :class:`Keeper`, the memory budget): it finds the prefix a new body starts with and
hands it to :func:`fast_parse`. It is the only part of the head index that holds request bytes.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import orjson

from proxy.core.budget import FairShares
from proxy.core.fields import validate_fields, validate_items
from proxy.core.prefixes import Base, Keeper, KeptPrefix, RawPrefix, SettingsBlock, prefix_digest
from proxy.core.rawjson import InputSpan, blank_back, blank_forward, locate_input, parse_object_part
from proxy.core.request import ParsedRequest, has_huge_float, make_request, parse_request

__all__ = [
    "PROBE",
    "PrefixCache",
    "fast_parse",
    "hash_prefix",
    "kept_prefix",
    "prefix_length",
    "raw_prefix",
    "settings_block",
]

PROBE = 32
"""Bytes just before a prefix's end that index it (they hold the newest input item)."""


_BLOCKS: dict[tuple[bytes, bytes, bytes], SettingsBlock] = {}
"""Shared blocks by (settings digest, hashes of the bytes before and after the input array)."""
_MAX_BLOCKS = 256
"""Distinct settings blocks kept (oldest first out): apps have a handful of agent configurations."""


def settings_block(req: ParsedRequest) -> SettingsBlock | None:
    """The block of ``req`` (its fast parse's, or the shared one for the same settings bytes);
    ``None`` without a located input array."""
    if req.settings is not None:
        return req.settings
    span = req.span
    if span is None or "input" not in req.fields:
        return None
    body = memoryview(req.body)
    key = (
        req.settings_digest,
        hashlib.blake2b(body[: span.key]).digest(),
        hashlib.blake2b(body[span.end :]).digest(),
    )
    block = _BLOCKS.get(key)
    if block is not None:
        return block
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    side = before
    for name, value in req.fields.items():
        if name == "input":
            side = after
        else:
            side[name] = value
    huge = has_huge_float(list(before.values())) or has_huge_float(list(after.values()))
    block = SettingsBlock(before, after, req.settings_digest, huge)
    if len(_BLOCKS) >= _MAX_BLOCKS:
        del _BLOCKS[next(iter(_BLOCKS))]
    _BLOCKS[key] = block
    return block


def prefix_length(req: ParsedRequest) -> int | None:
    """Where the next turn's byte-identical prefix of ``req.body`` ends, if known."""
    span = req.span
    if span is None:
        return None
    body = req.body
    # The prefix ends right after the last item, before any blank before "]": the next
    # turn writes "," there (pretty-printed bodies differ in the blanks that follow).
    length = blank_back(body, span.end - 1) + 1  # stops at the "[" at span.start at the latest
    if length <= span.start + 1 or length < PROBE:
        return None
    return length


def hash_prefix(body: bytes, length: int) -> Any:
    """SHA-256 state of ``body[:length]`` (hashlib releases the GIL: fine in a worker thread)."""
    return hashlib.sha256(memoryview(body)[:length])


def raw_prefix(req: ParsedRequest, state: Any = None) -> RawPrefix | None:
    """The byte-level facts a head keeps about its request body (``None`` if unknown).

    Args:
        req: The request the head is recorded for.
        state: ``hash_prefix(req.body, prefix_length(req))`` if already computed elsewhere.
    """
    length = prefix_length(req)
    if length is None or req.span is None:
        return None
    body = req.body
    if req.base is not None:
        state = req.base.raw_state.copy()
        state.update(memoryview(body)[req.base.raw_len : length])
    elif state is None:
        state = hash_prefix(body, length)
    block = settings_block(req)
    suffix = len(body) - req.span.end - 1
    return RawPrefix(length, body[length - PROBE : length], state.digest()[:16], state, req.span, body, block, suffix)


def kept_prefix(identity: str, req: ParsedRequest, state: Any, prefix_state: Any = None) -> KeptPrefix | None:
    """What the cache keeps of the request a head of ``identity`` is recorded from (``state``:
    the hash state of its input; ``prefix_state`` as :func:`raw_prefix`'s), or ``None``."""
    raw = raw_prefix(req, prefix_state)
    return KeptPrefix(identity, raw, req.n_items, state) if raw is not None else None


def fast_parse(raw: RawPrefix, anchor: Hashable, n_input: int, input_state: Any, body: bytes) -> ParsedRequest | None:
    """Parse ``body`` knowing it starts with ``raw``'s prefix (``n_input`` items).

    Returns ``None`` whenever the shortcut is not certain to agree with a full parse; the
    caller then parses the whole body.
    """
    length = raw.length
    i = blank_forward(body, length)
    if i >= len(body):
        return None
    if raw.settings is not None and raw.body is not None:
        found = _same_settings(raw, raw.settings, raw.body, anchor, n_input, input_state, body, i)
        if found is not None:
            return found
    prefix = b'{"input":['
    if body[i] == ord(","):
        j = blank_forward(body, i + 1)
        if j < len(body) and body[j] == ord("]"):
            return None  # "[a, ]" is invalid JSON; "[" + "]" would not be.
        source = prefix + body[i + 1 :]
        shift = (i + 1) - len(prefix)
    elif body[i] == ord("]"):
        source = prefix + body[i:]
        shift = i - len(prefix)
    else:
        return None
    try:
        tail_fields = orjson.loads(source)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(tail_fields, dict):
        return None
    tail = tail_fields.pop("input")
    # The members before "input" are byte-identical to last turn's; parse just those.
    begin = blank_forward(body, 0)
    end = blank_back(body, raw.span.key - 1)
    if end == begin:
        before: dict[str, Any] | None = {}
    elif body[end] == ord(","):
        before = parse_object_part(body[begin + 1 : end])
    else:
        return None
    if before is None or "input" in before or not isinstance(tail, list):
        return None
    tail_span = locate_input(source, {"input": tail, **tail_fields})
    if tail_span is None:
        return None
    # A second top-level "input" after ours would win in a full parse: then the bytes up to
    # the located end are not one array equal to ``tail``.
    try:
        if orjson.loads(source[tail_span.start : tail_span.end + 1]) != tail:
            return None
    except orjson.JSONDecodeError:
        return None
    fields: dict[str, Any] = {**before, "input": tail, **tail_fields}
    validate_fields(fields)
    validate_items(tail, n_input)
    return make_request(
        body,
        fields,
        InputSpan(raw.span.key, raw.span.start, tail_span.end + shift),
        base=Base(anchor, n_input, input_state.copy(), raw.state.copy(), length),
        tail=tail,
    )


def _same_settings(
    raw: RawPrefix,
    block: SettingsBlock,
    previous: bytes,
    anchor: Hashable,
    n_input: int,
    input_state: Any,
    body: bytes,
    i: int,
) -> ParsedRequest | None:
    """The hot path: ``body`` ends with the previous body's bytes after its input array, so only
    the new items between the prefix and those bytes are parsed (once); the settings are the
    previous turn's, already parsed, validated and digested.

    Exact: the previous body was valid with these very bytes around its input, and ``[`` + the
    new bytes + ``]`` parses as one array only if they are a list of values, so the new body
    parses as the previous one with these items appended. ``None`` when the bytes differ.
    """
    suffix = memoryview(previous)[len(previous) - raw.suffix :]
    close = len(body) - raw.suffix - 1  # where this body's "]" must be
    if close < i or body[close] != ord("]") or not body.endswith(suffix):
        return None
    if body[i] == ord("]"):
        if close != i:
            return None
        tail: Any = []
    elif body[i] == ord(","):
        j = blank_forward(body, i + 1)
        if j >= close:
            return None  # "[a, ]" is invalid JSON; "[" + "]" would not be.
        try:
            tail = orjson.loads(b"".join((b"[", memoryview(body)[i + 1 : close], b"]")))
        except orjson.JSONDecodeError:
            return None
        if not isinstance(tail, list):
            return None
    else:
        return None
    validate_items(tail, n_input)
    return make_request(
        body,
        block.fields(tail),
        InputSpan(raw.span.key, raw.span.start, close),
        base=Base(anchor, n_input, input_state.copy(), raw.state.copy(), raw.length),
        tail=tail,
        settings=block,
    )


_BYTES_PER_COMPARE = 512
"""SHA-256 of this many bytes costs about what comparing one more candidate prefix costs (the
interpreter's share of a comparison, ~0.3 µs; hashing ~0.7 ns a byte)."""


class PrefixCache:
    """The raw prefixes of recorded request bodies and the hot bodies among them.

    Args:
        hot_bytes: Request bodies kept for the byte comparison of the next turn's prefix,
            in total (the oldest of the identity keeping the most bytes dropped first).
        hot_seconds: A body is dropped this long after its turn (the next prefix is then
            verified with its digest: slower, same answer).
    """

    def __init__(self, *, hot_bytes: int = 256 * 1024 * 1024, hot_seconds: float = 120.0) -> None:
        self.hot_bytes = hot_bytes
        self.hot_seconds = hot_seconds
        self.keeper: Keeper | None = None
        """Asked before a body is kept, told when one is let go (the memory budget)."""
        self._prefixes: dict[Hashable, KeptPrefix] = {}
        self._probes: dict[str, dict[int, dict[bytes, dict[bytes, list[Hashable]]]]] = {}
        """identity → prefix length → the prefix's last bytes → its digest → anchors. Prefixes of
        one length and one ending (templated conversations, the same tool output) are told apart
        by one digest of the new body's bytes, not one comparison each."""
        self._lengths: dict[str, list[int]] = {}
        """identity → the prefix lengths of :attr:`_probes`, ascending (kept sorted as they come and
        go: a parse starts below its body's size, longest first, and sorts nothing)."""
        self._hot: OrderedDict[Hashable, float] = OrderedDict()
        self._hot_size = 0
        self._fair_hot = FairShares()
        """Kept bodies by identity, by size: at ``hot_bytes`` the heaviest identity's oldest
        cools first."""

    def __len__(self) -> int:
        return len(self._prefixes)

    def __repr__(self) -> str:
        return f"<PrefixCache [{len(self._prefixes)} prefixes, {len(self._hot)} hot, {self._hot_size} bytes]>"

    def parse(self, identity: str, body: bytes) -> ParsedRequest:
        """Parse ``body``, skipping the prefix a recorded body of ``identity`` already holds.

        Clients re-send their previous body byte for byte up to the end of its input
        (client-echo.md §1.2). When a prefix's digest matches, only the bytes after it are
        parsed; otherwise (or on any doubt) the whole body is.

        Raises:
            InvalidRequest: as :func:`~proxy.core.request.parse_request`.
        """
        by_length = self._probes.get(identity)
        if by_length:
            lengths = self._lengths[identity]
            # Longest prefix first (it is the most recent turn of the conversation), and only
            # those shorter than the body.
            for k in range(bisect_left(lengths, len(body)) - 1, -1, -1):
                length = lengths[k]
                by_digest = by_length[length].get(body[length - PROBE : length])
                if by_digest is None:
                    continue
                for anchor in self._holding(by_digest, body, length):
                    prefix = self._prefixes[anchor]
                    fast = fast_parse(prefix.raw, anchor, prefix.n_input, prefix.input_state, body)
                    if fast is not None:
                        return fast
        return parse_request(body)

    def _holding(self, by_digest: dict[bytes, list[Hashable]], body: bytes, length: int) -> list[Hashable]:
        """The anchors of one length and ending whose prefix ``body`` starts with (every anchor
        under one digest holds the same bytes; one digest at most can match).

        One prefix (the usual case): compared byte for byte while its body is hot, else by its
        digest. Several: one digest of ``body``'s bytes finds them when that costs less than
        comparing each (hashing :data:`_BYTES_PER_COMPARE` bytes costs about one comparison);
        otherwise each hot one is compared (templated conversations differ early: the
        comparison stops there) and the cold ones share one digest of ``body``.
        """
        if len(by_digest) == 1:
            anchors = next(iter(by_digest.values()))
            return anchors if self._prefixes[anchors[0]].raw.starts(body) else []
        if length < len(by_digest) * _BYTES_PER_COMPARE:
            return by_digest.get(prefix_digest(body, length), [])
        digest = None
        for key, anchors in by_digest.items():
            raw = self._prefixes[anchors[0]].raw
            if raw.body is not None:
                if raw.starts(body):
                    return anchors
                continue
            if digest is None:
                digest = prefix_digest(body, length)
            if key == digest:
                return anchors
        return []

    def raw(self, anchor: Hashable) -> RawPrefix | None:
        """The raw prefix kept for ``anchor``."""
        prefix = self._prefixes.get(anchor)
        return prefix.raw if prefix is not None else None

    def body(self, anchor: Hashable) -> bytes | None:
        """The hot body kept for ``anchor``, if still kept."""
        prefix = self._prefixes.get(anchor)
        return prefix.raw.body if prefix is not None else None

    def replace(self, anchor: Hashable, prefix: KeptPrefix | None, now: float) -> None:
        """Keep ``prefix`` under ``anchor`` in place of the one there, if any (``None``: only
        that one goes), its body if memory allows. The old body's memory is handed back and the
        new one's asked for in one call of the keeper (:meth:`Keeper.rekeep`); the anchor's
        fair share moves to the new body in one step."""
        old = self._prefixes.pop(anchor, None)
        hot = False
        if old is not None:
            self._unprobe(anchor, old)
            if self._hot.pop(anchor, None) is not None:
                hot = True
                if old.raw.body is not None:
                    self._hot_size -= len(old.raw.body)
                    old.raw.body = None
        body = prefix.raw.body if prefix is not None else None
        if prefix is not None:
            self._prefixes[anchor] = prefix
            self._probe(anchor, prefix)
        if prefix is not None and body is not None and self.keeper is not None:
            if not self.keeper.rekeep(anchor if hot else None, anchor, len(body)):
                body = prefix.raw.body = None  # no memory to spare: the digest serves this prefix
        elif hot and self.keeper is not None:
            self.keeper.cooled(anchor)
        if prefix is None or body is None:
            if hot:
                self._fair_hot.remove(anchor)
            return
        self._hot[anchor] = now
        self._hot_size += len(body)
        self._fair_hot.add(prefix.identity, anchor, len(body))  # the old body's share, if any, moves
        while self._hot_size > self.hot_bytes and self._hot:
            self.cool(self._fair_hot.victim() or next(iter(self._hot)))

    def _probe(self, anchor: Hashable, prefix: KeptPrefix) -> None:
        """Add ``anchor``'s ``prefix`` to the probes."""
        raw = prefix.raw
        by_length = self._probes.setdefault(prefix.identity, {})
        probes = by_length.get(raw.length)
        if probes is None:
            probes = by_length[raw.length] = {}
            insort(self._lengths.setdefault(prefix.identity, []), raw.length)
        probes.setdefault(raw.probe, {}).setdefault(raw.digest, []).append(anchor)

    def take(self, anchor: Hashable) -> KeptPrefix | None:
        """Forget the prefix of ``anchor`` (its body let go first) and return it."""
        self.cool(anchor)
        prefix = self._prefixes.pop(anchor, None)
        if prefix is not None:
            self._unprobe(anchor, prefix)
        return prefix

    def _unprobe(self, anchor: Hashable, prefix: KeptPrefix) -> None:
        """Remove ``anchor``'s ``prefix`` (no longer in :attr:`_prefixes`) from the probes."""
        by_length = self._probes[prefix.identity]
        probes = by_length[prefix.raw.length]
        by_digest = probes[prefix.raw.probe]
        by_digest[prefix.raw.digest].remove(anchor)
        if not by_digest[prefix.raw.digest]:
            del by_digest[prefix.raw.digest]
        if not by_digest:
            del probes[prefix.raw.probe]
            if not probes:
                del by_length[prefix.raw.length]
                lengths = self._lengths[prefix.identity]
                del lengths[bisect_left(lengths, prefix.raw.length)]
                if not by_length:
                    del self._probes[prefix.identity]
                    del self._lengths[prefix.identity]

    def cool(self, anchor: Hashable) -> None:
        """Let go of the body kept for ``anchor``, if any (memory pressure, or its age): the
        next prefix is then checked with the digest; same answer, slower."""
        if self._hot.pop(anchor, None) is None:
            return
        if self.keeper is not None:
            self.keeper.cooled(anchor)
        self._fair_hot.remove(anchor)
        prefix = self._prefixes.get(anchor)
        if prefix is not None and prefix.raw.body is not None:
            self._hot_size -= len(prefix.raw.body)
            prefix.raw.body = None

    def expire(self, now: float) -> None:
        """Let go of the bodies older than ``hot_seconds``."""
        while self._hot:
            anchor, since = next(iter(self._hot.items()))
            if now - since < self.hot_seconds:
                break
            self.cool(anchor)
