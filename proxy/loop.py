"""Which event loop the sidecar runs on: uvloop where it is installed (the default dependency on
CPython outside Windows), else asyncio's own. Reported in the startup line, ``--version`` and
``upshift_build_info{loop=...}``.

While the sidecar runs, the collector's youngest generation is collected every
:data:`YOUNG_THRESHOLD` net allocations instead of CPython's 700. Each young collection walks
every young object, and a busy sidecar's requests in flight (their coroutines, buffers and
parsed events) are young: at 700, 32 streams in flight cost a collection of ~4,000 objects
every ~18 turns, ~70 µs of CPU per turn (5 % of a 1 KB turn); at 7,000, ~10 µs.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["YOUNG_THRESHOLD", "loop_name", "run"]

T = TypeVar("T")

YOUNG_THRESHOLD = 7_000
"""Net allocations between two collections of the youngest generation (see the module's doc;
the older generations keep CPython's thresholds)."""


def loop_name() -> str:
    """``"uvloop"`` if it can be used here, else ``"asyncio"``."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on the best loop available, with the collector's young
    generation at :data:`YOUNG_THRESHOLD` (restored on return)."""
    before = gc.get_threshold()
    if 0 < before[0] < YOUNG_THRESHOLD:  # (0: collection turned off; a higher one: chosen)
        gc.set_threshold(YOUNG_THRESHOLD, *before[1:])
    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(main)
        return uvloop.run(main)
    finally:
        gc.set_threshold(*before)
