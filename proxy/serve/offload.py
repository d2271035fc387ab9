"""A large body parsed in full, kept off the event loop's critical stretch.

A first turn (or one whose prefix the fast parse could not skip) of megabytes is parsed in full;
two costs of it would otherwise hold the event loop for milliseconds: canonicalising its item
keys (done here a slice per loop turn, before the plan needs them) and hashing its history
prefix for the next turn's fast parse (done in a worker thread while the upstream works, ready
when the head is recorded).
"""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.core.fastparse import hash_prefix, prefix_length
from proxy.core.request import ParsedRequest

__all__ = ["hash_prefix_in_thread", "large", "warm_keys"]

_LARGE = 256 * 1024
"""Bodies larger than this that were parsed in full get their item keys in slices."""
_SLICE = 16
"""Items canonicalised per event-loop turn (a 20 KB tool output takes ~0.1 ms)."""


def large(req: ParsedRequest) -> bool:
    """Whether ``req`` is a large body parsed in full: the only kind this module has work for
    (the handler asks once and skips both steps for every other request)."""
    return req.base is None and len(req.body) > _LARGE


async def warm_keys(req: ParsedRequest) -> None:
    """Canonicalise the item keys of a :func:`large` body, a slice per loop turn."""
    while not req.warm_keys(_SLICE):
        await asyncio.sleep(0)


def hash_prefix_in_thread(req: ParsedRequest) -> asyncio.Future[Any] | None:
    """For a :func:`large` body, hash its history prefix (the next turn's fast-parse check) in
    a worker thread while the upstream works: SHA-256 of megabytes would otherwise hold the
    event loop for milliseconds when the head is recorded. ``None``: it has no prefix to hash."""
    length = prefix_length(req)
    if length is None:
        return None
    return asyncio.ensure_future(asyncio.to_thread(hash_prefix, req.body, length))
