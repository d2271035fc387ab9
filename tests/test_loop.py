"""Which event loop runs: uvloop where installed, asyncio otherwise; reported everywhere."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import subprocess
import sys
from pathlib import Path

from proxy.loop import YOUNG_THRESHOLD, loop_name, run

ROOT = Path(__file__).resolve().parent.parent


def test_loop_name_follows_what_is_installed() -> None:
    want = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    assert loop_name() == want


def test_run_uses_that_loop() -> None:
    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    module = run(which())
    assert module.startswith("uvloop") == (loop_name() == "uvloop")


def test_run_collects_the_young_generation_less_often_and_restores_it() -> None:
    async def threshold() -> tuple[int, int, int]:
        return gc.get_threshold()

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)  # CPython's default
        assert run(threshold()) == (YOUNG_THRESHOLD, 10, 10)
        assert gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(50_000, 5, 5)  # a process that chose its own keeps it
        assert run(threshold()) == (50_000, 5, 5)
    finally:
        gc.set_threshold(*before)


def test_version_names_the_loop() -> None:
    out = subprocess.run([sys.executable, "-m", "proxy", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and f"({loop_name()} event loop," in out.stdout
