"""The one door to library internals: every private attribute of aiohttp or websockets that the
sidecar must read or set is read or set here, and nowhere else.

Each accessor names the library version range it was checked against; ``tests/test_contracts.py``
has one contract test per accessor that fails with a clear message when the library changes the
internal (CI runs it at the lowest and highest allowed versions, ``.ci/constraints-*.txt``).
"""

from __future__ import annotations

# --- aiohttp -------------------------------------------------------------------------------
# (accessors for aiohttp internals go in this section)


# --- websockets ----------------------------------------------------------------------------
# (accessors for websockets internals go in this section)
