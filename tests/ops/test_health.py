"""Admin app: /healthz, /readyz across the lifecycle, /metrics, nothing else."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from proxy.observe import metrics
from proxy.observe.health import Lifecycle, State, make_admin_app

Client = TestClient[Any, Any]
MakeClient = Callable[..., Awaitable[Client]]


@pytest.fixture
async def lifecycle_client(aiohttp_client: MakeClient) -> tuple[Lifecycle, Client]:
    lifecycle = Lifecycle()
    return lifecycle, await aiohttp_client(make_admin_app(lifecycle))


async def test_healthz_in_every_state(lifecycle_client: tuple[Lifecycle, Client]) -> None:
    lifecycle, client = lifecycle_client
    steps: list[Callable[[], None]] = [lambda: None, lifecycle.mark_ready, lifecycle.mark_draining]
    for step in steps:
        step()
        resp = await client.get("/healthz")
        assert resp.status == 200
        assert await resp.json() == {"status": "ok"}


async def test_readyz_transitions(lifecycle_client: tuple[Lifecycle, Client]) -> None:
    lifecycle, client = lifecycle_client

    resp = await client.get("/readyz")
    assert resp.status == 503
    assert await resp.json() == {"status": "unavailable", "reason": "starting"}

    lifecycle.mark_ready()
    resp = await client.get("/readyz")
    assert resp.status == 200
    assert await resp.json() == {"status": "ready"}

    lifecycle.mark_draining()
    resp = await client.get("/readyz")
    assert resp.status == 503
    assert await resp.json() == {"status": "unavailable", "reason": "draining"}

    lifecycle.mark_ready()  # draining is final
    assert (await client.get("/readyz")).status == 503


def test_lifecycle_flags() -> None:
    lifecycle = Lifecycle()
    assert (lifecycle.state, lifecycle.ready, lifecycle.draining) == (State.STARTING, False, False)
    lifecycle.mark_ready()
    assert (lifecycle.state, lifecycle.ready, lifecycle.draining) == (State.READY, True, False)
    lifecycle.mark_draining()
    assert (lifecycle.state, lifecycle.ready, lifecycle.draining) == (State.DRAINING, False, True)
    assert repr(lifecycle) == "<Lifecycle draining>"


async def test_metrics_reflect_increments(lifecycle_client: tuple[Lifecycle, Client]) -> None:
    _, client = lifecycle_client
    sample = 'upshift_errors_total{code="test_health_metrics"}'

    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=")
    assert sample not in await resp.text()

    metrics.ERRORS.labels(code="test_health_metrics").inc(2)
    text = await (await client.get("/metrics")).text()
    assert f"{sample} 2.0" in text
    assert "# TYPE upshift_errors_total counter" in text
    metrics.ERRORS.remove("test_health_metrics")  # the registry is shared: no made-up code left behind


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/responses"), ("GET", "/debug"), ("POST", "/status")])
async def test_nothing_else(lifecycle_client: tuple[Lifecycle, Client], method: str, path: str) -> None:
    _, client = lifecycle_client
    assert (await client.request(method, path)).status in (404, 405)


async def test_probes_take_no_writes(lifecycle_client: tuple[Lifecycle, Client]) -> None:
    _, client = lifecycle_client
    assert (await client.post("/readyz")).status == 405
