"""``--workers N``: N sidecar processes on one listen address, one supervisor in front of them.

The supervisor (``upshift --workers N``) reserves the API address (a bound, non-listening
``SO_REUSEPORT`` socket, so port 0 becomes one concrete port that survives worker restarts)
and starts N workers (``python -m proxy.supervisor``, settings passed on stdin). Each worker is a
complete :class:`~proxy.server.Server` whose API listener shares the address with
``SO_REUSEPORT`` (the kernel spreads connections), plus private unix sockets in the
supervisor's runtime directory (mode 0700, :mod:`proxy.ingress.private`; never abstract
names): its API, which takes requests the other workers forward to it because it owns their
conversation (:mod:`proxy.ingress.cluster`), its handoff socket and its admin app. The
supervisor's probes and scrapes check (``SO_PEERCRED``) that the process listening on an
admin socket is the worker it started before they send a byte.

The supervisor serves the one admin listener:

* ``/healthz``: 200 while the supervisor runs; a worker whose own ``/healthz`` stops answering
  is killed and restarted (so is one that exits), with a back-off;
* ``/readyz``: 200 only when every worker answers its ``/readyz`` with 200;
* ``/metrics``: every worker's metrics, scraped on demand and merged, each sample with a
  ``worker`` label (0..N-1; sum them with ``sum without (worker)``), plus the supervisor's own
  ``upshift_worker_restarts_total`` and ``upshift_workers_ready``.

SIGTERM (or SIGINT) drains: ``/readyz`` fails at once, every worker gets SIGTERM and drains
as a single sidecar does, and the supervisor exits 0 when they have all exited. A worker
whose supervisor dies (stdin closes) drains and exits too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from proxy.config import Settings, parse_hostport
from proxy.contracts import CheckedUnixConnector
from proxy.errors import ConfigError
from proxy.ingress.listener import Guard, HardenedTCPSite
from proxy.ingress.peers import WorkerPlacement
from proxy.ingress.private import Trust, check_peer, runtime_dir
from proxy.loop import run as run_loop
from proxy.observe.health import Lifecycle, admin_host_guard
from proxy.observe.log import setup_logging
from proxy.observe.metrics import REGISTRY, WORKER_RESTARTS, WORKERS_READY

__all__ = ["merge_metrics", "supervise"]

log = logging.getLogger(__name__)

_SUPERVISOR_FAMILIES = frozenset({"upshift_worker_restarts", "upshift_workers_ready"})
_PROBE_TIMEOUT = 2.0
_WATCHDOG_PERIOD = 5.0
_WATCHDOG_FAILURES = 3
_BACKOFF_MAX = 10.0


def _socket_names(count: int) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str]:
    """Private API, admin and handoff socket paths of every worker, in a fresh 0700 directory."""
    folder = runtime_dir()
    api = tuple(os.path.join(folder, f"api-{i}.sock") for i in range(count))
    admin = tuple(os.path.join(folder, f"admin-{i}.sock") for i in range(count))
    handoff = tuple(os.path.join(folder, f"handoff-{i}.sock") for i in range(count))
    return api, admin, handoff, folder


def _reserve(listen: str) -> tuple[socket.socket, str]:
    """Bind (not listen) the API address with ``SO_REUSEPORT``; returns it as ``host:port``."""
    host, port = parse_hostport(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port:
        # Without SO_REUSEPORT first: another process's SO_REUSEPORT group on this port (say a
        # second upshift of the same user) would otherwise silently share our connections.
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    return sock, (f"[{host}]:{bound}" if family == socket.AF_INET6 else f"{host}:{bound}")


async def _get(path: str, target: str, trust: Trust, timeout: float = _PROBE_TIMEOUT) -> tuple[int, bytes]:
    """``GET target`` over a worker's private admin socket (its listener checked first); (status, body)."""

    def check(sock: Any) -> None:
        check_peer(sock, trust)

    connector = CheckedUnixConnector(path, check, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.get(f"http://worker{target}", allow_redirects=False) as resp:
            return resp.status, await resp.read()


_PROBE_ERRORS = (OSError, TimeoutError, aiohttp.ClientError)


def merge_metrics(texts: Iterable[tuple[int, str]]) -> list[Metric]:
    """Families of several workers' expositions, every sample labelled ``worker``."""
    families: dict[str, Metric] = {}
    for index, text in texts:
        for family in text_string_to_metric_families(text):
            if family.name.removesuffix("_created") in _SUPERVISOR_FAMILIES:
                continue
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = {**sample.labels, "worker": str(index)}
                merged.samples.append(Sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar))
    return list(families.values())


class _Static:
    """A collector returning fixed families (one scrape's worth)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.started = 0.0
        self.failures = 0


class _Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.count = settings.workers
        self.api, self.admin, self.handoff, self.folder = _socket_names(self.count)
        self.trust = Trust(pids=self._pids)
        self.lifecycle = Lifecycle()
        self.workers = [_Worker(i) for i in range(self.count)]
        self.stopping = False
        self.reserved, listen = _reserve(settings.listen)
        self.worker_settings = dataclasses.replace(settings, listen=listen, workers=1)

    def _pids(self) -> frozenset[int]:
        """The workers running now (the only processes its probes talk to)."""
        return frozenset(w.proc.pid for w in self.workers if w.proc is not None and w.proc.returncode is None)

    async def _spawn(self, worker: _Worker) -> None:
        argv = (sys.executable, "-m", "proxy.supervisor")
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE)
        assert proc.stdin is not None
        spec = pickle.dumps(
            (self.worker_settings, worker.index, self.api, self.handoff, self.admin[worker.index], os.getpid())
        )
        proc.stdin.write(struct.pack(">Q", len(spec)) + spec)
        await proc.stdin.drain()  # stdin stays open: the worker drains when it closes
        worker.proc, worker.started = proc, time.monotonic()

    async def _keep(self, worker: _Worker) -> None:
        """Run one worker for the supervisor's lifetime, restarting it when it exits."""
        backoff = 0.1
        while not self.stopping:
            await self._spawn(worker)
            assert worker.proc is not None
            code = await worker.proc.wait()
            if self.stopping:
                return
            lived = time.monotonic() - worker.started
            backoff = 0.1 if lived > 30 else min(backoff * 2, _BACKOFF_MAX)
            WORKER_RESTARTS.inc()
            log.warning("worker %d exited (%s) after %.1f s; restart in %.1f s", worker.index, code, lived, backoff)
            await asyncio.sleep(backoff)

    async def _watchdog(self) -> None:
        """Kill a worker whose /healthz stopped answering (it is then restarted)."""
        while not self.stopping:
            await asyncio.sleep(_WATCHDOG_PERIOD)
            for worker, ok in zip(self.workers, await self._probe("/healthz"), strict=True):
                if ok or worker.proc is None or worker.proc.returncode is not None:
                    worker.failures = 0
                    continue
                if time.monotonic() - worker.started < _WATCHDOG_PERIOD * _WATCHDOG_FAILURES:
                    continue  # still starting
                worker.failures += 1
                if worker.failures >= _WATCHDOG_FAILURES and not self.stopping:
                    log.warning("worker %d stopped answering /healthz; killing it", worker.index)
                    with contextlib.suppress(ProcessLookupError):
                        worker.proc.kill()
                    worker.failures = 0

    async def _probe(self, target: str) -> list[bool]:
        async def one(path: str) -> bool:
            try:
                status, _ = await _get(path, target, self.trust)
            except _PROBE_ERRORS:
                return False
            return status == 200

        return list(await asyncio.gather(*(one(p) for p in self.admin)))

    # -- admin app -------------------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        alive = sum(1 for w in self.workers if w.proc is not None and w.proc.returncode is None)
        return web.json_response({"status": "ok", "workers_alive": alive, "workers": self.count})

    async def _readyz(self, request: web.Request) -> web.Response:
        ready = sum(await self._probe("/readyz"))
        WORKERS_READY.set(ready)
        if self.lifecycle.ready and ready == self.count:
            return web.json_response({"status": "ready", "workers_ready": ready})
        reason = "draining" if self.lifecycle.draining else "starting" if not self.lifecycle.ready else "workers"
        return web.json_response(
            {"status": "unavailable", "reason": reason, "workers_ready": ready, "workers": self.count}, status=503
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        async def scrape(index: int) -> tuple[int, str] | None:
            try:
                status, body = await _get(self.admin[index], "/metrics", self.trust)
            except _PROBE_ERRORS:
                return None
            return (index, body.decode()) if status == 200 else None

        scraped = [s for s in await asyncio.gather(*(scrape(i) for i in range(self.count))) if s is not None]
        WORKERS_READY.set(sum(await self._probe("/readyz")))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Static(merge_metrics(scraped)))
        own = [m for m in REGISTRY.collect() if m.name.removesuffix("_created") in _SUPERVISOR_FAMILIES]
        registry.register(_Static(own))
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(registry), headers={"Content-Type": content_type})

    def _admin_app(self) -> web.Application:
        s = self.settings
        app = web.Application(middlewares=[admin_host_guard(s.admin_listen, s.listener.allowed_hosts)])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        return app

    # -- run ---------------------------------------------------------------------------------------

    async def run(self) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        runner = web.AppRunner(
            self._admin_app(),
            access_log=None,
            handle_signals=False,
            keepalive_timeout=self.settings.listener.keepalive_seconds,
        )
        await runner.setup()
        host, port = parse_hostport(self.settings.admin_listen)
        try:
            # The API listener's limits (header deadline, connection bound) hold on every worker.
            await HardenedTCPSite(runner, host, port, Guard(self.settings.listener)).start()
        except OSError as exc:
            log.error("cannot listen: %s", exc)
            await runner.cleanup()
            return 1
        keepers = [asyncio.create_task(self._keep(w)) for w in self.workers]
        watchdog = asyncio.create_task(self._watchdog())
        log.info("upshift supervisor: %d workers on %s", self.count, self.worker_settings.listen)
        waiter = asyncio.create_task(stop.wait())
        while not stop.is_set():  # ready once every worker is
            if all(await self._probe("/readyz")):
                self.lifecycle.mark_ready()
                break
            await asyncio.wait([waiter], timeout=0.05)
        await waiter
        log.info("signal received, draining %d workers", self.count)
        self.lifecycle.mark_draining()
        self.stopping = True
        watchdog.cancel()
        for worker in self.workers:
            if worker.proc is not None and worker.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGTERM)
        deadline = self.settings.shutdown.grace_seconds + 10
        procs = [w.proc for w in self.workers if w.proc is not None]
        try:
            async with asyncio.timeout(deadline):
                await asyncio.gather(*(p.wait() for p in procs))
        except TimeoutError:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for task in keepers:
            task.cancel()
        await asyncio.gather(*keepers, watchdog, return_exceptions=True)
        await runner.cleanup()
        self.reserved.close()
        with contextlib.suppress(OSError):
            for name in os.listdir(self.folder):
                os.unlink(os.path.join(self.folder, name))
            os.rmdir(self.folder)
        return 0


def supervise(settings: Settings) -> int:
    """Run ``settings.workers`` workers until SIGTERM/SIGINT; the exit code.

    Raises:
        ConfigError: ``cluster.secret_file`` cannot be read (checked here, once, rather than
            by every worker in a restart loop).
    """
    if settings.cluster.secret_file:
        try:
            with open(settings.cluster.secret_file, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"cluster.secret_file: cannot read {settings.cluster.secret_file}: {exc}") from None
    try:
        supervisor = _Supervisor(settings)
    except OSError as exc:
        log.error("cannot listen: %s", exc)
        return 1
    return asyncio.run(supervisor.run())


# -- the worker side -------------------------------------------------------------------------------


async def _serve_worker(
    settings: Settings, index: int, sockets: tuple[str, ...], handoffs: tuple[str, ...], admin: str, supervisor: int
) -> int:
    from proxy.server import Server, serve  # the worker's side only: the supervisor needs no server

    placement = WorkerPlacement(index, sockets, handoffs, supervisor=supervisor)
    server = Server(settings, worker=placement, admin_path=admin)
    stop = asyncio.Event()

    class Orphaned(asyncio.Protocol):  # the supervisor's end of stdin closed: it is gone
        def connection_lost(self, exc: Exception | None) -> None:
            stop.set()

    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(Orphaned, os.fdopen(0, "rb", buffering=0, closefd=False))
    try:
        return await serve(server, name=f"worker {index}", stop=stop)
    finally:
        transport.close()


def _read_exactly(fd: int, size: int) -> bytes:
    chunks = []
    while size:
        chunk = os.read(fd, size)
        if not chunk:
            raise EOFError("the supervisor closed stdin before the worker spec")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _worker_main() -> int:
    (size,) = struct.unpack(">Q", _read_exactly(0, 8))
    spec: Any = pickle.loads(_read_exactly(0, size))  # from our own supervisor, over a pipe
    setup_logging(spec[0].logging)
    return run_loop(_serve_worker(*spec))


if __name__ == "__main__":
    sys.exit(_worker_main())
