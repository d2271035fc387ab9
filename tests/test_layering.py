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


# -- the layers of proxy/ --------------------------------------------------------------------------

PACKAGES: dict[str, tuple[str, ...]] = {
    "root": ("proxy.cli", "proxy.server", "proxy.supervisor", "proxy.__main__", "proxy.build"),
    "ops": ("proxy.ops",),
    "ingress": ("proxy.ingress",),
    "serve": ("proxy.serve",),
    "upstream": ("proxy.upstream",),
    "intake": ("proxy.intake",),
    "observe": ("proxy.observe",),
    "core": ("proxy.core",),
    "wire": ("proxy.wire",),
    "base": ("proxy", "proxy.errors", "proxy.reasons", "proxy.config", "proxy.config_load", "proxy.config_check",
             "proxy.redact", "proxy.contracts",
             "proxy.kernel", "proxy.loop"),
}  # fmt: skip
"""The packages of ``proxy/``, highest first: a package is a directory, except the top-level
modules, split into the composition root (``root``: it builds and starts everything) and the
base every package may use (errors, labels, settings, the library seams)."""

CHART: dict[str, tuple[str, ...]] = {
    "root": ("ingress", "ops"),
    "ops": ("upstream",),
    "ingress": ("serve",),
    "serve": ("upstream",),
    "upstream": ("intake", "observe", "wire"),
    "intake": ("observe",),
    "observe": ("core",),
    "core": ("base",),
    "wire": (),
    "base": (),
}
"""docs/architecture.md's allowed imports: an arrow ``a -> b`` means a may import b and whatever
b may import. Nothing else is allowed; in particular no arrow goes up, and ``wire`` imports
nothing of ours."""

DESCRIBED = {
    "root": "cli · server · supervisor (the composition root)",
    "ops": "ops/ (the commands)<br/>doctor · explain · demo · refdocs",
    "ingress": "ingress/<br/>listener · front · reception · cluster · handoff",
    "serve": "serve/<br/>handlers · streaming · record · relay · memory",
    "upstream": "upstream/<br/>ws · pool · passthrough · egress",
    "intake": "intake/<br/>identity · keys · body · memory",
    "observe": "observe/<br/>metrics · log · health · status · misses",
    "core": "core/ (sans-I/O)",
    "wire": "wire/ (sans-I/O codecs)",
    "base": "errors · reasons · config · redact · contracts · loop",
}


def package_of(module: str) -> str:
    """The package ``module`` belongs to (the longest prefix named in :data:`PACKAGES`)."""
    best, length = "", -1
    for package, prefixes in PACKAGES.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = package, len(prefix)
    assert best, f"{module} is in no package of PACKAGES"
    return best


def allowed(package: str) -> set[str]:
    """The packages ``package`` may import: what the chart reaches from it."""
    seen: set[str] = set()
    todo = list(CHART[package])
    while todo:
        nxt = todo.pop()
        if nxt not in seen:
            seen.add(nxt)
            todo.extend(CHART[nxt])
    return seen


def chart() -> str:
    """The Mermaid chart of docs/architecture.md, drawn from :data:`CHART`."""
    lines = ["```mermaid", "flowchart TD"]
    for package, label in DESCRIBED.items():
        lines.append(f'    {package}["{label}"]')
    for package, below in CHART.items():
        lines.extend(f"    {package} --> {b}" for b in below)
    lines.append("```")
    return "\n".join(lines)


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
PACKAGE_GRAPH: dict[str, set[str]] = {package: set() for package in PACKAGES}
for _module, _imported in GRAPH.items():
    PACKAGE_GRAPH[package_of(_module)] |= {package_of(m) for m in _imported} - {package_of(_module)}

CORE_MAY_IMPORT = {"proxy.errors", "proxy.reasons", "proxy.redact"}
"""Of the base, the core takes errors and labels only: no settings, no library seams, no loop."""


def test_the_graph_sees_lazy_imports() -> None:
    assert "proxy.server" in GRAPH["proxy.supervisor"]  # inside _serve_worker
    assert "proxy.ops.demo" in GRAPH["proxy.cli"]  # importlib.import_module("proxy.ops.demo")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("proxy.core")))
def test_core_imports_no_shell_module(module: str) -> None:
    bad = {m for m in GRAPH[module] if not m.startswith("proxy.core.") and m not in CORE_MAY_IMPORT}
    assert not bad, f"{module} imports {sorted(bad)}"


def test_every_module_is_in_a_package_of_the_chart() -> None:
    assert set(PACKAGES) == set(CHART) == set(DESCRIBED)
    for module in MODULES:
        package_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_import_goes_down_the_chart(module: str) -> None:
    """docs/architecture.md's allowed imports, at package level, for every import of ``proxy``
    (lazy ones included)."""
    mine = package_of(module)
    bad = sorted(m for m in GRAPH[module] if package_of(m) != mine and package_of(m) not in allowed(mine))
    assert not bad, f"{module} ({mine}) imports {bad}: not below it in the chart"


def test_no_package_level_circle() -> None:
    cycles = _cycles(PACKAGE_GRAPH)
    assert not cycles, "package circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_chart_itself_has_no_circle() -> None:
    graph = {package: set(below) for package, below in CHART.items()}
    assert not _cycles(graph)
    assert all(package not in allowed(package) for package in CHART)


def test_the_package_check_finds_a_circle() -> None:
    """upstream taking identity from serve (serve imports upstream) was a circle."""
    graph = {k: set(v) for k, v in PACKAGE_GRAPH.items()}
    graph["upstream"].add("serve")
    assert any({"upstream", "serve"} <= set(c) for c in _cycles(graph))
    assert "serve" not in allowed("upstream")


def test_the_architecture_doc_shows_the_chart() -> None:
    """Regenerate with ``python tests/test_layering.py --write``."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    start = doc.index("<!-- layers -->\n") + len("<!-- layers -->\n")
    end = doc.index("\n<!-- /layers -->")
    assert doc[start:end] == chart(), "regenerate: python tests/test_layering.py --write"


def test_the_walk_ranks_the_layers_as_the_chart() -> None:
    """bench.walk counts a call into a higher layer as an upward call: its order of layers must
    put every package above what it may import."""
    from bench.walk import LAYERS

    def rank(package: str) -> int:
        prefixes = PACKAGES[package]
        return next(i for i, names in enumerate(LAYERS) if set(prefixes) & set(names))

    for package, below in CHART.items():
        for b in below:
            assert rank(package) > rank(b), f"bench.walk.LAYERS ranks {package} not above {b}"


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


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_layering.py --write  (redraws docs/architecture.md's chart)")
    path = ROOT / "docs" / "architecture.md"
    text = path.read_text()
    head, tail = text.index("<!-- layers -->\n") + len("<!-- layers -->\n"), text.index("\n<!-- /layers -->")
    path.write_text(text[:head] + chart() + text[tail:])
