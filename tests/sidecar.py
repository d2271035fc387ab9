"""An in-process sidecar for tests: the real :class:`proxy.server.Server` on free ports.

    async with Sidecar(emulator.base_url, pool={"max_sockets_per_identity": 2}) as sc:
        client = AsyncOpenAI(base_url=sc.base_url, api_key="sk-test")

Settings overrides are keyword arguments: top-level fields as values, sections (``pool``,
``timeouts``, ``limits``, ...) as dicts of field values or as whole dataclasses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import psutil

from proxy.config import Settings
from proxy.core.conversation import HeadTable
from proxy.server import Server
from proxy.upstream.pool import Pool

__all__ = ["ROOT", "Sidecar", "SidecarProcess", "override"]


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
        lanes = os.environ.get("LANES_PER_SOCKET_UNDER_TEST")
        if lanes and isinstance(changes.get("pool", {}), dict):
            # Runs the suite as an upstream without lanes would see it (``pool.lanes_per_socket: 1``).
            changes["pool"] = {"lanes_per_socket": int(lanes), **changes.get("pool", {})}
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


ROOT = Path(__file__).resolve().parent.parent


class SidecarProcess:
    """``python -m proxy`` on free ports, its stdout and stderr captured to files."""

    def __init__(self, upstream: str, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.out_path, self.err_path = tmp / "sidecar.stdout", tmp / "sidecar.stderr"
        # Nothing of this machine's own configuration leaks into the child.
        child_env = {k: v for k, v in os.environ.items() if not k.startswith(("UPSHIFT_", "OPENAI_"))}
        child_env["PYTHONUNBUFFERED"] = "1"
        child_env.update(env or {})
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "proxy", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                 "--upstream", upstream, *args],
                cwd=ROOT, env=child_env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
            )  # fmt: skip
        self.api = ""
        """``http://127.0.0.1:PORT`` of the API listener."""
        self.admin = ""
        """``http://127.0.0.1:PORT`` of the admin listener."""

    @property
    def base_url(self) -> str:
        return self.api + "/v1"

    def logs(self) -> str:
        """Everything the process wrote so far (stdout, then stderr)."""
        return self.out_path.read_text(errors="replace") + self.err_path.read_text(errors="replace")

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float = 15.0) -> None:
        """Find both listeners, tell them apart by ``/healthz``, then wait for ``/readyz`` 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"sidecar exited with {self.proc.returncode}:\n{self.logs()}"
            ports = sorted(
                {
                    c.laddr.port
                    for c in psutil.Process(self.proc.pid).net_connections(kind="tcp")
                    if c.status == psutil.CONN_LISTEN
                }
            )
            if len(ports) == 2 and not self.admin:
                for port in ports:
                    async with session.get(f"http://127.0.0.1:{port}/healthz") as resp:
                        if resp.status == 200 and (await resp.json()) == {"status": "ok"}:
                            self.admin = f"http://127.0.0.1:{port}"
                        else:
                            self.api = f"http://127.0.0.1:{port}"
            if self.admin and self.api:
                async with session.get(self.admin + "/readyz") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.05)
        raise AssertionError(f"sidecar not ready within {timeout} s:\n{self.logs()}")

    async def wait(self, timeout: float = 20.0) -> int:
        """Wait for the exit without blocking the loop (the in-process emulator must keep
        answering the sidecar's closing handshakes); returns the exit code."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, f"sidecar still running after {timeout} s"
            await asyncio.sleep(0.02)
        return self.proc.returncode

    async def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return await self.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
