"""An in-process sidecar for tests: the real :class:`proxy.server.Server` on free ports.

    async with Sidecar(emulator.base_url, pool={"max_sockets_per_identity": 2}) as sc:
        client = AsyncOpenAI(base_url=sc.base_url, api_key="sk-test")

Settings overrides are keyword arguments: top-level fields as values, sections (``pool``,
``timeouts``, ``limits``, ...) as dicts of field values or as whole dataclasses.
"""

from __future__ import annotations

import dataclasses
from types import TracebackType
from typing import Any

from proxy.config import Settings
from proxy.core.conversation import HeadTable
from proxy.pool import Pool
from proxy.server import Server

__all__ = ["Sidecar", "override"]


def override(settings: Settings, **changes: Any) -> Settings:
    """``settings`` with ``changes``; a dict value updates that section field by field."""
    values: dict[str, Any] = {}
    for name, value in changes.items():
        current = getattr(settings, name)
        if isinstance(value, dict) and dataclasses.is_dataclass(current):
            values[name] = dataclasses.replace(current, **value)  # type: ignore[type-var]
        else:
            values[name] = value
    return dataclasses.replace(settings, **values)


class Sidecar:
    """A started sidecar in this event loop.

    Args:
        upstream: Upstream base URL (``emulator.base_url``).
        settings: Base settings (default: ``Settings()``); listeners always go to free ports on
            127.0.0.1, and the drain grace defaults to 2 s so tests stay fast.
        **changes: Overrides, see :func:`override`.
    """

    def __init__(self, upstream: str, *, settings: Settings | None = None, **changes: Any) -> None:
        base = settings or Settings()
        changes.setdefault("shutdown", {"grace_seconds": 2.0})
        self.settings = override(base, upstream=upstream, listen="127.0.0.1:0", admin_listen="127.0.0.1:0", **changes)
        self.server = Server(self.settings)

    @property
    def port(self) -> int:
        """The API port."""
        return self.server.api_address[1]

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (no ``/v1``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``: what an app puts in ``OPENAI_BASE_URL``."""
        return self.url + "/v1"

    @property
    def admin_url(self) -> str:
        """``http://127.0.0.1:ADMIN_PORT`` (``/healthz``, ``/readyz``, ``/metrics``)."""
        return f"http://127.0.0.1:{self.server.admin_address[1]}"

    @property
    def pool(self) -> Pool:
        """The upstream socket pool (``repr(sc.pool)`` shows counts)."""
        return self.server.services.pool

    @property
    def heads(self) -> HeadTable:
        """The conversation head table."""
        return self.server.services.heads

    async def start(self) -> Sidecar:
        """Bind both listeners; returns self."""
        await self.server.start()
        return self

    async def stop(self) -> None:
        """Drain and stop (upstream sockets close with 1001)."""
        await self.server.stop()

    async def __aenter__(self) -> Sidecar:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
