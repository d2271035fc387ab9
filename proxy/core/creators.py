"""Who created each object id: the owner registry, and finding ids in bytes that pass by.

Behind one injected key the upstream's store is shared by every tenant, so the sidecar itself
must refuse a tenant that names another tenant's response, conversation, item, file, ... id
(``GET``/``DELETE /v1/responses/{id}``, ``previous_response_id``, ``conversation``, ``file_id``,
an ``item_reference``). Every path that returns a new id records its creator here; every route
that names one asks :meth:`OwnerRegistry.verdict` (which ids a request names:
:mod:`proxy.core.named_ids`).

The owner is the *tenant* (:func:`~proxy.core.tenants.tenant_of` of the identity digest: the app's
credential, behind an injected key its placeholder), never the query string or the optional
``OpenAI-Beta``/``OpenAI-Project``/``OpenAI-Organization`` headers, which stay part of the
upstream identity (sockets, heads) but which a caller varies for free: the same tenant with
another query string or project header still owns its ids, another tenant never does.

Bounded and fair: at most ``capacity`` ids are remembered, and when one must go it is the
oldest id of the tenant that holds the most (a tenant creating ids at a thousand times the
rate of another evicts its own ids, never the other's while it holds more than that one).

The sniffers find an id in bytes on their way to the app without parsing or re-encoding them:
the top-level ``id`` of a JSON response body, ``response.id`` of the first SSE event, of a
WebSocket ``response.created`` frame, and ``item.id`` of a WebSocket
``response.output_item.added`` frame (an output item the app may later name in an
``item_reference``). Each looks at a bounded prefix only.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import orjson

from proxy.core.tenants import tenant_of
from proxy.reasons import OwnerVerdict

__all__ = [
    "SNIFF_LIMIT",
    "OwnerRegistry",
    "OwnerVerdict",
    "created_id",
    "member_string",
]

SNIFF_LIMIT = 256 * 1024
"""Bytes of an answer looked at for its response id; an id found nowhere in them stays unknown
(then, behind an injected key, it is refused: the safe direction)."""


class OwnerRegistry:
    """Object id → the tenant that created it, bounded, evicting from the heaviest.

    Every method takes an identity digest (or a tenant: the digest's prefix) and keys it by its
    tenant (:func:`~proxy.core.tenants.tenant_of`).

    Args:
        capacity: Ids remembered in total.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(int(capacity), 1)
        self._owner: dict[str, str] = {}
        self._by_identity: dict[str, OrderedDict[str, None]] = {}
        self._sizes: dict[int, set[str]] = {}
        """Identities by how many ids they hold (finds the heaviest in O(1))."""
        self._heaviest = 0

    @classmethod
    def for_heads(cls, max_heads: int) -> OwnerRegistry:
        """Sized for a head table of ``max_heads``: sixteen ids a head (a head's own, those of
        incomplete and HTTP answers around it, and the output items of each, which an
        ``item_reference`` may name), at least 4096."""
        return cls(max(16 * max_heads, 4096))

    def __len__(self) -> int:
        return len(self._owner)

    def __repr__(self) -> str:
        return f"<OwnerRegistry [{len(self._owner)} ids, {len(self._by_identity)} identities]>"

    def held(self, identity: str) -> int:
        """How many ids of ``identity``'s tenant are remembered."""
        ids = self._by_identity.get(tenant_of(identity))
        return len(ids) if ids is not None else 0

    def note(self, identity: str, response_id: str) -> None:
        """Remember that ``identity``'s tenant created ``response_id`` (the latest word wins:
        an id is created once, and this is told when it is)."""
        identity = tenant_of(identity)
        current = self._owner.get(response_id)
        if current is not None:
            if current == identity:
                self._by_identity[identity].move_to_end(response_id)
                return
            self._remove(response_id)  # an id is created once; the latest word wins
        ids = self._by_identity.setdefault(identity, OrderedDict())
        self._resize(identity, len(ids), len(ids) + 1)
        ids[response_id] = None
        self._owner[response_id] = identity
        while len(self._owner) > self.capacity:
            self._evict()

    def adopt(self, identity: str, object_id: str) -> None:
        """Remember ``identity``'s tenant as the owner of ``object_id`` unless some tenant
        already is (the first word wins: an id seen in an answer under an object the caller
        owns, which must never take an id from its creator)."""
        if object_id not in self._owner:
            self.note(identity, object_id)

    def owner_of(self, response_id: str) -> str | None:
        """The tenant that created ``response_id``, if remembered."""
        return self._owner.get(response_id)

    def verdict(self, identity: str, response_id: str) -> OwnerVerdict:
        """Whether ``response_id`` is ``identity``'s tenant's own, another's, or unknown here."""
        owner = self._owner.get(response_id)
        if owner is None:
            return OwnerVerdict.UNKNOWN
        return OwnerVerdict.OWN if owner == tenant_of(identity) else OwnerVerdict.FOREIGN

    def _resize(self, identity: str, old: int, new: int) -> None:
        if old:
            bucket = self._sizes[old]
            bucket.discard(identity)
            if not bucket:
                del self._sizes[old]
        if new:
            self._sizes.setdefault(new, set()).add(identity)
        if new > self._heaviest:
            self._heaviest = new
        while self._heaviest and self._heaviest not in self._sizes:
            self._heaviest -= 1

    def _remove(self, response_id: str) -> None:
        identity = self._owner.pop(response_id)
        ids = self._by_identity[identity]
        del ids[response_id]
        self._resize(identity, len(ids) + 1, len(ids))
        if not ids:
            del self._by_identity[identity]

    def _evict(self) -> None:
        """Drop the oldest id of the identity holding the most (ties: any of them)."""
        identity = next(iter(self._sizes[self._heaviest]))
        oldest = next(iter(self._by_identity[identity]))
        self._remove(oldest)


# -- finding ids in bytes ----------------------------------------------------------------------

_STRUCT = re.compile(rb'["{}\[\]:,]')
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


class _NotThere(Exception):
    """The member cannot appear in the rest of the bytes."""


def member_string(data: bytes, path: tuple[str, ...]) -> str | None:
    """The string at ``path`` (``("id",)``, ``("response", "id")``) of the JSON object that
    starts ``data``, or ``None`` when it is not there (or not within ``data``, a prefix).

    Only structure is tokenised (strings are skipped at C speed); nothing is decoded but the
    keys on the path and the value found.
    """
    try:
        return _member_string(data, path)
    except (_NotThere, orjson.JSONDecodeError, IndexError):
        return None


def _member_string(data: bytes, path: tuple[str, ...]) -> str | None:
    stack: list[int] = []  # 0x7B object, 0x5B array
    matched = 0  # path components entered so far; the path's object is at depth matched + 1
    expect_key = False
    hit = False  # the last key read is the next path component
    pos = 0
    while True:
        m = _STRUCT.search(data, pos)
        if m is None:
            return None
        c = data[m.start()]
        pos = m.end()
        if c == 0x22:
            s = _STRING.match(data, m.start())
            if s is None:
                return None  # cut inside a string: the prefix ends here
            pos = s.end()
            if not stack:
                raise _NotThere
            if expect_key:
                hit = len(stack) == matched + 1 and orjson.loads(s.group()) == path[matched]
                expect_key = False
            else:
                if hit and matched == len(path) - 1:
                    value = orjson.loads(s.group())
                    return value if isinstance(value, str) else None
                hit = False
        elif c in (0x7B, 0x5B):
            if hit and c == 0x7B and matched < len(path) - 1:
                matched += 1
            elif not stack and c != 0x7B:
                raise _NotThere
            stack.append(c)
            expect_key, hit = c == 0x7B, False
        elif c in (0x7D, 0x5D):
            if not stack:
                raise _NotThere
            stack.pop()
            if len(stack) < matched + 1:
                raise _NotThere  # the object on the path ended without the member
            expect_key, hit = False, False
        elif c == 0x2C:
            expect_key, hit = bool(stack) and stack[-1] == 0x7B, False
        # ':' changes nothing: the value follows the key read


_CREATED = "response.created"
_ITEM_ADDED = "response.output_item.added"


def created_id(message: str | bytes) -> str | None:
    """``response.id`` of a WebSocket ``response.created`` frame (or of a frame whose head
    carries one), ``item.id`` of a ``response.output_item.added`` frame, else ``None``; looks
    at a bounded head only."""
    head = message[:256]
    text = isinstance(head, str)
    for needle, path in ((_CREATED, ("response", "id")), (_ITEM_ADDED, ("item", "id"))):
        if (needle if text else needle.encode()) in head:  # type: ignore[operator]
            data = message[:SNIFF_LIMIT]
            raw = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
            return member_string(raw, path)
    return None
