"""Tenants: whose quota and whose fair share an identity counts against.

An identity digest starts with its tenant's (:mod:`proxy.intake.identity`): a caller that splits
one credential into many identities (query strings, optional headers) is still one tenant, for
the fair shares of what is kept (:class:`proxy.core.budget.FairShares`), the sockets one may
hold (:mod:`proxy.core.placement`) and the ids it owns (:mod:`proxy.core.creators`).
"""

from __future__ import annotations

__all__ = ["TENANT_CHARS", "tenant_of"]

TENANT_CHARS = 16
"""An identity digest starts with its tenant's: this many hex characters of the sha256 of the
app's credential (:mod:`proxy.intake.identity`)."""


def tenant_of(identity: str) -> str:
    """The tenant of an identity digest: whose quota and whose share it counts against."""
    return identity[:TENANT_CHARS]
