"""The emulator and the sidecar as separate OS processes (own process groups, always cleaned up).

Separate processes keep the bench client off their event loops and let psutil read the
sidecar's own CPU time and RSS. Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from .ports import free_port
from .tls import LoopbackCA

__all__ = [
    "EmulatorProc",
    "Managed",
    "SidecarProc",
    "arm_watchdog",
    "free_port",
    "install_signal_handlers",
    "stop_all",
    "track",
]

JSON = Any
_LIVE: list[Managed] = []
_HELPERS: list[subprocess.Popen[bytes]] = []


def stop_all(grace: float = 5.0) -> None:
    """Stop every process still running (atexit and signal safety net)."""
    for proc in list(_LIVE):
        proc.stop(grace)
    for child in list(_HELPERS):
        with contextlib.suppress(OSError):
            child.kill()
        _HELPERS.remove(child)


def track(child: subprocess.Popen[bytes]) -> None:
    """Kill ``child`` (a helper such as py-spy) with the managed processes on exit."""
    _HELPERS.append(child)


def _on_signal(signum: int, frame: object) -> None:
    """SIGINT/SIGTERM: kill every child process group now, then exit (no half-cancelled event loop)."""
    stop_all(grace=1.0)
    os._exit(128 + signum)


def arm_watchdog(seconds: float) -> None:
    """Hard stop (children killed, exit code 3) if the run is still going after ``seconds``."""
    import threading

    def fire() -> None:
        print(f"bench: watchdog: still running after {seconds:.0f} s; stopping", file=sys.stderr, flush=True)
        stop_all(grace=1.0)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def install_signal_handlers() -> None:
    """Make Ctrl-C and SIGTERM always clean up the emulator, the sidecar and helpers."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)


atexit.register(stop_all)


class Managed:
    """A child process in its own session; :meth:`stop` kills the whole group."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_dir / f"{name}.log"
        self.popen: subprocess.Popen[bytes] | None = None
        self.ps: psutil.Process | None = None
        self.cwd = Path(__file__).resolve().parent.parent
        """Where the process runs: ``python -m`` imports the package of this checkout."""

    def start(self, cpus: list[int] | None = None) -> None:
        """Spawn the process (optionally pinned to ``cpus``)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.env, start_new_session=True, cwd=self.cwd,
        )  # fmt: skip
        log.close()
        _LIVE.append(self)
        self.ps = psutil.Process(self.popen.pid)
        if cpus:
            with contextlib.suppress(psutil.Error, AttributeError):
                self.ps.cpu_affinity(cpus)

    @property
    def pid(self) -> int:
        """The child's pid."""
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.popen is not None and self.popen.poll() is None

    async def wait_ready(self, url: str, timeout: float = 30.0, ssl_context: ssl.SSLContext | None = None) -> None:
        """Poll ``url`` until it answers 200 (or fail with the log tail)."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession(connector=_connector(ssl_context)) as session:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        """The end of the process's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by all the process's threads.

        Linux: the scheduler's nanosecond run time of every thread (``/proc/PID/task/*/schedstat``),
        so that the CPU of a single turn (well under the 10 ms tick of ``psutil.cpu_times``) adds
        up exactly; elsewhere user + system time from psutil. Threads that already ended are not
        in the sum, so only differences over a window with the same threads are meaningful.
        """
        assert self.ps is not None
        tasks = Path(f"/proc/{self.ps.pid}/task")
        try:
            total = 0
            for task in tasks.iterdir():
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    total += int((task / "schedstat").read_bytes().split()[0])
            return total / 1e9
        except (OSError, ValueError, IndexError):
            times = self.ps.cpu_times()
            return float(times.user + times.system)

    def rss(self) -> int:
        """Resident set size in bytes."""
        assert self.ps is not None
        return int(self.ps.memory_info().rss)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the process group, then SIGKILL after ``grace`` seconds."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(grace)
        if self in _LIVE:
            _LIVE.remove(self)


def _connector(context: ssl.SSLContext | None) -> aiohttp.TCPConnector | None:
    return aiohttp.TCPConnector(ssl=context) if context is not None else None


class EmulatorProc(Managed):
    """``python -m upshift_emulator`` on a free port; behind TLS with ``tls`` (:mod:`bench.tls`)."""

    def __init__(
        self, log_dir: Path, latency: dict[str, float], extra: list[str] | None = None, tls: LoopbackCA | None = None
    ) -> None:
        self.port = free_port()
        self.tls = tls
        self.ssl_context = tls.client_context() if tls is not None else None
        """What a client of this emulator trusts (None: plain HTTP)."""
        argv = [sys.executable, "-m", "upshift_emulator", "--listen", f"127.0.0.1:{self.port}"]
        argv += ["--log-level", "WARNING"]
        for key, value in latency.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        if tls is not None:
            argv += ["--tls-cert", str(tls.cert_file), "--tls-key", str(tls.key_file)]
        super().__init__("emulator-tls" if tls else "emulator", argv + (extra or []), log_dir)

    def stand_apart(self, nice: int) -> int:
        """Raise the emulator's scheduling priority to ``nice`` (negative: ahead of the app and
        the relay), so that on a small machine it paces its answers as a remote upstream would,
        not late by the CPU a relay beside it uses; the niceness it has (0 when not permitted)."""
        assert self.ps is not None
        with contextlib.suppress(psutil.Error, OSError):
            self.ps.nice(nice)
        with contextlib.suppress(psutil.Error):
            return int(self.ps.nice())
        return 0

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1`` (``https://`` behind TLS)."""
        return self.root + "/v1"

    @property
    def root(self) -> str:
        """``http://127.0.0.1:PORT`` (``https://`` behind TLS)."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        """``ws://127.0.0.1:PORT/v1/responses`` (``wss://`` behind TLS)."""
        return "ws" + self.base_url[4:] + "/responses"

    async def ready(self) -> None:
        """Wait for the health endpoint."""
        await self.wait_ready(self.root + "/_emulator/health", ssl_context=self.ssl_context)

    async def _call(self, method: str, path: str, body: JSON = None) -> JSON:
        async with aiohttp.ClientSession(connector=_connector(self.ssl_context)) as session:
            async with session.request(method, self.root + path, json=body) as resp:
                resp.raise_for_status()
                return await resp.json()

    async def set_latency(self, latency: dict[str, float]) -> JSON:
        """Replace the live latency model (zero-based: unspecified fields become 0)."""
        return await self._call("POST", "/_emulator/latency", {"preset": "zero", **latency})

    async def reset(self) -> None:
        """Forget responses and zero the counters."""
        await self._call("POST", "/_emulator/reset")

    async def stats(self) -> JSON:
        """``/_emulator/stats`` without the per-connection and per-response tables."""
        data = await self._call("GET", "/_emulator/stats")
        data.pop("connections", None)
        data.pop("input_items", None)
        return data

    async def record(self, response_id: str) -> JSON:
        """The oracle record of one response."""
        return await self._call("GET", f"/_emulator/responses/{response_id}")


class SidecarProc(Managed):
    """``python -m proxy`` pointed at the emulator, admin on its own port."""

    def __init__(
        self,
        log_dir: Path,
        upstream: str,
        env: dict[str, str] | None = None,
        wrap: list[str] | None = None,
        tls: LoopbackCA | None = None,
    ) -> None:
        """``wrap``: interpreter options before ``-m proxy`` (e.g. ``["-m", "pyinstrument", ...]``);
        ``tls``: the CA of an emulator behind TLS, trusted as ``egress.ca_file``."""
        self.port = free_port()
        self.admin_port = free_port()
        argv = [
            sys.executable, *(wrap or []), "-m", "proxy", "--listen", f"127.0.0.1:{self.port}",
            "--admin-listen", f"127.0.0.1:{self.admin_port}", "--upstream", upstream,
        ]  # fmt: skip
        defaults = {
            "UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY": "8192",
            "UPSHIFT_POOL_MAX_SOCKETS_TOTAL": "8192",
            "UPSHIFT_MATCHING_MAX_HEADS": "20000",
            **({"UPSHIFT_EGRESS_CA_FILE": str(tls.ca_file)} if tls is not None else {}),
        }
        super().__init__("sidecar", argv, log_dir, {**defaults, **(env or {})})

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

    async def ready(self) -> None:
        """Wait for ``/readyz``."""
        await self.wait_ready(f"http://127.0.0.1:{self.admin_port}/readyz")

    async def metrics(self) -> str:
        """The Prometheus exposition text."""
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{self.admin_port}/metrics") as resp:
                return await resp.text()
