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

__all__ = ["COMPILED", "GROUP", "ROOT", "build_kind", "compile_modules", "main", "remove_in_place"]

ROOT = Path(__file__).resolve().parent.parent
"""The directory that holds the ``proxy`` package (the repository, or site-packages)."""

COMPILED: tuple[str, ...] = (
    *(f"proxy.core.{name}" for name in (
        "affinity", "answer", "budget", "channel", "conversation", "creators", "demux", "explain", "fair",
        "fastparse", "fields", "headnotes", "heads", "items", "lanes", "named_ids", "patience", "placement",
        "planner", "plans", "prefixes", "rawjson", "request", "reseed", "retry", "rotation", "sideindex",
        "sizing", "socketcaps", "sockets", "sse",
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
interpreted code (mypyc/mypyc#671): a compiled module's dataclass built on a turn's path declares
``dataclass(init=False)`` and writes its own ``__init__`` (``object.__setattr__`` for a frozen one,
which mypyc turns into a plain store). ``tests/test_build.py`` finds one that does not."""

GROUP = "proxy._compiled"
"""mypyc's shared library (``proxy/_compiled__mypyc*.so``) holds the code of every compiled module;
each module's own ``.so`` is a shim that loads it. Inside the package, so that an editable install
finds it too."""


def build_kind() -> Build:
    """:attr:`Build.COMPILED` when the compiled modules were imported from extension modules (all
    or none: they are one library)."""
    path = getattr(sys.modules[Build.__module__], "__file__", None) or ""
    return Build.COMPILED if path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)) else Build.PURE


def _sources(root: Path) -> list[str]:
    return [str(root / (name.replace(".", "/") + ".py")) for name in COMPILED]


def compile_modules(root: Path, work: Path, *, in_place: bool) -> list[Path]:
    """Compile :data:`COMPILED` of the tree at ``root`` with mypyc; the built extension files.

    Args:
        root: The directory holding ``proxy/`` and ``pyproject.toml`` (mypy's settings).
        work: Scratch space for the generated C and object files.
        in_place: Put every extension next to its source (else under ``work/lib``).
    """
    from mypyc.build import mypycify

    # setuptools is imported by name: its types are not everywhere (and its own setup() would
    # re-read pyproject.toml, which older setuptools reject for the SPDX license string).
    dist_module: Any = importlib.import_module("setuptools.dist")
    here = os.getcwd()
    os.chdir(root)
    try:
        extensions = mypycify(_sources(root), opt_level="3", target_dir=str(work / "c"), group_name=GROUP)
        dist = dist_module.Distribution({"name": "upshift", "ext_modules": extensions})
        command = dist.get_command_obj("build_ext")
        command.inplace = in_place
        command.build_temp = str(work / "temp")
        command.build_lib = str(work / "lib")
        dist.run_command("build_ext")
        outputs: list[str] = command.get_outputs()
    finally:
        os.chdir(here)
    return _extensions(root) if in_place else [Path(p) for p in outputs]


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
