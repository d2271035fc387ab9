"""Conversation affinity: which process owns a request, computed from its body alone.

Every worker and every replica computes the same owner for a request, before the head lookup
and without parsing the history: rendezvous (highest-random-weight) hashing of an *owner key*
over the peer set. The owner key digests

* the caller's identity (``Identity.digest``: tenants never share an owner key), and
* the conversation's *root*: the input items up to and including the first user message.
  Every later turn of a conversation repeats them (client-echo.md §1.2), so all its turns map
  to one key, and so do its forks and the sub-agents that branch off the same history: the
  longest-match rule of :class:`~proxy.core.conversation.HeadTable` keeps working because all
  the heads it must choose between live in one process.

The root is canonicalised with :func:`~proxy.core.items.item_key` (key order, ``null`` fields,
string vs. part-list content), so a client that re-serialises its echo still lands on the same
owner; a string ``input`` is one user message, equal to ``[{"role": "user", "content": s}]``.

``instructions`` are deliberately *not* part of the key. They vary per agent: a handoff, or a
sub-agent given its own instructions over the shared history, would otherwise move to another
owner and lose the heads it could continue. The price is that conversations whose first user
message is identical (a canned prompt) share an owner whatever their instructions; distinct
first messages spread evenly.

Cheap by construction: only the top-level members before ``input`` and the first few items are
tokenised (a regex skips strings at C speed), and only the root items are parsed. A body whose
root cannot be found that way (not a JSON object, no ``input``, malformed) has no key: it is
handled where it landed, whose full parse then gives the proper error. So does an app that
chains itself (``previous_response_id`` or ``conversation``): its input is a delta without a
stable root, and the upstream continues a stored response from any socket.

Pure: bytes in, digests and peer names out.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from proxy.core.items import digest, item_key
from proxy.core.rawjson import blank_back, blank_forward, parse_object_part

__all__ = ["MAX_ROOT_ITEMS", "owner", "owner_key", "rank", "root_digest", "root_items"]

MAX_ROOT_ITEMS = 16
"""Items looked at for the first user message; without one, these items are the root."""

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NEXT = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_SCALAR_END = re.compile(rb"[,\]}\s]")
_SELF_CHAINED = (b'"previous_response_id"', b'"conversation"')
_TAIL_WINDOW = 64 * 1024


class _Stop(Exception):
    """The body is not something the cheap scan understands."""


def _skip_value(body: bytes, i: int) -> int:
    """Offset just after the JSON value starting at ``i`` (no validation beyond structure)."""
    if i >= len(body):
        raise _Stop
    c = body[i]
    if c == 0x22:  # '"'
        m = _STRING.match(body, i)
        if m is None:
            raise _Stop
        return m.end()
    if c in (0x7B, 0x5B):  # '{' '['
        depth = 0
        pos = i
        while True:
            m = _NEXT.search(body, pos)
            if m is None:
                raise _Stop
            token = m.group()
            pos = m.end()
            if token[0] in (0x7B, 0x5B):
                depth += 1
            elif token[0] in (0x7D, 0x5D):
                depth -= 1
                if depth == 0:
                    return pos
    m = _SCALAR_END.search(body, i)
    return m.start() if m is not None else len(body)


def _is_user_message(item: Any) -> bool:
    return isinstance(item, dict) and item.get("role") == "user" and item.get("type", "message") == "message"


def _input_root(body: bytes, i: int) -> list[Any]:
    """The root items of the ``input`` value starting at ``i``."""
    if body[i] == 0x22:
        text = orjson.loads(body[i : _skip_value(body, i)])
        return [{"role": "user", "content": text}]
    if body[i] != 0x5B:
        raise _Stop
    items: list[Any] = []
    i = blank_forward(body, i + 1)
    while i < len(body) and body[i] != 0x5D and len(items) < MAX_ROOT_ITEMS:
        end = _skip_value(body, i)
        items.append(orjson.loads(body[i:end]))
        if _is_user_message(items[-1]):
            break
        i = blank_forward(body, end)
        if i < len(body) and body[i] == 0x2C:
            i = blank_forward(body, i + 1)
    return items


def _chained_member(body: bytes, closing: int) -> bool:
    """Whether the body has a top-level, non-null ``previous_response_id`` or ``conversation``.

    ``"key"`` followed by ``:`` is always an object key (a raw quote cannot occur in a string);
    it is top-level exactly when the members on one side of it parse on their own. The smaller
    side is parsed, so the history is never parsed here. Only the last :data:`_TAIL_WINDOW`
    bytes are searched (members after ``input`` are small); one found nowhere else only costs
    a needless forward, never a wrong answer.
    """
    begin = blank_forward(body, 0)
    floor = max(begin, closing - _TAIL_WINDOW)
    for pattern in _SELF_CHAINED:
        end = closing
        for _ in range(4):
            q = body.rfind(pattern, floor, end)
            if q < 0:
                break
            end = q
            colon = blank_forward(body, q + len(pattern))
            if colon >= len(body) or body[colon] != 0x3A:
                continue
            if closing - q < q - begin:
                members = parse_object_part(body[q:closing])
            else:
                comma = blank_back(body, q - 1)
                left = comma == begin or (
                    body[comma] == 0x2C and parse_object_part(body[begin + 1 : comma]) is not None
                )
                value_end = _skip_value(body, blank_forward(body, colon + 1))
                members = parse_object_part(body[q:value_end]) if left else None
            if members is not None:
                if members.get(orjson.loads(pattern)) is not None:
                    return True
                break
    return False


def root_items(body: bytes) -> list[Any] | None:
    """The parsed root items of a ``POST /v1/responses`` body, or ``None`` (see module doc)."""
    try:
        i = blank_forward(body, 0)
        closing = blank_back(body, len(body) - 1)
        if i >= len(body) or body[i] != 0x7B or closing <= i or body[closing] != 0x7D:
            return None
        i = blank_forward(body, i + 1)
        while i < closing:
            m = _STRING.match(body, i)
            if m is None:
                return None
            key = orjson.loads(m.group())
            i = blank_forward(body, m.end())
            if i >= len(body) or body[i] != 0x3A:
                return None
            i = blank_forward(body, i + 1)
            if key in ("previous_response_id", "conversation"):
                if body.startswith(b"null", i):
                    i = blank_forward(body, i + 4)
                else:
                    return None
            elif key == "input":
                root = _input_root(body, i)
                if not root or _chained_member(body, closing):
                    return None
                return root
            else:
                i = blank_forward(body, _skip_value(body, i))
            if i < len(body) and body[i] == 0x2C:
                i = blank_forward(body, i + 1)
            elif i != closing:
                return None
    except (_Stop, orjson.JSONDecodeError, IndexError):
        return None
    return None


def root_digest(body: bytes) -> bytes | None:
    """Digest of the canonicalised root items of ``body`` (``None``: no root, serve locally)."""
    items = root_items(body)
    if items is None:
        return None
    try:
        return digest(
            b"".join(item_key(item) if isinstance(item, dict) else digest(orjson.dumps(item)) for item in items)
        )
    except TypeError:  # e.g. an integer orjson cannot re-serialise
        return None


def owner_key(identity_digest: str, root: bytes) -> bytes:
    """The key rendezvous hashing ranks peers for."""
    return digest(identity_digest.encode() + b"\0" + root)


def _score(peer: str, key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(peer.encode() + b"\0" + key, digest_size=8).digest(), "big")


def rank(key: bytes, peers: Iterable[str]) -> list[str]:
    """``peers`` from most to least preferred owner of ``key`` (rendezvous hashing).

    Removing a peer moves only the keys it owned (each to its own next choice); adding one
    moves only the keys it now wins, about 1/N of them.
    """
    return sorted(peers, key=lambda peer: (_score(peer, key), peer), reverse=True)


def owner(key: bytes, peers: Sequence[str]) -> str:
    """The preferred owner of ``key`` among ``peers`` (not empty)."""
    return max(peers, key=lambda peer: (_score(peer, key), peer))
