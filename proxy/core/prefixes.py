"""The records of the fast parse: what is kept of a previous body, and what a fast parse knew.

A body's members around its input array are processed once into a :class:`SettingsBlock`,
shared while later bodies carry the same bytes there. A recorded head keeps a
:class:`RawPrefix` of its request body (where its input ended, how to
recognise the bytes before that: the body itself while hot, else a digest), inside a
:class:`KeptPrefix` of the :class:`~proxy.core.fastparse.PrefixCache`, which asks its
:class:`Keeper` (the memory budget) before keeping a body. A request parsed fast carries a
:class:`Base`: what it knows of the prefix it skipped. The logic that builds and uses them is in
:mod:`proxy.core.fastparse`; these are apart so that a reader of a request or a head can hold
the data without it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.core.rawjson import InputSpan

__all__ = ["Base", "KeptPrefix", "Keeper", "RawPrefix", "SettingsBlock", "prefix_digest"]


@dataclass(slots=True, eq=False)
class SettingsBlock:
    """The non-input members of a body, processed once and reused while later bodies carry the
    very same bytes around their input (the steady state of an agent loop).

    Blocks are shared: every conversation whose bodies hold the same settings bytes uses one
    block (:func:`proxy.core.fastparse.settings_block` keeps a bounded table of them), so a head
    costs a reference, not a copy of the instructions and tools.

    Attributes:
        before: Fields before ``input`` (body order).
        after: Fields after the ``input`` array.
        digest: :func:`~proxy.core.request.settings_digest` of both.
        huge: Whether a value may be an integer beyond 64 bits (see :func:`~proxy.core.request.build_frame`).
    """

    before: dict[str, Any]
    after: dict[str, Any]
    digest: bytes
    huge: bool
    members: tuple[bytes, bytes] | None = None
    """The frame's members before and after ``input``, serialised once (by
    :func:`~proxy.core.request.build_frame`)."""

    def fields(self, items: list[Any]) -> dict[str, Any]:
        """Every field in body order, ``input`` set to ``items``."""
        return {**self.before, "input": items, **self.after}


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
    """:attr:`RawPrefix.digest` of a prefix of ``length`` bytes of ``body`` (the digest of
    :func:`proxy.core.fastparse.hash_prefix`)."""
    return hashlib.sha256(memoryview(body)[:length]).digest()[:16]


@dataclass(slots=True)
class KeptPrefix:
    """What the fast parse needs of one recorded body."""

    identity: str
    raw: RawPrefix
    """Byte-level facts about the body (its ``body`` is the hot copy, or ``None`` once cooled)."""
    n_input: int
    input_state: Any
    """SHA-256 state over the input item keys (extended, not recomputed, next turn)."""


class Keeper(Protocol):
    """Who else accounts for kept bodies (the memory budget, :class:`proxy.core.budget.Budget`)."""

    def keep(self, anchor: Hashable, size: int) -> bool:
        """Whether the head of ``anchor`` may keep a body of ``size`` bytes."""
        ...

    def cooled(self, anchor: Hashable) -> None:
        """The head of ``anchor`` let its kept body go."""
        ...

    def rekeep(self, old: Hashable | None, anchor: Hashable, size: int) -> bool:
        """:meth:`cooled` of ``old`` (if not ``None``), then :meth:`keep` of ``anchor``: one step
        for a body replacing another."""
        ...


@dataclass(frozen=True, slots=True)
class Base:
    """What a fast parse knows about the byte-identical prefix it skipped.

    Attributes:
        anchor: The head whose request body the new body extends byte for byte.
        count: Input items in that prefix (parsed last turn, not this one).
        input_state: SHA-256 state over those items' keys (see ``ParsedRequest.prefix_digest``).
        raw_state: SHA-256 state over ``body[:raw_len]``.
        raw_len: Length of the prefix: it ends right after the prefix's last input item.
    """

    anchor: Hashable
    count: int
    input_state: Any
    raw_state: Any
    raw_len: int
