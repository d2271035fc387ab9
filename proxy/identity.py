"""Who a request belongs to: the key that partitions sockets and conversation heads.

Headers exist only on a WebSocket upgrade, so a socket belongs to exactly one set of them
(pitfall 12), and an anchor must belong to the caller (pitfall 13). The identity hashes the
app's own ``Authorization``, the upstream ``Authorization`` actually used (a configured key),
``OpenAI-Organization``, ``OpenAI-Project``, ``OpenAI-Beta`` and the upstream URL. With an
injected key the app's own header still counts, so tenants behind one key stay apart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

__all__ = ["USER_AGENT", "Identity", "identify"]


def _version() -> str:
    try:
        return version("upshift")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0.1.0"


USER_AGENT = f"upshift/{_version()}"
"""``User-Agent`` of every upstream connection."""

_CACHE_MAX = 4096


@dataclass(frozen=True, slots=True)
class Identity:
    """A credential partition. Equality and hash use :attr:`digest` only.

    The repr shows a digest prefix, never a credential: identities end up in logs and reprs.
    """

    digest: str
    """sha256 hex of every part that makes the partition."""
    headers: tuple[tuple[str, str], ...] = field(compare=False, repr=False)
    """Upgrade headers for the upstream socket: Authorization, OpenAI-Organization,
    OpenAI-Project and OpenAI-Beta, when present."""

    def __repr__(self) -> str:
        return f"Identity({self.digest[:12]})"


_cache: dict[tuple[str | None, ...], Identity] = {}


def identify(
    app_headers: Mapping[str, str],
    *,
    upstream: str,
    authorization: str | None,
    openai_beta: str = "",
) -> Identity:
    """The identity of a request.

    Args:
        app_headers: The app's request headers (case-insensitive mapping).
        upstream: The upstream base URL.
        authorization: The ``Authorization`` to send upstream (``KeySource.authorization``).
        openai_beta: The configured ``OpenAI-Beta`` (empty: none); the app's own value wins.

    Returns:
        The identity; equal inputs give an equal (and usually the same, cached) object.
    """
    parts = (
        app_headers.get("Authorization"),
        authorization,
        app_headers.get("OpenAI-Organization"),
        app_headers.get("OpenAI-Project"),
        app_headers.get("OpenAI-Beta") or openai_beta or None,
        upstream,
    )
    found = _cache.get(parts)
    if found is not None:
        return found
    hasher = hashlib.sha256()
    for part in parts:
        # A length prefix keeps ("ab", "c") and ("a", "bc") apart; -1 marks an absent header.
        data = b"" if part is None else part.encode("utf-8", "surrogateescape")
        hasher.update(str(-1 if part is None else len(data)).encode() + b":" + data)
    headers = [
        (name, value)
        for name, value in (
            ("Authorization", authorization),
            ("OpenAI-Organization", parts[2]),
            ("OpenAI-Project", parts[3]),
            ("OpenAI-Beta", parts[4]),
        )
        if value
    ]
    identity = Identity(hasher.hexdigest(), tuple(headers))
    if len(_cache) >= _CACHE_MAX:
        _cache.clear()  # cheap bound; a miss only costs one hash
    _cache[parts] = identity
    return identity
