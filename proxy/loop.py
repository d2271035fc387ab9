"""Which event loop the sidecar runs on: uvloop where it is installed (the default dependency on
CPython outside Windows), else asyncio's own. Reported in the startup line, ``--version`` and
``upshift_build_info{loop=...}``.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["loop_name", "run"]

T = TypeVar("T")


def loop_name() -> str:
    """``"uvloop"`` if it can be used here, else ``"asyncio"``."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on the best loop available."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
