"""The admin listener answers no web page and stays off the LAN by default: a DNS-rebound page
(a ``Host`` naming the page's own domain) gets 403 on every path, while the kubelet's probes and
Prometheus (an IP address), ``localhost`` and ``listener.allowed_hosts`` names are answered; the
default address is loopback outside Kubernetes and the pod IP's wildcard inside it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import aiohttp
import orjson
import pytest
import yaml

from tests.security.ingress import body, openai_error, started
from tests.security.support import start_process
from tests.sidecar import ROOT, SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(90)

PATHS = ("/", "/status", "/misses", "/metrics", "/healthz", "/readyz")


async def _get(http: aiohttp.ClientSession, side: SidecarProcess, path: str, host: str) -> tuple[int, bytes]:
    async with http.get(side.admin + path, headers={"Host": host}) as resp:
        return resp.status, await resp.read()


@pytest.mark.parametrize("workers", [1, 2], ids=["process", "supervisor"])
async def test_a_rebound_host_gets_nothing_from_the_admin_listener(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], workers: int
) -> None:
    # With --workers the supervisor owns the admin listener (its own app): the same check.
    env = {"UPSHIFT_LISTENER_ALLOWED_HOSTS": "upshift.internal"}
    side = await start_process(spawn, emulator.base_url, "--workers", str(workers), env=env)
    paths = PATHS if workers == 1 else ("/healthz", "/readyz", "/metrics")
    port = side.admin.rpartition(":")[2]
    async with aiohttp.ClientSession() as http:
        async with http.post(side.base_url + "/responses", data=body("hello"), headers={"Authorization": "Bearer k"}):
            pass
        # The attack: a page of rebind.evil.example, resolved to 127.0.0.1, reads the status page,
        # the misses and the metrics of the user's sidecar.
        for host in (
            f"rebind.evil.example:{port}",
            "rebind.evil.example",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
        ):
            for path in paths:
                status, data = await _get(http, side, path, host)
                assert status == 403, (host, path, status, data[:200])
                openai_error(data, "host_not_allowed")
        # The control: loopback names, any IP address (the kubelet probes and Prometheus scrapes
        # name the pod IP), and a listed name are answered.
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"10.1.2.3:{port}", "[fd00::7]:9090",
                     f"upshift.internal:{port}"):  # fmt: skip
            for path in paths:
                status, data = await _get(http, side, path, host)
                assert status == 200, (host, path, status, data[:200])
            assert orjson.loads((await _get(http, side, "/healthz", host))[1])["status"] == "ok"


def _admin_listen(**env: str) -> str:
    child = {k: v for k, v in os.environ.items() if not k.startswith(("UPSHIFT_", "OPENAI_", "KUBERNETES_"))}
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "--print-config"],
        cwd=ROOT,
        env={**child, **env},
        capture_output=True,
        timeout=30,
        check=True,
    )
    return str(yaml.safe_load(out.stdout)["admin_listen"])


def test_the_admin_listener_is_loopback_by_default_outside_kubernetes() -> None:
    # The attack: the laptop quickstart's admin listener was on 0.0.0.0, readable from the LAN.
    assert _admin_listen() == "127.0.0.1:9090"
    assert _admin_listen(UPSHIFT_CONFIG=str(ROOT / "config.yaml")) == "127.0.0.1:9090"
    # The control: in a Pod (KUBERNETES_SERVICE_HOST is set in every container) the kubelet's
    # probes reach the pod IP; an explicit setting (what the manifests set) always wins.
    assert _admin_listen(KUBERNETES_SERVICE_HOST="10.96.0.1") == "0.0.0.0:9090"
    assert _admin_listen(KUBERNETES_SERVICE_HOST="10.96.0.1", UPSHIFT_ADMIN_LISTEN="0.0.0.0:9191") == "0.0.0.0:9191"
    assert _admin_listen(UPSHIFT_ADMIN_LISTEN="0.0.0.0:9090") == "0.0.0.0:9090"


async def test_a_loopback_admin_listener_in_a_pod_is_said_at_startup(
    emulator: Emulator, spawn: Callable[..., SidecarProcess]
) -> None:
    # A Deployment of its own that keeps config.yaml's loopback admin_listen: its probes would
    # fail with nothing in the log to say why.
    side = await started(spawn, emulator.base_url, KUBERNETES_SERVICE_HOST="10.96.0.1")
    assert "UPSHIFT_ADMIN_LISTEN=0.0.0.0:" in side.logs(), side.logs()
    outside = await started(spawn, emulator.base_url, KUBERNETES_SERVICE_HOST="")
    assert "UPSHIFT_ADMIN_LISTEN" not in outside.logs()
