"""The status page in a real headless browser (Debian's chromium, driven by Selenium).

The demo's agent loop runs through an in-process sidecar (plus two explained misses); the page
is loaded in headless chromium, which must render it with non-zero continuations, the chart and
the explained misses. The screenshot is kept as a test artifact in ``build/artifacts/`` (or
``$UPSHIFT_ARTIFACTS``). Without chromium the test is skipped locally and fails in CI.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.observe.health import SAMPLER_KEY
from proxy.ops.demo import run_agent_loop
from tests.sidecar import ROOT, Sidecar
from upshift_emulator import Emulator

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
ARTIFACTS = Path(os.environ.get("UPSHIFT_ARTIFACTS", ROOT / "build" / "artifacts"))


def _browser_or_skip() -> tuple[str, str]:
    if CHROMIUM is None or DRIVER is None:
        if os.environ.get("CI"):
            pytest.fail("chromium and chromedriver are required in CI (.ci/run installs them)")
        pytest.skip("chromium / chromedriver not installed (apt-get install chromium chromium-driver)")
    pytest.importorskip("selenium")
    return CHROMIUM, DRIVER


def _load(url: str, shot: Path, chromium: str, driver: str) -> dict[str, Any]:
    """Open ``url`` in headless chromium, save a screenshot, return what the page shows."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1500",
    ):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    try:
        browser.get(url)
        shown = {
            "title": browser.title,
            "continuations": browser.find_element(By.ID, "continuations").text,
            "rate": browser.find_element(By.ID, "continuation-rate").text,
            "chart_lines": len(browser.find_elements(By.CSS_SELECTOR, "#chart polyline")),
            "misses": [row.text for row in browser.find_elements(By.CSS_SELECTOR, "#misses tr")][1:],
            "external": browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)"),
        }
        shot.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(shot))
        return shown
    finally:
        browser.quit()


async def test_status_page_renders_in_headless_chromium(emulator: Emulator) -> None:
    chromium, driver = _browser_or_skip()
    async with Sidecar(emulator.base_url) as sc:
        sampler = sc.server._admin.app[SAMPLER_KEY]
        for _ in range(3):  # three demo loops, a chart sample after each
            await run_agent_loop(sc.base_url, turns=6, tool_output_kb=4)
            sampler.sample()
        await _explained_misses(sc.base_url)
        sampler.sample()
        shot = ARTIFACTS / "status-page.png"
        shown = await asyncio.to_thread(_load, sc.admin_url + "/status", shot, chromium, driver)
    assert shown["title"] == "upshift status"
    assert int(shown["continuations"].replace(" k", "")) > 0
    assert shown["rate"].endswith("%") and shown["rate"] != "0.0 %"
    assert shown["chart_lines"] >= 2  # continuations and at least one miss reason
    assert any("diverged" in row and "content[0].text" in row for row in shown["misses"]), shown["misses"]
    assert shown["external"] == []  # no asset loaded from anywhere
    assert shot.stat().st_size > 10_000


async def _explained_misses(base_url: str) -> None:
    """Two misses an operator would want explained: an edited first message, changed tools."""
    url = base_url + "/responses"
    headers = {"Authorization": "Bearer sk-upshift-demo-not-a-real-key"}
    first = [{"role": "user", "content": "Look at the repository. steps=1"}]
    body: dict[str, Any] = {"model": "gpt-6.1-sol", "input": first, "store": False, "tools": _TOOLS}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.post(url, json=body) as resp:
            output = (await resp.json())["output"]
        call = output[-1]
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}
        edited = [{"role": "user", "content": "Look at the repository again. steps=1"}, *output, result]
        async with session.post(url, json={**body, "input": edited}) as resp:
            assert resp.status == 200
        async with session.post(url, json={**body, "input": [*first, *output, result], "tools": []}) as resp:
            assert resp.status in (200, 400)


_TOOLS = [{"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}]
