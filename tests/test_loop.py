"""Which event loop runs: uvloop where installed, asyncio otherwise; reported everywhere."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path

from proxy.loop import loop_name, run

ROOT = Path(__file__).resolve().parent.parent


def test_loop_name_follows_what_is_installed() -> None:
    want = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    assert loop_name() == want


def test_run_uses_that_loop() -> None:
    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    module = run(which())
    assert module.startswith("uvloop") == (loop_name() == "uvloop")


def test_version_names_the_loop() -> None:
    out = subprocess.run([sys.executable, "-m", "proxy", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and f"({loop_name()} event loop," in out.stdout
