"""Which build runs (pure Python or compiled with mypyc), and the command that compiles in place.

The pure build is the default and the reference: ``pip install .`` needs no compiler. The compiled
build turns the modules a turn spends its time in (:data:`COMPILED`: the sans-I/O core, the frame
and SSE codecs and the serving shells a turn runs through) into C extensions with mypyc; they
behave the same and cost less CPU (docs/benchmarks.md). Two ways to get it:

- ``UPSHIFT_COMPILE=1 pip install .`` (or ``-e .``): the build hook (``hatch_build.py``) puts the
  extensions in the wheel (an editable install: next to the sources, as below).
- ``python -m proxy.build``: compiles in place, each ``.so`` next to its ``.py`` (Python's import
  system prefers an extension module over the source beside it); ``python -m proxy.build
  --clean`` removes them. An in-place build goes stale when a source changes: build again.

:func:`build_kind` reads which one was imported; ``--version``, the startup line and
``upshift_build_info{build=...}`` report it.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from proxy.reasons import Build

__all__ = [
    "COMPILED",
    "GROUP",
    "ROOT",
    "Unsupported",
    "build_kind",
    "compile_modules",
    "main",
    "native_inits",
    "remove_in_place",
]

ROOT = Path(__file__).resolve().parent.parent
"""The directory that holds the ``proxy`` package (the repository, or site-packages)."""

COMPILED: tuple[str, ...] = (
    *(f"proxy.core.{name}" for name in (
        "affinity", "answer", "budget", "channel", "conversation", "creators", "demux", "explain",
        "fastparse", "fields", "headnotes", "heads", "items", "lanes", "named_ids", "patience", "placement",
        "planner", "plans", "prefixes", "rawjson", "request", "reseed", "retry", "rotation", "sideindex",
        "sizing", "socketcaps", "sockets", "tenants", "tickets",
    )),
    "proxy.reasons",  # every label, beside the errors it names
    "proxy.wire.sse",
    "proxy.wire.wsframe",
    # The shells a turn runs through (the budget table of docs/benchmarks.md).
    "proxy.core.explainer",
    *(f"proxy.intake.{name}" for name in ("identity", "memory", "meter", "sysmem")),
    *(f"proxy.ingress.{name}" for name in ("front", "reception")),
    *(f"proxy.serve.{name}" for name in (
        "creator_check", "handlers", "inflight", "record", "streaming",
    )),
)  # fmt: skip
"""The modules the compiled build compiles. Modules that tests fault-inject into stay interpreted
or offer a seam of their own (e.g. :attr:`proxy.core.sockets.SocketBook.on_step`): a monkeypatched
module function never reaches compiled callers.

Left interpreted on purpose (mypyc 1.x cannot keep their behaviour): ``proxy.ingress.listener``
(subclasses aiohttp's ``RequestHandler``, which has ``__slots__``), ``proxy.upstream.pool`` and
``proxy.upstream.ws`` (kept in ``WeakSet`` registries; native instances take no weak reference),
``proxy.observe.log`` (compiled, the interpreter crashed at shutdown when its handlers were torn down),
and every module holding an async generator or a subclass of a builtin exception (mypyc refuses
the first and drops class attributes of the second: those live in ``proxy.errors``).

mypyc keeps what the ``dataclasses`` module generates (``__init__``, ``__eq__``, ``__repr__``) as
interpreted code (mypyc/mypyc#671): every instance of a compiled module's dataclass would run an
interpreted ``__init__``. The sources stay plain dataclasses: the build compiles a copy of the tree
in which :func:`native_inits` wrote each of those dataclasses the ``__init__`` that ``dataclasses``
would have generated, as a method mypyc compiles (``tests/test_build.py`` checks that the two
agree, and that no interpreted one runs on a turn)."""

GROUP = "proxy._compiled"
"""mypyc's shared library (``proxy/_compiled__mypyc*.so``) holds the code of every compiled module;
each module's own ``.so`` is a shim that loads it. Inside the package, so that an editable install
finds it too."""


def build_kind() -> Build:
    """:attr:`Build.COMPILED` when the compiled modules were imported from extension modules (all
    or none: they are one library)."""
    path = getattr(sys.modules[Build.__module__], "__file__", None) or ""
    return Build.COMPILED if path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)) else Build.PURE


class Unsupported(Exception):
    """A dataclass :func:`native_inits` leaves to ``dataclasses`` (it says why)."""


def _is_call_to(node: ast.expr, name: str) -> bool:
    func = node.func if isinstance(node, ast.Call) else node
    return (isinstance(func, ast.Name) and func.id == name) or (isinstance(func, ast.Attribute) and func.attr == name)


def _const(node: ast.expr) -> object:
    if not isinstance(node, ast.Constant):
        raise Unsupported(f"a non-constant dataclass option: {ast.unparse(node)}")
    return node.value


def _admits_none(ann: ast.expr) -> bool:
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return _admits_none(ann.left) or _admits_none(ann.right)
    head = ann.value if isinstance(ann, ast.Subscript) else ann
    return ast.unparse(head).rsplit(".", 1)[-1] in ("None", "Optional", "Any", "object", "Union")


def _init_def(cls: ast.ClassDef, frozen: bool) -> str:
    """The one-line ``__init__`` that ``dataclasses`` would generate for ``cls``."""
    if cls.bases or cls.keywords:
        raise Unsupported("a base class")
    params: list[str] = []
    body: list[str] = []
    used = {"object", "self"}
    names: set[str] = set()
    for stmt in cls.body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        name, ann = stmt.target.id, stmt.annotation
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            ann = ast.parse(ann.value, mode="eval").body
        kind = ast.unparse(ann)
        if kind.startswith(("ClassVar", "typing.ClassVar")):
            continue
        if kind.startswith(("InitVar", "KW_ONLY", "dataclasses.")):
            raise Unsupported(f"field {name}: {kind}")
        names.add(name)
        init, default, factory = True, stmt.value, None
        if stmt.value is not None and _is_call_to(stmt.value, "field"):
            call = stmt.value
            assert isinstance(call, ast.Call)
            if call.args:
                raise Unsupported(f"field {name}: positional field() arguments")
            default = None
            for kw in call.keywords:
                if kw.arg == "init":
                    init = bool(_const(kw.value))
                elif kw.arg == "default":
                    default = kw.value
                elif kw.arg == "default_factory":
                    factory = ast.unparse(kw.value)
                    used.update(n.id for n in ast.walk(kw.value) if isinstance(n, ast.Name))
                elif kw.arg not in ("repr", "compare", "hash", "metadata"):
                    raise Unsupported(f"field {name}: field({kw.arg}=...)")
        if not init:
            value = f"{factory}()" if factory else None if default is None else ast.unparse(default)
        elif factory is not None:
            if _admits_none(ann):
                raise Unsupported(f"field {name}: a default_factory for a type that holds None")
            params.append(f"{name}: {kind} | None = None")
            value = f"{factory}() if {name} is None else {name}"
        else:
            params.append(f"{name}: {kind}" + ("" if default is None else f" = {ast.unparse(default)}"))
            value = name
        if value is not None:
            body.append(f'object.__setattr__(self, "{name}", {value})' if frozen else f"self.{name} = {value}")
    if names & used:
        raise Unsupported(f"a field named like a name its __init__ uses: {sorted(names & used)}")
    methods = {s.name for s in cls.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)}
    if "__post_init__" in methods:
        body.append("self.__post_init__()")
    return f"def __init__({', '.join(['self', *params])}) -> None: {'; '.join(body) or 'pass'}"


def native_inits(source: str, skipped: list[str] | None = None) -> str:
    """``source`` with every dataclass that lets ``dataclasses`` write its ``__init__`` given that
    ``__init__`` as a method of its own (and ``init=False``), so that mypyc compiles it.

    The method is what ``dataclasses`` generates: each field in order, a default as written, a
    ``default_factory`` called when its argument is ``None``, ``field(init=False)`` set from its
    default, ``object.__setattr__`` for a frozen class, ``__post_init__`` last. It is one line, in
    place of the blank line after the class, so every other line keeps its number (tracebacks).
    A dataclass it cannot write exactly (a base class, ``InitVar``, ``kw_only``, a factory for a
    type that holds ``None``) keeps the interpreted one, its name and reason appended to
    ``skipped``.
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, str, ast.ClassDef, ast.expr]] = []
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for deco in cls.decorator_list:
            if not _is_call_to(deco, "dataclass"):
                continue
            options = {kw.arg: kw.value for kw in deco.keywords} if isinstance(deco, ast.Call) else {}
            methods = {s.name for s in cls.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)}
            try:
                if "init" in options or "__init__" in methods:
                    break
                if (isinstance(deco, ast.Call) and deco.args) or "kw_only" in options:
                    raise Unsupported("dataclass arguments it does not read")
                frozen = "frozen" in options and bool(_const(options["frozen"]))
                edits.append((cls.lineno, _init_def(cls, frozen), cls, deco))
            except Unsupported as why:
                if skipped is not None:
                    skipped.append(f"{cls.name}: {why}")
            break
    for _, method, cls, deco in sorted(edits, key=lambda edit: edit[0], reverse=True):
        indent = " " * cls.body[0].col_offset
        after = cls.end_lineno or cls.lineno  # the index of the line after the class
        line = indent + method + "\n"
        if after < len(lines) and not lines[after].strip():
            lines[after] = line
        else:
            lines.insert(after, line)
        if isinstance(deco, ast.Call):
            row, col = deco.func.end_lineno or deco.lineno, deco.func.end_col_offset or 0
            text = lines[row - 1]
            opening = text.index("(", col) + 1
            lines[row - 1] = text[:opening] + "init=False, " + text[opening:]
        else:
            row = deco.end_lineno or deco.lineno
            text = lines[row - 1]
            end = deco.end_col_offset or 0
            lines[row - 1] = text[:end] + "(init=False)" + text[end:]
    return "".join(lines)


def _native_tree(root: Path, into: Path) -> list[str]:
    """Copy the sources mypyc reads (``proxy/`` and ``pyproject.toml``, mypy's settings) from
    ``root`` to ``into``, the compiled modules through :func:`native_inits`; what it skipped."""
    built = (f"*{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES)
    shutil.copytree(root / "proxy", into / "proxy", ignore=shutil.ignore_patterns("__pycache__", *built))
    shutil.copy(root / "pyproject.toml", into / "pyproject.toml")
    skipped: list[str] = []
    for name in COMPILED:
        path = Path(*name.split(".")).with_suffix(".py")
        found: list[str] = []
        (into / path).write_text(native_inits((root / path).read_text(), found))
        skipped += [f"{name}.{why}" for why in found]
    return skipped


def compile_modules(root: Path, work: Path, *, in_place: bool) -> list[Path]:
    """Compile :data:`COMPILED` of the tree at ``root`` with mypyc; the built extension files.

    mypyc reads a copy of the sources under ``work`` whose dataclasses carry their ``__init__``
    (:func:`native_inits`); the tree at ``root`` is never written but for the extensions.

    Args:
        root: The directory holding ``proxy/`` and ``pyproject.toml`` (mypy's settings).
        work: Scratch space for the copy, the generated C and object files.
        in_place: Put every extension next to its source under ``root`` (else under ``work/lib``).
    """
    from mypyc.build import mypycify

    # setuptools is imported by name: its types are not everywhere (and its own setup() would
    # re-read pyproject.toml, which older setuptools reject for the SPDX license string).
    dist_module: Any = importlib.import_module("setuptools.dist")
    tree = work / "src"
    for skipped in _native_tree(root, tree):
        print(f"left to dataclasses (an interpreted __init__): {skipped}", file=sys.stderr)
    here = os.getcwd()
    os.chdir(tree)
    try:
        # Relative paths: what a compiled traceback names.
        sources = [str(Path(*name.split(".")).with_suffix(".py")) for name in COMPILED]
        extensions = mypycify(sources, opt_level="3", target_dir=str(work / "c"), group_name=GROUP)
        dist = dist_module.Distribution({"name": "upshift", "ext_modules": extensions})
        command = dist.get_command_obj("build_ext")
        command.build_temp = str(work / "temp")
        command.build_lib = str(work / "lib")
        dist.run_command("build_ext")
        outputs = [Path(p) for p in command.get_outputs()]
    finally:
        os.chdir(here)
    if not in_place:
        return outputs
    for built in outputs:
        shutil.copy(built, root / built.relative_to(work / "lib"))  # a new mtime: newer than its source
    return _extensions(root)


def _extensions(root: Path) -> list[Path]:
    found = {p for suffix in importlib.machinery.EXTENSION_SUFFIXES for p in (root / "proxy").rglob(f"*{suffix}")}
    return sorted(found)


def remove_in_place(root: Path) -> list[Path]:
    """Delete the extension modules an in-place build left under ``root/proxy``."""
    gone = _extensions(root)
    for path in gone:
        path.unlink()
    return gone


def main(argv: list[str] | None = None) -> int:
    """``python -m proxy.build [--clean]``: compile in place (or remove what that left)."""
    parser = argparse.ArgumentParser(prog="python -m proxy.build", description=__doc__.splitlines()[0])
    parser.add_argument("--clean", action="store_true", help="remove the compiled modules instead")
    parser.add_argument("--root", type=Path, default=ROOT, help="tree holding proxy/ (default: this one)")
    args = parser.parse_args(argv)
    root: Path = args.root.resolve()
    removed = remove_in_place(root)
    if args.clean:
        print(f"removed {len(removed)} compiled modules; the pure build runs")
        return 0
    if importlib.util.find_spec("mypyc") is None:
        print("python -m proxy.build needs mypy (pip install -e '.[dev]') and a C compiler", file=sys.stderr)
        return 2
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="upshift-mypyc-"))
    try:
        built = compile_modules(root, work, in_place=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"compiled {len(COMPILED)} modules ({len(built)} extension files) in {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
