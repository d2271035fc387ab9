"""Modules one can read in one sitting: no module of ``proxy/`` over 500 lines, and the two
classes every turn goes through, the planner and the pool, under 400; a README a newcomer reads
through (15 KB) and benchmark docs that hold the method and the latest results (25 KB; the
history is data under ``bench/results/``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.sidecar import ROOT

MODULE_LINES = 500
CLASS_LINES = 400
CLASSES = {"proxy/core/planner.py": "Planner", "proxy/upstream/pool.py": "Pool"}
DOC_BYTES = {"README.md": 15_000, "docs/benchmarks.md": 25_000}

MODULES = sorted((ROOT / "proxy").rglob("*.py"))


def test_modules_found() -> None:
    assert len(MODULES) > 50


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_over_the_limit(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines"


@pytest.mark.parametrize(("module", "name"), sorted(CLASSES.items()))
def test_the_planner_and_the_pool_stay_small(module: str, name: str) -> None:
    tree = ast.parse((ROOT / module).read_text())
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"{name} not found in {module}"
    cls = found[0]
    assert cls.end_lineno is not None
    lines = cls.end_lineno - cls.lineno + 1
    assert lines < CLASS_LINES, f"{name} has {lines} lines"


@pytest.mark.parametrize(("doc", "limit"), sorted(DOC_BYTES.items()))
def test_the_readme_and_the_benchmark_docs_stay_short(doc: str, limit: int) -> None:
    size = len((ROOT / doc).read_bytes())
    assert size <= limit, f"{doc} has {size} bytes (at most {limit})"
