"""``python -m proxy doctor`` as users start it, against the emulator in each of its shapes: lanes
and none, a socket cap, Azure's layout, upgrades refused, an egress proxy to a TLS upstream, and
through a running sidecar. In each the budget holds and the key is never printed."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.providers.support import Tinyproxy, TlsEmulator
from tests.sidecar import ROOT, Sidecar, SidecarProcess
from upshift_emulator import Emulator

KEY = "sk-doctor-7f3a9c1e5b"
CHECKS = ("http", "websocket", "continuation", "lanes", "store_false", "hydration", "compact", "service_tier")


async def doctor(*args: str, key: str | None = KEY, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``python -m proxy doctor ARGS``; its exit status and everything it wrote."""
    child = {k: v for k, v in os.environ.items() if not k.startswith(("UPSHIFT_", "OPENAI_", "SSL_CERT"))}
    child["PYTHONPATH"] = str(ROOT)
    if key is not None:
        child["OPENAI_API_KEY"] = key
    child.update(env or {})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "doctor", *args,
        cwd=ROOT, env=child, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    text = out.decode() + err.decode()
    for secret in (KEY, key):
        assert not secret or secret not in text, text
    return proc.returncode, text


async def doctor_json(*args: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    code, out = await doctor("--json", *args, **kwargs)
    doc = orjson.loads(out)
    assert isinstance(doc, dict), out
    for check in CHECKS:
        assert doc[check]["status"] in ("pass", "warn", "fail", "skip"), doc[check]
        assert isinstance(doc[check]["detail"], str) and doc[check]["detail"]
    limit = int(args[args.index("--max-requests") + 1]) if "--max-requests" in args else 12
    assert doc["requests_sent"] <= limit
    return code, doc


def serves_compact(emulator: Emulator) -> bool:
    """Whether the emulator has the standalone compaction route (else ``compact`` warns)."""
    return any(
        r.resource is not None and r.resource.canonical == "/v1/responses/compact" for r in emulator.app.router.routes()
    )


@dataclass(frozen=True)
class Seen:
    """One HTTP request the emulator received (an upgrade too)."""

    path: str
    api_version: str
    api_key: bool
    authorization: bool
    upgrade: bool


@asynccontextmanager
async def watched(**overrides: Any) -> AsyncIterator[tuple[Emulator, list[Seen]]]:
    """A started emulator, and every HTTP request it receives."""
    seen: list[Seen] = []

    @web.middleware
    async def record(request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        h = request.headers
        upgrade = h.get("Upgrade", "").lower() == "websocket"
        seen.append(
            Seen(request.path, request.query.get("api-version", ""), "api-key" in h, "Authorization" in h, upgrade)
        )
        return await handler(request)

    emulator = Emulator(**overrides)
    emulator.app.middlewares.append(record)
    await emulator.start()
    try:
        yield emulator, seen
    finally:
        await emulator.stop()


def sent_upstream(emulator: Emulator, seen: list[Seen]) -> int:
    """HTTP requests and WebSocket creates the emulator received."""
    return sum(not s.upgrade for s in seen) + int(emulator.stats.requests["ws"])


def assert_all_pass(emulator: Emulator, doc: dict[str, Any]) -> None:
    for check in CHECKS:
        want = "pass" if check != "compact" or serves_compact(emulator) else "warn"
        assert doc[check]["status"] == want, (check, doc[check])


async def test_with_lanes_every_check_passes() -> None:
    async with watched() as (emulator, seen):
        code, doc = await doctor_json("--upstream", emulator.base_url)
    assert code == 0
    assert_all_pass(emulator, doc)
    assert doc["lanes"]["supported"] is True
    cont = doc["continuation"]
    assert cont["full_first_event_ms"] > 0 and cont["continued_first_event_ms"] > 0
    assert doc["service_tier"] == {**doc["service_tier"], "requested": None, "served": "default"}
    stats = emulator.stats
    # socket A: first turn, its continuation (a cache hit), store:false and its continuation, the
    # lane; socket B: the stored continuation hydrated. Two sockets in all, never two at once.
    assert stats.ws_connections["opened"] == 2 and stats.ws_connections["refused"] == 0
    assert stats.cache_hits == 2 and stats.hydrations["ws"] == 1
    assert max(k.peak_open for k in stats.keys.values()) == 1
    assert doc["requests_sent"] == sent_upstream(emulator, seen) <= 12


async def test_lines_for_people(emulator: Emulator) -> None:
    code, out = await doctor("--upstream", emulator.base_url)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"upshift doctor: {emulator.base_url} (direct)")
    checks = [line.split()[1] for line in lines[1:-1]]
    assert checks == [
        "http",
        "websocket",
        "continuation",
        "lanes",
        "store_false",
        "hydration",
        "compact",
        "service_tier",
    ]
    assert all(line.split()[0] in ("PASS", "WARN") for line in lines[1:-1])
    assert "ms a turn on this network" in out and lines[-1].endswith("0 check(s) failed")


@pytest.mark.parametrize("mode", ["reject", "close"])
async def test_without_lanes_nothing_fails(mode: str) -> None:
    async with Emulator(ws_stream_ids=mode) as emulator:
        code, doc = await doctor_json("--upstream", emulator.base_url)
    assert code == 0
    lanes = doc["lanes"]
    assert lanes["supported"] is False and lanes["status"] == "warn"
    if mode == "reject":
        assert "unknown_parameter: Unknown parameter: 'stream_id'." in lanes["detail"]
        assert lanes["error"] == {
            "type": "invalid_request_error",
            "code": "unknown_parameter",
            "message": "Unknown parameter: 'stream_id'.",
            "param": "stream_id",
        }
    else:
        assert "1008" in lanes["detail"]
    assert all(doc[c]["status"] == "pass" for c in CHECKS if c not in ("lanes", "compact")), doc


async def test_a_socket_cap_of_one() -> None:
    """Never two sockets at once: an upstream that allows one socket per key passes everything."""
    async with Emulator(ws_max_connections_per_key=1, ws_connection_retry_after_s=0.2) as emulator:
        code, doc = await doctor_json("--upstream", emulator.base_url)
    assert code == 0
    assert_all_pass(emulator, doc)
    assert all(k.peak_open == 1 for k in emulator.stats.keys.values())
    assert emulator.stats.ws_connections["opened"] == 2


@pytest.mark.parametrize(("status", "attempts", "verdict"), [(403, 1, "fail"), (426, 1, "fail"), (429, 2, "warn")])
async def test_refused_upgrades(emulator: Emulator, status: int, attempts: int, verdict: str) -> None:
    """A proxy that blocks WebSocket answers the upgrade: ``websocket`` fails with its status,
    nothing that needs a socket is tried, the upgrade is not retried. A 429 (the key's sockets
    at the upstream's cap) is tried once more, then a warning: the way to the upstream works."""
    said = "WebSocket upgrades are not allowed by policy."
    emulator.faults.arm("refuse_upgrade", status=status, message=said, headers={"retry-after": "0"}, count=10)
    code, doc = await doctor_json("--upstream", emulator.base_url)
    assert code == (1 if verdict == "fail" else 0)
    ws = doc["websocket"]
    assert ws["status"] == verdict and ws["http_status"] == status
    assert f"refused with HTTP {status}: {said} (direct)" in ws["detail"]
    assert ws["hint"]
    assert doc["http"]["status"] == "pass"
    for check in ("continuation", "lanes", "store_false", "hydration"):
        assert doc[check]["status"] == "skip"
    assert doc["lanes"]["supported"] is None
    assert emulator.stats.ws_connections["refused"] == attempts and emulator.stats.requests["ws"] == 0


async def test_azure_layout() -> None:
    """``/openai/v1``, the key in ``api-key`` (no ``Authorization``), ``api-version`` on every
    request and on the upgrade."""
    async with watched(require_keys=(KEY,)) as (emulator, seen):
        upstream = emulator.url + "/openai/v1"
        args = ("--upstream", upstream, "--key-header", "api-key", "--api-version", "2025-04-01-preview")
        code, doc = await doctor_json(*args)
    assert code == 0
    assert_all_pass(emulator, doc)
    assert doc["websocket"]["detail"].startswith(
        f"upgraded on ws://127.0.0.1:{emulator.port}/openai/v1/responses?api-version=2025-04-01-preview"
    )
    assert sum(s.upgrade for s in seen) == 2 and doc["requests_sent"] == sent_upstream(emulator, seen)
    assert all(s.path.startswith("/openai/v1/responses") for s in seen), seen
    assert {(s.api_version, s.api_key, s.authorization) for s in seen} == {("2025-04-01-preview", True, False)}


async def test_through_an_egress_proxy_to_a_tls_upstream(tmp_path: Path) -> None:
    async with TlsEmulator(tmp_path) as tls, Tinyproxy(tmp_path) as proxy:
        env = {"UPSHIFT_EGRESS_PROXY": proxy.url, "UPSHIFT_EGRESS_CA_FILE": str(tls.ca_file)}
        code, doc = await doctor_json("--upstream", tls.base_url, env=env)
        connects = proxy.connects(tls.port)
    assert code == 0
    assert doc["websocket"]["status"] == "pass" and doc["http"]["status"] == "pass"
    assert f"via proxy {proxy.url}" in doc["websocket"]["detail"]
    assert_all_pass(tls.emulator, doc)
    # the HTTP session's connection and both sockets tunnelled through the proxy
    assert connects >= 3, proxy.log.read_text()


async def test_an_egress_proxy_that_refuses_the_connect(tmp_path: Path) -> None:
    """A company proxy that allows CONNECT to port 443 only: both transports fail, saying so."""
    async with TlsEmulator(tmp_path) as tls, Tinyproxy(tmp_path, connect_ports=(443,)) as proxy:
        env = {"UPSHIFT_EGRESS_PROXY": proxy.url, "UPSHIFT_EGRESS_CA_FILE": str(tls.ca_file)}
        code, doc = await doctor_json("--upstream", tls.base_url, env=env)
        refused = proxy.refused()
    assert code == 1
    for check in ("http", "websocket"):
        assert doc[check]["status"] == "fail" and "(HTTP 403 to CONNECT)" in doc[check]["detail"], doc[check]
        assert "egress.proxy" in doc[check]["hint"]
    assert refused == 2  # one CONNECT each, the upgrade not retried
    assert tls.emulator.stats.requests["http"] == 0


async def test_an_untrusted_certificate(tmp_path: Path) -> None:
    async with TlsEmulator(tmp_path) as tls:
        code, doc = await doctor_json("--upstream", tls.base_url, env={"UPSHIFT_EGRESS_PROXY": "off"})
    assert code == 1
    for check in ("http", "websocket"):
        assert doc[check]["status"] == "fail" and "certificate" in doc[check]["detail"].lower(), doc[check]
        assert "egress.ca_file" in doc[check]["hint"]
    assert tls.emulator.stats.ws_connections["opened"] == 0


async def test_via_a_running_sidecar(emulator: Emulator, spawn: Callable[..., SidecarProcess]) -> None:
    """``python -m proxy`` as deployed, in front of the doctor's upstream."""
    sidecar = spawn(emulator.base_url)
    async with aiohttp.ClientSession() as session:
        await sidecar.wait_ready(session)
    args = ("--upstream", emulator.base_url, "--via", sidecar.base_url, "--via-admin", sidecar.admin)
    code, doc = await doctor_json(*args)
    text_code, out = await doctor(*args)
    assert await sidecar.terminate() == 0
    assert code == 0 == text_code
    via = doc["via"]
    assert via["status"] == "pass", via
    assert via["first_turn"] == "full" and via["second_turn"] == "continuation"
    assert via["same_upstream"] is True and via["admin"]["readyz"] == "ready" and via["admin"]["version"]
    assert "through" in via["detail"] and "same upstream and credential" in via["detail"]
    assert doc["requests_sent"] == 12
    # The README shows such a run: its lines are the ones printed now, check by check.
    readme = (ROOT / "README.md").read_text()
    shown = readme[readme.index("```text\nupshift doctor: ") + 8 :]
    shown_lines = shown[: shown.index("```")].splitlines()
    assert [line.split()[1] for line in shown_lines[1:-1]] == [line.split()[1] for line in out.splitlines()[1:-1]]
    assert shown_lines[-1] == out.splitlines()[-1] == "12 of 12 requests sent; 0 check(s) failed"
    # Once the sidecar is gone, via says so.
    code, doc = await doctor_json(*args)
    assert code == 1 and doc["via"]["status"] == "fail" and "unreachable" in doc["via"]["detail"]
    assert doc["via"]["admin"]["readyz"] is None


async def test_via_a_sidecar_of_another_upstream(emulator: Emulator) -> None:
    """A sidecar whose upstream is not the doctor's: its responses are unknown there."""
    async with Emulator() as elsewhere, Sidecar(elsewhere.base_url) as sidecar:
        args = ("--upstream", emulator.base_url, "--via", sidecar.url, "--via-admin", sidecar.admin_url)
        code, doc = await doctor_json(*args)
    assert code == 1
    via = doc["via"]
    assert via["status"] == "fail" and via["same_upstream"] is False
    assert "another upstream or another credential" in via["detail"]
    assert via["second_turn"] == "continuation"


async def test_the_budget_stops_everything() -> None:
    async with watched() as (emulator, seen):
        code, doc = await doctor_json("--upstream", emulator.base_url, "--max-requests", "4")
    assert code == 0
    assert doc["requests_sent"] == 4 == sent_upstream(emulator, seen)
    assert [doc[c]["status"] for c in CHECKS[:3]] == ["pass"] * 3
    assert {doc[c]["status"] for c in CHECKS[3:7]} == {"skip"}


async def test_a_refused_key_fails_without_printing_it(emulator: Emulator) -> None:
    bad = "sk-bad-0123456789abcdef"
    code, out = await doctor("--upstream", emulator.base_url, key=bad)
    assert code == 1 and bad not in out
    assert "FAIL  http" in out and "HTTP 401" in out


async def test_service_tier_asked_and_served(emulator: Emulator) -> None:
    code, doc = await doctor_json("--upstream", emulator.base_url, "--service-tier", "flex", "--max-requests", "1")
    assert code == 0
    assert doc["service_tier"]["requested"] == "flex" and doc["service_tier"]["served"] == "flex"
    assert doc["service_tier"]["status"] == "pass"


async def test_a_service_tier_refused(emulator: Emulator) -> None:
    message = "Invalid value: 'ultrafast'. This model does not support the ultrafast service tier."
    emulator.faults.arm("error", status=400, param="service_tier", message=message, transport="http")
    args = ("--upstream", emulator.base_url, "--service-tier", "ultrafast", "--max-requests", "1")
    code, doc = await doctor_json(*args)
    assert code == 1
    assert doc["http"]["status"] == "pass" and "HTTP 400" in doc["http"]["detail"]
    tier = doc["service_tier"]
    assert tier["status"] == "fail" and message in tier["detail"]
    assert tier["requested"] == "ultrafast" and tier["served"] is None


async def test_an_injected_key_from_a_file(tmp_path: Path) -> None:
    """``api_key.source: file``: the key the sidecar would inject, read as the sidecar reads it."""
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    async with watched(require_keys=(KEY,)) as (emulator, seen):
        code, doc = await doctor_json("--upstream", emulator.base_url, "--api-key-file", str(key_file), key=None)
        assert code == 0
        assert_all_pass(emulator, doc)
    assert {s.authorization for s in seen} == {True}


async def test_no_key_is_a_usage_error(emulator: Emulator) -> None:
    code, out = await doctor("--upstream", emulator.base_url, key=None)
    assert code == 2 and "OPENAI_API_KEY is not set" in out
