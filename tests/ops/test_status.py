"""The status page and /misses on the admin app (aiohttp test client; the browser test is separate)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.core.explain import Detail, Explanation
from proxy.observe.health import Lifecycle, make_admin_app
from proxy.observe.misses import RECENT, MissRing
from proxy.observe.status import Sampler, render_status, snapshot
from proxy.reasons import MissReason

Client = TestClient[Any, Any]
MakeClient = Callable[..., Awaitable[Client]]


def _registry(lanes: bool) -> CollectorRegistry:
    reg = CollectorRegistry()
    requests = Counter("upshift_requests", "", ["route", "mode", "outcome"], registry=reg)
    requests.labels("responses", "continuation", "ok").inc(3)
    requests.labels("responses", "full", "ok").inc(1)
    Counter("upshift_continuation_misses", "", ["reason"], registry=reg).labels("diverged").inc()
    Histogram("upshift_added_latency_seconds", "", buckets=(0.001, 0.01), registry=reg).observe(0.0005)
    Gauge("upshift_upstream_sockets", "", ["state"], registry=reg).labels("open").set(2)
    if lanes:
        Gauge("upshift_upstream_lanes", "", ["state"], registry=reg).labels("busy").set(5)
    return reg


def test_page_shows_figures_and_lanes_only_when_exported() -> None:
    ring = MissRing(3)
    why = Explanation(MissReason.DIVERGED, 0, "message", "content[0].text", Detail.FIELD, 6, "ab12cd34")
    ring.add("diverged", 7, why)
    for lanes in (False, True):
        reg = _registry(lanes)
        sampler = Sampler(5.0, 60.0, reg)
        sampler.sample()
        page = render_status(list(sampler.samples), snapshot(reg), ring, "ready")
        assert re.search(r'id="continuations">3<', page)
        assert re.search(r'id="continuation-rate">75.0 %<', page)
        assert ("Upstream lanes" in page) is lanes
        assert "content[0].text" in page and "ab12cd34" in page
        assert "<script" not in page and 'http-equiv="refresh"' in page
        assert not re.search(r'(?:src|href)="(?!data:)', page)  # no external asset


def test_ring_is_bounded_newest_first() -> None:
    ring = MissRing(2)
    for n in range(3):
        ring.add("no_head", n, None)
    assert [m.items_in for m in ring.latest()] == [2, 1]
    assert ring.latest()[0].as_dict()["miss_item"] is None


async def test_admin_routes(aiohttp_client: MakeClient) -> None:
    lifecycle = Lifecycle()
    client = await aiohttp_client(make_admin_app(lifecycle))
    RECENT.clear()
    why = Explanation(MissReason.SETTINGS_CHANGED, None, None, "tools", Detail.SETTING, 2, "ffff0000")
    RECENT.add("settings_changed", 3, why)
    for path in ("/", "/status"):
        resp = await client.get(path)
        assert resp.status == 200 and resp.content_type == "text/html"
        assert "upshift status" in await resp.text()
    resp = await client.get("/misses?limit=1")
    body = await resp.json()
    assert body["misses"][0]["miss_field"] == "tools" and body["misses"][0]["identity"] == "ffff0000"
    assert (await client.post("/status")).status == 405
    RECENT.clear()
