"""Operable sidecar, end to end: probes, metrics, drain on SIGTERM, no credentials in logs, docs.

The sidecar runs as a real subprocess (``python -m proxy``) on port 0; its ports are read from
the process's listening sockets (psutil), so parallel test runs never race for a port. The
upstream is the in-process emulator on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

import proxy.observe.metrics
from proxy.build import build_kind
from proxy.config_load import env_name, setting_keys
from proxy.loop import loop_name
from proxy.ops.demo import run_agent_loop
from proxy.reasons import MissReason, PassthroughReason
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator, LatencyModel

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus exposition (0 if absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


async def _scrape(session: aiohttp.ClientSession, sidecar: SidecarProcess) -> str:
    async with session.get(sidecar.admin + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


# -- probes and metrics --------------------------------------------------------------------------


async def test_probes_and_metrics_follow_traffic(
    emulator: Emulator, spawn: Any, session: aiohttp.ClientSession
) -> None:
    sc = spawn(emulator.base_url)
    await sc.wait_ready(session)
    async with session.get(sc.admin + "/healthz") as resp:
        assert resp.status == 200
    async with session.get(sc.admin + "/readyz") as resp:
        assert resp.status == 200 and (await resp.json())["status"] == "ready"
    # The probes live on the admin listener only.
    async with session.get(sc.api + "/readyz") as resp:
        assert resp.status == 404

    before = await _scrape(session, sc)
    assert await run_agent_loop(sc.base_url, turns=2, tool_output_kb=2) == 2
    after = await _scrape(session, sc)

    cont = {"route": "responses", "mode": "continuation", "outcome": "ok"}
    full = {"route": "responses", "mode": "full", "outcome": "ok"}
    assert _sample(after, "upshift_requests_total", **cont) - _sample(before, "upshift_requests_total", **cont) == 1
    assert _sample(after, "upshift_requests_total", **full) - _sample(before, "upshift_requests_total", **full) == 1
    ws = {"transport": "websocket"}
    sent = _sample(after, "upshift_upstream_bytes_sent_total", **ws) - _sample(
        before, "upshift_upstream_bytes_sent_total", **ws
    )
    received = _sample(after, "upshift_request_bytes_total") - _sample(before, "upshift_request_bytes_total")
    # Both turns went upstream, and the continuation sent less than the app did.
    assert 0 < sent < received
    misses = "upshift_continuation_misses_total"
    assert _sample(after, misses, reason="no_head") - _sample(before, misses, reason="no_head") == 1
    assert _sample(after, "upshift_input_items_avoided_total") > _sample(before, "upshift_input_items_avoided_total")
    assert _sample(after, "upshift_inflight_requests") == 0
    assert _sample(after, "upshift_upstream_sockets", state="idle") >= 1
    # The emulator agrees: one continuation arrived over WebSocket.
    assert emulator.stats.continuations["ws"] == 1
    # Which build runs (pure, or compiled in the compiled CI run): the metric and the startup line.
    assert _sample(after, "upshift_build_info", build=build_kind(), loop=loop_name()) == 1
    assert f"{loop_name()} event loop, {build_kind()} build" in sc.logs()

    assert await sc.terminate() == 0


# -- SIGTERM with a stream in flight -------------------------------------------------------------


async def _read_stream(resp: aiohttp.ClientResponse, events: list[tuple[float, str]]) -> None:
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            events.append((time.monotonic(), orjson.loads(line[5:])["type"]))


async def test_sigterm_drains_in_flight_stream(spawn: Any, session: aiohttp.ClientSession) -> None:
    # ~100 output tokens at 50 tokens/s: the stream lasts about 2 s.
    async with Emulator(latency=LatencyModel(tokens_per_second=50.0)) as emulator:
        sc = spawn(emulator.base_url, env={"UPSHIFT_SHUTDOWN_GRACE_SECONDS": "15"})
        await sc.wait_ready(session)
        body = {"model": "gpt-6.1-sol", "input": "tell me a story reply_bytes=400", "stream": True}
        headers = {"Authorization": "Bearer sk-drain-test"}
        async with session.post(sc.base_url + "/responses", json=body, headers=headers) as resp:
            assert resp.status == 200
            events: list[tuple[float, str]] = []
            reader = asyncio.create_task(_read_stream(resp, events))
            while not any(kind == "response.output_text.delta" for _, kind in events):
                assert not reader.done(), events
                await asyncio.sleep(0.01)
            sc.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()

            # Draining: /readyz fails (the admin listener stays up), the API stops accepting.
            ready_status, not_ready_at = 200, 0.0
            while time.monotonic() - signalled < 1.5:
                async with session.get(sc.admin + "/readyz") as probe:
                    ready_status = probe.status
                if ready_status == 503:
                    not_ready_at = time.monotonic()
                    break
                await asyncio.sleep(0.02)
            assert ready_status == 503, "/readyz did not fail during the drain"
            refused = False
            while not refused and time.monotonic() - signalled < 1.5:
                try:
                    async with session.get(sc.api + "/v1/models", headers=headers):
                        pass
                except aiohttp.ClientConnectionError:
                    refused = True
                else:
                    await asyncio.sleep(0.02)
            assert refused, "the API listener still accepted connections during the drain"

            await asyncio.wait_for(reader, 15)
        kinds = [kind for _, kind in events]
        assert kinds[-1] == "response.completed", kinds[-5:]
        completed_at = events[-1][0]
        # The stream really was in flight while the sidecar was draining.
        assert not_ready_at < completed_at
        assert completed_at - signalled > 0.5
        assert sum(1 for t, kind in events if t > signalled and kind == "response.output_text.delta") >= 5
        assert await sc.wait(15) == 0, sc.logs()


async def test_drain_is_bounded_by_grace(spawn: Any, session: aiohttp.ClientSession) -> None:
    grace = 1.0
    # ~200 output tokens at 50 tokens/s: the stream would last about 4 s, well past the grace.
    async with Emulator(latency=LatencyModel(tokens_per_second=50.0)) as emulator:
        sc = spawn(emulator.base_url, env={"UPSHIFT_SHUTDOWN_GRACE_SECONDS": str(grace)})
        await sc.wait_ready(session)
        body = {"model": "gpt-6.1-sol", "input": "tell me a long story reply_bytes=800", "stream": True}
        headers = {"Authorization": "Bearer sk-drain-test"}
        async with session.post(sc.base_url + "/responses", json=body, headers=headers) as resp:
            events: list[tuple[float, str]] = []
            reader = asyncio.create_task(_read_stream(resp, events))
            while not any(kind == "response.output_text.delta" for _, kind in events):
                assert not reader.done(), events
                await asyncio.sleep(0.01)
            sc.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            # At the end of the grace the stream ends with one error event (then a clean end).
            await asyncio.wait_for(reader, 15)
        cut_after = time.monotonic() - signalled
        assert await sc.wait(15) == 0, sc.logs()
    assert events[-1][1] == "error", events[-3:]
    assert cut_after < grace + 0.6, f"in-flight stream cut {cut_after:.2f} s after SIGTERM (grace {grace} s)"


# -- credentials never reach the logs ------------------------------------------------------------


async def _ws_turn(session: aiohttp.ClientSession, sc: SidecarProcess, key: str) -> None:
    """One turn over the WebSocket relay (``GET /v1/responses`` upgrade)."""
    url = sc.base_url.replace("http://", "ws://") + "/responses"
    async with session.ws_connect(url, headers={"Authorization": f"Bearer {key}"}) as ws:
        await ws.send_str(orjson.dumps({"type": "response.create", "model": "gpt-6.1-sol", "input": "hi"}).decode())
        while True:
            msg = await ws.receive(timeout=10)
            assert msg.type == aiohttp.WSMsgType.TEXT, msg
            kind = orjson.loads(msg.data)["type"]
            if kind in ("error", "response.failed"):
                raise AssertionError(msg.data)
            if kind == "response.completed":
                return


def _assert_no_secret(logs: str, *secrets_: str) -> None:
    for secret in secrets_:
        # The whole value, and any 12-character piece of its random part.
        pieces = {secret} | {secret[-24:][i : i + 12] for i in range(0, 13, 4)}
        for piece in pieces:
            assert piece not in logs, f"credential material {piece!r} in the sidecar's logs"


async def test_no_authorization_value_in_logs_passthrough(
    emulator: Emulator, spawn: Any, session: aiohttp.ClientSession
) -> None:
    sk_key = "sk-proj-" + secrets.token_hex(16)
    plain_key = "upshiftsecret" + secrets.token_hex(16)  # not sk-shaped: the redactor's regex misses it
    bad_key = "sk-bad-" + secrets.token_hex(16)
    sc = spawn(emulator.base_url, "--log-level", "debug")
    await sc.wait_ready(session)
    await run_agent_loop(sc.base_url, turns=3, tool_output_kb=1, api_key=sk_key)
    for key in (sk_key, plain_key):
        auth = {"Authorization": f"Bearer {key}"}
        async with session.post(
            sc.base_url + "/responses", json={"model": "gpt-6.1-sol", "input": "hi"}, headers=auth
        ) as r:
            assert r.status == 200, await r.text()
        async with session.get(sc.base_url + "/models", headers=auth) as r:
            assert r.status == 200
        # An upstream 400 (unknown parameter) and an HTTP passthrough (background).
        async with session.post(
            sc.base_url + "/responses", json={"model": "gpt-6.1-sol", "bogus": 1}, headers=auth
        ) as r:
            assert r.status == 400
        bg = {"model": "gpt-6.1-sol", "input": "hi", "background": True}
        async with session.post(sc.base_url + "/responses", json=bg, headers=auth) as r:
            assert r.status == 200, await r.text()
        await _ws_turn(session, sc, key)
    async with session.post(
        sc.base_url + "/responses",
        json={"model": "gpt-6.1-sol", "input": "hi"},
        headers={"Authorization": f"Bearer {bad_key}"},
    ) as r:
        assert r.status == 401
    assert await sc.terminate() == 0
    logs = sc.logs()
    access = [line for line in logs.splitlines() if '"upshift.access"' in line]
    assert len(access) >= 10, logs[-2000:]  # the scan below saw real request logs
    _assert_no_secret(logs, sk_key, plain_key, bad_key)
    assert not re.search(r"(?i)bearer\s+(?!\[redacted\])\S", logs)


async def test_no_key_in_logs_with_key_file(spawn: Any, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    real_key = "sk-file-" + secrets.token_hex(16)
    key_file = tmp_path / "api-key"
    key_file.write_text(real_key + "\n")
    # The emulator accepts only the real key: a 200 proves the sidecar injected it.
    async with Emulator(require_keys=(real_key,)) as emulator:
        sc = spawn(emulator.base_url, "--api-key-file", str(key_file), "--log-level", "debug")
        await sc.wait_ready(session)
        await run_agent_loop(sc.base_url, turns=3, tool_output_kb=1, api_key="sk-placeholder")
        auth = {"Authorization": "Bearer sk-placeholder"}
        async with session.get(sc.base_url + "/models", headers=auth) as r:
            assert r.status == 200
        await _ws_turn(session, sc, "sk-placeholder")
        assert emulator.stats.continuations["ws"] == 2
        assert await sc.terminate() == 0
    logs = sc.logs()
    assert '"upshift.access"' in logs
    _assert_no_secret(logs, real_key)


# -- CLI -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--help"], ["--listen", "--admin-listen", "--upstream", "--config", "--api-key-file", "demo"]),
        (["demo", "--help"], ["--turns", "--tool-output-kb", "--latency"]),
    ],
)
def test_cli_help(args: list[str], expected: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "proxy", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    for word in expected:
        assert word in done.stdout


# -- the docs document every key, metric and fallback reason -----------------------------------


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _doc(relative: str) -> str:
    return (ROOT / relative).read_text(encoding="utf-8")


def _table_row(text: str, name: str) -> str:
    """The Markdown table row that documents ``name`` (in backticks, first cell)."""
    for line in text.splitlines():
        if line.startswith(f"| `{name}`"):
            return line
    raise AssertionError(f"{name} has no row")


@pytest.mark.parametrize("key", setting_keys())
def test_configuration_reference_documents_key(key: str) -> None:
    row = _table_row(_doc("docs/reference/configuration.md"), key)
    assert f"`{env_name(key)}`" in row


def _metrics() -> list[MetricWrapperBase]:
    return [m for m in vars(proxy.observe.metrics).values() if isinstance(m, MetricWrapperBase)]


def test_metrics_found() -> None:
    assert len(_metrics()) == len(proxy.observe.metrics.__all__) - 2  # everything but REGISTRY and LABEL_VALUES


@pytest.mark.parametrize("metric", _metrics(), ids=lambda m: str(m._name))
def test_metrics_reference_documents_metric(metric: MetricWrapperBase) -> None:
    exposed = metric._name + ("_total" if metric._type == "counter" else "")
    row = _table_row(_doc("docs/reference/metrics.md"), exposed)
    for label in metric._labelnames:
        assert f"`{label}`" in row, f"label {label} of {exposed}"


def _fallback_reasons() -> set[str]:
    return set(MissReason) | set(PassthroughReason)


def test_fallback_reasons_found() -> None:
    assert {"no_head", "app_chained", "background", "oversize", "pool_full"} <= _fallback_reasons()


@pytest.mark.parametrize("reason", sorted(_fallback_reasons()))
def test_operations_documents_fallback_reason(reason: str) -> None:
    _table_row(_doc("docs/operations.md"), reason)


def test_readme_quickstart_matches_ci() -> None:
    readme = _readme()
    test_cmd = "python -m pip install -c tests/constraints.txt -e '.[test]' && python -m pytest"
    assert test_cmd in readme
    # .ci/run runs the very same command line.
    ci = (ROOT / ".ci/run").read_text().splitlines()
    assert test_cmd in ci
    assert "python -m proxy demo" in readme
    assert "<!-- bench-figures -->" in readme
    # A newcomer's page: what it is, how to run it, links to the rest.
    assert len(readme.encode()) <= 15 * 1024
    for page in ("docs/operations.md", "docs/reference/configuration.md", "docs/reference/metrics.md"):
        assert f"]({page})" in readme, page
