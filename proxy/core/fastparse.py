"""The fast parse: read only the bytes after the history prefix the previous turn sent.

Clients re-send their previous body byte for byte up to the end of its input (client-echo.md
§1.2). A head keeps where that prefix ends (:class:`RawPrefix`); a new body that starts with
the same bytes is parsed from there on only, and :func:`fast_parse` returns ``None`` whenever
the shortcut is not certain to agree with a full parse.

The prefix is verified with a byte comparison while the previous body is still held (a *hot*
head: a conversation in the middle of its agent loop), otherwise with a SHA-256 digest, whose
state is carried from turn to turn so each turn hashes only its own new bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.rawjson import InputSpan, blank_back, blank_forward, locate_input, parse_object_part
from proxy.core.request import Base, ParsedRequest, SettingsBlock, make_request, validate_fields, validate_items

__all__ = ["PROBE", "RawPrefix", "fast_parse", "hash_prefix", "prefix_length", "raw_prefix"]

PROBE = 32
"""Bytes just before a prefix's end that index it (they hold the newest input item)."""


@dataclass(slots=True)
class RawPrefix:
    """Where the previous body's input ended, and how to recognise everything before that."""

    length: int
    """The prefix of the previous body that ends right after its last input item."""
    probe: bytes
    """``body[length - PROBE : length]``."""
    digest: bytes
    """SHA-256 of ``body[:length]`` (truncated)."""
    state: Any
    """The SHA-256 state behind ``digest``, extended by the next turn."""
    span: InputSpan
    """The previous body's input span (its key and start offsets carry over)."""
    _body: bytes | None = None
    settings: SettingsBlock | None = None
    """The previous body's settings, processed (shared), while the head is hot (see :func:`fast_parse`)."""
    suffix: int = 0
    """Bytes of the previous body after its input array's ``]``."""

    @property
    def body(self) -> bytes | None:
        """The previous body itself while the head is hot (a byte comparison beats hashing)."""
        return self._body

    @body.setter
    def body(self, value: bytes | None) -> None:
        # Letting the body go (the head cools) lets its processed settings go too.
        self._body = value
        if value is None:
            self.settings = None

    def starts(self, body: bytes) -> bool:
        """Whether ``body`` starts with this prefix."""
        if self.body is not None:
            return body.startswith(memoryview(self.body)[: self.length])
        return prefix_digest(body, self.length) == self.digest


def prefix_digest(body: bytes, length: int) -> bytes:
    """:attr:`RawPrefix.digest` of a prefix of ``length`` bytes of ``body``."""
    digest: bytes = hash_prefix(body, length).digest()
    return digest[:16]


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
    block = SettingsBlock.of(req)
    suffix = len(body) - req.span.end - 1
    return RawPrefix(length, body[length - PROBE : length], state.digest()[:16], state, req.span, body, block, suffix)


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
