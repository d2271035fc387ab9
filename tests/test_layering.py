"""Habits enforced: the sans-I/O core does no I/O, and the product and the emulator (the package
``upshift_emulator`` beside ``proxy``) never import each other."""

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
PRODUCT = sorted((ROOT / "proxy").rglob("*.py"))
EMULATOR = sorted((ROOT / "upshift_emulator").rglob("*.py"))


def test_files_found() -> None:
    assert len(CORE) >= 10 and len(PRODUCT) > len(CORE)
    assert len(EMULATOR) >= 10


def test_nothing_of_the_emulator_is_inside_the_product() -> None:
    """The emulator is a package of its own beside ``proxy``: no module of it, nor a leftover
    directory, is under ``proxy/`` (the product's modules are what the compiled build and the
    image take)."""
    inside = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proxy").rglob("*") if "emulator" in p.name)
    assert not inside, inside


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_core_imports_no_io(path: Path) -> None:
    bad = {name for name in _imports(path) if name.split(".")[0] in FORBIDDEN_IN_CORE}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(ROOT)))
def test_product_never_imports_the_emulator(path: Path) -> None:
    """The demo (proxy/ops/demo.py) runs the emulator too, but as a child process by its command
    (``python -m upshift_emulator``), never by an import: a deployment without it still imports
    every module of ``proxy``."""
    bad = {name for name in _imports(path) if "emulator" in name}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_demo_starts_the_emulator_by_its_command() -> None:
    source = (ROOT / "proxy" / "ops" / "demo.py").read_text()
    assert '"-m", "upshift_emulator"' in source


@pytest.mark.parametrize("path", EMULATOR, ids=lambda p: str(p.relative_to(ROOT)))
def test_emulator_never_imports_the_sidecar(path: Path) -> None:
    """The emulator is the oracle the sidecar is tested against: its own implementation of the
    protocol and of client echo. Sharing the sidecar's code (above all its matching code,
    ``proxy.core``) would let one bug pass on both sides."""
    names = _imports(path)
    bad = {n for n in names if n.split(".")[0] == "proxy"}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
    outside = {n for n in names if n.startswith("..")}
    assert not outside, f"{path.relative_to(ROOT)} reaches outside its package: {sorted(outside)}"


# -- the layers of proxy/ (issue 19) -----------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in (ROOT / "proxy").rglob("*.py")}


def _edges(name: str) -> set[str]:
    """Every proxy module ``name`` imports: at the top, inside functions (lazy), or by
    ``importlib.import_module("...")`` with a literal name."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called == "import_module" and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _edges(name) for name in MODULES}
SHELLS = ("proxy.ingress", "proxy.serve", "proxy.upstream", "proxy.ops")
SHELL_TOPS = {"proxy.server", "proxy.cli", "proxy.loop", "proxy.config", "proxy.contracts", "proxy.__main__"}


def _is_shell(module: str) -> bool:
    return module in SHELL_TOPS or module.startswith(tuple(s + "." for s in SHELLS)) or module in SHELLS


def test_the_graph_sees_lazy_imports() -> None:
    assert "proxy.server" in GRAPH["proxy.supervisor"]  # inside _serve_worker
    assert "proxy.ops.demo" in GRAPH["proxy.cli"]  # importlib.import_module("proxy.ops.demo")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("proxy.core")))
def test_core_imports_no_shell_module(module: str) -> None:
    bad = {m for m in GRAPH[module] if _is_shell(m) or m.startswith("proxy.wire")}
    assert not bad, f"{module} imports {sorted(bad)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("proxy.wire")))
def test_wire_imports_neither_core_nor_shells(module: str) -> None:
    bad = {m for m in GRAPH[module] if not m.startswith("proxy.wire")}
    assert not bad, f"{module} imports {sorted(bad)}"
    names = {n for n in _imports(MODULES[module]) if not n.startswith(_SANS_IO_LIBRARY)}
    third = {n.split(".")[0] for n in names} - {"__future__", "dataclasses", "proxy"}
    assert not third & {"asyncio", "aiohttp", "websockets", "socket"}, f"{module}: a codec does no I/O"


_SANS_IO_LIBRARY = ("websockets.frames", "websockets.protocol", "websockets.exceptions", "websockets.extensions")
"""websockets' own sans-I/O layer (frames, the protocol state machine): a codec may build on it;
its asyncio client and server may not be imported by a codec."""


CLUSTER_WING = {
    "proxy.ingress.cluster",
    "proxy.ingress.forward",
    "proxy.ingress.handoff",
    "proxy.ingress.peerauth",
    "proxy.supervisor",
}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("proxy.ingress")))
def test_only_ingress_imports_the_cluster_handoff_or_workers(module: str) -> None:
    bad = GRAPH[module] & CLUSTER_WING
    if module == "proxy.cli":
        bad -= {"proxy.supervisor"}  # the command line chooses the supervisor or the server
    if module == "proxy.supervisor":
        bad -= {"proxy.ingress.cluster"}  # the workers' places in the cluster
    assert not bad, f"{module} imports {sorted(bad)} (go through proxy.ingress.front)"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycle_anywhere_in_proxy() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_the_old_circle() -> None:
    """server.py importing workers (lazily, for --workers) as workers imports server was a circle."""
    graph = {k: set(v) for k, v in GRAPH.items()}
    graph["proxy.server"].add("proxy.supervisor")
    found = _cycles(graph)
    assert any({"proxy.server", "proxy.supervisor"} <= set(c) for c in found), found
