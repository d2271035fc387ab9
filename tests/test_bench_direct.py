"""bench.direct runs a condition end to end and reports both sides (not its figures: those are
the benchmark's, on a quiet machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(200)
def test_direct_and_through_upshift_run_the_same_workload(tmp_path: Path) -> None:
    out = tmp_path / "direct.json"
    args = ["--conditions", "store-false,refused", "--conversations", "6", "--turns", "3", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.direct", *args], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {row["condition"]: row for row in json.loads(out.read_text())}
    for row in rows.values():
        assert row["direct_errors"] == 0 and row["upshift"]["errors"] == 0, row
        assert sum(row["upshift"]["modes"].values()) == 18, row  # every turn answered
        assert row["upshift_added_ms_p99"] is not None and row["sidecar_cpu_s"] > 0, row
        assert row["floor_http"]["errors"] == 0 and row["floor_http_cpu_s"] > 0, row  # the bare HTTP hop
        for side in (row["direct"], row["upshift"], row["floor_http"]):  # first turns and later turns apart
            assert 0 < side["first_turn_ms_p50"] and 0 < side["later_turn_ms_p50"], row
    # Every upgrade refused: no turn went over a socket; each first turn over plain HTTP, its
    # answer adopted, and the later turns continued over plain HTTP.
    assert rows["refused"]["upshift"]["modes"] == {"passthrough": 6, "continuation": 12}, rows["refused"]
