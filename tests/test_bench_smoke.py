"""`python -m bench --quick` runs A, B and C end to end and writes a well-formed report.

No timing is asserted (shared, noisy machines): only that every setup ran, that the sidecar
used continuations and that it sent fewer bytes upstream than the full-history app.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(200)
def test_quick_bench_runs_and_reports(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    reports = list(tmp_path.glob("*-quick.json"))
    assert len(reports) == 1, list(tmp_path.iterdir())
    report = json.loads(reports[0].read_text())
    for comparison in report["comparisons"]:
        a, b, c = comparison["A"], comparison["B"], comparison["C"]
        assert a["error_count"] == b["error_count"] == c["error_count"] == 0
        assert b["modes"].get("continuation", 0) >= b["turns_per_rollout"] - 1  # all but each first turn
        assert b["upstream_bytes_total"] < a["upstream_bytes_total"]
        assert b["client_bytes_total"] == a["client_bytes_total"]  # same app, same bytes sent
    assert all(o["modes"] == {"continuation": o["turns"]} for o in report["overhead"])
    # The bare relay (bench.floor) ran the same sizes beside the sidecar, continuing its chains.
    for name in ("floor", "floor_aiohttp"):
        assert all(o[name]["turns"] > 0 and o[name]["cpu_ms_per_request"] > 0 for o in report["overhead"])
    assert {t["target"] for t in report["targets"]}, "targets are reported"
    # The docs are only rewritten by a full run.
    assert not (tmp_path / "benchmarks.md").exists()


@pytest.mark.timeout(200)
def test_ab_compares_a_commit_with_the_working_tree(tmp_path: Path) -> None:
    """`python -m bench.ab`: the base commit runs from its own worktree (removed afterwards)."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: bench.ab needs the base commit")
    before = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    out = tmp_path / "ab.json"
    argv = [sys.executable, "-m", "bench.ab", "--base", "HEAD", "--sizes", "1k", "--rounds", "2", "--reps", "10",
            "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    row = json.loads(out.read_text())["sizes"]["1k"]
    for side in ("A", "B"):
        assert len(row[side]["cpu_rounds"]) == 2 and all(c > 0 for c in row[side]["cpu_rounds"])
    assert row["B_over_A_cpu"] > 0 and "1k: CPU/turn A" in proc.stdout
    after = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert after == before  # the base worktree is gone
