"""``python -m proxy demo``: runs offline, exits 0, and shows the savings it claims."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.ops.demo import LoopResult, format_table, tool_output

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^(?P<label>direct \(HTTP\)|through upshift)\s+(?P<turns>\d+)\s+(?P<bytes>[\d,]+)\s+(?P<cont>\d+)\s+")


def _rows(text: str) -> dict[str, tuple[int, int, int]]:
    rows: dict[str, tuple[int, int, int]] = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            rows[m["label"]] = (int(m["turns"]), int(m["bytes"].replace(",", "")), int(m["cont"]))
    return rows


@pytest.mark.timeout(60)
def test_demo_runs_and_shows_savings() -> None:
    turns = 5
    env = {k: v for k, v in os.environ.items() if not k.startswith("UPSHIFT_")}
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "demo", "--turns", str(turns), "--latency", "zero"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(done.stdout)
    assert set(rows) == {"direct (HTTP)", "through upshift"}, done.stdout
    direct_turns, direct_bytes, direct_cont = rows["direct (HTTP)"]
    side_turns, side_bytes, side_cont = rows["through upshift"]
    assert direct_turns == side_turns == turns
    assert 0 < side_bytes < direct_bytes, done.stdout
    assert direct_cont == 0
    assert side_cont >= turns - 1, done.stdout
    assert "speed-up:" in done.stdout


def test_table_parses_back() -> None:
    direct = LoopResult("direct (HTTP)", 5, 123_456, 0, 2.0)
    through = LoopResult("through upshift", 5, 23_456, 4, 1.0)
    text = format_table(direct, through)
    assert _rows(text) == {"direct (HTTP)": (5, 123_456, 0), "through upshift": (5, 23_456, 4)}
    assert "speed-up: 2.00x" in text and "saved: 81%" in text


def test_tool_output_size_and_determinism() -> None:
    assert len(tool_output(3, 4096)) == 4096
    assert tool_output(3, 4096) == tool_output(3, 4096) != tool_output(4, 4096)


def test_bad_arguments_are_usage_errors() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "demo", "--turns", "1"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2 and "--turns" in done.stderr
