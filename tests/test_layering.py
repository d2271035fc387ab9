"""Habits enforced: the sans-I/O core does no I/O, and the product never imports the emulator."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.sidecar import ROOT

FORBIDDEN_IN_CORE = {"asyncio", "aiohttp", "websockets", "socket", "time", "logging", "yaml", "prometheus_client"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.add("." * node.level + (node.module or ""))
    return found


CORE = sorted((ROOT / "proxy" / "core").glob("*.py"))
PRODUCT = sorted(p for p in (ROOT / "proxy").rglob("*.py") if "emulator" not in p.relative_to(ROOT / "proxy").parts)


def test_files_found() -> None:
    assert len(CORE) >= 10 and len(PRODUCT) > len(CORE)


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_core_imports_no_io(path: Path) -> None:
    bad = {name for name in _imports(path) if name.split(".")[0] in FORBIDDEN_IN_CORE}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(ROOT)))
def test_product_never_imports_the_emulator(path: Path) -> None:
    if path.name == "demo.py":
        pytest.skip("the demo starts the emulator on purpose (a separate child process)")
    bad = {name for name in _imports(path) if "emulator" in name}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_emulator_never_imports_the_sidecars_matching_code() -> None:
    for path in (ROOT / "proxy" / "emulator").rglob("*.py"):
        names = _imports(path)
        bad = {n for n in names if n.startswith(("proxy.core", "proxy.upstream.pool", "proxy.serve.handlers"))}
        assert not bad, f"{path.name} imports {sorted(bad)}"
