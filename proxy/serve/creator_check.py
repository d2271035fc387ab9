"""The owner check every id-bearing route makes: local registry first, then peers.

:class:`OwnerBook` wraps the process's :class:`~proxy.core.creators.OwnerRegistry` (the pool's,
which its planner tells of every head) and, in a cluster, a :class:`RemoteOwners` that asks
the other workers and replicas (:mod:`proxy.ingress.creator_queries`): the id's creator recorded it
before the app could see it, so wherever a later request lands, some process knows. Behind an injected key the check
fails closed: an id no process knows is refused, as the upstream refuses an unknown id.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from proxy.core.creators import NamedIds, OwnerRegistry, noun
from proxy.errors import ForeignObject, ForeignResponse, NotShared
from proxy.reasons import ObjectKind, OwnerVerdict

__all__ = ["OwnerBook", "RemoteOwners"]


class RemoteOwners(Protocol):
    """Asks the other processes of the cluster about an id this process does not know."""

    async def verdict(self, identity: str, response_id: str) -> OwnerVerdict:
        """``own``/``foreign`` as the process that knows says, ``unknown`` if none does."""
        ...


class OwnerBook:
    """Who may name a response id.

    Args:
        registry: This process's owners (``Pool.owners``).
        strict: Refuse ids of unknown owner (an injected key: the upstream's store is shared).
        shared: ``identity.shared_objects``.
    """

    def __init__(self, registry: OwnerRegistry, *, strict: bool, shared: Iterable[str] = ()) -> None:
        self.registry = registry
        self.strict = strict
        self.shared = frozenset(shared)
        """``identity.shared_objects``: kinds of stored objects every tenant may name."""
        self.remote: RemoteOwners | None = None
        """Set by the composition root when there are other processes to ask."""

    def note(self, identity: str, response_id: str) -> None:
        """``identity`` created ``response_id`` (call before the app can see the id)."""
        self.registry.note(identity, response_id)

    async def verdict(self, identity: str, response_id: str) -> OwnerVerdict:
        """Whose ``response_id`` is: this process's record, else the peers'."""
        found = self.registry.verdict(identity, response_id)
        if found is OwnerVerdict.UNKNOWN and self.remote is not None:
            found = await self.remote.verdict(identity, response_id)
        return found

    async def allows(self, identity: str, response_id: str, *also: str) -> bool:
        """Whether ``identity`` may name ``response_id`` (its own; unknown only when not strict).

        ``also``: other digests the same caller's ids are recorded under (the caller's identity
        without its query string: ``GET /v1/responses/{id}?stream=true`` is the creator's own)."""
        verdicts = {await self.verdict(who, response_id) for who in (identity, *also)}
        if OwnerVerdict.OWN in verdicts:
            return True
        return verdicts == {OwnerVerdict.UNKNOWN} and not self.strict

    async def check(self, identity: str, named: NamedIds) -> None:
        """Refuse a request naming what ``identity`` may not name (the ids
        :func:`~proxy.core.creators.request_ids` read from it).

        Raises:
            ForeignResponse: its ``previous_response_id`` is not ``identity``'s.
            ForeignObject: its ``conversation``, a ``file_id`` of its input or a
                ``vector_store_ids`` entry of its tools is not ``identity``'s.
            NotShared: behind an injected key, an ``item_reference`` input (items have no
                recorded owner) unless ``items`` are shared.
        """
        rid = named.previous_response_id
        if rid is not None and not await self.allows(identity, rid):
            raise ForeignResponse(rid)
        conversation = named.conversation
        if conversation is not None and ObjectKind.CONVERSATIONS not in self.shared:
            if not await self.allows(identity, conversation):
                raise ForeignObject(noun(ObjectKind.CONVERSATIONS), conversation, param="conversation")
        for kind, ids, param in (
            (ObjectKind.FILES, named.files, "input"),
            (ObjectKind.VECTOR_STORES, named.vector_stores, "tools"),
        ):
            if kind not in self.shared:
                for object_id in ids:
                    if not await self.allows(identity, object_id):
                        raise ForeignObject(noun(kind), object_id, param=param)
        if named.items and self.strict and ObjectKind.ITEMS not in self.shared:
            raise NotShared(
                "Behind the sidecar's injected key an item_reference could name any tenant's item;"
                " an operator allows it with identity.shared_objects: [items].",
                param="input",
            )
