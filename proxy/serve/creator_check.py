"""The owner check every id-bearing route makes: local registry first, then peers.

:class:`OwnerBook` wraps the process's :class:`~proxy.core.creators.OwnerRegistry` (the pool's,
which its planner tells of every head) and, in a cluster, a :class:`RemoteOwners` that asks
the other workers and replicas (:mod:`proxy.ingress.creator_queries`): the id's creator recorded it
before the app could see it, so wherever a later request lands, some process knows. Behind an injected key the check
fails closed: an id no process knows is refused, as the upstream refuses an unknown id. Owners are
tenants (:mod:`proxy.core.creators`): every digest given here counts by its tenant.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from proxy.core.creators import OwnerRegistry
from proxy.core.named_ids import NamedIds, kind_of, noun
from proxy.errors import ForeignObject, ForeignResponse
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

    def note(self, identity: str, object_id: str) -> None:
        """``identity`` created ``object_id`` (call before the app can see the id).

        Behind an injected key every id is remembered (an ``item_reference`` to an output item
        is refused unless its tenant's). With the app's own key an id of unknown owner is
        allowed anyway (the upstream's key check separates tenants): output items, a few per
        turn and the only ids without a known prefix (:func:`~proxy.core.named_ids.kind_of`),
        are not remembered then; responses and every other object still are, so another key's
        id is still refused here."""
        if self.strict or kind_of(object_id, ObjectKind.ITEMS) is not ObjectKind.ITEMS:
            self.registry.note(identity, object_id)

    def adopt(self, identity: str, object_id: str) -> None:
        """``identity`` may name ``object_id``, seen in an answer under an object it owns, unless
        another tenant already owns it (:meth:`~proxy.core.creators.OwnerRegistry.adopt`)."""
        self.registry.adopt(identity, object_id)

    async def verdict(self, identity: str, response_id: str) -> OwnerVerdict:
        """Whose ``response_id`` is: this process's record, else the peers'."""
        found = self.registry.verdict(identity, response_id)
        if found is OwnerVerdict.UNKNOWN and self.remote is not None:
            found = await self.remote.verdict(identity, response_id)
        return found

    async def allows(self, identity: str, object_id: str) -> bool:
        """Whether ``identity`` may name ``object_id``: its tenant's own; one of unknown owner
        only when not strict. (The owner is the tenant: the query string and the optional
        headers of the caller play no part.)"""
        found = await self.verdict(identity, object_id)
        return found is OwnerVerdict.OWN or (found is OwnerVerdict.UNKNOWN and not self.strict)

    async def check(self, identity: str, named: NamedIds) -> None:
        """Refuse a request naming what ``identity`` may not name (the ids
        :func:`~proxy.core.named_ids.read_request` read from it).

        Raises:
            ForeignResponse: its ``previous_response_id`` is not ``identity``'s.
            ForeignObject: its ``conversation``, an ``item_reference`` input, or any object id
                below its top level (a ``file_id``, ``vector_store_ids``, a code interpreter's
                ``container``, a nested response id, ...) is not ``identity``'s and its kind is
                not shared. An item is ``identity``'s when the sidecar saw it created for
                ``identity``: an output item of its response, an item of its conversation;
                behind an injected key any other item id is refused.
        """
        rid = named.previous_response_id
        if rid is not None and not await self.allows(identity, rid):
            raise ForeignResponse(rid)
        conversation = named.conversation
        if conversation is not None and ObjectKind.CONVERSATIONS not in self.shared:
            if not await self.allows(identity, conversation):
                raise ForeignObject(noun(ObjectKind.CONVERSATIONS), conversation, param="conversation")
        if ObjectKind.ITEMS not in self.shared:
            for item in named.items:
                if not await self.allows(identity, item):
                    raise ForeignObject(noun(ObjectKind.ITEMS), item, param="input")
        for kind, object_id, param in named.objects:
            if kind not in self.shared and not await self.allows(identity, object_id):
                raise ForeignObject(noun(kind), object_id, param=param)
