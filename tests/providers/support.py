"""Real network parts for the provider tests: a forward proxy (Debian's ``tinyproxy``) as a
child process, and the emulator served over TLS with a test CA (``trustme``). Everything
listens on 127.0.0.1."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from pathlib import Path
from types import TracebackType

import pytest
from aiohttp import web

from bench.ports import free_port
from upshift_emulator import Emulator

__all__ = ["TlsEmulator", "Tinyproxy", "free_port", "require_tinyproxy"]


def require_tinyproxy() -> str:
    """The ``tinyproxy`` binary, or skip saying how to get it."""
    path = shutil.which("tinyproxy")
    if path is None:
        pytest.skip("tinyproxy is not installed: apt-get install -y tinyproxy (.ci/run installs it)")
    return path


class Tinyproxy:
    """``tinyproxy -d`` (foreground) with a generated config on a free loopback port.

    Args:
        tmp: Directory for the config and the log.
        connect_ports: ``ConnectPort`` lines: with any, ``CONNECT`` to other ports is refused
            with 403 (a company proxy that allows only 443); none allows every port.
        basic_auth: ``(user, password)``: requests without that ``Proxy-Authorization`` get 407.
    """

    def __init__(
        self, tmp: Path, *, connect_ports: tuple[int, ...] = (), basic_auth: tuple[str, str] | None = None
    ) -> None:
        self.binary = require_tinyproxy()
        self.port = free_port()
        self.log = tmp / "tinyproxy.log"
        self.conf = tmp / "tinyproxy.conf"
        lines = [
            f"Port {self.port}",
            "Listen 127.0.0.1",
            "Timeout 60",
            f'LogFile "{self.log}"',
            "LogLevel Info",
            "MaxClients 50",
            "Allow 127.0.0.1",
            "DisableViaHeader Yes",
            *(f"ConnectPort {port}" for port in connect_ports),
            *([f"BasicAuth {basic_auth[0]} {basic_auth[1]}"] if basic_auth else []),
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connects(self, port: int) -> int:
        """How many ``CONNECT 127.0.0.1:port`` requests the proxy has logged."""
        if not self.log.exists():
            return 0
        return self.log.read_text(errors="replace").count(f"CONNECT 127.0.0.1:{port} ")

    def refused(self) -> int:
        """How many ``CONNECT`` requests it refused."""
        return self.log.read_text(errors="replace").count("Refused CONNECT") if self.log.exists() else 0

    async def __aenter__(self) -> Tinyproxy:
        self.proc = subprocess.Popen(
            [self.binary, "-d", "-c", str(self.conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(200):
            assert self.proc.poll() is None, f"tinyproxy exited: {self.log.read_text() if self.log.exists() else ''}"
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.025)
                continue
            writer.close()
            await writer.wait_closed()
            return self
        raise AssertionError("tinyproxy did not start listening")

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class TlsEmulator:
    """The emulator's aiohttp app served over TLS on 127.0.0.1 with a certificate of a test CA.

    ``ca_file`` is the CA's PEM (what ``egress.ca_file`` or ``SSL_CERT_FILE`` points at);
    ``emulator`` is the instance (records, stats, faults).
    """

    def __init__(self, tmp: Path, **overrides: object) -> None:
        trustme = pytest.importorskip("trustme", reason="trustme is in the test extra: pip install -e '.[test]'")
        ca = trustme.CA()
        self.ca_file = tmp / "test-ca.pem"
        ca.cert_pem.write_to_path(str(self.ca_file))
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1", "localhost").configure_cert(self._context)
        self.emulator = Emulator(**overrides)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"https://127.0.0.1:{self.port}/v1"

    async def __aenter__(self) -> TlsEmulator:
        self._runner = web.AppRunner(self.emulator.app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._context)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
